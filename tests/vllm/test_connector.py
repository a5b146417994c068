"""TesseraConnector against vLLM's real classes (config, factory, scheduler, requests), with the
in-process tier (``backend="local"``). See ``_engine.py`` for how a step is driven."""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from tessera_ray.errors import LayoutError, TierConfigError
from tessera_ray.vllm.connector import (
    TesseraConnector,
    TesseraConnectorConfig,
    TesseraConnectorMetadata,
)
from tessera_ray.vllm.keys import prompt_keys
from tests.vllm._engine import (
    BLOCK,
    HEAD,
    LAYERS,
    Engine,
    fake_kv,
    vllm_config,
    write_model_dir,
)

_names = itertools.count()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("tiny-mla"))


@pytest.fixture
def extra() -> dict[str, Any]:
    # The model name is in the layout fingerprint, so each test gets its own in-process tier.
    # A generous lookup wait keeps these answers deterministic (test_slow_lookup_* sets it).
    return {
        "backend": "local",
        "model_name": f"tiny-mla-{next(_names)}",
        "local_num_blocks": 32,
        "lookup_wait_s": 10.0,
    }


_SEEN_BLOCKS: dict[int, int] = {}


@pytest.fixture(params=[64, 16, 128], ids=lambda b: f"engine-block-{b}")
def block(request: pytest.FixtureRequest, model_dir: Path) -> int:
    """The engine block size asked for; the tier's block stays 64 tokens. vLLM's CPU build
    forces 16 for its reference MLA backend, so there the three ask for one size."""
    asked = int(request.param)
    got = vllm_config(model_dir, {"backend": "local"}, block_size=asked).cache_config.block_size
    if _SEEN_BLOCKS.setdefault(got, asked) != asked:
        pytest.skip(f"this vLLM build runs block_size {got} whatever is asked (covered)")
    return asked


def prompt(n: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 31) % 1000 + 1 for i in range(n)]


def _store(
    model_dir: Path,
    extra: dict[str, Any],
    tokens: list[int],
    salt: str | None = None,
    block: int = BLOCK,
) -> Engine:
    """One engine runs ``tokens`` through prefill: its connector saves the full tier blocks."""
    engine = Engine(vllm_config(model_dir, extra, block_size=block))
    engine.scheduler.add_request(engine.request("A", tokens, cache_salt=salt))
    result = engine.step()
    assert result.load_errors == set()
    meta = result.output.kv_connector_metadata
    assert isinstance(meta, TesseraConnectorMetadata)
    assert sum(len(s.token_keys) for s in meta.plan.saves) == len(tokens) // BLOCK
    return engine


def test_factory_creates_both_roles(model_dir: Path, extra: dict[str, Any]) -> None:
    engine = Engine(vllm_config(model_dir, extra))
    assert isinstance(engine.connector, TesseraConnector)
    assert engine.connector.role == KVConnectorRole.SCHEDULER
    assert isinstance(engine.worker, TesseraConnector)
    assert engine.worker.role == KVConnectorRole.WORKER


def test_matched_tokens_are_the_stored_full_block_prefix(
    model_dir: Path, extra: dict[str, Any]
) -> None:
    stored = prompt(200)  # 3 full blocks and 8 tokens
    _store(model_dir, extra, stored)
    other = Engine(vllm_config(model_dir, extra))  # a second engine, sharing only the tier
    c = other.connector

    assert c.get_num_new_matched_tokens(other.request("B", stored[:192] + prompt(40, 1)), 0) == (
        192,
        False,
    )
    # Diverging inside block 2: only blocks 0 and 1 match.
    assert c.get_num_new_matched_tokens(other.request("C", stored[:150] + prompt(60, 2)), 0) == (
        128,
        False,
    )
    # A block-aligned prompt leaves its last block to vLLM (the last token must be computed).
    assert c.get_num_new_matched_tokens(other.request("D", stored[:192]), 0) == (128, False)
    # Tokens vLLM already has locally are not asked for again.
    assert c.get_num_new_matched_tokens(other.request("E", [*stored[:192], 9]), 64) == (128, False)
    assert c.get_num_new_matched_tokens(other.request("F", prompt(300, 3)), 0) == (0, False)


@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_a_routers_keys_are_the_keys_the_connector_saves(
    model_dir: Path, extra: dict[str, Any], salt: str | None
) -> None:
    """A request router computes a prompt's keys before any engine sees it (``prompt_keys``):
    they are the keys vLLM's connector saves under, vLLM's own extra hash keys included (a
    salted request's first block carries its salt)."""
    tokens = prompt(200)
    engine = Engine(vllm_config(model_dir, extra))
    engine.scheduler.add_request(engine.request("A", tokens, cache_salt=salt))
    meta = engine.step().output.kv_connector_metadata
    assert isinstance(meta, TesseraConnectorMetadata)
    saved = [k for s in meta.plan.saves for k in s.token_keys]
    planner = engine.connector.planner
    keys = prompt_keys(
        planner.layout.fingerprint, extra["model_name"], tokens, BLOCK, salt, planner.namespace
    )
    assert len(saved) == 3 and saved == keys


def test_another_cache_salt_matches_nothing(model_dir: Path, extra: dict[str, Any]) -> None:
    stored = prompt(200)
    _store(model_dir, extra, stored, salt="tenant-a")
    other = Engine(vllm_config(model_dir, extra))
    c = other.connector
    probe = [*stored[:192], 1]
    assert c.get_num_new_matched_tokens(other.request("A2", probe, "tenant-a"), 0) == (192, False)
    assert c.get_num_new_matched_tokens(other.request("B", probe, "tenant-b"), 0) == (0, False)
    assert c.get_num_new_matched_tokens(other.request("N", probe), 0) == (0, False)


def test_loaded_blocks_are_byte_identical_to_saved(
    model_dir: Path, extra: dict[str, Any], block: int
) -> None:
    """Saved by one engine, loaded by another with other block ids: the loaded positions hold
    the saved bytes, and the positions the step computes hold the step's own KV (vLLM writes
    them before attention asks for the load: the load must not overwrite them)."""
    stored = prompt(200)
    first = _store(model_dir, extra, stored, block=block)
    second = Engine(vllm_config(model_dir, extra, block_size=block))
    tokens = stored[:192] + prompt(40, 1)
    second.scheduler.add_request(second.request("B", tokens))

    result = second.step()

    assert result.load_errors == set()
    meta = result.output.kv_connector_metadata
    (load,) = meta.plan.loads
    assert len(load.token_keys) == 3 and (load.rows.start, load.rows.stop) == (0, 192)
    saved, loaded = first.rows("A", 0, 192), second.rows("B", 0, 192)
    for layer, (s, got) in enumerate(zip(saved, loaded, strict=True)):
        assert torch.equal(s, got)
        assert torch.equal(got, fake_kv(stored[:192], layer).view(torch.uint8))
    for layer, got in enumerate(second.rows("B", 192, len(tokens))):
        assert torch.equal(got, fake_kv(tokens, layer)[192:].view(torch.uint8))
    assert second.scheduler.requests["B"].num_computed_tokens == len(tokens)


@pytest.mark.parametrize("fault", ["evicted", "corrupted"])
def test_failed_block_is_reported_and_nothing_partial_is_left(
    model_dir: Path, extra: dict[str, Any], fault: str, block: int
) -> None:
    stored = prompt(200)
    first = _store(model_dir, extra, stored, block=block)
    second = Engine(vllm_config(model_dir, extra, block_size=block))
    tokens = stored[:192] + prompt(40, 1)
    second.scheduler.add_request(second.request("B", tokens))
    out = second.scheduler.schedule()  # lookup done, blocks allocated, load planned
    (load,) = out.kv_connector_metadata.plan.loads
    eb = second.block
    second.block_ids["B"] = list(load.rows.block_ids)  # what the step's own tracking will see

    # Between the lookup and the load, block 1 leaves the tier or its bytes rot.
    pool = second.worker.tier.service.pools[0]
    key = load.token_keys[1]
    if fault == "evicted":
        assert pool.evict_block(load.namespace, key, copy_data=False) is not None
    else:
        handles = pool.lookup(load.namespace, key)
        slot = handles[-1].offset // handles[-1].length
        pool.data[slot, 1000:1016] ^= 0x5A
        pool.release_many(list(handles))
    before = second.rows("B", 0, 192)
    second.block_ids.pop("B")

    result = second.step(out)

    # Tier block 1 failed; tier block 2 follows it (vLLM recomputes from the first failed
    # block): every engine block holding positions 64.. is reported, none of them written.
    # (With 128-token engine blocks that is engine block 0, which also holds tier block 0.)
    first_failed = (BLOCK // eb) * eb
    ids = second.block_ids["B"]
    assert result.load_errors == set(ids[first_failed // eb : 192 // eb + (192 % eb > 0)])
    if first_failed:
        for got, want in zip(
            second.rows("B", 0, first_failed), first.rows("A", 0, first_failed), strict=True
        ):
            assert torch.equal(got, want)
    for got, was in zip(second.rows("B", BLOCK, 192), before, strict=True):
        assert torch.equal(got, was[BLOCK:192]), "a failed tier block was partly written"
    # vLLM's scheduler took the report: the request resumes at the first failed engine block.
    assert second.scheduler.requests["B"].num_computed_tokens == first_failed

    result = second.step()  # vLLM recomputes from there and the connector saves again
    assert result.load_errors == set()
    for got, want in zip(second.rows("B", 0, 192), first.rows("A", 0, 192), strict=True):
        assert torch.equal(got, want)
    # The tier holds good bytes for every block again (a rotten copy was reported, dropped by
    # its pool and saved afresh): another engine loads all three without a load error.
    third = Engine(vllm_config(model_dir, extra, block_size=block))
    probe = third.request("P", [*stored[:192], 1])
    assert third.connector.get_num_new_matched_tokens(probe, 0) == (192, False)
    third.scheduler.add_request(third.request("C", tokens))
    result = third.step()
    assert result.load_errors == set()
    assert third.scheduler.requests["C"].num_computed_tokens == len(tokens)


def test_consumer_saves_nothing_and_producer_loads_nothing(
    model_dir: Path, extra: dict[str, Any]
) -> None:
    stored = prompt(200)
    consumer = Engine(vllm_config(model_dir, extra, kv_role="kv_consumer"))
    consumer.scheduler.add_request(consumer.request("A", stored))
    assert consumer.step().output.kv_connector_metadata.plan.saves == ()

    _store(model_dir, extra, stored)
    producer = Engine(vllm_config(model_dir, extra, kv_role="kv_producer"))
    probe = producer.request("B", [*stored[:192], 1])
    assert producer.connector.get_num_new_matched_tokens(probe, 0) == (0, False)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"blocks": 3}, "unknown key.*blocks.*valid keys"),
        ({"local_num_blocks": "many"}, "local_num_blocks must be an int"),
        ({"backend": "redis"}, "backend must be one of"),
        ({"timeout_s": -1}, "timeout_s must be positive"),
    ],
)
def test_bad_extra_config_is_refused_by_name(
    model_dir: Path, extra: dict[str, Any], bad: dict[str, Any], message: str
) -> None:
    with pytest.raises(TierConfigError, match=message):
        Engine(vllm_config(model_dir, {**extra, **bad}))


def test_local_backend_is_refused_when_workers_run_in_other_processes(
    model_dir: Path, extra: dict[str, Any]
) -> None:
    """With workers in their own processes the scheduler's in-process tier never sees what the
    workers store: a configuration that can never hit fails at engine start, saying why."""
    with pytest.raises(TierConfigError, match=r"backend 'local'.*'mp'.*backend 'ray'"):
        Engine(vllm_config(model_dir, extra, executor="mp"))


def test_slow_lookup_answers_ask_again(model_dir: Path, extra: dict[str, Any]) -> None:
    """The scheduler never waits on the tier beyond lookup_wait_s: a lookup still out answers
    None, which vLLM's scheduler takes as "skip this request, ask again next step"."""
    stored = prompt(200)
    _store(model_dir, extra, stored)
    engine = Engine(vllm_config(model_dir, {**extra, "lookup_wait_s": 1e-9}))
    tier = engine.worker.tier
    slow = tier.lookup_async

    def delayed(namespace: str, keys: Any) -> Any:
        import concurrent.futures
        import threading

        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        inner = slow(namespace, keys)
        threading.Timer(0.2, lambda: future.set_result(inner.result())).start()
        return future

    tier.lookup_async = delayed
    request = engine.request("B", [*stored[:192], 1])
    assert engine.connector.get_num_new_matched_tokens(request, 0) == (None, False)
    engine.scheduler.add_request(request)
    out = engine.scheduler.schedule()
    assert out.num_scheduled_tokens == {}  # skipped this step, not failed
    import time

    time.sleep(0.3)
    assert engine.connector.get_num_new_matched_tokens(request, 0) == (192, False)
    tier.lookup_async = slow


def test_a_prompt_asked_again_waits_for_this_engines_stores_then_loads(
    model_dir: Path, extra: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stores run behind the engine: a prompt asked again before they land waits for them
    (None: ask again) instead of recomputing, then loads every full tier block."""
    engine = Engine(vllm_config(model_dir, extra))
    tier, mover = engine.worker.tier, engine.worker.mover
    gate = threading.Event()
    store = tier.store

    def held_store(*args: Any) -> None:
        gate.wait(10.0)
        store(*args)

    monkeypatch.setattr(tier, "store", held_store)
    monkeypatch.setattr(mover, "flush", lambda timeout_s=None: True)  # the step must not wait
    stored = prompt(200)
    engine.scheduler.add_request(engine.request("A", stored))
    engine.step()
    again = engine.request("B", stored)
    assert engine.connector.get_num_new_matched_tokens(again, 0) == (None, False)
    gate.set()
    monkeypatch.undo()
    assert mover.flush(10.0)
    deadline = time.monotonic() + 5.0
    while (got := engine.connector.get_num_new_matched_tokens(again, 0)) == (None, False):
        assert time.monotonic() < deadline, "still waiting after the store landed"
        time.sleep(0.02)
    assert got == (192, False)


def test_a_store_that_failed_is_not_waited_for(
    model_dir: Path, extra: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The workers report each step's stores done through vLLM's worker metadata, failed ones
    too: the scheduler then recomputes at once rather than waiting out store_wait_s."""
    engine = Engine(vllm_config(model_dir, {**extra, "store_wait_s": 60.0}))

    def failing_store(*args: Any) -> None:
        raise ConnectionError("pool unreachable")

    monkeypatch.setattr(engine.worker.tier, "store", failing_store)
    stored = prompt(200)
    engine.scheduler.add_request(engine.request("A", stored))
    engine.step()  # its worker metadata reports the step's stores ended
    assert engine.connector.get_num_new_matched_tokens(engine.request("B", stored), 0) == (0, False)


def test_layers_are_registered_in_model_order(model_dir: Path, extra: dict[str, Any]) -> None:
    engine = Engine(vllm_config(model_dir, extra))
    layers = engine.worker.mover._layers
    assert [layers[name].index for name in LAYERS] == list(range(len(LAYERS)))


def test_deploy_example_settings_are_valid() -> None:
    import yaml
    from vllm.config import KVTransferConfig

    root = Path(__file__).resolve().parents[2]
    app = yaml.safe_load((root / "deploy" / "serve_llm_tessera.yaml").read_text())
    (llm,) = app["applications"][0]["args"]["llm_configs"]
    transfer = KVTransferConfig(**llm["engine_kwargs"]["kv_transfer_config"])
    assert transfer.kv_connector_module_path == "tessera_ray.vllm.connector"
    assert transfer.kv_load_failure_policy == "recompute"
    cfg = TesseraConnectorConfig.from_extra_config(transfer.kv_connector_extra_config)
    assert cfg.backend == "ray"
    size = llm["engine_kwargs"]["block_size"]
    assert size % BLOCK == 0 or BLOCK % size == 0


def test_a_tier_of_another_entry_with_the_same_bytes_is_refused() -> None:
    """Bytes per token are not enough: an MLA tier (512 + 64 bf16 per token) and a full-attention
    engine with one KV head of 288 values (K 288 + V 288 bf16) both hold 1,152 B per token, and
    a kv-fp16 tier holds as many bytes as a kv-bf16 engine; each pair is refused, naming both."""
    from tessera_ray.layout import FullAttentionConfig, MLAConfig, build_layout
    from tessera_ray.vllm.adapter import _check_engine

    mla = build_layout(MLAConfig(name="t", num_layers=2, num_heads=4))
    full = FullAttentionConfig(name="e", num_layers=2, num_heads=2, num_kv_heads=1, head_dim=288)
    with pytest.raises(LayoutError, match=r"512 bf16 c_kv .* the engine has 2 layers of 288 bf16"):
        _check_engine(mla, build_layout(full), 64, None)
    fp16 = build_layout(dataclasses.replace(full, format="kv-fp16"))
    with pytest.raises(LayoutError, match=r"288 fp16 k .* 288 bf16 k"):
        _check_engine(fp16, build_layout(full), 16, None)
    _check_engine(build_layout(full), build_layout(full), 16, None)  # the same: accepted


def test_the_hybrid_kv_cache_manager_stays_on(model_dir: Path, extra: dict[str, Any]) -> None:
    """The connector is ``SupportsHMA``: vLLM does not turn its hybrid KV-cache manager off for
    it (models such as DeepSeek-V4 cannot start without it), and a finished request reaches the
    connector through ``request_finished_all_groups`` with its tier count."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from tessera_ray.vllm.connector import TIER_SOURCES_PARAM, TIER_TOKENS_PARAM

    config = vllm_config(model_dir, extra)
    assert KVConnectorFactory.supports_hma_config(config.kv_transfer_config)
    engine = _store(model_dir, extra, prompt(2 * BLOCK + 5))
    request = engine.scheduler.requests["A"]
    ids = engine.scheduler.kv_cache_manager.get_block_ids("A")
    assert engine.connector.request_finished_all_groups(request, ids) == (
        False,
        {TIER_TOKENS_PARAM: 0, TIER_SOURCES_PARAM: {"local": 0, "remote": 0, "disk": 0}},
    )


def test_a_cache_group_the_connector_cannot_store_is_refused_naming_it() -> None:
    """With the hybrid manager on every group reaches the connector: one group of MLA pages is
    stored as before, MLA beside sliding windows as a hybrid model; a lone sliding-window group
    or a kind it does not store is refused at start, naming the group."""
    import torch
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    from tessera_ray.vllm.adapter import engine_groups
    from tessera_ray.vllm.hybrid import EngineGroup

    mla = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    window = SlidingWindowSpec(
        block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16, sliding_window=128
    )
    chunked = ChunkedLocalAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16, attention_chunk_size=64
    )
    layers = [f"model.layers.{i}.attn" for i in range(5)]
    assert engine_groups(KVCacheConfig(8, [], [KVCacheGroupSpec(layers, mla)])) == [EngineGroup(64)]
    hybrid = [KVCacheGroupSpec(layers[:1], mla), KVCacheGroupSpec(layers, window)]
    assert engine_groups(KVCacheConfig(8, [], hybrid)) == [EngineGroup(64), EngineGroup(16, 128)]
    with pytest.raises(LayoutError, match=r"group 0 of 1 \(SlidingWindowSpec, 16-token blocks"):
        engine_groups(KVCacheConfig(8, [], [KVCacheGroupSpec(layers, window)]))
    with pytest.raises(
        LayoutError,
        match=r"group 1 of 2 \(ChunkedLocalAttentionSpec, 16-token blocks, layers "
        r"model.layers.0.attn, model.layers.1.attn, model.layers.2.attn, \.\.\.\)",
    ):
        engine_groups(KVCacheConfig(8, [], [hybrid[0], KVCacheGroupSpec(layers, chunked)]))


class _LendingReads:
    """``LocalTier.read`` as the mapped and NIXL readers answer: the rows in one staging buffer
    that the next read overwrites (``lent``), with the addresses each read handed out."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from tessera_ray.actors.messages import BlockReads
        from tessera_ray.vllm.tiers import LocalTier

        self.staging = np.zeros((0, 0), np.uint8)
        read = LocalTier.read

        def lent(
            tier: LocalTier, namespace: str, keys: Any, hits: Any = None, ticket: Any = None
        ) -> BlockReads:
            reads = read(tier, namespace, keys, hits, ticket)
            if self.staging.shape[1] != reads.payloads.shape[1]:
                self.staging = np.zeros((64, reads.payloads.shape[1]), np.uint8)
            n = len(reads.payloads)
            self.staging[:n] = reads.payloads
            return BlockReads.of(reads.block_hashes, self.staging[:n], lent=True)

        monkeypatch.setattr(LocalTier, "read", lent)

    def holds(self, values: torch.Tensor) -> bool:
        """Whether ``values`` is a view of the staging buffer (no copy of it)."""
        lo = self.staging.ctypes.data
        at = values.untyped_storage().data_ptr()
        return lo <= at < lo + self.staging.nbytes


def test_two_tenants_hits_in_one_step_each_load_their_own_bytes(
    model_dir: Path, extra: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two requests of other cache salts (two namespaces, two reads in one step) through a
    reader whose next read reuses its staging memory: each loads its own prefix's bytes."""
    a, b = prompt(200, 1), prompt(200, 2)
    first = _store(model_dir, extra, a, salt="s1")
    first.scheduler.add_request(first.request("B0", b, cache_salt="s2"))
    first.step()
    _LendingReads(monkeypatch)
    second = Engine(vllm_config(model_dir, extra))
    second.scheduler.add_request(second.request("X", a[:192] + prompt(10, 3), cache_salt="s1"))
    second.scheduler.add_request(second.request("Y", b[:192] + prompt(10, 4), cache_salt="s2"))

    result = second.step()

    assert result.load_errors == set()
    loads = result.output.kv_connector_metadata.plan.loads
    assert len({load.namespace for load in loads}) == len(loads) == 2
    for tokens, req in ((a, "X"), (b, "Y")):
        for layer, got in enumerate(second.rows(req, 0, 192)):
            assert torch.equal(got, fake_kv(tokens[:192], layer).view(torch.uint8)), (req, layer)


def test_a_hit_is_copied_once_from_where_its_read_landed_into_the_cache(
    model_dir: Path, extra: dict[str, Any], block: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every byte of a hit goes into vLLM's cache straight from the memory the read landed in
    (no copy in between), and exactly once."""
    from tessera_ray.vllm.planes import LayerPlanes

    stored = prompt(200)
    _store(model_dir, extra, stored, block=block)
    lending = _LendingReads(monkeypatch)
    writes: list[tuple[int, bool]] = []
    write_tokens, write_groups = LayerPlanes.write_tokens, LayerPlanes.write_groups
    scatter = LayerPlanes.scatter

    def counted_write(planes: LayerPlanes, ids: torch.Tensor, values: torch.Tensor, *a: Any):
        writes.append((values.numel() * values.element_size(), lending.holds(values)))
        return write_tokens(planes, ids, values, *a)

    def counted_groups(planes: LayerPlanes, first: int, values: torch.Tensor, *a: Any) -> None:
        writes.append((values.numel() * values.element_size(), lending.holds(values)))
        write_groups(planes, first, values, *a)

    def counted_scatter(planes: LayerPlanes, rows: torch.Tensor, values: torch.Tensor) -> None:
        writes.append((values.numel() * values.element_size(), lending.holds(values)))
        scatter(planes, rows, values)

    monkeypatch.setattr(LayerPlanes, "write_tokens", counted_write)
    monkeypatch.setattr(LayerPlanes, "write_groups", counted_groups)
    monkeypatch.setattr(LayerPlanes, "scatter", counted_scatter)
    second = Engine(vllm_config(model_dir, extra, block_size=block))
    tokens = stored[:192] + prompt(40, 1)
    second.scheduler.add_request(second.request("B", tokens))

    result = second.step()

    assert result.load_errors == set()
    for layer, got in enumerate(second.rows("B", 0, 192)):
        assert torch.equal(got, fake_kv(stored[:192], layer).view(torch.uint8))
    hit_bytes = 192 * HEAD * 2 * len(LAYERS)  # bf16 rows of 576 values, every layer
    assert sum(n for n, _ in writes) == hit_bytes
    assert all(straight for _, straight in writes), writes


@pytest.mark.parametrize("lapsed", [False, True], ids=["pin-held", "pin-lapsed"])
def test_a_pinned_read_ends_its_pin_after_every_copy_and_a_lapsed_pin_fails_the_load(
    model_dir: Path, extra: dict[str, Any], monkeypatch: pytest.MonkeyPatch, lapsed: bool
) -> None:
    """A read served in the pool's own pinned pages (``pinned``) is copied into the cache
    before its pin ends, once per step; a pin that may have lapsed by then reports the step's
    loads as failed (the pool may have reused those pages), and vLLM recomputes them."""
    import dataclasses

    from tessera_ray.vllm.planes import LayerPlanes
    from tessera_ray.vllm.tiers import LocalTier

    stored = prompt(200)
    first = _store(model_dir, extra, stored)
    read, write_tokens = LocalTier.read, LayerPlanes.write_tokens
    write_groups = LayerPlanes.write_groups
    writes: list[int] = []
    ended: list[int] = []  # the writes done when each pin ended

    def pinned(
        tier: LocalTier, namespace: str, keys: Any, hits: Any = None, ticket: Any = None
    ) -> Any:
        return dataclasses.replace(read(tier, namespace, keys, hits, ticket), pinned=True)

    def end_reads(tier: LocalTier) -> bool:
        ended.append(len(writes))
        return not lapsed

    def counted(planes: LayerPlanes, ids: torch.Tensor, values: torch.Tensor, *a: Any) -> None:
        writes.append(values.numel())
        write_tokens(planes, ids, values, *a)

    def counted_groups(planes: LayerPlanes, first: int, values: torch.Tensor, *a: Any) -> None:
        writes.append(values.numel())
        write_groups(planes, first, values, *a)

    monkeypatch.setattr(LocalTier, "read", pinned)
    monkeypatch.setattr(LocalTier, "end_reads", end_reads, raising=False)
    monkeypatch.setattr(LayerPlanes, "write_tokens", counted)
    monkeypatch.setattr(LayerPlanes, "write_groups", counted_groups)
    second = Engine(vllm_config(model_dir, extra))
    tokens = stored[:192] + prompt(40, 1)
    second.scheduler.add_request(second.request("B", tokens))

    result = second.step()

    assert writes and ended[0] == len(writes), (ended, len(writes))  # after the last copy
    if not lapsed:
        assert result.load_errors == set()
        assert second.scheduler.requests["B"].num_computed_tokens == len(tokens)
        return
    assert result.load_errors, "a lapsed pin's copies were trusted"
    assert second.scheduler.requests["B"].num_computed_tokens == 0
    second.step()  # vLLM recomputes the prefix
    for got, want in zip(second.rows("B", 0, 192), first.rows("A", 0, 192), strict=True):
        assert torch.equal(got, want)


def test_a_layer_asked_for_after_its_step_ended_copies_nothing(
    model_dir: Path, extra: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A layer whose attention ran without asking for its load fails the step's loads; asked
    for after the step ended, it copies nothing (its pins have ended: the pool may have reused
    the pages)."""
    from tessera_ray.vllm.worker import WorkerMover

    stored = prompt(200)
    _store(model_dir, extra, stored)
    wait_layer = WorkerMover.wait_layer
    skipped: list[str] = []

    def skip_first(mover: WorkerMover, plan: Any, name: str) -> None:
        if not skipped:  # the first layer's attention runs without asking
            skipped.append(name)
            return
        wait_layer(mover, plan, name)

    monkeypatch.setattr(WorkerMover, "wait_layer", skip_first)
    second = Engine(vllm_config(model_dir, extra))
    second.scheduler.add_request(second.request("B", stored[:192] + prompt(40, 1)))

    result = second.step()

    assert result.load_errors, "a layer that never waited for its load was trusted"
    cache = second.caches[skipped[0]]
    before = cache.clone()
    wait_layer(second.worker.mover, result.output.kv_connector_metadata.plan, skipped[0])
    assert torch.equal(cache, before)
