"""Content hashes, token keys and block digests.

Two different jobs, two different hashes:

- A **content hash** finds candidate pages with equal bytes. It only needs to be fast and
  well-spread (xxh3-128, ~30 GB/s), because a match is never trusted: the pool compares the
  bytes before sharing. It is keyed (seeded) by tenant namespace and layout fingerprint, so the
  same bytes hash differently per tenant and layout. The function is injectable: tests pass a
  truncated hash to force collisions.
- A **token key** is what clients ask for, and clients choose the tokens, so an adversary could
  craft two prefixes whose keys collide and have one stand for the other. A fast
  non-cryptographic hash is not enough here; vLLM moved its prefix-cache keys to sha256 after
  CVE-2025-25183 for this reason. Token keys use sha256.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Callable, Sequence
from typing import Any

import xxhash

from tessera_ray.core.results import BlockHash, ContentHash, TokenKey

__all__ = [
    "ContentHashFn",
    "xxh3_128",
    "content_seed",
    "token_key",
    "block_hash",
    "TOKEN_KEY_BYTES",
]

ContentHashFn = Callable[[memoryview, int], int]
"""``(page bytes, 64-bit seed) -> hash``; must be deterministic across processes."""

TOKEN_KEY_BYTES = 32
_ROOT_PARENT = bytes(TOKEN_KEY_BYTES)
_MAX_TOKEN_ID = 2**63
_PARENT_FRAME = struct.pack("<Q", TOKEN_KEY_BYTES)


def xxh3_128(data: memoryview, seed: int) -> int:
    """The default content hash: seeded xxh3-128, read straight from the page buffer."""
    return xxhash.xxh3_128_intdigest(data, seed)


def _framed(*parts: bytes) -> bytes:
    # Length-prefix every field so ("ab", "c") and ("a", "bc") never encode the same.
    return b"".join(struct.pack("<Q", len(p)) + p for p in parts)


def content_seed(namespace: str, fingerprint: str) -> int:
    """The 64-bit seed that keys content hashes by (tenant namespace, layout fingerprint)."""
    digest = hashlib.blake2b(
        _framed(b"tessera-content/1", namespace.encode(), fingerprint.encode()), digest_size=8
    ).digest()
    return int.from_bytes(digest, "little")


def token_key(
    namespace: str, fingerprint: str, parent: TokenKey | None, token_ids: Sequence[int]
) -> TokenKey:
    """Chained key of one token block: sha256 over namespace, fingerprint, parent, token ids.

    ``parent`` is the previous block's key (``None`` for the first block), so a key names the
    whole prefix, not just this block's tokens.
    """
    if parent is not None and len(parent) != TOKEN_KEY_BYTES:
        raise ValueError(f"parent token key must be {TOKEN_KEY_BYTES} bytes, got {len(parent)}")
    # min and max run in C; only a block that fails them is walked, to name its first bad id.
    if token_ids and (min(token_ids) < 0 or max(token_ids) >= _MAX_TOKEN_ID):
        bad = next(t for t in token_ids if not 0 <= t < _MAX_TOKEN_ID)
        raise ValueError(f"token id {bad} out of range [0, 2**63)")
    # The bytes of sha256(_framed(tag, namespace, fingerprint, parent, ids)), with the first
    # three fields hashed once per (namespace, fingerprint) and that state copied: a lookup
    # keys every block of a prompt, and those fields are the same for all of them.
    h = _key_head(namespace, fingerprint).copy()
    h.update(_PARENT_FRAME + (parent if parent is not None else _ROOT_PARENT))
    h.update(struct.pack(f"<Q{len(token_ids)}Q", 8 * len(token_ids), *token_ids))
    return TokenKey(h.digest())


@functools.lru_cache(maxsize=64)
def _key_head(namespace: str, fingerprint: str) -> Any:
    """A sha256 fed the framed tag, namespace and fingerprint; only ever copied, never fed."""
    return hashlib.sha256(_framed(b"tessera-token/1", namespace.encode(), fingerprint.encode()))


def block_hash(page_hashes: Sequence[ContentHash], seed: int) -> BlockHash:
    """Digest of a block's page content hashes in layer order (xxh3-128, same seed)."""
    blob = b"".join(h.to_bytes(16, "little") for h in page_hashes)
    return BlockHash(xxhash.xxh3_128_intdigest(blob, seed))
