"""The dedup index: sealed pages by (namespace, content hash), with tenant namespaces as ids.

Scoped by namespace on purpose: two tenants never share a page, even with equal bytes, so a
hash collision (accidental or crafted) cannot cross tenants. A bucket holds every sealed page
of a namespace with one hash value (a record, or a list once pages collide); the pool compares
bytes against each before sharing.
"""

from __future__ import annotations

from collections.abc import Sequence

from tessera_ray.core._records import PageRecord
from tessera_ray.core.hashing import content_seed
from tessera_ray.errors import PoolConfigError

__all__ = ["DedupIndex"]

_Bucket = PageRecord | list[PageRecord]


class DedupIndex:
    __slots__ = ("buckets", "fingerprint", "ids", "names", "seeds")

    def __init__(self, fingerprint: str) -> None:
        self.fingerprint = fingerprint
        self.ids: dict[str, int] = {}
        self.names: list[str] = []
        self.seeds: list[int] = []
        """Content-hash seed of each namespace (keyed by namespace and layout fingerprint)."""
        self.buckets: list[dict[int, _Bucket]] = []

    def namespace(self, name: str) -> int:
        """The id of namespace ``name``, registering it on first use."""
        ns = self.ids.get(name)
        if ns is None:
            if not isinstance(name, str) or not name:
                raise PoolConfigError(f"namespace must be a non-empty str, got {name!r}")
            ns = len(self.names)
            self.ids[name] = ns
            self.names.append(name)
            self.seeds.append(content_seed(name, self.fingerprint))
            self.buckets.append({})
        return ns

    def known(self, name: str) -> int:
        """The id of ``name``, or -1 when nothing was ever sealed under it."""
        return self.ids.get(name, -1)

    def candidates(self, ns: int, digest: int) -> Sequence[PageRecord]:
        bucket = self.buckets[ns].get(digest)
        if bucket is None:
            return ()
        return bucket if isinstance(bucket, list) else (bucket,)

    def insert(self, ns: int, digest: int, rec: PageRecord) -> None:
        index = self.buckets[ns]
        bucket = index.get(digest)
        if bucket is None:
            index[digest] = rec
        elif isinstance(bucket, list):
            bucket.append(rec)
        else:
            index[digest] = [bucket, rec]

    def remove(self, rec: PageRecord) -> None:
        index = self.buckets[rec.namespace]
        bucket = index[rec.digest]
        if isinstance(bucket, list):
            bucket.remove(rec)
            if len(bucket) == 1:
                index[rec.digest] = bucket[0]
        else:
            assert bucket is rec
            del index[rec.digest]
