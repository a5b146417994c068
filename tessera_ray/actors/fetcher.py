"""Pulling blocks from another pool into this one: the cross-pool fetch protocol, without Ray.

The pool actor (Ray) and single-process use differ only in how they reach the owner pool: an
:class:`OwnerLink`. :class:`Fetcher` runs the protocol over it, so every way a fetch can fail
is a unit test with an in-process owner (:class:`LocalOwnerLink`).

Per owner, one fetch:

1. Pin the keys on the owner; while the pin is on its way, reserve a slot here for every key
   (what the owner does not hold is freed by the read). An owner that does not answer makes
   every key ``OWNER_UNAVAILABLE``; the reader looks elsewhere or recomputes.
2. If the owner restarted since the last fetch (its incarnation changed), forget its transport
   agent: the new process registered new memory under the same name.
3. Move the bytes: a one-sided read into the reserved slots where both pools share a transport,
   else the owner's pinned bytes as one payload. Either way every page is checked against the
   content hash the owner sealed it under before anything is sealed here.
4. Give back the reserved slots the read did not take; unpin. A block whose bytes hashed
   otherwise is reported to the owner once the unpin has landed, so that the owner checks its
   copy and drops it if it rotted (otherwise every later fetch of it would fail the same way).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from tessera_ray.actors.messages import (
    NOT_HELD,
    BlockFailure,
    FetchFailure,
    PinTicket,
    Reservation,
)
from tessera_ray.actors.tenancy import Access
from tessera_ray.core.results import TokenKey
from tessera_ray.errors import (
    PageShapeError,
    PoolExhaustedError,
    PoolUnavailableError,
    TenantError,
    TransferFailedError,
    TransportConfigError,
    TransportError,
)
from tessera_ray.metrics import Metrics
from tessera_ray.transport import PeerInfo

if TYPE_CHECKING:
    from tessera_ray.actors.pool_service import PoolService

__all__ = ["OwnerLink", "PendingPin", "Fetcher", "LocalOwnerLink"]

log = logging.getLogger(__name__)


class PendingPin(Protocol):
    """A pin request already sent to the owner."""

    async def answer(self, timeout_s: float) -> PinTicket:
        """The owner's ticket; raises :class:`PoolUnavailableError` when it does not come."""
        ...

    def cancel(self) -> None:
        """The answer is not wanted (its pin ends with its lease)."""
        ...


class OwnerLink(Protocol):
    """One owner pool as a fetching pool reaches it. Every failure to reach the owner is an
    :class:`~tessera_ray.errors.PoolUnavailableError`."""

    name: str

    async def pin(self, access: Access, keys: list[TokenKey]) -> PendingPin:
        """Send a pin request (the answer is awaited later, once slots are reserved here)."""
        ...

    async def peer_info(self) -> PeerInfo | None:
        """The owner's transport data (``None``: it has no one-sided transport)."""
        ...

    async def read_pinned(self, pin_id: int, timeout_s: float) -> np.ndarray:
        """The pinned blocks' bytes, one row per held block."""
        ...

    def unpin(self, pin_id: int) -> None:
        """End a pin; not awaited (a lost unpin ends with the lease)."""
        ...

    async def check_after_unpin(self, pin_id: int, access: Access, keys: list[TokenKey]) -> None:
        """Unpin, then have the owner check its copies of ``keys`` once the unpin landed."""
        ...

    def forget(self) -> None:
        """The owner failed: drop cached handles and connections (it may come back)."""
        ...

    def saw(self, incarnation: int) -> bool:
        """Record the owner's incarnation from its answer; True when it differs from the one
        seen before (first contact, or a new process under the same name)."""
        ...


class Fetcher:
    """Runs the fetch protocol (module docstring) for one pool, against owners reached through
    ``link_to(owner_name)``."""

    def __init__(
        self,
        svc: PoolService,
        link_to: Callable[[str], OwnerLink],
        metrics: Metrics | None = None,
        tags: dict[str, str] | None = None,
    ) -> None:
        self.svc = svc
        self._link_to = link_to
        self._metrics = metrics
        self._tags = tags or {}
        self._reports: set[asyncio.Task[None]] = set()  # the loop holds tasks weakly

    async def fetch(
        self, owner_name: str, access: Access, keys: list[TokenKey], timeout_s: float
    ) -> list[BlockFailure | None]:
        """:meth:`pull`, counted in the transfer metrics; ``owner_name`` this pool itself
        (a disk replica here) restores the blocks from disk instead."""
        self.svc.gate.resolve(access, write=False)
        if owner_name == self.svc.name:  # pinning restores a disk-only block
            ticket = await self.svc.pin(access, keys)
            self.svc.unpin(ticket.id)
            return [None if b is not None else NOT_HELD for b in ticket.blocks]
        began = time.perf_counter()
        reasons = await self.pull(owner_name, access, keys, timeout_s)
        if self._metrics is not None:
            installed = sum(r is None for r in reasons)
            m, tags = self._metrics, self._tags
            m.observe("tessera_transfer_latency_seconds", time.perf_counter() - began, tags)
            m.inc("tessera_transfer_bytes", installed * self.svc.block_bytes, tags)
            m.inc("tessera_transfer_errors", len(reasons) - installed, tags)
        return reasons

    async def pull(
        self, owner_name: str, access: Access, keys: list[TokenKey], timeout_s: float
    ) -> list[BlockFailure | None]:
        """Fetch ``keys`` from ``owner_name`` into this pool; per key ``None`` (installed) or
        why not. Raises only for the caller's own errors (its access, malformed keys)."""
        namespace = self.svc.gate.resolve(access, write=False)
        try:
            link = self._link_to(owner_name)
            ticket, reservation = await self._pin(link, access, keys, timeout_s)
        except (PoolUnavailableError, TimeoutError) as exc:
            return [BlockFailure(FetchFailure.OWNER_UNAVAILABLE, str(exc))] * len(keys)
        suspects: list[TokenKey] = []
        try:
            if ticket.namespace != namespace:
                detail = f"owner {owner_name} answered for another namespace"
                return [BlockFailure(FetchFailure.WRONG_NAMESPACE, detail)] * len(keys)
            if link.saw(ticket.incarnation):
                self._forget_peer(owner_name)  # a new process registered new memory
            reasons = await self._move(link, namespace, ticket, reservation, timeout_s)
            suspects = [
                k
                for k, r in zip(keys, reasons, strict=True)
                if r is not None and r.reason is FetchFailure.HASH_MISMATCH
            ]
            return reasons
        except (PoolUnavailableError, TimeoutError, TransportError) as exc:
            # The owner died mid-read (or its agent went away): the read gave its reserved
            # slots back (slots a read may still write are freed only once it is cancelled);
            # these blocks are misses, fetched elsewhere or recomputed.
            self._forget_peer(owner_name)
            link.forget()
            detail = f"transfer from {owner_name} failed: {type(exc).__name__}: {exc}"
            return [BlockFailure(FetchFailure.TRANSFER_FAILED, detail)] * len(keys)
        finally:
            if reservation is not None:  # what the fetch did not take over goes back
                self.svc.abort(reservation.id)
            if suspects:
                self._report(link, ticket.id, access, suspects)
            else:
                link.unpin(ticket.id)

    async def _pin(
        self, link: OwnerLink, access: Access, keys: list[TokenKey], timeout_s: float
    ) -> tuple[PinTicket, Reservation | None]:
        """The owner's ticket and the slots reserved here meanwhile."""
        try:
            pending = await link.pin(access, keys)
        except PoolUnavailableError:
            link.forget()
            raise
        try:
            reservation = await self._reserve_for(len(keys))
        except BaseException:
            pending.cancel()  # an answered pin is reaped when its lease ends
            raise
        try:
            return await pending.answer(timeout_s), reservation
        except BaseException as exc:
            if reservation is not None:
                self.svc.abort(reservation.id)
            if isinstance(exc, PoolUnavailableError | TimeoutError):
                link.forget()
            raise

    async def _reserve_for(self, num_blocks: int) -> Reservation | None:
        """Slots for a one-sided read of ``num_blocks``, or ``None`` (no transport, or no
        room now: the read then reserves what the owner holds)."""
        if self.svc.transport is None or not num_blocks:
            return None
        try:
            return await self.svc.reserve(num_blocks)
        except (PoolExhaustedError, PageShapeError):
            return None

    async def _move(
        self,
        link: OwnerLink,
        namespace: str,
        ticket: PinTicket,
        reservation: Reservation | None,
        timeout_s: float,
    ) -> list[BlockFailure | None]:
        peer = await self._peer(link)
        if peer is not None:
            return await self.svc.fetch_pinned(ticket, peer, timeout_s, reservation)
        reasons: list[BlockFailure | None] = [
            None if b is not None else NOT_HELD for b in ticket.blocks
        ]
        held = [b for b in ticket.blocks if b is not None]
        if not held:
            return reasons
        payload = await link.read_pinned(ticket.id, timeout_s)
        result = await self.svc.install(namespace, held, payload)
        errors = iter(result.errors)
        return [
            next(errors) if b is not None else r
            for b, r in zip(ticket.blocks, reasons, strict=True)
        ]

    async def _peer(self, link: OwnerLink) -> str | None:
        """The owner's transport name, its agent added once; ``None``: bytes go as a payload."""
        transport = self.svc.transport
        if transport is None:
            return None
        if link.name in transport.peers:
            return link.name
        info = await link.peer_info()
        if info is None or info.kind != transport.kind:
            return None
        try:
            transport.add_peers([info])
        except TransportConfigError as exc:  # its agent is gone (or never reachable from here)
            raise TransferFailedError(f"cannot reach {link.name}'s transport: {exc}") from exc
        return info.name

    def _forget_peer(self, owner_name: str) -> None:
        transport = self.svc.transport
        if transport is not None and owner_name in transport.peers:
            transport.remove_peers([owner_name])

    def _report(self, link: OwnerLink, pin_id: int, access: Access, keys: list[TokenKey]) -> None:
        """Have the owner check ``keys`` after the unpin, in the background: the fetch's
        outcome does not wait for it."""

        async def report() -> None:
            try:
                await link.check_after_unpin(pin_id, access, keys)
            except (PoolUnavailableError, TenantError) as exc:
                log.warning("could not have %d blocks checked by their owner: %s", len(keys), exc)

        task = asyncio.get_running_loop().create_task(report())
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

    async def drain_reports(self) -> None:
        """Wait for the owner checks sent so far (tests, shutdown)."""
        while self._reports:
            await asyncio.gather(*list(self._reports), return_exceptions=True)


class _Answered:
    """A pin answered in-process (or its failure), as a :class:`PendingPin`."""

    def __init__(self, call: Any) -> None:
        self._call = call

    async def answer(self, timeout_s: float) -> PinTicket:
        try:
            ticket: PinTicket = await asyncio.wait_for(self._call, timeout_s)
        except TimeoutError as exc:
            raise PoolUnavailableError(f"no pin answer within {timeout_s} s") from exc
        return ticket

    def cancel(self) -> None:
        self._call.close()


class LocalOwnerLink:
    """An owner :class:`PoolService` in this process (tests, single-process use). ``alive``
    set to False makes every call fail as a dead owner's would."""

    def __init__(self, owner: PoolService, peer: PeerInfo | None = None) -> None:
        self.owner = owner
        self.name = owner.name
        self.peer = peer
        self.alive = True
        self.forgotten = 0
        self.restarts = 0
        self.incarnation: int | None = None

    def _check_alive(self) -> None:
        if not self.alive:
            raise PoolUnavailableError(f"owner {self.name} unavailable: its process is gone")

    async def pin(self, access: Access, keys: list[TokenKey]) -> PendingPin:
        self._check_alive()
        return _Answered(self._pin(access, keys))

    async def _pin(self, access: Access, keys: list[TokenKey]) -> PinTicket:
        self._check_alive()
        return await self.owner.pin(access, keys)

    async def peer_info(self) -> PeerInfo | None:
        self._check_alive()
        return self.peer

    async def read_pinned(self, pin_id: int, timeout_s: float) -> np.ndarray:
        self._check_alive()
        return self.owner.read_pinned(pin_id)

    def unpin(self, pin_id: int) -> None:
        if self.alive:
            self.owner.unpin(pin_id)

    async def check_after_unpin(self, pin_id: int, access: Access, keys: list[TokenKey]) -> None:
        self._check_alive()
        self.owner.unpin(pin_id)
        await self.owner.check_blocks(access, keys)

    def forget(self) -> None:
        self.forgotten += 1

    def saw(self, incarnation: int) -> bool:
        if self.incarnation == incarnation:
            return False
        self.incarnation = incarnation
        self.restarts += 1
        return True
