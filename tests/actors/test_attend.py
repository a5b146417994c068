"""Attention where the pages live, and decoding with KV that went through the tier.

The tiny MLA model produces real KV; its pages are stored in pools on different nodes.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from tessera_ray.actors.client import TesseraClient
from tessera_ray.actors.config import PoolServiceConfig, TierConfig
from tessera_ray.core import token_key
from tessera_ray.kernels import mla_decode_reference
from tessera_ray.layout import MLAConfig, build_layout
from tessera_ray.models import TinyMLA, TinyMLAConfig
from tests.conftest import SimCluster

pytestmark = pytest.mark.ray

MODEL = TinyMLA(TinyMLAConfig())
LAYOUT = build_layout(
    MLAConfig(name="tiny-mla", num_layers=MODEL.config.num_layers, num_heads=MODEL.config.num_heads)
)
PAGE = LAYOUT.block_tokens
TOKENS = torch.randint(
    0, MODEL.config.vocab_size, (4 * PAGE,), generator=torch.Generator().manual_seed(7)
)


def keys_for(ns: str, tokens: torch.Tensor) -> list[bytes]:
    out, parent = [], None
    for b in range(tokens.numel() // PAGE):
        parent = token_key(
            ns, LAYOUT.fingerprint, parent, tokens[b * PAGE : (b + 1) * PAGE].tolist()
        )
        out.append(parent)
    return out


def fresh_pages(extra: int = 0) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The model's KV for TOKENS in bf16 pages, block b in page b (plus ``extra`` empty pages)."""
    blocks = TOKENS.numel() // PAGE
    pages = MODEL.new_pages(blocks + extra, PAGE, dtype=torch.bfloat16)
    table = torch.arange(blocks + extra, dtype=torch.int32)
    MODEL.write_prefill(MODEL.prefill(TOKENS).kv, pages, table)
    return pages, table


def payloads(pages: list[torch.Tensor], blocks: int) -> np.ndarray:
    """Block payloads as the tier stores them: each layer's page of the block, in layer order."""
    rows = [torch.cat([p[b].reshape(-1).view(torch.uint8) for p in pages]) for b in range(blocks)]
    return torch.stack(rows).numpy()


def pages_from(rows: list[np.ndarray], extra: int) -> list[torch.Tensor]:
    blocks = len(rows)
    pages = MODEL.new_pages(blocks + extra, PAGE, dtype=torch.bfloat16)
    per_layer = PAGE * MODEL.config.head_dim * 2
    for b, row in enumerate(rows):
        data = torch.from_numpy(np.array(row))
        for layer, p in enumerate(pages):
            chunk = data[layer * per_layer : (layer + 1) * per_layer]
            p[b].reshape(-1).view(torch.uint8).copy_(chunk)
    return pages


@pytest.fixture(scope="module")
def tier(
    tessera_cluster: SimCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TesseraClient]:
    disk: Path = tmp_path_factory.mktemp("attend-disk")
    config = TierConfig(
        model="tiny-mla",
        pool=PoolServiceConfig(num_blocks=8, disk_root=disk),
        num_shards=2,
        ray_namespace="tessera-test-attend",
    )
    client = TesseraClient.start(config, layout=LAYOUT, pools_on=tessera_cluster.node_ids)
    yield client
    client.stop()


def test_attention_runs_where_the_pages_live(
    tier: TesseraClient, tessera_cluster: SimCluster
) -> None:
    n1, n2, _ = (tier.pool_on(n) for n in tessera_cluster.node_ids)
    pages, table = fresh_pages()
    data = payloads(pages, 4)
    keys = keys_for("attn", TOKENS)
    tier.store("attn", keys[:2], data[:2], pool=n1)
    tier.store("attn", keys[2:], data[2:], pool=n2)
    q = torch.randn(
        1,
        2,
        MODEL.config.num_heads,
        MODEL.config.head_dim,
        generator=torch.Generator().manual_seed(1),
    )
    scale = MODEL.config.softmax_scale
    for layer in range(MODEL.config.num_layers):
        out, lse = tier.attend("attn", keys, layer, q, TOKENS.numel(), scale)
        ref_out, ref_lse = mla_decode_reference(
            q,
            pages[layer],
            table[None],
            torch.tensor([TOKENS.numel()], dtype=torch.int32),
            scale,
            True,
        )
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    with pytest.raises(LookupError, match="in no pool's memory"):
        tier.attend(
            "attn", [*keys, keys_for("other", TOKENS)[0]], 0, q, TOKENS.numel() + PAGE, scale
        )


def test_decode_through_the_tier_is_bit_exact(
    tier: TesseraClient, tessera_cluster: SimCluster
) -> None:
    """KV stored on node 1, spilled to its disk, fetched into node 3, read back: decoding from it
    gives exactly the logits of decoding from freshly computed KV."""
    n1, _, n3 = (tier.pool_on(n) for n in tessera_cluster.node_ids)
    pages, table = fresh_pages(extra=1)
    keys = keys_for("decode", TOKENS)
    tier.store("decode", keys, payloads(pages, 4), pool=n1)
    report = tier.evict(n1, 8)
    assert {r.token_key for r in report.spilled} >= set(keys)  # last copies went to disk
    result = tier.fetch("decode", keys, into=n3)
    assert set(result.fetched) == set(keys) and not result.failed
    rows = tier.read("decode", keys, pool=n3)
    assert all(r is not None for r in rows)
    through = pages_from(rows, extra=1)
    nxt, pos = torch.tensor([3]), torch.tensor([TOKENS.numel()])
    fresh_logits = MODEL.decode_step(nxt, pos, pages, table[None])
    tier_logits = MODEL.decode_step(nxt, pos, through, table[None])
    assert torch.equal(fresh_logits, tier_logits)
