"""The one link to a pool actor that every caller outside the pool uses: another pool fetching
from it (:class:`~tessera_ray.actors.fetcher.Fetcher`), the client, and the vLLM connector.

A link reaches its pool over the pool's channel first (lookups of what it holds, pins and unpins
without a Ray call, which costs several times a channel's round trip) and through Ray's typed
calls (:class:`~tessera_ray.actors._ray_handles.PoolRef`) otherwise or when the channel breaks.
It keeps per pool what a caller learns once: the actor handle, the open channel, and the pool's
incarnation (a new one means a new process: its transport agent and channel are new too). Every
failure to reach the pool leaves here as a :class:`~tessera_ray.errors.PoolUnavailableError`,
each call under a deadline.
"""

from __future__ import annotations

import asyncio
import logging

import numpy as np

from tessera_ray.actors._channel_book import ChannelBook
from tessera_ray.actors._ray_handles import CALL_TIMEOUT_S, ActorCache, PoolRef
from tessera_ray.actors.channel import ChannelClient, ChannelError, PendingCall, send_if_open
from tessera_ray.actors.links import ShardedDirectory
from tessera_ray.actors.messages import PinTicket
from tessera_ray.actors.tenancy import Access
from tessera_ray.core.results import BlockHash, TokenKey
from tessera_ray.errors import PoolUnavailableError
from tessera_ray.transport import PeerInfo

__all__ = ["PoolLinks", "PoolLink"]

log = logging.getLogger(__name__)


def _unavailable(owner: str, exc: BaseException) -> PoolUnavailableError:
    return PoolUnavailableError(f"pool {owner} unavailable: {type(exc).__name__}")


class PoolLinks:
    """What one caller knows of the pools it talks to.

    ``label`` names the caller in logs; ``channels``: use the pools' channels where they serve
    one; ``directory``: where a pool's transport data is asked first (a pool fetching from
    another does not add a call to a busy owner)."""

    def __init__(
        self,
        actors: ActorCache,
        *,
        label: str,
        channels: bool = True,
        directory: ShardedDirectory | None = None,
    ) -> None:
        self.actors = actors
        self.label = label
        self.use_channels = channels
        self.directory = directory
        self.channels = ChannelBook(label)
        self._incarnations: dict[str, int] = {}

    def link(self, name: str) -> PoolLink:
        return PoolLink(self, name)

    async def channel(self, name: str) -> ChannelClient | None:
        """The open channel to pool ``name``, connecting on first use; ``None`` when channels
        are off, the pool serves none, or it could not be reached lately (Ray then decides)."""
        if not self.use_channels:
            return None
        address = PoolRef(self.actors, name).channel
        return await self.channels.get(name, address, (PoolUnavailableError,))

    def open_channel(self, name: str) -> ChannelClient | None:
        """The channel to ``name`` if one is open now (no connecting)."""
        return self.channels.open(name)

    def drop_channel(self, name: str) -> None:
        self.channels.drop(name)

    def saw(self, name: str, incarnation: int) -> bool:
        """See :meth:`PoolLink.saw`. A new process of a known pool gets a new channel: the old
        one led to the process that is gone, and the new one may serve a channel where the old
        one did not."""
        known = self._incarnations.get(name)
        if known == incarnation:
            return False
        self._incarnations[name] = incarnation
        if known is not None or self.channels.serves_none(name):
            self.drop_channel(name)
        return True

    def close(self) -> None:
        """Close every channel (the caller shuts down); call on the loop that opened them."""
        self.channels.close()


class _PendingPin:
    """A pin sent over the channel (answered there, or by a Ray call if the channel breaks) or
    as a Ray call."""

    def __init__(
        self, link: PoolLink, access: Access, keys: list[TokenKey], call: PendingCall | None
    ) -> None:
        self._link = link
        self._access = access
        self._keys = keys
        self._call = call
        self._ray: asyncio.Future[PinTicket] | None = None if call is not None else self._by_ray()

    def _by_ray(self) -> asyncio.Future[PinTicket]:
        # Started now (sent at the loop's next turn), not when awaited: the pin travels while
        # the reader reserves its slots.
        return asyncio.ensure_future(self._link.ref.pin(self._access, self._keys))

    async def answer(self, timeout_s: float) -> PinTicket:
        link = self._link
        try:
            if self._call is not None:
                try:
                    ticket: PinTicket = await self._call.answer(timeout_s)
                    return ticket
                except ChannelError:  # broken or refused: the Ray call decides
                    link.links.drop_channel(link.name)
                    self._ray = self._by_ray()
            assert self._ray is not None
            return await asyncio.wait_for(self._ray, timeout_s)
        except TimeoutError as exc:
            raise _unavailable(link.name, exc) from exc

    def cancel(self) -> None:
        # An answered pin is reaped when its lease ends; the wait for an answer stops here.
        if self._call is not None:
            self._call.cancel()
        if self._ray is not None:
            self._ray.cancel()


class PoolLink:
    """One pool, reached over its channel and through Ray (an
    :class:`~tessera_ray.actors.fetcher.OwnerLink`, and the connector's and client's link)."""

    def __init__(self, links: PoolLinks, name: str) -> None:
        self.links = links
        self.name = name

    @property
    def ref(self) -> PoolRef:
        """The pool's typed Ray calls (those with no channel path)."""
        return PoolRef(self.links.actors, self.name)

    async def pin(self, access: Access, keys: list[TokenKey]) -> _PendingPin:
        """Send a pin; its answer is awaited later (:meth:`_PendingPin.answer`)."""
        channel = await self.links.channel(self.name)
        call: PendingCall | None = None
        if channel is not None:
            try:
                call = channel.request("pin", access, keys)
            except ChannelError:
                self.links.drop_channel(self.name)
        return _PendingPin(self, access, keys, call)

    async def pin_now(self, access: Access, keys: list[TokenKey], timeout_s: float) -> PinTicket:
        """Pin ``keys`` and wait for the ticket (at most ``timeout_s``)."""
        return await (await self.pin(access, keys)).answer(timeout_s)

    async def resident(
        self, access: Access, keys: list[TokenKey], timeout_s: float
    ) -> list[BlockHash | None] | None:
        """Per key, the hash of the block the pool holds in memory under it, asked over the
        channel; ``None`` when there is no channel to ask (the directory answers instead)."""
        channel = await self.links.channel(self.name)
        if channel is None:
            return None
        try:
            hashes: list[BlockHash | None] = await channel.call(
                "lookup", access, keys, timeout_s=timeout_s
            )
            return hashes
        except (ChannelError, TimeoutError) as exc:
            log.info("lookup over the channel to pool %s failed: %s", self.name, exc)
            self.links.drop_channel(self.name)
            return None

    async def peer_info(self, timeout_s: float = CALL_TIMEOUT_S) -> PeerInfo | None:
        """The pool's transport data: from the directory where the links have one (no call to
        a busy owner), else from the pool."""
        if self.links.directory is not None:
            info = await self.links.directory.peer(self.name)
            if info is not None:
                return info
        return await self.ref.peer_info(timeout_s)

    async def read_pinned(self, pin_id: int, timeout_s: float) -> np.ndarray:
        return await self.ref.read_pinned(pin_id, timeout_s=timeout_s)

    def unpin(self, pin_id: int) -> None:
        """End a pin without waiting (if it is lost, the pin ends with its lease)."""
        if not send_if_open(self.links.open_channel(self.name), "unpin", pin_id):
            self.ref.unpin_soon(pin_id)

    async def check_after_unpin(self, pin_id: int, access: Access, keys: list[TokenKey]) -> None:
        # Through Ray, not the channel: its answer says when the unpin landed (a block still
        # pinned cannot be dropped).
        await self.ref.unpin(pin_id)
        await self.ref.check_blocks(access, keys)

    def saw(self, incarnation: int) -> bool:
        """Record the incarnation a pool's answer carried; True when it is not the one seen
        before (first contact, or a new process under the same name)."""
        return self.links.saw(self.name, incarnation)

    def forget(self) -> None:
        """The pool failed: a pool of that name may come back as another actor."""
        self.links.actors.forget(self.name)
        self.links.drop_channel(self.name)
