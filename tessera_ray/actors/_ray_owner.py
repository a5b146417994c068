"""The :class:`~tessera_ray.actors.fetcher.OwnerLink` of a pool actor: the owner pool's actor
handle and its pin channel, each looked up once per owner and dropped when the owner fails.
Pins and unpins go over the channel where the owner serves one (no Ray call on the fetch
path), else, or when it breaks, as Ray calls. Every failure to reach the owner leaves here as
a :class:`~tessera_ray.errors.PoolUnavailableError`.
"""

from __future__ import annotations

import asyncio
import logging

import numpy as np

from tessera_ray.actors._ray_handles import ActorCache, PoolRef
from tessera_ray.actors.channel import ChannelClient, ChannelError, PendingCall, send_if_open
from tessera_ray.actors.directory_actor import ShardedDirectory
from tessera_ray.actors.messages import PinTicket
from tessera_ray.actors.tenancy import Access
from tessera_ray.core.results import TokenKey
from tessera_ray.errors import PoolUnavailableError
from tessera_ray.transport import PeerInfo

__all__ = ["RayOwnerLinks", "RayOwnerLink"]

log = logging.getLogger(__name__)


def _unavailable(owner: str, exc: BaseException) -> PoolUnavailableError:
    return PoolUnavailableError(f"owner {owner} unavailable: {type(exc).__name__}")


class RayOwnerLinks:
    """What one pool actor knows of the owners it fetches from."""

    def __init__(
        self, pool_name: str, ray_namespace: str, directory: ShardedDirectory, channels: bool
    ) -> None:
        self.pool_name = pool_name
        self.ray_namespace = ray_namespace
        self.directory = directory
        self.use_channels = channels
        self.actors = ActorCache(ray_namespace)
        """Actor handles of the owners fetched from (dropped when one fails)."""
        self.channels: dict[str, ChannelClient | None] = {}
        """Per owner, the open channel to it, or ``None`` where it serves none (Ray only)."""

    def link(self, owner_name: str) -> RayOwnerLink:
        return RayOwnerLink(self, owner_name)

    def ref(self, owner_name: str) -> PoolRef:
        return PoolRef(self.actors, owner_name)

    async def channel(self, owner_name: str) -> ChannelClient | None:
        """The open channel to ``owner_name``, connecting on first use; ``None`` when this pool
        or the owner does not use one, or it cannot be reached (pins then go through Ray)."""
        if not self.use_channels:
            return None
        if owner_name in self.channels:
            known = self.channels[owner_name]
            if known is None or not known.closed:
                return known
        try:
            address = await self.ref(owner_name).channel()
            client = None if address is None else await ChannelClient.connect(address, 5.0)
        except ChannelError as e:
            log.info(
                "pool %s: no channel to %s (%s); pinning through Ray", self.pool_name, owner_name, e
            )
            return None  # asked again next time: the owner may be back
        known = self.channels.get(owner_name)
        if known is not None and not known.closed:
            # Another fetch connected meanwhile: keep one connection per owner.
            if client is not None:
                client.close()
            return known
        self.channels[owner_name] = client
        return client

    def drop_channel(self, owner_name: str) -> None:
        client = self.channels.pop(owner_name, None)
        if client is not None:
            client.close()


class _RayPendingPin:
    """A pin sent over the channel (answered there, or by a Ray call if the channel breaks) or
    as a Ray call."""

    def __init__(
        self, link: RayOwnerLink, access: Access, keys: list[TokenKey], call: PendingCall | None
    ) -> None:
        self._link = link
        self._access = access
        self._keys = keys
        self._call = call
        self._ray: asyncio.Future[PinTicket] | None = None if call is not None else self._by_ray()

    def _by_ray(self) -> asyncio.Future[PinTicket]:
        # Started now (sent at the loop's next turn), not when awaited: the pin travels while
        # the reader reserves its slots.
        return asyncio.ensure_future(self._link.ref.pin(self._access, self._keys, None))

    async def answer(self, timeout_s: float) -> PinTicket:
        link = self._link
        try:
            if self._call is not None:
                try:
                    ticket: PinTicket = await self._call.answer(timeout_s)
                    return ticket
                except ChannelError:  # broken or refused: the Ray call decides
                    link.links.channels.pop(link.name, None)
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


class RayOwnerLink:
    """One owner pool, reached through Ray and its pin channel."""

    def __init__(self, links: RayOwnerLinks, name: str) -> None:
        self.links = links
        self.name = name

    @property
    def ref(self) -> PoolRef:
        return self.links.ref(self.name)

    async def pin(self, access: Access, keys: list[TokenKey]) -> _RayPendingPin:
        channel = await self.links.channel(self.name)
        call: PendingCall | None = None
        if channel is not None:
            try:
                call = channel.request("pin", access, keys)
            except ChannelError:
                self.links.channels.pop(self.name, None)
        return _RayPendingPin(self, access, keys, call)

    async def peer_info(self) -> PeerInfo | None:
        """From the directory first (no call to a busy owner), else from the owner."""
        info = await self.links.directory.peer(self.name)
        if info is not None:
            return info
        return await self.ref.peer_info()

    async def read_pinned(self, pin_id: int, timeout_s: float) -> np.ndarray:
        return await self.ref.read_pinned(pin_id, timeout_s)

    def unpin(self, pin_id: int) -> None:
        if send_if_open(self.links.channels.get(self.name), "unpin", pin_id):
            return
        self.ref.unpin_soon(pin_id)  # if it is lost, the pin ends with its lease

    async def check_after_unpin(self, pin_id: int, access: Access, keys: list[TokenKey]) -> None:
        # Through Ray, not the channel: its answer says when the unpin landed (a block still
        # pinned cannot be dropped).
        await self.ref.unpin(pin_id)
        await self.ref.check_blocks(access, keys)

    def forget(self) -> None:
        # A pool of that name may come back as another actor.
        self.links.actors.forget(self.name)
        self.links.drop_channel(self.name)

    def restarted(self) -> None:
        if self.links.channels.get(self.name, False) is None:
            # The new process may serve a channel the old one did not.
            self.links.channels.pop(self.name, None)
