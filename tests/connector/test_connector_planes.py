"""A layer of vLLM's cache as tier rows, for every packing the connector knows: the planes
gather each token's K of every head then V of every head, and a scatter writes exactly those
values back and nothing else. The packings are written here element by element from their
definitions (docs/full-attention-caches.md), independently of the views under test."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tessera_ray.errors import LayoutError
from tessera_ray.vllm.planes import PLANE_BUILDERS, mla_planes

B, H, N, D = 3, 2, 32, 32


def _side_by_side(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    out = torch.empty(B, H, N, 2 * D, dtype=k.dtype)
    for b in range(B):
        for h in range(H):
            for r in range(N):
                out[b, h, r, :D] = k[b, r, h]
                out[b, h, r, D:] = v[b, r, h]
    return out


def _cpu_vec(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    flat = torch.empty(B, H, 2 * N * D, dtype=k.dtype)
    for r in range(N):
        for d in range(D):
            flat[:, :, d * N + r] = k[:, r, :, d]
            flat[:, :, N * D + r * D + d] = v[:, r, :, d]
    return flat.view(B, H, N, 2 * D)


def _cpu_amx(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    flat = torch.empty(B, H, 2 * N * D, dtype=k.dtype)
    for r in range(N):
        for d in range(D):
            ki = ((r // 16) * (D // 2) + d // 2) * 32 + (r % 16) * 2 + d % 2
            vi = ((d // 16) * (N // 2) + r // 2) * 32 + (d % 16) * 2 + r % 2
            flat[:, :, ki] = k[:, r, :, d]
            flat[:, :, N * D + vi] = v[:, r, :, d]
    return flat.view(B, H, N, 2 * D)


PACKINGS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "kv-side-by-side": _side_by_side,
    "cpu-vec": _cpu_vec,
    "cpu-vec16": _cpu_vec,
    "cpu-amx": _cpu_amx,
}


def test_every_builder_is_checked_here() -> None:
    assert set(PACKINGS) == set(PLANE_BUILDERS)


@pytest.mark.parametrize("packing", sorted(PACKINGS))
def test_planes_read_and_write_each_tokens_k_then_v(packing: str) -> None:
    gen = torch.Generator().manual_seed(5)
    k = torch.randn(B, N, H, D, generator=gen).to(torch.bfloat16)
    v = torch.randn(B, N, H, D, generator=gen).to(torch.bfloat16)
    cache = PACKINGS[packing](k, v)
    planes = PLANE_BUILDERS[packing](cache, D)
    assert planes.row_values == 2 * H * D and planes.block_tokens == N

    rows = torch.tensor([2 * N + 5, 0, N + 31, 17])  # (block, token) = (2,5) (0,0) (1,31) (0,17)
    got = planes.gather(rows)
    for i, row in enumerate(rows.tolist()):
        b, r = divmod(row, N)
        want = torch.cat([k[b, r].reshape(-1), v[b, r].reshape(-1)])
        assert torch.equal(got[i], want), (packing, row)

    # Scatter new rows into a copy: exactly those tokens' values change, to the new ones.
    before = cache.clone()
    new = torch.randn(len(rows), 2 * H * D, generator=gen).to(torch.bfloat16)
    planes.scatter(rows, new)
    assert torch.equal(planes.gather(rows), new)
    k2, v2 = k.clone(), v.clone()
    for i, row in enumerate(rows.tolist()):
        b, r = divmod(row, N)
        k2[b, r] = new[i, : H * D].view(H, D)
        v2[b, r] = new[i, H * D :].view(H, D)
    assert torch.equal(cache, PACKINGS[packing](k2, v2))
    assert not torch.equal(cache, before)


@pytest.mark.parametrize("packing", sorted(PACKINGS))
@pytest.mark.parametrize(("first", "length"), [(0, N), (16, 16), (8, 8)])
@pytest.mark.parametrize("ids", [[2, 0], [1, 2]], ids=["apart", "consecutive"])
def test_block_writes_from_strided_pages_equal_row_writes(
    packing: str, first: int, length: int, ids: list[int]
) -> None:
    """``write_tokens`` from a strided view (every other page of a staging buffer, as a layer's
    pages sit among the other layers' in a tier block) leaves the cache exactly as the
    row-by-row scatter of the same tokens does, and touches nothing else."""
    gen = torch.Generator().manual_seed(6)
    k = torch.randn(B, N, H, D, generator=gen).to(torch.bfloat16)
    v = torch.randn(B, N, H, D, generator=gen).to(torch.bfloat16)
    by_blocks, by_rows = PACKINGS[packing](k, v), PACKINGS[packing](k, v)
    staged = torch.randn(2, 2, length, 2 * H * D, generator=gen).to(torch.bfloat16)
    new = staged[:, 1]  # [2 blocks, length, row]: not contiguous
    assert not new.is_contiguous()
    PLANE_BUILDERS[packing](by_blocks, D).write_tokens(torch.tensor(ids), new, first)
    offsets = torch.arange(first, first + length)
    rows = torch.cat([ids[0] * N + offsets, ids[1] * N + offsets])
    PLANE_BUILDERS[packing](by_rows, D).scatter(rows, new.reshape(2 * length, -1))
    assert torch.equal(by_blocks, by_rows)
    (spare,) = {0, 1, 2} - set(ids)
    assert torch.equal(by_blocks[spare], PACKINGS[packing](k, v)[spare])
    untouched = [r for r in range(N) if not first <= r < first + length]
    assert not untouched or torch.equal(
        PLANE_BUILDERS[packing](by_blocks, D).gather(torch.tensor(untouched, dtype=torch.long)),
        PLANE_BUILDERS[packing](PACKINGS[packing](k, v), D).gather(
            torch.tensor(untouched, dtype=torch.long)
        ),
    )


@pytest.mark.parametrize("packing", sorted(PACKINGS))
@pytest.mark.parametrize(("first", "length"), [(0, N), (16, 16), (8, 8)])
def test_grouped_writes_from_strided_pages_equal_row_writes(
    packing: str, first: int, length: int
) -> None:
    """``write_groups`` of one staged tier block's two engine blocks (a strided view: a layer's
    page among the others) into consecutive cache blocks 1 and 2 leaves the cache exactly as
    the row-by-row scatter of the same tokens, and block 0 as it was."""
    gen = torch.Generator().manual_seed(7)
    k = torch.randn(B, N, H, D, generator=gen).to(torch.bfloat16)
    v = torch.randn(B, N, H, D, generator=gen).to(torch.bfloat16)
    by_groups, by_rows = PACKINGS[packing](k, v), PACKINGS[packing](k, v)
    staged = torch.randn(1, 2, 2, length, 2 * H * D, generator=gen).to(torch.bfloat16)
    new = staged[:, :, 1]  # [1 tier block, 2 engine blocks, length, row]: not contiguous
    assert not new.is_contiguous()
    PLANE_BUILDERS[packing](by_groups, D).write_groups(1, new, first)
    offsets = torch.arange(first, first + length)
    rows = torch.cat([1 * N + offsets, 2 * N + offsets])
    PLANE_BUILDERS[packing](by_rows, D).scatter(rows, new.reshape(2 * length, -1))
    assert torch.equal(by_groups, by_rows)
    assert torch.equal(by_groups[0], PACKINGS[packing](k, v)[0])
    assert not torch.equal(by_groups, PACKINGS[packing](k, v))


def test_mla_planes_are_token_rows_and_refuse_another_shape() -> None:
    cache = torch.arange(4 * 16 * 576, dtype=torch.float32).view(4, 1, 16, 576)
    planes = mla_planes(cache, 16)
    assert torch.equal(planes.gather(torch.tensor([17])), cache[1, 0, 1].view(1, -1))
    with pytest.raises(LayoutError, match="not a contiguous cache of 32-token blocks"):
        mla_planes(cache.view(4, 16, 1, 576).transpose(1, 2), 32)
