"""The Triton kernel of the device hash (core/_xxh3_kernel.py) under Triton's interpreter
(``TRITON_INTERPRET=1``), on CPU tensors: its digests against xxhash's. Skipped only where
Triton is not installed (``make test`` installs it); tests/gpu/test_device_hash.py runs the
compiled kernel.

The interpreter has to be on before Triton is first imported (Triton's own library functions
are decorated then), and this test process may have imported it already, so the kernel runs in
a child process given the pages; the interpreter runs each program in Python, so they are few.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import xxhash

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
_CHILD = """
import json, sys, torch
from tessera_ray.core._xxh3 import xxh3_128_rows
cases = torch.load(sys.argv[1])
print(json.dumps([
    [str(d) for d in xxh3_128_rows(data, slots, seed, kernel=True)]
    for data, slots, seed in cases
]))
"""

Case = tuple[torch.Tensor, list[int], int]


def _rows(n: int, length: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, length), dtype=torch.uint8, generator=gen)


def _flipped(length: int) -> torch.Tensor:
    """A page and copies of it with one byte changed: in a scrambled block, in the last part-full
    group of blocks the kernel loads at once, in the partial block, and in the last stripe."""
    page = _rows(1, length, 2)[0]
    at = [5, 4 * 1024 + 3, 5 * 1024 + 1, length - 1]
    variants = page.repeat(len(at), 1)
    variants[torch.arange(len(at)), torch.tensor(at)] ^= 0x40
    return torch.cat([page[None], variants])


def _cases() -> list[Case]:
    # 248 B: no block; 1,024 B: one unscrambled block; 1,096 B: a block, a partial one and an
    # overlapping last stripe; 5,128 B: five blocks, more than one group; 73,728 B: an MLA page.
    cases: list[Case] = []
    for length in (248, 1024, 1096, 5128):
        for seed in (0, 2**64 - 1):
            cases.append((_rows(3, length, length), [2, 0, 2, 1], seed))
    cases.append((_rows(2, 73_728, 1), [1, 0], 41))
    flipped = _flipped(5128)
    cases.append((flipped, list(range(len(flipped))), 3))
    return cases


@pytest.fixture(scope="module")
def kernel_digests(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Case], list[list[int]]]:
    cases = _cases()
    path = tmp_path_factory.mktemp("xxh3") / "cases.pt"
    torch.save(cases, path)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    res = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    digests = [[int(d) for d in per_case] for per_case in json.loads(res.stdout)]
    return cases, digests


def test_the_kernel_equals_xxhash(kernel_digests: tuple[list[Case], list[list[int]]]) -> None:
    cases, digests = kernel_digests
    assert len(digests) == len(cases)
    for (data, slots, seed), got in zip(cases, digests, strict=True):
        want = [xxhash.xxh3_128_intdigest(data[s].numpy().tobytes(), seed) for s in slots]
        assert got == want, f"{data.shape[1]} B pages, seed {seed}"


def test_the_kernel_sees_a_change_in_every_part_of_a_page(
    kernel_digests: tuple[list[Case], list[list[int]]],
) -> None:
    got = kernel_digests[1][-1]
    assert len(got) == 5 and len(set(got)) == 5
