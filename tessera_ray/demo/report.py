"""What the demo measured: per-request records, totals, the summary table, JSON and the plot.

Every figure here is counted during the run (requests, fetch results, stores, parity checks)
or read from the pools' and shards' status at its end; nothing is estimated.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "RequestRecord",
    "TierTotals",
    "DemoReport",
    "FAMILIES_LINE",
    "render_summary",
    "plot_report",
]


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One agent turn. ``served_*`` are tokens of the longest prefix of full blocks the tier
    had (keys are chained, so a block after a gap cannot be used); the rest was computed."""

    index: int
    round: int
    agent: int
    pool: str
    tokens_requested: int
    served_local: int
    """Tokens in blocks already in the agent's pool memory."""
    served_remote: int
    """Tokens in blocks pulled from another pool's memory (NIXL or the object store)."""
    served_disk: int
    """Tokens in blocks restored from a disk tier."""
    tokens_computed: int
    blocks_requested: int
    blocks_stored: int
    parity: bool | None
    """Decode from the tier's KV equals decode from fresh KV (``None``: not sampled)."""
    fetch_errors: int
    """Blocks the tier had but a fetch failed to bring (computed instead)."""
    elapsed_s: float

    @property
    def tokens_served(self) -> int:
        return self.served_local + self.served_remote + self.served_disk


@dataclass(frozen=True, slots=True)
class TierTotals:
    """Summed over pools and shards at the end of the run (their own counters)."""

    blocks_in_memory: int
    blocks_on_disk: int
    transfers_in: int
    bytes_in: int
    spills: int
    restores: int
    evictions: int
    dedup_hits: int
    collisions: int
    lost_blocks: int
    transports: list[str]
    directory_lookups: int
    directory_hits: int


@dataclass
class DemoReport:
    config: dict[str, Any]
    pools: list[str]
    block_bytes: int
    block_tokens: int
    requests: list[RequestRecord]
    tier: TierTotals
    wall_s: float
    startup_s: float
    parity_skipped: int = 0
    notes: list[str] = field(default_factory=list)

    # -- totals ---------------------------------------------------------------------------

    def _sum(self, name: str) -> int:
        return sum(int(getattr(r, name)) for r in self.requests)

    def totals(self) -> dict[str, int]:
        checks = [r.parity for r in self.requests if r.parity is not None]
        without = self._sum("blocks_requested")
        stored = self._sum("blocks_stored")
        return {
            "requests": len(self.requests),
            "tokens_requested": self._sum("tokens_requested"),
            "tokens_served": sum(r.tokens_served for r in self.requests),
            "tokens_served_local": self._sum("served_local"),
            "tokens_served_remote": self._sum("served_remote"),
            "tokens_served_disk": self._sum("served_disk"),
            "tokens_computed": self._sum("tokens_computed"),
            "blocks_without_dedup": without,
            "blocks_stored": stored,
            "blocks_held": self.tier.blocks_in_memory + self.tier.blocks_on_disk,
            "bytes_without_dedup": without * self.block_bytes,
            "bytes_stored": stored * self.block_bytes,
            "bytes_saved": (without - stored) * self.block_bytes,
            "transfers": self.tier.transfers_in,
            "bytes_transferred": self.tier.bytes_in,
            "disk_spills": self.tier.spills,
            "disk_restores": self.tier.restores,
            "collisions": self.tier.collisions,
            "fetch_errors": self._sum("fetch_errors"),
            "parity_checks": len(checks),
            "parity_passed": sum(checks),
            "parity_skipped": self.parity_skipped,
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "pools": self.pools,
            "block_bytes": self.block_bytes,
            "block_tokens": self.block_tokens,
            "wall_s": round(self.wall_s, 3),
            "startup_s": round(self.startup_s, 3),
            "totals": self.totals(),
            "tier": asdict(self.tier),
            "requests": [asdict(r) for r in self.requests],
            "notes": self.notes,
        }

    def write_json(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):,.1f} MiB"


def _pct(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"


FAMILIES_LINE = (
    "model families run through vLLM with the tier: MLA (DeepSeek-V2/V3, Kimi-K2 geometry) and "
    "full attention (Llama, Mistral, Qwen2, Qwen3; `tessera-ray start --hf-config`); this demo "
    "runs the MLA model without vLLM"
)
"""What the summary says about model families (as the README does)."""


def render_summary(report: DemoReport) -> str:
    t = report.totals()
    c = report.config
    req, served, without = t["tokens_requested"], t["tokens_served"], t["blocks_without_dedup"]
    tier = report.tier
    rows = [
        ("agents x rounds", f"{c['num_agents']} x {c['num_rounds']} = {t['requests']} requests"),
        ("pools / directory shards", f"{len(report.pools)} / {c['num_shards']}"),
        ("tokens requested", f"{req:,}"),
        ("tokens served from the tier", f"{served:,} ({_pct(served, req)})"),
        ("  from the agent's pool memory", f"{t['tokens_served_local']:,}"),
        ("  from another pool's memory", f"{t['tokens_served_remote']:,}"),
        ("  restored from disk", f"{t['tokens_served_disk']:,}"),
        ("tokens computed", f"{t['tokens_computed']:,} ({_pct(t['tokens_computed'], req)})"),
        ("blocks stored / without dedup", f"{t['blocks_stored']:,} / {without:,}"),
        ("blocks held (memory + disk)", f"{tier.blocks_in_memory} + {tier.blocks_on_disk}"),
        ("bytes saved", f"{t['bytes_saved']:,} B ({_mib(t['bytes_saved'])})"),
        ("transfers between pools", f"{t['transfers']:,} blocks, {_mib(t['bytes_transferred'])} "
         f"({', '.join(report.tier.transports)})"),
        ("disk spills / restores", f"{t['disk_spills']:,} / {t['disk_restores']:,}"),
        ("dedup collisions", f"{t['collisions']}"),
        ("fetches that failed (computed)", f"{t['fetch_errors']} blocks"),
        ("decode parity checks passed", f"{t['parity_passed']} / {t['parity_checks']}"
         + (f" ({t['parity_skipped']} samples evicted before the check)"
            if t["parity_skipped"] else "")),
        ("wall time", f"{report.wall_s:.1f} s (Ray and tier start-up {report.startup_s:.1f} s)"),
    ]  # fmt: skip
    width = max(len(k) for k, _ in rows)
    lines = [f"tessera-ray demo: {c['num_agents']} agents on the tiny MLA model "
             f"({report.block_bytes:,} B per {report.block_tokens}-token block)"]  # fmt: skip
    lines.append("-" * (width + 40))
    lines += [f"{k:<{width}}  {v}" for k, v in rows]
    lines.append("-" * (width + 40))
    lines.append(FAMILIES_LINE)
    return "\n".join(lines)


def plot_report(report: DemoReport, out: Path) -> None:
    """Left: stored bytes over requests, with and without dedup. Right: tokens per round by
    where they came from."""
    from tessera_ray._plot import pyplot

    plt = pyplot()

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), dpi=110)
    with_dedup, without, s, w = [], [], 0, 0
    for r in report.requests:
        s += r.blocks_stored * report.block_bytes
        w += r.blocks_requested * report.block_bytes
        with_dedup.append(s / (1 << 20))
        without.append(w / (1 << 20))
    x = list(range(1, len(report.requests) + 1))
    left.plot(x, without, label="without dedup", color="tab:red")
    left.plot(x, with_dedup, label="stored by the tier", color="tab:blue")
    left.set_xlabel("requests")
    left.set_ylabel("KV bytes stored (MiB)")
    left.set_title("Stored bytes over the run")
    left.legend()
    rounds = sorted({r.round for r in report.requests})
    parts = [
        ("served_local", "pool memory", "tab:green"),
        ("served_remote", "other pool", "tab:blue"),
        ("served_disk", "disk", "tab:orange"),
        ("tokens_computed", "computed", "tab:gray"),
    ]
    bottom = [0] * len(rounds)
    for name, label, color in parts:
        vals = [sum(getattr(r, name) for r in report.requests if r.round == k) for k in rounds]
        right.bar([k + 1 for k in rounds], vals, bottom=bottom, label=label, color=color)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    right.set_xlabel("round")
    right.set_ylabel("tokens")
    right.set_xticks([k + 1 for k in rounds])
    right.set_title("Tokens by where they came from")
    right.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
