"""What a pool process runs beside its calls, kept out of the Ray shell so it reads (and is
tested) as plain asyncio: the pin channel's handlers and the background loops."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from tessera_ray.actors.channel import ChannelServer
from tessera_ray.actors.messages import PinTicket
from tessera_ray.actors.pool_service import PoolService
from tessera_ray.actors.tenancy import Access
from tessera_ray.core.results import TokenKey

__all__ = ["serve_pin_channel", "reap_forever", "every"]

log = logging.getLogger(__name__)


async def serve_pin_channel(svc: PoolService, host: str) -> ChannelServer | None:
    """The pool's pin channel, listening on ``host``; ``None`` when no port can be had (readers
    then keep pinning through Ray)."""

    def pin(access: Access, keys: list[TokenKey]) -> PinTicket | Awaitable[PinTicket]:
        # Answered at once when every block is in memory or nowhere (the usual case), else the
        # awaitable of the full pin (which restores from disk).
        ticket = svc.pin_resident(access, keys)
        return ticket if ticket is not None else svc.pin(access, keys)

    def unpin(pin_id: int) -> None:
        svc.unpin(pin_id)

    server = ChannelServer({"pin": pin, "unpin": unpin, "lookup": svc.resident_hashes}, host=host)
    try:
        await server.start()
    except OSError as e:
        log.warning("pool %s serves no pin channel: %s", svc.name, e)
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
