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
    unguessable rather than sequential, and unique across both tables."""

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
