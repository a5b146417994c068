"""What the connector's two roads to a running tier share: an engine reaches the tier through
one pool on its own node, reads pinned blocks out of that pool's memory (mapped into this
process, or one-sided over NIXL), and stores into it in one call.

The roads differ only in how the pool is reached, each a subclass with one handle to it:
:class:`~tessera_ray.vllm.node_tier.NodeTier` over the pool's channel, found through the pool's
announcement on this node, with no Ray in the engine's processes (the usual road), and
:class:`~tessera_ray.vllm.ray_tier.RayTier` as a Ray driver (an engine on a node with no pool
of the tier, or a pool that serves no channel).
"""

from __future__ import annotations

import abc
import concurrent.futures
import logging
import threading
import time
import uuid
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from tessera_ray.actors.directory import Holder, Tier
from tessera_ray.actors.messages import BlockCheck, BlockReads, PinTicket
from tessera_ray.actors.tenancy import Access, TenantGate
from tessera_ray.core.results import TokenKey
from tessera_ray.errors import PoolUnavailableError, TierConfigError, TransportError
from tessera_ray.layout import ModelLayout
from tessera_ray.transport import PeerInfo
from tessera_ray.vllm.backend import PinnedHits, TierBackend, TierHit, tier_call
from tessera_ray.vllm.config import TesseraConnectorConfig
from tessera_ray.vllm.loop import run_on_loop, submit_on_loop
from tessera_ray.vllm.nixl_reader import PoolReader

__all__ = ["PIN_MARGIN_S", "PoolTier", "read_secret"]

log = logging.getLogger(__name__)

PIN_MARGIN_S = 1.0
"""How long before a pin's lease ends the copies out of its pages must be done: the pool may
reuse the pages from then, and two processes' wall clocks agree only to a tick."""
_T = TypeVar("_T")


class PoolTier(TierBackend):
    """A running tier reached through pool :attr:`pool` on this engine's node (module
    docstring). Subclasses say how the pool is reached: the ``_``-prefixed coroutines below."""

    node: str | None
    """The Ray node this process shares with its pool (its memory is mapped), or ``None``."""

    def __init__(self, config: TesseraConnectorConfig, layout: ModelLayout, pool: str) -> None:
        self.timeout_s = config.timeout_s
        self.layout = layout
        self.pool = self.local_pool = pool
        self._gate = TenantGate(read_secret(config.tenant_secret_file))
        self._credentials: dict[str, Access] = {}
        self._here = (Holder(pool, Tier.MEMORY),)
        self._staging_bytes = config.nixl_staging_bytes
        self._reader: PoolReader | None = None
        self._reader_tried = False
        self._reader_incarnation: int | None = None
        """The pool process the reader's peer is (``None``: the one ``prepare_reads`` met)."""
        self._reader_stale = False
        """A NIXL read failed: ask the pool for its agent again before the next one."""
        self._held: list[PinTicket] = []
        """Pins of reads served in place, until :meth:`end_reads` (the worker's step ends)."""
        self._held_lock = threading.Lock()  # read on the worker's read thread, ended on its own
        self.lookup_pins = 0
        """Reads that used the scheduler's lookup's pin instead of asking the pool for one."""

    # ---------------------------------------------------------------- how the pool is reached

    @abc.abstractmethod
    async def _find(self, access: Access, keys: list[TokenKey]) -> list[TierHit | None]:
        """Per key, its hash and holders (this pool first, the directory for the rest)."""

    async def _find_pinned(self, access: Access, keys: list[TokenKey]) -> PinnedHits:
        """:meth:`_find`, with the leading run this pool holds pinned; a road that cannot pin
        on a lookup pins nothing (the worker's read pins then)."""
        return await self._find(access, keys), None

    @abc.abstractmethod
    async def _pull(self, access: Access, keys: list[TokenKey], hits: Sequence[TierHit]) -> None:
        """Fetch into this pool the blocks ``hits`` place only elsewhere."""

    @abc.abstractmethod
    async def _pin(self, access: Access, keys: list[TokenKey]) -> PinTicket: ...

    @abc.abstractmethod
    def _unpin(self, pin_id: int) -> None:
        """End a pin without waiting (a lost unpin ends with the pin's lease)."""

    @abc.abstractmethod
    def _saw(self, incarnation: int) -> None:
        """A pool answer carried ``incarnation`` (a new one: a new pool process)."""

    @abc.abstractmethod
    async def _peer(self) -> PeerInfo | None:
        """The pool's NIXL data (``None``: it moves blocks only by copies of its answers)."""

    @abc.abstractmethod
    async def _read_blocks(self, access: Access, keys: list[TokenKey]) -> BlockReads: ...

    @abc.abstractmethod
    async def _check(self, access: Access, keys: list[TokenKey]) -> list[BlockCheck]: ...

    @abc.abstractmethod
    async def _store(self, access: Access, keys: list[TokenKey], payloads: np.ndarray) -> None:
        """Store in one call to the pool."""

    @abc.abstractmethod
    async def _close(self) -> None:
        """Close the handle to the pool (on the connector's loop, which owns it)."""

    # ---------------------------------------------------------------- shared

    def _run(self, what: str, coro: Coroutine[Any, Any, _T]) -> _T:
        with tier_call(what):
            return run_on_loop(coro, self.timeout_s)

    def _access(self, namespace: str) -> Access:
        """What calls for ``namespace`` present: a credential on a tier with a tenant secret."""
        if not self._gate.closed:
            return namespace
        cred = self._credentials.get(namespace)
        if cred is None:
            cred = self._credentials[namespace] = self._gate.issue(namespace)
        return cred

    def prepare_reads(self) -> None:
        """Open the read path to this node's pool (worker side, once): staging memory
        registered with NIXL, the pool's agent added and, on the pool's node, its memory mapped
        (:class:`PoolReader`). Where the pool moves blocks only by copies, or NIXL cannot
        start, reads come back as the pool's answers."""
        if self._reader_tried:
            return
        self._reader_tried = True
        blocks = self._staging_bytes // self.layout.block_bytes
        if blocks < 1 or len(self.layout.groups) != 1:
            # The mapped and NIXL reader stages one layer group; a hybrid layout's blocks span
            # several, and come back as the pool's answers.
            return
        try:
            peer = run_on_loop(self._peer(), self.timeout_s)
            if peer is None or peer.kind != "nixl":
                return
            self._reader = PoolReader(
                self.layout,
                peer,
                capacity_blocks=blocks,
                name=f"tessera-connector-{uuid.uuid4().hex[:12]}",
                node=self.node,
            )
        except (ConnectionError, PoolUnavailableError, TransportError, TimeoutError) as exc:
            log.warning(
                "reads from pool %s's memory unavailable (%s); reading its answers", self.pool, exc
            )

    def release_reads(self) -> None:
        self.end_reads()
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.close()
        submit_on_loop(self._close())

    async def _lookup(self, namespace: str, keys: list[TokenKey]) -> list[TierHit | None]:
        with tier_call("tier lookup"):
            return await self._find(self._access(namespace), keys)

    def lookup_async(
        self, namespace: str, keys: Sequence[TokenKey]
    ) -> concurrent.futures.Future[list[TierHit | None]]:
        return submit_on_loop(self._lookup(namespace, list(keys)))

    async def _lookup_pinned(self, namespace: str, keys: list[TokenKey]) -> PinnedHits:
        with tier_call("tier lookup"):
            return await self._find_pinned(self._access(namespace), keys)

    def lookup_pinned_async(
        self, namespace: str, keys: Sequence[TokenKey]
    ) -> concurrent.futures.Future[PinnedHits] | None:
        return submit_on_loop(self._lookup_pinned(namespace, list(keys)))

    def unpin(self, ticket: PinTicket) -> None:
        self._unpin(ticket.id)

    async def _pulled(
        self, access: Access, keys: list[TokenKey], hits: Sequence[TierHit] | None
    ) -> None:
        """Pull what the lookup found only elsewhere (nothing to do when this pool holds all)."""
        if hits is not None and any(self._here[0] not in h.holders for h in hits):
            await self._pull(access, keys, hits)

    async def _pull_and_read(
        self, access: Access, keys: list[TokenKey], hits: Sequence[TierHit] | None
    ) -> BlockReads:
        await self._pulled(access, keys, hits)
        return await self._read_blocks(access, keys)

    async def _pull_and_pin(
        self, access: Access, keys: list[TokenKey], hits: Sequence[TierHit] | None
    ) -> PinTicket:
        await self._pulled(access, keys, hits)
        return await self._pin(access, keys)

    def read(
        self,
        namespace: str,
        keys: Sequence[TokenKey],
        hits: Sequence[TierHit] | None = None,
        ticket: PinTicket | None = None,
    ) -> BlockReads:
        access, keys = self._access(namespace), list(keys)
        reader = self._reader
        if ticket is not None and (reader is None or len(ticket.blocks) != len(keys)):
            self._unpin(ticket.id)  # nothing here reads pinned pages in place: read as usual
            ticket = None
        if reader is None:
            return self._run("tier read", self._pull_and_read(access, keys, hits))
        if ticket is None:
            ticket = self._run("tier pin", self._pull_and_pin(access, keys, hits))
        else:
            self.lookup_pins += 1
        kept = False
        try:
            self._saw(ticket.incarnation)
            if ticket.incarnation != self._reader_incarnation:
                if self._reader_incarnation is not None or self._reader_stale:
                    self._repoint(reader)  # a new pool process: its NIXL agent is new
                self._reader_incarnation, self._reader_stale = ticket.incarnation, False
            reads = reader.read(ticket, self.timeout_s)
            if reads is not None:
                if reads.pinned:  # views of the pool's pages: the pin lasts until end_reads
                    with self._held_lock:
                        self._held.append(ticket)
                    kept = True
                return reads
        except TransportError as exc:  # the pool's agent went away: its answers still work
            log.warning("pool %s's memory read failed (%s); reading its answer", self.pool, exc)
            self._reader_incarnation, self._reader_stale = None, True
        finally:
            if not kept:
                self._unpin(ticket.id)
        return self._run("tier read", self._read_blocks(access, keys))

    def end_reads(self) -> bool:
        with self._held_lock:
            held, self._held = self._held, []
        now = time.time()  # the pool's lease clock: the same machine's wall clock
        for ticket in held:
            self._unpin(ticket.id)
        return all(now < ticket.expires_at_s - PIN_MARGIN_S for ticket in held)

    def _repoint(self, reader: PoolReader) -> None:
        peer = self._run("tier peer", self._peer())
        if peer is None or peer.kind != "nixl":
            raise TransportError(f"pool {self.pool} no longer serves NIXL reads")
        reader.repoint(peer)

    def report_unverified(self, namespace: str, keys: Sequence[TokenKey]) -> list[BlockCheck]:
        # Reads are served by this pool (fetched into it first), so its copies are the suspects.
        return self._run("tier check", self._check(self._access(namespace), list(keys)))

    def store(self, namespace: str, keys: Sequence[TokenKey], payloads: np.ndarray) -> None:
        self._run("tier store", self._store(self._access(namespace), list(keys), payloads))


def read_secret(path: str | None) -> bytes | None:
    """The tenant secret in the file ``path`` names (``None``: an open tier)."""
    if path is None:
        return None
    try:
        secret = Path(path).read_bytes().strip()
    except OSError as exc:
        raise TierConfigError(
            f"kv_connector_extra_config: tenant_secret_file {path!r} cannot be read: {exc}"
        ) from exc
    if len(secret) < 16:
        raise TierConfigError(
            f"kv_connector_extra_config: tenant_secret_file {path!r} holds under 16 bytes"
        )
    return secret
