"""Input checks shared by every MLA decode backend: shapes, strides, dtypes, devices, table fit.

Every backend goes through :func:`check_decode_inputs` first, so a caller gets the same clear
:class:`~tessera_ray.errors.KernelError` whichever kernel would have run, instead of a CUDA
assertion or a silently wrong answer from an out-of-range page id.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tessera_ray.errors import KernelError

__all__ = ["DecodeShape", "check_decode_inputs", "check_table_fits", "FLOAT_DTYPES"]

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True, kw_only=True)
class DecodeShape:
    """The sizes one decode call works on, read off its (checked) inputs."""

    batch: int
    s_q: int
    h_q: int
    head_dim: int
    head_dim_v: int
    num_pages: int
    page_tokens: int
    max_blocks: int


def _need(cond: bool, message: str) -> None:
    if not cond:
        raise KernelError(message)


def check_decode_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    head_dim_v: int,
    check_values: bool = True,
) -> DecodeShape:
    """Check a decode call against FlashMLA's contract; return its sizes.

    ``check_values`` also reads the block table and lengths (a device sync on GPU): every used
    entry must name an existing page or be negative (a page this caller does not hold), and no
    sequence may be longer than its table row covers.
    """
    for name, t in (("q", q), ("k_cache", k_cache)):
        _need(isinstance(t, torch.Tensor), f"{name} must be a torch.Tensor, got {type(t)!r}")
        _need(
            t.dtype in FLOAT_DTYPES,
            f"{name} must be float32, bfloat16 or float16, got {t.dtype}",
        )
    _need(
        q.dim() == 4,
        f"q must be [batch, s_q, h_q, head_dim], got shape {tuple(q.shape)}",
    )
    _need(
        k_cache.dim() == 4,
        f"k_cache must be [num_pages, page_tokens, 1, head_dim] (FlashMLA layout), "
        f"got shape {tuple(k_cache.shape)}",
    )
    batch, s_q, h_q, head_dim = q.shape
    num_pages, page_tokens, h_k, k_dim = k_cache.shape
    _need(h_k == 1, f"k_cache must hold one latent head (dim 2 == 1), got {h_k}")
    _need(
        k_dim == head_dim,
        f"q head_dim {head_dim} != k_cache head_dim {k_dim}; both are kv_lora_rank + rope_dim",
    )
    _need(
        0 < head_dim_v < head_dim,
        f"head_dim_v must be in (0, {head_dim}), got {head_dim_v} (the latent part of the key)",
    )
    _need(batch > 0 and s_q > 0 and h_q > 0, f"q has an empty dimension: {tuple(q.shape)}")
    _need(page_tokens > 0, "k_cache pages hold no tokens")
    # The last dimension is read as one vector per token: it must be dense. Other strides are
    # free (views of a larger pool tensor are fine).
    _need(q.stride(-1) == 1, f"q's last dimension must be contiguous, stride {q.stride(-1)}")
    _need(
        k_cache.stride(-1) == 1,
        f"k_cache's last dimension must be contiguous, stride {k_cache.stride(-1)}",
    )
    _need(
        block_table.dim() == 2 and block_table.shape[0] == batch,
        f"block_table must be [batch={batch}, max_blocks], got shape {tuple(block_table.shape)}",
    )
    _need(
        block_table.dtype == torch.int32,
        f"block_table must be int32 (FlashMLA's contract), got {block_table.dtype}",
    )
    _need(
        cache_seqlens.dim() == 1 and cache_seqlens.shape[0] == batch,
        f"cache_seqlens must be [batch={batch}], got shape {tuple(cache_seqlens.shape)}",
    )
    _need(
        cache_seqlens.dtype == torch.int32,
        f"cache_seqlens must be int32, got {cache_seqlens.dtype}",
    )
    # FlashMLA reads both through raw pointers: as its own input checks, a contiguous
    # cache_seqlens and block-table rows of unit stride, or a kernel would read the wrong ids.
    _need(cache_seqlens.is_contiguous(), "cache_seqlens must be contiguous (FlashMLA's contract)")
    _need(
        block_table.shape[1] <= 1 or block_table.stride(1) == 1,
        f"block_table's last dimension must have stride 1 (FlashMLA's contract), got strides "
        f"{tuple(block_table.stride())}",
    )
    devices = {t.device for t in (q, k_cache, block_table, cache_seqlens)}
    _need(len(devices) == 1, f"all inputs must be on one device, got {sorted(map(str, devices))}")
    max_blocks = block_table.shape[1]
    if check_values:
        check_table_fits(block_table, cache_seqlens, num_pages=num_pages, page_tokens=page_tokens)
    return DecodeShape(
        batch=batch,
        s_q=s_q,
        h_q=h_q,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        num_pages=num_pages,
        page_tokens=page_tokens,
        max_blocks=max_blocks,
    )


def check_table_fits(
    block_table: torch.Tensor, cache_seqlens: torch.Tensor, *, num_pages: int, page_tokens: int
) -> None:
    """Every used table entry names an existing page (or is negative: not held here) and no
    sequence is longer than its row covers. Reads both tensors on the host."""
    max_blocks = block_table.shape[1]
    lens = cache_seqlens.cpu().long()
    _need(bool((lens >= 0).all()), f"cache_seqlens must be >= 0, got {lens.tolist()}")
    longest = int(lens.max()) if lens.numel() else 0
    _need(
        longest <= max_blocks * page_tokens,
        f"a sequence of {longest} tokens needs {-(-longest // page_tokens)} pages but "
        f"block_table has {max_blocks} columns",
    )
    table = block_table.cpu()
    used = torch.arange(max_blocks) < (-(-lens // page_tokens)).unsqueeze(1)
    bad = used & (table >= num_pages)
    _need(
        not bool(bad.any()),
        f"block_table names page ids >= num_pages ({num_pages}): "
        f"{sorted(set(table[bad].tolist()))[:8]}",
    )
