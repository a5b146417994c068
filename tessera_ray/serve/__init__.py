"""The Ray Serve side of the tier: the HTTP app (:mod:`~tessera_ray.serve.app`), Ray Serve LLM
deployments with the tier's connector (:mod:`~tessera_ray.serve.llm`), and the prefix-aware
router in front of them (:mod:`~tessera_ray.serve.router`, decisions in
:mod:`~tessera_ray.serve.routing`). They import Ray Serve, so none is imported here. The vLLM
connector itself is :mod:`tessera_ray.vllm`.
"""
