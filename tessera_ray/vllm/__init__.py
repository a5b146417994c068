"""The vLLM v1 KV connector: vLLM engines read and write their prefix KV through the tier.

vLLM loads :mod:`~tessera_ray.vllm.connector` by module path. By job:

- ``connector``: the entry vLLM names, and the public names (config, records); imports vLLM only
  when vLLM asks for the connector class (``adapter``, the thin translation of vLLM's objects).
- ``scheduler`` (the scheduler side's planner), ``request_state`` (what it keeps per request),
  ``records`` (the per-step plan the workers carry out), ``keys`` (token keys and block hashes).
- ``worker`` (moving blocks between vLLM's cache and the tier; ``loads``: what a step's load
  verified), ``planes`` and
  ``attention_backends`` (a layer of vLLM's cache as one row per token).
- ``backend`` (what the connector needs of the tier, and its failure type), ``tiers`` (the
  in-process tier, and opening a backend by config), ``ray_tier`` (the running tier on Ray),
  ``nixl_reader`` (the worker's NIXL reads from its node's pool), ``loop`` (the event-loop
  thread the backends run on).
- ``config`` (the one validated configuration), ``stats`` (what the connector costs and moved).
"""
