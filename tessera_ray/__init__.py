"""tessera-ray: a distributed KV-cache tier for Ray, for MLA and hybrid-compressed attention."""

__version__ = "0.1.0"

__all__ = ["__version__"]
