"""The tier's fetch side by side with what a user would pick instead, on the same bytes, in one run.

For each object size (a batch of 16 MiB, 4 MiB of the smallest; 256 DeepSeek-V3 MLA pages of
73,728 B and 16 x 1 MiB are the issue's two cases), from an owner process to a reader process:

- ``tessera_fetch``: the tier's full fetch path between two pool actors (owner lookup + pin +
  export in one actor call, one NIXL READ into reserved slots, every page's hash verified,
  sealed), and ``raw_nixl_read`` of the same slots, as ``bench_transport.py`` measures them.
- ``redis_get`` / ``redis_set``: Redis 7 over loopback, one MGET / MSET per batch (redis-py).
- ``mooncake_batch_get_into`` / ``mooncake_get`` / ``mooncake_put``: Mooncake Store, protocol
  tcp, P2P handshake, the reader's buffer registered once.
- ``ray_get`` / ``ray_put``: the Ray object store (get includes the copy into the reader's
  buffer).

Details of each peer's ends are in ``_peer_sides.py``. Systems are measured in phases, only
one system's processes alive at a time (NIXL agents keep polling threads running even when
idle, which on two cores would tax every other system), and the phases repeat in rounds so
that noise on a shared machine falls on all of them;
each figure is the median over rounds of per-round medians. The ``fetch_vs_*`` rows hold the
targets: >= 2x Mooncake batch get, >= 2x Redis GET, >= 2x the Ray object store, >= 0.6x raw
NIXL; a row below its target says why in its note, from this run's split of the fetch path
(``fetch_owner_call_*``: the owner's pin round trip; ``fetch_read_verify_seal_*``: the
reader's part). A peer that is not installed or does not start is a row saying why, never an
estimate.
The run happens inside a loopback-only network namespace when one can be made (``_peers.py``).
Plots: ``peers_read.png`` and ``peers_write.png``, GB/s by object size, one line per system.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
# Before anything loads UCX: its ib module crashes a process at exit with some system
# libibverbs (this single-host benchmark has no use for RDMA); an operator's choice stays.
os.environ.setdefault("UCX_MODULES", "^ib")

import _peers  # noqa: E402
from _peer_sides import MooncakeSide, RaySide, RedisSide  # noqa: E402
from bench_transport import MIB, MLA_PAGE_BYTES, payload, run_case  # noqa: E402
from common import Row, parse_args, start_local_ray, write_result  # noqa: E402

GB = 1e9
CALL_TIMEOUT_S = 120.0
"""One timed call of a peer; a peer that hangs becomes a "not available" row, not a hung run."""


@dataclass(frozen=True)
class Size:
    label: str
    page_bytes: int
    count: int
    case: str | None = None
    """The issue's workload name for the sizes whose ``fetch_vs_*`` rows carry the targets."""

    @property
    def nbytes(self) -> int:
        return self.page_bytes * self.count


SIZES = [
    # 4 MiB, not 16: per-object costs dominate at this size (Ray puts 1,024 objects in seconds).
    Size("16KiB", 16 << 10, 256),
    Size("72KiB", MLA_PAGE_BYTES, 256, "mla256"),
    Size("256KiB", 256 << 10, 64),
    Size("1MiB", MIB, 16, "16mib"),
    Size("4MiB", 4 * MIB, 4),
]


@dataclass(frozen=True)
class Series:
    key: str
    system: str
    label: str
    write: bool = False


SERIES = [
    Series("tessera_fetch", "tessera", "tessera fetch (NIXL READ + verify + seal)"),
    Series("raw_nixl_read", "tessera", "raw NIXL READ"),
    Series("memcpy", "tessera", "memcpy (one process)"),
    Series("mooncake_batch_get_into", "mooncake", "Mooncake batch_get_into (tcp)"),
    Series("mooncake_get", "mooncake", "Mooncake get (tcp)"),
    Series("redis_get", "redis", "Redis GET (one MGET per batch)"),
    Series("ray_get", "ray", "Ray object store get + copy"),
    Series("mooncake_put", "mooncake", "Mooncake put_batch (owner's segment)", write=True),
    Series("redis_set", "redis", "Redis SET (one MSET per batch)", write=True),
    Series("ray_put", "ray", "Ray object store put", write=True),
]
TARGETS = [("mooncake_batch_get_into", 2.0), ("redis_get", 2.0), ("ray_get", 2.0)]
TARGETS.append(("raw_nixl_read", 0.6))

TESSERA_KEYS = [("tessera_fetch", "full"), ("raw_nixl_read", "raw"), ("memcpy", "memcpy")]
"""Series key -> the name ``bench_transport.BenchNode.measure`` reports it under."""

Samples = dict[str, dict[str, list[float]]]
"""series key -> size label -> GB/s, one per round."""


def _gbs(size: Size, seconds: list[float]) -> float:
    return size.nbytes / statistics.median(seconds) / GB


def _rows_ref(size: Size) -> Any:
    import ray

    return ray.put(payload(size.count, size.page_bytes).numpy())


def tessera_round(sizes: list[Size], reps: int, out: Samples) -> None:
    for size in sizes:
        r = run_case(size.page_bytes, size.count, reps)
        for key, name in TESSERA_KEYS:
            out[key][size.label].append(r[name])
        # The full path's two halves, to explain a missed target with this run's numbers.
        out["owner_call_ms"][size.label].append(r["owner_call_ms"])
        out["read_verify_seal"][size.label].append(size.nbytes / r["read_verify_seal_ms"] / 1e6)


def _get(ref: Any) -> Any:
    import ray

    return ray.get(ref, timeout=CALL_TIMEOUT_S)


def redis_round(peer: _peers.Peer, sizes: list[Size], reps: int, out: Samples) -> None:
    import ray

    side: Any = ray.remote(RedisSide).options(num_cpus=0)
    owner, reader = side.remote(peer.address), side.remote(peer.address)
    try:
        for size in sizes:
            ref = _rows_ref(size)
            _get([owner.prepare.remote(ref), reader.prepare.remote(ref)])
            puts, gets = [], []
            for rep in range(reps + 1):  # rep 0 warms up, untimed
                puts.append(_get(owner.put.remote(rep)))
                gets.append(_get(reader.get.remote(rep)))
            out["redis_set"][size.label].append(_gbs(size, puts[1:]))
            out["redis_get"][size.label].append(_gbs(size, gets[1:]))
    finally:
        for actor in (owner, reader):
            ray.kill(actor)


def mooncake_round(peer: _peers.Peer, sizes: list[Size], reps: int, out: Samples) -> None:
    import ray

    side: Any = ray.remote(MooncakeSide).options(num_cpus=0)
    biggest = max(s.nbytes for s in sizes)
    # The owner's segment holds two batches at most (each is dropped once read); the local
    # buffers stage put and get.
    owner = side.remote(peer.address, segment_bytes=4 * biggest, buffer_bytes=2 * biggest)
    reader = side.remote(peer.address, segment_bytes=0, buffer_bytes=2 * biggest)
    try:
        for size in sizes:
            ref = _rows_ref(size)
            _get([owner.prepare.remote(ref), reader.prepare.remote(ref)])
            times: dict[str, list[float]] = defaultdict(list)
            for rep in range(reps + 1):
                times["mooncake_put"].append(_get(owner.put.remote(rep)))
                times["mooncake_get"].append(_get(reader.get.remote(rep)))
                times["mooncake_batch_get_into"].append(_get(reader.batch_get_into.remote(rep)))
                _get(owner.drop.remote(rep))
            if not _get(reader.matches.remote()):
                raise RuntimeError("batch_get_into delivered different bytes")
            for key, samples in times.items():
                out[key][size.label].append(_gbs(size, samples[1:]))
        _get([owner.close.remote(), reader.close.remote()])
    finally:
        for actor in (owner, reader):
            ray.kill(actor)


def ray_round(sizes: list[Size], reps: int, out: Samples) -> None:
    import ray

    side: Any = ray.remote(RaySide).options(num_cpus=0)
    owner, reader = side.remote(), side.remote()
    try:
        for size in sizes:
            ref = _rows_ref(size)
            _get([owner.prepare.remote(ref), reader.prepare.remote(ref)])
            puts, gets = [], []
            for _ in range(reps + 1):
                seconds, refs = _get(owner.put.remote(0))
                puts.append(seconds)
                gets.append(_get(reader.get.remote(refs)))
                del refs
            out["ray_put"][size.label].append(_gbs(size, puts[1:]))
            out["ray_get"][size.label].append(_gbs(size, gets[1:]))
    finally:
        for actor in (owner, reader):
            ray.kill(actor)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:200]


def measure(
    sizes: list[Size], reps: int, rounds: int
) -> tuple[Samples, dict[str, str], dict[str, str]]:
    """Every system over every size, ``rounds`` times; returns the samples, why each missing
    system is missing, and the versions of those that ran."""
    import ray

    problems: dict[str, str] = {}
    versions = {"ray": f"ray {ray.__version__}", "tessera": f"nixl {_peers.version('nixl')}"}
    checks = {"redis": _peers.redis_problem(), "mooncake": _peers.mooncake_problem()}
    problems.update({k: v for k, v in checks.items() if v is not None})
    samples: Samples = defaultdict(lambda: defaultdict(list))
    with _PeerServers(problems, versions) as servers:
        phases: list[tuple[str, Callable[[], None]]] = [
            ("tessera", lambda: tessera_round(sizes, reps, samples)),
            ("redis", lambda: redis_round(servers["redis"], sizes, reps, samples)),
            ("mooncake", lambda: mooncake_round(servers["mooncake"], sizes, reps, samples)),
            ("ray", lambda: ray_round(sizes, reps, samples)),
        ]
        for r in range(rounds):
            for system, phase in phases:
                if system in problems:
                    continue
                start = time.monotonic()
                if system == "tessera":
                    phase()  # the tier itself must work: its failure fails the benchmark
                else:
                    try:
                        phase()
                    except Exception as exc:  # a peer that breaks mid-run is reported
                        problems[system] = f"failed during the run: {_first_line(exc)}"
                took = time.monotonic() - start
                print(f"round {r + 1}/{rounds}: {system} in {took:.1f} s", flush=True)
    return samples, problems, versions


class _PeerServers:
    """Starts the servers of the peers that are installed; a server that does not start turns
    into a problem for its system."""

    def __init__(self, problems: dict[str, str], versions: dict[str, str]) -> None:
        self.problems, self.versions = problems, versions
        self.servers: dict[str, _peers.Peer] = {}
        self._stack: Any = None

    def __enter__(self) -> dict[str, _peers.Peer]:
        from contextlib import ExitStack

        self._stack = ExitStack()
        for system, start in (("redis", _peers.redis_server), ("mooncake", _peers.mooncake_master)):
            if system in self.problems:
                continue
            try:
                peer = self._stack.enter_context(start())
            except Exception as exc:
                self.problems[system] = f"server did not start: {_first_line(exc)}"
                continue
            self.servers[system] = peer
            self.versions[system] = peer.version
        return self.servers

    def __exit__(self, *exc: object) -> None:
        self._stack.close()


def _miss_reason(peer: str, fetch: float, base: float, size: Size, parts: dict[str, float]) -> str:
    """Why the fetch path is below ``peer`` here, in this run's own numbers."""
    total_ms = size.nbytes / fetch / 1e6
    own = (
        f"the fetch spends {parts['owner_call_ms']:.1f} of {total_ms:.1f} ms per batch in the "
        f"owner's pin round trip (lookup + pin + export on the pin channel), and its reader "
        f"part (READ + hash "
        f"every page + seal) runs at {parts['read_verify_seal']:.2f} GB/s"
    )
    if peer == "raw_nixl_read":
        return f"{own} = {parts['read_verify_seal'] / base:.2f}x raw NIXL"
    if peer == "ray_get":
        return (
            f"{own}; on one node Ray's get maps the owner's shared memory, so get + copy is a "
            f"local copy at {base:.2f} GB/s (no transfer, no verification)"
        )
    return f"{own}; {peer} moved the same bytes at {base:.2f} GB/s without verifying them"


def build_rows(sizes: list[Size], samples: Samples, problems: dict[str, str]) -> list[Row]:
    def value(key: str, size: Size) -> float | None:
        got = samples.get(key, {}).get(size.label)
        return statistics.median(got) if got else None

    system_of = {s.key: s.system for s in SERIES}
    rows: list[Row] = []
    for size in sizes:
        if size.case is None:
            continue
        fetch = value("tessera_fetch", size)
        assert fetch is not None, "the tier's fetch is always measured"
        parts = {k: value(k, size) or 0.0 for k in ("owner_call_ms", "read_verify_seal")}
        what = f"{size.count} x {size.page_bytes:,} B"
        for peer, target in TARGETS:
            base = value(peer, size)
            if base is None:
                note = f"{what}; {peer}: not available: {problems.get(system_of[peer])}"
            elif fetch / base < target:
                note = f"{what}; below target: {_miss_reason(peer, fetch, base, size, parts)}"
            else:
                note = what
            rows.append(
                Row(
                    name=f"fetch_vs_{peer}_{size.case}",
                    value=fetch,
                    unit="GB/s",
                    baseline=f"{peer}_{size.label}",
                    baseline_value=base,
                    target_ratio=target,
                    derived_from=f"tessera_fetch_{size.label} and {peer}_{size.label}",
                    note=note,
                )
            )
        rows.append(
            Row(
                name=f"fetch_owner_call_{size.case}",
                value=parts["owner_call_ms"],
                unit="ms",
                note=f"{what}; lookup + pin + export, one request on the pin channel",
            )
        )
        rows.append(
            Row(
                name=f"fetch_read_verify_seal_{size.case}",
                value=parts["read_verify_seal"],
                unit="GB/s",
                baseline=f"raw_nixl_read_{size.label}",
                baseline_value=value("raw_nixl_read", size),
                note=f"{what}; the reader's part of the fetch (no owner round trip)",
            )
        )
    for series in SERIES:
        for size in sizes:
            name = f"{series.key}_{size.label}"
            got = value(series.key, size)
            if got is None:
                why = problems.get(series.system, "no sample")
                rows.append(Row.unavailable(name, "GB/s", why))
                continue
            note = f"{size.count} x {size.page_bytes:,} B; {series.label}"
            rows.append(Row(name=name, value=got, unit="GB/s", note=note))
    return rows


def main() -> None:
    _peers.enter_loopback_namespace(sys.argv)
    args = parse_args("peers")
    import ray

    sizes = [s for s in SIZES if s.case is not None] if args.quick else SIZES
    reps, rounds = (3, 1) if args.quick else (5, 2)
    # The actors import this folder's modules (bench_transport, _peer_sides) by name.
    start_local_ray(object_store_bytes=1 << 30, pythonpath=(str(ROOT), str(HERE)))
    try:
        samples, problems, versions = measure(sizes, reps, rounds)
    finally:
        ray.shutdown()
    rows = build_rows(sizes, samples, problems)
    versions.update({k: f"not available: {v}" for k, v in problems.items()})
    from plot import throughput_plots

    plots = throughput_plots(sizes, samples, SERIES, args.out.parent, prefix="peers")
    write_result("peers", args, rows, plots=plots, versions=versions)


if __name__ == "__main__":
    main()
