"""Torch stand-ins for the Triton kernels that build DeepSeek-V4's attention metadata in vLLM
0.32.0, written from what each kernel computes. vLLM's CPU build expects triton-cpu for them;
with plain Triton it has only placeholders, and the first real step fails.

Each stand-in is called exactly as the vLLM object it replaces (same positional and keyword
arguments) and writes the same output buffers in place. Integer inputs are device tensors of
int32 (block tables, sequence lengths, query start offsets) or int64 (slot mappings); the
arithmetic runs in int64 and is cast to each output's dtype. None of them depends on vLLM, so
the unit tests run them on hand-made inputs.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "CompressedSlotMapping",
    "PrefillChunkMetadata",
    "PrefillGatherLens",
    "StandIn",
    "SWAIndicesAndLens",
    "UniformDecode",
    "token_to_request",
]

PAD_SLOT = -1  # vLLM's slot id for "no slot": a padded token, or one that writes nothing


class StandIn:
    """Base of the stand-ins for vLLM's Triton kernel objects. Those objects also precompile
    themselves when vLLM's JIT warmup asks; there is nothing to compile here."""

    def register_warmup(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to warm up: the stand-in is eager torch."""

    def __repr__(self) -> str:
        return f"<tessera_v4_cpu stand-in {type(self).__name__}>"


def token_to_request(
    query_start_loc: torch.Tensor, out: torch.Tensor, num_mapped_tokens: int, num_tokens: int
) -> torch.Tensor:
    """For each of the first ``num_tokens`` tokens of a batch, the index of the request whose
    query holds it: the first request whose query ends after the token (requests with empty
    queries, vLLM's padding, are never picked), the last request for a token past every end,
    and 0 for tokens at or past ``num_mapped_tokens``. Fills ``out[:num_tokens]`` and returns
    that view (vLLM's ``compute_token_to_req_indices``)."""
    num_reqs = query_start_loc.shape[0] - 1
    token = torch.arange(num_tokens, device=out.device)
    ends = query_start_loc[1:].to(torch.int64)
    req = torch.searchsorted(ends, token, right=True).clamp(max=max(num_reqs - 1, 0))
    req = torch.where(token < num_mapped_tokens, req, 0)
    out[:num_tokens] = req.to(out.dtype)
    return out[:num_tokens]


def _query_spans(
    query_start_loc: torch.Tensor, num_reqs: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every token of the first ``num_reqs`` queries: (token index in the batch, its request,
    its offset in the request's query). The queries tile ``query_start_loc[0]`` up to
    ``query_start_loc[num_reqs]``."""
    starts = query_start_loc[: num_reqs + 1].to(torch.int64)
    first, last = int(starts[0]), int(starts[-1])
    token = torch.arange(first, max(first, last), device=query_start_loc.device)
    req = torch.searchsorted(starts[1:], token, right=True)
    return token, req, token - starts[req]


class SWAIndicesAndLens(StandIn):
    """Sliding-window gather indices (``ComputeSWAIndicesAndLensKernel``).

    For output row ``i`` (batch token ``t = i + token_offset``): the token sits at position
    ``pos`` of its request (the request's cached prefix, then its offset in the query); it sees
    positions ``start .. pos + right``, where ``start`` is ``window_size - 1`` back (further
    back by what an image span adds beyond the window), never below 0 nor below the request's
    ``replay_start``. Row ``i`` of ``swa_indices`` gets the cache slots of those positions
    (block table entry times ``block_size`` plus the offset in the block), then ``PAD_SLOT``
    up to ``index_width`` columns; ``swa_lens[i]`` their count. A token whose
    ``is_valid_token`` is false (a padded one) gets length 0 and a row of ``PAD_SLOT``.
    """

    def __call__(
        self,
        swa_indices: torch.Tensor,
        swa_lens: torch.Tensor,
        window_size: int,
        index_width: int,
        left_visible: torch.Tensor,
        right_visible: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        token_to_req_indices: torch.Tensor,
        is_valid_token: torch.Tensor,
        block_table: torch.Tensor,
        block_size: int,
        replay_start: torch.Tensor,
        *,
        num_tokens: int,
        token_offset: int,
        has_image: bool = False,
    ) -> None:
        if num_tokens == 0:
            return
        device = swa_lens.device
        token = torch.arange(num_tokens, device=device) + token_offset
        valid = is_valid_token[token].to(torch.bool)
        # A padded token may map to any request; it is masked below, never read through.
        req = torch.where(valid, token_to_req_indices[token].to(torch.int64), 0)
        q_start = query_start_loc[req].to(torch.int64)
        q_len = query_start_loc[req + 1].to(torch.int64) - q_start
        pos = seq_lens[req].to(torch.int64) - q_len + token - q_start
        if has_image:
            left = left_visible[token].to(torch.int64)
            right = right_visible[token].to(torch.int64)
        else:
            left = right = torch.zeros_like(pos)
        widened = (left - (window_size - 1)).clamp(min=0)
        start = (pos - (window_size - 1) - widened).clamp(min=0)
        start = torch.maximum(start, replay_start[req].to(torch.int64))
        length = pos + right + 1 - start

        col = torch.arange(index_width, device=device)
        position = start[:, None] + col
        inside = (col < length[:, None]) & valid[:, None]
        block_col = torch.where(inside, position // block_size, 0)
        blocks = block_table[req[:, None], block_col].to(torch.int64)
        slots = torch.where(inside, blocks * block_size + position % block_size, PAD_SLOT)

        rows = swa_indices.as_strided((num_tokens, index_width), (swa_indices.stride(0), 1))
        rows.copy_(slots.to(swa_indices.dtype))
        swa_lens[:num_tokens] = torch.where(valid, length, 0).to(swa_lens.dtype)


class PrefillGatherLens(StandIn):
    """How many cached-or-new tokens each prefill gathers (``ComputePrefillMetadataKernel``):
    for prefill ``i`` (request ``num_decodes + i``), its query length plus as much of its cached
    prefix as the window reaches (at most ``window_size - 1`` tokens, none below the request's
    ``replay_start``)."""

    def __call__(
        self,
        prefill_gather_lens: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        replay_start: torch.Tensor,
        num_prefills: int,
        num_decodes: int,
        window_size: int,
    ) -> None:
        reqs = slice(num_decodes, num_decodes + num_prefills)
        starts = query_start_loc[num_decodes : num_decodes + num_prefills + 1].to(torch.int64)
        q_len = starts[1:] - starts[:-1]
        prefix = seq_lens[reqs].to(torch.int64) - q_len
        visible = (prefix - replay_start[reqs].to(torch.int64)).clamp(min=0)
        gather = q_len + visible.clamp(max=window_size - 1)
        prefill_gather_lens[:num_prefills] = gather.to(prefill_gather_lens.dtype)


class CompressedSlotMapping(StandIn):
    """Where each token writes its compressed state (``CompressedSlotMappingKernel``).

    Every ``compress_ratio`` positions share one compressed entry, written by the last of them
    (position ``p`` with ``(p + 1) % compress_ratio == 0``); that token's output is the entry's
    slot: entry ``p // compress_ratio`` (of the rank-local position under decode context
    parallelism), looked up in the request's block table of ``block_size``-entry blocks. Every
    other token, and a token whose own slot is ``PAD_SLOT`` (its KV is cached already), gets
    ``PAD_SLOT``. Only the rows of real query tokens are written; vLLM fills the rest first.
    """

    def __call__(
        self,
        compressed_slot_mapping: torch.Tensor,
        slot_mapping: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        block_size: int,
        compress_ratio: int,
        dcp_world_size: int,
        cp_interleave: int,
    ) -> None:
        num_reqs = min(block_table.shape[0], query_start_loc.shape[0] - 1)
        token, req, offset = _query_spans(query_start_loc, num_reqs)
        if token.numel() == 0:
            return
        starts = query_start_loc[: num_reqs + 1].to(torch.int64)
        q_len = (starts[1:] - starts[:-1])[req]
        pos = seq_lens[req].to(torch.int64) - q_len + offset
        own = slot_mapping[token].to(torch.int64)
        writes = ((pos + 1) % compress_ratio == 0) & (own != PAD_SLOT)
        stripe = cp_interleave * dcp_world_size
        local = pos // stripe * cp_interleave + pos % cp_interleave
        entry = local // compress_ratio
        block_col = torch.where(writes, entry // block_size, 0)
        blocks = block_table[req, block_col].to(torch.int64)
        slots = torch.where(writes, blocks * block_size + entry % block_size, PAD_SLOT)
        compressed_slot_mapping[token] = slots.to(compressed_slot_mapping.dtype)


class PrefillChunkMetadata(StandIn):
    """Row bounds of the indexer's prefill chunk (``BuildPrefillChunkMetadataKernel``).

    The chunk's requests have gathered compressed keys back to back (request ``b`` at rows
    ``cu_compressed_seq_lens[b] ..``). For each query token whose batch index falls in
    ``[query_slice_start, query_slice_stop)`` (written at its index minus the slice start):
    ``ks`` is its request's first row (``row_start_cu_compressed_seq_lens[b]``) and ``ke`` that
    plus the number of compressed entries its causal context holds, ``(position + 1) //
    COMPRESS_RATIO`` (its rank's share of them under decode context parallelism).
    ``token_to_seq`` names the request of every gathered row.
    """

    def __call__(
        self,
        query_start_loc: torch.Tensor,
        uncompressed_seq_lens: torch.Tensor,
        cu_compressed_seq_lens: torch.Tensor,
        row_start_cu_compressed_seq_lens: torch.Tensor,
        token_to_seq: torch.Tensor,
        cu_compressed_seq_len_ks: torch.Tensor,
        cu_compressed_seq_len_ke: torch.Tensor,
        query_slice_start: int,
        query_slice_stop: int,
        DCP_RANK: int,  # vLLM's keyword names
        DCP_WORLD: int,
        DCP_INTERLEAVE: int,
        *,
        num_reqs: int,
        COMPRESS_RATIO: int,
    ) -> None:
        token, req, offset = _query_spans(query_start_loc, num_reqs)
        starts = query_start_loc[: num_reqs + 1].to(torch.int64)
        q_len = (starts[1:] - starts[:-1])[req]
        keep = (token >= query_slice_start) & (token < query_slice_stop)
        token, req, offset, q_len = token[keep], req[keep], offset[keep], q_len[keep]
        row_start = row_start_cu_compressed_seq_lens[req].to(torch.int64)
        context = uncompressed_seq_lens[req].to(torch.int64) - q_len + 1 + offset
        entries = context // COMPRESS_RATIO
        if DCP_WORLD > 1:
            # This rank's share when entries are dealt out DCP_INTERLEAVE at a time in turn.
            whole = entries // DCP_INTERLEAVE // DCP_WORLD * DCP_INTERLEAVE
            rest = entries - whole * DCP_WORLD
            entries = whole + (rest - DCP_RANK * DCP_INTERLEAVE).clamp(0, DCP_INTERLEAVE)
        out = token - query_slice_start
        cu_compressed_seq_len_ks[out] = row_start.to(cu_compressed_seq_len_ks.dtype)
        cu_compressed_seq_len_ke[out] = (row_start + entries).to(cu_compressed_seq_len_ke.dtype)

        cu = cu_compressed_seq_lens[: num_reqs + 1].to(torch.int64)
        rows, owner, _ = _query_spans(cu, num_reqs)
        token_to_seq[rows] = owner.to(token_to_seq.dtype)


class UniformDecode(StandIn):
    """Per-token decode rows for the indexer when every decode request has the same query
    length ``max_decode_len`` (``PrepareUniformDecodeKernel``): token ``i`` of the decode batch
    is query token ``i % max_decode_len`` of request ``i // max_decode_len``; it sees the
    request's context up to itself (``seq_len - max_decode_len + i % max_decode_len + 1``
    tokens, 0 for a padded request), gets a copy of the request's block table row, and a
    query length of 1."""

    def __call__(
        self,
        seq_lens: torch.Tensor,
        decode_seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        expanded_block_table: torch.Tensor,
        decode_lens: torch.Tensor,
        num_decode_tokens: int,
        max_decode_len: int,
    ) -> None:
        index = torch.arange(num_decode_tokens, device=decode_lens.device)
        req, within = index // max_decode_len, index % max_decode_len
        seen = seq_lens[req].to(torch.int64) - max_decode_len + within + 1
        decode_seq_lens[:num_decode_tokens] = seen.clamp(min=0).to(decode_seq_lens.dtype)
        # vLLM sizes both tables alike; the kernel copies the expanded table's row width.
        width = min(block_table.shape[1], expanded_block_table.shape[1])
        expanded_block_table[:num_decode_tokens, :width] = block_table[req, :width]
        decode_lens[:num_decode_tokens] = 1
