"""Calls into FlashMLA and FlashInfer, each turned into the reference's ``(out, lse)`` contract.

Only :mod:`tessera_ray.kernels.adapter` calls these, after it has checked the inputs; nothing
here validates user input again. Both libraries are optional: they are imported lazily, and
only on a CUDA machine. Differences from the reference that are converted here:

- FlashMLA reports ``lse = +inf`` for a query that sees no key (its tests' reference does the
  same); we use ``-inf`` (the exact log of an empty sum), so merges need no special case.
- FlashInfer's MLA wrapper returns ``lse`` in base 2 unless asked for base e (newer releases
  take ``return_lse_base_on_e``); we convert to natural log.
"""

from __future__ import annotations

import importlib
import inspect
import math
import threading
from typing import Any

import torch

__all__ = ["flashmla_importable", "flashinfer_importable", "run_flashmla", "run_flashinfer"]

_WORKSPACE_BYTES = 128 << 20  # FlashInfer's documented starting size for the MLA wrapper
# One FlashInfer wrapper per device, reused: building one allocates its device workspace use
# and a pinned host buffer. Its plan/run pair is stateful, hence one lock per wrapper.
_wrappers: dict[torch.device, tuple[Any, threading.Lock]] = {}
_wrappers_lock = threading.Lock()


def _import(name: str) -> Any | None:
    try:
        return importlib.import_module(name)
    except Exception:  # an extension built for another torch/CUDA raises more than ImportError
        return None


def flashmla_importable() -> bool:
    module = _import("flash_mla")
    return module is not None and hasattr(module, "flash_mla_with_kvcache")


def flashinfer_importable() -> bool:
    module = _import("flashinfer.mla")
    return module is not None and hasattr(module, "BatchMLAPagedAttentionWrapper")


def _empty_rows_to_convention(
    out: torch.Tensor, lse: torch.Tensor, cache_seqlens: torch.Tensor, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows that see no key: ``out = 0``, ``lse = -inf`` whatever the kernel wrote there. Under
    ``causal``, row ``i`` of ``s_q`` sees keys up to ``seqlen - s_q + i``: with fewer keys than
    queries the first rows see none, which not every kernel masks."""
    batch, _, s_q = lse.shape
    no_key = torch.isposinf(lse) | torch.isneginf(lse) | torch.isnan(lse)
    if causal:
        rows = torch.arange(s_q, device=lse.device)
        last = cache_seqlens.view(-1, 1).to(rows.dtype) - s_q + rows  # [batch, s_q]
        no_key = no_key | (last < 0).view(batch, 1, s_q)
    no_key = no_key | (cache_seqlens == 0).view(-1, 1, 1)
    lse = lse.masked_fill(no_key, float("-inf"))
    out = out.masked_fill(no_key.transpose(1, 2).unsqueeze(-1), 0.0)
    return out, lse


def run_flashmla(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    head_dim_v: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA dense decode. Works with both interfaces: the older one whose
    ``get_mla_metadata(cache_seqlens, s_q * h_q // h_k, h_k)`` returns real scheduler tensors,
    and the newer one whose ``get_mla_metadata(*args)`` returns a lazily filled object."""
    flash_mla = importlib.import_module("flash_mla")
    _, s_q, h_q, _ = q.shape
    meta, splits = flash_mla.get_mla_metadata(cache_seqlens, s_q * h_q, 1)
    out, lse = flash_mla.flash_mla_with_kvcache(
        q.contiguous(),
        k_cache,
        block_table,
        cache_seqlens,
        head_dim_v,
        meta,
        splits,
        softmax_scale=softmax_scale,
        causal=causal,
    )
    return _empty_rows_to_convention(out, lse.float(), cache_seqlens, causal)


def _flashinfer_wrapper(mla: Any, device: torch.device) -> tuple[Any, threading.Lock]:
    with _wrappers_lock:
        entry = _wrappers.get(device)
        if entry is None:
            workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            entry = (mla.BatchMLAPagedAttentionWrapper(workspace), threading.Lock())
            _wrappers[device] = entry
        return entry


def run_flashinfer(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    head_dim_v: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer's batched MLA paged attention, planned per call from the block table (CSR:
    each sequence's used pages in order). Uses the long-standing flat ``plan`` form."""
    mla = importlib.import_module("flashinfer.mla")
    device = q.device
    batch, s_q, h_q, head_dim = q.shape
    page = k_cache.shape[1]
    rope_dim = head_dim - head_dim_v
    lens = cache_seqlens.to(torch.int32)
    pages_per_seq = (lens + page - 1) // page
    kv_indptr = torch.zeros(batch + 1, dtype=torch.int32, device=device)
    kv_indptr[1:] = torch.cumsum(pages_per_seq, 0)
    cols = torch.arange(block_table.shape[1], device=device)
    kv_indices = block_table[cols.unsqueeze(0) < pages_per_seq.unsqueeze(1)].to(torch.int32)
    qo_indptr = torch.arange(0, (batch + 1) * s_q, s_q, dtype=torch.int32, device=device)
    wrapper, lock = _flashinfer_wrapper(mla, device)
    flat_q = q.reshape(batch * s_q, h_q, head_dim)
    run_kwargs: dict[str, Any] = {"return_lse": True}
    natural = "return_lse_base_on_e" in inspect.signature(wrapper.run).parameters
    if natural:
        run_kwargs["return_lse_base_on_e"] = True
    with lock:
        wrapper.plan(
            qo_indptr,
            kv_indptr,
            kv_indices,
            lens,
            h_q,
            head_dim_v,
            rope_dim,
            page,
            causal,
            softmax_scale,
            q.dtype,
            k_cache.dtype,
        )
        out, lse = wrapper.run(
            flat_q[..., :head_dim_v],
            flat_q[..., head_dim_v:],
            k_cache[:, :, 0, :head_dim_v],
            k_cache[:, :, 0, head_dim_v:],
            **run_kwargs,
        )
    lse = lse.float() if natural else lse.float() * math.log(2.0)
    out = out.reshape(batch, s_q, h_q, head_dim_v)
    lse = lse.reshape(batch, s_q, h_q).transpose(1, 2).contiguous()
    return _empty_rows_to_convention(out, lse, cache_seqlens, causal)
