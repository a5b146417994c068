"""The channels one caller keeps open to named actors (pools, directory shards): connected at
first use from an address the actor gives through Ray, one per actor per event loop, and after
a failed try left alone for a while (the caller goes through Ray meanwhile).

Why per event loop: a channel's connection belongs to the loop that opened it, and some callers
run in several (the client's blocking methods each run a loop of their own); a channel taken
from another loop would be read by nobody.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Awaitable, Callable

from tessera_ray.actors.channel import ChannelAddress, ChannelClient, ChannelError

__all__ = ["CHANNEL_RETRY_S", "ONE_CALL_LOOP", "ChannelBook"]

log = logging.getLogger(__name__)

CHANNEL_RETRY_S = 10.0
"""After an actor's channel could not be reached, how long its calls go through Ray before the
channel is tried again (each try is a Ray call to learn the address)."""
_CONNECT_S = 5.0

ONE_CALL_LOOP: contextvars.ContextVar[bool] = contextvars.ContextVar("one_call_loop", default=False)
"""Set where a loop runs one call and ends (the client's blocking methods): a channel opened
there would serve one request and cost more than the Ray call it replaces."""

AddressOf = Callable[[], Awaitable[ChannelAddress | None]]
"""Asks the actor (through Ray) where its channel is; ``None``: it serves none."""


def _loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class ChannelBook:
    """Open channels by actor name (``label`` names the caller in logs)."""

    def __init__(self, label: str) -> None:
        self.label = label
        self._open: dict[tuple[str, asyncio.AbstractEventLoop], ChannelClient | None] = {}
        """Per actor and loop: the open channel, or ``None`` where the actor serves none."""
        self._retry_at: dict[str, float] = {}

    async def get(
        self, name: str, address: AddressOf, unreachable: tuple[type[BaseException], ...]
    ) -> ChannelClient | None:
        """The open channel to ``name``, connecting on first use; ``None`` when it serves none
        or could not be reached lately (``unreachable``: what asking its address raises then)."""
        loop = asyncio.get_running_loop()
        key = (name, loop)
        if key in self._open:
            known = self._open[key]
            if known is None or not known.closed:
                return known
        if time.monotonic() < self._retry_at.get(name, 0.0):
            return None
        failures: tuple[type[BaseException], ...] = (ChannelError, TimeoutError, *unreachable)
        try:
            where = await address()
            client = None if where is None else await ChannelClient.connect(where, _CONNECT_S)
        except failures as e:
            log.info("%s: no channel to %s (%s); calling through Ray", self.label, name, e)
            self._retry_at[name] = time.monotonic() + CHANNEL_RETRY_S
            return None
        known = self._open.get(key)
        if known is not None and not known.closed:
            # Another call connected meanwhile: keep one connection per actor.
            if client is not None:
                client.close()
            return known
        self._forget_closed_loops()
        self._open[key] = client
        return client

    def open(self, name: str) -> ChannelClient | None:
        """The channel to ``name`` if one is open now on this loop (no connecting)."""
        loop = _loop()
        known = self._open.get((name, loop)) if loop is not None else None
        return known if known is not None and not known.closed else None

    def serves_none(self, name: str) -> bool:
        """Whether ``name`` was found to serve no channel (on any loop)."""
        return any(n == name and c is None for (n, _), c in self._open.items())

    def drop(self, name: str) -> None:
        """Forget ``name``'s channels (they broke, or lead to a process that is gone); the next
        call connects again."""
        self._retry_at.pop(name, None)
        here = _loop()
        for key in [k for k in self._open if k[0] == name]:
            client = self._open.pop(key)
            # Only this loop may close its connections; another loop's goes with that loop.
            if client is not None and key[1] is here:
                client.close()

    def close(self) -> None:
        """Close every channel (the caller shuts down)."""
        for name in {n for n, _ in self._open}:
            self.drop(name)

    def _forget_closed_loops(self) -> None:
        for key in [k for k in self._open if k[1].is_closed()]:
            del self._open[key]
