"""Moving blocks in and out of a pool, and attention over its pages (part of PoolService).

- :meth:`TransferMixin.install`: blocks that arrived as bytes (the object-store path) are
  checked page by page against the owner's content hashes before anything is sealed.
- :meth:`TransferMixin.fetch_pinned`: one-sided reads of another pool's pinned pages straight
  into reserved slots, verified and sealed in one hash pass, then named by their token keys.
- :meth:`TransferMixin.attend`: partial MLA attention over the blocks this pool holds.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from tessera_ray.actors._leases import Lease, LeaseTable
from tessera_ray.actors.directory import Tier
from tessera_ray.actors.messages import (
    BlockFailure,
    FetchFailure,
    InstallResult,
    PinnedBlock,
    PinTicket,
    StoredBlock,
)
from tessera_ray.actors.tenancy import Access, TenantGate
from tessera_ray.core import BlockPool, PageHandle, xxh3_128
from tessera_ray.core.results import BlockHash, TokenKey
from tessera_ray.errors import PageShapeError
from tessera_ray.layout import ModelLayout
from tessera_ray.transport import PeerInfo, Transport
from tessera_ray.transport.fetch import (
    PageExport,
    PageFetchResult,
    fetch_verified_many,
)

if TYPE_CHECKING:
    from tessera_ray.actors.messages import Reservation

__all__ = ["TransferMixin", "NOT_HELD"]

NOT_HELD = BlockFailure(FetchFailure.NOT_HELD, "the owner does not hold it")


class TransferMixin:
    """The transfer half of :class:`~tessera_ray.actors.pool_service.PoolService`."""

    # Provided by PoolService.
    name: str
    layout: ModelLayout
    pools: list[BlockPool]
    block_bytes: int
    transport: Transport | None
    transfers_in: int
    bytes_in: int
    _resident: OrderedDict[tuple[str, bytes], BlockHash]
    leases: LeaseTable
    gate: TenantGate

    if TYPE_CHECKING:

        @staticmethod
        def _check_keys(namespace: str, token_keys: Sequence[bytes]) -> None: ...

        def _payload_rows(self, payloads: object, count: int) -> torch.Tensor: ...

        def _seed(self, namespace: str) -> int: ...

        async def reserve(self, num_blocks: int, lease_s: float | None = None) -> Reservation: ...

        def _release(self, lease: Lease) -> None: ...

        async def _commit(
            self,
            reservation_id: int,
            namespace: str,
            token_keys: Sequence[TokenKey],
            payloads: np.ndarray | torch.Tensor,
        ) -> list[StoredBlock]: ...

        async def _announce(
            self, namespace: str, blocks: Sequence[StoredBlock], tier: Tier
        ) -> None: ...

    async def install(
        self, namespace: str, blocks: Sequence[PinnedBlock], payloads: np.ndarray | torch.Tensor
    ) -> InstallResult:
        """Install fetched blocks after checking every page against the owner's content hash.

        A block with any mismatching page is refused whole (never sealed here); the others are
        sealed and registered as replicas of this pool.
        """
        self._check_keys(namespace, [b.token_key for b in blocks])
        rows = self._payload_rows(payloads, len(blocks))
        seed = self._seed(namespace)
        good: list[int] = []
        errors: list[BlockFailure | None] = [None] * len(blocks)
        for i, block in enumerate(blocks):
            bad = self._verify(rows[i], block, seed)
            if bad is not None:
                errors[i] = bad
            else:
                good.append(i)
        installed: list[StoredBlock | None] = [None] * len(blocks)
        if good:
            res = await self.reserve(len(good))
            stored = await self._commit(
                res.id, namespace, [blocks[i].token_key for i in good], rows[good]
            )
            for i, s in zip(good, stored, strict=True):
                installed[i] = s
            self.transfers_in += len(good)
            self.bytes_in += len(good) * self.block_bytes
        return InstallResult(tuple(installed), tuple(errors))

    def _verify(self, row: torch.Tensor, block: PinnedBlock, seed: int) -> BlockFailure | None:
        view = row.numpy()
        offset = 0
        for g, pool in enumerate(self.pools):
            expected = block.content_hashes[g] if g < len(block.content_hashes) else ()
            if len(expected) != pool.layers_per_block:
                return BlockFailure(
                    FetchFailure.LAYOUT_MISMATCH,
                    f"block {block.token_key[:4].hex()}: wrong page count for group {g}",
                )
            for layer, want in enumerate(expected):
                page = view[offset : offset + pool.page_bytes]
                offset += pool.page_bytes
                if xxh3_128(memoryview(page.data), seed) != want:
                    return BlockFailure(
                        FetchFailure.HASH_MISMATCH,
                        f"block {block.token_key[:4].hex()}...: page {layer} of group {g} does "
                        "not match the owner's content hash; not installed",
                    )
        return None

    # ------------------------------------------------------------------ one-sided fetch

    def attach_transport(self, transport: Transport) -> PeerInfo:
        """Register this pool's memory with ``transport`` (once); returns what peers need."""
        self.transport = transport
        return transport.register(self.pools)

    async def fetch_pinned(
        self,
        ticket: PinTicket,
        owner_peer: str,
        timeout_s: float | None = None,
        reservation: Reservation | None = None,
    ) -> list[BlockFailure | None]:
        """Read the blocks ``ticket`` pinned on another pool straight into reserved local slots
        (one transport request per layer group), verify every page's content hash, and name
        the blocks under their token keys. Per pinned block: ``None`` or why it failed. A
        failed block's slots return to the free list or stay unnamed; nothing unverified is
        ever sealed. The owner unpins afterwards, whatever the outcome.

        ``reservation``: slots reserved while the pin was on its way (at least one block per
        pinned block; the fetch takes it over and frees what it does not use); ``None``
        reserves here."""
        if self.transport is None:
            raise PageShapeError("no transport attached; use install() with the bytes instead")
        held = [b for b in ticket.blocks if b is not None]
        if not held:
            return [None if b is not None else NOT_HELD for b in ticket.blocks]
        lease = None
        if reservation is not None and reservation.num_blocks >= len(held):
            lease = self.leases.reservations.pop(reservation.id, None)  # None: it expired meanwhile
        if lease is None:
            res = await self.reserve(len(held))
            lease = self.leases.reservations.pop(res.id)
        # The fetch owns these slots from here on.
        if len(lease.handles) > len(held):
            self._release(Lease(lease.handles[len(held) :], 0.0))
            lease.handles = lease.handles[: len(held)]
        exports = [
            PageExport(
                peer=owner_peer,
                namespace=ticket.namespace,
                fingerprint=self.layout.fingerprint,
                page_bytes=pool.page_bytes,
                slots=tuple(s for b in held for s in b.slots[g]),
                content_hashes=tuple(h for b in held for h in b.content_hashes[g]),
                group=g,
            )
            for g, pool in enumerate(self.pools)
        ]
        local = [
            [h for per_group in lease.handles for h in per_group[g]] for g in range(len(self.pools))
        ]
        results = fetch_verified_many(self.transport, exports, local=local, timeout_s=timeout_s)
        outcome = self._name_fetched(ticket.namespace, held, results)
        stored = [s for s in outcome if isinstance(s, StoredBlock)]
        await self._announce(ticket.namespace, stored, Tier.MEMORY)
        self.transfers_in += len(stored)
        self.bytes_in += len(stored) * self.block_bytes
        reasons = iter(None if isinstance(o, StoredBlock) else o for o in outcome)
        return [next(reasons) if b is not None else NOT_HELD for b in ticket.blocks]

    def _name_fetched(
        self, namespace: str, held: Sequence[PinnedBlock], results: Sequence[PageFetchResult]
    ) -> list[StoredBlock | BlockFailure]:
        pages: list[dict[int, PageHandle]] = [
            {f.position: f.handle for f in r.fetched} for r in results
        ]
        errors: list[dict[int, BlockFailure]] = [
            {
                f.position: BlockFailure(
                    FetchFailure(f.reason.value),
                    f"block {held[f.position // pool.layers_per_block].token_key[:4].hex()}...: "
                    f"{f.detail}",
                )
                for f in r.failed
            }
            for r, pool in zip(results, self.pools, strict=True)
        ]
        out: list[StoredBlock | BlockFailure] = []
        for i, block in enumerate(held):
            per_group: list[list[PageHandle]] = []
            error: BlockFailure | None = None
            for g, pool in enumerate(self.pools):
                span = range(i * pool.layers_per_block, (i + 1) * pool.layers_per_block)
                per_group.append([pages[g][p] for p in span if p in pages[g]])
                error = error or next((errors[g][p] for p in span if p in errors[g]), None)
            if error is None:
                registered = all(
                    pool.register_block(handles, namespace, block.token_key)
                    for pool, handles in zip(self.pools, per_group, strict=True)
                )
                first = per_group[0][0]
                out.append(
                    StoredBlock(
                        block.token_key,
                        block.block_hash,
                        first.offset // first.length,
                        first.generation,
                        False,
                        registered,
                    )
                )
                if registered:
                    self._resident[(namespace, block.token_key)] = block.block_hash
            else:
                out.append(error)
            for pool, handles in zip(self.pools, per_group, strict=True):
                pool.release_many(handles)  # named blocks wait in the LRU; unnamed pages drain
        return out

    # ------------------------------------------------------------------ attention

    def attend(
        self,
        access: Access,
        token_keys: Sequence[TokenKey],
        positions: Sequence[int],
        layer: int,
        q: torch.Tensor,
        seqlen: int,
        softmax_scale: float,
        causal: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Partial MLA attention of one sequence over the blocks at ``positions`` (indices into
        ``token_keys``, the sequence's blocks in order) that this pool holds in memory.

        Returns ``(out, lse, missing)``: ``out`` ``[1, s_q, h, kv_lora_rank]`` and ``lse``
        ``[1, h, s_q]`` over exactly those keys (the client merges partials from several pools
        with :func:`~tessera_ray.kernels.merge_attention_states`), and the positions this pool
        no longer holds, which the caller must cover elsewhere. Pages stay referenced while the
        kernel reads them.
        """
        from tessera_ray.kernels import mla_decode

        namespace = self.gate.resolve(access, write=False)
        self._check_keys(namespace, token_keys)
        group = next((g for g, grp in enumerate(self.layout.groups) if layer in grp.layers), None)
        if group is None:
            raise PageShapeError(f"layer {layer} has no paged MLA group in {self.layout.model!r}")
        pool = self.pools[group]
        index_in_block = self.layout.groups[group].layers.index(layer)
        if any(not 0 <= p < len(token_keys) for p in positions):
            raise PageShapeError(f"positions must index the {len(token_keys)} token keys")
        table = torch.full((1, len(token_keys)), -1, dtype=torch.int32)
        held: list[tuple[PageHandle, ...]] = []
        missing: list[int] = []
        for p in positions:
            handles = pool.lookup(namespace, token_keys[p])
            if handles is None:
                missing.append(p)
                continue
            held.append(handles)
            page = handles[index_in_block]
            table[0, p] = page.offset // page.length
        try:
            result = mla_decode(
                q,
                pool.flashmla_view(),
                table,
                torch.tensor([seqlen], dtype=torch.int32),
                softmax_scale,
                causal,
                head_dim_v=pool.page_spec.regions[0].num_values,
            )
        finally:
            for handles in held:
                pool.release_many(list(handles))
        return result.out, result.lse, missing
