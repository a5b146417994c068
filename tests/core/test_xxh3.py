"""The device form of the content hash (core/_xxh3.py), run here with torch ops on the CPU:
every digest is checked against the xxhash package, which the host path calls."""

from __future__ import annotations

import random

import pytest
import torch
import xxhash

from tessera_ray.core._xxh3 import MIN_BYTES, rows_qualify, xxh3_128_rows
from tessera_ray.errors import PageBoundsError, PageDTypeError, PageShapeError

SEEDS = (0, 1, 2**63, 2**64 - 1, 0x9D3F_0C21_7A55_E104)
_rng = random.Random(41)
LENGTHS = sorted(
    {
        *(8 * _rng.randrange(31, 513) for _ in range(40)),  # 248 .. 4,096 B in whole words
        248,  # the shortest input in whole words on the long path
        *(1024 * k for k in (1, 2, 3, 4)),  # the last block full: never scrambled
        *(1024 * k + d for k in (1, 2) for d in (-64, -8, 8, 64)),  # around a block's edge
        *(64 * k for k in (5, 17, 31)),  # whole stripes, a partial block
        73_728,  # a DeepSeek MLA page
    }
)


def _rows(n: int, length: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, length), dtype=torch.uint8, generator=gen)


def _host(rows: torch.Tensor, seed: int) -> list[int]:
    return [xxhash.xxh3_128_intdigest(r.numpy().tobytes(), seed) for r in rows]


@pytest.mark.parametrize("length", LENGTHS)
def test_the_reference_equals_xxhash(length: int) -> None:
    data = _rows(5, length, length)
    order = [3, 0, 4, 1, 2, 3]  # out of order, one row twice
    for seed in SEEDS:
        assert xxh3_128_rows(data, order, seed) == _host(data[order], seed)


def test_the_reference_hashes_in_chunks_of_rows_like_one_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    data = _rows(7, 1096, 3)
    whole = xxh3_128_rows(data, list(range(7)), 5)
    monkeypatch.setattr("tessera_ray.core._xxh3._ROW_CHUNK_BYTES", 2 * 1096)
    assert xxh3_128_rows(data, list(range(7)), 5) == whole == _host(data, 5)


def _flips(page: torch.Tensor, bits: list[int]) -> torch.Tensor:
    out = page.repeat(len(bits), 1)
    at = torch.tensor(bits)
    out[torch.arange(len(bits)), at // 8] ^= (1 << (at % 8)).to(torch.uint8)
    return out


def _swaps(page: torch.Tensor, pairs: list[tuple[int, int]]) -> torch.Tensor:
    words = page.view(torch.int64).repeat(len(pairs), 1)
    rows = torch.arange(len(pairs))
    a = torch.tensor([p[0] for p in pairs])
    b = torch.tensor([p[1] for p in pairs])
    words[rows, a], words[rows, b] = words[rows, b], words[rows, a]
    return words.view(torch.uint8)


def _check_all_differ(page: torch.Tensor, variants: torch.Tensor, seed: int) -> None:
    """Every variant's key differs from the page's and from every other variant's, and is the
    key xxhash gives it."""
    assert not (variants == page).all(dim=1).any(), "a variant equals the page"
    keys = xxh3_128_rows(torch.cat([page[None], variants]), list(range(len(variants) + 1)), seed)
    assert len(set(keys)) == len(keys)
    assert keys == _host(torch.cat([page[None], variants]), seed)


# 1,024 B: one block, never scrambled; 1,096 B: a scrambled block, one partial-block stripe and
# a last stripe overlapping it; 2,048 B: two blocks.
@pytest.mark.parametrize("length", [1024, 1096, 2048])
def test_every_bit_flip_changes_the_key(length: int) -> None:
    page = _rows(1, length, length)[0]
    bits = list(range(length * 8))
    for start in range(0, len(bits), 4096):
        _check_all_differ(page, _flips(page, bits[start : start + 4096]), SEEDS[-1])


@pytest.mark.parametrize("length", [1024, 1096])
def test_every_swap_of_two_words_changes_the_key(length: int) -> None:
    page = _rows(1, length, length + 1)[0]
    n = length // 8
    assert len(set(page.view(torch.int64).tolist())) == n, "words must differ to swap them"
    pairs = [(a, b) for a in range(n) for b in range(a + 1, n)]
    for start in range(0, len(pairs), 4096):
        _check_all_differ(page, _swaps(page, pairs[start : start + 4096]), 0)


def test_sampled_flips_and_swaps_change_the_key_of_a_full_page() -> None:
    length = 73_728
    n = length // 8
    page = _rows(1, length, 7)[0]
    rng = random.Random(7)
    # The first and last bits, each block's edges, the last stripe, and random ones.
    edges = [0, length * 8 - 1, *(1024 * 8 * k + d for k in range(1, 72) for d in (-1, 0))]
    bits = [*edges[:60], *(rng.randrange(length * 8) for _ in range(60))]
    bits += [8 * (length - 64) + rng.randrange(512) for _ in range(8)]
    _check_all_differ(page, _flips(page, sorted(set(bits))), 1)
    pairs = {(0, n - 1), (n - 9, n - 1), (127, 128)}
    while len(pairs) < 100:
        a, b = sorted(rng.sample(range(n), 2))
        pairs.add((a, b))
    _check_all_differ(page, _swaps(page, sorted(pairs)), 1)


def test_keys_stay_seeded() -> None:
    data = _rows(6, 2048, 11)
    keys = [xxh3_128_rows(data, list(range(6)), seed) for seed in SEEDS]
    assert len({k for per_seed in keys for k in per_seed}) == 6 * len(SEEDS)
    assert keys == [_host(data, seed) for seed in SEEDS]


def test_what_qualifies_for_the_device_hash() -> None:
    assert MIN_BYTES == 241
    assert [n for n in (232, 240, 241, 244, 248, 1001, 1024) if rows_qualify(n)] == [248, 1024]


@pytest.mark.parametrize("length", [240, 244, 1001])
def test_rows_that_do_not_qualify_are_refused(length: int) -> None:
    with pytest.raises(PageShapeError, match="hashed on the host"):
        xxh3_128_rows(_rows(2, length, 0), [0], 0)


def test_bad_input_is_refused_with_a_reason() -> None:
    data = _rows(3, 256, 0)
    with pytest.raises(PageDTypeError):
        xxh3_128_rows(data.view(torch.int64), [0], 0)
    with pytest.raises(PageShapeError, match="contiguous"):
        xxh3_128_rows(torch.cat([data, data], dim=1)[:, :256], [0], 0)
    with pytest.raises(PageShapeError, match="contiguous"):
        xxh3_128_rows(data.reshape(-1)[1 : 1 + 2 * 256].view(2, 256), [0], 0)
    with pytest.raises(PageBoundsError):
        xxh3_128_rows(data, [0, 3], 0)
    with pytest.raises(PageBoundsError):
        xxh3_128_rows(data, [-1], 0)
    for seed in (-1, 2**64, True, 1.5):
        with pytest.raises(PageShapeError, match="seed"):
            xxh3_128_rows(data, [0], seed)  # type: ignore[arg-type]
    assert xxh3_128_rows(data, [], 0) == []
