"""How the vLLM connector names blocks in the tier: token keys from tokens, block hashes from
bytes (no vLLM or Ray import, so a router can compute a prompt's keys too).

Token keys follow vLLM's block hashing inputs: each block's key chains the parent block's key
and the block's token ids, and carries vLLM's extra keys of the block (LoRA adapter, multimodal
inputs, prompt embeddings, the ``cache_salt``), the model's name and the tier layout's
fingerprint. The ``cache_salt`` also picks the tenant namespace, so a request of another salt
is a miss at the directory even for equal tokens.

:func:`payload_block_hash` recomputes a block's hash from its bytes exactly as the pool sealed
it, so the connector verifies what it read against what the lookup promised before any byte
reaches vLLM's cache.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tessera_ray.core import block_hash, content_seed, token_key, xxh3_128
from tessera_ray.core.results import BlockHash, ContentHash, TokenKey
from tessera_ray.layout import ModelLayout

__all__ = [
    "ExtraKeysFn",
    "no_extra_keys",
    "key_fingerprint",
    "tenant_namespace",
    "prompt_keys",
    "payload_block_hash",
]

ExtraKeysFn = Callable[[Any, int, int, int], tuple[Any, int]]
"""``(request, start token, end token, multimodal index) -> (extra keys or None, next index)``:
vLLM's per-block extra hash inputs (``generate_block_hash_extra_keys``)."""


def no_extra_keys(request: Any, start: int, end: int, mm_index: int) -> tuple[Any, int]:
    """An :data:`ExtraKeysFn` for plain-text requests: no block has extra keys."""
    return None, mm_index


def key_fingerprint(layout_fingerprint: str, model_name: str, extra: Any = None) -> str:
    """What a token key covers besides the block's tokens: the page layout, the model, and
    vLLM's extra keys of the block (LoRA, multimodal inputs; ``None`` for plain text)."""
    # JSON of a list keeps the parts apart (no separator a model name could contain); vLLM's
    # extra keys are tuples of str, int and bytes, whose repr is stable.
    return json.dumps([layout_fingerprint, model_name, repr(extra) if extra else None])


def prompt_keys(
    layout_fingerprint: str,
    model_name: str,
    token_ids: Sequence[int],
    block_tokens: int,
    cache_salt: str | None = None,
    base_namespace: str = "vllm",
) -> list[TokenKey]:
    """The chained keys of the full tier blocks of a plain-text prompt, as the connector's
    scheduler computes them (for a router that looks a prompt up before any engine sees it):
    under the request's tenant namespace, and with vLLM's extra hash key of a salted request
    on its first block (``("cache_salt", salt)``, what ``generate_block_hash_extra_keys``
    gives a block that starts at position 0)."""
    namespace = tenant_namespace(base_namespace, cache_salt)
    plain = key_fingerprint(layout_fingerprint, model_name)
    keys: list[TokenKey] = []
    parent: TokenKey | None = None
    for start in range(0, len(token_ids) - block_tokens + 1, block_tokens):
        extra = (("cache_salt", cache_salt),) if start == 0 and cache_salt else None
        fingerprint = key_fingerprint(layout_fingerprint, model_name, extra) if extra else plain
        block = list(token_ids[start : start + block_tokens])
        parent = token_key(namespace, fingerprint, parent, block)
        keys.append(parent)
    return keys


def tenant_namespace(base: str, cache_salt: str | None) -> str:
    """The tier namespace of a request: ``base``, or a per-salt namespace under it. The salt is
    hashed so it never appears in the tier's state or metrics."""
    if not cache_salt:
        return base
    return f"{base}/salt-{hashlib.sha256(cache_salt.encode()).hexdigest()[:32]}"


def payload_block_hash(layout: ModelLayout, namespace: str, row: np.ndarray) -> BlockHash:
    """The block hash a pool gives ``row`` (one block's payload) when it seals it under
    ``namespace``: per layer group, the digest of its pages' seeded content hashes; across
    groups, the digest of the group digests (as :class:`PoolService` combines them)."""
    seed = content_seed(namespace, layout.fingerprint)
    data = np.ascontiguousarray(row, dtype=np.uint8).reshape(-1).data
    group_hashes: list[ContentHash] = []
    offset = 0
    for group in layout.groups:
        pb = group.page.page_bytes
        pages = [
            ContentHash(xxh3_128(data[offset + i * pb : offset + (i + 1) * pb], seed))
            for i in range(len(group.layers))
        ]
        offset += group.block_bytes
        group_hashes.append(ContentHash(block_hash(pages, seed)))
    if len(group_hashes) == 1:
        return BlockHash(group_hashes[0])
    return block_hash(group_hashes, seed)
