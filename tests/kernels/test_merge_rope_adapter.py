"""LSE merge of partials from several pools, RoPE re-rotation, and the backend adapter on CPU."""

from __future__ import annotations

import pytest
import torch

from tessera_ray.errors import KernelBackendUnavailableError, KernelError
from tessera_ray.kernels import (
    apply_rope,
    available_backends,
    mask_block_table,
    merge_attention_states,
    mla_decode,
    mla_decode_reference,
    rope_shift,
    select_backend,
)
from tests.kernels.helpers import KV_LORA, ROPE, paged_case

D = KV_LORA + ROPE


@pytest.mark.parametrize("pools", [2, 3])
@pytest.mark.parametrize(("s_q", "causal"), [(1, True), (2, True), (2, False)])
def test_partials_from_disjoint_page_sets_merge_to_single_pool_attention(
    pools: int, s_q: int, causal: bool
) -> None:
    case = paged_case([70, 33, 3, 128], page=16, seed=pools)
    q = torch.randn(4, s_q, 16, D, generator=torch.Generator().manual_seed(9))
    full_out, full_lse = mla_decode_reference(
        q, case.k_cache, case.block_table, case.seqlens, 0.07, causal
    )
    owner = torch.randint(0, pools, (case.k_cache.shape[0],), generator=torch.Generator())
    owner[int(case.block_table[2, 0])] = 0  # sequence 2 has one page: pools 1.. see nothing of it
    outs, lses = [], []
    for pool in range(pools):
        table = mask_block_table(case.block_table, owner == pool)
        out, lse = mla_decode_reference(q, case.k_cache, table, case.seqlens, 0.07, causal)
        outs.append(out)
        lses.append(lse)
    assert torch.isneginf(lses[1][2]).all()  # an empty partial takes part in the merge
    out, lse = merge_attention_states(outs, lses)
    torch.testing.assert_close(out, full_out, atol=1e-5, rtol=0)
    torch.testing.assert_close(lse, full_lse, atol=1e-5, rtol=0)


def test_merge_of_a_single_partial_is_identity_and_all_empty_stays_empty() -> None:
    out = torch.randn(2, 1, 3, 8)
    lse = torch.randn(2, 3, 1)
    got_out, got_lse = merge_attention_states([out], [lse])
    torch.testing.assert_close(got_out, out, atol=1e-6, rtol=0)
    torch.testing.assert_close(got_lse, lse, atol=0, rtol=0)
    empty = torch.full_like(lse, float("-inf"))
    z_out, z_lse = merge_attention_states([torch.zeros_like(out)] * 2, [empty, empty])
    assert (z_out == 0).all() and torch.isneginf(z_lse).all()


def test_compacted_tables_merge_for_single_query_decode() -> None:
    """For s_q = 1 attention ignores key order, so a pool may also decode its pages as a
    compact table of its own (what a GPU kernel needs, since kernels take no holes)."""
    case = paged_case([64], page=16)  # four full pages
    q = torch.randn(1, 1, 8, D)
    full = mla_decode_reference(q, case.k_cache, case.block_table, case.seqlens, 0.1, True)
    ids = case.block_table[0, :4]
    parts = [ids[[0, 3]], ids[[2, 1]]]
    outs, lses = [], []
    for part in parts:
        table = part.view(1, -1).to(torch.int32)
        out, lse = mla_decode_reference(
            q, case.k_cache, table, torch.tensor([32], dtype=torch.int32), 0.1, True
        )
        outs.append(out)
        lses.append(lse)
    out, lse = merge_attention_states(outs, lses)
    torch.testing.assert_close(out, full[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(lse, full[1], atol=1e-5, rtol=0)


def test_merge_rejects_mismatched_partials() -> None:
    with pytest.raises(KernelError, match="one lse per out"):
        merge_attention_states([torch.zeros(1, 1, 1, 4)], [])
    with pytest.raises(KernelError, match=r"lse must be \[batch, h_q, s_q\]"):
        merge_attention_states([torch.zeros(1, 1, 2, 4)], [torch.zeros(1, 1, 2)])
    with pytest.raises(KernelError, match="differ in shape"):
        merge_attention_states(
            [torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 5)], [torch.zeros(1, 2, 1)] * 2
        )


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_shift_equals_rope_at_the_new_position(interleaved: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(50, ROPE, generator=gen)
    start = torch.randint(0, 100_000, (50,), generator=gen)
    for delta in (1, 17, 4096, -300, 65_536):
        stored = apply_rope(k, start, interleaved=interleaved)
        shifted = rope_shift(stored, delta, interleaved=interleaved)
        fresh = apply_rope(k, start + delta, interleaved=interleaved)
        torch.testing.assert_close(shifted, fresh, atol=1e-6, rtol=0)
        assert (shifted - stored).abs().max() > 1e-2  # it really moved
    per_token = torch.arange(50) * 7 - 100
    torch.testing.assert_close(
        rope_shift(apply_rope(k, start), per_token),
        apply_rope(k, start + per_token),
        atol=1e-6,
        rtol=0,
    )
    assert torch.equal(rope_shift(k, 0), k)


def test_rope_scores_depend_only_on_relative_position() -> None:
    """Why shifting is sound: a query and key moved together keep their dot product."""
    q, k = torch.randn(ROPE), torch.randn(ROPE)
    base = (apply_rope(q, torch.tensor(900)) * apply_rope(k, torch.tensor(100))).sum()
    moved = (
        apply_rope(q, torch.tensor(5900)) * rope_shift(apply_rope(k, torch.tensor(100)), 5000)
    ).sum()
    torch.testing.assert_close(moved, base, atol=1e-5, rtol=0)


def test_rope_shift_keeps_bf16_and_rejects_float_delta() -> None:
    k = torch.randn(4, ROPE).bfloat16()
    assert rope_shift(k, 3).dtype == torch.bfloat16
    with pytest.raises(KernelError, match="whole positions"):
        rope_shift(k, torch.tensor(1.5))
    with pytest.raises(KernelError, match="even"):
        apply_rope(torch.randn(3, 7), torch.tensor(1))


def test_adapter_runs_reference_on_cpu_and_says_so() -> None:
    case = paged_case([30, 9], page=16)
    q = torch.randn(2, 1, 4, D)
    result = mla_decode(q, case.k_cache, case.block_table, case.seqlens, 0.1, True)
    assert result.backend == "reference"
    want = mla_decode_reference(q, case.k_cache, case.block_table, case.seqlens, 0.1, True)
    assert torch.equal(result.out, want[0]) and torch.equal(result.lse, want[1])
    chosen, reasons = select_backend(q, case.k_cache, case.block_table, case.seqlens)
    assert chosen == "reference" and reasons["reference"] is None
    assert "CUDA" in (reasons["flashmla"] or "") and "CUDA" in (reasons["flashinfer"] or "")
    assert available_backends()["reference"] is True


def test_adapter_refuses_named_backend_that_cannot_run_and_unknown_names() -> None:
    case = paged_case([30], page=16)
    q = torch.randn(1, 1, 4, D)
    with pytest.raises(KernelBackendUnavailableError, match="flashmla"):
        mla_decode(q, case.k_cache, case.block_table, case.seqlens, 0.1, True, backend="flashmla")
    with pytest.raises(KernelError, match="unknown backend"):
        mla_decode(q, case.k_cache, case.block_table, case.seqlens, 0.1, True, backend="triton")  # type: ignore[arg-type]
    with pytest.raises(KernelError, match="int32"):
        mla_decode(q, case.k_cache, case.block_table.long(), case.seqlens, 0.1, True)


@pytest.mark.parametrize(
    ("capability", "flashmla", "flashinfer"),
    [
        (None, False, False),  # no CUDA: the reference only
        ((8, 0), False, True),  # A100
        ((8, 9), False, True),  # L40S
        ((9, 0), True, True),  # H100 / H200
        ((10, 0), False, True),  # B200: FlashMLA imports there, but its dense decode fails
        ((12, 0), False, True),
    ],
)
def test_available_backends_follow_the_capability_table(
    monkeypatch: pytest.MonkeyPatch,
    capability: tuple[int, int] | None,
    flashmla: bool,
    flashinfer: bool,
) -> None:
    """With both kernels importable, what each GPU generation may run (faked on CPU); the
    reason names the requirement and the GPU."""
    from tessera_ray.kernels import _gpu_backends, adapter

    monkeypatch.setattr(adapter, "_device_capability", lambda device=None: capability)
    monkeypatch.setattr(_gpu_backends, "flashmla_importable", lambda: True)
    monkeypatch.setattr(_gpu_backends, "flashinfer_importable", lambda: True)
    assert available_backends() == {
        "flashmla": flashmla,
        "flashinfer": flashinfer,
        "reference": True,
    }
    why = adapter.capability_problem("flashmla", capability)
    assert (why is None) == flashmla
    if capability is not None and not flashmla:
        assert why is not None and "SM90" in why and f"SM{capability[0]}{capability[1]}" in why
    assert adapter.capability_problem("reference", capability) is None
