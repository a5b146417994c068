"""How the vLLM connector talks to the tier: one small batched interface, two backends.

- :class:`RayTier`: the running tier on a Ray cluster, through :class:`TesseraClient` (lookup in
  the sharded directory; reads pull blocks into this node's pool first, then read them there).
- :class:`LocalTier`: the core engine in this process (a :class:`PoolService` over
  :class:`BlockPool` s and an in-process :class:`DirectoryShard`), no Ray. vLLM's scheduler and
  a ``uni`` executor's worker live in one process, so their connectors share one instance
  (:func:`shared_local_tier`).

Every call takes and returns lists (one round trip per request batch). Both backends run their
coroutines on one private event-loop thread per process (``_connector_loop``), because vLLM
calls the connector from plain threads that may or may not already run a loop of their own; the
one thread also serialises every use of a shared :class:`LocalTier`.

:func:`payload_block_hash` (``_connector_keys``, re-exported here) recomputes a block's hash
from its bytes exactly as the pool sealed it, so the connector verifies what it read against
what the lookup promised before any byte reaches vLLM's cache.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import logging
import threading
import uuid
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from tessera_ray.actors.channel import ChannelClient, ChannelError, send_if_open
from tessera_ray.actors.config import PoolServiceConfig
from tessera_ray.actors.links import LocalDirectory
from tessera_ray.actors.messages import BlockCheck, BlockReads, PinTicket
from tessera_ray.actors.pool_service import PoolService
from tessera_ray.actors.tenancy import Access
from tessera_ray.core.results import BlockHash, TokenKey
from tessera_ray.errors import TierConfigError, TransportError
from tessera_ray.layout import ModelLayout
from tessera_ray.serve._connector_config import TesseraConnectorConfig
from tessera_ray.serve._connector_keys import payload_block_hash
from tessera_ray.serve._connector_loop import run_on_loop, submit_on_loop
from tessera_ray.serve._connector_nixl import PoolReader

# payload_block_hash and the loop helpers moved out of this module stay importable from it.
__all__ = [
    "TierBackend",
    "LocalTier",
    "RayTier",
    "open_tier",
    "shared_local_tier",
    "payload_block_hash",
    "run_on_loop",
    "submit_on_loop",
]

log = logging.getLogger(__name__)
_T = TypeVar("_T")
_CHANNEL_RETRY_S = 10.0  # between attempts to reach a pool's channel that did not answer


class TierBackend(abc.ABC):
    """What the connector needs of the tier; every method is one batched call."""

    layout: ModelLayout
    """The layout the tier stores pages in (token keys and hashes carry its fingerprint)."""
    timeout_s: float
    """Longest one batched call may take."""

    @abc.abstractmethod
    def lookup_async(
        self, namespace: str, keys: Sequence[TokenKey]
    ) -> concurrent.futures.Future[list[BlockHash | None]]:
        """Start one batched lookup: per key, the hash of the block the tier holds under it,
        or ``None`` (a miss). Returns at once; the scheduler waits on the future briefly."""

    def lookup(self, namespace: str, keys: Sequence[TokenKey]) -> list[BlockHash | None]:
        """:meth:`lookup_async`, waited for."""
        return self.lookup_async(namespace, keys).result(self.timeout_s)

    def prepare_reads(self) -> None:  # noqa: B027 - optional hook, nothing to set up here
        """Set up what reads need, once, where reads happen (the worker); optional."""

    def release_reads(self) -> None:  # noqa: B027 - optional hook, nothing to release here
        """Release what :meth:`prepare_reads` set up (the worker shuts down)."""

    @abc.abstractmethod
    def read(self, namespace: str, keys: Sequence[TokenKey]) -> BlockReads:
        """Per key, the block's payload (uint8 ``[block_bytes]``) with the hash the pool
        sealed it under, or nothing when the tier no longer holds it (evicted since the
        lookup, owner gone). Not verified here."""

    @abc.abstractmethod
    def report_unverified(self, namespace: str, keys: Sequence[TokenKey]) -> list[BlockCheck]:
        """The blocks under ``keys`` came back with bytes that do not match their hash: the
        tier checks its own copies and drops the ones that rotted, so the next save of those
        keys stores them afresh instead of every later request recomputing them."""

    @abc.abstractmethod
    def store(self, namespace: str, keys: Sequence[TokenKey], payloads: np.ndarray) -> None:
        """Store ``payloads[i]`` (uint8 ``[len(keys), block_bytes]``) under ``keys[i]``."""


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

    def _run(self, coro: Coroutine[Any, Any, _T]) -> _T:
        return run_on_loop(coro, self.timeout_s)

    async def _lookup(self, namespace: str, keys: list[TokenKey]) -> list[BlockHash | None]:
        results = await self.directory.lookup(namespace, keys)
        return [r.block_hash if r is not None else None for r in results]

    def lookup_async(
        self, namespace: str, keys: Sequence[TokenKey]
    ) -> concurrent.futures.Future[list[BlockHash | None]]:
        return submit_on_loop(self._lookup(namespace, list(keys)))

    def read(self, namespace: str, keys: Sequence[TokenKey]) -> BlockReads:
        return self._run(self.service.read_blocks(namespace, list(keys)))

    def report_unverified(self, namespace: str, keys: Sequence[TokenKey]) -> list[BlockCheck]:
        return self._run(self.service.check_blocks(namespace, list(keys)))

    def store(self, namespace: str, keys: Sequence[TokenKey], payloads: np.ndarray) -> None:
        self._run(self.service.store(namespace, list(keys), payloads))


class RayTier(TierBackend):
    """The running tier on a Ray cluster (``tessera-ray start``), through one client."""

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
        self._pool_actor = self.client.pool(self.pool)
        self._staging_bytes = config.nixl_staging_bytes
        self._reader: PoolReader | None = None
        self._reader_tried = False
        self._channel: ChannelClient | None = None
        """The pool's channel: a lookup of what it holds, a pin and an unpin without a Ray
        call (a Ray actor call costs several times its round trip)."""
        self._channel_retry_s = 0.0

    def prepare_reads(self) -> None:
        """Open the NIXL path to this node's pool (worker side, once): staging memory
        registered with NIXL, the pool's agent added. Where the pool moves blocks through Ray's
        object store, or NIXL cannot start, reads go through the object store."""
        if self._reader_tried:
            return
        self._reader_tried = True
        blocks = self._staging_bytes // self.layout.block_bytes
        if blocks < 1:
            return
        try:
            import ray

            peer = ray.get(self._pool_actor.peer_info.remote(), timeout=self.timeout_s)
            if peer is None or peer.kind != "nixl":
                return
            self._reader = PoolReader(
                self.layout,
                peer,
                capacity_blocks=blocks,
                name=f"tessera-connector-{uuid.uuid4().hex[:12]}",
            )
        except Exception as exc:
            log.warning(
                "NIXL reads from pool %s unavailable (%s); reading through Ray's object store",
                self.pool,
                exc,
            )
            return
        self._run(self._open_channel())

    async def _open_channel(self) -> ChannelClient | None:
        """The pool's channel, connecting when there is none (at most every
        ``_CHANNEL_RETRY_S``); ``None`` when the pool serves none or cannot be reached: lookups,
        pins and unpins then go through Ray."""
        channel = self._channel
        if channel is not None and not channel.closed:
            return channel
        loop = asyncio.get_running_loop()
        if loop.time() < self._channel_retry_s:
            return None
        self._channel_retry_s = loop.time() + _CHANNEL_RETRY_S
        self._channel = None
        try:
            address = await asyncio.wait_for(self._pool_actor.channel.remote(), self.timeout_s)
            if address is not None:
                self._channel = await ChannelClient.connect(address, self.timeout_s)
        except Exception as exc:
            log.info("no channel to pool %s (%s); asking through Ray", self.pool, exc)
        return self._channel

    def release_reads(self) -> None:
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.close()
        channel, self._channel = self._channel, None
        if channel is not None:
            submit_on_loop(_close_channel(channel))

    def _run(self, coro: Coroutine[Any, Any, _T]) -> _T:
        return run_on_loop(coro, self.timeout_s)

    def _access(self, namespace: str) -> Access:
        """What calls for ``namespace`` present: a credential on a tier with tenant secret."""
        if not self._closed:
            return namespace
        cred = self._credentials.get(namespace)
        if cred is None:
            cred = self._credentials[namespace] = self.client.issue_credential(namespace)
        return cred

    async def _lookup(self, namespace: str, keys: list[TokenKey]) -> list[BlockHash | None]:
        # This node's pool first, over its channel: it usually holds the whole run (it is
        # where this engine's reads land), and then the directory is not asked at all.
        access = self._access(namespace)
        local = await self._lookup_local(access, keys)
        held = 0
        while held < len(local) and local[held] is not None:
            held += 1
        if held == len(keys):
            return local
        results = await self.client.alookup(access, keys[held:])
        return [*local[:held], *(r.block_hash if r is not None else None for r in results)]

    async def _lookup_local(self, access: Access, keys: list[TokenKey]) -> list[BlockHash | None]:
        channel = await self._open_channel()
        if channel is None:
            return []
        try:
            hashes: list[BlockHash | None] = await channel.call(
                "lookup", access, keys, timeout_s=self.timeout_s
            )
            return hashes
        except Exception as exc:  # the directory still answers
            log.info("lookup over the channel to pool %s failed: %s", self.pool, exc)
            return []

    def lookup_async(
        self, namespace: str, keys: Sequence[TokenKey]
    ) -> concurrent.futures.Future[list[BlockHash | None]]:
        return submit_on_loop(self._lookup(namespace, list(keys)))

    async def _read(self, namespace: str, keys: list[TokenKey]) -> BlockReads:
        access = self._access(namespace)
        # Pull what other pools hold into this node's pool, then read it all from there; a key
        # no pool could supply reads as not held.
        await self.client.afetch(access, keys, into=self.pool)
        return await self.client.aread_blocks(access, keys, pool=self.pool)

    async def _pin(self, namespace: str, keys: list[TokenKey]) -> PinTicket:
        """Pin ``keys`` in this node's pool, pulling in first what only other pools hold (one
        call when this pool holds them all, the common case for a node's own prefixes)."""
        access = self._access(namespace)
        ticket = await self._pin_local(access, keys)
        if all(b is not None for b in ticket.blocks):
            return ticket
        await self._unpin(ticket.id)
        await self.client.afetch(access, keys, into=self.pool)
        return await self._pin_local(access, keys)

    async def _pin_local(self, access: Access, keys: list[TokenKey]) -> PinTicket:
        channel = await self._open_channel()
        if channel is not None:
            try:
                pinned: PinTicket = await channel.call(
                    "pin", access, keys, timeout_s=self.timeout_s
                )
                return pinned
            except (ChannelError, TimeoutError) as exc:  # the Ray call decides
                log.info("pin over the channel to pool %s failed (%s); using Ray", self.pool, exc)
        result: PinTicket = await self._pool_actor.pin.remote(access, keys)
        return result

    async def _unpin(self, pin_id: int) -> None:
        if not send_if_open(self._channel, "unpin", pin_id):
            self._pool_actor.unpin.remote(pin_id)

    def read(self, namespace: str, keys: Sequence[TokenKey]) -> BlockReads:
        reader = self._reader
        if reader is None:
            return self._run(self._read(namespace, list(keys)))
        ticket = self._run(self._pin(namespace, list(keys)))
        try:
            if reader.incarnation != ticket.incarnation:
                self._refresh_peer(reader, ticket.incarnation)
            if reader.fits(ticket):
                return reader.read(ticket, self.timeout_s)
        except TransportError as exc:  # the pool's agent went away: the object store still works
            log.warning("NIXL read from pool %s failed (%s); reading through Ray", self.pool, exc)
            reader.incarnation = None
        finally:
            submit_on_loop(self._unpin(ticket.id))
        return self._run(self._read(namespace, list(keys)))

    def _refresh_peer(self, reader: PoolReader, incarnation: int) -> None:
        """The pool (re)started since the reader last saw it: its NIXL agent is new."""
        import ray

        peer = ray.get(self._pool_actor.peer_info.remote(), timeout=self.timeout_s)
        if reader.peer in reader.transport.peers:
            reader.transport.remove_peers([reader.peer])
        reader.transport.add_peers([peer])
        reader.peer, reader.incarnation = peer.name, incarnation
        if self._channel is not None:
            submit_on_loop(_close_channel(self._channel))
        self._channel, self._channel_retry_s = None, 0.0  # a new pool process, a new channel

    def report_unverified(self, namespace: str, keys: Sequence[TokenKey]) -> list[BlockCheck]:
        # Reads are served by this pool (fetched into it first), so its copies are the suspects.
        return self._run(
            self.client.acheck_blocks(self._access(namespace), list(keys), pool=self.pool)
        )

    def store(self, namespace: str, keys: Sequence[TokenKey], payloads: np.ndarray) -> None:
        self._run(self.client.astore(self._access(namespace), list(keys), payloads, pool=self.pool))


async def _close_channel(channel: ChannelClient) -> None:
    channel.close()  # on the loop that owns its transport


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
    return RayTier(config)
