"""A pool with a transport: the test stand-in for the lead's PoolActor (in-process or as an
actor). Owner side: ``put`` writes random pages, seals, pins (one reference each) and exports;
``unpin`` drops the pins. Reader side: ``fetch`` runs the verified fetch."""

from __future__ import annotations

import itertools
import os
from typing import Any

import torch

from tessera_ray.core import BlockPool, PageHandle, PoolConfig, PoolStats
from tessera_ray.layout import CacheSpec, DType, EntryFormat, PageSpec, Region, Scheme
from tessera_ray.transport import (
    PageExport,
    PageFetchResult,
    PeerInfo,
    Transport,
    TransportConfig,
    export_pages,
    fetch_verified,
    make_transport,
)

FINGERPRINT = "transport-test-layout"
NAMESPACE = "tenant-a"
_lease_ids = itertools.count(1)


def test_spec(page_bytes: int) -> PageSpec:
    """An MLA-shaped page of ``page_bytes``: 4 tokens of (bf16 c_kv, bf16 k_rope)."""
    values = page_bytes // 4 // 2
    entry = EntryFormat(
        name="transport-test",
        regions=(
            Region(name="c_kv", num_values=values - 2, dtype=DType.BF16),
            Region(name="k_rope", num_values=2, dtype=DType.BF16),
        ),
    )
    return PageSpec(cache=CacheSpec(scheme=Scheme.MLA, entry=entry), block_tokens=4)


def make_pool(
    num_pages: int,
    page_bytes: int,
    fingerprint: str = FINGERPRINT,
    shared_memory_dir: str | None = None,
) -> BlockPool:
    config = PoolConfig(num_pages=num_pages, shared_memory_dir=shared_memory_dir)
    return BlockPool(test_spec(page_bytes), config, fingerprint=fingerprint)


class Node:
    """``page_bytes`` may list several sizes: one pool per layer group, all on one transport.
    ``node``: the node the transport says it runs on (``ray_node``: the actor's Ray node);
    ``shared_memory_dir``: pools other processes of the node can map."""

    def __init__(
        self,
        kind: str,
        name: str,
        *,
        num_pages: int = 32,
        page_bytes: int | tuple[int, ...] = 4096,
        fingerprint: str = FINGERPRINT,
        timeout_s: float = 5.0,
        fetch_chunk_bytes: int = 4 << 20,
        hash_chunk_bytes: int = 512 << 10,
        in_actor: bool = False,
        transport_cls: type[Transport] | None = None,
        node: str | None = None,
        ray_node: bool = False,
        shared_memory_dir: str | None = None,
        same_node: str = "auto",
        nixl_agent_on_demand: bool = False,
    ) -> None:
        sizes = (page_bytes,) if isinstance(page_bytes, int) else page_bytes
        self.pools = [make_pool(num_pages, pb, fingerprint, shared_memory_dir) for pb in sizes]
        self.pool = self.pools[0]
        config = TransportConfig(
            kind=kind,  # type: ignore[arg-type]
            timeout_s=timeout_s,
            fetch_chunk_bytes=fetch_chunk_bytes,
            hash_chunk_bytes=hash_chunk_bytes,
            same_node=same_node,  # type: ignore[arg-type]
            nixl_agent_on_demand=nixl_agent_on_demand,
        )
        endpoint = None
        if in_actor or ray_node:
            import ray

            if in_actor:
                endpoint = ray.get_runtime_context().current_actor
            if ray_node:
                node = ray.get_runtime_context().get_node_id()
        if transport_cls is not None:
            extra = {"node": node} if node is not None else {}  # LocalTransport takes none
            self.transport = transport_cls(config, name=name, **extra)
        else:
            self.transport = make_transport(config, name=name, endpoint=endpoint, node=node)
        self.info = self.transport.register(self.pools)
        self._leases: dict[int, tuple[int, list[PageHandle]]] = {}
        self._gen = torch.Generator().manual_seed(hash(name) & 0xFFFF)

    # ---------------------------------------------------------------- wiring
    def peer_info(self) -> PeerInfo:
        return self.info

    def add_peers(self, infos: list[PeerInfo]) -> None:
        self.transport.add_peers(infos)

    def transport_serve(self, group: int, slots: list[int]) -> Any:
        return self.transport.serve(group, slots)  # type: ignore[attr-defined]

    # ---------------------------------------------------------------- owner side
    def put(
        self, n: int, namespace: str = NAMESPACE, group: int = 0
    ) -> tuple[int, PageExport, list[bytes]]:
        """Write ``n`` random pages, seal them, pin them under a lease, export them."""
        pool = self.pools[group]
        short = n - pool.stats().pages_free
        if short > 0:  # an owner reused across tests: unpinned pages wait in the LRU
            pool.evict(short, copy_data=False)
        handles = pool.allocate_many(n)
        data = torch.randint(0, 256, (n, pool.page_bytes), dtype=torch.uint8, generator=self._gen)
        handles = pool.write_many(handles, data)
        sealed = pool.seal_many(handles, namespace)
        pinned = [pool.share(r.handle) for r in sealed]  # the lease's references
        pool.release_many([r.handle for r in sealed])  # the writer is done with them
        lease = next(_lease_ids)
        self._leases[lease] = (group, pinned)
        export = export_pages(
            pool, pinned, namespace=namespace, peer=self.transport.name, group=group
        )
        return lease, export, [bytes(row.numpy().tobytes()) for row in data]

    def unpin(self, lease: int) -> None:
        group, handles = self._leases.pop(lease)
        self.pools[group].release_many(handles)

    # ---------------------------------------------------------------- reader side
    def fetch(self, export: PageExport, timeout_s: float | None = None) -> PageFetchResult:
        return fetch_verified(self.transport, export, timeout_s=timeout_s)

    def read_pages(self, handles: list[PageHandle], group: int = 0) -> list[bytes]:
        return [self.pools[group].read_bytes(h) for h in handles]

    def drop(self, handles: list[PageHandle], group: int = 0) -> None:
        """Release fetched pages and evict them, so a reused node starts the next test empty."""
        self.pools[group].release_many(handles)
        self.pools[group].evict(len(handles), copy_data=False)

    def pid(self) -> int:
        return os.getpid()

    def carrier(self, peer: str) -> str:
        return self.transport.carrier(peer)

    def mapped_counts(self) -> tuple[int, int]:
        """Reads and bytes this node's transport copied out of mapped peer memory."""
        return self.transport.mapped_reads, self.transport.mapped_bytes

    def stats(self, group: int = 0) -> PoolStats:
        return self.pools[group].stats()

    def check(self) -> None:
        for pool in self.pools:
            pool.check_consistency()

    def close(self) -> None:
        self.transport.close()


class ActorProxy:
    """Calls an actor's methods as if it were a local :class:`Node` (``ray.get`` on each)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def __getattr__(self, name: str) -> Any:
        import ray

        method = getattr(self.handle, name)
        return lambda *a, **kw: ray.get(method.remote(*a, **kw), timeout=60)


def node_actor(kind: str, name: str, *, on_node: str | None = None, **kw: Any) -> ActorProxy:
    """A :class:`Node` in a Ray actor of its own (``on_node``: pinned to that Ray node)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    options: dict[str, Any] = {"num_cpus": 0}  # UCX_MODULES, PYTHONPATH: from the job (conftest)
    if on_node is not None:
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(on_node, soft=False)
    actor = ray.remote(Node).options(**options).remote(kind, name, in_actor=True, **kw)
    proxy = ActorProxy(actor)
    proxy.stats()  # wait until constructed: errors surface here
    return proxy
