"""Window persistence strategies: bytes written (pinned) and round trips through a tier."""

from __future__ import annotations

from tessera_ray.layout import preset_layout
from tessera_ray.storage import HostMemoryTier, WindowPersister, WindowStrategy, window_write_bytes

from .conftest import HASH, run

TOKENS_32K = 32_768


def test_v4_flash_32k_bytes_per_strategy() -> None:
    # V4-Flash: 43 layers keep a 128-token window (docs/reference.md); v4-model1 entries are 584 B.
    model1 = preset_layout("deepseek-v4-flash", format="v4-model1")
    paper = preset_layout("deepseek-v4-flash", format="v4-paper")
    assert window_write_bytes(model1, TOKENS_32K, WindowStrategy.DROP) == 0
    assert window_write_bytes(model1, TOKENS_32K, WindowStrategy.SNAPSHOT) == 43 * 128 * 584
    assert window_write_bytes(model1, TOKENS_32K, WindowStrategy.SNAPSHOT) == 3_214_336
    assert window_write_bytes(model1, TOKENS_32K, WindowStrategy.FULL) == 822_870_016
    assert window_write_bytes(paper, TOKENS_32K, WindowStrategy.SNAPSHOT) == 3_170_304
    assert window_write_bytes(paper, TOKENS_32K, WindowStrategy.FULL) == 811_597_824
    assert window_write_bytes(model1, 100, WindowStrategy.SNAPSHOT, checkpoints=3) == (
        3 * 43 * 100 * 584
    )


def test_strategies_write_what_they_promise() -> None:
    async def body() -> None:
        for strategy in WindowStrategy:
            tier = HostMemoryTier(1 << 16, 4096, hasher=HASH)
            p = WindowPersister(tier, strategy, HASH)
            keys = [await p.on_produced(bytes([i]) * 100) for i in range(3)]
            snap = await p.on_checkpoint(b"w" * 300)
            kept = [k for k in keys if k is not None]
            if strategy is WindowStrategy.FULL:
                assert p.bytes_written == 300 and snap is None
                assert await p.restore(kept) == b"\0" * 100 + b"\1" * 100 + b"\2" * 100
            elif strategy is WindowStrategy.SNAPSHOT:
                assert p.bytes_written == 300 and not kept and snap is not None
                assert await p.restore([snap]) == b"w" * 300
            else:
                assert p.bytes_written == 0 and len(tier) == 0 and snap is None
                assert await p.restore([]) is None

    run(body())
