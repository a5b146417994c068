"""The ``fp8_ds_mla`` page format (DeepSeek-V3.2 / vLLM / FlashMLA): 656 bytes per token.

One token's entry, in byte order (sizes come from :func:`tessera_ray.layout.formats.mla_entry`,
not from constants here): ``kv_lora_rank`` fp8_e4m3 latent values, then one float32 scale per
``FP8_SCALE_TILE`` (128) latent values, then ``rope_dim`` bf16 RoPE values, unquantized. For
DeepSeek: 512 + 4 x 4 + 64 x 2 = 656 B. Pages are uint8 tensors
``[num_pages, page_tokens, entry_bytes]``.

Scale convention (FlashMLA's interface docstring and its test quantizer; vLLM writes the same
layout): the stored float32 is the *dequantization* factor ``scale = amax(tile) / 448`` (448 is
the largest finite e4m3fn value), and ``value = fp8 * scale``. FlashMLA's test quantizer also
rounds the scale up to a power of two (``pow2_scales=True`` here); dequantization is the same
multiply either way, so pages from either producer decode alike.

Round-trip bound, per latent value ``x`` in a tile with scale ``s`` (e4m3 has 3 mantissa bits,
round to nearest): a normal fp8 value is off by at most half a unit in the last place, i.e.
``2^-4`` relative; values that land below e4m3's smallest normal (``2^-6``) after scaling are
subnormal, spaced ``2^-9``, so off by at most ``2^-10`` in scaled units. Together::

    |dequant(quant(x)) - x| <= 2^-4 |x| + 2^-10 s

(:func:`fp8_ds_mla_error_bound`; the sum, not the max, also covers float32 rounding in the
divide and multiply). RoPE values are stored as bf16: exact for bf16 input, within ``2^-9``
relative for float32 input.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tessera_ray.errors import KernelError
from tessera_ray.kernels._checks import check_table_fits
from tessera_ray.kernels.reference import mla_decode_reference
from tessera_ray.layout.formats import FP8_SCALE_TILE, mla_entry

__all__ = [
    "Fp8DsMlaLayout",
    "fp8_ds_mla_layout",
    "quantize_fp8_ds_mla",
    "dequantize_fp8_ds_mla",
    "fp8_ds_mla_error_bound",
    "mla_decode_fp8_reference",
    "FP8_E4M3_MAX",
]

FP8_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448.0
_MANTISSA_HALF_ULP = 2.0**-4  # e4m3: 3 mantissa bits; half an ulp relative to the value
_SUBNORMAL_HALF_STEP = 2.0**-10  # e4m3 subnormals are spaced 2^-9 (in scaled units)


@dataclass(frozen=True, kw_only=True)
class Fp8DsMlaLayout:
    """Byte offsets of one fp8_ds_mla entry, read from the layout package's region list."""

    kv_lora_rank: int
    rope_dim: int
    tile: int
    c_kv_offset: int
    scale_offset: int
    rope_offset: int
    entry_bytes: int

    @property
    def num_tiles(self) -> int:
        return self.kv_lora_rank // self.tile

    @property
    def head_dim(self) -> int:
        """Values per token once dequantized: the FlashMLA key width (576 for DeepSeek)."""
        return self.kv_lora_rank + self.rope_dim


def fp8_ds_mla_layout(kv_lora_rank: int = 512, rope_dim: int = 64) -> Fp8DsMlaLayout:
    """The entry layout for a model's geometry (DeepSeek-V3.2 by default: 656 B)."""
    entry = mla_entry("fp8_ds_mla", kv_lora_rank=kv_lora_rank, rope_dim=rope_dim)
    offsets = entry.region_offsets
    return Fp8DsMlaLayout(
        kv_lora_rank=kv_lora_rank,
        rope_dim=rope_dim,
        tile=FP8_SCALE_TILE,
        c_kv_offset=offsets["c_kv"][0],
        scale_offset=offsets["scale"][0],
        rope_offset=offsets["k_rope"][0],
        entry_bytes=entry.entry_bytes,
    )


def _as_tokens(k_cache: torch.Tensor, layout: Fp8DsMlaLayout) -> torch.Tensor:
    """Float pages ``[P, T, 1, head_dim]`` or ``[P, T, head_dim]`` -> ``[P, T, head_dim]``."""
    if k_cache.dim() == 4 and k_cache.shape[2] == 1:
        k_cache = k_cache.squeeze(2)
    if k_cache.dim() != 3 or k_cache.shape[-1] != layout.head_dim:
        raise KernelError(
            f"pages must be [num_pages, page_tokens, 1, {layout.head_dim}] (or without the 1), "
            f"got {tuple(k_cache.shape)}"
        )
    if not k_cache.is_floating_point():
        raise KernelError(f"pages to quantize must be a float dtype, got {k_cache.dtype}")
    return k_cache


def _tiled(values: torch.Tensor, layout: Fp8DsMlaLayout) -> torch.Tensor:
    """``[..., kv_lora_rank]`` -> ``[..., num_tiles, tile]``: one row per scale."""
    return values.reshape(*values.shape[:-1], layout.num_tiles, layout.tile)


def _scales(c_kv: torch.Tensor, layout: Fp8DsMlaLayout, pow2: bool) -> torch.Tensor:
    tiles = _tiled(c_kv.float(), layout)
    amax = tiles.abs().amax(dim=-1)
    # An all-zero tile gets scale 1 (any positive scale stores zeros exactly); 0 would give NaN.
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    if pow2:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    return scale


def quantize_fp8_ds_mla(
    k_cache: torch.Tensor,
    *,
    layout: Fp8DsMlaLayout | None = None,
    pow2_scales: bool = False,
) -> torch.Tensor:
    """Quantize FlashMLA-layout pages to fp8_ds_mla bytes.

    Args:
        k_cache: ``[num_pages, page_tokens, 1, head_dim]`` (or ``[.., head_dim]``) float pages,
            each token ``[c_kv | k_rope]``.
        layout: entry layout; default DeepSeek's (512 + 64 -> 656 B).
        pow2_scales: round each scale up to a power of two (FlashMLA's test quantizer).

    Returns:
        uint8 ``[num_pages, page_tokens, entry_bytes]`` on ``k_cache``'s device.
    """
    layout = layout or fp8_ds_mla_layout()
    tokens = _as_tokens(k_cache, layout)
    num_pages, page_tokens, _ = tokens.shape
    r = layout.kv_lora_rank
    c_kv = tokens[..., :r]
    scale = _scales(c_kv, layout, pow2_scales)  # [P, T, tiles]
    scaled = _tiled(c_kv.float(), layout) / scale.unsqueeze(-1)
    # Clamp: float32 rounding can put amax/scale a hair above 448, and torch's e4m3fn cast is
    # not saturating (it would give NaN above 464).
    fp8 = scaled.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).flatten(-2)
    out = torch.zeros(num_pages, page_tokens, layout.entry_bytes, dtype=torch.uint8)
    out = out.to(k_cache.device)
    out[..., layout.c_kv_offset : layout.c_kv_offset + r] = fp8.view(torch.uint8)
    scale_bytes = layout.num_tiles * 4
    out[..., layout.scale_offset : layout.scale_offset + scale_bytes] = (
        scale.float().contiguous().view(torch.uint8)
    )
    rope = tokens[..., r:].to(torch.bfloat16).contiguous()
    out[..., layout.rope_offset : layout.rope_offset + 2 * layout.rope_dim] = rope.view(torch.uint8)
    return out


def _check_pages(pages: torch.Tensor, layout: Fp8DsMlaLayout) -> None:
    if pages.dtype != torch.uint8 or pages.dim() != 3 or pages.shape[-1] != layout.entry_bytes:
        raise KernelError(
            f"fp8_ds_mla pages must be uint8 [num_pages, page_tokens, {layout.entry_bytes}], "
            f"got {pages.dtype} {tuple(pages.shape)}"
        )


def _scale_view(pages: torch.Tensor, layout: Fp8DsMlaLayout) -> torch.Tensor:
    region = pages[..., layout.scale_offset : layout.scale_offset + 4 * layout.num_tiles]
    return region.contiguous().view(torch.float32)


def dequantize_fp8_ds_mla(
    pages: torch.Tensor,
    *,
    layout: Fp8DsMlaLayout | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """fp8_ds_mla bytes ``[num_pages, page_tokens, entry_bytes]`` -> FlashMLA-layout pages
    ``[num_pages, page_tokens, 1, head_dim]`` of ``dtype`` (computed in float32)."""
    layout = layout or fp8_ds_mla_layout()
    _check_pages(pages, layout)
    r = layout.kv_lora_rank
    fp8 = pages[..., layout.c_kv_offset : layout.c_kv_offset + r].contiguous()
    values = _tiled(fp8.view(torch.float8_e4m3fn).float(), layout)
    c_kv = (values * _scale_view(pages, layout).unsqueeze(-1)).flatten(-2)
    rope_bytes = pages[..., layout.rope_offset : layout.rope_offset + 2 * layout.rope_dim]
    rope = rope_bytes.contiguous().view(torch.bfloat16).float()
    return torch.cat((c_kv, rope), dim=-1).unsqueeze(2).to(dtype)


def fp8_ds_mla_error_bound(
    k_cache: torch.Tensor,
    *,
    layout: Fp8DsMlaLayout | None = None,
    pow2_scales: bool = False,
) -> torch.Tensor:
    """Per-value bound on ``|dequantize(quantize(k_cache)) - k_cache|``, shaped like the
    token-major input ``[num_pages, page_tokens, head_dim]`` (module docstring derives it)."""
    layout = layout or fp8_ds_mla_layout()
    tokens = _as_tokens(k_cache, layout).float()
    r = layout.kv_lora_rank
    scale = _scales(tokens[..., :r], layout, pow2_scales).repeat_interleave(layout.tile, dim=-1)
    c_bound = _MANTISSA_HALF_ULP * tokens[..., :r].abs() + _SUBNORMAL_HALF_STEP * scale
    if k_cache.dtype == torch.bfloat16:
        rope_bound = torch.zeros_like(tokens[..., r:])
    else:
        rope_bound = 2.0**-9 * tokens[..., r:].abs()  # bf16: 8 significant bits, round to nearest
    return torch.cat((c_bound, rope_bound), dim=-1)


def mla_decode_fp8_reference(
    q: torch.Tensor,
    pages: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    *,
    layout: Fp8DsMlaLayout | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference decode over fp8_ds_mla pages: dequantize the pages the table uses, then
    :func:`~tessera_ray.kernels.reference.mla_decode_reference` (same shapes and conventions;
    ``pages`` is uint8 ``[num_pages, page_tokens, entry_bytes]``)."""
    layout = layout or fp8_ds_mla_layout()
    _check_pages(pages, layout)
    num_pages, page_tokens, _ = pages.shape
    if block_table.dim() != 2 or cache_seqlens.dim() != 1:
        raise KernelError("block_table must be [batch, max_blocks], cache_seqlens [batch]")
    check_table_fits(block_table, cache_seqlens, num_pages=num_pages, page_tokens=page_tokens)
    # Dequantize only the pages in use: a pool holds far more pages than one batch reads.
    lens = cache_seqlens.cpu().long()
    table = block_table.cpu().long()
    used_cols = torch.arange(table.shape[1]) < (-(-lens // page_tokens)).unsqueeze(1)
    in_use = used_cols & (table >= 0)
    used = torch.unique(table[in_use])
    remap = torch.full((num_pages,), -1, dtype=torch.long)
    remap[used] = torch.arange(used.numel())
    compact = torch.where(in_use, remap[table.clamp(0, num_pages - 1)], torch.full_like(table, -1))
    dense = dequantize_fp8_ds_mla(pages[used.to(pages.device)], layout=layout)
    if dense.shape[0] == 0:  # nothing in use: one dummy page keeps the shapes valid
        dense = torch.zeros(1, page_tokens, 1, layout.head_dim, device=pages.device)
    return mla_decode_reference(
        q,
        dense,
        compact.to(device=block_table.device, dtype=torch.int32),
        cache_seqlens,
        softmax_scale,
        causal,
        head_dim_v=layout.kv_lora_rank,
    )
