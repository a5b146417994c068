"""What a pool process runs beside its calls, kept out of the Ray shell so it reads (and is
tested) as plain asyncio: the pool's channel and its handlers, and the background loops.

The channel serves two kinds of caller. Other pools and readers pin, unpin and ask what the pool
holds (``pin``, ``unpin``, ``lookup``). An engine on the pool's node (the vLLM connector, found
through :mod:`~tessera_ray.actors.announce`) reaches the whole tier through it and never joins
Ray: ``find`` answers a lookup (what the pool holds, the directory asked only for the rest),
``pull`` fetches blocks held elsewhere into this pool (started already when ``find`` placed
them elsewhere: the transfer begins when the scheduler's lookup is answered), ``store_mapped``
stores in one call the rows the engine wrote into its own shared-memory slab and ``read_into``
answers a read into another (``store`` and ``read_blocks`` carry the bytes in the call where
the engine has no slab), ``check_blocks`` is the pool's own verb, and ``peer`` and
``describe`` hand out what the engine needs once (its NIXL data, its layout).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tessera_ray.actors._announcer import WRITE_BEHIND
from tessera_ray.actors._client_plan import FetchPlan, FetchResult
from tessera_ray.actors.channel import ChannelServer
from tessera_ray.actors.directory import Holder, Tier
from tessera_ray.actors.links import DirectoryLink
from tessera_ray.actors.messages import BlockFailure, PinTicket, StoredBlock
from tessera_ray.actors.pool_service import PoolService
from tessera_ray.actors.tenancy import Access
from tessera_ray.core.results import BlockHash, TokenKey
from tessera_ray.core.shm import SlabInfo, SlabMapping, is_slab_path
from tessera_ray.errors import PageShapeError, PeerMappingError

__all__ = ["EngineSide", "EngineSlabs", "Found", "serve_channel", "reap_forever", "every"]

log = logging.getLogger(__name__)

Found = tuple[BlockHash, tuple[Holder, ...]]
"""A ``find`` answer per block: the hash it was sealed under and where it is held."""
Pinned = tuple[list[Found | None], PinTicket | None]
"""A ``find`` answer with the run held here pinned (``find_pinned``)."""

FetchFrom = Callable[[str, Access, list[TokenKey]], Awaitable[Sequence[BlockFailure | None]]]
"""Pull blocks from an owner into this pool (the actor's fetcher)."""


class EngineSlabs:
    """The shared-memory slabs of engines on this node that this pool has mapped, by path.

    An engine moves a store's bytes and a read's answer through slabs of its own (made by
    :func:`~tessera_ray.core.shm.shared_host_zeros`), named in the call: the pool copies a
    store's rows from the slab straight into its pages (``store_mapped``) and a read's blocks
    into the slab (``read_into``), instead of carrying them pickled through a socket. Only slab
    files in the pool's own shared-memory directory are mapped (a caller cannot have the pool
    read or write any other file); a few are kept open, the ones whose engine is gone closed
    first."""

    LIMIT = 16

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory
        self._maps: dict[str, SlabMapping] = {}

    def rows(self, info: SlabInfo, count: int) -> np.ndarray:
        """The first ``count`` rows of the slab ``info`` describes, in place."""
        if self.directory is None or not is_slab_path(info.path, str(self.directory)):
            raise PeerMappingError(
                f"{info.path!r} is not a slab in this pool's shared memory directory "
                f"({self.directory})"
            )
        mapping = self._maps.get(info.path)
        if mapping is None or mapping.closed or mapping.info != info:
            if mapping is not None:
                mapping.close()
            self._trim()
            mapping = self._maps[info.path] = SlabMapping(info, writable=True)
        return mapping.pages(count)

    def _trim(self) -> None:
        for path, mapping in list(self._maps.items()):
            if not mapping.owner_alive():
                mapping.close()
                del self._maps[path]
        while len(self._maps) >= self.LIMIT:
            path = next(iter(self._maps))
            self._maps.pop(path).close()

    def close(self) -> None:
        for mapping in self._maps.values():
            mapping.close()
        self._maps.clear()


class EngineSide:
    """The handlers an engine on this node calls over the channel (module docstring)."""

    def __init__(
        self,
        svc: PoolService,
        directory: DirectoryLink,
        fetch_from: FetchFrom,
        purge: Callable[[str], Awaitable[None]],
        describe: Callable[[], Any],
        peer: Callable[[], Any],
    ) -> None:
        self.svc = svc
        self.directory = directory
        self._fetch_from = fetch_from
        self._purge = purge
        self._here = (Holder(svc.name, Tier.MEMORY),)
        self.slabs = EngineSlabs(svc.config.shared_memory_dir)
        self._pulling: dict[TokenKey, asyncio.Task[FetchResult]] = {}
        """Blocks an early pull (:meth:`_pull_soon`) is bringing here, by key."""
        self.handlers: dict[str, Callable[..., Any]] = {
            "find": self.find,
            "find_pinned": self.find_pinned,
            "pull": self.pull,
            "store": self.store,
            "store_mapped": self.store_mapped,
            "read_blocks": svc.read_blocks,
            "read_into": self.read_into,
            "check_blocks": svc.check_blocks,
            "describe": describe,
            "peer": peer,
        }

    def find(
        self, access: Access, keys: list[TokenKey]
    ) -> list[Found | None] | Awaitable[list[Found | None]]:
        """Per key, its hash and holders, or ``None``: the run this pool holds in memory is
        answered at once (in the channel's callback); only the rest is asked of the directory."""
        found = self._resident_run(access, keys)
        if len(found) == len(keys):
            return found
        return self._ask_directory(access, keys, found)

    def find_pinned(self, access: Access, keys: list[TokenKey]) -> Pinned | Awaitable[Pinned]:
        """:meth:`find`, with the run this pool holds in memory pinned for the engine's worker
        (``None``: nothing held here): the worker reads it in place without asking the pool
        again, so its read starts the moment its step does. Unpinned by whoever ends up not
        reading it (or by the pin's lease)."""
        found = self._resident_run(access, keys)
        ticket = self.svc.pin_resident(access, keys[: len(found)]) if found else None
        if len(found) == len(keys):
            return found, ticket
        return self._rest_pinned(access, keys, found, ticket)

    async def _rest_pinned(
        self,
        access: Access,
        keys: list[TokenKey],
        found: list[Found | None],
        ticket: PinTicket | None,
    ) -> Pinned:
        try:
            return await self._ask_directory(access, keys, found), ticket
        except BaseException:
            if ticket is not None:
                self.svc.unpin(ticket.id)
            raise

    def _resident_run(self, access: Access, keys: list[TokenKey]) -> list[Found | None]:
        """The leading keys this pool holds in memory, with their hashes."""
        found: list[Found | None] = []
        for h in self.svc.resident_hashes(access, keys):
            if h is None:
                break
            found.append((h, self._here))
        return found

    async def _ask_directory(
        self, access: Access, keys: list[TokenKey], found: list[Found | None]
    ) -> list[Found | None]:
        results = await self.directory.lookup(access, keys[len(found) :])
        found = [*found, *((r.block_hash, Holder.of(r)) if r else None for r in results)]
        self._pull_soon(access, keys, found)
        return found

    def _pull_soon(self, access: Access, keys: list[TokenKey], found: list[Found | None]) -> None:
        """Start pulling what ``find`` placed elsewhere now, not when the engine's worker
        asks a step later: the worker's ``pull`` then waits for this one and usually finds
        every block here."""
        away = [
            (key, f[1])
            for key, f in zip(keys, found, strict=True)
            if f is not None and self._here[0] not in f[1] and key not in self._pulling
        ]
        if not away:
            return
        ks, holders = [k for k, _ in away], [h for _, h in away]
        task = asyncio.get_running_loop().create_task(self._pull_held(access, ks, holders))
        for key in ks:
            self._pulling[key] = task
        task.add_done_callback(lambda t: self._pulled(t, ks))

    def _pulled(self, task: asyncio.Task[FetchResult], keys: list[TokenKey]) -> None:
        for key in keys:
            if self._pulling.get(key) is task:
                del self._pulling[key]
        if not task.cancelled() and task.exception() is not None:
            # Nothing waits on an early pull but the worker's, which pulls again what is missing.
            log.info("pool %s: an early pull failed: %s", self.svc.name, task.exception())

    async def store(
        self, access: Access, keys: list[TokenKey], payloads: np.ndarray
    ) -> list[StoredBlock]:
        """:meth:`PoolService.store`, answered once the pages are written: the directory
        learns of them right after (:mod:`~tessera_ray.actors._announcer`)."""
        WRITE_BEHIND.set(True)  # this call's own task: the pool's other calls still wait
        return await self.svc.store(access, keys, payloads)

    async def store_mapped(
        self, access: Access, keys: list[TokenKey], slab: SlabInfo, count: int
    ) -> list[StoredBlock]:
        """Store ``count`` rows the engine wrote into its slab ``slab`` (:class:`EngineSlabs`);
        the engine reuses the slab once this answers."""
        if count != len(keys):
            raise PageShapeError(f"{count} staged rows for {len(keys)} token keys")
        return await self.store(access, keys, self.slabs.rows(slab, count))

    async def read_into(
        self, access: Access, keys: list[TokenKey], slab: SlabInfo
    ) -> tuple[BlockHash | None, ...]:
        """:meth:`PoolService.read_blocks`, the held blocks' bytes written into the engine's
        slab ``slab`` in key order (rows 0, 1, ...); answers each key's hash (``None``: not
        held). The engine reads the rows once this answers."""
        return await self.svc.read_into(access, keys, self.slabs.rows(slab, len(keys)))

    async def pull(
        self, access: Access, keys: list[TokenKey], holders: list[tuple[Holder, ...] | None]
    ) -> FetchResult:
        """Fetch into this pool what a ``find`` placed elsewhere (one pull per owner), after
        the early pulls of any of these blocks end; what they brought here is not pulled again."""
        early = {self._pulling[k] for k in keys if k in self._pulling}
        if early:
            await asyncio.wait(early)
        here = self.svc.resident_hashes(access, keys)
        rest = [i for i, h in enumerate(here) if h is None]
        return await self._pull_held(access, [keys[i] for i in rest], [holders[i] for i in rest])

    async def _pull_held(
        self, access: Access, keys: list[TokenKey], holders: Sequence[Sequence[Holder] | None]
    ) -> FetchResult:
        plan = FetchPlan(self.svc.name, keys, holders)
        return await plan.run(lambda owner, ks: self._fetch_from(owner, access, ks), self._purge)


async def serve_channel(
    svc: PoolService, host: str, engine: EngineSide | None = None
) -> ChannelServer | None:
    """The pool's channel, listening on ``host`` (``engine``: also the engine's verbs);
    ``None`` when no port can be had (readers then keep pinning through Ray)."""

    def pin(access: Access, keys: list[TokenKey]) -> PinTicket | Awaitable[PinTicket]:
        # Answered at once when every block is in memory or nowhere (the usual case), else the
        # awaitable of the full pin (which restores from disk).
        ticket = svc.pin_resident(access, keys)
        return ticket if ticket is not None else svc.pin(access, keys)

    def unpin(pin_id: int) -> None:
        svc.unpin(pin_id)

    handlers: dict[str, Callable[..., Any]] = {
        "pin": pin,
        "unpin": unpin,
        "lookup": svc.resident_hashes,
    }
    if engine is not None:
        handlers.update(engine.handlers)
    server = ChannelServer(handlers, host=host)
    try:
        await server.start()
    except OSError as e:
        log.warning("pool %s serves no channel: %s", svc.name, e)
        return None
    return server


async def reap_forever(svc: PoolService) -> None:
    """Return expired leases' references, a few times per lease."""
    while True:
        await asyncio.sleep(min(1.0, svc.config.lease_s / 4))
        svc.reap()


async def every(interval_s: float, what: str, step: Callable[[], None]) -> None:
    """Run ``step`` every ``interval_s``; a failing step is logged and tried again next time
    (a metrics hiccup must not stop the exports for good)."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            step()
        except Exception:
            log.exception("%s failed", what)
