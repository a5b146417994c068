"""Fallback transport over the Ray object store, for when NIXL is missing or fails.

Not one-sided: the owner's actor must expose a method named :data:`SERVE_METHOD` that returns
``transport.serve(group, slots)`` (a numpy copy of the pinned pages, which Ray places in the object
store); the reader asks for it and copies the rows into its reserved slots when the object
arrives. Because the reader does that copy itself, an aborted read can never write late.

This module makes ``ray.*`` calls (imported lazily, inside the methods): the actors' client
module may take them over, the transport logic does not depend on where they live.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tessera_ray.core import BlockPool
from tessera_ray.errors import (
    TransferFailedError,
    TransferTimeoutError,
    TransportConfigError,
    TransportError,
)
from tessera_ray.transport._rows import scatter_rows
from tessera_ray.transport.base import (
    PeerInfo,
    TransferState,
    TransferTicket,
    Transport,
    TransportCapabilities,
)
from tessera_ray.transport.config import TransportConfig

__all__ = ["RayObjectTransport", "SERVE_METHOD"]

SERVE_METHOD = "transport_serve"
"""Name of the owner actor's method ``(group, slots)`` returning ``RayObjectTransport.serve``."""


class RayObjectTransport(Transport):
    """See the module docstring. ``endpoint`` is this pool's actor handle (what readers call)."""

    kind = "ray"
    capabilities = TransportCapabilities(one_sided=False, cross_process=True, device_memory=False)

    def __init__(
        self,
        config: TransportConfig,
        *,
        name: str,
        endpoint: Any = None,
        node: str | None = None,
    ) -> None:
        super().__init__(config, name=name, node=node)
        self._self_endpoint = endpoint
        self._refs: dict[int, tuple[Any, list[int]]] = {}
        self._finished: dict[int, BaseException | tuple[int, ...] | None] = {}
        """Per settled read: its error, else its digests (``None`` when it does not hash)."""

    def _register(self, pools: tuple[BlockPool, ...]) -> None:
        return None

    def _endpoint(self) -> Any:
        return self._self_endpoint

    def serve(self, group: int, slots: list[int]) -> np.ndarray:
        """Owner side: a copy of the (pinned) pages ``slots`` of layer group ``group``,
        ``uint8 [len(slots), page_bytes]``.

        A numpy array rather than a tensor: Ray hands numpy arrays to the reader zero-copy out of
        the object store."""
        pool = self.pool_of(group)
        index = torch.tensor(slots, dtype=torch.long, device=pool.data.device)
        return pool.data.index_select(0, index).cpu().numpy()

    def _add_peer(self, info: PeerInfo) -> None:
        if info.endpoint is None or not hasattr(info.endpoint, SERVE_METHOD):
            raise TransportConfigError(
                f"peer {info.name!r} has no endpoint with a {SERVE_METHOD}() method; create its "
                "RayObjectTransport with endpoint=<its actor handle>"
            )

    def _start(
        self, ticket: TransferTicket, info: PeerInfo, remote: list[int], local: list[int]
    ) -> None:
        try:
            ref = getattr(info.endpoint, SERVE_METHOD).remote(ticket.group, remote)
        except Exception as e:
            raise TransferFailedError(f"asking {info.name!r} for pages failed: {e}") from e
        self._refs[ticket.id] = (ref, local)

    def _complete(self, ticket: TransferTicket, timeout_s: float) -> bool:
        """Fetch the object within ``timeout_s`` and land it; False if it is not ready yet."""
        import ray
        from ray.exceptions import GetTimeoutError

        ref, local = self._refs[ticket.id]
        try:
            rows = ray.get(ref, timeout=timeout_s)
        except GetTimeoutError:
            return False
        except Exception as e:  # RayActorError, RayTaskError, ObjectLostError...
            err: BaseException | tuple[int, ...] | None = TransferFailedError(
                f"Ray read {ticket.id} from {ticket.peer!r} failed: {type(e).__name__}: {e}"
            )
        else:
            pool = self.pool_of(ticket.group)
            expect = (ticket.num_pages, pool.page_bytes)
            if not isinstance(rows, np.ndarray) or rows.dtype != np.uint8 or rows.shape != expect:
                err = TransferFailedError(f"peer {ticket.peer!r} answered with malformed pages")
            else:
                scatter_rows(pool.data, local, rows)
                err = self._hash_landed(ticket, local)
        del self._refs[ticket.id]
        self._finished[ticket.id] = err
        return True

    def _poll(self, ticket: TransferTicket) -> TransferState:
        import ray

        if ticket.id in self._refs:
            ready, _ = ray.wait([self._refs[ticket.id][0]], timeout=0)
            if not ready or not self._complete(ticket, 0):
                return TransferState.PENDING
        if ticket.id not in self._finished:
            raise TransportError(f"ticket {ticket.id} is unknown or already settled")
        failed = isinstance(self._finished[ticket.id], BaseException)
        return TransferState.FAILED if failed else TransferState.DONE

    def _wait(self, ticket: TransferTicket, timeout_s: float) -> tuple[int, ...] | None:
        if ticket.id in self._refs and not self._complete(ticket, timeout_s):
            self._refs.pop(ticket.id)
            raise TransferTimeoutError(
                f"Ray read {ticket.id} of {ticket.num_pages} pages from {ticket.peer!r} did not "
                f"finish within {timeout_s} s; it was abandoned"
            )
        if ticket.id not in self._finished:
            raise TransportError(f"ticket {ticket.id} is unknown or already settled")
        outcome = self._finished.pop(ticket.id)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def _abort(self, ticket: TransferTicket) -> bool:
        # Dropping the reference is enough: only this process copies into the slots.
        self._refs.pop(ticket.id, None)
        self._finished.pop(ticket.id, None)
        return True
