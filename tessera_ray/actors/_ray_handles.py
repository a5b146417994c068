"""The Ray boundary of the actors package: actor names, handles looked up once, and typed
calls that apply a deadline and turn every way of not reaching an actor (dead, restarting,
not yet named, too slow) into one error: :class:`PoolUnavailableError` for a pool,
:class:`DirectoryUnavailableError` for a directory shard. Callers branch on those types."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, TypeVar, cast

import numpy as np
import ray
import torch

from tessera_ray.actors._channel_book import ONE_CALL_LOOP, ChannelBook
from tessera_ray.actors.channel import ChannelAddress, ChannelError
from tessera_ray.actors.config import PoolServiceConfig
from tessera_ray.actors.directory import (
    DirectoryStats,
    LookupResult,
    Registration,
    Registrations,
    Tier,
)
from tessera_ray.actors.messages import (
    BlockCheck,
    BlockFailure,
    BlockReads,
    EvictionReport,
    PinTicket,
    PoolStatus,
    Reservation,
    StoredBlock,
)
from tessera_ray.actors.tenancy import Access
from tessera_ray.core.results import BlockHash, TokenKey
from tessera_ray.errors import DirectoryUnavailableError, PoolUnavailableError
from tessera_ray.layout import ModelLayout
from tessera_ray.transport import PeerInfo

__all__ = [
    "POOL_PREFIX",
    "DIR_PREFIX",
    "DEAD",
    "UNREACHABLE",
    "CALL_TIMEOUT_S",
    "shard_name",
    "start_this_actor",
    "ActorCache",
    "PoolRef",
    "ShardRef",
]

POOL_PREFIX = "tessera-pool-"
DIR_PREFIX = "tessera-dir-"
DEAD = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)
"""What a call to an actor whose process is gone raises."""
UNREACHABLE = (
    *DEAD,
    ValueError,
    TimeoutError,
    ray.exceptions.GetTimeoutError,
    ray.exceptions.ObjectLostError,
)
"""Everything that means "that actor did not answer" (``ValueError``: no actor of that name;
``ObjectLostError``: the call's arguments or answer could not be moved, e.g. their owner is
gone)."""
CALL_TIMEOUT_S = 10.0
"""The deadline of a control call (status, purge, abort); data calls name their own."""

T = TypeVar("T")


def shard_name(i: int) -> str:
    return f"{DIR_PREFIX}{i}"


def start_this_actor() -> None:
    """From an actor's constructor: call its own ``ready`` once the constructor returns (what
    starts its background work), without waiting for the answer."""
    ray.get_runtime_context().current_actor.ready.remote()


class ActorCache:
    """Handles of the named actors of one Ray namespace, each looked up once: a lookup is a
    blocking call to Ray's control store. A handle survives its actor's restarts; one whose
    call failed is looked up again next time (the name may now be a new actor)."""

    def __init__(self, ray_namespace: str) -> None:
        self.ray_namespace = ray_namespace
        self._handles: dict[str, Any] = {}
        self.shard_channels = ChannelBook(f"directory caller in {ray_namespace!r}")
        """The directory shards' channels (:class:`ShardRef`'s hot calls go over them)."""

    def get(self, name: str) -> Any:
        handle = self._handles.get(name)
        if handle is None:
            handle = self._handles[name] = ray.get_actor(name, namespace=self.ray_namespace)
        return handle

    def forget(self, name: str) -> None:
        self._handles.pop(name, None)

    async def call(
        self,
        name: str,
        what: str,
        method: str,
        args: tuple[object, ...],
        timeout_s: float | None,
        unavailable: type[PoolUnavailableError] | type[DirectoryUnavailableError],
    ) -> Any:
        try:
            ref = getattr(self.get(name), method).remote(*args)
            return await asyncio.wait_for(ref, timeout_s)
        except UNREACHABLE as exc:
            self.forget(name)
            raise unavailable(f"{what} did not answer {method}: {type(exc).__name__}") from exc

    def call_now(
        self,
        name: str,
        what: str,
        method: str,
        args: tuple[object, ...],
        timeout_s: float,
        unavailable: type[PoolUnavailableError] | type[DirectoryUnavailableError],
    ) -> Any:
        """:meth:`call`, blocking: for synchronous callers that may run inside an event loop
        (a Serve replica's constructor), where a coroutine cannot be run to completion."""
        try:
            return ray.get(getattr(self.get(name), method).remote(*args), timeout=timeout_s)
        except UNREACHABLE as exc:
            self.forget(name)
            raise unavailable(f"{what} did not answer {method}: {type(exc).__name__}") from exc


class PoolRef:
    """A pool actor, as its callers see it: the verbs of
    :class:`~tessera_ray.actors.pool_api.PoolApi` (same signatures, a test checks), the shell's
    own calls, and one error when it is unreachable."""

    def __init__(self, actors: ActorCache, name: str) -> None:
        self.actors = actors
        self.name = name

    async def _call(self, method: str, *args: object, timeout_s: float | None = None) -> Any:
        what = f"pool {self.name}"
        return await self.actors.call(
            self.name, what, method, args, timeout_s, PoolUnavailableError
        )

    # ------------------------------------------------------------------ PoolApi

    async def reserve(self, num_blocks: int, lease_s: float | None = None) -> Reservation:
        return cast(Reservation, await self._call("reserve", num_blocks, lease_s))

    async def commit(
        self,
        reservation_id: int,
        access: Access,
        token_keys: Sequence[TokenKey],
        payloads: np.ndarray | torch.Tensor,
    ) -> list[StoredBlock]:
        args = (reservation_id, access, list(token_keys), payloads)
        return cast(list[StoredBlock], await self._call("commit", *args))

    async def abort(self, reservation_id: int) -> None:
        await self._call("abort", reservation_id, timeout_s=CALL_TIMEOUT_S)

    async def store(
        self, access: Access, token_keys: Sequence[TokenKey], payloads: np.ndarray | torch.Tensor
    ) -> list[StoredBlock]:
        stored = await self._call("store", access, list(token_keys), payloads)
        return cast(list[StoredBlock], stored)

    async def contains(
        self, access: Access, token_keys: Sequence[TokenKey], touch: bool = False
    ) -> list[Tier | None]:
        found = await self._call("contains", access, list(token_keys), touch)
        return cast(list[Tier | None], found)

    async def pin(
        self,
        access: Access,
        token_keys: Sequence[TokenKey],
        lease_s: float | None = None,
        timeout_s: float | None = None,
    ) -> PinTicket:
        ticket = await self._call("pin", access, list(token_keys), lease_s, timeout_s=timeout_s)
        return cast(PinTicket, ticket)

    async def unpin(self, pin_id: int) -> bool:
        return cast(bool, await self._call("unpin", pin_id, timeout_s=CALL_TIMEOUT_S))

    async def read_pinned(self, pin_id: int, timeout_s: float | None = None) -> np.ndarray:
        return cast(np.ndarray, await self._call("read_pinned", pin_id, timeout_s=timeout_s))

    async def read(self, access: Access, token_keys: Sequence[TokenKey]) -> list[np.ndarray | None]:
        return cast(list[np.ndarray | None], await self._call("read", access, list(token_keys)))

    async def read_blocks(self, access: Access, token_keys: Sequence[TokenKey]) -> BlockReads:
        return cast(BlockReads, await self._call("read_blocks", access, list(token_keys)))

    async def check_blocks(
        self, access: Access, token_keys: Sequence[TokenKey]
    ) -> list[BlockCheck]:
        found = await self._call("check_blocks", access, list(token_keys))
        return cast(list[BlockCheck], found)

    async def attend(
        self,
        access: Access,
        token_keys: Sequence[TokenKey],
        positions: Sequence[int],
        layer: int,
        q: torch.Tensor,
        seqlen: int,
        softmax_scale: float,
        causal: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        args = (access, list(token_keys), list(positions), layer, q, seqlen, softmax_scale, causal)
        return cast(tuple[torch.Tensor, torch.Tensor, list[int]], await self._call("attend", *args))

    async def evict(self, num_blocks: int) -> EvictionReport:
        return cast(EvictionReport, await self._call("evict", num_blocks))

    async def inventory(self) -> list[Registration]:
        return cast(list[Registration], await self._call("inventory", timeout_s=CALL_TIMEOUT_S))

    async def status(self, timeout_s: float = CALL_TIMEOUT_S) -> PoolStatus:
        return cast(PoolStatus, await self._call("status", timeout_s=timeout_s))

    # ------------------------------------------------------------------ the shell's own

    async def fetch_from(
        self, owner: str, access: Access, token_keys: Sequence[TokenKey]
    ) -> list[BlockFailure | None]:
        found = await self._call("fetch_from", owner, access, list(token_keys))
        return cast(list[BlockFailure | None], found)

    def unpin_soon(self, pin_id: int) -> None:
        """Send an unpin without waiting for it (its answer changes nothing for the caller)."""
        try:
            self.actors.get(self.name).unpin.remote(pin_id)
        except UNREACHABLE:
            self.actors.forget(self.name)

    async def channel(self) -> ChannelAddress | None:
        return cast(ChannelAddress | None, await self._call("channel", timeout_s=CALL_TIMEOUT_S))

    async def peer_info(self, timeout_s: float = CALL_TIMEOUT_S) -> PeerInfo | None:
        return cast(PeerInfo | None, await self._call("peer_info", timeout_s=timeout_s))

    async def health(self, timeout_s: float) -> bool:
        return cast(bool, await self._call("health", timeout_s=timeout_s))

    def describe_now(self) -> tuple[ModelLayout, PoolServiceConfig, int]:
        """The pool's layout, settings and shard count, blocking (:meth:`ActorCache.call_now`)."""
        found = self.actors.call_now(
            self.name, f"pool {self.name}", "describe", (), CALL_TIMEOUT_S, PoolUnavailableError
        )
        return cast(tuple[ModelLayout, PoolServiceConfig, int], found)

    async def flush_metrics(self) -> None:
        await self._call("flush_metrics", timeout_s=CALL_TIMEOUT_S)


class ShardRef:
    """A directory shard actor: typed methods, one error when it is unreachable."""

    def __init__(self, actors: ActorCache, index: int) -> None:
        self.actors = actors
        self.index = index
        self.name = shard_name(index)

    async def _call(self, method: str, *args: object, timeout_s: float | None) -> Any:
        what = f"directory shard {self.index}"
        unavailable = DirectoryUnavailableError
        return await self.actors.call(self.name, what, method, args, timeout_s, unavailable)

    async def _hot(self, method: str, *args: object, timeout_s: float) -> Any:
        """A call every lookup or store makes: over the shard's channel, where a Ray actor call
        would cost both processes several times the CPU (the shards' and pools' CPU under a
        serving load was mostly Ray's: docs/connector-cost.md); through Ray where there is no
        channel, or when it breaks. Each of these calls may be repeated: a register or a drop
        sent again after a break changes nothing twice."""
        book = self.actors.shard_channels
        channel = None
        if not ONE_CALL_LOOP.get():
            channel = await book.get(self.name, self.channel, (DirectoryUnavailableError,))
        if channel is not None:
            try:
                # No wait on the socket: the caller's loop (a pool's) has other work meanwhile.
                return await channel.request(method, *args).answer(timeout_s, poll_s=0.0)
            except ChannelError:
                book.drop(self.name)
            except TimeoutError as exc:
                raise DirectoryUnavailableError(
                    f"directory shard {self.index} did not answer {method} in {timeout_s} s"
                ) from exc
        return await self._call(method, *args, timeout_s=timeout_s)

    async def channel(self) -> ChannelAddress | None:
        return cast(ChannelAddress | None, await self._call("channel", timeout_s=CALL_TIMEOUT_S))

    async def lookup(
        self, access: Access, token_keys: Sequence[TokenKey], timeout_s: float = CALL_TIMEOUT_S
    ) -> list[LookupResult | None]:
        found = await self._hot("lookup", access, list(token_keys), timeout_s=timeout_s)
        return cast(list[LookupResult | None], found)

    async def register(self, entries: Sequence[Registration]) -> None:
        # As flat columns: a batch pickles as a few lists, not one tuple per entry.
        await self._hot("register", Registrations(entries), timeout_s=CALL_TIMEOUT_S)

    async def drop_replicas(
        self, pool: str, blocks: Sequence[tuple[str, BlockHash]], tier: Tier | None
    ) -> None:
        await self._hot("drop_replicas", pool, list(blocks), tier, timeout_s=CALL_TIMEOUT_S)

    async def purge_pool(self, pool: str) -> None:
        await self._call("purge_pool", pool, timeout_s=CALL_TIMEOUT_S)

    async def publish_peer(self, info: PeerInfo) -> None:
        await self._call("publish_peer", info, timeout_s=CALL_TIMEOUT_S)

    async def peer(self, name: str) -> PeerInfo | None:
        return cast(PeerInfo | None, await self._call("peer", name, timeout_s=CALL_TIMEOUT_S))

    async def stats(self, timeout_s: float = CALL_TIMEOUT_S) -> DirectoryStats:
        return cast(DirectoryStats, await self._call("stats", timeout_s=timeout_s))

    async def wait_rebuilt(self, timeout_s: float) -> bool:
        return cast(
            bool, await self._call("wait_rebuilt", timeout_s, timeout_s=timeout_s + CALL_TIMEOUT_S)
        )

    async def flush_metrics(self) -> None:
        await self._call("flush_metrics", timeout_s=CALL_TIMEOUT_S)
