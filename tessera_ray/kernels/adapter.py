"""The one entry point for MLA decode: checks inputs, picks a kernel, says which one ran.

Order of preference with ``backend="auto"``:

1. ``flashmla``: FlashMLA importable, a GPU of compute capability 9.x (Hopper: FlashMLA's dense
   decode is built for SM90 only, so Blackwell takes FlashInfer), bf16 ``q`` and pages, pages
   of 64 tokens, key width 576 with value width 512, and every used block-table entry held (no
   negative ids).
2. ``flashinfer``: FlashInfer's MLA paged wrapper importable, a GPU of capability 8.0 or newer,
   bf16 / fp16 ``q`` and pages of one dtype, rope width 64, value width 512, all pages held.
3. ``reference``: everything else (CPU, fp32, partial page sets, small test geometries).

Asking for a backend by name skips the preference but not the checks: a named backend that
cannot run these inputs raises :class:`~tessera_ray.errors.KernelBackendUnavailableError` with
the reason, instead of silently running something else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from tessera_ray.errors import KernelBackendUnavailableError, KernelError
from tessera_ray.kernels import _gpu_backends
from tessera_ray.kernels._checks import DecodeShape, check_decode_inputs
from tessera_ray.kernels.reference import DEFAULT_HEAD_DIM_V, mla_decode_reference

__all__ = [
    "BACKENDS",
    "Backend",
    "DecodeResult",
    "mla_decode",
    "select_backend",
    "available_backends",
    "capability_problem",
]

Backend = Literal["flashmla", "flashinfer", "reference"]
BACKENDS: tuple[Backend, ...] = ("flashmla", "flashinfer", "reference")

_FLASHMLA_PAGE_TOKENS = 64  # FlashMLA's only page size
_FLASHMLA_HEAD_DIM = 576
_FLASHINFER_ROPE_DIM = 64

Capability = tuple[int, int]

_GPU_NEEDS: dict[Backend, tuple[Callable[[Capability], bool], str]] = {
    # FlashMLA's dense decode kernels are compiled for SM90a only; on any other GPU its
    # import succeeds and the call fails, so the capability alone must rule it out.
    "flashmla": (lambda cap: cap[0] == 9, "FlashMLA's dense decode runs on SM90 (Hopper) only"),
    "flashinfer": (lambda cap: cap >= (8, 0), "FlashInfer's MLA kernels need SM80 or newer"),
}
"""Per GPU backend: whether a device of a compute capability can run it, and why not."""


def _device_capability(device: torch.device | None = None) -> Capability | None:
    """The CUDA compute capability of ``device`` (default: the current one); ``None`` without
    CUDA."""
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return major, minor


def capability_problem(backend: Backend, capability: Capability | None) -> str | None:
    """Why ``backend`` cannot run on a device of ``capability`` (``None``: no CUDA device), or
    ``None`` when it can."""
    if backend == "reference":
        return None
    if capability is None:
        return "no CUDA device"
    can_run, why = _GPU_NEEDS[backend]
    return None if can_run(capability) else f"{why}; this GPU is SM{capability[0]}{capability[1]}"


@dataclass(frozen=True, kw_only=True)
class DecodeResult:
    """One decode's result: ``out [batch, s_q, h_q, head_dim_v]``, ``lse [batch, h_q, s_q]``
    float32 natural log (``-inf`` where a query saw no key), and the backend that ran."""

    out: torch.Tensor
    lse: torch.Tensor
    backend: Backend


def _all_pages_held(block_table: torch.Tensor, cache_seqlens: torch.Tensor, page: int) -> bool:
    used = torch.arange(block_table.shape[1], device=block_table.device).unsqueeze(0) < (
        (cache_seqlens.long() + page - 1) // page
    ).unsqueeze(1)
    return not bool((used & (block_table < 0)).any())


def _why_not_flashmla(
    q: torch.Tensor, k_cache: torch.Tensor, shape: DecodeShape, all_held: bool
) -> str | None:
    if not q.is_cuda:
        return "inputs are not on a CUDA device"
    problem = capability_problem("flashmla", _device_capability(q.device))
    if problem is not None:
        return problem
    if q.dtype != torch.bfloat16 or k_cache.dtype != torch.bfloat16:
        return f"FlashMLA here runs bf16 q and pages, got {q.dtype} and {k_cache.dtype}"
    if shape.page_tokens != _FLASHMLA_PAGE_TOKENS:
        return f"FlashMLA pages hold {_FLASHMLA_PAGE_TOKENS} tokens, got {shape.page_tokens}"
    if shape.head_dim != _FLASHMLA_HEAD_DIM or shape.head_dim_v != DEFAULT_HEAD_DIM_V:
        return (
            f"FlashMLA needs head_dim 576 / head_dim_v 512, got {shape.head_dim}/{shape.head_dim_v}"
        )
    if not all_held:
        return "the block table has pages not held here (negative ids)"
    if not _gpu_backends.flashmla_importable():
        return "flash_mla is not importable"
    return None


def _why_not_flashinfer(
    q: torch.Tensor, k_cache: torch.Tensor, shape: DecodeShape, all_held: bool
) -> str | None:
    if not q.is_cuda:
        return "inputs are not on a CUDA device"
    problem = capability_problem("flashinfer", _device_capability(q.device))
    if problem is not None:
        return problem
    if q.dtype not in (torch.bfloat16, torch.float16) or k_cache.dtype != q.dtype:
        return (
            f"FlashInfer MLA runs bf16/fp16 q and pages of one dtype, got {q.dtype}/{k_cache.dtype}"
        )
    if shape.head_dim_v != DEFAULT_HEAD_DIM_V or shape.head_dim - shape.head_dim_v != 64:
        return "FlashInfer MLA needs kv_lora_rank 512 and rope dim 64"
    if not all_held:
        return "the block table has pages not held here (negative ids)"
    if not _gpu_backends.flashinfer_importable():
        return "flashinfer.mla is not importable"
    return None


def _why_not_reference(*_: object) -> str | None:
    return None


_REASONS: dict[Backend, Callable[[torch.Tensor, torch.Tensor, DecodeShape, bool], str | None]] = {
    "flashmla": _why_not_flashmla,
    "flashinfer": _why_not_flashinfer,
    "reference": _why_not_reference,
}


def _run_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    head_dim_v: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    return mla_decode_reference(
        q, k_cache, block_table, cache_seqlens, softmax_scale, causal, head_dim_v=head_dim_v
    )


_RUNNERS: dict[Backend, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
    "flashmla": _gpu_backends.run_flashmla,
    "flashinfer": _gpu_backends.run_flashinfer,
    "reference": _run_reference,
}


def select_backend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    head_dim_v: int = DEFAULT_HEAD_DIM_V,
) -> tuple[Backend, dict[Backend, str | None]]:
    """The backend ``auto`` would run, and for each backend why it could not (``None``: could)."""
    shape = check_decode_inputs(q, k_cache, block_table, cache_seqlens, head_dim_v=head_dim_v)
    all_held = _all_pages_held(block_table, cache_seqlens, shape.page_tokens)
    reasons = {name: _REASONS[name](q, k_cache, shape, all_held) for name in BACKENDS}
    chosen = next(name for name in BACKENDS if reasons[name] is None)
    return chosen, reasons


def available_backends() -> dict[Backend, bool]:
    """Which backends could run at all in this process (importable, and a GPU they run on)."""
    cap = _device_capability()
    return {
        "flashmla": capability_problem("flashmla", cap) is None
        and _gpu_backends.flashmla_importable(),
        "flashinfer": capability_problem("flashinfer", cap) is None
        and _gpu_backends.flashinfer_importable(),
        "reference": True,
    }


def mla_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    *,
    head_dim_v: int = DEFAULT_HEAD_DIM_V,
    backend: Backend | Literal["auto"] = "auto",
) -> DecodeResult:
    """Paged MLA decode on the best available kernel.

    Args:
        q: ``[batch, s_q, h_q, head_dim]`` absorbed queries; ``head_dim`` = kv_lora_rank +
            rope_dim (576). Last dimension contiguous.
        k_cache: ``[num_pages, page_tokens, 1, head_dim]`` pages (FlashMLA layout, 64 tokens a
            page for FlashMLA); last dimension contiguous, other strides free.
        block_table: ``[batch, max_blocks]`` int32 page ids (negative: not held here; only the
            reference supports that).
        cache_seqlens: ``[batch]`` int32 tokens per sequence.
        softmax_scale: ``1/sqrt(qk_nope_head_dim + qk_rope_head_dim)`` for DeepSeek (1/sqrt(192)).
        causal: FlashMLA's causal rule for ``s_q > 1`` (see the reference).
        head_dim_v: leading key values that are the value (512).
        backend: ``"auto"`` or a name from :data:`BACKENDS`.

    Returns:
        :class:`DecodeResult` with ``out`` in ``q``'s dtype and float32 ``lse``.
    """
    if backend != "auto" and backend not in BACKENDS:
        raise KernelError(f"unknown backend {backend!r}; valid: auto, {', '.join(BACKENDS)}")
    chosen, reasons = select_backend(q, k_cache, block_table, cache_seqlens, head_dim_v=head_dim_v)
    if backend != "auto":
        reason = reasons[backend]
        if reason is not None:
            raise KernelBackendUnavailableError(f"backend {backend!r} cannot run this: {reason}")
        chosen = backend
    out, lse = _RUNNERS[chosen](
        q, k_cache, block_table, cache_seqlens, softmax_scale, causal, head_dim_v
    )
    return DecodeResult(out=out, lse=lse, backend=chosen)
