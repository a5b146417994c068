"""The directory actor: a thin Ray shell over :class:`DirectoryShard`; named, restartable.
After a (re)start it rebuilds itself from the pools' inventories; it checks that pools are
alive, purges the replicas of dead ones, and re-learns a purged pool that answers again.
Its hot calls (lookup, register, drop_replicas) are also served on a channel
(:mod:`~tessera_ray.actors.channel`), whose address callers learn with a Ray call: every lookup
and store of the tier makes them, and a Ray actor call costs both ends several times more CPU.
The other side, how pools and clients reach the shards, is
:class:`~tessera_ray.actors.links.ShardedDirectory`.
"""

from __future__ import annotations

import asyncio
import logging

import ray

from tessera_ray.actors._ray_handles import POOL_PREFIX, ActorCache, PoolRef
from tessera_ray.actors.channel import ChannelAddress, ChannelServer
from tessera_ray.actors.directory import (
    DirectoryShard,
    DirectoryStats,
    LookupAnswer,
    Registration,
    Tier,
)
from tessera_ray.actors.exporter import export_directory_stats
from tessera_ray.actors.tenancy import Access, TenantGate
from tessera_ray.core.results import BlockHash, TokenKey
from tessera_ray.errors import PoolUnavailableError
from tessera_ray.metrics import get_metrics
from tessera_ray.transport import PeerInfo

__all__ = ["DirectoryActor"]

log = logging.getLogger(__name__)


@ray.remote(num_cpus=0)
class DirectoryActor:
    """Thin shell over :class:`DirectoryShard`, rebuilt from pool inventories after a start."""

    def __init__(
        self,
        shard: int,
        num_shards: int,
        ray_namespace: str,
        health_interval_s: float,
        metrics_interval_s: float = 5.0,
        tenant_secret: bytes | None = None,
    ) -> None:
        self.shard = DirectoryShard(shard, num_shards, TenantGate(tenant_secret))
        self.metrics = get_metrics()
        self.metrics_interval_s = metrics_interval_s
        self.ray_namespace = ray_namespace
        self.health_interval_s = health_interval_s
        self._actors = ActorCache(ray_namespace)
        self._rebuilt = asyncio.Event()
        self._peers: dict[str, PeerInfo] = {}
        self._purged: set[str] = set()
        """Pools purged from this shard that may still be (or be again) alive; see
        :meth:`_reconcile`."""
        self._reconciled = asyncio.Event()
        self._reconciled.set()
        self._started = False
        self._serving: asyncio.Future[ChannelAddress | None] | None = None
        self._channel_server: ChannelServer | None = None

    def _start(self) -> None:
        if not self._started:
            self._started = True
            loop = asyncio.get_running_loop()
            # Keep references: the loop holds tasks weakly.
            self._tasks = [
                loop.create_task(self._rebuild()),
                loop.create_task(self._health_loop()),
                loop.create_task(self._exporter()),
            ]

    async def channel(self) -> ChannelAddress | None:
        """Where this shard serves its hot calls without Ray (``None``: it could not listen;
        callers then use the Ray methods). Listening starts at the first ask."""
        self._start()
        if self._serving is None:
            self._serving = asyncio.ensure_future(self._serve())
        return await asyncio.shield(self._serving)

    async def _serve(self) -> ChannelAddress | None:
        shard = self.shard
        server = ChannelServer(
            # Answered in the callback that read the request: these never wait.
            {
                "lookup": shard.lookup,
                "register": shard.register,
                "drop_replicas": shard.drop_replicas,
            },
            host=ray.util.get_node_ip_address(),  # type: ignore[no-untyped-call]
        )
        try:
            address = await server.start()
        except OSError as e:
            log.warning("directory shard %d serves no channel: %s", shard.shard, e)
            return None
        self._channel_server = server
        return address

    async def _exporter(self) -> None:
        while True:
            await asyncio.sleep(self.metrics_interval_s)
            try:
                export_directory_stats(self.metrics, self.shard.stats(), self.ray_namespace)
            except Exception:  # a metrics hiccup must not stop the shard's exports for good
                log.exception("directory shard: metrics export failed")

    async def flush_metrics(self) -> None:
        """Export the current snapshot now (instead of waiting for the next interval)."""
        self._start()
        export_directory_stats(self.metrics, self.shard.stats(), self.ray_namespace)

    def _pool_names(self) -> list[str]:
        return [
            a["name"]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == self.ray_namespace and a["name"].startswith(POOL_PREFIX)
        ]

    async def _adopt(self, name: str) -> None:
        """Learn what pool ``name`` holds from its inventory (and its transport data)."""
        pool = PoolRef(self._actors, name)
        self.shard.rebuild_from(await pool.inventory())
        peer = await pool.peer_info()
        if peer is not None:
            self._peers[name] = peer

    async def _rebuild(self) -> None:
        try:
            for name in self._pool_names():
                try:
                    await self._adopt(name)
                except PoolUnavailableError as exc:
                    log.warning("rebuild: pool %s unavailable: %s", name, exc)
        except Exception:
            log.exception("rebuild of directory shard %d failed", self.shard.shard)
            raise
        finally:
            # Even a failed rebuild ends the wait: lookups then miss, which is slower, not wrong.
            self._rebuilt.set()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            alive = set(self._pool_names())
            for name in self.shard.pools():
                healthy = name in alive
                if healthy:
                    try:
                        await PoolRef(self._actors, name).health(self.health_interval_s)
                    except PoolUnavailableError:
                        healthy = False
                if not healthy:
                    self._peers.pop(name, None)
                    self._suspect(name)
                if not healthy and self.shard.purge_pool(name):
                    log.warning("pool %s is dead: its replicas were purged", name)
            await self._reconcile(alive)

    async def _reconcile(self, alive: set[str]) -> None:
        """Re-learn purged pools that answer again, from their inventories.

        A purge is decided on a pool that looked dead: its health call failed or timed out
        (a restart, or only a busy pool), or a client found it unavailable. By the time the
        purge lands, a restarted pool may already have re-announced its disk tier, and a busy
        one never went away: either way the purge wiped replicas the pool holds, and nothing
        would announce them again. The chaos suite lost 7 of 62 blocks to this (held on disk,
        unknown to the directory). An inventory taken after the purge is the truth again."""
        for name in list(self._purged):
            if name not in alive:
                self._purged.discard(name)  # gone for good (a restart keeps the name listed)
                continue
            try:
                await self._adopt(name)
            except PoolUnavailableError:
                continue  # still down: try again next round
            self._purged.discard(name)
            log.info("pool %s answers again: its inventory was re-registered", name)
        if not self._purged:
            self._reconciled.set()

    def _suspect(self, name: str) -> None:
        self._purged.add(name)
        self._reconciled.clear()

    async def register(self, entries: list[Registration]) -> int:
        self._start()
        return self.shard.register(entries)

    async def lookup(self, access: Access, token_keys: list[TokenKey]) -> LookupAnswer:
        """The shard's columnar answer; it reaches the caller as a plain list."""
        self._start()
        return self.shard.lookup(access, token_keys)

    async def drop_replicas(
        self, pool: str, blocks: list[tuple[str, BlockHash]], tier: Tier | None
    ) -> int:
        self._start()
        return self.shard.drop_replicas(pool, blocks, tier)

    async def purge_pool(self, pool: str) -> int:
        self._start()
        self._peers.pop(pool, None)
        self._suspect(pool)  # re-learned from its inventory if it answers later
        return self.shard.purge_pool(pool)

    async def publish_peer(self, info: PeerInfo) -> None:
        self._start()
        self._peers[info.name] = info

    async def peer(self, name: str) -> PeerInfo | None:
        self._start()
        return self._peers.get(name)

    async def stats(self) -> DirectoryStats:
        self._start()
        return self.shard.stats()

    @ray.method(max_task_retries=-1)  # idempotent: retried across a restart, unlike lookups
    async def wait_rebuilt(self, timeout_s: float) -> bool:
        """True once the index has been rebuilt from the pools' inventories, and every pool
        purged since then that answers again has been re-learned (see :meth:`_reconcile`)."""
        self._start()

        async def settled() -> None:
            await self._rebuilt.wait()
            await self._reconciled.wait()

        try:
            await asyncio.wait_for(settled(), timeout_s)
        except TimeoutError:
            return False
        return True
