"""The pool actor: a thin async Ray shell over :class:`PoolService`, one per GPU (or per node
on CPU clusters), placed by node affinity. It reaps expired leases in the background and pulls
blocks from other pools (``fetch_from``): pin on the owner, move the bytes, verify every page
against the owner's content hash, install, unpin. With ``directory_actor``, ``client`` and
``_ray_names``, one of the modules of ``actors/`` that make Ray calls.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

import numpy as np
import ray

from tessera_ray.actors._heap import freeze_startup_heap
from tessera_ray.actors._ray_names import CALL_TIMEOUT_S as _CALL_TIMEOUT_S
from tessera_ray.actors._ray_names import DEAD as _DEAD
from tessera_ray.actors.channel import (
    ChannelAddress,
    ChannelClient,
    ChannelError,
    ChannelServer,
    PendingCall,
)
from tessera_ray.actors.config import PoolServiceConfig
from tessera_ray.actors.directory import (
    Registration,
    Tier,
)
from tessera_ray.actors.directory_actor import ShardedDirectory
from tessera_ray.actors.exporter import export_pool_status, pool_tags
from tessera_ray.actors.messages import (
    BlockCheck,
    BlockReads,
    PinTicket,
    PoolStatus,
    Reservation,
    StoredBlock,
)
from tessera_ray.actors.pool_service import PoolService
from tessera_ray.actors.pool_transfer import is_hash_mismatch
from tessera_ray.actors.tenancy import Access, TenantGate
from tessera_ray.core import ContentHashFn, xxh3_128
from tessera_ray.core.results import TokenKey
from tessera_ray.errors import PageShapeError, PoolExhaustedError, TenantError, TransportError
from tessera_ray.layout import ModelLayout
from tessera_ray.metrics import get_metrics
from tessera_ray.transport import PeerInfo, make_transport
from tessera_ray.transport.factory import fallback_counts

__all__ = ["PoolActor"]

log = logging.getLogger(__name__)


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
        self.directory = ShardedDirectory(ray_namespace, num_shards)
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
        self._owners: dict[str, Any] = {}
        """Actor handles of the pools this one fetched from (dropped when one fails)."""
        self._channels: dict[str, ChannelClient | None] = {}
        """Per owner, the open channel to it, or ``None`` where it serves none (Ray only)."""
        self._channel_server: ChannelServer | None = None
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
        if self.svc.config.pin_channel:
            await self._serve_channel()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._reaper()), loop.create_task(self._exporter())]
        frozen = freeze_startup_heap()  # full collections would walk it all (see _heap)
        log.debug(
            "pool %s: %d start-up objects frozen out of garbage collection", self.svc.name, frozen
        )

    async def _serve_channel(self) -> None:
        server = ChannelServer(
            {
                "pin": self._channel_pin,
                "unpin": self._unpin_quietly,
                "lookup": self.svc.resident_hashes,
            },
            host=ray.util.get_node_ip_address(),  # type: ignore[no-untyped-call]
        )
        try:
            await server.start()
        except OSError as e:  # no port to listen on: readers keep pinning through Ray
            log.warning("pool %s serves no pin channel: %s", self.svc.name, e)
            return
        self._channel_server = server

    def _channel_pin(self, access: Access, keys: list[TokenKey]) -> Any:
        """A pin asked on the channel: answered at once when every block is in memory or
        nowhere (the usual case), else the awaitable of the full pin (restores from disk)."""
        ticket = self.svc.pin_resident(access, keys)
        return ticket if ticket is not None else self.svc.pin(access, keys)

    def _unpin_quietly(self, pin_id: int) -> None:
        self.svc.unpin(pin_id)

    async def channel(self) -> ChannelAddress | None:
        """Where readers ask this pool to pin and unpin without a Ray call (``None``: nowhere)."""
        await self._start()
        server = self._channel_server
        return server.address if server is not None else None

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

    async def read_blocks(self, namespace: Access, keys: list[TokenKey]) -> BlockReads:
        """Payloads with the block hashes to check them against (see :class:`BlockReads`)."""
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
        reservation: Reservation | None = None
        try:
            owner = self._owner(owner_name)
            ticket, channel, reservation = await self._pin_at(
                owner_name, owner, access, keys, timeout_s
            )
        except (*_DEAD, ValueError, TimeoutError) as exc:
            self._owners.pop(owner_name, None)  # a pool of that name may come back as another actor
            self._drop_channel(owner_name)
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
                if channel is None:  # the new process may serve a channel the old one did not
                    self._channels.pop(owner_name, None)
                self._incarnations[owner_name] = ticket.incarnation
            peer = await self._peer_of(owner_name, owner)
            reasons: list[str | None]
            if peer is not None:
                reasons = await self.svc.fetch_pinned(ticket, peer, timeout_s, reservation)
            else:
                reasons = [
                    None if b is not None else f"not held by {owner_name}" for b in ticket.blocks
                ]
                held = [b for b in ticket.blocks if b is not None]
                if held:
                    payload: Any = await asyncio.wait_for(
                        owner.read_pinned.remote(ticket.id), timeout_s
                    )
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
            self._owners.pop(owner_name, None)
            return [f"transfer from {owner_name} failed: {type(exc).__name__}"] * len(keys)
        finally:
            if reservation is not None:  # what the fetch did not take over goes back
                self.svc.abort(reservation.id)
            # Not awaited: the lease ends a pin anyway. A suspect's check must follow the unpin,
            # so that one goes through Ray, whose answer says when it landed.
            if suspects:
                unpinned: Any = owner.unpin.remote(ticket.id)
                task = asyncio.get_running_loop().create_task(
                    self._report(owner, unpinned, access, suspects)
                )
                self._reports.add(task)
                task.add_done_callback(self._reports.discard)
            elif not self._unpin_over(channel, ticket.id):
                owner.unpin.remote(ticket.id)

    @staticmethod
    def _unpin_over(channel: ChannelClient | None, pin_id: int) -> bool:
        """Send the unpin over ``channel``; False when it cannot go that way."""
        if channel is None or channel.closed:
            return False
        try:
            channel.send("unpin", pin_id)
        except ChannelError:
            return False
        return True

    async def _pin_at(
        self, owner_name: str, owner: Any, access: Access, keys: list[TokenKey], timeout_s: float
    ) -> tuple[PinTicket, ChannelClient | None, Reservation | None]:
        """Pin ``keys`` on the owner: over its channel, else (none, or it broke) as a Ray
        call. While the owner pins, slots for every key are reserved here (what the owner
        does not hold is freed by the fetch): the reservation no longer waits for the pin
        round trip. Returns the ticket, the channel it came through and the reservation."""
        channel = await self._channel_to(owner_name, owner)
        pending: PendingCall | None = None
        if channel is not None:
            try:
                pending = channel.request("pin", access, keys)
            except ChannelError:
                self._channels.pop(owner_name, None)
        ref: Any = owner.pin.remote(access, keys) if pending is None else None
        try:
            reservation = await self._reserve_for(len(keys))
        except BaseException:
            if pending is not None:
                pending.cancel()  # an answered pin is reaped when its lease ends
            raise
        try:
            if pending is not None:
                try:
                    return await pending.answer(timeout_s), channel, reservation
                except ChannelError:  # broken or refused: the Ray call decides
                    self._channels.pop(owner_name, None)
                    ref = owner.pin.remote(access, keys)
            ticket: PinTicket = await asyncio.wait_for(ref, timeout_s)
        except BaseException:
            if reservation is not None:
                self.svc.abort(reservation.id)
            raise
        return ticket, None, reservation

    async def _reserve_for(self, num_blocks: int) -> Reservation | None:
        """Slots for a one-sided fetch of ``num_blocks``, or ``None`` (no transport, or no
        room now: the fetch then reserves what the owner holds, as it did alone)."""
        if self.svc.transport is None or not num_blocks:
            return None
        try:
            return await self.svc.reserve(num_blocks)
        except (PoolExhaustedError, PageShapeError):
            return None

    def _owner(self, owner_name: str) -> Any:
        """The owner's actor handle, looked up once: a lookup is a blocking call to Ray's
        control store (0.4 ms here), on this actor's event loop, on every fetch otherwise."""
        handle = self._owners.get(owner_name)
        if handle is None:
            handle = ray.get_actor(owner_name, namespace=self.ray_namespace)
            self._owners[owner_name] = handle
        return handle

    async def _channel_to(self, owner_name: str, owner: Any) -> ChannelClient | None:
        """The open channel to ``owner_name``, connecting on first use; ``None`` when this pool
        or the owner does not use one, or it cannot be reached (pins then go through Ray)."""
        if not self.svc.config.pin_channel:
            return None
        if owner_name in self._channels:
            known = self._channels[owner_name]
            if known is None or not known.closed:
                return known
        try:
            address = await asyncio.wait_for(owner.channel.remote(), _CALL_TIMEOUT_S)
            client = None if address is None else await ChannelClient.connect(address, 5.0)
        except ChannelError as e:
            log.info(
                "pool %s: no channel to %s (%s); pinning through Ray", self.svc.name, owner_name, e
            )
            return None  # asked again next time: the owner may be back
        known = self._channels.get(owner_name)
        if known is not None and not known.closed:
            # Another fetch connected meanwhile: keep one connection per owner.
            if client is not None:
                client.close()
            return known
        self._channels[owner_name] = client
        return client

    def _drop_channel(self, owner_name: str) -> None:
        client = self._channels.pop(owner_name, None)
        if client is not None:
            client.close()

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
