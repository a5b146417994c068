"""The reference decode against dense, non-absorbed MLA attention, and its edge conventions."""

from __future__ import annotations

import pytest
import torch

from tessera_ray.errors import KernelError
from tessera_ray.kernels import mla_decode_reference
from tests.kernels.helpers import KV_LORA, NOPE, ROPE, SCALE, V_DIM, dense_mla, paged_case


def _weights(heads: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w_uk = torch.randn(heads, NOPE, KV_LORA, generator=gen) / KV_LORA**0.5
    w_uv = torch.randn(heads, V_DIM, KV_LORA, generator=gen) / KV_LORA**0.5
    return w_uk, w_uv


@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("s_q", [1, 2])
@pytest.mark.parametrize("causal", [True, False])
def test_paged_absorbed_decode_equals_dense_attention(heads: int, s_q: int, causal: bool) -> None:
    # Ragged lengths: shorter than a page, exactly a page, several pages with a partial last one.
    lengths = [5, 16, 41, 2]
    case = paged_case(lengths, page=16, seed=heads + s_q)
    w_uk, w_uv = _weights(heads, seed=1)
    gen = torch.Generator().manual_seed(2)
    q_nope = torch.randn(len(lengths), s_q, heads, NOPE, generator=gen)
    q_rope = torch.randn(len(lengths), s_q, heads, ROPE, generator=gen)
    # Absorption: q_lat = W_UK^T q_nope, so q_lat . c_kv == q_nope . (W_UK c_kv).
    q_lat = torch.einsum("bshn,hnc->bshc", q_nope, w_uk)
    q = torch.cat([q_lat, q_rope], dim=-1).float()
    assert case.block_table[:, :3].tolist() != sorted(case.block_table[:, :3].tolist())

    out_lat, lse = mla_decode_reference(
        q, case.k_cache, case.block_table, case.seqlens, SCALE, causal
    )
    assert out_lat.shape == (len(lengths), s_q, heads, KV_LORA) and out_lat.dtype == torch.float32
    assert lse.shape == (len(lengths), heads, s_q) and lse.dtype == torch.float32
    out = torch.einsum("bshc,hvc->bshv", out_lat, w_uv)  # W_UV applied after attention
    for b in range(len(lengths)):
        c_kv = case.c_kv[b].float().double()  # the values the float32 pages really hold
        k_rope = case.k_rope[b].float().double()
        want_out, want_lse = dense_mla(q_nope[b], q_rope[b], c_kv, k_rope, w_uk, w_uv, causal)
        torch.testing.assert_close(out[b].double(), want_out, atol=1e-5, rtol=0)
        torch.testing.assert_close(lse[b].double(), want_lse, atol=1e-5, rtol=0)


def test_causal_mask_matters_for_two_queries() -> None:
    """Causal and non-causal differ for s_q = 2 on row 0 only (row 1 sees every key)."""
    case = paged_case([20], page=16)
    q = torch.randn(1, 2, 4, KV_LORA + ROPE)
    out_c, lse_c = mla_decode_reference(q, case.k_cache, case.block_table, case.seqlens, 0.05, True)
    out_n, lse_n = mla_decode_reference(
        q, case.k_cache, case.block_table, case.seqlens, 0.05, False
    )
    assert not torch.allclose(out_c[:, 0], out_n[:, 0])
    torch.testing.assert_close(out_c[:, 1], out_n[:, 1], atol=0, rtol=0)
    torch.testing.assert_close(lse_c[:, :, 1], lse_n[:, :, 1], atol=0, rtol=0)
    # Row 0 is exactly attention over the first 19 keys.
    out_19, lse_19 = mla_decode_reference(
        q[:, :1], case.k_cache, case.block_table, torch.tensor([19], dtype=torch.int32), 0.05, True
    )
    torch.testing.assert_close(out_c[:, :1], out_19, atol=1e-6, rtol=0)
    torch.testing.assert_close(lse_c[:, :, :1], lse_19, atol=1e-6, rtol=0)


def test_empty_sequence_and_unseeable_rows_give_zero_out_and_minus_inf_lse() -> None:
    case = paged_case([0, 1, 7], page=4)
    q = torch.randn(3, 2, 3, KV_LORA + ROPE)
    out, lse = mla_decode_reference(q, case.k_cache, case.block_table, case.seqlens, 0.1, True)
    assert torch.isneginf(lse[0]).all() and (out[0] == 0).all()
    # seqlen 1, s_q 2, causal: row 0 would see keys up to position -1, i.e. none.
    assert torch.isneginf(lse[1, :, 0]).all() and (out[1, 0] == 0).all()
    assert torch.isfinite(lse[1, :, 1]).all() and torch.isfinite(lse[2]).all()
    assert not torch.isnan(out).any()


def test_pages_not_held_are_skipped_but_keep_positions() -> None:
    case = paged_case([40], page=16)
    q = torch.randn(1, 1, 2, KV_LORA + ROPE)
    table = case.block_table.clone()
    table[0, 1] = -1  # tokens 16..31 live elsewhere
    out, lse = mla_decode_reference(q, case.k_cache, table, case.seqlens, 0.1, False)
    keys = torch.cat([case.k_cache[int(table[0, 0]), :, 0], case.k_cache[int(table[0, 2]), :8, 0]])
    scores = torch.einsum("hd,td->ht", q[0, 0], keys) * 0.1
    torch.testing.assert_close(lse[0, :, 0], torch.logsumexp(scores, -1), atol=1e-5, rtol=0)
    want = torch.softmax(scores, -1) @ keys[:, :KV_LORA]
    torch.testing.assert_close(out[0, 0], want, atol=1e-5, rtol=0)


def test_bf16_pages_with_fp32_queries_upcast_exactly() -> None:
    case = paged_case([30], page=16)
    pages16 = case.k_cache.bfloat16()
    q = torch.randn(1, 1, 4, KV_LORA + ROPE)
    got = mla_decode_reference(q, pages16, case.block_table, case.seqlens, 0.05, False)
    want = mla_decode_reference(q, pages16.float(), case.block_table, case.seqlens, 0.05, False)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_strided_page_view_is_accepted() -> None:
    """A pool hands out views; only the last dimension has to be dense."""
    case = paged_case([25], page=16)
    big = torch.zeros(case.k_cache.shape[0], 16, 2, KV_LORA + ROPE)
    big[:, :, 1:] = case.k_cache
    view = big[:, :, 1:]
    assert not view.is_contiguous()
    q = torch.randn(1, 1, 2, KV_LORA + ROPE)
    got = mla_decode_reference(q, view, case.block_table, case.seqlens, 0.1, False)
    want = mla_decode_reference(q, case.k_cache, case.block_table, case.seqlens, 0.1, False)
    assert torch.equal(got[0], want[0])


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda a: a.update(block_table=a["block_table"].long()), "int32"),
        (lambda a: a.update(cache_seqlens=a["cache_seqlens"].long()), "int32"),
        (lambda a: a.update(q=a["q"][..., :500]), "head_dim"),
        (lambda a: a.update(k_cache=a["k_cache"].expand(-1, -1, 2, -1)), "one latent head"),
        (lambda a: a.update(q=a["q"].transpose(2, 3).contiguous().transpose(2, 3)), "contiguous"),
        (lambda a: a.update(cache_seqlens=torch.tensor([99], dtype=torch.int32)), "columns"),
        (lambda a: a["block_table"].fill_(1000), "num_pages"),
        (lambda a: a.update(q=a["q"][0]), "q must be"),
        (lambda a: a.update(q=a["q"].to(torch.int32)), "float32"),
    ],
)
def test_bad_inputs_raise_kernel_error(mutate: object, needle: str) -> None:
    case = paged_case([20], page=16)
    args = {
        "q": torch.randn(1, 1, 2, KV_LORA + ROPE),
        "k_cache": case.k_cache,
        "block_table": case.block_table.clone(),
        "cache_seqlens": case.seqlens,
    }
    mutate(args)  # type: ignore[operator]
    with pytest.raises(KernelError, match=needle):
        mla_decode_reference(
            args["q"], args["k_cache"], args["block_table"], args["cache_seqlens"], 0.1, False
        )
    assert issubclass(KernelError, ValueError)


def test_tables_a_raw_pointer_kernel_would_misread_are_refused() -> None:
    """As FlashMLA's own checks: a non-contiguous cache_seqlens, or block-table rows whose
    entries are not adjacent, are refused rather than read as if they were."""
    case = paged_case([20, 40], page=16)
    q = torch.randn(2, 1, 2, KV_LORA + ROPE)
    gapped = torch.stack([case.seqlens, torch.zeros_like(case.seqlens)], dim=1)[:, 0]
    assert not gapped.is_contiguous() and torch.equal(gapped, case.seqlens)
    with pytest.raises(KernelError, match="cache_seqlens must be contiguous"):
        mla_decode_reference(q, case.k_cache, case.block_table, gapped, 0.1, False)
    column_major = case.block_table.t().contiguous().t()
    assert torch.equal(column_major, case.block_table) and column_major.stride(1) != 1
    with pytest.raises(KernelError, match="last dimension must have stride 1"):
        mla_decode_reference(q, case.k_cache, column_major, case.seqlens, 0.1, False)
    got = mla_decode_reference(q, case.k_cache, case.block_table, case.seqlens, 0.1, False)
    assert got[0].shape[0] == 2
