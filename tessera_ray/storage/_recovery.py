"""Opening a disk-tier root: the layout check, the ``O_DIRECT`` choice, the index rebuild.

A restart trusts only what it scanned: every segment's headers are read back, ``.partial``
leftovers of killed writers are deleted (their batches were never acknowledged) and records
that fail their checks are quarantined, so they are never served.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

from tessera_ray.errors import LayoutMismatchError, StorageConfigError
from tessera_ray.storage import _direct as D
from tessera_ray.storage import _files as F
from tessera_ray.storage._catalog import Catalog, Segment
from tessera_ray.storage._format import scan_segment
from tessera_ray.storage._progress import Progress
from tessera_ray.storage._repair import quarantine_record, try_repair, unlink_segments
from tessera_ray.storage.config import DiskTierConfig

__all__ = ["Recovered", "choose_direct", "prepare_root", "rebuild", "PROGRESS_MIN_FILES"]

PROGRESS_MIN_FILES = 10_000
"""Segment count from which opening a root shows a progress line (on a TTY stderr): below it
an open is quick enough that a line would only flicker."""


@dataclass(frozen=True, slots=True)
class Recovered:
    """What a rebuild found besides the index (counted in ``DiskTierStats``)."""

    partials_cleaned: int
    orphans: int
    corrupt: int


def prepare_root(cfg: DiskTierConfig, *, custom_hasher: bool) -> None:
    """Create the root's directories and its metadata, or check the metadata already there."""
    root = cfg.root
    try:
        for d in (root, root / F.SEGMENTS, root / F.QUARANTINE):
            d.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise F.storage_error(exc, f"cannot create tier root {root}") from None
    meta = F.read_meta(root)
    want = F.RootMeta(
        fingerprint=cfg.fingerprint,
        namespace=cfg.namespace,
        hasher="custom" if custom_hasher else F.DEFAULT_HASHER,
    )
    if meta is None:
        try:
            F.write_meta(root, want)
        except OSError as exc:
            raise F.storage_error(exc, f"cannot initialise tier root {root}") from None
    elif meta.fingerprint != want.fingerprint or meta.namespace != want.namespace:
        raise LayoutMismatchError(
            f"tier root {root} holds layout {meta.fingerprint} (namespace "
            f"{meta.namespace!r}), not {want.fingerprint} ({want.namespace!r}); open it with "
            "that layout or use another root"
        )


def choose_direct(cfg: DiskTierConfig) -> bool:
    """Whether segment IO goes around the page cache (``DiskTierConfig.direct_io`` says why)."""
    wanted = cfg.direct_io
    if wanted is False:
        return False
    if D.direct_supported(cfg.root / F.META_NAME):
        return True
    if wanted:
        raise StorageConfigError(
            f"direct_io=True but the filesystem of {cfg.root} does not support O_DIRECT; "
            "use direct_io=None (auto) or False, or a root on another filesystem"
        )
    return False


def rebuild(cfg: DiskTierConfig, fp16: bytes, cat: Catalog) -> Recovered:
    """Index every trustworthy record under ``cfg.root`` into ``cat``, oldest segment first
    (recency is not persisted: modification times order the segments), then evict to fit."""
    seg_dir = cfg.root / F.SEGMENTS
    partials = orphans = corrupt = 0
    segs: list[tuple[float, str, int]] = []
    for name in sorted(os.listdir(seg_dir)):
        path = seg_dir / name
        if name.endswith(F.PARTIAL_SUFFIX):
            # A writer died before its rename: the batch was never acknowledged.
            try:
                path.unlink()
                partials += 1
            except OSError:
                pass  # read-only root: never indexed, so never served
        elif F.segment_name_ok(name):
            st = path.stat()
            segs.append((st.st_mtime, name, st.st_size))
        else:
            orphans += 1  # not ours: fsck reports it, the tier ignores it
    segs.sort()
    show = Progress.wanted(len(segs), min_items=PROGRESS_MIN_FILES, force=cfg.progress)
    bar = Progress(f"indexing {cfg.root}", len(segs), enabled=show)
    for _mtime, name, size in segs:
        corrupt += _load_segment(cfg.root, fp16, cat, name, size)
        bar.advance()
    bar.close()
    gone = cat.evict_for(0)
    if gone:
        try_repair(lambda: unlink_segments(seg_dir, gone))
    return Recovered(partials_cleaned=partials, orphans=orphans, corrupt=corrupt)


def _load_segment(root: Path, fp16: bytes, cat: Catalog, name: str, size: int) -> int:
    """Index one segment's good records; returns how many records were corrupt."""
    seg_dir = root / F.SEGMENTS
    path = seg_dir / name
    if size == 0:
        try_repair(lambda: F.quarantine_file(root, path, "empty segment"))
        return 0
    seg = Segment(name=name, size=size)
    fd = os.open(path, os.O_RDONLY)
    try:
        items = scan_segment(fd, size)
    finally:
        os.close(fd)
    corrupt = 0
    for item in items:
        if item.dead:
            continue
        h = item.header
        problem = item.problem
        if problem is None and h is not None and h.fingerprint != fp16:
            problem = "layout fingerprint mismatch"
        if problem is not None:
            key = h.key if h is not None else None
            corrupt += 1
            try_repair(
                functools.partial(
                    quarantine_record, root, name, item.offset, item.span, key, problem, size
                )
            )
            continue
        assert h is not None
        cat.claim(seg, h.key, item.offset, h.payload_len, h.head_bytes)
    if seg.live:
        cat.segments[name] = seg
        cat.used += size
    else:
        try_repair(lambda: unlink_segments(seg_dir, [name]))
    return corrupt
