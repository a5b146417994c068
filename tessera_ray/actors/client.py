"""The client of the tier: handles to its actors and the data path (store, lookup, fetch,
attend, read). Every call is batched: one directory round trip per shard per request.

The rest of the client's job lives beside it, each module with one: :mod:`.deploy` starts,
finds and stops the actors (``start``, ``connect`` and ``stop`` below call it), :mod:`.admin`
holds the operator's calls (``status``, ``evict``, ``flush_metrics``, ``wait_rebuilt``, kept
here as thin calls to :attr:`TesseraClient.admin`), and the directory's fan-out over shards is
:class:`~tessera_ray.actors.links.ShardedDirectory`, the one the pools use too. The actor
shells are re-exported here: :class:`~tessera_ray.actors.pool_actor.PoolActor` and
:class:`~tessera_ray.actors.directory_actor.DirectoryActor`. This module imports no Ray itself:
every Ray call it causes goes through ``deploy`` or ``_ray_handles`` (a pool's, through its
:mod:`~tessera_ray.actors.pool_link`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tessera_ray.actors._client_plan import FetchPlan, FetchResult, assign_holders, merge_partials
from tessera_ray.actors._client_sync import blocking, run_blocking
from tessera_ray.actors._ray_handles import (
    DIR_PREFIX,
    POOL_PREFIX,
    ActorCache,
    PoolRef,
    ShardRef,
    shard_name,
)
from tessera_ray.actors.admin import TierAdmin
from tessera_ray.actors.config import TierConfig
from tessera_ray.actors.deploy import connect_tier, start_tier, stop_tier, this_node
from tessera_ray.actors.directory import DirectoryStats, Holder, LookupResult
from tessera_ray.actors.directory_actor import DirectoryActor
from tessera_ray.actors.links import ShardedDirectory
from tessera_ray.actors.messages import (
    BlockCheck,
    BlockReads,
    EvictionReport,
    PoolStatus,
    StoredBlock,
)
from tessera_ray.actors.pool_actor import PoolActor
from tessera_ray.actors.pool_link import PoolLink, PoolLinks
from tessera_ray.actors.tenancy import Access, Credential, TenantGate
from tessera_ray.core.results import TokenKey
from tessera_ray.errors import PoolUnavailableError
from tessera_ray.layout import ModelLayout

__all__ = [
    "PoolActor",
    "DirectoryActor",
    "TesseraClient",
    "FetchResult",
    "POOL_PREFIX",
    "DIR_PREFIX",
    "this_node",
]


class TesseraClient:
    """Starts or connects to the tier; every method is batched (one call per shard)."""

    def __init__(
        self,
        config: TierConfig,
        layout: ModelLayout,
        pools: list[str],
        *,
        owns_ray: bool = False,
        tenant_secret: bytes | None = None,
    ) -> None:
        self._gate = TenantGate(tenant_secret)
        self.config = config
        self.layout = layout
        self.pools = pools
        self.owns_ray = owns_ray
        """True when :meth:`start` started the embedded Ray; :meth:`stop` then shuts it down."""
        self._actors = ActorCache(config.ray_namespace)
        self._links = PoolLinks(self._actors, label="client")

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    def start(
        cls,
        config: TierConfig,
        *,
        layout: ModelLayout | None = None,
        address: str | None = None,
        pools_on: Sequence[str] | None = None,
        quiet: bool = False,
        tenant_secret: bytes | None = None,
    ) -> TesseraClient:
        """Start the tier: directory shards on this node, pools on every alive node (or on the
        node ids in ``pools_on``): one per GPU (``num_gpus=1``, pages in device memory) on GPU
        nodes, ``pools_per_node`` on CPU nodes. Starts an embedded local Ray on 127.0.0.1 when
        none is connected (``quiet``: keep the actors' log lines off this process's output).

        ``tenant_secret``: every call must then name its namespace with a credential
        (:meth:`issue_credential`; see :mod:`~tessera_ray.actors.tenancy`); ``None``: an open
        tier where a namespace is a plain string."""
        TenantGate(tenant_secret)  # refuse a weak secret before anything starts
        tier = start_tier(
            config,
            layout=layout,
            address=address,
            pools_on=pools_on,
            quiet=quiet,
            tenant_secret=tenant_secret,
        )
        return cls(
            tier.config,
            tier.layout,
            tier.pools,
            owns_ray=tier.owns_ray,
            tenant_secret=tenant_secret,
        )

    @classmethod
    def connect(
        cls,
        ray_namespace: str = "tessera",
        *,
        address: str | None = None,
        tenant_secret: bytes | None = None,
    ) -> TesseraClient:
        """Attach to a running tier (started by :meth:`start` or ``tessera-ray start``): the
        pools and shards are found by name, the layout and settings are asked of a pool (never
        the tenant secret: an operator who holds it passes it to issue credentials)."""
        tier = connect_tier(ray_namespace, address=address)
        return cls(tier.config, tier.layout, tier.pools, tenant_secret=tenant_secret)

    def stop(self) -> None:
        """Kill the tier's actors (the disk tiers stay on disk), and the embedded Ray if
        :meth:`start` started it."""
        stop_tier(self.config, self.pools, owns_ray=self.owns_ray)

    def issue_credential(self, tenant: str, reads: Sequence[str] = ()) -> Credential:
        """A credential for ``tenant`` that may also read the namespaces in ``reads``
        (explicit sharing). Needs the tier's tenant secret (given to :meth:`start` or
        :meth:`connect`); hand it to the tenant's code, which passes it as the namespace."""
        return self._gate.issue(tenant, reads)

    # ------------------------------------------------------------------ handles

    def pool_ref(self, name: str) -> PoolRef:
        """Pool ``name``, through the typed calls every caller in the package makes."""
        return PoolRef(self._actors, name)

    def shard_ref(self, i: int) -> ShardRef:
        return ShardRef(self._actors, i)

    def pool_link(self, name: str) -> PoolLink:
        """Pool ``name`` over its channel first, through Ray otherwise: pins, unpins and lookups
        of what it holds, the pool's restarts tracked (:mod:`~tessera_ray.actors.pool_link`)."""
        return self._links.link(name)

    def close_links(self) -> None:
        """Close the channels :meth:`pool_link` opened (on the loop that opened them)."""
        self._links.close()

    def _directory(self) -> ShardedDirectory:
        """The shards, fanned out over as the pools' own lookups and purges are (one code
        path). Made per call: its write lock binds to the event loop it first waits in, and
        each blocking method runs in a loop of its own."""
        return ShardedDirectory([self.shard_ref(s) for s in range(self.config.num_shards)])

    def pool(self, name: str) -> Any:
        """Pool ``name``'s raw Ray actor handle (for operators and tests: ``ray.kill``, a call
        the typed interface does not offer)."""
        return self._actors.get(name)

    def shard(self, i: int) -> Any:
        """Directory shard ``i``'s raw Ray actor handle (see :meth:`pool`)."""
        return self._actors.get(shard_name(i))

    def node_pool(self, node_id: str) -> str | None:
        """The (first) pool on node ``node_id``, ``None`` when the node has none."""
        prefix = f"{POOL_PREFIX}{node_id[:12]}-"
        return next((n for n in self.pools if n.startswith(prefix)), None)

    def pool_on(self, node_id: str) -> str:
        pool = self.node_pool(node_id)
        if pool is None:
            raise PoolUnavailableError(f"no tessera-ray pool on node {node_id}")
        return pool

    def local_pool(self) -> str:
        """A pool on the node this process runs on (reads landing there stay local later), or
        the first pool when this node has none."""
        return self.node_pool(self.node) or self.pools[0]

    @property
    def node(self) -> str:
        """The Ray node this process runs on (a transport reads pools of the same node through
        their mapped memory)."""
        return this_node()

    # ------------------------------------------------------------------ data path
    #
    # Each operation is written once, as a coroutine (``a``-prefixed: use these inside an event
    # loop, e.g. a Ray Serve deployment); the plain method runs it to completion for scripts.

    async def astore(
        self, namespace: Access, token_keys: Sequence[TokenKey], payloads: np.ndarray, *, pool: str
    ) -> list[StoredBlock]:
        """Store into ``pool`` in one call (the pool reserves, writes, seals and registers the
        blocks with the directory; a failed store returns its slots)."""
        return await self.pool_ref(pool).store(namespace, list(token_keys), payloads)

    async def alookup(
        self, namespace: Access, token_keys: Sequence[TokenKey], *, strict: bool = False
    ) -> list[LookupResult | None]:
        """One call per shard. A shard that is down (restarting) answers with misses, or
        raises :class:`DirectoryUnavailableError` when ``strict`` (a caller that must tell "not
        held" from "not known", such as a request router)."""
        return await self._directory().lookup(namespace, token_keys, strict=strict)

    async def apurge_pool(self, pool: str) -> None:
        """Have every shard forget ``pool``'s replicas (a pool found unavailable); a shard
        that is down is skipped, and re-learns the pool from its inventory if it answers."""
        await self._directory().purge(pool)

    async def afetch(
        self,
        namespace: Access,
        token_keys: Sequence[TokenKey],
        *,
        into: str,
        holders: Sequence[Sequence[Holder] | None] | None = None,
    ) -> FetchResult:
        """Make the blocks available in pool ``into``: local hits stay, blocks held elsewhere are
        pulled (memory replicas first, then disk), a dead owner is purged and the next replica
        tried; what no live replica has is a miss (the engine recomputes it).

        ``holders``: where a lookup already found each key (the vLLM connector carries its
        scheduler's lookup to the worker): the directory is not asked again, and local hits are
        not confirmed (the caller's next call to ``into``, a pin or a read, says what it still
        holds)."""
        if holders is None:
            found = await self.alookup(namespace, token_keys)
            plan = FetchPlan.of_lookup(into, token_keys, found)
        else:
            plan = FetchPlan(into, token_keys, holders)
        target = self.pool_ref(into)
        if plan.local and holders is None:
            # Confirm the local hits (the directory may lag an eviction) and mark them used, so
            # the pool keeps them over older blocks; a stale one is pulled like any other.
            plan.confirm_local(await target.contains(namespace, plan.local, True))
        return await plan.run(
            lambda owner, keys: target.fetch_from(owner, namespace, keys), self.apurge_pool
        )

    async def aattend(
        self,
        namespace: Access,
        token_keys: Sequence[TokenKey],
        layer: int,
        q: torch.Tensor,
        seqlen: int,
        softmax_scale: float,
        causal: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """MLA attention of one sequence where its pages live: each block is assigned to one
        pool holding it in memory, every pool computes its partial (out, lse) over its blocks,
        and the partials are merged exactly (LSE merge). Raises ``LookupError`` naming blocks
        no pool holds in memory (fetch them first, or recompute)."""
        assigned = assign_holders(await self.alookup(namespace, token_keys))
        keys, scale = list(token_keys), softmax_scale
        partials = await asyncio.gather(
            *(
                self.pool_ref(p).attend(namespace, keys, pos, layer, q, seqlen, scale, causal)
                for p, pos in assigned.items()
            )
        )
        return merge_partials(list(assigned), partials)

    async def aread(
        self, namespace: Access, token_keys: Sequence[TokenKey], *, pool: str
    ) -> list[np.ndarray | None]:
        return await self.pool_ref(pool).read(namespace, list(token_keys))

    async def aread_blocks(
        self, namespace: Access, token_keys: Sequence[TokenKey], *, pool: str
    ) -> BlockReads:
        """:meth:`aread` with the hash each block was sealed under, to verify the bytes by."""
        return await self.pool_ref(pool).read_blocks(namespace, list(token_keys))

    async def acheck_blocks(
        self, namespace: Access, token_keys: Sequence[TokenKey], *, pool: str
    ) -> list[BlockCheck]:
        """Have ``pool`` re-hash blocks whose bytes a consumer could not verify; it drops the
        ones that rotted in its memory (see :class:`BlockCheck`)."""
        return await self.pool_ref(pool).check_blocks(namespace, list(token_keys))

    store = blocking(astore)
    purge_pool = blocking(apurge_pool)
    fetch = blocking(afetch)
    attend = blocking(aattend)
    read = blocking(aread)
    check_blocks = blocking(acheck_blocks)

    def lookup(
        self, namespace: Access, token_keys: Sequence[TokenKey]
    ) -> list[LookupResult | None]:
        # Written out to keep the narrower signature: the blocking form takes no ``strict``.
        return run_blocking(self.alookup(namespace, token_keys))

    # ------------------------------------------------------------------ admin

    @property
    def admin(self) -> TierAdmin:
        """The operator's calls over this tier's pools and shards (see :mod:`.admin`)."""
        return TierAdmin(self._actors, self.pools, self.config.num_shards)

    # The client's own names for them, kept for its callers.

    async def astatus(self) -> tuple[list[PoolStatus | str], list[DirectoryStats | str]]:
        """Every pool's and shard's snapshot (:meth:`TierAdmin.astatus`)."""
        return await self.admin.astatus()

    async def aevict(self, pool: str, num_blocks: int) -> EvictionReport:
        """Have ``pool`` evict up to ``num_blocks`` blocks (:meth:`TierAdmin.aevict`)."""
        return await self.admin.aevict(pool, num_blocks)

    async def aflush_metrics(self) -> None:
        """Every pool and shard exports its snapshot now (:meth:`TierAdmin.aflush_metrics`)."""
        await self.admin.aflush_metrics()

    async def await_rebuilt(self, timeout_s: float = 30.0) -> bool:
        """Wait for every shard's rebuild; False on ``timeout_s``
        (:meth:`TierAdmin.await_rebuilt`)."""
        return await self.admin.await_rebuilt(timeout_s)

    status = blocking(astatus)
    evict = blocking(aevict)
    flush_metrics = blocking(aflush_metrics)
    wait_rebuilt = blocking(await_rebuilt)
