"""Same-process transport: a copy between two pools of one process (tests, single-worker use).

Peers are found by name in a process-wide registry of weak references, so a transport that was
closed or collected is simply no longer readable.
"""

from __future__ import annotations

import weakref

import torch

from tessera_ray.core import BlockPool
from tessera_ray.errors import TransferFailedError, TransportConfigError
from tessera_ray.transport.base import (
    PeerInfo,
    TransferState,
    TransferTicket,
    Transport,
    TransportCapabilities,
)
from tessera_ray.transport.config import TransportConfig

__all__ = ["LocalTransport"]

_REGISTRY: weakref.WeakValueDictionary[str, LocalTransport] = weakref.WeakValueDictionary()


class LocalTransport(Transport):
    """Copies rows of a peer pool's tensor straight into this pool's tensor, synchronously."""

    kind = "local"
    capabilities = TransportCapabilities(one_sided=True, cross_process=False, device_memory=True)

    def __init__(self, config: TransportConfig, *, name: str) -> None:
        super().__init__(config, name=name)
        if name in _REGISTRY:
            raise TransportConfigError(f"a local transport named {name!r} exists in this process")
        _REGISTRY[name] = self
        self._done: dict[int, tuple[TransferState, tuple[int, ...] | None]] = {}

    def _register(self, pools: tuple[BlockPool, ...]) -> None:
        return None

    def _add_peer(self, info: PeerInfo) -> None:
        if info.name not in _REGISTRY:
            raise TransportConfigError(
                f"no local transport named {info.name!r} in this process; a local transport "
                "only reaches pools of its own process (use 'nixl' or 'ray' across processes)"
            )

    def _start(
        self, ticket: TransferTicket, info: PeerInfo, remote: list[int], local: list[int]
    ) -> None:
        src = _REGISTRY.get(info.name)
        if src is None or len(src._pools) <= ticket.group:
            self._done[ticket.id] = (TransferState.FAILED, None)
            return
        # One gather and one scatter, whatever the number of pages, of 8-byte words where the
        # page size allows (a byte-wide gather on a device moves a byte per element).
        source = src._pools[ticket.group].words
        dst = self.pool_of(ticket.group).words
        rows = source.index_select(0, torch.tensor(remote, device=source.device))
        dst.index_copy_(0, torch.tensor(local, device=dst.device), rows.to(dst.device))
        self._done[ticket.id] = (TransferState.DONE, self._hash_landed(ticket, local))

    def _poll(self, ticket: TransferTicket) -> TransferState:
        return self._done.get(ticket.id, (TransferState.FAILED, None))[0]

    def _wait(self, ticket: TransferTicket, timeout_s: float) -> tuple[int, ...] | None:
        state, digests = self._done.pop(ticket.id, (None, None))
        if state is not TransferState.DONE:
            raise TransferFailedError(
                f"local read {ticket.id} from {ticket.peer!r} failed: the peer transport is "
                "gone or the ticket was already settled"
            )
        return digests

    def _abort(self, ticket: TransferTicket) -> bool:
        self._done.pop(ticket.id, None)
        return True

    def _close(self) -> None:
        if _REGISTRY.get(self.name) is self:
            del _REGISTRY[self.name]
