"""The connector's backend for the running tier on a Ray cluster (``tessera-ray start``).

Everything goes through one :class:`~tessera_ray.actors.client.TesseraClient` and its
:class:`~tessera_ray.actors.pool_link.PoolLink` to this node's pool (channel first, Ray's typed
calls otherwise). A lookup asks this node's pool what it holds (it usually holds the whole run:
it is where this engine's reads land) and the directory for the rest, and answers each block's
holders; the worker's read pulls the blocks from those holders into this node's pool (one call
to it) and reads them there into staging memory registered once (a pin, then one copy out of
the pool's memory mapped into this process, or a one-sided NIXL read where it cannot be mapped),
else through Ray's object store. A cross-node hit thus asks the directory once and this node's
pool twice.
"""

from __future__ import annotations

import concurrent.futures
import logging
import uuid
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from tessera_ray.actors.directory import Holder, Tier
from tessera_ray.actors.messages import BlockCheck, BlockReads, PinTicket
from tessera_ray.actors.tenancy import Access
from tessera_ray.core.results import TokenKey
from tessera_ray.errors import PoolUnavailableError, TierConfigError, TransportError
from tessera_ray.vllm.backend import TierBackend, TierHit, hit_of, tier_call
from tessera_ray.vllm.config import TesseraConnectorConfig
from tessera_ray.vllm.loop import run_on_loop, submit_on_loop
from tessera_ray.vllm.nixl_reader import PoolReader

__all__ = ["RayTier"]

log = logging.getLogger(__name__)
_T = TypeVar("_T")


class RayTier(TierBackend):
    """The running tier on a Ray cluster, through one client and one link to this node's pool."""

    def __init__(self, config: TesseraConnectorConfig) -> None:
        # The Ray backend only: the local one runs without Ray.
        from tessera_ray.actors.client import TesseraClient

        self.timeout_s = config.timeout_s
        secret = _read_secret(config.tenant_secret_file)
        self.client = TesseraClient.connect(
            config.ray_namespace, address=config.ray_address, tenant_secret=secret
        )
        self._credentials: dict[str, Access] = {}
        self._closed = secret is not None
        self.layout = self.client.layout
        if config.pool is not None:
            if config.pool not in self.client.pools:
                raise TierConfigError(
                    f"pool {config.pool!r} is not a pool of the tier in Ray namespace "
                    f"{config.ray_namespace!r}; pools: {', '.join(self.client.pools)}"
                )
            self.pool = config.pool
        else:
            self.pool = self.client.local_pool()
        self.link = self.client.pool_link(self.pool)
        self.local_pool = self.pool
        self._here = (Holder(self.pool, Tier.MEMORY),)
        self._staging_bytes = config.nixl_staging_bytes
        self._reader: PoolReader | None = None
        self._reader_tried = False
        self._reader_incarnation: int | None = None
        """The pool process the reader's peer is (``None``: the one ``prepare_reads`` met)."""
        self._reader_stale = False
        """A NIXL read failed: ask the pool for its agent again before the next one."""

    def _run(self, what: str, coro: Coroutine[Any, Any, _T]) -> _T:
        with tier_call(what):
            return run_on_loop(coro, self.timeout_s)

    # ---------------------------------------------------------------- set-up

    def prepare_reads(self) -> None:
        """Open the read path to this node's pool (worker side, once): staging memory
        registered with NIXL, the pool's agent added and, on the pool's node, its memory mapped
        (:class:`PoolReader`). Where the pool moves blocks through Ray's object store, or NIXL
        cannot start, reads go through the object store."""
        if self._reader_tried:
            return
        self._reader_tried = True
        blocks = self._staging_bytes // self.layout.block_bytes
        if blocks < 1 or len(self.layout.groups) != 1:
            # The mapped and NIXL reader stages one layer group; a hybrid layout's blocks span
            # several, and go through the object store.
            return
        try:
            peer = run_on_loop(self.link.peer_info(self.timeout_s), self.timeout_s)
            if peer is None or peer.kind != "nixl":
                return
            self._reader = PoolReader(
                self.layout,
                peer,
                capacity_blocks=blocks,
                name=f"tessera-connector-{uuid.uuid4().hex[:12]}",
                node=self.client.node,
            )
        except (PoolUnavailableError, TransportError, TimeoutError) as exc:
            log.warning(
                "NIXL reads from pool %s unavailable (%s); reading through Ray's object store",
                self.pool,
                exc,
            )

    def release_reads(self) -> None:
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.close()
        submit_on_loop(_close_links(self))

    def _access(self, namespace: str) -> Access:
        """What calls for ``namespace`` present: a credential on a tier with tenant secret."""
        if not self._closed:
            return namespace
        cred = self._credentials.get(namespace)
        if cred is None:
            cred = self._credentials[namespace] = self.client.issue_credential(namespace)
        return cred

    # ---------------------------------------------------------------- scheduler side

    async def _lookup(self, namespace: str, keys: list[TokenKey]) -> list[TierHit | None]:
        with tier_call("tier lookup"):
            # This node's pool first, over its channel: when it holds the whole run the
            # directory is not asked at all.
            access = self._access(namespace)
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

    def lookup_async(
        self, namespace: str, keys: Sequence[TokenKey]
    ) -> concurrent.futures.Future[list[TierHit | None]]:
        return submit_on_loop(self._lookup(namespace, list(keys)))

    # ---------------------------------------------------------------- worker side

    async def _pull(
        self, access: Access, keys: list[TokenKey], hits: Sequence[TierHit] | None
    ) -> None:
        """Pull into this node's pool what the lookup found only elsewhere (one call to this
        pool per owner, none when it holds them all)."""
        if hits is None:
            return
        holders = [h.holders for h in hits]
        if any(self._here[0] not in held for held in holders):
            await self.client.afetch(access, keys, into=self.pool, holders=holders)

    async def _read_by_ray(
        self, access: Access, keys: list[TokenKey], hits: Sequence[TierHit] | None
    ) -> BlockReads:
        await self._pull(access, keys, hits)
        return await self.client.aread_blocks(access, keys, pool=self.pool)

    async def _pin(
        self, access: Access, keys: list[TokenKey], hits: Sequence[TierHit] | None
    ) -> PinTicket:
        await self._pull(access, keys, hits)
        return await self.link.pin_now(access, keys, self.timeout_s)

    def read(
        self, namespace: str, keys: Sequence[TokenKey], hits: Sequence[TierHit] | None = None
    ) -> BlockReads:
        access, keys = self._access(namespace), list(keys)
        reader = self._reader
        if reader is None:
            return self._run("tier read", self._read_by_ray(access, keys, hits))
        ticket = self._run("tier pin", self._pin(access, keys, hits))
        try:
            self.link.saw(ticket.incarnation)
            if ticket.incarnation != self._reader_incarnation:
                if self._reader_incarnation is not None or self._reader_stale:
                    self._repoint(reader)  # a new pool process: its NIXL agent is new
                self._reader_incarnation, self._reader_stale = ticket.incarnation, False
            if reader.fits(ticket):
                return reader.read(ticket, self.timeout_s)
        except TransportError as exc:  # the pool's agent went away: the object store still works
            log.warning("NIXL read from pool %s failed (%s); reading through Ray", self.pool, exc)
            self._reader_incarnation, self._reader_stale = None, True
        finally:
            self.link.unpin(ticket.id)
        return self._run("tier read", self._read_by_ray(access, keys, None))

    def _repoint(self, reader: PoolReader) -> None:
        peer = self._run("tier peer", self.link.peer_info(self.timeout_s))
        if peer is None or peer.kind != "nixl":
            raise TransportError(f"pool {self.pool} no longer serves NIXL reads")
        reader.repoint(peer)

    def report_unverified(self, namespace: str, keys: Sequence[TokenKey]) -> list[BlockCheck]:
        # Reads are served by this pool (fetched into it first), so its copies are the suspects.
        access = self._access(namespace)
        return self._run(
            "tier check", self.client.acheck_blocks(access, list(keys), pool=self.pool)
        )

    def store(self, namespace: str, keys: Sequence[TokenKey], payloads: np.ndarray) -> None:
        access = self._access(namespace)
        self._run("tier store", self.client.astore(access, list(keys), payloads, pool=self.pool))


async def _close_links(tier: RayTier) -> None:
    tier.client.close_links()  # on the loop that owns the channels' transports


def _read_secret(path: str | None) -> bytes | None:
    if path is None:
        return None
    try:
        secret = Path(path).read_bytes().strip()
    except OSError as exc:
        raise TierConfigError(
            f"kv_connector_extra_config: tenant_secret_file {path!r} cannot be read: {exc}"
        ) from exc
    if len(secret) < 16:
        raise TierConfigError(
            f"kv_connector_extra_config: tenant_secret_file {path!r} holds under 16 bytes"
        )
    return secret
