"""The verbs of one pool, written once: :class:`PoolApi`, the pool as a caller in another
process sees it.

Three layers answer these verbs, under the same names and the same parameter names:

- :class:`~tessera_ray.actors._ray_handles.PoolRef`, what callers hold: exactly this shape
  (a test compares the signatures and type hints);
- :class:`~tessera_ray.actors.pool_actor.PoolActor`, the Ray shell, and
  :class:`~tessera_ray.actors.pool_service.PoolService`, the logic: the same parameters less
  ``timeout_s``, which is the caller's deadline on the remote call and never reaches the pool.

One name per concept, in every layer:

- ``access``: the namespace the caller acts in, a plain string or a
  :class:`~tessera_ray.actors.tenancy.Credential`; the pool resolves it (and checks it) itself.
- ``token_keys``: the blocks, by token key, one per block; answers align with them.
- ``lease_s``: how long the pool holds what it reserves or pins for the caller (``None``: the
  pool's default); a lease that expires gives everything back.
- ``timeout_s``: the caller's deadline (``None``: none), always the last parameter. Positional
  or keyword, because callers outside this package pass it positionally (``status(5.0)``).

Every verb is a coroutine here. :class:`PoolService` keeps the verbs that never wait as plain
methods (``abort``, ``unpin``, ``contains``, ``read_pinned``, ``attend``, ``inventory``,
``status``): its in-process callers (the fetcher, the pin channel's handlers, which answer
inside the callback that read the request) get their answer without a turn of the event loop,
and the actor shell, whose methods are all coroutines, wraps them.

Not here: what only a caller in the pool's own process uses (``install``,
``fetch_pinned``, ``pin_resident``, ``resident_hashes``: the pool service's), and the shell's
own calls, which the service has no part in (``fetch_from``, a pull driven by the actor's
fetcher; ``channel``, ``peer_info``, ``health``, ``describe``, ``flush_metrics``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from tessera_ray.actors.directory import Registration, Tier
from tessera_ray.actors.messages import (
    BlockCheck,
    BlockReads,
    EvictionReport,
    PinTicket,
    PoolStatus,
    Reservation,
    StoredBlock,
)
from tessera_ray.actors.tenancy import Access
from tessera_ray.core.results import TokenKey

__all__ = ["PoolApi", "DEADLINE"]

DEADLINE = "timeout_s"
"""The one parameter a remote caller's form of a verb adds: its deadline (see above)."""


class PoolApi(Protocol):
    """One pool's verbs, batched: lists in, aligned lists out."""

    # ------------------------------------------------------------------ store

    async def reserve(self, num_blocks: int, lease_s: float | None = None) -> Reservation:
        """Slots for ``num_blocks`` blocks under a lease, evicting old blocks if memory is
        short."""
        ...

    async def commit(
        self,
        reservation_id: int,
        access: Access,
        token_keys: Sequence[TokenKey],
        payloads: np.ndarray | torch.Tensor,
    ) -> list[StoredBlock]:
        """Write, seal and register the reserved blocks (``payloads``: uint8
        ``[len(token_keys), block_bytes]``); unused reserved slots are returned."""
        ...

    async def abort(self, reservation_id: int) -> None:
        """Return a reservation's slots (an unknown or expired one: nothing happens)."""
        ...

    async def store(
        self, access: Access, token_keys: Sequence[TokenKey], payloads: np.ndarray | torch.Tensor
    ) -> list[StoredBlock]:
        """:meth:`reserve` and :meth:`commit` in one call, for a caller that holds the bytes:
        one round trip instead of two (a failed store returns its slots)."""
        ...

    # ------------------------------------------------------------------ read

    async def contains(
        self, access: Access, token_keys: Sequence[TokenKey], touch: bool = False
    ) -> list[Tier | None]:
        """Where the pool holds each block (``touch``: a memory hit counts as a use)."""
        ...

    async def pin(
        self,
        access: Access,
        token_keys: Sequence[TokenKey],
        lease_s: float | None = None,
        timeout_s: float | None = None,
    ) -> PinTicket:
        """Hold the blocks in memory for a reader (restoring disk-only ones first); the ticket
        names their slots and content hashes."""
        ...

    async def unpin(self, pin_id: int) -> bool:
        """Release a pin; False when it is unknown or already expired."""
        ...

    async def read_pinned(self, pin_id: int, timeout_s: float | None = None) -> np.ndarray:
        """The pinned blocks' payloads, ``[blocks held, block_bytes]``."""
        ...

    async def read(self, access: Access, token_keys: Sequence[TokenKey]) -> list[np.ndarray | None]:
        """Per key, the block's bytes, or ``None`` when the pool holds no block under it."""
        ...

    async def read_blocks(self, access: Access, token_keys: Sequence[TokenKey]) -> BlockReads:
        """:meth:`read` with the hash each block was sealed under, to verify the bytes by."""
        ...

    async def check_blocks(
        self, access: Access, token_keys: Sequence[TokenKey]
    ) -> list[BlockCheck]:
        """Re-hash blocks a consumer could not verify; drop those that rotted here."""
        ...

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
        """Partial MLA attention over the blocks the pool holds: ``(out, lse, positions
        used)``."""
        ...

    # ------------------------------------------------------------------ eviction and state

    async def evict(self, num_blocks: int) -> EvictionReport:
        """Evict up to ``num_blocks`` blocks (spilling last copies to disk)."""
        ...

    async def inventory(self) -> list[Registration]:
        """Every block the pool can serve, as directory registrations (for a rebuild)."""
        ...

    async def status(self, timeout_s: float = ...) -> PoolStatus:
        """The pool's snapshot (the default deadline: the caller's for a control call)."""
        ...
