"""Partial MLA decode attention over the pages one pool holds, run where the pages are."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tessera_ray.actors._groups import LayerGroups
from tessera_ray.core import PageHandle
from tessera_ray.core.results import TokenKey
from tessera_ray.errors import PageShapeError

__all__ = ["attend_held"]


def attend_held(
    groups: LayerGroups,
    namespace: str,
    token_keys: Sequence[TokenKey],
    positions: Sequence[int],
    layer: int,
    q: torch.Tensor,
    seqlen: int,
    softmax_scale: float,
    causal: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Attention of one sequence over the blocks at ``positions`` (indices into ``token_keys``,
    the sequence's blocks in order) that ``groups`` holds in memory.

    Returns ``(out, lse, missing)``: ``out`` ``[1, s_q, h, kv_lora_rank]`` and ``lse``
    ``[1, h, s_q]`` over exactly those blocks (partials from several pools merge with
    :func:`~tessera_ray.kernels.merge_attention_states`), and the positions not held here,
    which the caller must cover elsewhere. Pages stay referenced while the kernel reads them.
    """
    from tessera_ray.kernels import mla_decode

    layout = groups.layout
    group = next((g for g, grp in enumerate(layout.groups) if layer in grp.layers), None)
    if group is None:
        raise PageShapeError(f"layer {layer} has no paged MLA group in {layout.model!r}")
    if any(not 0 <= p < len(token_keys) for p in positions):
        raise PageShapeError(f"positions must index the {len(token_keys)} token keys")
    pool = groups.pools[group]
    index_in_block = layout.groups[group].layers.index(layer)
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
