"""The FlashInfer call's own logic, on CPU with a stand-in ``flashinfer.mla``: one wrapper per
device reused across calls, and causal rows that see no key reported as the reference reports
them (``out = 0``, ``lse = -inf``) whatever the kernel wrote there."""

from __future__ import annotations

import math
import sys
import types
from typing import Any

import pytest
import torch

from tessera_ray.kernels import _gpu_backends

H_Q, DV, ROPE, PAGE = 2, 8, 4, 4


class _FakeWrapper:
    """Records plans; ``run`` returns finite values everywhere (base-2 lse, as old releases)."""

    built = 0

    def __init__(self, workspace: torch.Tensor) -> None:
        type(self).built += 1
        self.plans: list[tuple[Any, ...]] = []

    def plan(self, *args: Any) -> None:
        self.plans.append(args)

    def run(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, ckv: Any, kpe: Any, *, return_lse: bool
    ) -> Any:
        rows = q_nope.shape[0]
        out = torch.ones(rows, H_Q, DV, dtype=q_nope.dtype)
        lse = torch.full((rows, H_Q), 2.0)
        return out, lse


@pytest.fixture
def fake_flashinfer(monkeypatch: pytest.MonkeyPatch) -> type[_FakeWrapper]:
    package = types.ModuleType("flashinfer")
    mla = types.ModuleType("flashinfer.mla")
    mla.BatchMLAPagedAttentionWrapper = _FakeWrapper  # type: ignore[attr-defined]
    package.mla = mla  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flashinfer", package)
    monkeypatch.setitem(sys.modules, "flashinfer.mla", mla)
    monkeypatch.setattr(_gpu_backends, "_wrappers", {})
    _FakeWrapper.built = 0
    return _FakeWrapper


def _call(seqlens: list[int], s_q: int, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    batch = len(seqlens)
    q = torch.zeros(batch, s_q, H_Q, DV + ROPE)
    cache = torch.zeros(8, PAGE, 1, DV + ROPE)
    table = torch.arange(batch * 2, dtype=torch.int32).view(batch, 2)
    lens = torch.tensor(seqlens, dtype=torch.int32)
    return _gpu_backends.run_flashinfer(q, cache, table, lens, 0.1, causal, DV)


def test_one_wrapper_per_device_is_reused(fake_flashinfer: type[_FakeWrapper]) -> None:
    for _ in range(3):
        _call([5, 3], 1, causal=False)
    assert fake_flashinfer.built == 1
    ((wrapper, _),) = _gpu_backends._wrappers.values()
    assert len(wrapper.plans) == 3  # planned per call, built once


def test_causal_rows_before_the_first_key_see_nothing(
    fake_flashinfer: type[_FakeWrapper],
) -> None:
    out, lse = _call([1, 5, 0], 3, causal=True)  # lse: [batch, h_q, s_q]
    # Sequence 0 has one key: rows 0 and 1 of 3 come before it; sequence 2 has none.
    seen = torch.tensor([[False, False, True], [True, True, True], [False, False, False]])
    for b in range(3):
        for i in range(3):
            if seen[b, i]:
                assert torch.all(lse[b, :, i] == 2.0 * math.log(2.0))
                assert torch.all(out[b, i] == 1.0)
            else:
                assert torch.all(torch.isneginf(lse[b, :, i])) and torch.all(out[b, i] == 0.0)
    # Without causal masking, a sequence with keys is seen by every row.
    out, lse = _call([1, 5, 0], 3, causal=False)
    assert torch.all(torch.isfinite(lse[:2])) and torch.all(torch.isneginf(lse[2]))
