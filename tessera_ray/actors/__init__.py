"""Thin Ray shells over the core classes: pool actors, the sharded directory, the client.

The four modules that import Ray live here (``pool_actor``, ``directory_actor``, ``client`` and
``_ray_handles``, the boundary they call through); everything below them is testable without Ray.
"""
