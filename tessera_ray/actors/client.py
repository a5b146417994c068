"""Every ``ray.*`` call of tessera-ray lives here: the actor shells and the client.

- :class:`PoolActor`: a thin async shell over :class:`PoolService`, one per GPU (or per node on
  CPU clusters), placed by node affinity. It reaps expired leases in the background and pulls
  blocks from other pools (``fetch_from``): pin on the owner, move the bytes, verify every page
  against the owner's content hash, install, unpin.
- :class:`DirectoryActor`: a thin shell over :class:`DirectoryShard`; named, restartable. After a
  (re)start it rebuilds itself from the pools' inventories; it checks that pools are alive,
  purges the replicas of dead ones, and re-learns a purged pool that answers again.
- :class:`TesseraClient`: starts or connects to the tier; store, lookup, fetch, status. Every
  call is batched: one directory round trip per shard per request.

Actor names: ``tessera-dir-<i>`` and ``tessera-pool-<node>-<i>`` in the tier's Ray namespace.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from tessera_ray.actors.config import PoolServiceConfig, TierConfig
from tessera_ray.actors.directory import (
    DirectoryShard,
    DirectoryStats,
    LookupResult,
    Registration,
    Tier,
)
from tessera_ray.actors.exporter import export_directory_stats, export_pool_status, pool_tags
from tessera_ray.actors.links import group_by_shard
from tessera_ray.actors.messages import (
    BlockCheck,
    BlockRead,
    EvictionReport,
    PinTicket,
    PoolStatus,
    StoredBlock,
)
from tessera_ray.actors.pool_service import PoolService
from tessera_ray.actors.pool_transfer import is_hash_mismatch
from tessera_ray.actors.tenancy import Access, Credential, TenantGate
from tessera_ray.core import ContentHashFn, xxh3_128
from tessera_ray.core.results import BlockHash, TokenKey
from tessera_ray.errors import PoolUnavailableError, TenantError, TransportError
from tessera_ray.layout import ModelLayout, preset_layout
from tessera_ray.metrics import get_metrics
from tessera_ray.transport import PeerInfo, make_transport
from tessera_ray.transport.factory import fallback_counts

__all__ = [
    "PoolActor",
    "DirectoryActor",
    "TesseraClient",
    "FetchResult",
    "POOL_PREFIX",
    "DIR_PREFIX",
]

log = logging.getLogger(__name__)

POOL_PREFIX = "tessera-pool-"
DIR_PREFIX = "tessera-dir-"
_DEAD = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)
_CALL_TIMEOUT_S = 10.0


def _shard_name(i: int) -> str:
    return f"{DIR_PREFIX}{i}"


class _RayDirectory:
    """The pool's view of the directory (DirectoryLink over shard actors). A shard that is down
    is skipped: it rebuilds from inventories when it is back, so nothing is lost."""

    def __init__(self, ray_namespace: str, num_shards: int) -> None:
        self.ray_namespace = ray_namespace
        self.num_shards = num_shards
        # Ray runs an async actor's calls in no guaranteed order, even from one caller: a drop
        # and a later register of the same replica could land reversed, leaving the directory
        # naming a copy the pool no longer has (or forgetting one it has). Each change waits
        # for the previous one to be applied.
        self._writes = asyncio.Lock()

    def _shard(self, i: int) -> Any:
        return ray.get_actor(_shard_name(i), namespace=self.ray_namespace)

    async def _call(self, i: int, method: str, *args: Any) -> Any:
        try:
            return await asyncio.wait_for(
                getattr(self._shard(i), method).remote(*args), _CALL_TIMEOUT_S
            )
        except (*_DEAD, ValueError, TimeoutError) as exc:  # ValueError: name not found yet
            log.warning("directory shard %d unavailable for %s: %s", i, method, exc)
            return None

    async def register(self, entries: Sequence[Registration]) -> None:
        groups = group_by_shard([e.token_key for e in entries], self.num_shards)
        async with self._writes:
            await asyncio.gather(
                *(self._call(s, "register", [entries[i] for i in idx]) for s, idx in groups.items())
            )

    async def drop(
        self, pool: str, blocks: Sequence[tuple[str, BlockHash]], tier: Tier | None
    ) -> None:
        async with self._writes:
            await asyncio.gather(
                *(
                    self._call(s, "drop_replicas", pool, list(blocks), tier)
                    for s in range(self.num_shards)
                )
            )

    async def purge(self, pool: str) -> None:
        """Forget every replica of ``pool`` (a pool process that starts holds nothing)."""
        async with self._writes:
            await asyncio.gather(
                *(self._call(s, "purge_pool", pool) for s in range(self.num_shards))
            )

    async def publish_peer(self, info: PeerInfo) -> None:
        """Every shard keeps every pool's transport data, so a reader finds it at any shard."""
        await asyncio.gather(*(self._call(s, "publish_peer", info) for s in range(self.num_shards)))

    async def peer(self, name: str) -> PeerInfo | None:
        for s in range(self.num_shards):
            found = await self._call(s, "peer", name)
            if found is not None:
                return found  # type: ignore[no-any-return]
        return None

    async def lookup(
        self, namespace: Access, token_keys: Sequence[TokenKey]
    ) -> list[LookupResult | None]:
        out: list[LookupResult | None] = [None] * len(token_keys)
        groups = group_by_shard(token_keys, self.num_shards)
        answers = await asyncio.gather(
            *(
                self._call(s, "lookup", namespace, [token_keys[i] for i in idx])
                for s, idx in groups.items()
            )
        )
        for idx, answer in zip(groups.values(), answers, strict=True):
            for i, r in zip(idx, answer or [None] * len(idx), strict=True):
                out[i] = r
        return out


# Restarted by Ray when its process dies (calls in flight fail; clients fall back): the new
# process purges the old one's memory replicas and re-announces its disk tier.
@ray.remote(num_cpus=0, max_restarts=-1)
class PoolActor:
    """Thin shell over :class:`PoolService` (see the module docstring)."""

    def __init__(
        self,
        name: str,
        layout: ModelLayout,
        config: PoolServiceConfig,
        ray_namespace: str,
        num_shards: int,
        content_hash: ContentHashFn | None = None,
        tenant_secret: bytes | None = None,
    ) -> None:
        # UCX reads this when the NIXL agent starts: with system libibverbs present a process
        # holding a UCX backend can crash at exit otherwise (REFERENCE.md).
        os.environ.setdefault("UCX_MODULES", "^ib")
        node = ray.get_runtime_context().get_node_id()
        self.ray_namespace = ray_namespace
        self.num_shards = num_shards
        self.directory = _RayDirectory(ray_namespace, num_shards)
        # content_hash: a weaker hash forces collisions in tests; the default is xxh3-128.
        self.svc = PoolService(
            name,
            layout,
            config,
            directory=self.directory,
            node=node,
            content_hash=content_hash or xxh3_128,
            gate=TenantGate(tenant_secret),
        )
        self._incarnations: dict[str, int] = {}
        self._reports: set[asyncio.Task[None]] = set()  # the loop holds tasks weakly
        self.metrics = get_metrics()
        # One-sided reads need NIXL; without it (or with kind "ray") blocks move through the
        # object store (read_pinned + install), verified the same way.
        self.peer: PeerInfo | None = None
        if config.transport.kind in ("auto", "nixl"):
            transport = make_transport(config.transport, name=name)
            if transport.kind == "nixl":
                self.peer = self.svc.attach_transport(transport)
            else:
                transport.close()
        self._started = False

    async def _start(self) -> None:
        # Background work starts on the first call: an async actor's __init__ has no loop yet.
        if self._started:
            return
        self._started = True
        # This process holds nothing in memory yet: replicas a previous incarnation registered
        # under this name are stale.
        await self.directory.purge(self.svc.name)
        if self.peer is not None:
            await self.directory.publish_peer(self.peer)
        await self.svc.reopen_disk()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._reaper()), loop.create_task(self._exporter())]

    async def _reaper(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.svc.config.lease_s / 4))
            self.svc.reap()

    async def _exporter(self) -> None:
        while True:
            await asyncio.sleep(self.svc.config.metrics_interval_s)
            try:
                self._export()
            except Exception:  # a metrics hiccup must not stop the pool's exports for good
                log.exception("pool %s: metrics export failed", self.svc.name)

    def _export(self) -> None:
        export_pool_status(self.metrics, self.svc.status(), self.ray_namespace, fallback_counts())

    async def flush_metrics(self) -> None:
        """Export the current snapshot now (instead of waiting for the next interval)."""
        await self._start()
        self._export()

    async def ready(self) -> str:
        await self._start()
        return self.svc.name

    async def health(self) -> bool:
        return True

    async def peer_info(self) -> PeerInfo | None:
        """This pool's NIXL agent data (``None`` when it moves blocks through the object store)."""
        return self.peer

    async def _peer_of(self, owner_name: str, owner: Any) -> str | None:
        """The owner's transport name, its agent added once (directory first, then the owner)."""
        transport = self.svc.transport
        if transport is None:
            return None
        if owner_name in transport.peers:
            return owner_name
        info = await self.directory.peer(owner_name)
        if info is None:
            info = await asyncio.wait_for(owner.peer_info.remote(), _CALL_TIMEOUT_S)
        if info is None or info.kind != transport.kind:
            return None
        transport.add_peers([info])
        return info.name

    async def describe(self) -> tuple[ModelLayout, PoolServiceConfig, int]:
        """The layout, settings and shard count this pool runs with (for clients that connect)."""
        return self.svc.layout, self.svc.config, self.num_shards

    async def reserve(self, num_blocks: int, lease_s: float | None = None) -> Any:
        await self._start()
        return await self.svc.reserve(num_blocks, lease_s)

    async def commit(
        self, reservation_id: int, namespace: Access, keys: list[TokenKey], payloads: np.ndarray
    ) -> list[StoredBlock]:
        await self._start()
        return await self.svc.commit(reservation_id, namespace, keys, payloads)

    async def abort(self, reservation_id: int) -> None:
        self.svc.abort(reservation_id)

    async def store(
        self, namespace: Access, keys: list[TokenKey], payloads: np.ndarray
    ) -> list[StoredBlock]:
        await self._start()
        return await self.svc.store(namespace, keys, payloads)

    async def contains(
        self, namespace: Access, keys: list[TokenKey], touch: bool = False
    ) -> list[Tier | None]:
        await self._start()
        return self.svc.contains(namespace, keys, touch)

    async def pin(
        self, namespace: Access, keys: list[TokenKey], lease_s: float | None = None
    ) -> Any:
        await self._start()
        return await self.svc.pin(namespace, keys, lease_s)

    async def unpin(self, pin_id: int) -> bool:
        return self.svc.unpin(pin_id)

    async def read_pinned(self, pin_id: int) -> np.ndarray:
        return self.svc.read_pinned(pin_id)

    async def read(self, namespace: Access, keys: list[TokenKey]) -> list[np.ndarray | None]:
        """Payloads of blocks held here (memory or disk), for callers that consume bytes."""
        blocks = await self.read_blocks(namespace, keys)
        return [b.payload if b is not None else None for b in blocks]

    async def read_blocks(self, namespace: Access, keys: list[TokenKey]) -> list[BlockRead | None]:
        """Payloads with the block hashes to check them against (see :class:`BlockRead`)."""
        await self._start()
        return await self.svc.read_blocks(namespace, keys)

    async def check_blocks(self, namespace: Access, keys: list[TokenKey]) -> list[BlockCheck]:
        await self._start()
        return await self.svc.check_blocks(namespace, keys)

    async def attend(
        self,
        namespace: Access,
        keys: list[TokenKey],
        positions: list[int],
        layer: int,
        q: Any,
        seqlen: int,
        softmax_scale: float,
        causal: bool = True,
    ) -> Any:
        await self._start()
        return self.svc.attend(namespace, keys, positions, layer, q, seqlen, softmax_scale, causal)

    async def evict(self, num_blocks: int) -> Any:
        await self._start()
        return await self.svc.evict(num_blocks)

    async def inventory(self) -> list[Registration]:
        await self._start()
        return self.svc.inventory()

    async def status(self) -> PoolStatus:
        await self._start()
        return self.svc.status()

    async def fetch_from(
        self, owner_name: str, namespace: Access, keys: list[TokenKey], timeout_s: float = 30.0
    ) -> list[str | None]:
        """Pull blocks from ``owner_name`` into this pool; per key ``None`` (installed or
        already here) or the reason it was not fetched. The caller's access is checked here
        and again by the owner."""
        await self._start()
        self.svc.gate.resolve(namespace, write=False)
        if owner_name == self.svc.name:  # a disk replica here: pinning restores it
            ticket = await self.svc.pin(namespace, keys)
            self.svc.unpin(ticket.id)
            return [None if b is not None else "not on this pool" for b in ticket.blocks]
        began = time.perf_counter()
        reasons = await self._pull(owner_name, namespace, keys, timeout_s)
        tags = pool_tags(self.ray_namespace, self.svc.name, self.svc.node)
        self.metrics.observe("tessera_transfer_latency_seconds", time.perf_counter() - began, tags)
        installed = sum(r is None for r in reasons)
        self.metrics.inc("tessera_transfer_bytes", installed * self.svc.block_bytes, tags)
        self.metrics.inc("tessera_transfer_errors", len(reasons) - installed, tags)
        return reasons

    async def _pull(
        self, owner_name: str, access: Access, keys: list[TokenKey], timeout_s: float
    ) -> list[str | None]:
        namespace = self.svc.gate.resolve(access, write=False)
        try:
            owner = ray.get_actor(owner_name, namespace=self.ray_namespace)
            ticket: PinTicket = await asyncio.wait_for(owner.pin.remote(access, keys), timeout_s)
        except (*_DEAD, ValueError, TimeoutError) as exc:
            return [f"owner {owner_name} unavailable: {type(exc).__name__}"] * len(keys)
        suspects: list[TokenKey] = []
        try:
            if ticket.namespace != namespace:
                return [f"owner {owner_name} answered for another namespace"] * len(keys)
            transport = self.svc.transport
            if self._incarnations.get(owner_name) != ticket.incarnation:
                # The owner restarted: its old NIXL agent (same name) is gone.
                if transport is not None and owner_name in transport.peers:
                    transport.remove_peers([owner_name])
                self._incarnations[owner_name] = ticket.incarnation
            peer = await self._peer_of(owner_name, owner)
            reasons: list[str | None]
            if peer is not None:
                reasons = await self.svc.fetch_pinned(ticket, peer, timeout_s)
            else:
                reasons = [
                    None if b is not None else f"not held by {owner_name}" for b in ticket.blocks
                ]
                held = [b for b in ticket.blocks if b is not None]
                if held:
                    payload = await asyncio.wait_for(owner.read_pinned.remote(ticket.id), timeout_s)
                    result = await self.svc.install(namespace, held, payload)
                    errors = iter(result.errors)
                    reasons = [
                        next(errors) if b is not None else r
                        for b, r in zip(ticket.blocks, reasons, strict=True)
                    ]
            suspects = [k for k, r in zip(keys, reasons, strict=True) if is_hash_mismatch(r)]
            return reasons
        except (*_DEAD, TimeoutError, TransportError) as exc:
            # The owner died mid-read (or its agent went away): the fetch gave its reserved
            # slots back (slots a read may still write are freed only once it is cancelled);
            # these blocks are misses, fetched elsewhere or recomputed.
            if self.svc.transport is not None and owner_name in self.svc.transport.peers:
                self.svc.transport.remove_peers([owner_name])
            return [f"transfer from {owner_name} failed: {type(exc).__name__}"] * len(keys)
        finally:
            unpinned = owner.unpin.remote(ticket.id)  # not awaited: the lease ends it anyway
            if suspects:
                task = asyncio.get_running_loop().create_task(
                    self._report(owner, unpinned, access, suspects)
                )
                self._reports.add(task)
                task.add_done_callback(self._reports.discard)

    async def _report(
        self, owner: Any, unpinned: Any, access: Access, keys: list[TokenKey]
    ) -> None:
        """Blocks whose bytes arrived hashing otherwise than sealed: the owner checks its copy
        and drops it if it rotted, or every later fetch of it would fail the same way. Sent
        once this fetch's unpin has landed (a block still pinned cannot be dropped), in the
        background: the fetch's outcome does not wait for it."""
        try:
            await unpinned
            await owner.check_blocks.remote(access, keys)
        except (*_DEAD, TenantError) as exc:
            log.warning("could not have %d blocks checked by their owner: %s", len(keys), exc)


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
        self._rebuilt = asyncio.Event()
        self._peers: dict[str, PeerInfo] = {}
        self._purged: set[str] = set()
        """Pools purged from this shard that may still be (or be again) alive; see
        :meth:`_reconcile`."""
        self._reconciled = asyncio.Event()
        self._reconciled.set()
        self._started = False

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
        pool = ray.get_actor(name, namespace=self.ray_namespace)
        inventory: list[Registration] = await asyncio.wait_for(
            pool.inventory.remote(), _CALL_TIMEOUT_S
        )
        self.shard.rebuild_from(inventory)
        peer = await asyncio.wait_for(pool.peer_info.remote(), _CALL_TIMEOUT_S)
        if peer is not None:
            self._peers[name] = peer

    async def _rebuild(self) -> None:
        try:
            for name in self._pool_names():
                try:
                    await self._adopt(name)
                except (*_DEAD, ValueError, TimeoutError) as exc:
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
                        pool = ray.get_actor(name, namespace=self.ray_namespace)
                        await asyncio.wait_for(pool.health.remote(), self.health_interval_s)
                    except (*_DEAD, ValueError, TimeoutError):
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
            except (*_DEAD, ValueError, TimeoutError):
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

    async def lookup(self, namespace: Access, keys: list[TokenKey]) -> list[LookupResult | None]:
        self._start()
        return self.shard.lookup(namespace, keys)

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


@dataclass(frozen=True, slots=True)
class FetchResult:
    """Per requested key: where it is now available in the target pool, or why not."""

    pool: str
    local_hits: tuple[TokenKey, ...]
    fetched: tuple[TokenKey, ...]
    missed: tuple[TokenKey, ...]
    failed: dict[TokenKey, str] = field(default_factory=dict)

    @property
    def available(self) -> set[TokenKey]:
        return set(self.local_hits) | set(self.fetched)


class TesseraClient:
    """Starts or connects to the tier; every method is batched (one call per shard)."""

    def __init__(
        self,
        config: TierConfig,
        layout: ModelLayout,
        pools: list[str],
        *,
        owns_ray: bool = False,
        tenant_secret: bytes | None = None,
    ) -> None:
        self._gate = TenantGate(tenant_secret)
        self.config = config
        self.layout = layout
        self.pools = pools
        self.owns_ray = owns_ray
        """True when :meth:`start` started the embedded Ray; :meth:`stop` then shuts it down."""

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    def start(
        cls,
        config: TierConfig,
        *,
        layout: ModelLayout | None = None,
        address: str | None = None,
        pools_on: Sequence[str] | None = None,
        quiet: bool = False,
        tenant_secret: bytes | None = None,
    ) -> TesseraClient:
        """Start the tier: directory shards on this node, pools on every alive node (or on the
        node ids in ``pools_on``): one per GPU (``num_gpus=1``, pages in device memory) on GPU
        nodes, ``pools_per_node`` on CPU nodes. Starts an embedded local Ray on 127.0.0.1 when
        none is connected (``quiet``: keep the actors' log lines off this process's output).

        ``tenant_secret``: every call must then name its namespace with a credential
        (:meth:`issue_credential`; see :mod:`~tessera_ray.actors.tenancy`); ``None``: an open
        tier where a namespace is a plain string."""
        TenantGate(tenant_secret)  # refuse a weak secret before anything starts
        owns_ray = not ray.is_initialized()
        if owns_ray:
            ray.init(
                address=address or "local",
                namespace=config.ray_namespace,
                include_dashboard=False,
                _node_ip_address="127.0.0.1",
                logging_level=logging.ERROR,
                log_to_driver=not quiet,
            )
        layout = layout or preset_layout(config.model, format=config.format)
        here = ray.get_runtime_context().get_node_id()
        for i in range(config.num_shards):
            DirectoryActor.options(  # type: ignore[attr-defined]
                name=_shard_name(i),
                namespace=config.ray_namespace,
                lifetime="detached",
                max_restarts=-1,
                get_if_exists=True,
                scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=True),
            ).remote(
                i,
                config.num_shards,
                config.ray_namespace,
                config.health_interval_s,
                config.pool.metrics_interval_s,
                tenant_secret,
            )
        alive = {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}  # type: ignore[no-untyped-call]
        nodes = list(pools_on) if pools_on is not None else list(alive)
        names: list[str] = []
        handles = []
        for node in nodes:
            # One pool per GPU, its pages in device memory; one per node (or pools_per_node)
            # on CPU nodes.
            gpus = int(alive.get(node, {}).get("Resources", {}).get("GPU", 0))
            for j in range(gpus or config.pools_per_node):
                name = f"{POOL_PREFIX}{node[:12]}-{j}"
                pool_cfg = config.pool
                if gpus:
                    pool_cfg = dataclasses.replace(pool_cfg, device="cuda")
                if pool_cfg.disk_root is not None:
                    pool_cfg = _with_disk(pool_cfg, name)
                handles.append(
                    PoolActor.options(  # type: ignore[attr-defined]
                        name=name,
                        namespace=config.ray_namespace,
                        lifetime="detached",
                        get_if_exists=True,
                        num_gpus=1 if gpus else 0,
                        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                    ).remote(
                        name,
                        layout,
                        pool_cfg,
                        config.ray_namespace,
                        config.num_shards,
                        None,
                        tenant_secret,
                    )
                )
                names.append(name)
        ray.get([h.ready.remote() for h in handles])
        return cls(
            config,
            layout,
            names,
            owns_ray=owns_ray and address is None,
            tenant_secret=tenant_secret,
        )

    @classmethod
    def connect(
        cls,
        ray_namespace: str = "tessera",
        *,
        address: str | None = None,
        tenant_secret: bytes | None = None,
    ) -> TesseraClient:
        """Attach to a running tier (started by :meth:`start` or ``tessera-ray start``): the
        pools and shards are found by name, the layout and settings are asked of a pool (never
        the tenant secret: an operator who holds it passes it to issue credentials)."""
        if not ray.is_initialized():
            ray.init(
                address=address or "auto", namespace=ray_namespace, logging_level=logging.ERROR
            )
        named = [
            a["name"]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == ray_namespace
        ]
        pools = sorted(n for n in named if n.startswith(POOL_PREFIX))
        if not pools:
            raise PoolUnavailableError(
                f"no tessera-ray pools in Ray namespace {ray_namespace!r}; start the tier first "
                f"(tessera-ray start)"
            )
        described = cast(
            tuple[ModelLayout, PoolServiceConfig, int],
            ray.get(ray.get_actor(pools[0], namespace=ray_namespace).describe.remote()),
        )
        layout, pool_cfg, num_shards = described
        config = TierConfig(
            model=layout.model, pool=pool_cfg, num_shards=num_shards, ray_namespace=ray_namespace
        )
        return cls(config, layout, pools, tenant_secret=tenant_secret)

    def stop(self) -> None:
        """Kill the tier's actors (the disk tiers stay on disk), and the embedded Ray if
        :meth:`start` started it."""
        for name in [*self.pools, *(_shard_name(i) for i in range(self.config.num_shards))]:
            try:
                ray.kill(ray.get_actor(name, namespace=self.config.ray_namespace), no_restart=True)
            except ValueError:
                pass
        if self.owns_ray:
            ray.shutdown()

    def issue_credential(self, tenant: str, reads: Sequence[str] = ()) -> Credential:
        """A credential for ``tenant`` that may also read the namespaces in ``reads``
        (explicit sharing). Needs the tier's tenant secret (given to :meth:`start` or
        :meth:`connect`); hand it to the tenant's code, which passes it as the namespace."""
        return self._gate.issue(tenant, reads)

    # ------------------------------------------------------------------ handles

    def pool(self, name: str) -> Any:
        return ray.get_actor(name, namespace=self.config.ray_namespace)

    def shard(self, i: int) -> Any:
        return ray.get_actor(_shard_name(i), namespace=self.config.ray_namespace)

    def pool_on(self, node_id: str) -> str:
        prefix = f"{POOL_PREFIX}{node_id[:12]}-"
        return next(n for n in self.pools if n.startswith(prefix))

    def local_pool(self) -> str:
        """A pool on the node this process runs on (reads landing there stay local later), or
        the first pool when this node has none."""
        prefix = f"{POOL_PREFIX}{ray.get_runtime_context().get_node_id()[:12]}-"
        return next((n for n in self.pools if n.startswith(prefix)), self.pools[0])

    # ------------------------------------------------------------------ data path
    #
    # Each operation is written once, as a coroutine (``a``-prefixed: use these inside an event
    # loop, e.g. a Ray Serve deployment); the plain method runs it to completion for scripts.

    async def astore(
        self, namespace: Access, token_keys: Sequence[TokenKey], payloads: np.ndarray, *, pool: str
    ) -> list[StoredBlock]:
        """Two-phase store into ``pool``: reserve, then commit (the pool registers the blocks
        with the directory); a failed commit aborts the reservation."""
        actor = self.pool(pool)
        res = await actor.reserve.remote(len(token_keys))
        try:
            stored: list[StoredBlock] = await actor.commit.remote(
                res.id, namespace, list(token_keys), payloads
            )
            return stored
        except BaseException:
            # Awaited, so a refused store has returned its slots when the error reaches the
            # caller (the lease would return them anyway, later).
            try:
                await asyncio.wait_for(actor.abort.remote(res.id), _CALL_TIMEOUT_S)
            except (*_DEAD, TimeoutError):
                pass
            raise

    async def alookup(
        self, namespace: Access, token_keys: Sequence[TokenKey]
    ) -> list[LookupResult | None]:
        """One call per shard. A shard that is down (restarting) answers with misses."""
        out: list[LookupResult | None] = [None] * len(token_keys)
        groups = group_by_shard(token_keys, self.config.num_shards)

        async def ask(s: int, idx: list[int]) -> None:
            ref = self.shard(s).lookup.remote(namespace, [token_keys[i] for i in idx])
            try:
                answer = await asyncio.wait_for(ref, _CALL_TIMEOUT_S)
            except (*_DEAD, TimeoutError) as exc:
                log.warning("directory shard %d unavailable: %s; answering misses", s, exc)
                return
            for i, r in zip(idx, answer, strict=True):
                out[i] = r

        await asyncio.gather(*(ask(s, idx) for s, idx in groups.items()))
        return out

    async def apurge_pool(self, pool: str) -> None:
        async def purge(s: int) -> None:
            try:
                await asyncio.wait_for(self.shard(s).purge_pool.remote(pool), _CALL_TIMEOUT_S)
            except (*_DEAD, TimeoutError):
                pass

        await asyncio.gather(*(purge(s) for s in range(self.config.num_shards)))

    async def afetch(
        self, namespace: Access, token_keys: Sequence[TokenKey], *, into: str
    ) -> FetchResult:
        """Make the blocks available in pool ``into``: local hits stay, blocks held elsewhere are
        pulled (memory replicas first, then disk), a dead owner is purged and the next replica
        tried; what no live replica has is a miss (the engine recomputes it)."""
        results = await self.alookup(namespace, token_keys)
        local, missed = [], []
        pending: dict[TokenKey, list[str]] = {}
        for key, r in zip(token_keys, results, strict=True):
            if r is None:
                missed.append(key)
            elif any(rep.pool == into and rep.tier == Tier.MEMORY for rep in r.replicas):
                local.append(key)
            else:
                order = sorted(
                    r.replicas, key=lambda rep: (rep.tier != Tier.MEMORY, rep.pool != into)
                )
                pending[key] = list(dict.fromkeys(rep.pool for rep in order))
        fetched: list[TokenKey] = []
        failed: dict[TokenKey, str] = {}
        target = self.pool(into)
        if local:
            # Confirm the local hits (the directory may lag an eviction) and mark them used, so
            # the pool keeps them over older blocks; a stale one is pulled like any other.
            held = await target.contains.remote(namespace, local, True)
            for key, tier in zip(list(local), held, strict=True):
                if tier != Tier.MEMORY:
                    local.remove(key)
                    result = results[token_keys.index(key)]
                    others = (
                        [rep.pool for rep in result.replicas if rep.pool != into] if result else []
                    )
                    if tier == Tier.DISK:
                        others.insert(0, into)
                    if others:
                        pending[key] = list(dict.fromkeys(others))
                    else:
                        missed.append(key)
        while pending:
            by_owner: dict[str, list[TokenKey]] = {}
            for key, owners in pending.items():
                by_owner.setdefault(owners[0], []).append(key)
            answers = await asyncio.gather(
                *(target.fetch_from.remote(o, namespace, ks) for o, ks in by_owner.items())
            )
            for (owner, owner_keys), reasons in zip(by_owner.items(), answers, strict=True):
                if any(r is not None and "unavailable" in r for r in reasons):
                    await self.apurge_pool(owner)
                for key, reason in zip(owner_keys, reasons, strict=True):
                    if reason is None:
                        fetched.append(key)
                        del pending[key]
                        continue
                    pending[key].pop(0)
                    if not pending[key]:
                        failed[key] = reason
                        del pending[key]
        return FetchResult(into, tuple(local), tuple(fetched), tuple(missed), failed)

    async def aattend(
        self,
        namespace: Access,
        token_keys: Sequence[TokenKey],
        layer: int,
        q: Any,
        seqlen: int,
        softmax_scale: float,
        causal: bool = True,
    ) -> tuple[Any, Any]:
        """MLA attention of one sequence where its pages live: each block is assigned to one
        pool holding it in memory, every pool computes its partial (out, lse) over its blocks,
        and the partials are merged exactly (LSE merge). Raises ``LookupError`` naming blocks
        no pool holds in memory (fetch them first, or recompute)."""
        from tessera_ray.kernels import merge_attention_states

        results = await self.alookup(namespace, token_keys)
        assigned: dict[str, list[int]] = {}
        absent = []
        for i, r in enumerate(results):
            owners = [rep.pool for rep in r.replicas if rep.tier == Tier.MEMORY] if r else []
            if not owners:
                absent.append(i)
                continue
            # Spread blocks over their holders; any holder gives the same bytes.
            assigned.setdefault(min(owners, key=lambda p: len(assigned.get(p, ()))), []).append(i)
        if absent:
            raise LookupError(f"blocks {absent} of the sequence are in no pool's memory")
        keys = list(token_keys)
        partials = await asyncio.gather(
            *(
                self.pool(p).attend.remote(
                    namespace, keys, pos, layer, q, seqlen, softmax_scale, causal
                )
                for p, pos in assigned.items()
            )
        )
        for p, (_, _, missing) in zip(assigned, partials, strict=True):
            if missing:
                raise LookupError(f"pool {p} no longer holds blocks {missing}; retry")
        return merge_attention_states([o for o, _, _ in partials], [lse for _, lse, _ in partials])

    async def aread(
        self, namespace: Access, token_keys: Sequence[TokenKey], *, pool: str
    ) -> list[np.ndarray | None]:
        rows: list[np.ndarray | None] = await self.pool(pool).read.remote(
            namespace, list(token_keys)
        )
        return rows

    async def aread_blocks(
        self, namespace: Access, token_keys: Sequence[TokenKey], *, pool: str
    ) -> list[BlockRead | None]:
        """:meth:`aread` with the hash each block was sealed under, to verify the bytes by."""
        blocks: list[BlockRead | None] = await self.pool(pool).read_blocks.remote(
            namespace, list(token_keys)
        )
        return blocks

    async def acheck_blocks(
        self, namespace: Access, token_keys: Sequence[TokenKey], *, pool: str
    ) -> list[BlockCheck]:
        """Have ``pool`` re-hash blocks whose bytes a consumer could not verify; it drops the
        ones that rotted in its memory (see :class:`BlockCheck`)."""
        checks: list[BlockCheck] = await self.pool(pool).check_blocks.remote(
            namespace, list(token_keys)
        )
        return checks

    async def aevict(self, pool: str, num_blocks: int) -> EvictionReport:
        report: EvictionReport = await self.pool(pool).evict.remote(num_blocks)
        return report

    def store(
        self, namespace: Access, token_keys: Sequence[TokenKey], payloads: np.ndarray, *, pool: str
    ) -> list[StoredBlock]:
        return _run(self.astore(namespace, token_keys, payloads, pool=pool))

    def lookup(
        self, namespace: Access, token_keys: Sequence[TokenKey]
    ) -> list[LookupResult | None]:
        return _run(self.alookup(namespace, token_keys))

    def purge_pool(self, pool: str) -> None:
        _run(self.apurge_pool(pool))

    def fetch(self, namespace: Access, token_keys: Sequence[TokenKey], *, into: str) -> FetchResult:
        return _run(self.afetch(namespace, token_keys, into=into))

    def attend(
        self,
        namespace: Access,
        token_keys: Sequence[TokenKey],
        layer: int,
        q: Any,
        seqlen: int,
        softmax_scale: float,
        causal: bool = True,
    ) -> tuple[Any, Any]:
        return _run(self.aattend(namespace, token_keys, layer, q, seqlen, softmax_scale, causal))

    def read(
        self, namespace: Access, token_keys: Sequence[TokenKey], *, pool: str
    ) -> list[np.ndarray | None]:
        return _run(self.aread(namespace, token_keys, pool=pool))

    def check_blocks(
        self, namespace: Access, token_keys: Sequence[TokenKey], *, pool: str
    ) -> list[BlockCheck]:
        return _run(self.acheck_blocks(namespace, token_keys, pool=pool))

    def evict(self, pool: str, num_blocks: int) -> EvictionReport:
        return _run(self.aevict(pool, num_blocks))

    # ------------------------------------------------------------------ status

    def status(self) -> tuple[list[PoolStatus | str], list[DirectoryStats | str]]:
        """Every pool's and shard's snapshot; an unreachable one is reported by a reason."""
        pools: list[PoolStatus | str] = []
        for name in self.pools:
            try:
                pools.append(ray.get(self.pool(name).status.remote(), timeout=_CALL_TIMEOUT_S))
            except (*_DEAD, ValueError, ray.exceptions.GetTimeoutError) as exc:
                pools.append(f"{name}: down ({type(exc).__name__})")
        shards: list[DirectoryStats | str] = []
        for s in range(self.config.num_shards):
            try:
                shards.append(ray.get(self.shard(s).stats.remote(), timeout=_CALL_TIMEOUT_S))
            except (*_DEAD, ValueError, ray.exceptions.GetTimeoutError) as exc:
                shards.append(f"shard {s}: down ({type(exc).__name__})")
        return pools, shards

    def flush_metrics(self) -> None:
        """Have every pool and shard export its snapshot now (Ray still ships the values to
        the nodes' metrics endpoints on its own schedule)."""
        refs = [self.pool(p).flush_metrics.remote() for p in self.pools]
        refs += [self.shard(s).flush_metrics.remote() for s in range(self.config.num_shards)]
        ray.get(refs, timeout=_CALL_TIMEOUT_S)

    def wait_rebuilt(self, timeout_s: float = 30.0) -> bool:
        """Block until every shard has rebuilt its index (after a start or a restart) and
        re-learned every pool it purged that answers again; False on ``timeout_s``."""
        refs = [self.shard(s).wait_rebuilt.remote(timeout_s) for s in range(self.config.num_shards)]
        try:
            return all(ray.get(refs, timeout=timeout_s + _CALL_TIMEOUT_S))
        except (*_DEAD, ray.exceptions.GetTimeoutError):
            return False


_T = TypeVar("_T")


def _run(coro: Coroutine[Any, Any, _T]) -> _T:
    """Run a client coroutine from synchronous code (scripts, tests)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    coro.close()
    raise RuntimeError(
        "TesseraClient's blocking methods cannot run inside an event loop; await the "
        "a-prefixed form instead (astore, alookup, afetch, aattend, aread, aevict)"
    )


def _with_disk(cfg: PoolServiceConfig, pool_name: str) -> PoolServiceConfig:
    assert cfg.disk_root is not None
    return dataclasses.replace(cfg, disk_root=cfg.disk_root / pool_name)
