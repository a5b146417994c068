"""Thin Ray shells over the core classes: pool actors, the sharded directory, the client.

The four modules that import Ray live here (``pool_actor``, ``directory_actor``, ``deploy``,
which starts them, and ``_ray_handles``, the boundary every call goes through); everything else
is testable without Ray. A pool's verbs are written once in ``pool_api``.
"""
