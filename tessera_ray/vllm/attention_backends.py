"""Which planes (:mod:`~tessera_ray.vllm.planes`) a vLLM attention backend's cache is read
through (imports vLLM): MLA caches are token rows on every backend; full-attention caches keep
K and V by backend, and on vLLM's CPU build by the instruction set its kernels were built for
(docs/full-attention-caches.md).

A packing the connector was not written for is refused at start, never guessed: on the CPU
build every packing is also checked once against vLLM's own cache-write op, so a change of
layout in vLLM stops the engine instead of storing scrambled rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from tessera_ray.errors import LayoutError
from tessera_ray.vllm.planes import PLANE_BUILDERS, LayerPlanes, mla_planes

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["planes_for", "GPU_PACKINGS"]

GPU_PACKINGS: dict[str, str] = {
    "FLASH_ATTN": "kv-side-by-side",
    "FLASHINFER": "kv-side-by-side",
    "TRITON_ATTN": "kv-side-by-side",
}
"""vLLM GPU backends whose logical ``[blocks, heads, tokens, 2 x head_dim]`` cache keeps a
token's K and then V per head; the layer view vLLM hands the connector indexes logically
whatever physical order (``KVCacheLayout``) was resolved."""

_CHECKED: set[tuple[str, int, int, int, torch.dtype]] = set()


def _packing(layer_name: str, layer: Any) -> str:
    backend = layer.attn_backend.get_name()
    if backend == "CPU_ATTN":
        packing = f"cpu-{layer.isa}"
        if packing in PLANE_BUILDERS:
            return packing
        raise LayoutError(
            f"layer {layer_name}: vLLM's CPU attention packs its cache for instruction set "
            f"{layer.isa!r}, which TesseraConnector does not read (it reads "
            f"{', '.join(p.removeprefix('cpu-') for p in PLANE_BUILDERS if p.startswith('cpu-'))})"
        )
    if backend in GPU_PACKINGS:
        return GPU_PACKINGS[backend]
    raise LayoutError(
        f"layer {layer_name}: attention backend {backend} is not one TesseraConnector reads "
        f"full-attention caches of ({', '.join([*GPU_PACKINGS, 'CPU_ATTN'])})"
    )


def _check_cpu_packing(isa: str, kv: torch.Tensor, head_dim: int, planes_of: Any) -> None:
    """vLLM's own CPU cache-write op packs random K and V into a scratch block; the planes
    must read back exactly what it was given."""
    _, heads, tokens, _ = kv.shape
    key = (isa, heads, tokens, head_dim, kv.dtype)
    if key in _CHECKED:
        return
    from vllm._custom_ops import cpu_attn_reshape_and_cache

    gen = torch.Generator().manual_seed(28)
    k = torch.randn(tokens, heads, head_dim, generator=gen).to(kv.dtype)
    v = torch.randn(tokens, heads, head_dim, generator=gen).to(kv.dtype)
    scratch = torch.zeros((1, heads, tokens, 2 * head_dim), dtype=kv.dtype)
    k_cache, v_cache = scratch.view(1, heads, 2 * tokens, head_dim).chunk(2, dim=2)
    slots = torch.arange(tokens, dtype=torch.long)
    cpu_attn_reshape_and_cache(k, v, k_cache, v_cache, slots, isa)
    got = planes_of(scratch, head_dim).gather(slots)
    want = torch.cat([k.reshape(tokens, -1), v.reshape(tokens, -1)], dim=1)
    if not torch.equal(got, want):
        raise LayoutError(
            f"vLLM's CPU attention ({isa}) packs its cache otherwise than TesseraConnector reads "
            "it; refusing to store scrambled rows"
        )
    _CHECKED.add(key)


def planes_for(
    vllm_config: VllmConfig, engine_tokens: int
) -> Callable[[str, torch.Tensor], LayerPlanes]:
    """How the worker reads each registered layer of this engine as tier rows."""
    model = vllm_config.model_config
    if model.use_mla:
        return lambda name, kv: mla_planes(kv, engine_tokens)
    head_dim = model.get_head_size()

    def of(name: str, kv: torch.Tensor) -> LayerPlanes:
        # Read when the worker registers: vLLM fills the context as it builds the model.
        layer = vllm_config.compilation_config.static_forward_context.get(name)
        if layer is None or kv.dim() != 4:
            raise LayoutError(
                f"layer {name}: not an attention layer vLLM registered, or its cache "
                f"{tuple(kv.shape)} is not [blocks, heads, tokens, K and V]"
            )
        packing = _packing(name, layer)
        build = PLANE_BUILDERS[packing]
        if packing.startswith("cpu-"):
            _check_cpu_packing(layer.isa, kv, head_dim, build)
        return build(kv, head_dim)

    return of
