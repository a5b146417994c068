"""Token keys (sha256, chained) and keyed content hashes."""

from __future__ import annotations

import hashlib

import pytest

from tessera_ray.core import block_hash, content_seed, token_key, xxh3_128
from tessera_ray.core.results import ContentHash


def test_token_key_is_chained_and_scoped() -> None:
    root = token_key("t", "fp", None, [1, 2, 3])
    assert len(root) == 32
    assert root == token_key("t", "fp", None, [1, 2, 3])  # deterministic
    child = token_key("t", "fp", root, [4])
    assert child != token_key("t", "fp", None, [4])  # the parent is part of the key
    other = token_key("t", "fp", token_key("t", "fp", None, [1, 2, 9]), [4])
    assert child != other  # same block tokens, different prefix
    assert token_key("u", "fp", None, [1, 2, 3]) != root  # tenant
    assert token_key("t", "fp2", None, [1, 2, 3]) != root  # layout
    # Length framing: ("ab", "c") and ("a", "bc") differ.
    assert token_key("ab", "c", None, [1]) != token_key("a", "bc", None, [1])
    # Token ids are fixed-width: [1, 2] and [258] never encode alike.
    assert token_key("t", "fp", None, [1, 2]) != token_key("t", "fp", None, [258])


def test_token_key_is_sha256_of_a_framed_encoding() -> None:
    # Pin the algorithm: a cryptographic hash, since clients choose the tokens.
    import struct

    def framed(*parts: bytes) -> bytes:
        return b"".join(struct.pack("<Q", len(p)) + p for p in parts)

    blob = framed(b"tessera-token/1", b"t", b"fp", bytes(32), struct.pack("<2Q", 7, 8))
    assert token_key("t", "fp", None, [7, 8]) == hashlib.sha256(blob).digest()
    # The same encoding along a chain of blocks, under several namespaces in turn (the key's
    # head is hashed once per namespace and layout and reused): every key, parents and all.
    parents: dict[str, bytes | None] = {"t": None, "u": None}
    for block in range(6):
        for ns in ("t", "u"):
            ids = [block * 1000 + i for i in range(block)] + [2**63 - 1]
            parent = parents[ns]
            want = hashlib.sha256(
                framed(
                    b"tessera-token/1",
                    ns.encode(),
                    b"fp",
                    parent if parent is not None else bytes(32),
                    struct.pack(f"<{len(ids)}Q", *ids),
                )
            ).digest()
            got = token_key(ns, "fp", parent, ids)  # type: ignore[arg-type]
            assert got == want, (ns, block)
            parents[ns] = got


def test_token_key_validates_input() -> None:
    with pytest.raises(ValueError, match="token id -1 out of range"):
        token_key("t", "fp", None, [-1])
    with pytest.raises(ValueError, match=f"token id {2**63} out of range"):
        token_key("t", "fp", None, [5, 2**63, -3])  # the first bad id is named
    with pytest.raises(ValueError):
        token_key("t", "fp", b"short", [1])  # type: ignore[arg-type]


def test_content_hash_keyed_by_namespace_and_layout() -> None:
    data = memoryview(bytes(range(64)))
    a = xxh3_128(data, content_seed("t", "fp"))
    assert a == xxh3_128(data, content_seed("t", "fp"))
    assert a != xxh3_128(data, content_seed("u", "fp"))
    assert a != xxh3_128(data, content_seed("t", "fp2"))
    assert 0 <= a < 2**128


def test_block_hash_depends_on_layer_order() -> None:
    h1, h2 = ContentHash(1), ContentHash(2)
    assert block_hash([h1, h2], 0) != block_hash([h2, h1], 0)
    assert block_hash([h1, h2], 0) == block_hash([h1, h2], 0)
