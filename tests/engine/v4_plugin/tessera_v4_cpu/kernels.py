"""Torch stand-ins for the C++ kernels of DeepSeek-V4's CPU path that vLLM 0.32.0 builds only into
its AVX512-BF16 library. On a CPU without AVX512-BF16 vLLM loads its AVX2 library instead
(``vllm/platforms/cpu.py``, ``import_kernels``), which has none of them: the model fails to load
(``torch.ops._C`` has no ``convert_weight_packed``), and the AVX512 library cannot be loaded
there at all (illegal instruction). :func:`register_missing` registers, under vLLM's own op
names in the ``_C`` namespace, a torch version of each op the running library lacks; where the
library has the op, it is left alone.

Each stand-in is written from what the kernel computes (its inputs, outputs and cache bytes),
not from its code. The cache layouts are the ones vLLM's other kernels read:

* ``fp8_ds_mla`` (sliding-window and compressed attention caches): per block of ``B`` tokens,
  ``B`` token rows of 576 bytes (448 fp8 e4m3 values of the non-rotary part, then 64 bf16
  rotary values) followed by ``B`` rows of 8 scale bytes (one UE8M0 power-of-two exponent per
  64 fp8 values, then a zero pad byte);
* the indexer key cache: per block, ``B`` rows of 128 fp8 values, then ``B`` fp32 scales.

Numerics follow the kernels where it changes values (bf16 rounding points, power-of-two
scales, fp8 flushing); accumulation order does not. One difference: for more than 512
candidates, ``topk_transform_512_cpu`` lists its picks by descending score, the kernel in heap
order (attention sums over them either way).
"""

# No ``from __future__ import annotations``: torch.library reads these annotations as types.

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["OPS", "register_missing"]

ROPE_DIM = 64  # rotary part of every DeepSeek-V4 head (attention and indexer)
QUANT_TILE = 64  # values sharing one UE8M0 scale in fp8_ds_mla
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_SMALLEST_NORMAL = 2.0**-6
SCALE_FLOOR = 1e-4  # smallest quantization step the kernels use
INDEXER_HEAD_DIM = 128
TOPK = 512  # the only indexer top-k vLLM's CPU kernels take
_TOKEN_CHUNK = 64  # query tokens per attention/logits chunk: bounds the gathered keys


# --- shared pieces --------------------------------------------------------------------------


def _rope(
    x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, inverse: bool = False
) -> torch.Tensor:
    """GPT-J (interleaved) rotation of the last ``2 * half`` values of ``x`` [N, ..., D] by each
    row's position; ``cos_sin`` rows hold ``half`` cosines then ``half`` sines. Returns fp32."""
    half = cos_sin.shape[-1] // 2
    out = x.float().clone()
    rot = out[..., -2 * half :]
    even, odd = rot[..., 0::2].clone(), rot[..., 1::2].clone()
    shape = (positions.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos = cos_sin[positions, :half].float().view(shape)
    sin = cos_sin[positions, half : 2 * half].float().view(shape)
    if inverse:
        sin = -sin
    rot[..., 0::2] = even * cos - odd * sin
    rot[..., 1::2] = even * sin + odd * cos
    return out


def _to_fp8(scaled: torch.Tensor, flush_subnormals: bool) -> torch.Tensor:
    """fp32 values already within +-448 -> float8_e4m3fn bytes (uint8)."""
    if flush_subnormals:
        # The vectorised conversion of the sliding-window insert drops fp8 subnormals.
        scaled = torch.where(scaled.abs() < FP8_SMALLEST_NORMAL, 0.0, scaled)
    return scaled.to(torch.float8_e4m3fn).view(torch.uint8)


def _pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """The exponent of the smallest power of two ``s`` with ``amax / s <= 448``."""
    return torch.ceil(torch.log2(amax / FP8_MAX))


def _quantize_tiles(
    nope: torch.Tensor, flush_subnormals: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, 448] values (already bf16-rounded) -> ([N, 448] fp8 bytes, [N, 7] UE8M0 bytes)."""
    n = nope.shape[0]
    tiles = nope.float().view(n, -1, QUANT_TILE)
    amax = tiles.abs().amax(-1).clamp(min=SCALE_FLOOR * FP8_MAX)
    exponent = _pow2_scale(amax)
    scaled = (tiles * torch.exp2(-exponent)[..., None]).clamp(-FP8_MAX, FP8_MAX)
    data = _to_fp8(scaled, flush_subnormals).view(n, -1)
    return data, (exponent + 127).to(torch.uint8)


def _slot_rows(
    cache_2d: torch.Tensor,
    slots: torch.Tensor,
    block_size: int,
    row_bytes: int,
    offset: int = 0,
    width: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Index pair into a 2-D [blocks, bytes] cache for the ``width`` bytes at ``offset`` of row
    ``slot`` (rows of ``row_bytes`` from the start of the slot's block)."""
    width = row_bytes if width is None else width
    block = (slots // block_size)[:, None]
    col = (slots % block_size)[:, None] * row_bytes + offset + torch.arange(width)
    return block.expand_as(col), col


def _write_ds_mla(
    cache_2d: torch.Tensor,
    slots: torch.Tensor,
    block_size: int,
    nope_bytes: torch.Tensor,
    scale_bytes: torch.Tensor,
    rope_bf16: torch.Tensor,
) -> None:
    """Store tokens in fp8_ds_mla layout at ``slots``."""
    n = slots.shape[0]
    token = torch.cat([nope_bytes, rope_bf16.to(torch.bfloat16).contiguous().view(torch.uint8)], 1)
    cache_2d[_slot_rows(cache_2d, slots, block_size, token.shape[1])] = token
    scales = torch.cat([scale_bytes, torch.zeros(n, 1, dtype=torch.uint8)], 1)
    base = block_size * token.shape[1]
    cache_2d[_slot_rows(cache_2d, slots, block_size, scales.shape[1], offset=base)] = scales


def _read_ds_mla(cache_2d: torch.Tensor, slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """fp8_ds_mla rows at ``slots`` -> [N, 512] values, dequantised and rounded to bf16 as the
    attention kernel feeds them to its matmuls (returned as fp32)."""
    token_bytes = (512 - ROPE_DIM) + 2 * ROPE_DIM
    raw = cache_2d[_slot_rows(cache_2d, slots, block_size, token_bytes)]
    nope_dim = 512 - ROPE_DIM
    scale_rows = _slot_rows(
        cache_2d, slots, block_size, 8, offset=block_size * token_bytes, width=nope_dim // 64
    )
    exponent = cache_2d[scale_rows].to(torch.int32)
    scale = torch.where(exponent == 0, 0.0, torch.exp2((exponent - 127).float()))
    scale = torch.where(exponent == 255, float("nan"), scale)
    nope = raw[:, :nope_dim].contiguous().view(torch.float8_e4m3fn).float()
    nope = (nope.view(len(slots), -1, QUANT_TILE) * scale[..., None]).view(len(slots), -1)
    rope = raw[:, nope_dim:].contiguous().view(torch.bfloat16).float()
    return torch.cat([nope.to(torch.bfloat16).float(), rope], 1)


# --- attention ------------------------------------------------------------------------------


def fused_qnorm_rope_kv_insert_cpu(
    q: torch.Tensor,
    kv: torch.Tensor,
    positions: torch.Tensor,
    swa_kv_cache_2d: torch.Tensor,
    slot_mapping: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_head_padded: int,
    eps: float,
    cache_block_size: int,
) -> torch.Tensor:
    """Queries: each head RMS-normalised (no weight), rotary part rotated, padded with zero
    heads to ``q_head_padded``. Keys: rotary part rotated, rounded to bf16, stored at their
    slots (a negative slot stores nothing) in fp8_ds_mla."""
    num_tokens, heads, dim = q.shape
    qf = q.float()
    qf = qf * torch.rsqrt(qf.square().mean(-1, keepdim=True) + eps)
    out = q.new_zeros((num_tokens, q_head_padded, dim))
    out[:, :heads] = _rope(qf, positions, cos_sin_cache).to(q.dtype)

    n = slot_mapping.shape[0]
    keep = slot_mapping >= 0
    if bool(keep.any()):
        rows = _rope(kv[:n][keep], positions[:n][keep], cos_sin_cache)
        rows = rows.to(torch.bfloat16).float()
        nope_bytes, scale_bytes = _quantize_tiles(rows[:, : dim - ROPE_DIM], True)
        _write_ds_mla(
            swa_kv_cache_2d, slot_mapping[keep], cache_block_size, nope_bytes, scale_bytes,
            rows[:, dim - ROPE_DIM :],
        )  # fmt: skip
    return out


def flash_mla_with_kvcache_cpu(
    out: torch.Tensor,
    q: torch.Tensor,
    window_cache_2d: torch.Tensor,
    window_slots: torch.Tensor,
    window_block_size: int,
    compressed_cache_2d: torch.Tensor,
    compressed_slots: torch.Tensor,
    compressed_block_size: int,
    attn_sink: torch.Tensor,
    scale: float,
) -> None:
    """Each query token attends, all heads sharing one key/value row per slot (the row is both),
    to the rows at its valid window slots and its valid compressed slots (a slot is valid when
    non-negative and inside its cache). Softmax over ``scale * q.k`` with each head's sink as
    one more logit whose value row is zero; a token with no valid slot gets zeros."""
    sources = [(window_cache_2d, window_slots, window_block_size)]
    if compressed_slots.shape[1] > 0:
        sources.append((compressed_cache_2d, compressed_slots, compressed_block_size))
    sink = attn_sink.float()
    for start in range(0, q.shape[0], _TOKEN_CHUNK):
        rows = slice(start, start + _TOKEN_CHUNK)
        keys, valids = [], []
        for cache, slots, block_size in sources:
            chunk = slots[rows]
            valid = (chunk >= 0) & (chunk < cache.shape[0] * block_size)
            # Each distinct row is read once, then laid out in each token's own slot order:
            # the sums then run in list order whatever blocks the rows sit in.
            unique, inverse = torch.unique(torch.where(valid, chunk, 0), return_inverse=True)
            keys.append(_read_ds_mla(cache, unique, block_size)[inverse])
            valids.append(valid)
        key = torch.cat(keys, 1)  # [tokens, slots, 512]
        valid = torch.cat(valids, 1)[:, None, :]
        logits = torch.einsum("thd,tnd->thn", q[rows].float(), key) * scale
        logits = logits.masked_fill(~valid, float("-inf"))
        peak = logits.amax(-1, keepdim=True)
        lonely = ~torch.isfinite(peak)
        peak = torch.where(lonely, 0.0, peak)
        weight = torch.exp(logits - peak)
        denom = weight.sum(-1) + torch.exp(sink[None, :] - peak[..., 0])
        result = torch.einsum("thn,tnd->thd", weight, key) / denom[..., None]
        out[rows] = torch.where(lonely, 0.0, result).to(out.dtype)


def inverse_gptj_rope_o_proj_cpu(
    o: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, rope_dim: int
) -> torch.Tensor:
    """The attention output with each token's rotary part rotated back by its position (fp32)."""
    return _rope(o, positions, cos_sin_cache[:, :rope_dim], inverse=True)


def convert_weight_packed(weight: torch.Tensor) -> torch.Tensor:
    """The kernels' packed weight layout; :func:`bmm_cpu` here reads the plain one."""
    return weight.contiguous().clone()


def bmm_cpu(
    out: torch.Tensor,
    mat1: torch.Tensor,
    mat2: torch.Tensor,
    is_vnni: bool,
    scale: torch.Tensor | None = None,
) -> None:
    """``out[b] = mat1[b] @ mat2[b].T`` (``mat2`` is [batch, N, K])."""
    if scale is not None:
        raise NotImplementedError("tessera_v4_cpu: bmm_cpu has no fp8 weight path")
    out.copy_(torch.bmm(mat1.float(), mat2.float().transpose(1, 2)).to(out.dtype))


# --- indexer --------------------------------------------------------------------------------


def fused_indexer_q_rope_quant_cpu(
    positions: torch.Tensor,
    index_q: torch.Tensor,
    index_q_cos_sin_cache: torch.Tensor,
    index_q_fp8: torch.Tensor,
    index_weights: torch.Tensor,
    index_weights_softmax_scale: float,
    index_weights_head_scale: float,
    index_weights_out: torch.Tensor,
) -> None:
    """Indexer queries: rotary part rotated and rounded to bf16, each (token, head) scaled by a
    power of two to fit fp8 (the scale folded into its weight, with the softmax and head
    scales)."""
    q = _rope(index_q, positions, index_q_cos_sin_cache)
    rot = q[..., -ROPE_DIM:]
    q[..., -ROPE_DIM:] = rot.to(torch.bfloat16).float()
    amax = q.abs().amax(-1).clamp(min=SCALE_FLOOR)
    step = torch.exp2(_pow2_scale(amax))
    scaled = (q / step[..., None]).clamp(-FP8_MAX, FP8_MAX)
    index_q_fp8.copy_(scaled.to(torch.float8_e4m3fn))
    weights = index_weights.float() * step * index_weights_softmax_scale * index_weights_head_scale
    index_weights_out.copy_(weights)


def fp8_paged_mqa_logits_cpu(
    q_fp8: torch.Tensor,
    kvcache_fp8: torch.Tensor,
    weight: torch.Tensor,
    seq_lens: torch.Tensor,
    page_table: torch.Tensor,
    block_size: int,
    max_seq_len: int,
) -> torch.Tensor:
    """Indexer score of each cached compressed key ``j < seq_lens[b]`` for query row ``b``:
    ``key_scale[j] * sum_h weight[b, h] * relu(q[b, h] . key[j])`` (fp8 values as stored).
    Scores past a row's length are -inf (never read)."""
    batch, _, dim = q_fp8.shape
    logits = torch.full((batch, max_seq_len), float("-inf"))
    if batch == 0 or max_seq_len == 0:
        return logits
    position = torch.arange(max_seq_len)
    offset = position % block_size
    key_col = (offset * dim)[:, None] + torch.arange(dim)  # [max_seq_len, dim]
    scale_col = (block_size * dim + offset * 4)[:, None] + torch.arange(4)
    for start in range(0, batch, _TOKEN_CHUNK):
        rows = slice(start, start + _TOKEN_CHUNK)
        inside = position[None, :] < seq_lens[rows].long()[:, None]
        page_col = torch.where(inside, position // block_size, 0)
        page = page_table[rows].long().gather(1, page_col)[..., None]  # [b, max_seq_len, 1]
        key = kvcache_fp8[page, key_col].view(torch.float8_e4m3fn).float()
        key_scale = kvcache_fp8[page, scale_col].contiguous().view(torch.float32)[..., 0]
        dots = torch.einsum("bhd,bld->bhl", q_fp8[rows].float(), key).clamp(min=0)
        score = torch.einsum("bhl,bh->bl", dots, weight[rows].float()) * key_scale
        logits[rows] = torch.where(inside, score, float("-inf"))
    return logits


def topk_transform_512_cpu(
    scores: torch.Tensor,
    seq_lens: torch.Tensor,
    page_tables: torch.Tensor,
    out_page_indices: torch.Tensor,
    page_size: int,
    out_raw_indices: torch.Tensor | None = None,
) -> None:
    """Per row: the indices of its 512 best scores among its first ``seq_lens`` (ties to the
    lower index; all of them, in order, when there are at most 512), -1 for the rest; also
    each one as a cache slot through the row's page table."""
    batch, width = scores.shape
    length = seq_lens.long().clamp(0, width)
    position = torch.arange(width)
    masked = torch.where(position[None, :] < length[:, None], scores, float("-inf"))
    order = torch.sort(masked, dim=1, descending=True, stable=True).indices[:, :TOPK]
    few = length <= TOPK
    if width < TOPK:
        order = torch.cat([order, torch.zeros(batch, TOPK - width, dtype=order.dtype)], 1)
    ascending = torch.arange(TOPK).expand(batch, TOPK)
    raw = torch.where(few[:, None], ascending, order)
    raw = torch.where(torch.arange(TOPK)[None, :] < length[:, None].clamp(max=TOPK), raw, -1)
    page = page_tables.long().gather(1, torch.where(raw >= 0, raw // page_size, 0))
    slots = torch.where(raw >= 0, page * page_size + raw % page_size, -1)
    out_page_indices[:, :TOPK] = slots.to(out_page_indices.dtype)
    if out_raw_indices is not None:
        out_raw_indices[:, :TOPK] = raw.to(out_raw_indices.dtype)


# --- compressor -----------------------------------------------------------------------------


def save_partial_states_cpu(
    kv: torch.Tensor,
    score: torch.Tensor,
    ape: torch.Tensor,
    positions: torch.Tensor,
    state_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Each token's state row at its slot: its key/value projection, then its gate score plus
    the learned bias of its position within the compression window (``pos % ratio``)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_size = state_cache.shape[1]
    biased = score[keep] + ape[positions[keep] % ape.shape[0]]
    state_cache[slots // block_size, slots % block_size] = torch.cat([kv[keep], biased], 1)


def _compress(
    state_cache: torch.Tensor,
    gather_slots: torch.Tensor,
    positions: torch.Tensor,
    kv_slot_mapping: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    compress_ratio: int,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tokens that close a compression window and have a slot, their window pooled: per
    channel, a softmax over the window's gate scores weights its key/values. The window's older
    ``ratio`` rows contribute their first ``head_dim`` channels, the newer ones (overlapping
    windows) their second. Then RMS-normalised with ``norm_weight``. Returns (pooled fp32
    [N, head_dim], their positions, their cache slots)."""
    closes = ((positions + 1) % compress_ratio == 0) & (kv_slot_mapping >= 0)
    slots = gather_slots[closes]
    num, window = slots.shape
    state_width = state_cache.shape[2] // 2
    block_size = state_cache.shape[1]
    valid = slots >= 0
    safe = torch.where(valid, slots, 0)
    rows = state_cache[safe // block_size, safe % block_size]  # [N, window, 2 * state_width]
    newer = (torch.arange(window) >= compress_ratio).long() * head_dim
    channel = newer[:, None] + torch.arange(head_dim)  # [window, head_dim]
    values = rows.gather(2, channel.expand(num, window, head_dim))
    scores = rows.gather(2, (channel + state_width).expand(num, window, head_dim))
    scores = scores.masked_fill(~valid[..., None], float("-inf"))
    weights = torch.softmax(scores, dim=1)
    pooled = (weights * torch.where(valid[..., None], values, 0.0)).sum(1)
    pooled = pooled * torch.rsqrt(pooled.square().mean(-1, keepdim=True) + eps)
    return pooled * norm_weight.float(), positions[closes], kv_slot_mapping[closes]


def compress_norm_rope_store_cpu(
    state_cache: torch.Tensor,
    gather_slots: torch.Tensor,
    positions: torch.Tensor,
    kv_slot_mapping: torch.Tensor,
    rms_norm_weight: torch.Tensor,
    rms_norm_eps: float,
    cos_sin_cache: torch.Tensor,
    kv_cache_2d: torch.Tensor,
    kv_cache_block_size: int,
    compress_ratio: int,
) -> None:
    """Main compressor: pooled entries, rotary part rotated at the window's first position,
    stored in fp8_ds_mla (the non-rotary part rounded to bf16 before quantization)."""
    pooled, pos, slots = _compress(
        state_cache, gather_slots, positions, kv_slot_mapping, rms_norm_weight, rms_norm_eps,
        compress_ratio, 512,
    )  # fmt: skip
    if slots.numel() == 0:
        return
    nope_bytes, scale_bytes = _quantize_tiles(pooled[:, :-ROPE_DIM].to(torch.bfloat16), False)
    first = pos // compress_ratio * compress_ratio
    rope = _rope(pooled, first, cos_sin_cache)[:, -ROPE_DIM:]
    _write_ds_mla(kv_cache_2d, slots, kv_cache_block_size, nope_bytes, scale_bytes, rope)


def compress_norm_rope_store_indexer_cpu(
    state_cache: torch.Tensor,
    gather_slots: torch.Tensor,
    positions: torch.Tensor,
    kv_slot_mapping: torch.Tensor,
    rms_norm_weight: torch.Tensor,
    rms_norm_eps: float,
    cos_sin_cache: torch.Tensor,
    kv_cache_2d: torch.Tensor,
    kv_cache_block_size: int,
    compress_ratio: int,
) -> None:
    """Indexer compressor: pooled 128-value keys, rotated at the window's first position,
    rounded to bf16, scaled by one power of two per key into fp8; the key bytes, then the fp32
    scales, per cache block."""
    pooled, pos, slots = _compress(
        state_cache, gather_slots, positions, kv_slot_mapping, rms_norm_weight, rms_norm_eps,
        compress_ratio, INDEXER_HEAD_DIM,
    )  # fmt: skip
    if slots.numel() == 0:
        return
    first = pos // compress_ratio * compress_ratio
    key = _rope(pooled, first, cos_sin_cache).to(torch.bfloat16).float()
    step = torch.exp2(_pow2_scale(key.abs().amax(-1).clamp(min=SCALE_FLOOR)))
    data = _to_fp8((key / step[:, None]).clamp(-FP8_MAX, FP8_MAX), False)
    kv_cache_2d[_slot_rows(kv_cache_2d, slots, kv_cache_block_size, INDEXER_HEAD_DIM)] = data
    scale_at = _slot_rows(
        kv_cache_2d, slots, kv_cache_block_size, 4, offset=kv_cache_block_size * INDEXER_HEAD_DIM
    )
    kv_cache_2d[scale_at] = step.float()[:, None].contiguous().view(torch.uint8)


# --- hyper-connections and routing ---------------------------------------------------------


def hc_pre_fused_cpu(
    x: torch.Tensor,
    hc_fn: torch.Tensor,
    hc_scale: torch.Tensor,
    hc_base: torch.Tensor,
    hc_mult: int,
    sinkhorn_iters: int,
    rms_eps: float,
    hc_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """vLLM's own eager reference of the hyper-connection pre block (``mhc_pre_torch``), with
    the kernel's single epsilon and post multiplier 2. Returns (layer input, post, comb)."""
    from vllm.model_executor.kernels.mhc.torch import mhc_pre_torch

    post, comb, layer_input = mhc_pre_torch(
        x, hc_fn, hc_scale, hc_base, rms_eps, hc_eps, hc_eps, 2.0, sinkhorn_iters
    )
    return layer_input.to(x.dtype), post.reshape(x.shape[0], hc_mult), comb.contiguous()


def hc_post_fused_cpu(
    x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """vLLM's eager reference of the post block (``mhc_post_torch``)."""
    from vllm.model_executor.kernels.mhc.torch import mhc_post_torch

    out: torch.Tensor = mhc_post_torch(x, residual, post.unsqueeze(-1), comb)
    return out.to(x.dtype)


def hc_head_fused_cpu(
    x: torch.Tensor,
    hc_fn: torch.Tensor,
    hc_scale: torch.Tensor,
    hc_base: torch.Tensor,
    hc_eps: float,
    norm_eps: float,
) -> torch.Tensor:
    """Collapse the residual streams before the final norm: stream ``h`` weighted by
    ``sigmoid(scale * (x . fn_h) / rms(x) + base_h) + hc_eps`` (x all streams flattened)."""
    flat = x.float().reshape(x.shape[0], -1)
    inv_rms = torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    gate = torch.sigmoid(flat @ hc_fn.float().t() * inv_rms * hc_scale.float() + hc_base.float())
    return ((gate + hc_eps)[..., None] * x.float()).sum(1).to(x.dtype)


def _expert_scores(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    x = logits.float()
    if scoring_func == "sigmoid":
        return torch.sigmoid(x)
    if scoring_func == "softmax":
        return torch.softmax(x, dim=-1)
    if scoring_func != "sqrtsoftplus":
        raise ValueError(f"tessera_v4_cpu: unsupported scoring_func {scoring_func!r}")
    # sqrt(softplus(x)), with the kernel's cut-offs on both tails.
    middle = torch.sqrt(torch.log1p(torch.exp(x.clamp(max=20.0))))
    return torch.where(x > 20.0, torch.sqrt(x), torch.where(x < -15.0, torch.exp(x / 2), middle))


def biased_topk_cpu(
    hidden_states: torch.Tensor,
    gating_output: torch.Tensor,
    correction_bias: torch.Tensor,
    topk: int,
    renormalize: bool,
    scoring_func: str,
    num_fused_shared_experts: int,
    routed_scaling_factor: float | None,
    apply_routed_scaling_factor_on_output: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts picked by score plus correction bias, weighted by the unbiased score."""
    if num_fused_shared_experts:
        raise NotImplementedError("tessera_v4_cpu: no fused shared experts")
    scores = _expert_scores(gating_output, scoring_func)
    ids = torch.topk(scores + correction_bias.float(), topk, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        factor = routed_scaling_factor if routed_scaling_factor is not None else 0.0
        scale = 1.0 / weights.sum(-1, keepdim=True)
        weights = weights * (scale * factor if apply_routed_scaling_factor_on_output else scale)
    return weights, ids.to(torch.int32)


def hash_topk_cpu(
    gating_output: torch.Tensor,
    tid2eid: torch.Tensor,
    topk: int,
    scoring_func: str,
    num_fused_shared_experts: int,
    num_experts: int,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts from each token's row of the hash table, weighted by their scores (renormalised
    to ``routed_scaling_factor`` unless the scores are a softmax)."""
    if num_fused_shared_experts:
        raise NotImplementedError("tessera_v4_cpu: no fused shared experts")
    scores = _expert_scores(gating_output, scoring_func)
    ids = tid2eid.long()
    weights = scores.gather(1, ids)
    if scoring_func != "softmax":
        total = weights.sum(-1, keepdim=True)
        weights = torch.where(total > 0, weights / total * routed_scaling_factor, weights)
    return weights, ids.to(torch.int32)


# name -> (function, arguments it writes in place)
OPS: dict[str, tuple[Callable[..., Any], tuple[str, ...]]] = {
    "fused_qnorm_rope_kv_insert_cpu": (fused_qnorm_rope_kv_insert_cpu, ("swa_kv_cache_2d",)),
    "flash_mla_with_kvcache_cpu": (flash_mla_with_kvcache_cpu, ("out",)),
    "inverse_gptj_rope_o_proj_cpu": (inverse_gptj_rope_o_proj_cpu, ()),
    "convert_weight_packed": (convert_weight_packed, ()),
    "bmm_cpu": (bmm_cpu, ("out",)),
    "fused_indexer_q_rope_quant_cpu": (
        fused_indexer_q_rope_quant_cpu,
        ("index_q_fp8", "index_weights_out"),
    ),
    "fp8_paged_mqa_logits_cpu": (fp8_paged_mqa_logits_cpu, ()),
    "topk_transform_512_cpu": (topk_transform_512_cpu, ("out_page_indices", "out_raw_indices")),
    "save_partial_states_cpu": (save_partial_states_cpu, ("state_cache",)),
    "compress_norm_rope_store_cpu": (compress_norm_rope_store_cpu, ("kv_cache_2d",)),
    "compress_norm_rope_store_indexer_cpu": (
        compress_norm_rope_store_indexer_cpu,
        ("kv_cache_2d",),
    ),
    "hc_pre_fused_cpu": (hc_pre_fused_cpu, ()),
    "hc_post_fused_cpu": (hc_post_fused_cpu, ()),
    "hc_head_fused_cpu": (hc_head_fused_cpu, ()),
    "biased_topk_cpu": (biased_topk_cpu, ()),
    "hash_topk_cpu": (hash_topk_cpu, ()),
}


def register_missing() -> list[str]:
    """Register each op of :data:`OPS` that ``torch.ops._C`` lacks; returns their names."""
    added = []
    for name, (fn, mutated) in OPS.items():
        if hasattr(torch.ops._C, name):
            continue
        torch.library.custom_op(f"_C::{name}", fn, mutates_args=mutated, device_types="cpu")
        added.append(name)
    return added
