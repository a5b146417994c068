"""Thin Ray shells over the core classes: pool actors, the sharded directory, the client.

The one module that makes ``ray.*`` calls lives here; everything below it is testable without Ray.
"""
