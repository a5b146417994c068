"""Simulated Ray nodes on one host need every Ray address on loopback: with this variable at
``0`` when Ray is imported, Ray takes 127.0.0.1 as the node address; otherwise a node's GCS
address is the host's routable one, which a loopback-only node cannot reach. No imports here,
so an entry point can set it before anything imports Ray."""

from __future__ import annotations

import os

__all__ = ["LOOPBACK_ENV", "keep_ray_on_loopback", "ray_on_loopback"]

LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def keep_ray_on_loopback() -> None:
    """Ask for loopback addresses (an operator's own setting stays); before Ray is imported."""
    os.environ.setdefault(LOOPBACK_ENV, "0")


def ray_on_loopback() -> bool:
    return os.environ.get(LOOPBACK_ENV) == "0"
