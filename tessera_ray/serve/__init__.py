"""Ray Serve application and the vLLM KV connector.

Import :mod:`tessera_ray.serve.app` for the HTTP app (it imports Ray Serve, so it is not
imported here), and :mod:`tessera_ray.serve.connector` for the vLLM connector (vLLM loads it by
module path; it imports vLLM only when vLLM asks for the connector class).
"""
