"""The record behind a reservation or a pin (private to the pool service)."""

from __future__ import annotations

from dataclasses import dataclass

from tessera_ray.core import PageHandle

__all__ = ["Lease"]


@dataclass(slots=True)
class Lease:
    handles: list[list[list[PageHandle]]]
    """Per block, per layer group, the page handles the lease holds a reference on."""
    expires_at_s: float
    namespace: str = ""
