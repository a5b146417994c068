"""``tessera-ray status``: a table of the tier's pools and directory shards (Ray imported
lazily, so the other subcommands stay fast and Ray-free)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["add_status_command", "render_status", "status_json"]


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f}MiB"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in [header, *rows]]


def render_status(pools: Sequence[object], shards: Sequence[object]) -> str:
    """The text of one ``status`` snapshot (entries that are strings are down components)."""
    from tessera_ray.actors.directory import DirectoryStats, Tier
    from tessera_ray.actors.messages import PoolStatus

    rows, down = [], []
    for p in pools:
        if not isinstance(p, PoolStatus):
            down.append(str(p))
            continue
        mem_used = p.pages_used.get(Tier.MEMORY, 0)
        mem_total = mem_used + p.pages_free.get(Tier.MEMORY, 0)
        seals = p.dedup_hits + mem_used
        # Integrity and security signals make a pool's health line, not only its liveness.
        signals = (p.collisions, p.quarantines, p.rotten_blocks, p.lost_blocks)
        health = "WARN" if any(signals) else "ok"
        rows.append(
            [
                p.name,
                p.node[:12],
                f"{mem_used}/{mem_total}",
                f"{p.blocks_on_disk} ({_mib(p.disk_bytes)})",
                f"{p.blocks_in_memory}+{p.blocks_on_disk}",
                f"{seals / mem_used:.2f}" if mem_used else "-",
                str(p.collisions),
                str(p.quarantines),
                str(p.rotten_blocks),
                health,
            ]
        )
    header = ["pool", "node", "mem pages", "disk blocks", "blocks", "dedup", "collisions"]
    lines = [f"pools: {len(rows)} up, {len(down)} down"]
    lines += _table([*header, "quarantines", "rotten", "health"], rows)
    lines += [f"{d}" for d in down]
    srows, sdown = [], []
    for s in shards:
        if not isinstance(s, DirectoryStats):
            sdown.append(str(s))
            continue
        rate = f"{s.hits / s.lookups:.0%}" if s.lookups else "-"
        counts = (s.token_keys, s.blocks, s.replicas, s.pools, s.lookups)
        srows.append([f"shard {s.shard}", *map(str, counts), rate, "ok"])
    lines += ["", f"directory shards: {len(srows)} up, {len(sdown)} down"]
    header = ["shard", "token keys", "blocks", "replicas", "pools", "lookups", "hit rate"]
    lines += _table([*header, "health"], srows)
    lines += [f"{d}" for d in sdown]
    return "\n".join(lines)


def _component(c: object) -> dict[str, Any]:
    if not dataclasses.is_dataclass(c) or isinstance(c, type):
        return {"down": str(c)}
    out = dataclasses.asdict(c)
    for name, value in out.items():  # per-tier counts: keyed by the tier's name
        if isinstance(value, dict):
            out[name] = {getattr(k, "name", str(k)).lower(): v for k, v in value.items()}
    return out


def status_json(pools: Sequence[object], shards: Sequence[object]) -> str:
    """One ``status`` snapshot as JSON: every field of each pool's and shard's status, or
    ``{"down": reason}`` for a component that did not answer."""
    return json.dumps(
        {"pools": [_component(p) for p in pools], "shards": list(map(_component, shards))}
    )


def _cmd_status(ns: argparse.Namespace) -> int:
    from tessera_ray.actors.client import TesseraClient

    client = TesseraClient.connect(ns.ray_namespace, address=ns.address)
    render = status_json if ns.json else render_status
    while True:
        print(render(*client.status()), flush=True)
        if ns.watch is None:
            return 0
        try:
            time.sleep(ns.watch)  # a refresh period the operator asked for, not a poll
        except KeyboardInterrupt:
            return 0
        print()


def add_status_command(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    status = sub.add_parser("status", help="pools and directory shards of a running tier")
    status.add_argument("--address", default=None, help="Ray address (default: auto-detect)")
    status.add_argument("--ray-namespace", default="tessera", help="Ray namespace of the actors")
    status.add_argument(
        "--watch",
        type=float,
        nargs="?",
        const=2.0,
        default=None,
        metavar="SECONDS",
        help="refresh every SECONDS (default 2) until interrupted",
    )
    status.add_argument("--json", action="store_true", help="one JSON object per snapshot")
    status.set_defaults(handler=_cmd_status)
