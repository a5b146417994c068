"""MLA decode over paged latents in plain PyTorch: the reference every kernel is tested against.

Absorbed MLA decode (docs/mla-math.md): each stored token is one 576-value key
``[c_kv (512) | k_rope (64)]``; its first ``head_dim_v`` values are also the value. For query
head ``i`` at query row ``j``::

    score_t = (q[j, i] . k_t) * softmax_scale
    lse     = log(sum_t exp(score_t))            (natural log, as FlashMLA's softmax_lse)
    out     = sum_t exp(score_t - lse) k_t[:head_dim_v]

Conventions, pinned by tests:

- Causal with ``s_q > 1`` follows FlashMLA: query row ``j`` of ``s_q`` sees keys at positions
  ``0 .. seqlen - s_q + j`` (the queries are the last ``s_q`` tokens of the sequence).
- A query that sees no key (``seqlen == 0``, or a causal row before the first key, or only pages
  this caller does not hold) gets ``out = 0`` and ``lse = -inf``. That is the exact value of an
  empty partial, so :func:`~tessera_ray.kernels.merge.merge_attention_states` needs no special
  case. (FlashMLA itself reports ``+inf`` there; the adapter converts.)
- A negative block-table entry means "this page is not held here": its keys are skipped but
  positions stay where the table puts them, so causal masking of a partial is still right.
  This is how one pool computes its partial over a sequence whose pages are spread out.

All arithmetic is float32 whatever the page dtype (bf16 pages are upcast after the gather), so
the same pages give bit-identical results wherever they sit in the pool.
"""

from __future__ import annotations

import torch

from tessera_ray.kernels._checks import check_decode_inputs

__all__ = ["mla_decode_reference", "DEFAULT_HEAD_DIM_V"]

DEFAULT_HEAD_DIM_V = 512
"""The latent width (kv_lora_rank) of DeepSeek-V2/V3 and Kimi-K2; FlashMLA's only head_dim_v."""


def mla_decode_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    *,
    head_dim_v: int = DEFAULT_HEAD_DIM_V,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged MLA decode with float32 accumulation, FlashMLA's ``flash_mla_with_kvcache`` contract.

    Args:
        q: ``[batch, s_q, h_q, head_dim]`` absorbed queries (``head_dim`` = kv_lora_rank +
            rope_dim, 576 for DeepSeek-V3), float32 / bfloat16 / float16.
        k_cache: ``[num_pages, page_tokens, 1, head_dim]`` pages; any float dtype (may differ
            from ``q``'s: bf16 pages with fp32 queries is the tiny model's bf16 mode).
        block_table: ``[batch, max_blocks]`` int32 page ids; entry ``k`` of row ``b`` holds
            tokens ``k*page_tokens ..`` of sequence ``b``. Negative: page not held here.
        cache_seqlens: ``[batch]`` int32 tokens per sequence (may be 0).
        softmax_scale: multiplies ``q . k`` before the softmax (DeepSeek-V3: ``1/sqrt(192)``).
        causal: mask keys after each query row's position (matters only when ``s_q > 1``).
        head_dim_v: how many leading key values are the value (512 for DeepSeek).

    Returns:
        ``(out, lse)``: out ``[batch, s_q, h_q, head_dim_v]`` in ``q``'s dtype, lse
        ``[batch, h_q, s_q]`` float32 (natural log of the sum of exp of scaled scores).
    """
    shape = check_decode_inputs(q, k_cache, block_table, cache_seqlens, head_dim_v=head_dim_v)
    batch, s_q, h_q = shape.batch, shape.s_q, shape.h_q
    page = shape.page_tokens
    device = q.device
    out = torch.zeros(batch, s_q, h_q, head_dim_v, dtype=torch.float32, device=device)
    lse = torch.full((batch, h_q, s_q), float("-inf"), dtype=torch.float32, device=device)
    lens = cache_seqlens.cpu().tolist()
    flat = k_cache.view(shape.num_pages * page, shape.head_dim) if k_cache.is_contiguous() else None
    for b, length in enumerate(lens):
        if length == 0:
            continue
        blocks = -(-length // page)
        ids = block_table[b, :blocks].to(device=device, dtype=torch.int64)
        held = ids >= 0
        # Token slots of the sequence, in order; pages not held read page 0 and are masked.
        slots = ids.clamp(min=0).unsqueeze(1) * page + torch.arange(page, device=device)
        slots = slots.reshape(-1)[:length]
        if flat is not None:
            keys = flat.index_select(0, slots)
        else:
            keys = k_cache.reshape(-1, shape.head_dim).index_select(0, slots)
        keys = keys.float()  # [length, head_dim]
        valid = held.repeat_interleave(page)[:length].unsqueeze(0).expand(s_q, length)
        if causal and s_q > 1:
            last = length - s_q + torch.arange(s_q, device=device)  # last key each row sees
            valid = valid & (torch.arange(length, device=device).unsqueeze(0) <= last[:, None])
        qb = q[b].float()  # [s_q, h_q, head_dim]
        scores = torch.einsum("shd,td->sht", qb, keys) * softmax_scale
        scores = scores.masked_fill(~valid.unsqueeze(1), float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)  # [s_q, h_q]; -inf where nothing is seen
        # exp(-inf - 0) = 0 turns rows that see nothing into zeros instead of NaN.
        safe = torch.where(torch.isneginf(row_lse), torch.zeros_like(row_lse), row_lse)
        probs = torch.exp(scores - safe.unsqueeze(-1))
        out[b] = torch.einsum("sht,tv->shv", probs, keys[:, :head_dim_v])
        lse[b] = row_lse.transpose(0, 1)
    return out.to(q.dtype), lse
