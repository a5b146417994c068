"""A layer of vLLM's cache seen as the tier sees it: one row per token, whatever order the
engine's attention kernels keep the values in (torch only, no vLLM import).

A layer is one or more *planes*: views of the layer's tensor, each ``[blocks, T1, T2, ...]``
where token ``r`` of a block is ``(r // T2, r % T2)`` and the trailing axes, flattened in
order, are that token's values in the tier row. A token's tier row is its values in every
plane, plane after plane. Planes are views (no copy), so a gather reads the engine's cache
and a scatter writes into it, through any strides.

- MLA: one plane, the token's latent and RoPE key (``[blocks, tokens, 1, 576]``).
- Full attention with K and V of a token side by side per head (vLLM's GPU backends: logical
  ``[blocks, heads, tokens, 2 x head_dim]``): a K plane and a V plane, ``[blocks, tokens, 1,
  heads, head_dim]``.
- vLLM's CPU attention kernels pack each head's K and V of a block apart, in an order of their
  instruction set (docs/full-attention-caches.md); one builder per packing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tessera_ray.errors import LayoutError

__all__ = ["LayerPlanes", "PLANE_BUILDERS", "consecutive_runs", "mla_planes"]


@dataclass(frozen=True, slots=True)
class LayerPlanes:
    """One layer's planes (see the module docstring)."""

    planes: tuple[torch.Tensor, ...]
    block_tokens: int

    def __post_init__(self) -> None:
        for p in self.planes:
            if p.dim() < 3 or p.shape[1] * p.shape[2] != self.block_tokens:
                raise LayoutError(
                    f"a cache plane {tuple(p.shape)} does not hold {self.block_tokens} tokens "
                    "per block"
                )

    @property
    def dtype(self) -> torch.dtype:
        return self.planes[0].dtype

    @property
    def device(self) -> torch.device:
        return self.planes[0].device

    @property
    def row_values(self) -> int:
        """Values per token in the tier row."""
        return sum(_numel(p.shape[3:]) for p in self.planes)

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """``[len(rows), row_values]``: the tier rows of cache rows ``rows`` (``block x
        block_tokens + token``), a copy."""
        rows = rows.to(self.device)
        blocks, token = rows // self.block_tokens, rows % self.block_tokens
        parts = []
        for p in self.planes:
            flat = _token_rows(p)
            if flat is not None:
                parts.append(flat.index_select(0, rows))
            else:
                parts.append(
                    p[blocks, token // p.shape[2], token % p.shape[2]].reshape(len(rows), -1)
                )
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def scatter(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``values`` (``[len(rows), row_values]``, this layer's dtype) into cache rows
        ``rows``."""
        rows = rows.to(self.device)
        values = values.to(self.device)
        blocks, token = rows // self.block_tokens, rows % self.block_tokens
        at = 0
        for p in self.planes:
            width = _numel(p.shape[3:])
            flat = _token_rows(p)
            if flat is not None:
                flat.index_copy_(0, rows, values[:, at : at + width])
            else:
                part = values[:, at : at + width].reshape(len(rows), *p.shape[3:])
                p[blocks, token // p.shape[2], token % p.shape[2]] = part
            at += width

    def write_tokens(self, blocks: torch.Tensor, values: torch.Tensor, first: int = 0) -> None:
        """Write ``values`` (``[len(blocks), L, row_values]``, this layer's dtype, any strides)
        into tokens ``[first, first + L)`` of each cache block of ``blocks``: per plane, one
        slice copy per run of consecutive block ids, read straight from ``values`` (a view of
        staged pages needs no copy first)."""
        n, length = values.shape[0], values.shape[1]
        if any(first % p.shape[2] or length % p.shape[2] for p in self.planes):
            # The tokens are not whole rows of a plane's second token axis: row by row.
            offsets = torch.arange(first, first + length)
            rows = (blocks.reshape(-1, 1) * self.block_tokens + offsets).reshape(-1)
            self.scatter(rows, values.reshape(n * length, -1))
            return
        runs = consecutive_runs(blocks.tolist())
        at = 0
        for p in self.planes:
            width, t2 = _numel(p.shape[3:]), p.shape[2]
            part = values[..., at : at + width].reshape(n, length // t2, t2, *p.shape[3:])
            dest = p[:, first // t2 : (first + length) // t2]
            for i, j, block in runs:
                # A slice copy between strided views runs at memory speed; an indexed copy
                # (index_copy_) moves element by element, several times slower.
                dest[block : block + j - i].copy_(part[i:j])
            at += width

    def write_groups(self, first_block: int, values: torch.Tensor, first: int = 0) -> None:
        """Write ``values`` (``[q, k, L, row_values]``, any strides) into tokens ``[first,
        first + L)`` of the ``q x k`` consecutive cache blocks from ``first_block``, block
        ``first_block + i x k + j`` from ``values[i, j]``: one slice copy per plane where
        :meth:`write_tokens` would need one per ``k``-th block (the ``k`` engine blocks of
        each of ``q`` staged tier blocks, which lie at the staging's stride, not side by
        side)."""
        q, k, length = values.shape[0], values.shape[1], values.shape[2]
        if any(first % p.shape[2] or length % p.shape[2] for p in self.planes):
            ids = torch.arange(first_block, first_block + q * k)
            self.write_tokens(ids, values.reshape(q * k, length, -1), first)
            return
        at = 0
        for p in self.planes:
            width, t2 = _numel(p.shape[3:]), p.shape[2]
            part = values[..., at : at + width].reshape(q, k, length // t2, t2, *p.shape[3:])
            dest = p[first_block : first_block + q * k, first // t2 : (first + length) // t2]
            dest.view(q, k, *dest.shape[1:]).copy_(part)
            at += width


def consecutive_runs(blocks: list[int]) -> list[tuple[int, int, int]]:
    """``blocks`` as runs of consecutive ids: ``(i, j, blocks[i])`` for each maximal run
    ``blocks[i:j]`` (vLLM hands a new request's blocks out mostly in order)."""
    runs, i = [], 0
    while i < len(blocks):
        j = i + 1
        while j < len(blocks) and blocks[j] == blocks[j - 1] + 1:
            j += 1
        runs.append((i, j, blocks[i]))
        i = j
    return runs


def _token_rows(plane: torch.Tensor) -> torch.Tensor | None:
    """``plane`` as ``[blocks x tokens, values]`` where its tokens are contiguous rows (MLA),
    for the indexed copies torch does fastest; ``None`` otherwise."""
    if plane.shape[2] != 1 or not plane.is_contiguous():
        return None
    return plane.view(plane.shape[0] * plane.shape[1], -1)


def _numel(shape: torch.Size | tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def mla_planes(kv: torch.Tensor, block_tokens: int) -> LayerPlanes:
    """An MLA layer: ``[blocks, (1,) tokens, row]`` contiguous (vLLM's CPU build adds the 1)."""
    inner = [d for d in kv.shape[1:-1] if d != 1]
    if not kv.is_contiguous() or inner != [block_tokens]:
        raise LayoutError(
            f"MLA cache {tuple(kv.shape)} is not a contiguous cache of {block_tokens}-token "
            "blocks of token rows"
        )
    return LayerPlanes((kv.view(kv.shape[0], block_tokens, 1, kv.shape[-1]),), block_tokens)


def _kv_side_by_side(kv: torch.Tensor, head_dim: int) -> LayerPlanes:
    # Logical [blocks, heads, tokens, 2 x head_dim]: K then V of each (token, head).
    k = kv[..., :head_dim].permute(0, 2, 1, 3).unsqueeze(2)
    v = kv[..., head_dim:].permute(0, 2, 1, 3).unsqueeze(2)
    return LayerPlanes((k, v), kv.shape[2])


def _cpu_vec(kv: torch.Tensor, head_dim: int) -> LayerPlanes:
    # Per (block, head): K of all N tokens column-major [D, N], then V row-major [N, D].
    b, h, n, _ = kv.shape
    x = kv.view(b, h, 2, n * head_dim)
    k = x[:, :, 0].view(b, h, head_dim, n).permute(0, 3, 1, 2).unsqueeze(2)
    v = x[:, :, 1].view(b, h, n, head_dim).permute(0, 2, 1, 3).unsqueeze(2)
    return LayerPlanes((k, v), n)


def _cpu_amx(kv: torch.Tensor, head_dim: int) -> LayerPlanes:
    # AMX tiles: K[r, d] at [r // 16, d // 2, r % 16, d % 2], V[r, d] at
    # [d // 16, r // 2, d % 16, r % 2], per (block, head).
    b, h, n, _ = kv.shape
    if n % 16 or head_dim % 16:
        raise LayoutError(f"AMX-packed cache of {n}-token blocks, head_dim {head_dim}")
    x = kv.view(b, h, 2, n * head_dim)
    k = x[:, :, 0].view(b, h, n // 16, head_dim // 2, 16, 2).permute(0, 2, 4, 1, 3, 5)
    v = x[:, :, 1].view(b, h, head_dim // 16, n // 2, 16, 2).permute(0, 3, 5, 1, 2, 4)
    return LayerPlanes((k, v), n)


PLANE_BUILDERS: dict[str, Callable[[torch.Tensor, int], LayerPlanes]] = {
    "kv-side-by-side": _kv_side_by_side,
    "cpu-vec": _cpu_vec,
    "cpu-vec16": _cpu_vec,
    "cpu-amx": _cpu_amx,
}
"""Full-attention packings, by name: a layer tensor of logical shape ``[blocks, heads,
tokens, 2 x head_dim]`` and its head_dim -> its planes."""
