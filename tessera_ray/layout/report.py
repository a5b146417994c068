"""Human and JSON renderings of layouts and their byte accounting (used by ``tessera-ray size``).

JSON keeps every byte count an exact integer and every fractional quantity an exact fraction
string (``"9/2"``), with a float beside it only for convenience.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from tessera_ray.layout.accounting import ContextUsage
from tessera_ray.layout.engine_pages import EnginePages
from tessera_ray.layout.formats import FORMATS
from tessera_ray.layout.models import DEFAULT_FORMATS, PRESETS
from tessera_ray.layout.spec import CacheSpec, ModelLayout
from tessera_ray.layout.units import format_bytes, format_context

__all__ = ["layout_json", "usage_json", "engine_json", "render_layout", "render_presets"]


def _frac(value: Fraction) -> str:
    return (
        str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"
    )


def _frac_text(value: Fraction) -> str:
    """As :func:`_frac`, with thousands separators, for the human table."""
    if value.denominator == 1:
        return f"{value.numerator:,}"
    return f"{value.numerator:,}/{value.denominator:,}"


def _per(spec: CacheSpec) -> str:
    if spec.stride_tokens == 1:
        return f"{spec.bytes_per_group:,} B/token"
    return (
        f"{spec.bytes_per_group:,} B per {spec.stride_tokens} tokens "
        f"({_frac(spec.bytes_per_token)} B/token)"
    )


def layout_json(layout: ModelLayout) -> dict[str, Any]:
    return {
        "model": layout.model,
        "format": layout.format_name,
        "num_layers": layout.num_layers,
        "block_tokens": layout.block_tokens,
        "fingerprint": layout.fingerprint,
        "assumed": layout.assumed,
        "notes": list(layout.notes),
        "paged_bytes_per_token": _frac(layout.paged_bytes_per_token),
        "window_bytes_per_token": _frac(layout.window_bytes_per_token),
        "mha_bytes_per_token": layout.mha_bytes_per_token,
        "block_bytes": layout.block_bytes,
        "specs": [
            {
                "spec": g.page.cache.label(),
                "layers": list(g.layers),
                "paged": True,
                "regions": g.page.cache.entry.describe(),
                "stride_tokens": g.page.cache.stride_tokens,
                "bytes_per_group": g.page.cache.bytes_per_group,
                "bytes_per_token": _frac(g.page.bytes_per_token),
                "page_bytes": g.page.page_bytes,
            }
            for g in layout.groups
        ]
        + [
            {
                "spec": s.label(),
                "layers": list(ls),
                "paged": False,
                "regions": s.entry.describe(),
                "stride_tokens": s.stride_tokens,
                "bytes_per_group": s.bytes_per_group,
                "bytes_per_token": _frac(s.bytes_per_token),
                "window_tokens": s.window_tokens,
            }
            for s, ls in layout.windows
        ],
    }


def engine_json(pages: EnginePages) -> dict[str, Any]:
    """The engine's caches: per cache its block, page (padding included) and bytes per token of
    one layer; totals over every layer."""
    return {
        "engine": pages.engine,
        "caches": [
            {
                "spec": c.label(),
                "layers": list(c.layers),
                "window_tokens": c.cache.window_tokens,
                "block_tokens": c.block_tokens,
                "entries_per_page": c.entries_per_page,
                "content_bytes": c.content_bytes,
                "padding_bytes": c.padding_bytes,
                "page_bytes": c.page_bytes,
                "bytes_per_token": _frac(c.bytes_per_token),
                "block_bytes": c.block_bytes,
            }
            for c in pages.caches
        ],
        "page_bytes": pages.page_bytes,
        "paged_block_bytes": pages.paged_block_bytes,
        "paged_bytes_per_token": _frac(pages.paged_bytes_per_token),
        "window_bytes_per_token": _frac(pages.window_bytes_per_token),
    }


def _render_engine(pages: EnginePages) -> list[str]:
    lines = [f"  {pages.engine} allocates (pages padded as the engine pads them):"]
    for c in pages.caches:
        padding = f" ({c.padding_bytes:,} B padding)" if c.padding_bytes else ""
        lines.append(
            f"    {c.label()} x {len(c.layers)} layers: block {c.block_tokens} tokens, page "
            f"{c.page_bytes:,} B{padding} = {_frac_text(c.bytes_per_token)} B/token"
        )
    lines.append(
        f"    total: {pages.page_bytes:,} B for a page of every cache and layer; "
        f"{pages.paged_block_bytes:,} B a block of the whole-context caches "
        f"({_frac_text(pages.paged_bytes_per_token)} B/token), windows "
        f"{_frac_text(pages.window_bytes_per_token)} B/token"
    )
    return lines


def usage_json(usage: ContextUsage) -> dict[str, Any]:
    return {
        "context": format_context(usage.context_tokens),
        "context_tokens": usage.context_tokens,
        "payload_bytes": usage.payload_bytes,
        "stored_bytes": usage.stored_bytes,
        "padding_bytes": usage.padding_bytes,
        "mha_bytes": usage.mha_bytes,
        "ratio": _frac(usage.ratio),
        "ratio_float": float(usage.ratio),
        "block_tokens": usage.block_tokens,
        "blocks": usage.blocks,
        "pages": usage.pages,
        "specs": [
            {
                "spec": s.label,
                "num_layers": s.num_layers,
                "paged": s.paged,
                "payload_bytes": s.payload_bytes,
                "stored_bytes": s.stored_bytes,
                "padding_bytes": s.padding_bytes,
                "pages": s.pages,
                "pending_tokens": s.pending_tokens,
            }
            for s in usage.specs
        ],
    }


def _table(rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ).rstrip()
        for r in rows
    ]


def render_layout(
    layout: ModelLayout, usages: list[ContextUsage], engine: EnginePages | None = None
) -> str:
    """A header describing the layout (and, given ``engine``, the engine's caches for it), then
    one row per context."""
    lines = [
        f"{layout.model}: format {layout.format_name}, {layout.num_layers} layers, "
        f"block {layout.block_tokens} tokens, {_frac(layout.paged_bytes_per_token)} paged B/token, "
        f"fingerprint {layout.fingerprint[:16]}"
    ]
    for g in layout.groups:
        c = g.page.cache
        lines.append(
            f"  {c.label()} x {len(g.layers)} layers: {c.entry.describe()} = {_per(c)}, "
            f"page {g.page.page_bytes:,} B"
        )
    for s, ls in layout.windows:
        lines.append(
            f"  {s.label()} x {len(ls)} layers: {s.entry.describe()} = {_per(s)}, "
            f"a window of {s.window_tokens} tokens (not paged)"
        )
    if layout.windows:
        lines.append(
            f"  resume record (the windows where a stored prefix ends): {layout.resume_bytes:,} B"
        )
    if engine is not None:
        lines.extend(_render_engine(engine))
    lines.extend(f"  note: {n}" for n in layout.notes)
    header = [
        "context",
        "tokens",
        "payload",
        "MHA-equivalent",
        "ratio",
        "block",
        "pages",
        "padding",
    ]
    rows = [header] + [
        [
            format_context(u.context_tokens),
            f"{u.context_tokens:,}",
            format_bytes(u.payload_bytes),
            format_bytes(u.mha_bytes),
            f"{float(u.ratio):.2f}x",
            str(u.block_tokens),
            f"{u.pages:,}",
            format_bytes(u.padding_bytes),
        ]
        for u in usages
    ]
    lines.extend(_table(rows, right={1, 2, 3, 4, 5, 6, 7}))
    return "\n".join(lines)


def render_presets() -> str:
    rows = [["model", "family", "layers", "default format", "note"]]
    for name, c in PRESETS.items():
        rows.append(
            [
                name,
                c.family.value,
                str(c.num_layers),
                DEFAULT_FORMATS[c.family],
                "assumed geometry" if c.assumed else "",
            ]
        )
    frows = [["format", "family", "description"]]
    frows += [[f.name, f.family.value, f.description] for f in FORMATS.values()]
    return "\n".join(
        ["presets:", *_table(rows, right={2}), "", "formats:", *_table(frows, right=set())]
    )
