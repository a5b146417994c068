"""The process's count of transport fallbacks: a wanted way of moving pages was unavailable and
another carried them (exported as ``tessera_transport_fallbacks_total``).

Its own module because both the chooser (:mod:`~tessera_ray.transport.factory`) and every
transport (a same-node peer whose memory cannot be mapped) count here.
"""

from __future__ import annotations

import threading

__all__ = ["count_fallback", "fallback_counts"]

_lock = threading.Lock()
_fallbacks: dict[tuple[str, str, str], int] = {}


def fallback_counts() -> dict[tuple[str, str, str], int]:
    """``{(from kind, to kind, reason class): count}`` since the process started: what the
    metrics module exports as ``tessera_transport_fallbacks_total``."""
    with _lock:
        return dict(_fallbacks)


def count_fallback(src: str, dst: str, reason: str) -> None:
    with _lock:
        key = (src, dst, reason)
        _fallbacks[key] = _fallbacks.get(key, 0) + 1
