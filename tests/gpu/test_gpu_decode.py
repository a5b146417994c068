"""FlashMLA and FlashInfer against the reference on bf16 pages (skipped without CUDA).

Run by ``benchmarks/gpu_check.sh``. Tolerances: the kernels round P and ``out`` to bf16 while
the reference keeps float32, so ``out`` is compared at bf16 precision (about 1e-2) and ``lse``
(float32 in every backend) at 1e-2.
"""

from __future__ import annotations

import pytest
import torch

from tessera_ray.kernels import (
    available_backends,
    merge_attention_states,
    mla_decode,
    mla_decode_reference,
)
from tessera_ray.models import TinyMLA
from tests._marks import GPU_ONLY

pytestmark = GPU_ONLY

PAGE = 64  # FlashMLA's page
SCALE = 192**-0.5


def _case(lengths: list[int], heads: int, s_q: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    blocks = [-(-n // PAGE) for n in lengths]
    num_pages = sum(blocks) + 4
    k_cache = torch.randn(num_pages, PAGE, 1, 576, device="cuda", generator=gen).bfloat16()
    perm = torch.randperm(num_pages, device="cuda", generator=gen).to(torch.int32)
    table = torch.zeros(len(lengths), max(blocks) + 1, dtype=torch.int32, device="cuda")
    used = 0
    for b, n in enumerate(blocks):
        table[b, :n] = perm[used : used + n]
        used += n
    q = torch.randn(len(lengths), s_q, heads, 576, device="cuda", generator=gen).bfloat16()
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    return q, k_cache, table, lens


def _check_against_reference(backend: str, heads: int, s_q: int, causal: bool) -> None:
    q, k_cache, table, lens = _case([1, 64, 700, 4096, 129], heads, s_q)
    got = mla_decode(q, k_cache, table, lens, SCALE, causal, backend=backend)  # type: ignore[arg-type]
    assert got.backend == backend
    want_out, want_lse = mla_decode_reference(q.float(), k_cache, table, lens, SCALE, causal)
    assert got.out.shape == want_out.shape and got.lse.shape == want_lse.shape
    torch.testing.assert_close(got.out.float(), want_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.lse, want_lse, atol=1e-2, rtol=0)


@pytest.mark.skipif(not available_backends()["flashmla"], reason="FlashMLA not usable here")
@pytest.mark.parametrize(
    ("heads", "s_q", "causal"), [(16, 1, False), (128, 1, True), (128, 2, True)]
)
def test_flashmla_matches_reference(heads: int, s_q: int, causal: bool) -> None:
    _check_against_reference("flashmla", heads, s_q, causal)


@pytest.mark.skipif(not available_backends()["flashinfer"], reason="FlashInfer MLA not usable here")
@pytest.mark.parametrize(
    ("heads", "s_q", "causal"), [(16, 1, False), (128, 1, True), (128, 2, True)]
)
def test_flashinfer_matches_reference(heads: int, s_q: int, causal: bool) -> None:
    _check_against_reference("flashinfer", heads, s_q, causal)


@pytest.mark.parametrize("backend", ["flashmla", "flashinfer"])
def test_empty_sequence_follows_the_convention(backend: str) -> None:
    if not available_backends()[backend]:  # type: ignore[index]
        pytest.skip(f"{backend} not usable here")
    q, k_cache, table, lens = _case([0, 100], 16, 1)
    got = mla_decode(q, k_cache, table, lens, SCALE, False, backend=backend)  # type: ignore[arg-type]
    assert torch.isneginf(got.lse[0]).all() and (got.out[0] == 0).all()
    assert torch.isfinite(got.lse[1]).all()


def test_auto_prefers_a_gpu_kernel_when_one_is_usable() -> None:
    q, k_cache, table, lens = _case([300], 16, 1)
    got = mla_decode(q, k_cache, table, lens, SCALE, False)
    avail = available_backends()
    want = "flashmla" if avail["flashmla"] else "flashinfer" if avail["flashinfer"] else "reference"
    assert got.backend == want


def test_partials_on_gpu_merge_to_full_attention() -> None:
    """Two holders decode compact tables of their own pages (s_q = 1) on the GPU kernel."""
    q, k_cache, table, lens = _case([4096], 128, 1)
    full = mla_decode(q, k_cache, table, lens, SCALE, False)
    halves = (table[:, :32], table[:, 32:64])
    parts = [
        mla_decode(q, k_cache, half.contiguous(), torch.full_like(lens, 2048), SCALE, False)
        for half in halves
    ]
    out, lse = merge_attention_states([p.out for p in parts], [p.lse for p in parts])
    torch.testing.assert_close(out.float(), full.out.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, full.lse, atol=1e-3, rtol=0)


def test_tiny_model_decodes_on_gpu_kernel_like_reference() -> None:
    model = TinyMLA(device="cuda")
    toks = torch.randint(0, 256, (200,), generator=torch.Generator().manual_seed(0))
    pages = model.new_pages(4, PAGE, dtype=torch.bfloat16)
    table = torch.tensor([[3, 1, 0, 2]], dtype=torch.int32, device="cuda")
    model.write_prefill(model.prefill(toks[:199]).kv, pages, table[0])
    ref_pages = [p.clone() for p in pages]
    got = model.decode_step(toks[199:], torch.tensor([199]), pages, table)
    want = model.decode_step(toks[199:], torch.tensor([199]), ref_pages, table, backend="reference")
    assert (got - want).abs().max() <= 3e-2 * want.abs().max()
