"""Small pools for fast tests: tiny custom page specs rather than 73 KB MLA pages."""

from __future__ import annotations

import pytest
import torch

from tessera_ray.core import BlockPool, ContentHashFn, PoolConfig, xxh3_128
from tessera_ray.layout import CacheSpec, DType, EntryFormat, PageSpec, Region, Scheme

FINGERPRINT = "test-layout-fingerprint"


def tiny_spec(page_bytes: int = 64) -> PageSpec:
    """An MLA-shaped page of ``page_bytes`` bytes: 4 tokens of (bf16 c_kv, bf16 k_rope)."""
    tokens = 4
    values = page_bytes // tokens // 2
    entry = EntryFormat(
        name="tiny",
        regions=(
            Region(name="c_kv", num_values=values - 2, dtype=DType.BF16),
            Region(name="k_rope", num_values=2, dtype=DType.BF16),
        ),
    )
    return PageSpec(cache=CacheSpec(scheme=Scheme.MLA, entry=entry), block_tokens=tokens)


def make_pool(
    num_pages: int = 16,
    *,
    page_bytes: int = 64,
    layers_per_block: int = 1,
    content_hash: ContentHashFn = xxh3_128,
) -> BlockPool:
    return BlockPool(
        tiny_spec(page_bytes),
        PoolConfig(num_pages=num_pages),
        fingerprint=FINGERPRINT,
        layers_per_block=layers_per_block,
        content_hash=content_hash,
    )


def page_of(byte: int, page_bytes: int = 64) -> torch.Tensor:
    return torch.full((page_bytes,), byte, dtype=torch.uint8)


def random_page(gen: torch.Generator, page_bytes: int = 64) -> torch.Tensor:
    return torch.randint(0, 256, (page_bytes,), dtype=torch.uint8, generator=gen)


@pytest.fixture
def pool() -> BlockPool:
    return make_pool()
