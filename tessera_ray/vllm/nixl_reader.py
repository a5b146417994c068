"""The connector worker's path to this node's pool: pinned blocks read out of the pool's
memory, mapped into this process once (a shared-memory slab, or a GPU pool's CUDA IPC handle),
or one-sided over NIXL where it cannot be mapped; each page is hashed and checked against the
content hash the pool sealed it under. A request's blocks are one pin and one hash pass.

Where the pool's host memory is mapped here, the blocks are not copied out at all: the worker
hashes the pinned pages where they are, one layer at a time, and copies each layer's from there
into vLLM's cache, once, right after its hashes matched, while the pin holds (the pool neither
writes nor frees a pinned page; the pin ends when the worker's step has copied them, or the
copies count as failed if it lapsed first). Otherwise they are copied into staging memory the
worker registered once, and hashed where they land.

Through Ray's object store a read costs the pool a copy into shared memory and the worker the
page faults of fresh object-store pages, on every step; over NIXL the bytes cross once, by the
transport's own copy, and the pool only pins and unpins. The staging memory holds
``capacity_blocks`` tier blocks; a copied read that does not fit goes through the object store.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from tessera_ray.actors.messages import BlockReads, PinnedBlock, PinTicket
from tessera_ray.core import BlockPool, PoolConfig, content_seed
from tessera_ray.core.results import BlockHash
from tessera_ray.errors import TransferFailedError
from tessera_ray.layout import ModelLayout
from tessera_ray.transport import MAPPED, MappedPeer, PeerInfo, TransportConfig
from tessera_ray.transport.factory import make_transport
from tessera_ray.vllm.scheduler import check_paged_layout

__all__ = ["PoolReader"]

log = logging.getLogger(__name__)


class PoolReader:
    """Reads blocks pinned in one pool (``peer``) into this process's staging memory."""

    def __init__(
        self,
        layout: ModelLayout,
        peer: PeerInfo,
        *,
        capacity_blocks: int,
        name: str,
        node: str | None = None,
    ) -> None:
        """``node``: the Ray node this process runs on; the pool's memory is mapped when the
        pool publishes the same node (``None``: NIXL only)."""
        check_paged_layout(layout)  # one layer group: a block is one page per layer
        self.layout = layout
        self.layers = layout.num_layers
        self.capacity_blocks = capacity_blocks
        self.staging = BlockPool.for_group(
            layout, 0, PoolConfig(num_pages=capacity_blocks * self.layers)
        )
        # On demand: reading from a pool on this node is a copy out of its mapped memory, and
        # an engine worker then runs no NIXL agent (no progress thread on the engine's cores).
        config = TransportConfig(kind="nixl", nixl_agent_on_demand=True)
        self.transport = make_transport(config, name=name, node=node)
        self.transport.register(self.staging)
        self.transport.add_peers([peer])
        self.peer = peer.name
        self.in_place_reads = 0
        """Reads served as views of the pool's pinned pages (no copy out)."""
        self.in_place_bytes = 0

    @property
    def carrier(self) -> str:
        """What carries this reader's reads: ``"mapped"`` or ``"nixl"``."""
        return self.transport.carrier(self.peer)

    def read(self, ticket: PinTicket, timeout_s: float) -> BlockReads | None:
        """The pinned blocks' bytes, each page checked against what the pool sealed it with; a
        block that does not match reads as not held (the caller recomputes it).

        In place where the pool's memory is mapped here and the blocks lie at a constant stride
        in it (each block's layers on consecutive pages, as a pool allocates them): a strided
        view of the pool's pages, ``pinned`` (valid while the caller keeps the pin), hashed
        by the caller one layer at a time as it copies them (``check_layer``). Else
        copied into the staging memory and lent (valid until the next read); ``None`` where
        they do not fit it."""
        held = [(i, b) for i, b in enumerate(ticket.blocks) if b is not None]
        if not held:
            empty = np.empty((0, self.layout.block_bytes), np.uint8)
            return BlockReads.of([None] * len(ticket.blocks), empty, carrier=self.carrier)
        seed = content_seed(ticket.namespace, self.layout.fingerprint)
        in_place = self._in_place(held)
        if in_place is not None:
            return self._read_in_place(ticket, held, seed, *in_place)
        if len(held) > self.capacity_blocks:
            return None
        return self._read_copied(ticket, held, seed, timeout_s)

    def _in_place(
        self, held: list[tuple[int, PinnedBlock]]
    ) -> tuple[MappedPeer, np.ndarray] | None:
        """The mapped peer and the held blocks' rows as a view of its pages, where the blocks
        lie at one stride (``None``: not mapped here, or laid out otherwise)."""
        mapped = self.transport.mapped_peer(self.peer)
        pages = None if mapped is None else mapped.host_pages(0)
        if mapped is None or pages is None:
            return None
        per, page_bytes = self.layers, pages.shape[1]
        first = held[0][1].slots[0][0]
        stride = held[1][1].slots[0][0] - first if len(held) > 1 else per
        if stride < per:
            return None
        for j, (_, block) in enumerate(held):
            start = first + j * stride
            if tuple(block.slots[0]) != tuple(range(start, start + per)):
                return None
        rows = np.lib.stride_tricks.as_strided(
            pages[first:].reshape(-1),
            shape=(len(held), per * page_bytes),
            strides=(stride * page_bytes, 1),
            writeable=False,
        )
        return mapped, rows

    def _read_in_place(
        self,
        ticket: PinTicket,
        held: list[tuple[int, PinnedBlock]],
        seed: int,
        mapped: MappedPeer,
        rows: np.ndarray,
    ) -> BlockReads:
        content_hash, page_bytes = self.staging.content_hash_fn, self.staging.page_bytes
        hashes: list[BlockHash | None] = [None] * len(ticket.blocks)
        for i, block in held:
            hashes[i] = block.block_hash
        seals = [block.content_hashes[0] for _, block in held]

        def check_layer(layer: int, which: Sequence[int]) -> list[int]:
            at = layer * page_bytes
            bad = [
                j
                for j in which
                if content_hash(rows[j, at : at + page_bytes].data, seed) != seals[j][layer]
            ]
            if not mapped.alive():  # its pages may be a dead pool's, whatever it sealed
                raise TransferFailedError(f"pool {self.peer!r} exited during an in-place read")
            if bad:
                log.warning("%d blocks pinned in place do not match their seals", len(bad))
            return bad

        self.in_place_reads += 1
        self.in_place_bytes += len(held) * self.layout.block_bytes
        return BlockReads.of(hashes, rows, carrier=MAPPED, pinned=True, check_layer=check_layer)

    def _read_copied(
        self, ticket: PinTicket, held: list[tuple[int, PinnedBlock]], seed: int, timeout_s: float
    ) -> BlockReads:
        n, per = len(held), self.layers
        hashes: list[BlockHash | None] = [None] * len(ticket.blocks)
        carrier = self.carrier
        remote = [s for _, b in held for s in b.slots[0]]
        (request,) = self.transport.read_many(
            self.peer, [(remote, list(range(n * per)))], hash_seed=seed
        )
        digests = self.transport.wait(request, timeout_s)
        assert digests is not None  # asked with a hash seed
        good: list[int] = []
        for j, (i, b) in enumerate(held):
            if tuple(digests[j * per : (j + 1) * per]) == tuple(b.content_hashes[0]):
                hashes[i] = b.block_hash
                good.append(j)
            else:
                log.warning("a block read (%s) does not match its seal; recomputing it", carrier)
        rows = self.staging.data[: n * per].view(n, per * self.staging.page_bytes).numpy()
        lent = len(good) == n  # else the good rows are picked out: a copy
        payloads = rows if lent else rows[good]
        return BlockReads.of(hashes, payloads, verified=True, carrier=carrier, lent=lent)

    def repoint(self, peer: PeerInfo) -> None:
        """The pool is a new process (a restart): read from its new agent from now on."""
        if self.peer in self.transport.peers:
            self.transport.remove_peers([self.peer])
        self.transport.add_peers([peer])
        self.peer = peer.name

    def close(self) -> None:
        self.transport.close()
