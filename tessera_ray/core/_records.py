"""The pool's hot metadata: one slotted record per page, and the intrusive list they live on.

Kept deliberately small (see ``benchmarks/bench_pool.py``, ``metadata_bytes_per_page``): a page
is one slotted object whose fields are small ints or references to objects that already exist.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["FREE", "WRITABLE", "SEALED", "PageRecord", "BlockRecord", "PageList"]

FREE = 0
"""On the free list; bytes scrubbed; no handle to it resolves."""
WRITABLE = 1
"""Allocated and not yet sealed: private to one holder (refcount 1), writable in place."""
SEALED = 2
"""Immutable, in the dedup index; shared by refcount; evictable when the refcount is 0."""


@dataclass(slots=True, eq=False)
class PageRecord:
    """Bookkeeping of one page slot. ``prev``/``next`` link it into exactly one of the pool's
    intrusive lists (free pages on the free list, unreferenced sealed pages on the LRU) or into
    none (referenced pages); a page is never on both, so one pair of links serves both lists.

    One record, several owners, each writing only its own fields (a record per part would cost
    the per-page bytes this layout saves): the page table (``core/_pages.py``) writes the life
    of the page (``generation``, ``refcount``, ``state``, ``namespace``, ``digest``) and, through
    its lists, ``prev``/``next``; the block index (``core/_blocks.py``) writes ``blocks``. The
    dedup index only reads ``namespace`` and ``digest``, which the table sets as it seals.
    """

    index: int
    generation: int = 0
    refcount: int = 0
    state: int = FREE
    namespace: int = -1
    """Namespace id of a sealed page (index into the pool's namespace table); -1 otherwise."""
    digest: int = 0
    """Content hash of a sealed page."""
    prev: PageRecord | None = None
    next: PageRecord | None = None
    blocks: BlockRecord | list[BlockRecord] | None = None
    """Registered blocks this sealed page belongs to (dropped when the page is evicted): one
    record directly in the common case, a list only when several blocks share the page; a
    one-element list per page would cost ~70 B of the ~300 B budget."""


@dataclass(slots=True, eq=False)
class BlockRecord:
    """A registered token block: its layer pages (identity, not just hashes) and token keys."""

    namespace: int
    block_hash: int
    pages: tuple[PageRecord, ...]
    token_keys: list[bytes]


class PageList:
    """Intrusive doubly linked list of :class:`PageRecord` with a sentinel.

    Why intrusive: the links live in the records, so moving a page between lists allocates
    nothing, and removing a page from the middle (a freed LRU page taken back by a lookup, a
    dedup hit on an evictable page) is O(1) given the record, where ``collections.deque`` would
    need an O(n) search. The sentinel makes the empty list and both ends ordinary cases.
    """

    __slots__ = ("_head", "size")

    def __init__(self) -> None:
        self._head = PageRecord(index=-1)
        self._head.prev = self._head.next = self._head
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def push_back(self, rec: PageRecord) -> None:
        assert rec.prev is None and rec.next is None, "page already on a list"
        tail = self._head.prev
        assert tail is not None
        rec.prev, rec.next = tail, self._head
        tail.next = rec
        self._head.prev = rec
        self.size += 1

    def remove(self, rec: PageRecord) -> None:
        prev, nxt = rec.prev, rec.next
        assert prev is not None and nxt is not None, "page not on a list"
        prev.next, nxt.prev = nxt, prev
        rec.prev = rec.next = None
        self.size -= 1

    def pop_front(self) -> PageRecord | None:
        first = self._head.next
        if first is self._head or first is None:
            return None
        self.remove(first)
        return first

    def __iter__(self) -> Iterator[PageRecord]:
        node = self._head.next
        while node is not None and node is not self._head:
            yield node
            node = node.next
