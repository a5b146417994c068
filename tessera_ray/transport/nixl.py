"""NIXL transport: one-sided READs of a peer pool's slots straight into local slots.

One NIXL agent per pool actor. Its pool tensors (one per layer group) are registered once, in
:meth:`register`; each slot of each group is one descriptor of a *prepared* list, made once for
the local pools and once per peer (groups concatenated, so a group's slot ``s`` is descriptor
``offset[group] + s``). A read of any number of slots is then one ``make_prepped_xfer`` request
built from two index lists (NIXL merges runs of adjacent slots into single descriptors).
Nothing is registered or prepared per transfer. The progress thread stays on (see
:class:`NixlTransport`).

Every agent call runs on one I/O thread of the transport. Over UCX's cma transport (processes
on one host) the copy happens inside the posting call, with the GIL released; on the I/O thread
it proceeds while the caller seals pages that already landed, and one thread keeps the agent
single-threaded (its default, lock-free sync mode). A read that hashes is posted in requests of
``TransportConfig.hash_chunk_bytes``, and the I/O thread hashes each one's pages as soon as it
completes, while they are still in its core's cache.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, TypeVar

from tessera_ray.core import BlockPool
from tessera_ray.errors import (
    TransferFailedError,
    TransferTimeoutError,
    TransportConfigError,
    TransportError,
    TransportUnavailableError,
)
from tessera_ray.transport._nixl_agent import (
    PROGRESS_DELAY_RELEASES,
    import_nixl,
    new_agent,
    nixl_version,
)
from tessera_ray.transport._nixl_descs import memory_of, slot_descs
from tessera_ray.transport.base import (
    PeerInfo,
    TransferState,
    TransferTicket,
    Transport,
    TransportCapabilities,
)
from tessera_ray.transport.config import TransportConfig

# The agent helpers live in _nixl_agent; they stay importable from here, where callers look.
__all__ = ["NixlTransport", "import_nixl", "nixl_version", "PROGRESS_DELAY_RELEASES"]

log = logging.getLogger(__name__)

_INIT_AGENT = "NIXL_INIT_AGENT"
_STATES = {"DONE": TransferState.DONE, "PROC": TransferState.PENDING, "ERR": TransferState.FAILED}
_SPINS = 64
_POLL_MAX_SLEEP_S = 0.0005
"""Longest pause between two completion checks: NIXL's Python API has no blocking wait, so a
wait spins briefly and then backs off, at most this long (a fraction of any transfer's cost)."""
"""Completion checks before the first pause: a cma read of a few MB is done within them."""
_CANCEL_GRACE_S = 2.0
"""How long an abort waits for the I/O thread to release a request (it may be inside a
synchronous copy); past it the request counts as uncancellable and its slots stay withheld."""
T = TypeVar("T")


@dataclass(slots=True)
class _Job:
    future: Future[tuple[TransferState, bool, tuple[int, ...] | None]]
    """Resolves to (final state, request released, digests of the landed pages or ``None``)
    once the read settles on the I/O thread."""
    cancel: threading.Event


_Item = tuple[_Job, TransferTicket, list[int], list[int], list[int]]
"""A queued read: its job, ticket, local slots, local and remote descriptor indices."""


class NixlTransport(Transport):
    """See the module docstring. Raises :class:`TransportUnavailableError` when no agent starts."""

    kind = "nixl"
    capabilities = TransportCapabilities(
        one_sided=True, cross_process=True, device_memory=True, overlaps_caller=True
    )

    def __init__(self, config: TransportConfig, *, name: str, node: str | None = None) -> None:
        super().__init__(config, name=name, node=node)
        self._nixl = import_nixl()  # refused here, at once, where NIXL is not installed
        self._agent: Any = None
        self._pending_pools: tuple[BlockPool, ...] = ()
        """Pools registered before the agent started (on demand): registered when it starts."""
        self._mapped_only: set[str] = set()
        """Peers read through their mapped memory whose NIXL metadata was never loaded (on
        demand: no agent needed for them)."""
        self._reg: Any = None
        self._local: Any = None
        self._local_offsets: list[int] = []
        self._remote: dict[str, Any] = {}
        self._remote_offsets: dict[str, list[int]] = {}
        self._xfers: dict[int, Any] = {}  # I/O thread only
        self._jobs: dict[int, _Job] = {}
        self._mem_type = "DRAM"
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"nixl-io-{name}")
        if not config.nixl_agent_on_demand:
            try:
                self._on_io(self._agent_io)
            except BaseException:
                self._io.shutdown(wait=False)
                raise

    def _agent_io(self) -> Any:
        """The agent, started on first call (I/O thread): its progress thread runs from then
        on, so an on-demand transport starts it only for a peer that needs it."""
        if self._agent is not None:
            return self._agent
        nixl_agent, nixl_agent_config = self._nixl
        try:
            agent = new_agent(
                nixl_agent,
                self.name,
                nixl_agent_config(
                    # Required: without it a cross-process READ here never completes (the
                    # state check does not drive progress).
                    enable_prog_thread=True,
                    backends=list(self.config.nixl_backends),
                    num_threads=self.config.nixl_num_threads,
                ),
                self.config.nixl_progress_delay_us,
            )
        except Exception as e:
            raise TransportUnavailableError(f"NIXL agent {self.name!r} did not start: {e}") from e
        missing = [b for b in self.config.nixl_backends if b not in agent.backends]
        if missing:
            raise TransportUnavailableError(
                f"NIXL backend(s) {', '.join(missing)} not available (plugins here: "
                f"{', '.join(agent.plugin_list) or 'none'})"
            )
        self._agent = agent
        if self._pending_pools:
            pools, self._pending_pools = self._pending_pools, ()
            self._register_io(pools)
        return agent

    @property
    def agent_started(self) -> bool:
        """Whether this transport runs a NIXL agent (and its progress thread) now."""
        return self._agent is not None

    def _on_io(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the I/O thread and return its result (keeps the agent single-threaded)."""
        return self._io.submit(fn).result()

    def _register(self, pools: tuple[BlockPool, ...]) -> None:
        self._on_io(lambda: self._register_io(pools))

    def _register_io(self, pools: tuple[BlockPool, ...]) -> None:
        if self._agent is None:  # on demand: registered when the agent starts
            self._pending_pools = pools
            return
        mem_type, dev = memory_of(str(pools[0].data.device))
        try:
            self._reg = self._agent.register_memory([p.data for p in pools])
            descs, self._local_offsets = slot_descs(
                [(p.data.data_ptr(), p.data.shape[0], p.page_bytes) for p in pools], dev
            )
            self._local = self._agent.prep_xfer_dlist(_INIT_AGENT, descs, mem_type)
        except Exception as e:
            raise TransportError(f"registering the pools with NIXL failed: {e}") from e
        self._mem_type = mem_type

    def _metadata(self) -> bytes:
        # Taken after registration, so it carries the registered pool memory.
        if self.config.nixl_agent_on_demand:
            # A reader's own info is not published: it names no agent until one runs.
            return self._on_io(lambda: b"" if self._agent is None else self._agent_metadata())
        return self._on_io(lambda: bytes(self._agent_io().get_agent_metadata()))

    def _agent_metadata(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    def _add_peer(self, info: PeerInfo) -> None:
        self._on_io(lambda: self._add_peer_io(info))

    def _add_peer_io(self, info: PeerInfo) -> None:
        if self._agent is None and info.name in self._mapped.peers:
            self._mapped_only.add(info.name)  # every read of it is a copy out of its memory
            return
        if not info.metadata:
            raise TransportConfigError(
                f"peer {info.name!r} publishes no NIXL agent (an on-demand reader that has not "
                "started one) and is not mapped here: nothing can read from it"
            )
        agent = self._agent_io()
        mem_type, dev = memory_of(info.regions[0].device)
        try:
            loaded = agent.add_remote_agent(info.metadata)
        except Exception as e:
            raise TransportError(f"loading NIXL metadata of peer {info.name!r} failed: {e}") from e
        loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded != info.name:
            self._agent.remove_remote_agent(loaded)
            raise TransportConfigError(
                f"peer info names {info.name!r} but its metadata is agent {loaded!r}"
            )
        descs, offsets = slot_descs(
            [(r.base_addr, r.num_pages, r.page_bytes) for r in info.regions], dev
        )
        try:
            self._remote[info.name] = self._agent.prep_xfer_dlist(info.name, descs, mem_type)
            self._remote_offsets[info.name] = offsets
        except Exception as e:
            self._agent.remove_remote_agent(info.name)
            raise TransportError(
                f"preparing descriptors of peer {info.name!r} failed (is its pool registered?): {e}"
            ) from e

    def _remove_peer(self, name: str) -> None:
        self._on_io(lambda: self._remove_peer_io(name))

    def _remove_peer_io(self, name: str) -> None:
        if name in self._mapped_only or self._agent is None:
            self._mapped_only.discard(name)
            return
        handle = self._remote.pop(name, None)
        self._remote_offsets.pop(name, None)
        try:
            if handle is not None:
                self._agent.release_dlist_handle(handle)
            self._agent.remove_remote_agent(name)
        except Exception as e:  # a dead peer may already be disconnected: nothing to undo
            log.debug("removing NIXL peer %s: %s", name, e)

    def _start(
        self, ticket: TransferTicket, info: PeerInfo, remote: list[int], local: list[int]
    ) -> None:
        self._start_many([ticket], info, [(remote, local)])

    def _start_many(
        self,
        tickets: list[TransferTicket],
        info: PeerInfo,
        lists: list[tuple[list[int], list[int]]],
    ) -> None:
        # One I/O job runs every read back to back. Handing each over separately cost a
        # thread hand-off per read, and the I/O thread could not start the first copy before
        # the caller, holding the GIL, had queued the last one.
        group = tickets[0].group
        lo = self._local_offsets[group]
        ro = self._remote_offsets[info.name][group]
        items: list[_Item] = [
            (
                _Job(Future(), threading.Event()),
                t,
                local,
                [lo + s for s in local] if lo else local,
                [ro + s for s in remote] if ro else remote,
            )
            for t, (remote, local) in zip(tickets, lists, strict=True)
        ]
        try:
            self._io.submit(self._run_many, self._remote[info.name], items)
        except RuntimeError as e:  # the executor is shut down: the transport is closing
            raise TransportError(f"transport {self.name!r} is closing: {e}") from e
        for job, ticket, _, _, _ in items:
            self._jobs[ticket.id] = job

    def _run_many(self, remote_dlist: Any, items: list[_Item]) -> None:
        """I/O thread: run queued reads in order; an aborted one is skipped untouched."""
        for job, ticket, slots, local, remote in items:
            if not job.future.set_running_or_notify_cancel():
                continue
            try:
                job.future.set_result(
                    self._run(ticket, slots, local, remote_dlist, remote, job.cancel)
                )
            except BaseException as e:  # settles the ticket; its waiter raises it
                job.future.set_exception(e)

    def _run(
        self,
        ticket: TransferTicket,
        slots: list[int],
        local: list[int],
        remote_dlist: Any,
        remote: list[int],
        cancel: threading.Event,
    ) -> tuple[TransferState, bool, tuple[int, ...] | None]:
        """I/O thread: one read, in requests of ``hash_chunk_bytes`` when it hashes, each
        request's pages (local ``slots``, descriptors ``local``) hashed as soon as it is done;
        returns (state, released, digests). A request that fails ends the read there."""
        step = len(local)
        if ticket.hash_seed is not None and self.config.hash_chunk_bytes:
            step = max(1, self.config.hash_chunk_bytes // self.pool_of(ticket.group).page_bytes)
        digests: list[int] = []
        for a in range(0, len(local), step):
            state, released = self._run_one(
                ticket, local[a : a + step], remote_dlist, remote[a : a + step], cancel
            )
            if state is not TransferState.DONE:
                return state, released, None
            digests += self._hash_landed(ticket, slots[a : a + step]) or ()
        return TransferState.DONE, True, tuple(digests) if ticket.hash_seed is not None else None

    def _run_one(
        self,
        ticket: TransferTicket,
        local: list[int],
        remote_dlist: Any,
        remote: list[int],
        cancel: threading.Event,
    ) -> tuple[TransferState, bool]:
        """I/O thread: build, post and watch one request until it settles; returns (state,
        released). Cancelled before it started, it never touches the slots."""
        if cancel.is_set():
            return TransferState.FAILED, True
        try:
            handle = self._agent.make_prepped_xfer("READ", self._local, local, remote_dlist, remote)
        except Exception as e:
            log.warning("NIXL could not build read %d from %s: %s", ticket.id, ticket.peer, e)
            return TransferState.FAILED, True
        self._xfers[ticket.id] = handle
        posted: str | None = None
        try:
            posted = self._agent.transfer(handle)
        except Exception as e:  # reported by the state check below
            log.debug("posting NIXL read %d failed: %s", ticket.id, e)
        pause, checks = 1e-5, 0
        while True:
            state = self._state(handle, posted)
            posted = None
            if state is not TransferState.PENDING or cancel.is_set():
                released = self._settle(ticket.id)
                return (TransferState.FAILED if state is TransferState.PENDING else state), released
            checks += 1
            if checks > _SPINS:
                # No blocking wait exists in NIXL's Python API; back off so a slow transfer
                # leaves the CPU to the progress thread.
                time.sleep(pause)
                pause = min(pause * 2, _POLL_MAX_SLEEP_S)

    def _job(self, ticket: TransferTicket) -> _Job:
        job = self._jobs.get(ticket.id)
        if job is None:
            raise TransportError(f"ticket {ticket.id} is unknown or already settled")
        return job

    def _state(self, handle: Any, posted: str | None = None) -> TransferState:
        """The request's state: ``posted``, what posting it answered, when given (over cma the
        copy is done inside that call, which then says DONE: asking again would be one more
        progress call per request, a cost that adds up over a read of many requests)."""
        if posted is not None:
            return _STATES.get(posted, TransferState.FAILED)
        try:
            return _STATES.get(self._agent.check_xfer_state(handle), TransferState.FAILED)
        except Exception:
            return TransferState.FAILED

    def _poll(self, ticket: TransferTicket) -> TransferState:
        job = self._job(ticket)
        return job.future.result()[0] if job.future.done() else TransferState.PENDING

    def _wait(self, ticket: TransferTicket, timeout_s: float) -> tuple[int, ...] | None:
        job = self._job(ticket)
        try:
            state, released, digests = job.future.result(timeout=timeout_s)
        except FutureTimeout:
            raise _failed(
                TransferTimeoutError(
                    f"NIXL read {ticket.id} of {ticket.num_pages} pages from {ticket.peer!r} "
                    f"did not finish within {timeout_s} s; it was aborted"
                ),
                self._cancel(ticket.id),
            ) from None
        del self._jobs[ticket.id]
        if state is not TransferState.DONE:
            raise _failed(
                TransferFailedError(
                    f"NIXL read {ticket.id} of {ticket.num_pages} pages from {ticket.peer!r} "
                    "failed (owner gone or connection broken); fetch from another replica"
                ),
                released,
            )
        return digests

    def _abort(self, ticket: TransferTicket) -> bool:
        if ticket.id not in self._jobs:
            return True
        return self._cancel(ticket.id)

    def _cancel(self, ticket_id: int) -> bool:
        """Settle a job; True when no byte of it can land any more."""
        job = self._jobs.pop(ticket_id)
        job.cancel.set()
        if job.future.cancel():
            return True
        try:
            return job.future.result(timeout=_CANCEL_GRACE_S)[1]
        except FutureTimeout:
            log.warning(
                "NIXL read %d is stuck in the backend; its slots stay out of use", ticket_id
            )
            return False

    def _settle(self, ticket_id: int) -> bool:
        """I/O thread: release the request (NIXL cancels it if still active); False if it
        could not be."""
        handle = self._xfers.pop(ticket_id)
        try:
            self._agent.release_xfer_handle(handle)
        except Exception as e:
            log.warning(
                "NIXL could not cancel read %d; its slots stay out of use: %s", ticket_id, e
            )
            return False
        return True

    def _close(self) -> None:
        for tid in list(self._jobs):
            self._cancel(tid)
        self._on_io(self._close_io)
        self._io.shutdown(wait=True)
        # Dropping the agent stops its progress thread (which spins a core) once collected.
        self._agent = None

    def _close_io(self) -> None:
        if self._agent is None:
            return
        try:
            if self._local is not None:
                self._agent.release_dlist_handle(self._local)
            if self._reg is not None:
                self._agent.deregister_memory(self._reg)
        except Exception as e:
            log.debug("closing NIXL agent %s: %s", self.name, e)
        self._local = self._reg = None


def _failed(err: TransferFailedError | TransferTimeoutError, slots_safe: bool) -> Exception:
    err.slots_safe = slots_safe
    return err
