"""bench_trace.py's fleet simulator: a hand-written trace whose hits, tokens computed and order of
events are worked out by hand, the routers' rules, input validation, and ``--quick``."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tessera_ray.demo.workload import DemoConfig
from tessera_ray.layout import preset_layout
from tests.benchmarks.contract import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
from _serve_sim import SIM_ROUTERS, fit_profile, fleet_trace, predict
from _trace_input import (
    TRACE_BLOCK_TOKENS,
    ModelProfile,
    TraceError,
    TraceRequest,
    check_fits,
    load_profile,
    parse_trace_lines,
    profile_from_dict,
)
from _trace_routers import OverlapMinusLoad, RayPrefixAffinity, RoundRobin, TesseraRouter
from _trace_sim import Fleet, bound_tokens, request_keys
from bench_trace import DEFAULT_PROFILE
from bench_trace import main as bench_main

sys.path.pop(0)

BLOCK_BYTES = TRACE_BLOCK_TOKENS * 31_104  # deepseek-v2-lite: 31,104 B per token
GBPS_1MS = BLOCK_BYTES / 1e9 / 1e-3  # GB/s at which one trace block takes 1 ms


def profile(**over: object) -> ModelProfile:
    """1 ms per prompt token, no attention term, 10 ms per output token, one replica a node,
    1 ms per block from this node's pool and 1 ms more from another node's."""
    raw: dict[str, object] = {
        "name": "hand",
        "kv_bytes_per_token": 31_104,
        "prefill_s_per_token": 1e-3,
        "attention_s_per_pair": 0.0,
        "decode_s_per_token": 1e-2,
        "max_running": 4,
        "engine_cache_tokens": 100_000,
        "replicas_per_node": 1,
        "pool_bytes_per_node": 1 << 40,
        "disk_bytes_per_node": 0,
        "same_node_gb_s": GBPS_1MS,
        "cross_node_gb_s": GBPS_1MS,
        "disk_gb_s": 1.0,
        "request_overhead_s": 0.0,
    }
    raw.update(over)
    return profile_from_dict(raw)


def trace(*reqs: tuple[float, int, int, list[int]]) -> list[TraceRequest]:
    lines = [
        json.dumps({"timestamp": t, "input_length": n, "output_length": o, "hash_ids": ids})
        for t, n, o, ids in reqs
    ]
    return parse_trace_lines(lines)


HAND = trace(
    (0, 1024, 10, [1, 2]),  # A -> replica 0: computes 1024, first token at 1.024 s
    (500, 1536, 0, [1, 2, 3]),  # B -> replica 1 (node 1), nothing stored yet: computes 1536
    (2000, 1536, 0, [1, 2, 4]),  # C -> replica 0: [1, 2] in its own cache, computes 512
    (3000, 1100, 0, [1, 2, 5]),  # D -> replica 1: two full blocks cached, computes 76
    (4000, 2048, 0, [1, 2, 3, 6]),  # E -> replica 0: [1, 2] own, [3] on node 1's pool
)


def run(
    reqs: list[TraceRequest], *, tier: bool, replicas: int = 2, prof: ModelProfile | None = None
):
    fleet = Fleet(prof or profile(), replicas, tier=tier)
    return fleet, fleet.run(reqs, request_keys(reqs), RoundRobin(), time_scale=1.0)


def test_hand_trace_without_the_tier() -> None:
    _, s = run(HAND, tier=False)
    assert s.prompt_tokens == 1024 + 1536 + 1536 + 1100 + 2048
    # E finds only [1, 2] on replica 0 and computes its last two blocks.
    assert s.computed_tokens == 1024 + 1536 + 512 + 76 + 1024
    assert s.local_tokens == 0 + 0 + 1024 + 1024 + 1024
    assert s.tier_node_tokens == s.tier_remote_tokens == s.disk_tokens == 0
    # First tokens in the order prefills end: A 1.024, B 0.5 + 1.536, C, D, E.
    assert s.ttft_s == pytest.approx([1.024, 1.536, 0.512, 0.076, 1.024])


def test_hand_trace_with_the_tier_reads_another_nodes_pool() -> None:
    fleet, s = run(HAND, tier=True)
    # E: [1, 2] from replica 0's own cache, [3] read from node 1's pool (stored by B at
    # 2.036 s) in 2 ms, then 512 tokens computed.
    assert s.computed_tokens == 1024 + 1536 + 512 + 76 + 512
    assert s.tier_remote_tokens == 512 and s.tier_node_tokens == 0
    assert s.ttft_s == pytest.approx([1.024, 1.536, 0.512, 0.076, 0.002 + 0.512])
    # The block read from node 1 now has a replica in node 0's pool as well.
    k3 = request_keys(HAND)[4][2]
    (found,) = fleet.directory.lookup([k3])
    assert found is not None and {r.pool for r in found.replicas} == {"pool-0", "pool-1"}


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    _, s = run(trace((0, 1024, 0, [1, 2]), (2000, 1024, 0, [1, 2])), tier=False, replicas=1)
    assert s.computed_tokens == 1024 + 1
    assert s.ttft_s == pytest.approx([1.024, 0.001])


def test_a_full_batch_holds_the_next_request_until_a_decode_ends() -> None:
    reqs = trace((0, 1024, 100, [1, 2]), (100, 512, 0, [9]))
    _, s = run(reqs, tier=False, replicas=1, prof=profile(max_running=1))
    # A: prefill to 1.024 s, 100 decode steps to 2.024 s; B starts then: 2.536 - 0.1.
    assert s.ttft_s == pytest.approx([1.024, 2.436])


def test_a_replica_without_kv_room_waits_and_one_too_small_is_refused() -> None:
    reqs = trace((0, 1024, 0, [1, 2]), (0, 1024, 0, [3, 4]))
    _, s = run(reqs, tier=False, replicas=1, prof=profile(engine_cache_tokens=1024))
    assert s.ttft_s == pytest.approx([1.024, 2.048])  # B waits for A's blocks to be evictable
    with pytest.raises(TraceError, match="engine_cache_tokens"):
        run(reqs, tier=False, replicas=1, prof=profile(engine_cache_tokens=1000))


def test_a_profile_that_cannot_hold_a_request_is_refused_before_the_replay(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The check runs before any request is replayed, and names the profile, the first request
    that does not fit, what it needs, and how many others do not fit either."""
    reqs = trace((0, 512, 0, [1]), (10, 1024, 8, [2, 3]), (20, 900, 200, [4, 5]))
    small = profile(name="small", engine_cache_tokens=1024)
    with pytest.raises(TraceError) as refused:
        check_fits(reqs, small)
    message = str(refused.value)
    assert "profile 'small'" in message and "request 1 needs 1,032 KV tokens" in message
    assert "(1,024 prompt + 8 output)" in message and "(1,024)" in message
    assert "2 of 3 requests do not fit" in message
    check_fits(reqs, profile(engine_cache_tokens=1100))  # every request fits: no error
    fleet = Fleet(small, 1, tier=False)
    with pytest.raises(TraceError, match="profile 'small' cannot hold the trace"):
        fleet.run(reqs, request_keys(reqs), RoundRobin())  # not at request 1, mid-replay
    # The benchmark's command line refuses it too, before it replays anything.
    lines = [
        json.dumps({"timestamp": t, "input_length": n, "output_length": o, "hash_ids": ids})
        for t, n, o, ids in [(0, 512, 0, [1]), (10, 1024, 8, [2, 3])]
    ]
    (tmp_path / "t.jsonl").write_text("\n".join(lines) + "\n")
    raw = json.loads(DEFAULT_PROFILE.read_text())
    raw["engine_cache_tokens"] = 1024
    (tmp_path / "p.json").write_text(json.dumps(raw))
    out = tmp_path / "trace.json"
    argv = ["--trace", str(tmp_path / "t.jsonl"), "--profile", str(tmp_path / "p.json")]
    assert bench_main([*argv, "--replicas", "1", "--out", str(out)]) == 2
    assert "cannot hold the trace: request 1" in capsys.readouterr().err and not out.exists()


def test_a_closed_loop_sends_each_round_at_most_n_at_a_time() -> None:
    """Rounds [A, B, C] then [D], two at a time on one replica of 4 running requests: B waits
    for A's prefill (one prefill engine), C is sent when A is done, D when all three are."""
    reqs = trace(
        (0, 1024, 0, [1, 2]),
        (0, 512, 0, [3]),
        (0, 512, 0, [4]),
        (0, 1024, 0, [1, 2]),
    )
    fleet = Fleet(profile(), 1, tier=False)
    s = fleet.run(reqs, request_keys(reqs), RoundRobin(), rounds=[[0, 1, 2], [3]], concurrency=2)
    # A: 0 -> 1.024; B: waits, 1.024 -> 1.536; C sent at 1.024, waits for B, 1.536 -> 2.048;
    # D sent at 2.048 (round 1), hits [1, 2] and computes its last token: 2.049.
    assert s.ttft_s == pytest.approx([1.024, 1.536, 1.024, 0.001])


def test_bound_counts_every_block_seen_before() -> None:
    assert bound_tokens(HAND, request_keys(HAND)) == 1024 + 512 + 512 + 76 + 512


def test_ray_prefix_router_keeps_a_shared_prefix_on_one_replica() -> None:
    reqs = trace((0, 1536, 0, [1, 2, 3]), (10, 1536, 0, [1, 2, 7]), (20, 512, 0, [8]))
    keys = request_keys(reqs)
    fleet = Fleet(profile(), 4, tier=False)
    router = RayPrefixAffinity(seed=1, num_replicas=4)
    first = router.choose(fleet, reqs[0], keys[0])
    fleet.replicas[first].waiting.append(0)  # its queue grows, as in the fleet
    # 2 of 3 characters match (above the 0.1 threshold): the same replica despite its queue.
    assert router.choose(fleet, reqs[1], keys[1]) == first
    # No match: the replicas with the fewest characters in the tree, i.e. not ``first``.
    assert router.choose(fleet, reqs[2], keys[2]) != first


def test_overlap_router_weighs_cached_blocks_against_active_ones() -> None:
    reqs = trace((0, 1536, 0, [1, 2, 3]), (5000, 1536, 0, [1, 2, 9]))
    fleet = Fleet(profile(), 3, tier=False)
    keys = request_keys(reqs)
    fleet.replicas[1].cache.admit(keys[0], 0)
    fleet.replicas[1].cache.ready(keys[0])
    router = OverlapMinusLoad(seed=0)
    assert router.choose(fleet, reqs[1], keys[1]) == 1  # 1 block to prefill there, 3 elsewhere
    fleet.replicas[1].active_blocks = 5  # 1 + 5 > 3 + 0: the idle replicas win now
    assert router.choose(fleet, reqs[1], keys[1]) in (0, 2)


def test_tessera_router_follows_the_directory_to_the_holding_node() -> None:
    reqs = trace((0, 1536, 0, [1, 2, 3]), (5000, 1536, 0, [1, 2, 9]))
    keys = request_keys(reqs)
    fleet = Fleet(profile(replicas_per_node=2), 6, tier=True)
    fleet.nodes[2].store(keys[0])  # node 2's pool holds the first request's blocks
    router = TesseraRouter(seed=0, tier=True, routed_memory_s=0.0)
    for _ in range(5):
        assert fleet.replicas[router.choose(fleet, reqs[1], keys[1])].node == 2
    assert router.choices == {"tier": 5}


@pytest.mark.parametrize(
    ("line", "why"),
    [
        ("{not json", "not valid JSON"),
        ('{"timestamp": 0, "input_length": 10, "hash_ids": [1]}', "missing field"),
        ('{"timestamp": -1, "input_length": 10, "output_length": 1, "hash_ids": [1]}', "timestamp"),
        (
            '{"timestamp": 0, "input_length": 1000, "output_length": 1, "hash_ids": [1]}',
            "expected 2",
        ),
        (
            '{"timestamp": 0, "input_length": 10, "output_length": 1.5, "hash_ids": [1]}',
            "output_length",
        ),
    ],
)
def test_a_bad_trace_line_is_refused_with_its_number(line: str, why: str) -> None:
    good = '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}'
    with pytest.raises(TraceError, match=rf"line 3: .*{why}"):
        parse_trace_lines([good, good, line, good])


def test_the_default_profile_loads_and_bad_profiles_are_refused(tmp_path: Path) -> None:
    p = load_profile(DEFAULT_PROFILE)
    assert p.replicas_per_node == 8 and p.prefill_s(1000, 0) > 0
    assert p.kv_bytes_per_token == preset_layout("deepseek-v2-lite").paged_bytes_per_token
    with pytest.raises(TraceError, match=r"missing figure.*disk_gb_s"):
        raw = json.loads(DEFAULT_PROFILE.read_text())
        del raw["disk_gb_s"]
        profile_from_dict(raw)
    with pytest.raises(TraceError, match="decode_s_per_token must be a finite number >= 0"):
        profile(decode_s_per_token=-1.0)
    with pytest.raises(TraceError, match="max_running must be > 0"):
        profile(max_running=0)
    bad = tmp_path / "p.json"
    bad.write_text("{")
    with pytest.raises(TraceError, match="not valid JSON"):
        load_profile(bad)


def _synthetic_trace(path: Path, sessions: int = 60, seed: int = 3) -> None:
    """Conversations: each turn repeats the session's earlier blocks and adds some."""
    rng = random.Random(seed)
    next_id, lines, t = 1, [], 0
    for _session in range(sessions):
        ids = [0]
        for _turn in range(rng.randint(1, 4)):
            ids += list(range(next_id, next_id + rng.randint(1, 6)))
            next_id = ids[-1] + 1
            n = (len(ids) - 1) * TRACE_BLOCK_TOKENS + rng.randint(1, TRACE_BLOCK_TOKENS)
            t += rng.randint(0, 800)
            obj = {"timestamp": t, "input_length": n, "output_length": 50, "hash_ids": ids}
            lines.append(json.dumps(obj))
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.slow
def test_quick_run_writes_every_router_and_the_targets(tmp_path: Path) -> None:
    src = tmp_path / "trace.jsonl"
    _synthetic_trace(src)
    out = tmp_path / "trace.json"
    cmd = [sys.executable, "benchmarks/bench_trace.py", "--quick", "--trace", str(src)]
    subprocess.run([*cmd, "--out", str(out)], cwd=ROOT, check=True, capture_output=True, timeout=60)
    doc = json.loads(out.read_text())
    names = {r["name"] for r in doc["rows"]}
    for router in ("round_robin", "power_of_two", "ray_prefix", "overlap_load", "tessera"):
        assert f"{router}_64_tokens_computed" in names and f"{router}_8_ttft_p90" in names
    target = {r["name"]: r for r in doc["rows"] if r["target_ratio"] is not None}
    assert "tessera_vs_ray_prefix_ttft_p90_64" in target
    bound = next(r["value"] for r in doc["rows"] if r["name"] == "bound_64_tokens_computed")
    for r in doc["rows"]:  # nobody computes fewer tokens than the bound
        if r["name"].endswith("_tokens_computed"):
            assert r["value"] >= bound
    assert (out.parent / "trace.png").stat().st_size > 0


def test_a_bad_trace_stops_the_benchmark_before_it_runs(tmp_path: Path) -> None:
    src = tmp_path / "bad.jsonl"
    src.write_text('{"timestamp": 0}\n')
    got = subprocess.run(
        [
            sys.executable,
            "benchmarks/bench_trace.py",
            "--trace",
            str(src),
            "--out",
            str(tmp_path / "o.json"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert got.returncode == 2 and "line 1: missing field(s)" in got.stderr
    assert not (tmp_path / "o.json").exists()


def test_bench_serves_workload_as_a_trace_shares_what_its_prompts_share() -> None:
    config = DemoConfig(num_agents=6, num_rounds=2)
    reqs, rounds = fleet_trace(config)
    assert rounds == [list(range(6)), list(range(6, 12))]
    a0, a3, a1 = reqs[0], reqs[3], reqs[1]  # agents 0 and 3 read document 0, agent 1 doc 1
    shared = config.system_blocks + config.document_blocks
    assert a0.hash_ids[:shared] == a3.hash_ids[:shared]
    assert a0.hash_ids[shared] != a3.hash_ids[shared]  # own preambles
    assert a0.hash_ids[: config.system_blocks] == a1.hash_ids[: config.system_blocks]
    assert a0.hash_ids[config.system_blocks] != a1.hash_ids[config.system_blocks]
    # Agent 0's second turn repeats every full block of its first; its tail is partial.
    again = reqs[6]
    assert again.hash_ids[: a0.full_blocks] == a0.hash_ids[: a0.full_blocks]
    assert a0.input_length == (a0.full_blocks * 64) + config.tail_tokens

    # Through a tokenizer (here: two tokens a word): the blocks are the engine's tokens'.
    def encode(text: str) -> list[int]:
        return [t for w in text.split() for t in (int(w[1:]), 999)]

    doubled, _ = fleet_trace(config, encode)
    assert doubled[0].input_length == 2 * a0.input_length
    assert doubled[0].full_blocks == 2 * a0.full_blocks
    assert doubled[0].hash_ids[:4] == doubled[3].hash_ids[:4]  # 2 system blocks: 4 of 64 tokens
    assert doubled[0].hash_ids[2 * shared] != doubled[3].hash_ids[2 * shared]


def test_the_serve_profile_is_fitted_to_cold_prompts() -> None:
    def cold(n: int, t: float) -> dict[str, float]:
        return {"prompt_tokens": n, "cached_tokens": 0, "first_token_s": t}

    truth = [cold(n, 0.2 + 1e-4 * n + 2e-8 * n * (n + 1) / 2) for n in (64, 512, 1024, 2048)]
    warm = {"prompt_tokens": 4096, "cached_tokens": 4000, "first_token_s": 0.01}  # not cold
    kw = {"kv_bytes_per_token": 1024, "engine_cache_tokens": 10**6, "pool_bytes_per_node": 1 << 30}
    p = fit_profile([*truth, warm], transfer_gb_s=2.0, **kw)
    assert p.request_overhead_s == pytest.approx(0.2)
    assert p.prefill_s_per_token == pytest.approx(1e-4)
    assert p.attention_s_per_pair == pytest.approx(2e-8)
    # Times that fall with length beyond linear: the pair term is left out, not negative.
    flat = [cold(n, 0.2 + 1e-4 * n - 1e-9 * n * n) for n in (64, 512, 1024, 2048)]
    p = fit_profile(flat, transfer_gb_s=2.0, **kw)
    assert p.attention_s_per_pair == 0.0 and p.prefill_s_per_token > 0
    with pytest.raises(ValueError, match="3 or more cold prompts"):
        fit_profile(truth[:2], transfer_gb_s=2.0, **kw)


def test_the_simulator_replays_bench_serve_under_each_router() -> None:
    config = DemoConfig(num_agents=6, num_rounds=2)
    reqs, _ = fleet_trace(config)
    kw = {"kv_bytes_per_token": 1024, "engine_cache_tokens": 10**6, "pool_bytes_per_node": 1 << 30}
    cold = [
        {"prompt_tokens": n, "cached_tokens": 0, "first_token_s": 0.3 + 1e-3 * n}
        for n in (64, 512, 1024)
    ]
    profile = fit_profile(cold, transfer_gb_s=2.0, **kw)
    floor = bound_tokens(reqs, request_keys(reqs))
    for run in SIM_ROUTERS:
        s = predict(config, profile, run)
        assert len(s.ttft_s) == len(reqs) and s.prompt_tokens == sum(r.input_length for r in reqs)
        assert floor <= s.computed_tokens < s.prompt_tokens
        assert min(s.ttft_s) >= profile.request_overhead_s
