"""Exact merge of partial attention computed over disjoint key sets (pages in several pools).

Attention over keys ``A + B`` is a softmax-weighted mix of the two partials (docs/mla-math.md)::

    lse = logaddexp(lse_a, lse_b)
    out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

so attention can run where the pages live and only ``(out, lse)`` travels. An empty partial
(``lse = -inf``, ``out = 0``) has weight exactly 0; if every partial is empty the merge is
empty too (``out = 0``, ``lse = -inf``), never NaN.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tessera_ray.errors import KernelError

__all__ = ["merge_attention_states", "mask_block_table"]


def merge_attention_states(
    outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partial attention results ``(out_k, lse_k)`` over disjoint key sets.

    Args:
        outs: each ``[batch, s_q, h_q, head_dim_v]`` (the decode ``out`` layout).
        lses: each ``[batch, h_q, s_q]`` float32, natural log (the decode ``lse`` layout).

    Returns:
        ``(out, lse)`` in the same layouts; ``out`` in the first partial's dtype, computed in
        float32.
    """
    if len(outs) == 0 or len(outs) != len(lses):
        raise KernelError(
            f"merge needs one lse per out and at least one partial, got {len(outs)} outs and "
            f"{len(lses)} lses"
        )
    first_out = outs[0]
    if first_out.dim() != 4:
        raise KernelError(f"out must be [batch, s_q, h_q, dv], got {tuple(first_out.shape)}")
    batch, s_q, h_q, _ = first_out.shape
    for out, lse in zip(outs, lses, strict=True):
        if out.shape != first_out.shape:
            raise KernelError(f"partials differ in shape: {tuple(out.shape)} vs {first_out.shape}")
        if tuple(lse.shape) != (batch, h_q, s_q):
            raise KernelError(f"lse must be [batch, h_q, s_q]={batch, h_q, s_q}, got {lse.shape}")
        if out.device != first_out.device or lse.device != first_out.device:
            raise KernelError("partials must be on one device; move them first")
    stacked_lse = torch.stack([lse.float() for lse in lses])  # [k, batch, h_q, s_q]
    total = torch.logsumexp(stacked_lse, dim=0)
    safe = torch.where(torch.isneginf(total), torch.zeros_like(total), total)
    # Weight of each partial, [k, batch, s_q, h_q, 1] to line up with out's layout.
    weights = torch.exp(stacked_lse - safe).transpose(2, 3).unsqueeze(-1)
    merged = (weights * torch.stack([o.float() for o in outs])).sum(dim=0)
    return merged.to(first_out.dtype), total


def mask_block_table(block_table: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """The block table a holder of only some pages decodes with: other entries become -1.

    ``held`` is a bool tensor over page ids (``held[page_id]`` is True where this pool holds the
    page). The reference decode skips negative entries but keeps every token's position, so
    partials from holders of disjoint page sets merge to the full attention, causal included.
    """
    if held.dtype != torch.bool or held.dim() != 1:
        raise KernelError(f"held must be a 1-D bool mask over page ids, got {held.dtype}")
    ids = block_table.long()
    inside = (ids >= 0) & (ids < held.numel())
    keep = inside & held[ids.clamp(0, held.numel() - 1)]
    return torch.where(keep, block_table, torch.full_like(block_table, -1))
