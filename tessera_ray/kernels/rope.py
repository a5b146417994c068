"""Rotary position embedding for MLA's decoupled key, and re-rotation of stored keys.

RoPE rotates each pair of values by ``position * inv_freq[k]``; rotations compose, so a
``k_rope`` stored for position ``p`` becomes the key for ``p + delta`` by one more rotation by
``delta`` (docs/mla-math.md). :func:`rope_shift` is that building block: it lets a page computed at
one offset serve another offset *for the RoPE half only*. It does not make c_kv position-free
(c_kv after layer 0 depends on the preceding context), so it is not a reuse mode by itself.

Two pairings are common: ``interleaved=False`` pairs value ``k`` with ``k + dim/2`` (the
"rotate half" form of Hugging Face's DeepSeek code); ``interleaved=True`` pairs ``2k`` with
``2k + 1`` (DeepSeek's reference inference code, complex multiplication). Angles are computed
in float64 and rotations in float32, whatever the stored dtype.
"""

from __future__ import annotations

import torch

from tessera_ray.errors import KernelError

__all__ = ["DEFAULT_ROPE_BASE", "rope_cos_sin", "apply_rope", "rope_shift"]

DEFAULT_ROPE_BASE = 10000.0


def rope_cos_sin(
    positions: torch.Tensor, dim: int, *, base: float = DEFAULT_ROPE_BASE
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of shape ``positions.shape + (dim // 2,)``, float32.

    Computed in float64 so that large positions (128K tokens) keep full float32 accuracy.
    """
    if dim <= 0 or dim % 2:
        raise KernelError(f"rope dim must be a positive even number, got {dim}")
    inv_freq = base ** (
        -torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device) / dim
    )
    angles = positions.to(torch.float64).unsqueeze(-1) * inv_freq
    return torch.cos(angles).float(), torch.sin(angles).float()


def _rotate(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    xf = x.float()
    if interleaved:
        a, b = xf[..., 0::2], xf[..., 1::2]
        return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    half = xf.shape[-1] // 2
    a, b = xf[..., :half], xf[..., half:]
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)


def apply_rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    *,
    base: float = DEFAULT_ROPE_BASE,
    interleaved: bool = False,
) -> torch.Tensor:
    """Rotate ``x`` (``[..., dim]``) to ``positions`` (broadcastable to ``x.shape[:-1]``).

    Returns float32 (callers cast to their storage dtype: rounding happens once, at storage).
    """
    cos, sin = rope_cos_sin(positions, x.shape[-1], base=base)
    return _rotate(x, cos, sin, interleaved)


def rope_shift(
    k_rope: torch.Tensor,
    delta: int | torch.Tensor,
    *,
    base: float = DEFAULT_ROPE_BASE,
    interleaved: bool = False,
) -> torch.Tensor:
    """Move stored RoPE keys ``k_rope`` (``[..., rope_dim]``) by ``delta`` positions.

    Exact in real arithmetic: ``rope_shift(apply_rope(k, p), d) == apply_rope(k, p + d)``; in
    float32 within about 1e-6 of recomputing (tested). ``delta`` is an int or a tensor
    broadcastable to ``k_rope.shape[:-1]`` (one shift per token, say); negative moves back.
    The result has ``k_rope``'s dtype: for bf16 pages that rounds once more, so a shifted bf16
    key is within bf16 rounding of, not bit-equal to, a recomputed one.
    """
    if isinstance(delta, bool) or not isinstance(delta, int | torch.Tensor):
        raise KernelError(f"delta must be an int or an integer tensor, got {type(delta)!r}")
    shift = (
        torch.tensor(delta, device=k_rope.device)
        if isinstance(delta, int)
        else delta.to(k_rope.device)
    )
    if shift.is_floating_point():
        raise KernelError(f"delta must hold whole positions, got dtype {shift.dtype}")
    cos, sin = rope_cos_sin(shift, k_rope.shape[-1], base=base)
    return _rotate(k_rope, cos, sin, interleaved).to(k_rope.dtype)
