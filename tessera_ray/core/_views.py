"""Typed zero-copy views of the pool's byte tensor, one per region of the page spec.

The pool stores raw bytes ``[num_pages, page_bytes]`` because precision differs per region
inside one entry (fp8 content, bf16 RoPE, fp32 or ue8m0 scales). Entries lie token-major inside
a page, so region ``r`` of every entry is a strided slice of the bytes, reinterpreted as
``r.dtype``: ``[num_pages, entries_per_page, values]``. FP4 views as torch's packed pair type
(``float4_e2m1fn_x2``), so it has half as many elements as values.
"""

from __future__ import annotations

import torch

from tessera_ray.layout import DType, PageSpec, Region, Scheme

__all__ = ["region_dtype", "region_columns", "region_views", "flashmla_view"]


def region_dtype(region: Region) -> torch.dtype:
    dtype = getattr(torch, region.dtype.torch_name, None)
    # An older torch without fp8/fp4 types keeps the raw bytes: still exact, just untyped.
    return dtype if isinstance(dtype, torch.dtype) else torch.uint8


def region_columns(region: Region) -> int:
    """Elements of the torch view per entry (fp4 packs two values into one element)."""
    return region.nbytes // region_dtype(region).itemsize


def region_views(data: torch.Tensor, spec: PageSpec) -> dict[str, torch.Tensor]:
    """``{region name: [num_pages, entries_per_page, columns] view}`` sharing ``data``'s memory.

    A region whose offset or entry stride is not a multiple of its element size cannot be
    reinterpreted in place; it stays a ``uint8`` view (its bytes are still exact).
    """
    entries = data.view(data.shape[0], spec.entries_per_page, spec.entry_bytes)
    views: dict[str, torch.Tensor] = {}
    for region in spec.regions:
        offset, length = spec.cache.entry.region_offsets[region.name]
        raw = entries[:, :, offset : offset + length]
        try:
            views[region.name] = raw.view(region_dtype(region))
        except RuntimeError:
            views[region.name] = raw
    return views


def flashmla_view(data: torch.Tensor, spec: PageSpec) -> torch.Tensor:
    """FlashMLA's ``k_cache [num_pages, block_tokens, 1, 576]`` bf16 over the same memory.

    Only an MLA page whose every region is bf16 (the "mla-bf16" format) has this shape; any
    other format raises ``ValueError``.
    """
    if spec.cache.scheme is not Scheme.MLA or any(r.dtype is not DType.BF16 for r in spec.regions):
        raise ValueError(
            f"FlashMLA's dense view needs an all-bf16 MLA page, not {spec.cache.label()} "
            f"({spec.cache.entry.describe()})"
        )
    values = spec.entry_bytes // 2
    return (
        data.view(data.shape[0], spec.block_tokens, 1, spec.entry_bytes)
        .view(torch.bfloat16)
        .view(data.shape[0], spec.block_tokens, 1, values)
    )
