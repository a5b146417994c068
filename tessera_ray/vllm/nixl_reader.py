"""The connector worker's path to this node's pool: pinned blocks are copied out of the pool's
memory, mapped into this process once (a shared-memory slab, or a GPU pool's CUDA IPC handle),
or read one-sided over NIXL where it cannot be mapped, into staging memory the worker
registered once; each page is hashed where it lands and checked against the content hash the
pool sealed it under. A request's blocks are one pin, one copy, one hash pass.

Through Ray's object store a read costs the pool a copy into shared memory and the worker the
page faults of fresh object-store pages, on every step; over NIXL the bytes cross once, by the
transport's own copy, and the pool only pins and unpins. The staging memory holds
``capacity_blocks`` tier blocks; a read that does not fit goes through the object store.
"""

from __future__ import annotations

import logging

import numpy as np

from tessera_ray.actors.messages import BlockReads, PinTicket
from tessera_ray.core import BlockPool, PoolConfig, content_seed
from tessera_ray.core.results import BlockHash
from tessera_ray.layout import ModelLayout
from tessera_ray.transport import PeerInfo, TransportConfig
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

    @property
    def carrier(self) -> str:
        """What carries this reader's reads: ``"mapped"`` or ``"nixl"``."""
        return self.transport.carrier(self.peer)

    def fits(self, ticket: PinTicket) -> bool:
        return sum(b is not None for b in ticket.blocks) <= self.capacity_blocks

    def read(self, ticket: PinTicket, timeout_s: float) -> BlockReads:
        """The pinned blocks' bytes, as a view of the staging memory (lent: valid until the
        next read). A block whose landed pages do not hash to what the pool sealed reads as not
        held: the caller recomputes it."""
        held = [(i, b) for i, b in enumerate(ticket.blocks) if b is not None]
        if len(held) > self.capacity_blocks:
            raise ValueError(f"{len(held)} blocks do not fit {self.capacity_blocks} staged")
        n, per = len(held), self.layers
        hashes: list[BlockHash | None] = [None] * len(ticket.blocks)
        carrier = self.carrier
        if not n:
            empty = np.empty((0, self.layout.block_bytes), np.uint8)
            return BlockReads.of(hashes, empty, carrier=carrier)
        remote = [s for _, b in held for s in b.slots[0]]
        seed = content_seed(ticket.namespace, self.layout.fingerprint)
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
