"""Names and error kinds the Ray shells share (pool actor, directory actor, client)."""

from __future__ import annotations

import ray

__all__ = ["POOL_PREFIX", "DIR_PREFIX", "DEAD", "CALL_TIMEOUT_S", "shard_name"]

POOL_PREFIX = "tessera-pool-"
DIR_PREFIX = "tessera-dir-"
DEAD = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)
"""What a call to an actor whose process is gone raises."""
CALL_TIMEOUT_S = 10.0


def shard_name(i: int) -> str:
    return f"{DIR_PREFIX}{i}"
