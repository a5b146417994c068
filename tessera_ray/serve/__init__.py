"""Ray Serve application and the vLLM KV connector."""
