"""Reservations and pins of one pool: what each holds references on, and until when (private
to the pool service, which releases the references)."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass

from tessera_ray.core import PageHandle

__all__ = ["Lease", "LeaseTable"]


@dataclass(slots=True)
class Lease:
    handles: list[list[list[PageHandle]]]
    """Per block, per layer group, the page handles the lease holds a reference on."""
    expires_at_s: float
    namespace: str = ""


class LeaseTable:
    """Open reservations (slots for a store or a fetch) and pins (blocks held for a reader),
    under ids that are capabilities: whoever holds one may commit or read it, so ids are
    unguessable rather than sequential, and unique across both tables.

    The table only records leases: whoever takes one out (:meth:`take_reservation`,
    :meth:`unpin`, :meth:`expired`, :meth:`drain`) releases its references."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self.reservations: dict[int, Lease] = {}
        self.pins: dict[int, Lease] = {}

    def _new_id(self) -> int:
        while True:
            lease_id = secrets.randbits(62) + 1
            if lease_id not in self.reservations and lease_id not in self.pins:
                return lease_id

    def reserve(self, handles: list[list[list[PageHandle]]], lease_s: float) -> tuple[int, Lease]:
        lease_id = self._new_id()
        lease = self.reservations[lease_id] = Lease(handles, self._clock() + lease_s)
        return lease_id, lease

    def pin(
        self, handles: list[list[list[PageHandle]]], lease_s: float, namespace: str
    ) -> tuple[int, Lease]:
        lease_id = self._new_id()
        lease = self.pins[lease_id] = Lease(handles, self._clock() + lease_s, namespace)
        return lease_id, lease

    def reservation(self, reservation_id: int) -> Lease | None:
        """The open reservation ``reservation_id``, left in the table (``None``: unknown)."""
        return self.reservations.get(reservation_id)

    def take_reservation(self, reservation_id: int) -> Lease | None:
        """The reservation, taken out of the table (committed, aborted or taken over);
        ``None`` when it is unknown or already expired."""
        return self.reservations.pop(reservation_id, None)

    def pinned(self, pin_id: int) -> Lease | None:
        """The live pin ``pin_id``, left in the table (``None``: unknown or expired)."""
        return self.pins.get(pin_id)

    def unpin(self, pin_id: int) -> Lease | None:
        """The pin, taken out of the table; ``None`` when it is unknown or already expired."""
        return self.pins.pop(pin_id, None)

    def expired(self) -> list[Lease]:
        """Every lease past its deadline, taken out of the tables (the caller releases them)."""
        now = self._clock()
        out: list[Lease] = []
        for table in (self.reservations, self.pins):
            for lease_id in [i for i, lease in table.items() if lease.expires_at_s <= now]:
                out.append(table.pop(lease_id))
        return out

    def drain(self) -> list[Lease]:
        """Every lease, taken out of the tables (the pool is closing)."""
        out = [*self.reservations.values(), *self.pins.values()]
        self.reservations.clear()
        self.pins.clear()
        return out
