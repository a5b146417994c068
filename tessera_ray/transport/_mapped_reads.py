"""The reads a transport carries through mapped peer memory: the mapped peers, each read from
its start to the wait or abort that settles it, and their counts.

A read copies out of the peer's mapping into the reader's slots in chunks of about
``hash_chunk_bytes`` (at least :data:`MIN_COPY_BYTES`), each chunk's pages hashed right after
they landed (still in cache), then asks whether the owner still lives: a read that finds it
gone fails whole, since its bytes may be a dead pool's. One read runs at once in the calling
thread (no hand-off for what a thread switch would only delay); the parts of a split fetch run
back to back on the transport's own thread, so the caller verifies and seals part ``i`` while
part ``i + 1`` is copied and hashed (the copy and the hash release the GIL). A part still
queued when it is aborted never runs; one running finishes its copy first, which takes no
longer than a copy.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from tessera_ray.errors import (
    PeerMappingError,
    TransferFailedError,
    TransferTimeoutError,
    TransportError,
)
from tessera_ray.transport._mapped import MappedPeer
from tessera_ray.transport._records import TransferState, TransferTicket

__all__ = ["MappedReads", "MIN_COPY_BYTES"]

MIN_COPY_BYTES = 1 << 20
"""glibc copies under about 512 KiB with ``rep movsb``, which some x86 CPUs run far slower than
the vector loop it uses above (figures in docs/same-node.md)."""

Digests = tuple[int, ...] | None
HashLanded = Callable[[TransferTicket, Sequence[int]], Digests]
_Job = tuple[TransferTicket, list[int], list[int], "Future[Digests]"]


class MappedReads:
    """Owned by one transport (see the module docstring); ``hash_landed`` is its
    :meth:`~tessera_ray.transport.Transport._hash_landed`."""

    def __init__(self, name: str, hash_landed: HashLanded, hash_chunk_bytes: int) -> None:
        self._name = name
        self._hash_landed = hash_landed
        self._hash_chunk_bytes = hash_chunk_bytes
        self.peers: dict[str, MappedPeer] = {}
        self._jobs: dict[int, Future[Digests]] = {}
        self._io: ThreadPoolExecutor | None = None
        self._counts = threading.Lock()  # both threads count
        self.reads = 0
        """Reads (tickets) that completed through a peer's mapped memory."""
        self.bytes = 0
        """Bytes those reads copied."""

    def add(self, name: str, peer: MappedPeer) -> None:
        self.peers[name] = peer

    def remove(self, name: str) -> None:
        peer = self.peers.pop(name, None)
        if peer is not None:
            peer.close()

    def start(
        self,
        tickets: list[TransferTicket],
        lists: list[tuple[list[int], list[int]]],
        dst: torch.Tensor,
    ) -> None:
        """Start the reads ``tickets`` (``(remote, local)`` slots each) of one peer and group
        into ``dst``, the local pool tensor of that group."""
        peer = self.peers[tickets[0].peer]
        jobs: list[_Job] = [
            (t, remote, local, Future()) for t, (remote, local) in zip(tickets, lists, strict=True)
        ]
        for ticket, _, _, future in jobs:
            self._jobs[ticket.id] = future
        if len(jobs) == 1:
            self._run(peer, dst, jobs)
            return
        if self._io is None:
            self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"mapped-{self._name}")
        self._io.submit(self._run, peer, dst, jobs)

    def _run(self, peer: MappedPeer, dst: torch.Tensor, jobs: list[_Job]) -> None:
        for ticket, remote, local, future in jobs:
            if not future.set_running_or_notify_cancel():
                continue  # aborted while queued: never touches its slots
            try:
                future.set_result(self._copy(peer, dst, ticket, remote, local))
            except PeerMappingError as e:
                future.set_exception(
                    TransferFailedError(
                        f"mapped read {ticket.id} of {ticket.num_pages} pages from "
                        f"{ticket.peer!r} failed: {e}; fetch from another replica"
                    )
                )
            except BaseException as e:  # settles the ticket; its waiter raises it
                future.set_exception(e)

    def _copy(
        self,
        peer: MappedPeer,
        dst: torch.Tensor,
        ticket: TransferTicket,
        remote: list[int],
        local: list[int],
    ) -> Digests:
        step = len(local) or 1
        if ticket.hash_seed is not None and self._hash_chunk_bytes:
            step = max(1, max(self._hash_chunk_bytes, MIN_COPY_BYTES) // dst.shape[1])
        digests: list[int] = []
        for a in range(0, len(local), step):
            peer.copy(ticket.group, remote[a : a + step], dst, local[a : a + step])
            digests += self._hash_landed(ticket, local[a : a + step]) or ()
        if not peer.alive():
            peer.close()  # its memory is freed once nobody maps it
            raise PeerMappingError("its owner process is gone")
        with self._counts:
            self.reads += 1
            self.bytes += ticket.nbytes
        return tuple(digests) if ticket.hash_seed is not None else None

    def _job(self, ticket: TransferTicket) -> Future[Digests]:
        future = self._jobs.get(ticket.id)
        if future is None:
            raise TransportError(f"ticket {ticket.id} is unknown or already settled")
        return future

    def wait(self, ticket: TransferTicket, timeout_s: float) -> Digests:
        future = self._job(ticket)
        try:
            return future.result(timeout=timeout_s)
        except FutureTimeout:
            self.abort(ticket)
            raise TransferTimeoutError(
                f"mapped read {ticket.id} of {ticket.num_pages} pages from {ticket.peer!r} did "
                f"not finish within {timeout_s} s; it was aborted"
            ) from None
        finally:
            self._jobs.pop(ticket.id, None)

    def poll(self, ticket: TransferTicket) -> TransferState:
        future = self._job(ticket)
        if not future.done():
            return TransferState.PENDING
        return TransferState.FAILED if future.exception() is not None else TransferState.DONE

    def abort(self, ticket: TransferTicket) -> bool:
        future = self._jobs.pop(ticket.id, None)
        if future is None or future.cancel():
            return True
        try:  # running: a copy, it ends; no byte lands after it
            future.result()
        except BaseException:  # its failure is the read's, already settled by this abort
            pass
        return True

    def close(self) -> None:
        for ticket_id in list(self._jobs):
            future = self._jobs.pop(ticket_id)
            if not future.cancel():
                future.exception()  # wait for the running one
        if self._io is not None:
            self._io.shutdown(wait=True)
        for name in list(self.peers):
            self.remove(name)
