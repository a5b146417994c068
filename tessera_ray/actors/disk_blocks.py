"""Whole token blocks on a pool's disk tier, per tenant namespace, surviving restarts.

A pool spills the last in-memory copy of a block here instead of dropping it. Each namespace
gets its own :class:`~tessera_ray.storage.DiskTier` root (the tier keys content hashes by
namespace and layout) holding block payloads under their content hash, plus a small manifest
tier mapping the token key to the payload's key, so a restarted pool knows again which token
keys it can serve from disk.

Manifest records are keyed by the first 16 bytes of the token key (a sha256 output), and the
manifest tier's "content hash" is exactly that prefix of the payload: the tier's usual checks
(key equals hash of what was read, checksum over header and payload) then prove that the record
read back is the one written for that key. The full 32-byte key inside is compared on read, so
even a prefix collision is a miss, never a wrong block.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tessera_ray.core.hostmem import aligned_host_bytes
from tessera_ray.core.results import BlockHash, TokenKey
from tessera_ray.storage import DiskTier
from tessera_ray.storage.keys import content_hasher, payload_view

__all__ = ["DiskBlocks", "DiskBlock"]

_DIR_RE = re.compile(r"ns-[0-9a-f]{32}")
_MANIFEST_BYTES = 32 + 16 + 16


@dataclass(frozen=True, slots=True)
class DiskBlock:
    namespace: str
    token_key: TokenKey
    block_hash: BlockHash


def _prefix_key(data: memoryview) -> bytes:
    return bytes(data[:16])


class _Namespace:
    def __init__(self, root: Path, namespace: str, fingerprint: str, capacity_bytes: int) -> None:
        root.mkdir(parents=True, exist_ok=True)
        marker = root / "namespace"
        if not marker.exists():
            marker.write_text(namespace, encoding="utf-8")
        self.namespace = namespace
        self.hash = content_hasher(namespace, fingerprint)
        self.data = DiskTier(
            root / "blocks",
            capacity_bytes,
            fingerprint=fingerprint,
            namespace=namespace,
            io_threads=2,
        )
        # Manifests are tiny; give them a small fixed budget beside the data.
        self.manifests = DiskTier(
            root / "manifests",
            max(1 << 20, capacity_bytes // 256),
            fingerprint=fingerprint,
            namespace=namespace,
            hasher=_prefix_key,
            io_threads=1,
        )

    async def close(self) -> None:
        await self.data.close()
        await self.manifests.close()


class DiskBlocks:
    """Block payloads and manifests under ``root/ns-<sha256(namespace)>/``."""

    def __init__(
        self,
        root: Path,
        *,
        fingerprint: str,
        capacity_bytes: int,
        block_bytes: int | None = None,
    ) -> None:
        self.root = Path(root)
        self.fingerprint = fingerprint
        self.capacity_bytes = capacity_bytes
        self.block_bytes = block_bytes
        """Payload size of every block; when known, ``get`` reads payloads straight into one
        aligned buffer (no staging copy, no ``bytes`` per block)."""
        self._spaces: dict[str, _Namespace] = {}
        self.held: dict[tuple[str, bytes], BlockHash] = {}
        """Every block written here (or found by ``reopen``) and not since found missing or
        corrupt: what the pool may promise without a disk read."""

    def _space(self, namespace: str) -> _Namespace:
        space = self._spaces.get(namespace)
        if space is None:
            # Directory names derive from a hash of the namespace, never from the name itself,
            # so no tenant string can reach a path.
            name = "ns-" + hashlib.sha256(namespace.encode()).hexdigest()[:32]
            space = _Namespace(self.root / name, namespace, self.fingerprint, self.capacity_bytes)
            self._spaces[namespace] = space
        return space

    async def reopen(self) -> list[DiskBlock]:
        """Open every namespace found under the root; returns the blocks their manifests name."""
        found: list[DiskBlock] = []
        if not self.root.exists():
            return found
        for path in sorted(self.root.iterdir()):
            marker = path / "namespace"
            if not _DIR_RE.fullmatch(path.name) or not marker.is_file():
                continue
            namespace = marker.read_text(encoding="utf-8")
            if "ns-" + hashlib.sha256(namespace.encode()).hexdigest()[:32] != path.name:
                continue  # a marker that does not match its directory is not trusted
            space = self._space(namespace)
            keys = [k async for k in space.manifests.keys()]
            for raw in await space.manifests.get_many(keys):
                if raw is not None and len(raw) == _MANIFEST_BYTES:
                    found.append(
                        DiskBlock(
                            namespace,
                            TokenKey(raw[:32]),
                            BlockHash(int.from_bytes(raw[32:48], "big")),
                        )
                    )
        self.held.update(((b.namespace, b.token_key), b.block_hash) for b in found)
        return found

    async def put(
        self, namespace: str, blocks: Sequence[tuple[TokenKey, BlockHash, bytes | memoryview]]
    ) -> None:
        """Write blocks (payload and manifest) in one batch per tier."""
        if not blocks:
            return
        space = self._space(namespace)
        data, manifests = [], []
        for key, bh, payload in blocks:
            view = payload_view(payload)
            data_key = space.hash(view)
            data.append((data_key, view))
            manifests.append((key[:16], key + int(bh).to_bytes(16, "big") + data_key))
        await space.data.put_many(data, prehashed=True)  # keyed by space.hash just above
        await space.manifests.put_many(manifests)
        self.held.update(((namespace, key), bh) for key, bh, _ in blocks)

    async def get(
        self, namespace: str, token_keys: Sequence[TokenKey]
    ) -> list[tuple[BlockHash, bytes | memoryview] | None]:
        """Verified payloads for ``token_keys`` (``None``: not on disk, or failed its checks);
        with ``block_bytes`` set they are views of one page-aligned buffer, read there
        directly."""
        space = self._spaces.get(namespace)
        if space is None:
            for key in token_keys:
                self.held.pop((namespace, key), None)
            return [None] * len(token_keys)
        raws = await space.manifests.get_many([k[:16] for k in token_keys])
        wanted: list[bytes] = []
        where: list[int] = []
        hashes: dict[int, BlockHash] = {}
        for i, (key, raw) in enumerate(zip(token_keys, raws, strict=True)):
            if raw is None or len(raw) != _MANIFEST_BYTES or raw[:32] != key:
                continue
            hashes[i] = BlockHash(int.from_bytes(raw[32:48], "big"))
            wanted.append(raw[48:64])
            where.append(i)
        out: list[tuple[BlockHash, bytes | memoryview] | None] = [None] * len(token_keys)
        for i, payload in zip(where, await self._payloads(space, wanted), strict=True):
            if payload is not None:
                out[i] = (hashes[i], payload)
        for key, got in zip(token_keys, out, strict=True):
            if got is None:
                self.held.pop((namespace, key), None)
        return out

    async def _payloads(
        self, space: _Namespace, keys: list[bytes]
    ) -> list[bytes | memoryview | None]:
        size = self.block_bytes
        if not keys or size is None:
            return list(await space.data.get_many(keys))
        scratch = aligned_host_bytes(len(keys) * size)
        outs = [scratch[i * size : (i + 1) * size] for i in range(len(keys))]
        try:
            got = await space.data.get_many_into(keys, outs)
        except ValueError:  # a stored payload larger than a block: read it as it is
            return list(await space.data.get_many(keys))
        return [o if n == size else None for o, n in zip(outs, got, strict=True)]

    async def discard(self, namespace: str, token_keys: Sequence[TokenKey]) -> None:
        for key in token_keys:
            self.held.pop((namespace, key), None)
        space = self._spaces.get(namespace)
        if space is not None:
            await space.manifests.delete_many([k[:16] for k in token_keys])

    def stats(self) -> tuple[int, int]:
        """(blocks, bytes) on disk over all namespaces."""
        blocks = sum(len(s.manifests) for s in self._spaces.values())
        used = sum(s.data.used_bytes + s.manifests.used_bytes for s in self._spaces.values())
        return blocks, used

    def quarantined(self) -> int:
        """Records that failed verification and were quarantined, over all namespaces."""
        return sum(
            s.data.stats.corrupt_total + s.manifests.stats.corrupt_total
            for s in self._spaces.values()
        )

    async def close(self) -> None:
        for space in self._spaces.values():
            await space.close()
        self._spaces.clear()
        self.held.clear()
