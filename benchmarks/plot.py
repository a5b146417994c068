"""PNG plots for the benchmarks: throughput by object size, one line per system.

Used by ``bench_peers.py`` after it measures; the PNGs go next to its JSON and BENCHMARKS.md
shows them. Only sizes a system was measured at are drawn: a system that is not available has
no line, and the legend says so.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

__all__ = ["throughput_plots"]


class _Size(Protocol):
    @property
    def label(self) -> str: ...
    @property
    def page_bytes(self) -> int: ...


class _Series(Protocol):
    @property
    def key(self) -> str: ...
    @property
    def system(self) -> str: ...
    @property
    def label(self) -> str: ...
    @property
    def write(self) -> bool: ...


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # no display on a benchmark machine
    import matplotlib.pyplot as plt

    return plt


def _lines(
    ax: Any,
    title: str,
    sizes: Sequence[_Size],
    samples: Mapping[str, Mapping[str, list[float]]],
    series: Sequence[_Series],
) -> None:
    for s in series:
        points = [
            (size.page_bytes, statistics.median(got))
            for size in sizes
            if (got := samples.get(s.key, {}).get(size.label))
        ]
        if not points:
            ax.plot([], [], linestyle="none", label=f"{s.label}: not available")
            continue
        xs, ys = zip(*points, strict=True)
        ax.plot(xs, ys, marker="o", linestyle="--" if s.write else "-", label=s.label)
    ax.set_xscale("log", base=2)
    ax.set_xticks([size.page_bytes for size in sizes], [size.label for size in sizes])
    ax.set_xlabel("object size (batches of 16 MiB; 4 MiB of the smallest)")
    ax.set_ylabel("GB/s (median)")
    ax.set_title(title)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8)


def _save(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path)
    _pyplot().close(fig)


def throughput_plots(
    sizes: Sequence[_Size],
    samples: Mapping[str, Mapping[str, list[float]]],
    series: Sequence[_Series],
    folder: Path,
    *,
    prefix: str,
) -> list[str]:
    """Draw into ``folder``: ``{prefix}_read.png`` (fetch / get of every system),
    ``{prefix}_write.png`` (put / set) and ``{prefix}_by_system.png`` (one panel per system,
    its reads and writes); returns their file names."""
    plt = _pyplot()
    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for kind, write in (("read", False), ("write", True)):
        chosen = [s for s in series if s.write is write]
        verb = "writing (put / SET)" if write else "reading into the reader (fetch / GET)"
        fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
        _lines(ax, f"Owner to reader on one machine: {verb}", sizes, samples, chosen)
        names.append(f"{prefix}_{kind}.png")
        _save(fig, folder / names[-1])
    systems = list(dict.fromkeys(s.system for s in series))
    rows = -(-len(systems) // 2)
    fig, axes = plt.subplots(rows, 2, figsize=(12, 4.5 * rows), dpi=90, squeeze=False)
    for ax in axes.flat[len(systems) :]:
        ax.set_visible(False)
    for ax, system in zip(axes.flat, systems, strict=False):
        mine = [s for s in series if s.system == system]
        _lines(ax, system, sizes, samples, mine)
    names.append(f"{prefix}_by_system.png")
    _save(fig, folder / names[-1])
    return names
