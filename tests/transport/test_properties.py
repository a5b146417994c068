"""Hypothesis against a plain model: whatever pages are exported and whichever expected hashes
are wrong, a verified fetch installs exactly the pages whose bytes match, with the owner's
bytes, and every reserved slot ends sealed or free (LocalTransport keeps it fast)."""

from __future__ import annotations

import functools

from hypothesis import given, settings
from hypothesis import strategies as st

from tessera_ray.transport import FailureReason, PageExport, fetch_verified

from ._node import Node
from .conformance import unique


@functools.cache
def _owner() -> tuple[Node, PageExport, list[bytes]]:
    """One owner with 24 pinned pages for every example (made on first use, not at import)."""
    owner = Node("local", unique("prop-owner"), num_pages=64)
    _, export, data = owner.put(24)
    return owner, export, data


@settings(max_examples=60, deadline=None)
@given(
    picks=st.lists(st.integers(0, 23), min_size=0, max_size=12, unique=True),
    bad=st.sets(st.integers(0, 11)),
    reserve_first=st.booleans(),
)
def test_fetch_installs_exactly_the_matching_pages(
    picks: list[int], bad: set[int], reserve_first: bool
) -> None:
    owner, export0, data0 = _owner()
    reader = Node("local", unique("prop-reader"), num_pages=16)
    reader.add_peers([owner.peer_info()])
    hashes = [export0.content_hashes[p] ^ (1 if i in bad else 0) for i, p in enumerate(picks)]
    export = PageExport(
        peer=export0.peer,
        namespace=export0.namespace,
        fingerprint=export0.fingerprint,
        page_bytes=export0.page_bytes,
        slots=tuple(export0.slots[p] for p in picks),
        content_hashes=tuple(hashes),
    )
    local = reader.pool.allocate_many(len(picks)) if reserve_first else None
    res = fetch_verified(reader.transport, export, local=local, timeout_s=5)

    want_ok = [i for i in range(len(picks)) if i not in bad]
    assert [f.position for f in res.fetched] == want_ok
    assert [f.position for f in res.failed] == [i for i in range(len(picks)) if i in bad]
    assert all(f.reason is FailureReason.HASH_MISMATCH for f in res.failed)
    got = reader.read_pages([f.handle for f in res.fetched])
    assert got == [data0[picks[i]] for i in want_ok]
    s = reader.stats()
    assert s.pages_sealed == len(want_ok) and s.pages_free == 16 - len(want_ok)
    reader.check()
    reader.close()
