"""A pool's block store on disk: restores read payloads straight into one aligned buffer, and
anything that fails its checks is a miss, never a wrong block."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from tessera_ray.actors.disk_blocks import DiskBlocks
from tessera_ray.core import BlockHash, TokenKey, token_key
from tessera_ray.core.hostmem import buffer_address

FP = "disk-blocks-test"
NS = "tenant"
BLOCK = 4 * 4096  # whole 512 B blocks: aligned records


def _blocks(n: int, size: int = BLOCK) -> list[tuple[TokenKey, BlockHash, bytes]]:
    out = []
    for i in range(n):
        key = token_key(NS, FP, None, [i, i + 1])
        out.append((key, BlockHash(1000 + i), os.urandom(size)))
    return out


def test_restore_reads_into_one_aligned_buffer(tmp_path: Path) -> None:
    blocks = _blocks(3)

    async def body() -> None:
        store = DiskBlocks(tmp_path, fingerprint=FP, capacity_bytes=1 << 26, block_bytes=BLOCK)
        await store.put(NS, blocks)
        got = await store.get(NS, [k for k, _, _ in blocks] + [token_key(NS, FP, None, [9])])
        assert got[3] is None
        for (_, bh, data), found in zip(blocks, got[:3], strict=True):
            assert found is not None
            assert found[0] == bh and bytes(found[1]) == data
            assert isinstance(found[1], memoryview) and buffer_address(found[1]) % 4096 == 0
        await store.close()

    asyncio.run(body())


def test_corrupt_or_oversized_payloads_are_misses_or_read_as_stored(tmp_path: Path) -> None:
    blocks = _blocks(3)

    async def body() -> None:
        store = DiskBlocks(tmp_path, fingerprint=FP, capacity_bytes=1 << 26, block_bytes=BLOCK)
        await store.put(NS, blocks)
        seg = next((tmp_path).glob("ns-*/blocks/segments/*.seg"))
        with open(seg, "r+b") as f:  # a payload byte of the second block
            f.seek(2 * 512 + BLOCK + 100)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0x40]))
        got = await store.get(NS, [k for k, _, _ in blocks])
        assert got[1] is None
        assert [bytes(g[1]) for g in (got[0], got[2]) if g is not None] == [
            blocks[0][2],
            blocks[2][2],
        ]
        await store.close()
        # A store told a smaller block size than was written reads the payloads whole.
        small = DiskBlocks(tmp_path, fingerprint=FP, capacity_bytes=1 << 26, block_bytes=512)
        await small.reopen()
        again = await small.get(NS, [blocks[0][0], blocks[2][0]])
        assert [bytes(g[1]) for g in again if g is not None] == [blocks[0][2], blocks[2][2]]
        await small.close()

    asyncio.run(body())
