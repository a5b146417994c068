"""Operator calls over a whole tier: every pool's and shard's snapshot, metric flushes, an
eviction on demand, and the wait for the directory's rebuild. None is on a request's path.

:class:`TierAdmin` is reached as :attr:`TesseraClient.admin
<tessera_ray.actors.client.TesseraClient.admin>`; the client keeps methods of the same names
(``status``, ``evict``, ``flush_metrics``, ``wait_rebuilt`` and their coroutines) that call it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from tessera_ray.actors._client_sync import blocking
from tessera_ray.actors._ray_handles import ActorCache, PoolRef, ShardRef
from tessera_ray.actors.directory import DirectoryStats
from tessera_ray.actors.messages import EvictionReport, PoolStatus
from tessera_ray.errors import DirectoryUnavailableError, PoolUnavailableError

__all__ = ["TierAdmin"]


class TierAdmin:
    """The operator's calls to the pools ``pools`` and the ``num_shards`` directory shards of
    one tier (their actors reached through ``actors``)."""

    def __init__(self, actors: ActorCache, pools: Sequence[str], num_shards: int) -> None:
        self._actors = actors
        self.pools = list(pools)
        self.num_shards = num_shards

    def _shards(self) -> list[ShardRef]:
        return [ShardRef(self._actors, s) for s in range(self.num_shards)]

    async def astatus(self) -> tuple[list[PoolStatus | str], list[DirectoryStats | str]]:
        """Every pool's and shard's snapshot; an unreachable one is reported by a reason."""

        async def pool(name: str) -> PoolStatus | str:
            try:
                return await PoolRef(self._actors, name).status()
            except PoolUnavailableError as exc:
                return f"{name}: down ({type(exc.__cause__).__name__})"

        async def shard(ref: ShardRef) -> DirectoryStats | str:
            try:
                return await ref.stats()
            except DirectoryUnavailableError as exc:
                return f"shard {ref.index}: down ({type(exc.__cause__).__name__})"

        pools = await asyncio.gather(*(pool(p) for p in self.pools))
        shards = await asyncio.gather(*(shard(ref) for ref in self._shards()))
        return list(pools), list(shards)

    async def aevict(self, pool: str, num_blocks: int) -> EvictionReport:
        """Have ``pool`` evict up to ``num_blocks`` blocks (last copies spill to its disk)."""
        return await PoolRef(self._actors, pool).evict(num_blocks)

    async def aflush_metrics(self) -> None:
        """Have every pool and shard export its snapshot now (Ray still ships the values to
        the nodes' metrics endpoints on its own schedule)."""
        await asyncio.gather(
            *(PoolRef(self._actors, p).flush_metrics() for p in self.pools),
            *(ref.flush_metrics() for ref in self._shards()),
        )

    async def await_rebuilt(self, timeout_s: float = 30.0) -> bool:
        """Wait until every shard has rebuilt its index (after a start or a restart) and
        re-learned every pool it purged that answers again; False on ``timeout_s``."""
        try:
            done = await asyncio.gather(*(ref.wait_rebuilt(timeout_s) for ref in self._shards()))
        except DirectoryUnavailableError:
            return False
        return all(done)

    status = blocking(astatus)
    evict = blocking(aevict)
    flush_metrics = blocking(aflush_metrics)
    wait_rebuilt = blocking(await_rebuilt)
