"""One conformance class every tier passes; subclasses supply ``make_tier``.

Tests build tiers of room for at least 8 pages of 256 B (plus overhead) unless they say so.
"""

from __future__ import annotations

import pytest

from tessera_ray.errors import InvalidKeyError, PageNotFoundError
from tessera_ray.storage import StorageTier

from .conftest import page, run


class TierConformance:
    def make_tier(self, capacity_pages: int = 64) -> StorageTier:
        raise NotImplementedError

    def test_put_get_roundtrip(self) -> None:
        async def body() -> None:
            async with self.make_tier() as tier:
                items = [page(i) for i in range(5)]
                await tier.put_many(items)
                assert await tier.get_many([k for k, _ in items]) == [d for _, d in items]
                assert len(tier) == 5
                assert await tier.contains_many([k for k, _ in items]) == [True] * 5

        run(body())

    def test_hex_and_bytes_keys_agree(self) -> None:
        async def body() -> None:
            async with self.make_tier() as tier:
                k, d = page(1)
                await tier.put(k.hex(), d)
                assert await tier.get(k) == d
                assert await tier.contains(k.hex())

        run(body())

    def test_missing_is_none_in_batches_and_raises_single(self) -> None:
        async def body() -> None:
            async with self.make_tier() as tier:
                k, d = page(1)
                k2, _ = page(2)
                await tier.put(k, d)
                assert await tier.get_many([k2, k]) == [None, d]
                with pytest.raises(PageNotFoundError):
                    await tier.get(k2)
                with pytest.raises(KeyError):  # stdlib type callers expect
                    await tier.get(k2)

        run(body())

    def test_get_into_fills_caller_buffer(self) -> None:
        async def body() -> None:
            async with self.make_tier() as tier:
                items = [page(i) for i in range(3)]
                await tier.put_many(items)
                bufs = [bytearray(300) for _ in items]
                sizes = await tier.get_many_into([k for k, _ in items], bufs)
                assert sizes == [256, 256, 256]
                for (_, d), b in zip(items, bufs, strict=True):
                    assert bytes(b[:256]) == d
                missing, _ = page(99)
                assert await tier.get_many_into([missing], [bytearray(256)]) == [None]

        run(body())

    def test_tensor_payload_and_tensor_output(self) -> None:
        torch = pytest.importorskip("torch")

        async def body() -> None:
            async with self.make_tier() as tier:
                k, d = page(4)
                t = torch.frombuffer(bytearray(d), dtype=torch.uint8)
                await tier.put(k, t)
                out = torch.zeros(256, dtype=torch.uint8)
                assert await tier.get_into(k, out) == 256
                assert out.numpy().tobytes() == d

        run(body())

    def test_delete(self) -> None:
        async def body() -> None:
            async with self.make_tier() as tier:
                items = [page(i) for i in range(4)]
                await tier.put_many(items)
                assert await tier.delete_many([items[1][0], page(50)[0]]) == [True, False]
                assert not await tier.contains(items[1][0])
                assert await tier.get_many([k for k, _ in items]) == [
                    items[0][1],
                    None,
                    items[2][1],
                    items[3][1],
                ]
                assert not await tier.delete(items[1][0])

        run(body())

    def test_keys_iteration(self) -> None:
        async def body() -> None:
            async with self.make_tier() as tier:
                items = [page(i) for i in range(6)]
                await tier.put_many(items)
                got = [k async for k in tier.keys()]
                assert sorted(got) == sorted(k for k, _ in items)

        run(body())

    def test_duplicate_put_keeps_one_copy(self) -> None:
        async def body() -> None:
            async with self.make_tier() as tier:
                k, d = page(3)
                await tier.put_many([(k, d), (k, d)])
                await tier.put(k, d)
                assert len(tier) == 1
                assert await tier.get(k) == d

        run(body())

    @pytest.mark.parametrize("bad", ["../../etc/passwd", "ABCDEF" * 6, "a" * 31, b"short", 7])
    def test_invalid_keys_rejected(self, bad: object) -> None:
        async def body() -> None:
            async with self.make_tier() as tier:
                with pytest.raises(InvalidKeyError):
                    await tier.put(bad, b"x" * 256)  # type: ignore[arg-type]
                with pytest.raises(ValueError):
                    await tier.get(bad)  # type: ignore[arg-type]
                assert len(tier) == 0

        run(body())

    def test_lru_eviction_within_capacity(self) -> None:
        async def body() -> None:
            async with self.make_tier(capacity_pages=3) as tier:
                a, b, c, d = (page(i) for i in range(4))
                for item in (a, b, c):
                    await tier.put(*item)
                await tier.get(a[0])  # a is now more recent than b
                await tier.put(*d)
                assert await tier.contains_many([a[0], b[0], c[0], d[0]]) == [
                    True,
                    False,
                    True,
                    True,
                ]
                assert len(tier) == 3

        run(body())
