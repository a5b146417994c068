"""Ray Serve application and the vLLM KV connector.

Import :mod:`tessera_ray.serve.app` for the HTTP app (it imports Ray Serve, so it is not
imported here)."""
