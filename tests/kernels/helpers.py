"""Random MLA data laid out in pages, with the un-paged latents kept for dense comparisons."""

from __future__ import annotations

from dataclasses import dataclass

import torch

KV_LORA = 512
ROPE = 64
NOPE = 128
V_DIM = 128
SCALE = (NOPE + ROPE) ** -0.5  # DeepSeek-V3: 1/sqrt(192)


@dataclass
class PagedCase:
    c_kv: list[torch.Tensor]  # per sequence [len, KV_LORA] float64
    k_rope: list[torch.Tensor]  # per sequence [len, ROPE] float64
    k_cache: torch.Tensor  # [num_pages, page, 1, KV_LORA + ROPE] float32
    block_table: torch.Tensor  # [batch, max_blocks] int32, shuffled page ids, -7 in unused slots
    seqlens: torch.Tensor  # [batch] int32


def paged_case(
    seqlens: list[int], *, page: int = 16, spare_pages: int = 3, seed: int = 0
) -> PagedCase:
    """Sequences of the given lengths in pages whose ids are a random permutation (so the block
    table is non-contiguous), with spare pages of garbage that no sequence uses."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-n // page) for n in seqlens]
    num_pages = sum(blocks) + spare_pages
    perm = torch.randperm(num_pages, generator=gen)
    k_cache = torch.randn(num_pages, page, 1, KV_LORA + ROPE, generator=gen) * 50  # garbage
    max_blocks = max(max(blocks), 1) + 1
    table = torch.full((len(seqlens), max_blocks), -7, dtype=torch.int32)
    c_kvs, ropes, used = [], [], 0
    for b, n in enumerate(seqlens):
        c = torch.randn(n, KV_LORA, generator=gen, dtype=torch.float64)
        r = torch.randn(n, ROPE, generator=gen, dtype=torch.float64)
        c_kvs.append(c)
        ropes.append(r)
        ids = perm[used : used + blocks[b]]
        used += blocks[b]
        table[b, : blocks[b]] = ids.to(torch.int32)
        tokens = torch.cat([c, r], dim=-1).float()
        for k, pid in enumerate(ids.tolist()):
            chunk = tokens[k * page : (k + 1) * page]
            k_cache[pid, : chunk.shape[0], 0] = chunk
    return PagedCase(c_kvs, ropes, k_cache, table, torch.tensor(seqlens, dtype=torch.int32))


def dense_mla(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    c_kv: torch.Tensor,
    k_rope: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-absorbed MLA attention of one sequence in float64: keys and values expanded per head.

    q_nope [s_q, h, NOPE], q_rope [s_q, h, ROPE], c_kv [L, KV_LORA], k_rope [L, ROPE],
    w_uk [h, NOPE, KV_LORA], w_uv [h, V_DIM, KV_LORA]. Returns out [s_q, h, V_DIM], lse [h, s_q].
    """
    q_nope, q_rope = q_nope.double(), q_rope.double()
    k_nope = torch.einsum("hnc,tc->thn", w_uk.double(), c_kv)
    v = torch.einsum("hvc,tc->thv", w_uv.double(), c_kv)
    scores = (
        torch.einsum("shn,thn->sht", q_nope, k_nope) + torch.einsum("shr,tr->sht", q_rope, k_rope)
    ) * SCALE
    s_q, length = q_nope.shape[0], c_kv.shape[0]
    if causal:
        last = length - s_q + torch.arange(s_q)
        mask = torch.arange(length).unsqueeze(0) <= last.unsqueeze(1)
        scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("sht,thv->shv", torch.softmax(scores, dim=-1), v)
    return out, lse.transpose(0, 1)
