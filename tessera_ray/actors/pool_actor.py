"""The pool actor: a thin async Ray shell over :class:`PoolService`, one per GPU (or per node
on CPU clusters), placed by node affinity. It answers the verbs of
:class:`~tessera_ray.actors.pool_api.PoolApi` under the same parameter names, reaps expired
leases in the background, serves its pin channel, and pulls blocks from other pools
(``fetch_from``, the protocol in :mod:`~tessera_ray.actors.fetcher`, owners reached through
:mod:`~tessera_ray.actors.pool_link`). With ``directory_actor``, ``deploy`` and
``_ray_handles``, one of the four modules of ``actors/`` that import Ray.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import numpy as np
import ray
import torch

from tessera_ray.actors._heap import freeze_startup_heap
from tessera_ray.actors._pool_runtime import EngineSide, every, reap_forever, serve_channel
from tessera_ray.actors._ray_handles import ActorCache, ShardRef, start_this_actor
from tessera_ray.actors.announce import PoolAnnouncement, announce
from tessera_ray.actors.channel import ChannelAddress, ChannelServer
from tessera_ray.actors.config import PoolServiceConfig
from tessera_ray.actors.directory import Registration, Tier
from tessera_ray.actors.exporter import export_pool_status, pool_tags
from tessera_ray.actors.fetcher import Fetcher
from tessera_ray.actors.links import ShardedDirectory
from tessera_ray.actors.messages import (
    BlockCheck,
    BlockFailure,
    BlockReads,
    EvictionReport,
    PinTicket,
    PoolStatus,
    Reservation,
    StoredBlock,
)
from tessera_ray.actors.pool_link import PoolLinks
from tessera_ray.actors.pool_service import PoolService
from tessera_ray.actors.tenancy import Access, TenantGate
from tessera_ray.core import ContentHashFn, xxh3_128
from tessera_ray.core.results import TokenKey
from tessera_ray.errors import TierConfigError
from tessera_ray.layout import ModelLayout
from tessera_ray.metrics import get_metrics
from tessera_ray.transport import PeerInfo, make_transport
from tessera_ray.transport.factory import fallback_counts

__all__ = ["PoolActor"]

log = logging.getLogger(__name__)

FETCH_TIMEOUT_S = 30.0
"""Longest one pull from an owner may take, for a caller's ``fetch_from`` and an engine's pull
over the channel alike."""


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
        node = ray.get_runtime_context().get_node_id()
        self.ray_namespace = ray_namespace
        self.num_shards = num_shards
        actors = ActorCache(ray_namespace)
        self.directory = ShardedDirectory([ShardRef(actors, i) for i in range(num_shards)])
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
        self.metrics = get_metrics()
        self._links = PoolLinks(
            actors,
            label=f"pool {name}",
            channels=config.pin_channel,
            directory=self.directory,
        )
        self.fetcher = Fetcher(
            self.svc, self._links.link, self.metrics, pool_tags(ray_namespace, name, node)
        )
        self._channel_server: ChannelServer | None = None
        # One-sided reads need NIXL; without it (or with kind "ray") blocks move through the
        # object store (read_pinned + install), verified the same way.
        self.peer: PeerInfo | None = None
        if config.transport.kind in ("auto", "nixl"):
            # With the node, pools of this node are read through their mapped memory.
            transport = make_transport(config.transport, name=name, node=node)
            if transport.kind == "nixl":
                self.peer = self.svc.attach_transport(transport)
            else:
                transport.close()
                if config.transport.same_node == "mapped":
                    raise TierConfigError(
                        f"pool {name}: transport.same_node='mapped' needs NIXL here, which did "
                        "not start (see the logged fallback); use same_node='auto'"
                    )
        self._starting: asyncio.Future[None] | None = None
        # Start at once, not at the first call: a process Ray restarted is called by no one
        # until a caller notices, and engines on this node reach it only through the channel
        # it announces when it starts (the call runs once this constructor returns).
        start_this_actor()

    async def _start(self) -> None:
        """Start the background work once; every call waits until it has started (the first
        call may still be starting it when the next arrives)."""
        # On the first call: an async actor's __init__ has no loop yet.
        starting = self._starting
        if starting is None or (starting.done() and starting.exception() is not None):
            # Not started, or the last start failed (a shard down, a disk that refused): try
            # again, so the failure reaches this caller rather than only a log.
            starting = self._starting = asyncio.ensure_future(self._start_once())
        await asyncio.shield(starting)

    async def _start_once(self) -> None:
        name = self.svc.name
        # This process holds nothing in memory yet: replicas a previous incarnation registered
        # under this name are stale.
        await self.directory.purge(name)
        if self.peer is not None:
            await self.directory.publish_peer(self.peer)
        await self.svc.reopen_disk()
        if self.svc.config.pin_channel:
            host = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
            engine = EngineSide(
                self.svc,
                self.directory,
                lambda owner, access, keys: self.fetcher.fetch(
                    owner, access, keys, FETCH_TIMEOUT_S
                ),
                self.directory.purge,
                describe=self._describe,
                peer=lambda: self.peer,
            )
            self._channel_server = await serve_channel(self.svc, host, engine)
            self._announce()
        loop = asyncio.get_running_loop()
        export = every(self.svc.config.metrics_interval_s, f"pool {name} export", self._export)
        self._tasks = [loop.create_task(reap_forever(self.svc)), loop.create_task(export)]
        frozen = freeze_startup_heap()  # full collections would walk it all (see _heap)
        log.debug("pool %s: %d start-up objects frozen out of garbage collection", name, frozen)

    def _announce(self) -> None:
        """Tell processes on this node where the channel is (engines reach the tier through
        it without joining Ray: :mod:`~tessera_ray.actors.announce`)."""
        server = self._channel_server
        if server is None or server.address is None:
            return
        entry = PoolAnnouncement.of_this_process(
            self.ray_namespace, self.svc.name, self.svc.node, server.address
        )
        try:
            announce(entry)
        except OSError as e:  # engines on this node then find the pool through Ray
            log.warning("pool %s: could not announce its channel on this node: %s", entry.pool, e)

    async def channel(self) -> ChannelAddress | None:
        """Where readers ask this pool to pin and unpin without a Ray call (``None``: nowhere)."""
        await self._start()
        server = self._channel_server
        return server.address if server is not None else None

    def _export(self) -> None:
        export_pool_status(self.metrics, self._status(), self.ray_namespace, fallback_counts())

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

    async def describe(self) -> tuple[ModelLayout, PoolServiceConfig, int]:
        """The layout, settings and shard count this pool runs with (for clients that connect)."""
        return self._describe()

    def _describe(self) -> tuple[ModelLayout, PoolServiceConfig, int]:
        return self.svc.layout, self.svc.config, self.num_shards

    # ------------------------------------------------------------------ PoolApi (see pool_api)

    async def reserve(self, num_blocks: int, lease_s: float | None = None) -> Reservation:
        await self._start()
        return await self.svc.reserve(num_blocks, lease_s)

    async def commit(
        self,
        reservation_id: int,
        access: Access,
        token_keys: list[TokenKey],
        payloads: np.ndarray | torch.Tensor,
    ) -> list[StoredBlock]:
        await self._start()
        return await self.svc.commit(reservation_id, access, token_keys, payloads)

    async def abort(self, reservation_id: int) -> None:
        self.svc.abort(reservation_id)

    async def store(
        self, access: Access, token_keys: list[TokenKey], payloads: np.ndarray | torch.Tensor
    ) -> list[StoredBlock]:
        await self._start()
        return await self.svc.store(access, token_keys, payloads)

    async def contains(
        self, access: Access, token_keys: list[TokenKey], touch: bool = False
    ) -> list[Tier | None]:
        await self._start()
        return self.svc.contains(access, token_keys, touch)

    async def pin(
        self, access: Access, token_keys: list[TokenKey], lease_s: float | None = None
    ) -> PinTicket:
        await self._start()
        return await self.svc.pin(access, token_keys, lease_s)

    async def unpin(self, pin_id: int) -> bool:
        return self.svc.unpin(pin_id)

    async def read_pinned(self, pin_id: int) -> np.ndarray:
        return self.svc.read_pinned(pin_id)

    async def read(self, access: Access, token_keys: list[TokenKey]) -> list[np.ndarray | None]:
        await self._start()
        return await self.svc.read(access, token_keys)

    async def read_blocks(self, access: Access, token_keys: list[TokenKey]) -> BlockReads:
        await self._start()
        return await self.svc.read_blocks(access, token_keys)

    async def check_blocks(self, access: Access, token_keys: list[TokenKey]) -> list[BlockCheck]:
        await self._start()
        return await self.svc.check_blocks(access, token_keys)

    async def attend(
        self,
        access: Access,
        token_keys: list[TokenKey],
        positions: list[int],
        layer: int,
        q: torch.Tensor,
        seqlen: int,
        softmax_scale: float,
        causal: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        await self._start()
        args = (access, token_keys, positions, layer, q, seqlen, softmax_scale, causal)
        return self.svc.attend(*args)

    async def evict(self, num_blocks: int) -> EvictionReport:
        await self._start()
        return await self.svc.evict(num_blocks)

    async def inventory(self) -> list[Registration]:
        await self._start()
        return self.svc.inventory()

    async def status(self) -> PoolStatus:
        await self._start()
        return self._status()

    def _status(self) -> PoolStatus:
        """The service's snapshot with this shell's channel counts."""
        status = self.svc.status()
        server = self._channel_server
        if server is None:
            return status
        return dataclasses.replace(
            status, channel_pins=server.served["pin"], channel_refused=server.refused
        )

    # ------------------------------------------------------------------ the shell's own

    async def fetch_from(
        self,
        owner: str,
        access: Access,
        token_keys: list[TokenKey],
        timeout_s: float = FETCH_TIMEOUT_S,
    ) -> list[BlockFailure | None]:
        """Pull blocks from pool ``owner`` into this pool (:class:`Fetcher`); per key ``None``
        (installed or already here) or why not. The caller's access is checked here and again
        by the owner."""
        await self._start()
        return await self.fetcher.fetch(owner, access, token_keys, timeout_s)
