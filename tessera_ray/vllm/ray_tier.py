"""The connector's road to the tier as a Ray driver: for an engine on a node where no pool of
the tier announces a channel (:mod:`~tessera_ray.actors.announce`), the engine's processes join
Ray and reach a pool through one :class:`~tessera_ray.actors.pool_link.PoolLink` (its channel
where it serves one, Ray's typed calls otherwise). What the roads share is
:class:`~tessera_ray.vllm.pool_tier.PoolTier`; the usual road is
:class:`~tessera_ray.vllm.node_tier.NodeTier`, which needs no Ray in the engine.

A lookup asks the pool what it holds and the directory for the rest; the worker's read pulls the
blocks held elsewhere into the pool (one call per owner) and reads them there.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tessera_ray.actors.messages import BlockCheck, BlockReads, PinTicket
from tessera_ray.actors.tenancy import Access
from tessera_ray.core.results import TokenKey
from tessera_ray.errors import TierConfigError
from tessera_ray.transport import PeerInfo
from tessera_ray.vllm.backend import TierHit, hit_of
from tessera_ray.vllm.config import TesseraConnectorConfig
from tessera_ray.vllm.pool_tier import PoolTier, read_secret

__all__ = ["RayTier"]


class RayTier(PoolTier):
    """The running tier on a Ray cluster, reached as a Ray driver (module docstring)."""

    def __init__(self, config: TesseraConnectorConfig) -> None:
        # The Ray road only: the other roads run without Ray.
        from tessera_ray.actors.client import TesseraClient

        self.client = TesseraClient.connect(
            config.ray_namespace,
            address=config.ray_address,
            tenant_secret=read_secret(config.tenant_secret_file),
        )
        if config.pool is not None and config.pool not in self.client.pools:
            raise TierConfigError(
                f"pool {config.pool!r} is not a pool of the tier in Ray namespace "
                f"{config.ray_namespace!r}; pools: {', '.join(self.client.pools)}"
            )
        super().__init__(config, self.client.layout, config.pool or self.client.local_pool())
        self.node = self.client.node
        self.link = self.client.pool_link(self.pool)

    async def _find(self, access: Access, keys: list[TokenKey]) -> list[TierHit | None]:
        # This node's pool first, over its channel: when it holds the whole run the directory
        # is not asked at all.
        local = await self.link.resident(access, keys, self.timeout_s) or []
        hits: list[TierHit | None] = []
        for h in local:
            if h is None:
                break
            hits.append(TierHit(h, self._here))
        if len(hits) == len(keys):
            return hits
        results = await self.client.alookup(access, keys[len(hits) :])
        return [*hits, *(hit_of(r) if r is not None else None for r in results)]

    async def _pull(self, access: Access, keys: list[TokenKey], hits: Sequence[TierHit]) -> None:
        holders = [h.holders for h in hits]
        await self.client.afetch(access, keys, into=self.pool, holders=holders)

    async def _pin(self, access: Access, keys: list[TokenKey]) -> PinTicket:
        return await self.link.pin_now(access, keys, self.timeout_s)

    def _unpin(self, pin_id: int) -> None:
        self.link.unpin(pin_id)

    def _saw(self, incarnation: int) -> None:
        self.link.saw(incarnation)

    async def _peer(self) -> PeerInfo | None:
        return await self.link.peer_info(self.timeout_s)

    async def _read_blocks(self, access: Access, keys: list[TokenKey]) -> BlockReads:
        return await self.client.aread_blocks(access, keys, pool=self.pool)

    async def _check(self, access: Access, keys: list[TokenKey]) -> list[BlockCheck]:
        return await self.client.acheck_blocks(access, keys, pool=self.pool)

    async def _store(self, access: Access, keys: list[TokenKey], payloads: np.ndarray) -> None:
        await self.client.astore(access, keys, payloads, pool=self.pool)

    async def _close(self) -> None:
        self.client.close_links()  # on the loop that owns the channels' transports
