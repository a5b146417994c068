"""RELIABILITY.md from the chaos suite's JSON (``make reliability`` runs both).

``python -m tests.chaos.render [build/reliability.json] [RELIABILITY.md]``. Every figure in the
document is read from the JSON a run of ``tests/chaos`` wrote; nothing here is typed by hand.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
COMMAND = "make reliability"
"""Runs ``pytest tests/chaos`` (writing build/reliability.json), then this script."""


def _faults(data: dict[str, Any]) -> list[str]:
    rows = ["| fault | injected | survived | what happened |", "|---|---:|---:|---|"]
    for name, f in sorted(data["faults"].items()):
        notes = "; ".join(f["notes"][:5])
        rows.append(f"| {name} | {f['injected']} | {f['survived']} | {notes} |")
    return rows


def _rejections(data: dict[str, Any]) -> list[str]:
    rows = [
        "| bad input | tried | rejected | state unchanged | error |",
        "|---|---:|---:|---:|---|",
    ]
    for name, r in sorted(data["rejections"].items()):
        rows.append(
            f"| {name} | {r['tried']} | {r['rejected']} | {r['state_unchanged']} | "
            f"{', '.join(r['errors'])} |"
        )
    return rows


def _load(load: dict[str, Any]) -> list[str]:
    rows = ["| operation | count | p50 ms | p99 ms |", "|---|---:|---:|---:|"]
    for op, lat in load["latency"].items():
        rows.append(f"| {op} | {lat['count']} | {lat['p50_ms']} | {lat['p99_ms']} |")
    return rows


def _retried(load: dict[str, Any]) -> str:
    n = load.get("blocks_served_by_another_replica_at_the_end")
    if n is None:  # a run from before the accounting counted it
        return ""
    return f" ({n} of them through another replica than the directory's first choice)"


def render(data: dict[str, Any]) -> str:
    figures = data["figures"]
    final = figures.get("final_accounting", {})
    load = figures.get("load")
    collide = figures.get("collision_campaign")
    injected = sum(f["injected"] for f in data["faults"].values())
    survived = sum(f["survived"] for f in data["faults"].values())
    tried = sum(r["tried"] for r in data["rejections"].values())
    refused = sum(r["rejected"] for r in data["rejections"].values())
    lost = final.get("lost", "not measured")
    if load is not None:
        lost_load = load["blocks_stored"] - load["blocks_present_byte_exact"]
    out = [
        "# Reliability",
        "",
        "Generated from the chaos suite's own run (`tests/chaos`, part of `make test`); do not",
        f"edit by hand. Reproduce every figure with `{COMMAND}` (about "
        f"{data['duration_s'] / 60:.0f} min here).",
        "",
        f"Run {data['when']} on {data['machine']}; a 3-node simulated Ray cluster on 127.0.0.1 "
        "with Ray token authentication on.",
        "",
        "## Summary",
        "",
        "| figure | value |",
        "|---|---:|",
        f"| pages served and checked against ground truth | {data['pages_checked']:,} |",
        f"| wrong pages served | {data['wrong_pages']} |",
        f"| faults injected / survived | {injected} / {survived} |",
        f"| blocks acknowledged under faults | {data['acknowledged_blocks']} |",
        f"| acknowledged blocks lost (fault suite) | {lost} |",
    ]
    if final:
        out.append(
            "| acknowledged blocks whose only copy the injected disk corruption destroyed "
            f"(detected, quarantined, never served) | {final['destroyed_by_injected_corruption']} |"
        )
    if load is not None:
        out.append(f"| blocks lost under load | {lost_load} of {load['blocks_stored']:,} |")
    out += [
        f"| bad inputs tried / rejected | {tried} / {refused} |",
        f"| calls retried after an actor died | {data['retries']} |",
        "",
        "Ground truth: every page a request gets back is compared with the tiny MLA model's "
        "recomputation of that request's own tokens (not with what the tier says it stored); "
        "every block the tier acknowledged is re-read at the end and compared with the hash of "
        "its true bytes. The fault suite runs pools with write-through to their disk tiers, so "
        "a pool process that dies loses nothing it acknowledged (Ray restarts it, it reopens "
        "its disk tier and re-announces it).",
        "",
        "## Faults injected under a running agent workload",
        "",
        *_faults(data),
        "",
        "## Bad input tried and rejected",
        "",
        "Each is sent to a live pool or directory shard; the pool's and the directory's state "
        "(blocks in memory and on disk, free slots, reservations, pins, token keys) is compared "
        "before and after.",
        "",
        *_rejections(data),
        "",
    ]
    if collide is not None:
        out += [
            "## Forced-collision campaign across tenants",
            "",
            f"A pool sealing with a {collide['hash_bits']}-bit content hash (so nearly every "
            f"page collides), {collide['tenants']} tenants each storing distinct blocks plus "
            f"blocks identical to the other tenant's: {collide['pages_sealed']} pages sealed, "
            f"{collide['collisions_detected']} hash collisions caught by byte comparison, "
            f"{collide['dedup_hits']} pages shared (the dedup index is scoped by tenant, so "
            f"identical bytes of two tenants are never one page), "
            f"{collide['wrong_pages_served']} wrong pages served; every tenant read back "
            "exactly its own bytes.",
            "",
        ]
    if load is not None:
        out += [
            "## Load",
            "",
            f"{load['clients']} concurrent clients (asyncio, one driver), "
            f"{load['operations']:,} store / lookup / fetch operations in {load['wall_s']} s "
            f"({load['ops_per_s']} ops/s), tenant credentials checked on every call; "
            f"{load['refused_pool_busy']} stores refused while a pool was full of concurrent "
            f"reservations (retried as new operations). {load['blocks_stored']:,} blocks "
            f"stored, {load['blocks_present_byte_exact']:,} present and byte-exact at the end"
            f"{_retried(load)}, "
            f"{load['lost_by_the_tier']} lost; pools spilled to disk {load['spilled_to_disk']:,} "
            "times on the way (memory held 3 x 512 blocks).",
            "",
            *_load(load),
            "",
        ]
    return "\n".join(out)


def main(argv: list[str]) -> int:
    src = Path(argv[0]) if argv else ROOT / "build" / "reliability.json"
    dst = Path(argv[1]) if len(argv) > 1 else ROOT / "RELIABILITY.md"
    dst.write_text(render(json.loads(src.read_text(encoding="utf-8"))), encoding="utf-8")
    print(f"wrote {dst} from {src}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
