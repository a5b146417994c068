"""The :class:`~tessera_ray.actors.fetcher.OwnerLink` of a pool actor: the owner pool's actor
handle and its pin channel, each looked up once per owner and dropped when the owner fails.
Pins and unpins go over the channel where the owner serves one (no Ray call on the fetch
path), else, or when it breaks, as Ray calls. Every failure to reach the owner leaves here as
a :class:`~tessera_ray.errors.PoolUnavailableError`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import numpy as np
import ray

from tessera_ray.actors._ray_names import CALL_TIMEOUT_S, DEAD
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
        self.handles: dict[str, Any] = {}
        """Actor handles of the owners fetched from (dropped when one fails)."""
        self.channels: dict[str, ChannelClient | None] = {}
        """Per owner, the open channel to it, or ``None`` where it serves none (Ray only)."""

    def link(self, owner_name: str) -> RayOwnerLink:
        return RayOwnerLink(self, owner_name)

    def handle(self, owner_name: str) -> Any:
        """The owner's actor handle, looked up once: a lookup is a blocking call to Ray's
        control store, on this actor's event loop, on every fetch otherwise."""
        handle = self.handles.get(owner_name)
        if handle is None:
            try:
                handle = ray.get_actor(owner_name, namespace=self.ray_namespace)
            except ValueError as exc:  # no actor of that name (yet)
                raise _unavailable(owner_name, exc) from exc
            self.handles[owner_name] = handle
        return handle

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
            owner = self.handle(owner_name)
            address = await asyncio.wait_for(owner.channel.remote(), CALL_TIMEOUT_S)
            client = None if address is None else await ChannelClient.connect(address, 5.0)
        except ChannelError as e:
            log.info(
                "pool %s: no channel to %s (%s); pinning through Ray", self.pool_name, owner_name, e
            )
            return None  # asked again next time: the owner may be back
        except (*DEAD, TimeoutError) as exc:
            raise _unavailable(owner_name, exc) from exc
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
        self._ref: Any = None if call is not None else link.owner.pin.remote(access, keys)

    async def answer(self, timeout_s: float) -> PinTicket:
        link = self._link
        try:
            if self._call is not None:
                try:
                    ticket: PinTicket = await self._call.answer(timeout_s)
                    return ticket
                except ChannelError:  # broken or refused: the Ray call decides
                    link.links.channels.pop(link.name, None)
                    self._ref = link.owner.pin.remote(self._access, self._keys)
            return await asyncio.wait_for(self._ref, timeout_s)
        except (*DEAD, TimeoutError) as exc:
            raise _unavailable(link.name, exc) from exc

    def cancel(self) -> None:
        if self._call is not None:
            self._call.cancel()  # an answered pin is reaped when its lease ends


class RayOwnerLink:
    """One owner pool, reached through Ray and its pin channel."""

    def __init__(self, links: RayOwnerLinks, name: str) -> None:
        self.links = links
        self.name = name

    @property
    def owner(self) -> Any:
        return self.links.handle(self.name)

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
        try:
            found: PeerInfo | None = await asyncio.wait_for(
                self.owner.peer_info.remote(), CALL_TIMEOUT_S
            )
        except (*DEAD, TimeoutError) as exc:
            raise _unavailable(self.name, exc) from exc
        return found

    async def read_pinned(self, pin_id: int, timeout_s: float) -> np.ndarray:
        try:
            payload: np.ndarray = await asyncio.wait_for(
                self.owner.read_pinned.remote(pin_id), timeout_s
            )
        except DEAD as exc:
            raise _unavailable(self.name, exc) from exc
        return payload

    def unpin(self, pin_id: int) -> None:
        if send_if_open(self.links.channels.get(self.name), "unpin", pin_id):
            return
        try:
            self.owner.unpin.remote(pin_id)
        except PoolUnavailableError:
            pass  # the pin ends with its lease

    async def check_after_unpin(self, pin_id: int, access: Access, keys: list[TokenKey]) -> None:
        # Through Ray, not the channel: its answer says when the unpin landed (a block still
        # pinned cannot be dropped).
        try:
            await self.owner.unpin.remote(pin_id)
            await self.owner.check_blocks.remote(access, keys)
        except DEAD as exc:
            raise _unavailable(self.name, exc) from exc

    def forget(self) -> None:
        # A pool of that name may come back as another actor.
        self.links.handles.pop(self.name, None)
        self.links.drop_channel(self.name)

    def restarted(self) -> None:
        if self.links.channels.get(self.name, False) is None:
            # The new process may serve a channel the old one did not.
            self.links.channels.pop(self.name, None)
