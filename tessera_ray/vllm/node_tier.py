"""The connector's usual road to the tier: over the channel of the pool on this engine's node,
found through the pool's announcement (:mod:`~tessera_ray.actors.announce`). The engine's
processes never join Ray: no driver threads, nothing for Ray's GCS to serve while the engine is
idle (docs/connector-cost.md).

Everything is one handle, the channel to that pool, and every verb one call on it: ``find`` (the
pool answers what it holds and asks the directory for the rest), ``pull`` (the pool fetches what
is held elsewhere), ``pin`` and ``unpin`` around a read out of the pool's mapped memory,
``store_mapped`` (one call per step's batch: the bytes are written once into a shared-memory
slab of this engine's, which the pool maps, and copied from there into its pages),
``read_into`` (a read the mapped reader cannot serve, such as a hybrid layout's, answered into
another slab) and ``check_blocks``. A channel that breaks fails the call (the engine
recomputes); the next call reads the announcement again and connects to whatever process
serves the pool now (a restarted pool announces a new channel).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from tessera_ray.actors._client_nodes import inherited_raylet_node
from tessera_ray.actors.announce import PoolAnnouncement, announced, running
from tessera_ray.actors.channel import (
    MAX_FRAME_BYTES,
    ChannelClient,
    ChannelError,
    send_if_open,
)
from tessera_ray.actors.messages import BlockCheck, BlockReads, PinTicket
from tessera_ray.actors.tenancy import Access
from tessera_ray.core.results import BlockHash, TokenKey
from tessera_ray.core.shm import SlabInfo, shared_host_zeros, slab_of
from tessera_ray.errors import (
    PeerMappingError,
    PoolConfigError,
    PoolMemoryError,
    PoolUnavailableError,
    TierConfigError,
)
from tessera_ray.layout import ModelLayout
from tessera_ray.transport import PeerInfo
from tessera_ray.vllm.backend import PinnedHits, TierHit, tier_call
from tessera_ray.vllm.config import TesseraConnectorConfig
from tessera_ray.vllm.loop import run_on_loop, submit_on_loop
from tessera_ray.vllm.pool_tier import PoolTier

__all__ = ["NodeTier", "announced_pool"]

log = logging.getLogger(__name__)

_CONNECT_TIMEOUT_S = 5.0
SHM_DIR = "/dev/shm"
"""Where an engine makes its store slab (the pools' default shared-memory directory; a pool
maps only slabs in its own)."""
SLAB_BYTES = 64 << 20
"""Each slab's size (one for stores, one for reads): larger batches go in several calls."""


def announced_pool(config: TesseraConnectorConfig) -> PoolAnnouncement | None:
    """The pool this engine reaches over its channel: the one ``config`` names, else one of the
    tier's namespace announced on this machine, on this process's Ray node where that is known
    without Ray (a process under a Ray worker, such as a Serve replica's engine, inherits it;
    several Ray nodes can share a machine), else the first by name (``None``: none is)."""
    pools = announced(config.ray_namespace)
    if config.pool is not None:
        return next((p for p in pools if p.pool == config.pool), None)
    node = os.environ.get("RAY_NODE_ID") or inherited_raylet_node()
    return next((p for p in pools if p.node == node), pools[0] if pools else None)


class _Slab:
    """One of this engine's shared-memory slabs, through which a store's or a read's bytes pass
    between this process and the pool (made at its first use, used by one call at a time)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.rows = 1
        self.row_bytes = 0
        self._made: tuple[SlabInfo, np.ndarray] | None = None
        self._tensor: Any = None
        """Keeps the slab mapped (and its file) while this engine lives."""
        self._tried = False
        self._lock: asyncio.Lock | None = None

    def get(self) -> tuple[SlabInfo, np.ndarray] | None:
        """The slab and its rows; ``None`` where none can be had (the bytes then travel in the
        calls)."""
        if self._made is None and not self._tried:
            self._tried = True
            try:
                tensor = shared_host_zeros(SHM_DIR, self.rows, self.row_bytes)
            except (PoolConfigError, PoolMemoryError) as exc:
                log.info(
                    "no %s slab in %s (%s): the bytes travel in the calls", self.what, SHM_DIR, exc
                )
                return None
            info = slab_of(tensor)
            assert info is not None, "a slab made here is known here"
            self._made, self._tensor = (info, tensor.numpy()), tensor
        return self._made

    def lock(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()  # on the connector's loop, which runs every call
        return self._lock

    def refused(self, pool: str, exc: BaseException) -> None:
        """The pool cannot map this slab (it runs in another container, or has another shared
        memory directory): the bytes travel in the calls from now on."""
        log.info("pool %s cannot map this engine's %s slab: %s", pool, self.what, exc)
        self._made = self._tensor = None


class NodeTier(PoolTier):
    """The running tier through the channel of pool ``entry`` (module docstring)."""

    def __init__(self, config: TesseraConnectorConfig, entry: PoolAnnouncement) -> None:
        self.namespace = config.ray_namespace
        self.node = entry.node
        self._channel: ChannelClient | None = None
        self._entry = entry
        self._connected_once = False
        self._rows_per_call = 1
        self._store_slab = _Slab("store")
        self._read_slab = _Slab("read")
        with tier_call("tier describe"):
            layout = run_on_loop(self._describe_when_up(config.timeout_s), config.timeout_s + 1.0)
        if not isinstance(layout, ModelLayout):
            raise TierConfigError(f"pool {entry.pool} described its layout as {layout!r}")
        super().__init__(config, layout, entry.pool)
        for slab in (self._store_slab, self._read_slab):
            slab.rows = max(1, SLAB_BYTES // layout.block_bytes)
            slab.row_bytes = layout.block_bytes
        # A frame carries at most MAX_FRAME_BYTES: stores and reads go in runs that fit.
        self._rows_per_call = max(1, (MAX_FRAME_BYTES // 2) // layout.block_bytes)

    # ---------------------------------------------------------------- the one handle

    async def _describe_when_up(self, timeout_s: float) -> Any:
        """The pool's layout, asked until ``timeout_s`` passes: at the engine's start the pool
        may be restarting (its old process gone, the new one not yet listening), and the engine
        waits for it rather than failing. Later calls never wait like this: a pool that is down
        then costs the engine a recompute, not a stall."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        pause = 0.05
        while True:
            try:
                layout, _, _ = await self._ask(max(0.1, deadline - loop.time()), "describe")
                return layout
            except (ChannelError, PoolUnavailableError) as e:
                if loop.time() >= deadline:
                    entry = self._entry
                    now = "running" if running(entry) else "gone"
                    raise type(e)(
                        f"{e} (pool {entry.pool}, announced by process {entry.pid}, {now}; "
                        f"asked for {timeout_s:.0f} s)"
                    ) from e
                log.info("pool %s not reached yet (%s): asking again", self._entry.pool, e)
            await asyncio.sleep(max(0.0, min(pause, deadline - loop.time())))
            pause = min(1.0, pause * 2)

    async def _connect(self, timeout_s: float) -> ChannelClient:
        channel = self._channel
        if channel is not None and not channel.closed:
            return channel
        if self._connected_once:
            # The channel broke or never opened: the pool's process may have gone, and its
            # successor announces another channel.
            fresh = next((p for p in announced(self.namespace) if p.pool == self._entry.pool), None)
            if fresh is None:
                raise PoolUnavailableError(f"pool {self._entry.pool} is not announced on this node")
            self._entry = fresh
        self._connected_once = True
        wait_s = min(timeout_s, _CONNECT_TIMEOUT_S)
        opened = await ChannelClient.connect(self._entry.address, wait_s)
        if self._channel is not None and not self._channel.closed:  # connected meanwhile
            opened.close()
            return self._channel
        self._channel = opened
        return opened

    async def _ask(self, timeout_s: float, op: str, *args: Any) -> Any:
        """One call on the channel; a broken channel fails it (the next call reconnects)."""
        channel = await self._connect(timeout_s)
        try:
            return await channel.call(op, *args, timeout_s=timeout_s)
        except ChannelError:
            channel.close()
            raise

    async def _call(self, op: str, *args: Any) -> Any:
        return await self._ask(self.timeout_s, op, *args)

    # ---------------------------------------------------------------- PoolTier

    async def _find(self, access: Access, keys: list[TokenKey]) -> list[TierHit | None]:
        found = await self._call("find", access, keys)
        return [None if f is None else TierHit(*f) for f in found]

    async def _find_pinned(self, access: Access, keys: list[TokenKey]) -> PinnedHits:
        found, ticket = await self._call("find_pinned", access, keys)
        return [None if f is None else TierHit(*f) for f in found], ticket

    async def _pull(self, access: Access, keys: list[TokenKey], hits: Sequence[TierHit]) -> None:
        await self._call("pull", access, keys, [h.holders for h in hits])

    async def _pin(self, access: Access, keys: list[TokenKey]) -> PinTicket:
        ticket: PinTicket = await self._call("pin", access, keys)
        return ticket

    def _unpin(self, pin_id: int) -> None:
        # Sent from the loop's thread (a transport is not safe to write from another).
        submit_on_loop(self._send_unpin(pin_id))

    async def _send_unpin(self, pin_id: int) -> None:
        send_if_open(self._channel, "unpin", pin_id)

    def _saw(self, incarnation: int) -> None:
        """Nothing to do: a new pool process was reached through a new channel already."""

    async def _peer(self) -> PeerInfo | None:
        peer: PeerInfo | None = await self._call("peer")
        return peer

    def _runs(self, count: int) -> list[slice]:
        step = self._rows_per_call
        return [slice(i, i + step) for i in range(0, count, step)]

    async def _read_blocks(self, access: Access, keys: list[TokenKey]) -> BlockReads:
        slab = self._read_slab.get()
        if slab is None:
            return await self._read_answers(access, keys)
        info, rows = slab
        # A read that fits the slab is one call, its rows left where the pool wrote them (lent);
        # a larger one goes in runs, each copied out before the next is written there.
        payloads = None
        if len(keys) > len(rows):
            payloads = np.empty((len(keys), self.layout.block_bytes), dtype=np.uint8)
        hashes: list[BlockHash | None] = []
        held = 0
        async with self._read_slab.lock():  # one read at a time is written into the slab
            for start in range(0, len(keys), len(rows)):
                run = keys[start : start + len(rows)]
                try:
                    found = await self._call("read_into", access, run, info)
                except PeerMappingError as exc:
                    self._read_slab.refused(self.pool, exc)
                    rest = await self._read_answers(access, keys[start:])
                    if payloads is None:
                        return rest
                    found, rows = rest.block_hashes, rest.payloads
                count = sum(h is not None for h in found)
                if payloads is None:
                    return BlockReads.of(found, rows[:count], carrier="slab", lent=True)
                payloads[held : held + count] = rows[:count]
                hashes.extend(found)
                held += count
                if len(hashes) == len(keys):
                    break
        assert payloads is not None
        return BlockReads.of(hashes, payloads[:held], carrier="slab")

    async def _read_answers(self, access: Access, keys: list[TokenKey]) -> BlockReads:
        """The read's bytes in the pool's answers (no slab), in runs that fit a frame."""
        runs = self._runs(len(keys))
        if len(runs) <= 1:
            reads: BlockReads = await self._call("read_blocks", access, keys)
            return reads
        return BlockReads.joined([await self._call("read_blocks", access, keys[r]) for r in runs])

    async def _check(self, access: Access, keys: list[TokenKey]) -> list[BlockCheck]:
        checked: list[BlockCheck] = await self._call("check_blocks", access, keys)
        return checked

    async def _store(self, access: Access, keys: list[TokenKey], payloads: np.ndarray) -> None:
        slab = self._store_slab.get()
        if slab is None:
            return await self._store_in_calls(access, keys, payloads)
        info, rows = slab
        async with self._store_slab.lock():  # one store at a time writes the slab
            for start in range(0, len(keys), len(rows)):
                count = min(len(rows), len(keys) - start)
                np.copyto(rows[:count], payloads[start : start + count])
                try:
                    await self._call(
                        "store_mapped", access, keys[start : start + count], info, count
                    )
                except PeerMappingError as exc:  # the pool cannot map it (another container)
                    self._store_slab.refused(self.pool, exc)
                    return await self._store_in_calls(access, keys[start:], payloads[start:])

    async def _store_in_calls(
        self, access: Access, keys: list[TokenKey], payloads: np.ndarray
    ) -> None:
        """The store's bytes in the calls themselves (no slab), in runs that fit a frame."""
        for run in self._runs(len(keys)):
            await self._call("store", access, keys[run], payloads[run])

    async def _close(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()
