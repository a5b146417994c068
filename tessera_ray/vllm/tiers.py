"""The tier backends the connector opens by config: :class:`LocalTier` (the core engine in this
process, no Ray), and for the running tier on a Ray cluster
:class:`~tessera_ray.vllm.node_tier.NodeTier` (over the channel of the pool on this node, no Ray
in the engine) or, where no pool of the tier is announced on this node,
:class:`~tessera_ray.vllm.ray_tier.RayTier` (a Ray driver).

vLLM's scheduler and a ``uni`` executor's worker live in one process, so their connectors share
one :class:`LocalTier` (:func:`shared_local_tier`). Both backends run their coroutines on the
connector's one event-loop thread (:mod:`~tessera_ray.vllm.loop`), which also serialises every
use of a shared :class:`LocalTier`.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import numpy as np

from tessera_ray.actors.config import PoolServiceConfig
from tessera_ray.actors.links import LocalDirectory
from tessera_ray.actors.messages import BlockCheck, BlockReads, PinTicket
from tessera_ray.actors.pool_service import PoolService
from tessera_ray.core.results import TokenKey
from tessera_ray.layout import ModelLayout
from tessera_ray.vllm.backend import TierBackend, TierHit, hit_of, tier_call
from tessera_ray.vllm.config import TesseraConnectorConfig
from tessera_ray.vllm.loop import run_on_loop, submit_on_loop

__all__ = ["LocalTier", "open_tier", "shared_local_tier"]

log = logging.getLogger(__name__)
_T = TypeVar("_T")


class LocalTier(TierBackend):
    """The core engine in this process: one :class:`PoolService` and an in-process directory."""

    def __init__(self, layout: ModelLayout, *, num_blocks: int, device: str, timeout_s: float):
        self.layout = layout
        self.timeout_s = timeout_s
        self.directory = LocalDirectory()
        self.service = PoolService(
            "local",
            layout,
            PoolServiceConfig(num_blocks=num_blocks, device=device),
            directory=self.directory,
        )

    def _run(self, what: str, coro: Coroutine[Any, Any, _T]) -> _T:
        with tier_call(what):
            return run_on_loop(coro, self.timeout_s)

    async def _lookup(self, namespace: str, keys: list[TokenKey]) -> list[TierHit | None]:
        results = await self.directory.lookup(namespace, keys)
        return [hit_of(r) if r is not None else None for r in results]

    def lookup_async(
        self, namespace: str, keys: Sequence[TokenKey]
    ) -> concurrent.futures.Future[list[TierHit | None]]:
        return submit_on_loop(self._lookup(namespace, list(keys)))

    def read(
        self,
        namespace: str,
        keys: Sequence[TokenKey],
        hits: Sequence[TierHit] | None = None,
        ticket: PinTicket | None = None,
    ) -> BlockReads:
        # One pool holds everything: the holders a lookup found are this one (its lookups
        # pin nothing, so no ticket comes here).
        return self._run("tier read", self.service.read_blocks(namespace, list(keys)))

    def report_unverified(self, namespace: str, keys: Sequence[TokenKey]) -> list[BlockCheck]:
        return self._run("tier check", self.service.check_blocks(namespace, list(keys)))

    def store(self, namespace: str, keys: Sequence[TokenKey], payloads: np.ndarray) -> None:
        self._run("tier store", self.service.store(namespace, list(keys), payloads))


_LOCAL_LOCK = threading.Lock()
_LOCAL_TIERS: dict[str, LocalTier] = {}


def shared_local_tier(layout: ModelLayout, config: TesseraConnectorConfig) -> LocalTier:
    """This process's in-process tier for ``layout`` (created on first use), so the scheduler's
    lookups see what the worker stored. Later callers get the first one's size and device."""
    with _LOCAL_LOCK:
        tier = _LOCAL_TIERS.get(layout.fingerprint)
        if tier is None:
            tier = LocalTier(
                layout,
                num_blocks=config.local_num_blocks,
                device=config.local_device,
                timeout_s=config.timeout_s,
            )
            _LOCAL_TIERS[layout.fingerprint] = tier
        elif tier.service.config.num_blocks != config.local_num_blocks:
            log.warning(
                "in-process tier for %s already exists with %d blocks; ignoring "
                "local_num_blocks=%d",
                layout.model,
                tier.service.config.num_blocks,
                config.local_num_blocks,
            )
        return tier


def open_tier(config: TesseraConnectorConfig, local_layout: ModelLayout) -> TierBackend:
    """The backend ``config`` names; ``local_layout`` is the in-process tier's layout."""
    if config.backend == "local":
        return shared_local_tier(local_layout, config)
    from tessera_ray.vllm.node_tier import NodeTier, announced_pool

    entry = announced_pool(config)
    if entry is not None:
        log.info("connector: pool %s over its channel (this process does not join Ray)", entry.pool)
        return NodeTier(config, entry)
    # Imported here: only this road joins Ray.
    from tessera_ray.vllm.ray_tier import RayTier

    return RayTier(config)
