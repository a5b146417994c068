"""Same-node reads: a peer's pool memory mapped once, and a read a copy out of it.

A pool publishes, per layer group, how a process on its node maps its memory: a host pool's
shared-memory slab (:class:`~tessera_ray.core.shm.SlabInfo`) or a device pool's CUDA IPC handle
(:class:`DeviceShare`). A reader whose transport runs on the same Ray node opens them once, when
the peer is added (:class:`MappedPeer`); a read then copies the named pages into the reader's
reserved slots: runs of consecutive pages as one ``memmove`` on the host, one gather on a
device. The node is compared by Ray node id, never by whether the file opens: nodes simulated
on one machine share its ``/dev/shm``, and their reads must still take the backend.

Nothing else changes for the caller: the owner pins, the copy lands in reserved slots and is
hashed where it landed, the fetch compares with the export before sealing, the owner unpins.
Without an RDMA NIC, NIXL on one node falls back to TCP emulation, far below a copy between
processes (docs/same-node.md), which is why this path exists at all.
"""

from __future__ import annotations

import logging
import secrets
import threading
import weakref
from collections.abc import Sequence

import numpy as np
import torch

from tessera_ray.core import BlockPool
from tessera_ray.core.shm import SlabInfo, SlabMapping, slab_of
from tessera_ray.errors import PeerMappingError, TransportConfigError
from tessera_ray.transport._fallbacks import count_fallback
from tessera_ray.transport._records import DeviceShare, MemoryShare, PeerInfo, PoolRegion
from tessera_ray.transport._rows import gather_rows, scatter_rows

__all__ = ["MappedPeer", "share_pools", "open_same_node", "MAPPED"]

log = logging.getLogger("tessera_ray.transport")

MAPPED = "mapped"
"""What :meth:`Transport.carrier` answers for a peer read through its mapped memory."""


_SHARED_HERE: weakref.WeakValueDictionary[str, torch.Tensor] = weakref.WeakValueDictionary()
"""Device tensors this process shared, by token: a reader in the owner's own process uses the
tensor itself (CUDA IPC does not open a handle in the process that made it)."""


def share_pools(pools: Sequence[BlockPool]) -> tuple[MemoryShare | None, ...]:
    """Per pool, how a process on this node maps its memory (``None``: it cannot)."""
    return tuple(
        slab_of(p.data) if p.data.device.type == "cpu" else _share_device(p.data) for p in pools
    )


def _share_device(data: torch.Tensor) -> DeviceShare | None:
    try:
        from torch.multiprocessing.reductions import reduce_tensor

        # torch counts, per share, the processes still using it, and keeps a freed tensor's
        # memory while that count is positive. A pool tensor lives as long as its process,
        # so that count never decides anything here, however many readers open the share.
        _, args = reduce_tensor(data)  # type: ignore[no-untyped-call]
    except Exception as e:  # an allocator that cannot export IPC handles (expandable segments)
        log.info(
            "device pool memory on %s cannot be shared with other processes: %s", data.device, e
        )
        return None
    token = secrets.token_hex(16)
    _SHARED_HERE[token] = data
    return DeviceShare(
        token=token,
        device=str(data.device),
        num_pages=data.shape[0],
        page_bytes=data.shape[1],
        handle=tuple(args),
    )


def _open_device(share: DeviceShare) -> torch.Tensor:
    here = _SHARED_HERE.get(share.token)
    if here is not None:
        return here
    try:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        data: torch.Tensor = rebuild_cuda_tensor(*share.handle)  # type: ignore[no-untyped-call]
    except Exception as e:  # no peer access between the GPUs, another container, no driver
        raise PeerMappingError(f"cannot open the CUDA IPC handle of {share.device}: {e}") from e
    if data.dtype != torch.uint8 or tuple(data.shape) != (share.num_pages, share.page_bytes):
        raise PeerMappingError(f"the CUDA IPC handle opened as {data.dtype} {tuple(data.shape)}")
    return data


def _wide(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` seen as 8-byte words where the row size allows: a device gather of wide words
    moves the same bytes with far fewer elements than one of bytes."""
    return rows.view(torch.int64) if rows.shape[1] % 8 == 0 else rows


class MappedPeer:
    """One peer's pools, mapped into this process; see the module docstring.

    A copy and closing the mapping exclude each other (``_lock``): a read that finds the owner
    gone closes the mapping on the transport's thread while another read of the same peer may
    be copying on the caller's, and a copy out of memory already unmapped would crash the
    process, where a copy out of a closed mapping is only a failed read."""

    def __init__(
        self, name: str, regions: Sequence[PoolRegion], shares: Sequence[MemoryShare | None]
    ) -> None:
        if len(shares) != len(regions) or not all(shares):
            raise PeerMappingError(
                f"peer {name!r} shares the memory of {sum(s is not None for s in shares)} of its "
                f"{len(regions)} layer groups (private pool memory: shared_memory_dir=None?)"
            )
        self.name = name
        self._lock = threading.Lock()
        self._groups: list[SlabMapping | torch.Tensor | None] = []
        try:
            for region, share in zip(regions, shares, strict=True):
                assert share is not None
                if (share.num_pages, share.page_bytes) != (region.num_pages, region.page_bytes):
                    raise PeerMappingError(
                        f"peer {name!r} shares {share.num_pages} x {share.page_bytes} B but "
                        f"registered {region.num_pages} x {region.page_bytes} B"
                    )
                self._groups.append(
                    SlabMapping(share) if isinstance(share, SlabInfo) else _open_device(share)
                )
        except BaseException:
            self.close()
            raise

    def copy(self, group: int, remote: list[int], dst: torch.Tensor, local: list[int]) -> None:
        """Copy the peer's pages ``remote`` of layer group ``group`` into rows ``local`` of
        ``dst``; done when it returns. Raises :class:`PeerMappingError` once closed."""
        with self._lock:
            self._copy(group, remote, dst, local)

    def _copy(self, group: int, remote: list[int], dst: torch.Tensor, local: list[int]) -> None:
        src = self._groups[group] if group < len(self._groups) else None
        if src is None or (isinstance(src, SlabMapping) and src.closed):
            raise PeerMappingError(f"the mapping of peer {self.name!r} is closed")
        if isinstance(src, SlabMapping):
            if dst.device.type == "cpu":
                gather_rows(dst, local, src.address, remote)
                return
            staged = torch.empty((len(remote), dst.shape[1]), dtype=torch.uint8)
            gather_rows(staged, list(range(len(remote))), src.address, remote)
            index = torch.tensor(local, dtype=torch.long, device=dst.device)
            dst.index_copy_(0, index, staged.to(dst.device))
        else:
            rows = _wide(src).index_select(0, torch.tensor(remote, device=src.device))
            if dst.device.type == "cpu":
                scatter_rows(dst, local, rows.view(torch.uint8).cpu().numpy())
                return
            index = torch.tensor(local, dtype=torch.long, device=dst.device)
            _wide(dst).index_copy_(0, index, rows.to(dst.device))
        if dst.device.type == "cuda":
            torch.cuda.current_stream(dst.device).synchronize()  # landed when this returns

    def host_pages(self, group: int) -> np.ndarray | None:
        """Layer group ``group``'s pages in place, read-only ``uint8 [num_pages, page_bytes]``
        (``None``: a device share, or closed). A view keeps the mapping alive however the peer
        is closed meanwhile (:meth:`SlabMapping.close`), so reading it never faults; whether its
        bytes are still the owner's is for the caller's pin and :meth:`alive` to say."""
        with self._lock:
            src = self._groups[group] if group < len(self._groups) else None
            if not isinstance(src, SlabMapping) or src.closed:
                return None
            return src.pages(src.info.num_pages)

    def alive(self) -> bool:
        """Whether the owner still holds its memory. Host pools answer by the slab's lock; a
        device share cannot tell, and its reads rest on verification alone."""
        with self._lock:
            if not self._groups or self._groups[0] is None:
                return False  # closed
            for src in self._groups:
                if isinstance(src, SlabMapping):
                    return src.owner_alive()
            return True

    def close(self) -> None:
        """Unmap everything (idempotent): a dead owner's memory is freed once no reader maps
        it."""
        with self._lock:
            for src in self._groups:
                if isinstance(src, SlabMapping):
                    src.close()
            self._groups = [None] * len(self._groups)


def open_same_node(mode: str, node: str | None, kind: str, info: PeerInfo) -> MappedPeer | None:
    """The mapped path to ``info``'s pools for a transport of ``kind`` on ``node`` with
    ``same_node`` ``mode``, or ``None`` when the backend carries its reads. A peer on this node
    whose memory cannot be mapped is logged and counted as a fallback to the backend, or
    refused under ``"mapped"`` (:class:`TransportConfigError`), as is a peer on another node."""
    if mode == "backend" or node is None:
        return None
    if info.node != node:
        if mode == MAPPED:
            raise TransportConfigError(
                f"same_node='mapped' but peer {info.name!r} runs on node {info.node!r}, not on "
                f"this node {node!r}; use same_node='auto' where pools span nodes"
            )
        return None
    try:
        return MappedPeer(info.name, info.regions, info.mappings)
    except PeerMappingError as e:
        if mode == MAPPED:
            raise TransportConfigError(
                f"same_node='mapped' but the memory of peer {info.name!r} cannot be mapped "
                f"here: {e}"
            ) from e
        reason = type(e.__cause__ or e).__name__
        log.warning(
            "peer %s: same node, memory not mappable (%s); %s carries it", info.name, e, kind
        )
        count_fallback(MAPPED, kind, reason)
        return None
