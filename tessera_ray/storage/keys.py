"""Page keys and payload views shared by every tier.

A page is addressed by its content hash: 16 bytes, shown as 32 lowercase hex characters. Keys
become file names in the disk tier, so this module is the one gate that refuses anything else
(``../etc``, upper case, short strings) before it can reach a path.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import xxhash

from tessera_ray.core.hashing import content_seed
from tessera_ray.errors import InvalidKeyError

__all__ = [
    "KEY_BYTES",
    "ContentHasher",
    "Payload",
    "content_hasher",
    "normalize_key",
    "key_hex",
    "is_key_hex",
    "payload_view",
    "writable_view",
]

KEY_BYTES = 16
_HEX_RE = re.compile(r"[0-9a-f]{32}")

ContentHasher = Callable[[memoryview], bytes]
"""``page bytes -> 16-byte digest``; deterministic across processes. Injectable so tests can
force collisions or count calls."""

Payload = Any
"""bytes, bytearray, memoryview, or a contiguous uint8 numpy array / CPU torch tensor."""


def content_hasher(namespace: str, fingerprint: str) -> ContentHasher:
    """The default content hash: xxh3-128 keyed by (tenant namespace, layout fingerprint).

    Seeded exactly as the pool seeds its content hashes, so a page spilled from a pool keeps its
    key: the digest is the pool's ``ContentHash`` integer as 16 big-endian bytes.
    """
    seed = content_seed(namespace, fingerprint)

    def digest(data: memoryview) -> bytes:
        return xxhash.xxh3_128_digest(data, seed)

    return digest


def is_key_hex(name: str) -> bool:
    """True when ``name`` is exactly 32 lowercase hex characters."""
    return _HEX_RE.fullmatch(name) is not None


def normalize_key(key: object) -> bytes:
    """A 16-byte digest from ``key`` (16 bytes, or 32 lowercase hex chars); anything else is
    refused with :class:`InvalidKeyError` before it can name a file."""
    if type(key) is bytes and len(key) == KEY_BYTES:
        return key  # the common case, first: a batch normalizes every key it is given
    if isinstance(key, bytes | bytearray | memoryview):
        raw = bytes(key)
        if len(raw) == KEY_BYTES:
            return raw
        raise InvalidKeyError(
            f"a page key must be a {KEY_BYTES}-byte content hash, got {len(raw)} bytes"
        )
    if isinstance(key, str):
        if is_key_hex(key):
            return bytes.fromhex(key)
        shown = key if len(key) <= 40 else key[:37] + "..."
        raise InvalidKeyError(
            f"a page key must be 32 lowercase hex characters (a content hash), got {shown!r}"
        )
    raise InvalidKeyError(f"a page key must be bytes or a hex string, got {type(key).__name__}")


def key_hex(key: bytes) -> str:
    return key.hex()


def _torch_view(obj: Any) -> memoryview:
    import torch  # only reached with a tensor in hand, so torch is already imported

    if obj.device.type != "cpu":
        raise TypeError(f"payload tensors must be on the CPU, got device {obj.device}")
    if not obj.is_contiguous():
        raise TypeError("payload tensors must be contiguous")
    return memoryview(obj.reshape(-1).view(torch.uint8).numpy()).cast("B")


def payload_view(payload: Payload) -> memoryview:
    """A flat read-only byte view of ``payload`` without copying it."""
    if type(payload) is memoryview and payload.format == "B" and payload.ndim == 1:
        if payload.c_contiguous:
            return payload  # already one: a batch takes this path for every page
    if type(payload).__module__.startswith("torch"):
        return _torch_view(payload)
    view = memoryview(payload)
    if not view.c_contiguous:
        raise TypeError("payloads must be C-contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def writable_view(buffer: Payload) -> memoryview:
    """A flat writable byte view of a caller's buffer (bytearray, numpy array, CPU tensor)."""
    view = payload_view(buffer)
    if view.readonly:
        raise TypeError("the output buffer is read-only; pass a bytearray, array or tensor")
    return view
