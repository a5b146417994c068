"""PNG plots. matplotlib is imported here only, lazily, so the CLI starts fast without it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tessera_ray.errors import OptionalDependencyError
from tessera_ray.layout import ModelLayout, account, format_context

__all__ = ["plot_sizes", "pyplot"]


def pyplot() -> Any:
    """matplotlib's pyplot on its file-only backend; a clear error when the extra is missing."""
    try:
        import matplotlib
    except ImportError:
        raise OptionalDependencyError(
            "--plot needs matplotlib: pip install 'tessera-ray[plot]'"
        ) from None
    matplotlib.use("Agg")  # no display on servers
    import matplotlib.pyplot as plt

    return plt


def _binary(nbytes: int) -> str:
    """Power-of-two byte counts as ``32 MiB``, ``1 TiB`` (tick labels)."""
    units = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")
    unit = (nbytes.bit_length() - 1) // 10
    return f"{nbytes >> (10 * unit)} {units[unit]}"


def plot_sizes(layouts: list[ModelLayout], out: Path, *, max_context: int) -> None:
    """Stored KV bytes against context, one line per layout, MHA-equivalent dashed (log axes)."""
    plt = pyplot()

    top = max(max_context, 1 << 20)
    contexts = [1 << p for p in range(10, top.bit_length())]
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    for layout in layouts:
        usages = [account(layout, c) for c in contexts]
        (line,) = ax.plot(
            contexts,
            [u.stored_bytes for u in usages],
            marker="o",
            markersize=3,
            label=f"{layout.model} ({layout.format_name})",
        )
        ax.plot(
            contexts,
            [u.mha_bytes for u in usages],
            linestyle="--",
            linewidth=0.8,
            color=line.get_color(),
            alpha=0.6,
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xticks(contexts[::2], [format_context(c) for c in contexts[::2]])
    low, high = ax.get_ylim()
    ticks = [1 << p for p in range(0, 61, 5) if low <= (1 << p) <= high]
    ax.set_yticks(ticks, [_binary(t) for t in ticks])
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("KV bytes per sequence (whole pages)")
    ax.set_title("KV cache per sequence; dashed: MHA-equivalent bf16")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
