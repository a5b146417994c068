"""One error hierarchy for tessera-ray.

Every error the package raises on purpose derives from :class:`TesseraError`, and also from the
standard-library type a caller would naturally catch (``ValueError`` for bad input, ``KeyError``
for a missing name, ``OSError`` for storage faults), so generic handlers keep working. Messages
say what was wrong and what to do about it.
"""

from __future__ import annotations

__all__ = [
    "TierConfigError",
    "LeaseError",
    "PoolUnavailableError",
    "DirectoryUnavailableError",
    "OptionalDependencyError",
    "TenantError",
    "DirectoryError",
    "TesseraError",
    "LayoutError",
    "UnknownNameError",
    "InvalidContextError",
    "PoolError",
    "PoolConfigError",
    "PoolMemoryError",
    "PoolExhaustedError",
    "HandleError",
    "StaleHandleError",
    "ForgedHandleError",
    "PageSealedError",
    "PageNotSealedError",
    "PageBoundsError",
    "PageDTypeError",
    "PageShapeError",
    "PageNotFreeableError",
    "StorageError",
    "StorageConfigError",
    "InvalidKeyError",
    "PageNotFoundError",
    "CorruptPageError",
    "DiskFullError",
    "ReadOnlyStorageError",
    "StorageLockedError",
    "LayoutMismatchError",
    "KernelError",
    "KernelBackendUnavailableError",
]


class TesseraError(Exception):
    """Base of every error tessera-ray raises deliberately."""


class LayoutError(TesseraError, ValueError):
    """A KV layout, region or model geometry is inconsistent or out of range."""


class UnknownNameError(TesseraError, ValueError):
    """A preset, format or other named choice does not exist; the message lists valid names.

    Derives from ``ValueError`` rather than ``KeyError`` because ``KeyError`` quotes its message,
    which would garble the one-line CLI error.
    """


class InvalidContextError(TesseraError, ValueError):
    """A context length could not be parsed or is not a positive number of tokens."""


class PoolError(TesseraError):
    """Base of every error the block pool (``tessera_ray.core``) raises; a failed call leaves the
    pool exactly as it was."""


class PoolConfigError(PoolError, ValueError):
    """A pool configuration is out of range; the message names the field."""


class PoolMemoryError(PoolError, MemoryError):
    """A pool was asked for more pages than the device's memory allows; nothing was allocated.
    Ask for fewer pages or free memory first."""


class PoolExhaustedError(PoolError, MemoryError):
    """No free page is left; call ``evict()`` (and hand what left to the tier below) or release
    references, then retry."""


class HandleError(PoolError, ValueError):
    """A page handle does not name a live page of this pool."""


class StaleHandleError(HandleError):
    """The handle named a page that has since been freed or evicted (its generation moved on);
    look the page up again."""


class ForgedHandleError(HandleError):
    """The handle was never issued by this pool: wrong region, misaligned offset, wrong length,
    out-of-range page or a generation the page never had."""


class PageSealedError(PoolError, ValueError):
    """The page is sealed (immutable); sealing twice is refused. Writes to a sealed page fork it
    instead (copy-on-write)."""


class PageNotSealedError(PoolError, ValueError):
    """The operation needs a sealed page (sharing, block registration); seal it first."""


class PageBoundsError(PoolError, ValueError):
    """A write or read would reach past the end of a page or region."""


class PageDTypeError(PoolError, ValueError):
    """Data of the wrong dtype for the page or region it was written to."""


class PageShapeError(PoolError, ValueError):
    """Data of the wrong shape for the page or region it was written to."""


class PageNotFreeableError(PoolError, ValueError):
    """A release of a page that holds no reference (already free, or unreferenced in the LRU)."""


class StorageError(TesseraError, OSError):
    """Base of every error a storage tier (``tessera_ray.storage``) raises; ``errno`` is set
    where an operating-system error caused it."""


class StorageConfigError(TesseraError, ValueError):
    """A tier configuration is out of range; the message names the field."""


class InvalidKeyError(TesseraError, ValueError):
    """A page key is not a 16-byte content hash (or its 32-char lowercase hex form), or the
    payload does not hash to it. Keys become file names, so anything else is refused."""


class PageNotFoundError(StorageError, KeyError):
    """The tier holds no page with this content hash (never stored, deleted or evicted)."""

    def __str__(self) -> str:  # KeyError would quote the message; keep one plain line
        return str(self.args[0]) if self.args else ""


class CorruptPageError(StorageError):
    """A stored record failed verification (checksum, content hash, header, length or layout
    fingerprint). It was moved to quarantine and is never served; recompute the page."""


class DiskFullError(StorageError):
    """The filesystem ran out of space (ENOSPC) while writing; nothing already stored was lost.
    Free space or lower ``capacity_bytes`` below what the filesystem can hold."""


class ReadOnlyStorageError(StorageError):
    """The tier root is read-only (EROFS/EACCES); stored pages stay readable, writes fail."""


class StorageLockedError(StorageError):
    """Another process holds the tier root open; one writer per root. Close it or use another
    root."""


class LayoutMismatchError(StorageError, ValueError):
    """The tier root was created for another layout fingerprint; pages of different layouts
    never mix. Open it with the layout it was created for, or use another root."""


class DirectoryError(TesseraError, ValueError):
    """A directory request is malformed (bad key, namespace, replica or shard)."""


class KernelError(TesseraError, ValueError):
    """An attention kernel was called with tensors of the wrong shape, stride, dtype or device,
    or with a block table / sequence lengths that do not fit the pages; the message names the
    argument and the expected layout."""


class KernelBackendUnavailableError(TesseraError, RuntimeError):
    """A kernel backend was asked for by name but cannot run here (not importable, GPU too old,
    or the inputs use a layout it does not support); ask for ``backend="auto"`` to fall back."""


# --------------------------------------------------------- transport (tessera_ray.transport)
# Appended as a block (and to ``__all__`` below) so concurrent edits elsewhere in this file merge.

__all__ += [
    "TransportError",
    "TransportConfigError",
    "TransportUnavailableError",
    "TransferFailedError",
    "TransferTimeoutError",
    "VerificationError",
]


class TransportError(TesseraError, OSError):
    """Base of every error a page transport (``tessera_ray.transport``) raises: an unknown peer,
    a transfer the backend reported as failed, a timeout, bytes that failed verification.

    ``slots_safe`` is False only when a transfer could not be cancelled, so the backend may still
    write into the reader's slots: those slots must not be reused (the fetch helper keeps them)."""

    slots_safe: bool = True


class TransportConfigError(TesseraError, ValueError):
    """A transport configuration or call is malformed (unknown kind, non-positive timeout, slot
    lists of different lengths, a slot outside the pool); the message names the field."""


class TransportUnavailableError(TransportError):
    """The requested transport cannot run here (NIXL not importable, agent creation failed, no
    Ray); ask for ``kind="auto"`` to fall back to the Ray object store."""


class TransferFailedError(TransportError):
    """The backend reported the transfer as failed (the owner died, its memory went away, the
    connection broke). The pages were not fetched; fall back to another replica or recompute."""


class TransferTimeoutError(TransportError, TimeoutError):
    """The transfer did not complete within ``timeout_s``; it was aborted and nothing it wrote is
    used. Retry from another replica or recompute."""


class VerificationError(TransportError, ValueError):
    """Fetched bytes did not hash to the content hash the owner exported (corrupted in flight or
    at the source). The pages were not installed; their slots went back to the free list."""


class TierConfigError(TesseraError, ValueError):
    """A pool-actor or tier configuration value is invalid."""


class LeaseError(TesseraError, KeyError):
    """A reservation or pin is unknown or expired (its slots were returned); start over."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class PoolUnavailableError(TesseraError, ConnectionError):
    """A pool actor is dead or unreachable; its replicas are being purged."""


class DirectoryUnavailableError(TesseraError, ConnectionError):
    """A directory shard did not answer (dead, restarting, or slower than the caller's bound)."""


class OptionalDependencyError(TesseraError, ImportError):
    """A feature needs a package of an optional extra that is not installed."""


class TenantError(TesseraError, PermissionError):
    """A call named a namespace it may not use: no credential on a tier that requires one, a
    credential that does not verify, or a namespace the credential does not grant. Nothing was
    read or changed."""


class MetricsError(TesseraError, ValueError):
    """A metric is recorded that ``tessera_ray.metrics.METRICS`` does not declare, or with
    other tags than declared; declare it there (names, tags and kinds are fixed)."""


__all__ += ["MetricsError"]


# ------------------------------------------------------- demo and serve (tessera_ray.demo/serve)
__all__ += ["DemoConfigError", "BadRequestError"]


class DemoConfigError(TesseraError, ValueError):
    """A demo setting is out of range (``tessera-ray demo``); the message names the setting."""


class BadRequestError(TesseraError, ValueError):
    """A request is malformed or oversized (an HTTP body that is not JSON, a missing field, a
    key that is not 64 hex digits, a batch over the per-call limit); refused before anything in
    the tier changes (the Serve app answers it with status 400)."""


# ------------------------------------------------------------------ the vLLM connector's tier
__all__ += ["TierUnavailableError"]


class TierUnavailableError(TesseraError, ConnectionError):
    """The tier could not answer a connector's call in time (a pool or directory shard down or
    slow, a transfer that failed): the connector recomputes what it asked for and counts it.
    Every other error out of a tier backend is a bug and reaches vLLM."""


# --------------------------------------------------------- same-node mapped memory
# Appended as a block (and to ``__all__`` below) so concurrent edits elsewhere in this file merge.

__all__ += ["PeerMappingError"]


class PeerMappingError(TesseraError, OSError):
    """Another process's pool memory cannot be mapped here: its shared-memory file is absent
    (the peer runs in another container), this process may not open it, or it is not the size
    its descriptor says. Readers fall back to the transport's backend (NIXL)."""
