"""One error hierarchy for tessera-ray.

Every error the package raises on purpose derives from :class:`TesseraError`, and also from the
standard-library type a caller would naturally catch (``ValueError`` for bad input, ``KeyError``
for a missing name, ``OSError`` for storage faults), so generic handlers keep working. Messages
say what was wrong and what to do about it.
"""

from __future__ import annotations

__all__ = [
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
    "ArenaError",
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
    """A pool or arena configuration is out of range; the message names the field."""


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


class ArenaError(PoolError, ValueError):
    """A request arena was misused: unknown or duplicate request, oversized ring, or full arena."""
