"""What the fleet simulator (``bench_trace.py``) reads: a request trace and a model profile,
both validated whole before anything runs, so a bad line is refused with its line number
instead of surfacing as a crash an hour into a replay.

Trace format (the Mooncake FAST'25 trace release, ``../shared/traces/README.md``): one JSON
object a line with ``timestamp`` (ms from the start), ``input_length``, ``output_length`` and
``hash_ids``, one id per block of ``TRACE_BLOCK_TOKENS`` prompt tokens; two requests share a
prefix exactly as far as their ``hash_ids`` agree.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

__all__ = [
    "TRACE_BLOCK_TOKENS",
    "TraceError",
    "TraceRequest",
    "ModelProfile",
    "load_trace",
    "parse_trace_lines",
    "load_profile",
    "profile_from_dict",
    "check_fits",
]

TRACE_BLOCK_TOKENS = 512
"""Tokens per ``hash_ids`` entry in the trace release (its README)."""

_TRACE_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


class TraceError(ValueError):
    """A trace line or a profile that cannot be replayed; the message names where and what."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace, in arrival order (``index`` is its position there)."""

    index: int
    arrival_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    block_tokens: int = TRACE_BLOCK_TOKENS
    """Prompt tokens per ``hash_ids`` entry."""

    @property
    def full_blocks(self) -> int:
        """Blocks an engine can cache: only full ones (vLLM hashes full blocks only)."""
        return min(len(self.hash_ids), self.input_length // self.block_tokens)


def _nonneg_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _request(lineno: int, obj: Any, index: int, block_tokens: int) -> TraceRequest:
    where = f"trace line {lineno}"
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    missing = [f for f in _TRACE_FIELDS if f not in obj]
    if missing:
        raise TraceError(f"{where}: missing field(s) {', '.join(missing)}")
    ts = obj["timestamp"]
    if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not ts >= 0:
        raise TraceError(f"{where}: timestamp must be a number of ms >= 0, got {ts!r}")
    for name in ("input_length", "output_length"):
        if not _nonneg_int(obj[name]):
            raise TraceError(f"{where}: {name} must be an int >= 0, got {obj[name]!r}")
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or not all(_nonneg_int(i) for i in ids):
        raise TraceError(f"{where}: hash_ids must be a list of ints >= 0")
    expect = math.ceil(obj["input_length"] / block_tokens)
    if len(ids) != expect:
        raise TraceError(
            f"{where}: {len(ids)} hash_ids for input_length {obj['input_length']}, expected "
            f"{expect} (one per {block_tokens} tokens)"
        )
    n, out = obj["input_length"], obj["output_length"]
    return TraceRequest(index, float(ts), n, out, tuple(ids), block_tokens)


def parse_trace_lines(
    lines: list[str], *, source: str = "trace", block_tokens: int = TRACE_BLOCK_TOKENS
) -> list[TraceRequest]:
    """Every non-blank line parsed and checked, then sorted by arrival (stable)."""
    out: list[TraceRequest] = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceError(f"{source} line {lineno}: not valid JSON ({e.msg})") from None
        try:
            out.append(_request(lineno, obj, len(out), block_tokens))
        except TraceError as e:
            raise TraceError(f"{source}: {e}") from None
    if not out:
        raise TraceError(f"{source}: no requests")
    out.sort(key=lambda r: r.arrival_ms)
    return [dataclasses.replace(r, index=i) for i, r in enumerate(out)]


def load_trace(path: Path, limit: int | None = None) -> list[TraceRequest]:
    """The trace at ``path`` (all of it is validated; ``limit`` keeps the first requests)."""
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise TraceError(f"cannot read trace {path}: {e.strerror}") from None
    requests = parse_trace_lines(lines, source=str(path))
    return requests if limit is None else requests[:limit]


@dataclass(frozen=True, kw_only=True)
class ModelProfile:
    """Time and capacity figures of one engine replica and its node, in seconds, bytes and
    GB/s. Each figure is required and checked; a profile file also carries ``sources`` (where
    each figure comes from), which the simulator keeps but does not read."""

    name: str
    kv_bytes_per_token: int
    """KV bytes per token of the model, as its engine pages them (``tessera-ray size``)."""
    prefill_s_per_token: float
    """Prefill cost per new token, the weights' share (linear in tokens)."""
    attention_s_per_pair: float
    """Prefill cost per (new token, context token) pair: the attention term."""
    decode_s_per_token: float
    """Time between output tokens of one running request (one decode step)."""
    max_running: int
    """Requests one replica decodes at once (the engine's batch limit)."""
    engine_cache_tokens: int
    """KV tokens one replica's engine holds: running requests and its own prefix cache."""
    replicas_per_node: int
    pool_bytes_per_node: int
    """The tier pool on each node (0: no pool)."""
    disk_bytes_per_node: int
    same_node_gb_s: float
    """Tier pool on the node to the engine."""
    cross_node_gb_s: float
    """Another node's pool to this node's pool."""
    disk_gb_s: float
    request_overhead_s: float
    """Time a request spends outside the engine (HTTP, proxy, routing), added to its TTFT."""

    def prefill_s(self, new_tokens: int, context_tokens: int) -> float:
        """Prefill of ``new_tokens`` after ``context_tokens`` already in the cache (causal)."""
        pairs = new_tokens * (context_tokens + (new_tokens + 1) / 2)
        return new_tokens * self.prefill_s_per_token + pairs * self.attention_s_per_pair


_INT_FIELDS = {
    "kv_bytes_per_token",
    "max_running",
    "engine_cache_tokens",
    "replicas_per_node",
    "pool_bytes_per_node",
    "disk_bytes_per_node",
}
_POSITIVE = {"kv_bytes_per_token", "max_running", "engine_cache_tokens", "replicas_per_node"}
_POSITIVE |= {"same_node_gb_s", "cross_node_gb_s", "disk_gb_s", "prefill_s_per_token"}


def profile_from_dict(raw: dict[str, Any], *, source: str = "profile") -> ModelProfile:
    """A checked profile: every field present, numbers finite and >= 0 (> 0 where a zero
    would divide or stall); unknown keys other than ``sources`` are refused."""
    if not isinstance(raw, dict):
        raise TraceError(f"{source}: a profile is a JSON object")
    names = [f.name for f in fields(ModelProfile)]
    unknown = sorted(set(raw) - set(names) - {"sources"})
    if unknown:
        raise TraceError(f"{source}: unknown field(s) {', '.join(unknown)}")
    missing = [n for n in names if n not in raw]
    if missing:
        raise TraceError(f"{source}: missing figure(s) {', '.join(missing)}")
    values: dict[str, Any] = {}
    for name in names:
        v = raw[name]
        if name == "name":
            if not isinstance(v, str) or not v:
                raise TraceError(f"{source}: {name} must be a non-empty string, got {v!r}")
        else:
            ok_type = isinstance(v, int) if name in _INT_FIELDS else isinstance(v, (int, float))
            if not ok_type or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                raise TraceError(f"{source}: {name} must be a finite number >= 0, got {v!r}")
            if name in _POSITIVE and v == 0:
                raise TraceError(f"{source}: {name} must be > 0, got {v!r}")
            v = v if name in _INT_FIELDS else float(v)
        values[name] = v
    return ModelProfile(**values)


def load_profile(path: Path) -> ModelProfile:
    try:
        raw = json.loads(path.read_text())
    except OSError as e:
        raise TraceError(f"cannot read profile {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise TraceError(f"profile {path}: not valid JSON ({e.msg})") from None
    return profile_from_dict(raw, source=f"profile {path}")


def check_fits(requests: Sequence[TraceRequest], profile: ModelProfile) -> None:
    """Refuse, before any replay, a profile whose replica cannot hold one of the requests'
    KV (prompt and output) even alone: the replay would stop at that request, with every
    figure before it wasted. Names the profile, the first such request and how many there are."""
    cap = profile.engine_cache_tokens
    too_big = [r for r in requests if r.input_length + r.output_length > cap]
    if too_big:
        first = too_big[0]
        raise TraceError(
            f"profile {profile.name!r} cannot hold the trace: request {first.index} needs "
            f"{first.input_length + first.output_length:,} KV tokens "
            f"({first.input_length:,} prompt + {first.output_length:,} output), more than a "
            f"replica's engine_cache_tokens ({cap:,}); {len(too_big)} of {len(requests)} "
            "requests do not fit"
        )
