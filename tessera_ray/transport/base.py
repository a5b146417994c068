"""The transport ABC: register a pool once, read remote slots into local slots, wait or abort.

Every transport reads *into slots the caller reserved*: it never allocates, seals or frees
pages. Verification and installing belong to :func:`tessera_ray.transport.fetch_verified`, so
all transports share one path that decides what is trusted.

A pool actor holds one :class:`BlockPool` per layer group; one transport (one NIXL agent)
serves them all: :meth:`Transport.register` takes every group's pool at once, and a read names
its ``group``.

A read returns a :class:`TransferTicket`. Every ticket ends in exactly one :meth:`wait` (which
returns, or raises after releasing the backend's resources) or :meth:`abort`; :meth:`poll` only
reports. Tickets are small frozen values, the live backend handles stay inside the transport.

A read may also hash what it landed (``hash_seed``): each page's content hash is taken on the
thread that copied it, right after its bytes arrived, while they are still in that CPU's cache,
and :meth:`wait` returns the digests. Hashing there costs about half of hashing the same pages
after the whole read (they have left the cache by then). The transport only computes; the
caller compares the digests with what the owner exported and decides what is trusted.

A transport that knows its Ray node (``node``) reads a peer on the same node through that
peer's mapped pool memory instead of its backend (:mod:`~tessera_ray.transport._mapped`,
``TransportConfig.same_node``): the same tickets, the same hashing of what landed, a copy in
place of a network transfer. :meth:`Transport.carrier` says which path a peer's reads take.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from numbers import Integral
from typing import Any

from tessera_ray.core import BlockPool
from tessera_ray.errors import TransportConfigError, TransportError
from tessera_ray.transport._mapped import MAPPED, MappedPeer, open_same_node, share_pools
from tessera_ray.transport._mapped_reads import MappedReads
from tessera_ray.transport._records import (
    MemoryShare,
    PeerInfo,
    PoolRegion,
    TransferState,
    TransferTicket,
    TransportCapabilities,
)
from tessera_ray.transport.config import TransportConfig

__all__ = [
    "Transport",
    "PoolRegion",
    "TransportCapabilities",
    "PeerInfo",
    "TransferTicket",
    "TransferState",
]


_TICKET_IDS = itertools.count(1)


class Transport(ABC):
    """Moves whole pages from a peer's pool into this transport's pool (see module docstring)."""

    kind: str = ""
    capabilities: TransportCapabilities

    def __init__(self, config: TransportConfig, *, name: str, node: str | None = None) -> None:
        if not isinstance(name, str) or not name:
            raise TransportConfigError(f"a transport needs a non-empty unique name, got {name!r}")
        if node is not None and (not isinstance(node, str) or not node):
            raise TransportConfigError(f"node must be a Ray node id or None, got {node!r}")
        if config.same_node == MAPPED and node is None:
            raise TransportConfigError(
                "same_node='mapped' needs the Ray node this transport runs on (node=...)"
            )
        self.config = config
        self.name = name
        self.node = node
        """Ray node id of this process (``None``: unknown, every read takes the backend)."""
        self._pools: tuple[BlockPool, ...] = ()
        self._shares: tuple[MemoryShare | None, ...] = ()
        self._peers: dict[str, PeerInfo] = {}
        self._mapped = MappedReads(name, self._hash_landed, config.hash_chunk_bytes)
        self._closed = False

    # ----------------------------------------------------------------- set-up

    def register(self, pools: BlockPool | Sequence[BlockPool]) -> PeerInfo:
        """Register the memory of ``pools`` (one per layer group, in group order; a single pool
        is group 0) with the backend, once for the transport's life; returns what peers need
        (publish it). Transfers never register memory."""
        if self._closed:
            raise TransportError(f"transport {self.name!r} is closed")
        if self._pools:
            raise TransportError(
                f"transport {self.name!r} already registered its pools; register all layer "
                "groups in one call"
            )
        group = (pools,) if isinstance(pools, BlockPool) else tuple(pools)
        if not group:
            raise TransportConfigError("register() needs at least one pool")
        if len({p.fingerprint for p in group}) != 1:
            raise TransportConfigError("all registered pools must share one layout fingerprint")
        if len({p.data.device for p in group}) != 1:
            raise TransportConfigError("all registered pools must live on one device")
        if not all(p.data.is_contiguous() for p in group):
            raise TransportConfigError("a pool tensor must be contiguous to be registered")
        self._register(group)
        self._pools = group
        if self.capabilities.cross_process:  # in-process peers copy directly, nothing to map
            self._shares = share_pools(group)
        return self.peer_info()

    @property
    def pools(self) -> tuple[BlockPool, ...]:
        if not self._pools:
            raise TransportError(f"transport {self.name!r} has no registered pool; register() it")
        return self._pools

    @property
    def pool(self) -> BlockPool:
        """The group-0 pool (the only one for single-group layouts such as MLA)."""
        return self.pools[0]

    def pool_of(self, group: int) -> BlockPool:
        pools = self.pools
        if isinstance(group, bool) or not 0 <= group < len(pools):
            raise TransportConfigError(f"group {group!r} is not one of {len(pools)} registered")
        return pools[group]

    def peer_info(self) -> PeerInfo:
        pools = self.pools
        return PeerInfo(
            kind=self.kind,
            name=self.name,
            fingerprint=pools[0].fingerprint,
            regions=tuple(
                PoolRegion(p.data.shape[0], p.page_bytes, p.data.data_ptr(), str(p.data.device))
                for p in pools
            ),
            metadata=self._metadata(),
            node=self.node,
            mappings=self._shares,
            endpoint=self._endpoint(),
        )

    def add_peers(self, peers: Sequence[PeerInfo]) -> None:
        """Make each peer readable (idempotent for a peer already known with equal info; a
        peer known with other info, a restarted one, is removed and added again). A peer on
        this transport's node is mapped here, once (see the module docstring)."""
        for info in peers:
            if info.kind != self.kind:
                raise TransportConfigError(
                    f"peer {info.name!r} uses the {info.kind!r} transport, this one is "
                    f"{self.kind!r}; every pool of a cluster must use the same kind"
                )
            if info.name == self.name:
                raise TransportConfigError(f"peer {info.name!r} is this transport itself")
            if self.config.same_node == MAPPED and info.node != self.node:
                open_same_node(MAPPED, self.node, self.kind, info)  # raises, naming the nodes
        for info in peers:
            known = self._peers.get(info.name)
            if known == info:
                continue
            if known is not None:
                self.remove_peers([info.name])
            mapped = None
            if self.capabilities.cross_process:
                mapped = open_same_node(self.config.same_node, self.node, self.kind, info)
            # Mapped first, so the backend knows a peer it may never need to reach itself.
            if mapped is not None:
                self._mapped.add(info.name, mapped)
            try:
                self._add_peer(info)
            except BaseException:
                self._mapped.remove(info.name)
                raise
            self._peers[info.name] = info

    def remove_peers(self, names: Sequence[str]) -> None:
        """Forget peers (a dead or restarted pool), unmapping their memory; unknown names are
        ignored."""
        for name in names:
            if self._peers.pop(name, None) is not None:
                self._mapped.remove(name)
                self._remove_peer(name)

    def carrier(self, peer: str) -> str:
        """What carries reads from ``peer``: ``"mapped"`` (its memory, mapped here) or this
        transport's kind (its backend)."""
        if peer not in self._peers:
            raise TransportError(f"unknown peer {peer!r}; add_peers() its PeerInfo first")
        return MAPPED if peer in self._mapped.peers else self.kind

    def mapped_peer(self, peer: str) -> MappedPeer | None:
        """``peer``'s memory as mapped here (``None``: its reads take the backend), for a reader
        that reads pinned pages in place rather than copying them out."""
        return self._mapped.peers.get(peer)

    @property
    def mapped_reads(self) -> int:
        """Reads (tickets) that completed through a peer's mapped memory."""
        return self._mapped.reads

    @property
    def mapped_bytes(self) -> int:
        """Bytes those reads copied."""
        return self._mapped.bytes

    @property
    def peers(self) -> tuple[str, ...]:
        return tuple(self._peers)

    # ----------------------------------------------------------------- transfers

    def read(
        self,
        peer: str,
        remote_slots: Sequence[int],
        local_slots: Sequence[int],
        *,
        group: int = 0,
        hash_seed: int | None = None,
    ) -> TransferTicket:
        """Start copying the peer's pages ``remote_slots[i]`` of layer group ``group`` into
        local ``local_slots[i]`` of the same group, all in one backend request. The local slots
        must be reserved by the caller. With ``hash_seed``, the read also hashes every page it
        landed with the pool's content hash keyed by that seed (see the module docstring)."""
        return self.read_many(
            peer, [(remote_slots, local_slots)], group=group, hash_seed=hash_seed
        )[0]

    def read_many(
        self,
        peer: str,
        parts: Sequence[tuple[Sequence[int], Sequence[int]]],
        *,
        group: int = 0,
        hash_seed: int | None = None,
    ) -> list[TransferTicket]:
        """:meth:`read` of several ``(remote_slots, local_slots)`` parts, one ticket each (a
        backend may split a part that hashes into requests of about
        ``TransportConfig.hash_chunk_bytes``), queued together in order: a backend that
        copies on its own thread runs them back to back, so the caller can seal part ``i``
        while part ``i + 1`` lands.
        Every part is checked before any starts; no local slot may appear twice. If a part
        cannot start, none is left running."""
        if self._closed:
            raise TransportError(f"transport {self.name!r} is closed")
        info = self._peers.get(peer)
        if info is None:
            raise TransportError(
                f"unknown peer {peer!r}; add_peers() its PeerInfo first (known: "
                f"{', '.join(self._peers) or 'none'})"
            )
        pool = self.pool_of(group)
        if group >= len(info.regions):
            raise TransportConfigError(f"peer {peer!r} registered {len(info.regions)} groups")
        region = info.regions[group]
        if region.page_bytes != pool.page_bytes:
            raise TransportConfigError(
                f"peer {peer!r} has {region.page_bytes} B pages in group {group}, this pool "
                f"{pool.page_bytes} B"
            )
        lists: list[tuple[list[int], list[int]]] = []
        for remote_slots, local_slots in parts:
            if len(remote_slots) != len(local_slots):
                raise TransportConfigError(
                    f"{len(remote_slots)} remote slots but {len(local_slots)} local slots"
                )
            lists.append(
                (
                    _checked_slots("remote", remote_slots, region.num_pages),
                    _checked_slots("local", local_slots, pool.data.shape[0]),
                )
            )
        named = sum(len(local) for _, local in lists)
        if len({s for _, local in lists for s in local}) != named:
            raise TransportConfigError("a local slot is named twice in one read")
        if hash_seed is not None and (
            isinstance(hash_seed, bool) or not isinstance(hash_seed, int) or hash_seed < 0
        ):
            raise TransportConfigError(f"hash_seed must be an int >= 0, got {hash_seed!r}")
        mapped = peer in self._mapped.peers
        tickets = [
            TransferTicket(
                next(_TICKET_IDS),
                peer,
                group,
                len(local),
                len(local) * pool.page_bytes,
                hash_seed,
                mapped,
            )
            for _, local in lists
        ]
        if mapped:
            self._mapped.start(tickets, lists, pool.data)
        else:
            self._start_many(tickets, info, lists)
        return tickets

    def wait(
        self, ticket: TransferTicket, timeout_s: float | None = None
    ) -> tuple[int, ...] | None:
        """Block until the read completes; returns the landed pages' content hashes in the
        order of its local slots when it was asked to hash (``hash_seed``), else ``None``. On
        timeout or failure the backend request is released (aborted) and
        :class:`TransferTimeoutError` / :class:`TransferFailedError` raised; either way the
        ticket is settled."""
        timeout_s = self.config.timeout_s if timeout_s is None else timeout_s
        if ticket.mapped:
            return self._mapped.wait(ticket, timeout_s)
        return self._wait(ticket, timeout_s)

    def poll(self, ticket: TransferTicket) -> TransferState:
        """The read's state now, without blocking (settle it with :meth:`wait`)."""
        return self._mapped.poll(ticket) if ticket.mapped else self._poll(ticket)

    def abort(self, ticket: TransferTicket) -> bool:
        """Cancel and settle the read. True when no byte can land in the local slots after
        this returns; False when the backend could not cancel (keep those slots out of use)."""
        return self._mapped.abort(ticket) if ticket.mapped else self._abort(ticket)

    def close(self) -> None:
        """Release backend resources (peers, registration). Idempotent."""
        if self._closed:
            return
        self.remove_peers(list(self._peers))
        self._mapped.close()
        self._close()
        self._closed = True

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- backend hooks

    @abstractmethod
    def _register(self, pools: tuple[BlockPool, ...]) -> None: ...

    def _metadata(self) -> bytes:
        return b""

    def _endpoint(self) -> Any:
        return None

    @abstractmethod
    def _add_peer(self, info: PeerInfo) -> None: ...

    def _remove_peer(self, name: str) -> None:
        return None

    @abstractmethod
    def _start(
        self, ticket: TransferTicket, info: PeerInfo, remote: list[int], local: list[int]
    ) -> None: ...

    def _start_many(
        self,
        tickets: list[TransferTicket],
        info: PeerInfo,
        lists: list[tuple[list[int], list[int]]],
    ) -> None:
        """Queue reads in order (a backend with an I/O thread overrides it to hand them over
        at once); ``lists`` are ``(remote, local)`` per ticket. All or nothing: when one cannot
        start, those already started are aborted before the error propagates."""
        started: list[TransferTicket] = []
        try:
            for ticket, (remote, local) in zip(tickets, lists, strict=True):
                self._start(ticket, info, remote, local)
                started.append(ticket)
        except BaseException:
            for ticket in started:
                self.abort(ticket)
            raise

    @abstractmethod
    def _wait(self, ticket: TransferTicket, timeout_s: float) -> tuple[int, ...] | None:
        """Settle the read; returns :meth:`_hash_landed` of its slots when it hashes."""

    @abstractmethod
    def _poll(self, ticket: TransferTicket) -> TransferState:
        """:meth:`poll` of a read the backend carries."""

    @abstractmethod
    def _abort(self, ticket: TransferTicket) -> bool:
        """:meth:`abort` of a read the backend carries."""

    def _hash_landed(self, ticket: TransferTicket, local: Sequence[int]) -> tuple[int, ...] | None:
        """The content hashes of local pages ``local`` of the ticket's group, if it hashes
        (``None`` otherwise); a backend calls it where the bytes just landed."""
        if ticket.hash_seed is None:
            return None
        return tuple(self.pool_of(ticket.group).hash_pages(local, ticket.hash_seed))

    def _close(self) -> None:
        return None


def _checked_slots(side: str, slots: Sequence[int], num_pages: int) -> list[int]:
    """``slots`` as a list of ints, each a page of a ``num_pages``-page pool."""
    out = list(slots)
    # A fetch names hundreds of slots per read: plain ints are checked with builtins (C
    # loops), anything else (numpy integers, bools to refuse) one by one.
    if set(map(type, out)) <= {int}:
        if not out or (min(out) >= 0 and max(out) < num_pages):
            return out
    for s in out:
        if isinstance(s, bool) or not isinstance(s, Integral) or not 0 <= s < num_pages:
            raise TransportConfigError(
                f"{side} slot {s!r} is not a page of a {num_pages}-page pool"
            )
    return [int(s) for s in out]
