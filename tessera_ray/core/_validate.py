"""Input checks for handles, page writes and blocks, made before the pool changes anything."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tessera_ray.core._records import FREE, SEALED, PageRecord
from tessera_ray.core._views import region_columns, region_dtype
from tessera_ray.core.hashing import TOKEN_KEY_BYTES
from tessera_ray.core.results import PageHandle
from tessera_ray.errors import (
    ForgedHandleError,
    PageBoundsError,
    PageDTypeError,
    PageNotSealedError,
    PageShapeError,
    StaleHandleError,
    UnknownNameError,
)
from tessera_ray.layout import PageSpec, Region

__all__ = [
    "check_handle",
    "check_raw_write",
    "check_page_rows",
    "check_region_write",
    "check_block_size",
    "check_token_key",
    "check_sealed_under",
]


def check_raw_write(data: object, offset: int, page_bytes: int) -> torch.Tensor:
    """``data`` must be a 1-D ``uint8`` tensor that fits the page from byte ``offset``."""
    if not isinstance(data, torch.Tensor):
        raise PageDTypeError(f"data must be a torch.Tensor, got {type(data).__name__}")
    if data.dtype != torch.uint8:
        raise PageDTypeError(f"raw page writes take uint8 bytes, got {data.dtype}")
    if data.dim() != 1:
        raise PageShapeError(f"raw page writes take a 1-D tensor, got {tuple(data.shape)}")
    if offset < 0 or offset + data.numel() > page_bytes:
        raise PageBoundsError(
            f"{data.numel()} B at offset {offset} runs past the {page_bytes} B page"
        )
    return data


def check_page_rows(data: object, pages: int, page_bytes: int) -> None:
    """``data`` must be ``uint8 [pages, page_bytes]``: whole pages, one row each."""
    if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8:
        raise PageDTypeError("write_many takes a uint8 tensor [pages, page_bytes]")
    if tuple(data.shape) != (pages, page_bytes):
        raise PageShapeError(
            f"write_many of {pages} pages takes [{pages}, {page_bytes}], got {tuple(data.shape)}"
        )


def check_block_size(handles: Sequence[object], layers_per_block: int) -> None:
    """A block is one page per layer of its group."""
    if len(handles) != layers_per_block:
        raise PageShapeError(
            f"a block has {layers_per_block} pages (one per layer), got {len(handles)}"
        )


def check_token_key(token_key: object) -> None:
    """A token key, when given, is the ``TOKEN_KEY_BYTES`` bytes :func:`token_key` makes."""
    if token_key is not None and (
        not isinstance(token_key, bytes) or len(token_key) != TOKEN_KEY_BYTES
    ):
        raise PageShapeError(f"a token key is {TOKEN_KEY_BYTES} bytes (see token_key())")


def check_sealed_under(recs: Sequence[PageRecord], ns: int, namespace: str) -> None:
    """Every page of ``recs`` is sealed under namespace id ``ns`` (named ``namespace``)."""
    for r in recs:
        if r.state != SEALED or r.namespace != ns:
            raise PageNotSealedError(f"page {r.index} is not sealed under {namespace!r}")


def check_region_write(spec: PageSpec, region: str, data: object, start_entry: int) -> Region:
    """``data`` must be ``[n, columns]`` of the region's dtype, fitting from ``start_entry``."""
    found = next((r for r in spec.regions if r.name == region), None)
    if found is None:
        names = ", ".join(r.name for r in spec.regions)
        raise UnknownNameError(f"no region {region!r}; this page has {names}")
    want = region_dtype(found)
    if not isinstance(data, torch.Tensor) or data.dtype != want:
        got = data.dtype if isinstance(data, torch.Tensor) else type(data).__name__
        raise PageDTypeError(f"region {region!r} holds {want}, got {got}")
    cols = region_columns(found)
    if data.dim() != 2 or data.shape[1] != cols:
        raise PageShapeError(f"region {region!r} takes [entries, {cols}], got {tuple(data.shape)}")
    end = start_entry + data.shape[0]
    if start_entry < 0 or end > spec.entries_per_page:
        raise PageBoundsError(
            f"entries {start_entry}..{end} run past the page's {spec.entries_per_page} entries"
        )
    return found


def check_handle(
    handle: object, region: int, page_bytes: int, records: Sequence[PageRecord]
) -> PageRecord:
    """Resolve ``handle`` the slow way, raising the error that says what is wrong with it."""
    if not isinstance(handle, PageHandle):
        raise ForgedHandleError(f"expected a PageHandle, got {type(handle).__name__}")
    if handle.region != region:
        raise ForgedHandleError(f"handle names region {handle.region}, not this pool's")
    if handle.length != page_bytes:
        raise ForgedHandleError(f"handle length {handle.length} != page {page_bytes} B")
    index, rem = divmod(handle.offset, page_bytes)
    if rem or not 0 <= index < len(records):
        raise ForgedHandleError(f"handle offset {handle.offset} is not a page of this pool")
    rec = records[index]
    if handle.generation < 0 or handle.generation > rec.generation:
        raise ForgedHandleError(
            f"page {index} never had generation {handle.generation} (now {rec.generation})"
        )
    if handle.generation < rec.generation:
        raise StaleHandleError(
            f"page {index} was freed since this handle was issued (generation "
            f"{handle.generation}, now {rec.generation}); look the page up again"
        )
    if rec.state == FREE:
        # Freeing moves the generation on, so no issued handle names a free slot.
        raise ForgedHandleError(f"page {index} is free and was never issued at this generation")
    return rec
