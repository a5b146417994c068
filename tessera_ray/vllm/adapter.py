"""``TesseraConnector``: the vLLM v1 KV connector class itself (imports vLLM).

A thin adapter: it translates vLLM's objects (requests, block lists, scheduler output, cache
tensors) into the plain calls of :class:`SchedulerPlanner` (scheduler side) and
:class:`WorkerMover` (worker side), which hold the logic. Import it through
:mod:`tessera_ray.vllm.connector`, which loads this module only when vLLM asks for the class.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

from tessera_ray.errors import LayoutError, TierConfigError
from tessera_ray.layout import (
    EntryFormat,
    FullAttentionConfig,
    MLAConfig,
    ModelLayout,
    Scheme,
    build_layout,
    config_from_hf,
)
from tessera_ray.vllm.attention_backends import planes_for
from tessera_ray.vllm.config import TesseraConnectorConfig
from tessera_ray.vllm.hybrid import EngineGroup, HybridPlanner
from tessera_ray.vllm.hybrid_worker import HybridMover, resume_chunks
from tessera_ray.vllm.records import CachedScheduled, NewScheduled, StepPlan
from tessera_ray.vllm.scheduler import (
    SchedulerPlanner,
    check_block_sizes,
    check_paged_layout,
)
from tessera_ray.vllm.stats import (
    ConnectorCounters,
    counted,
    reduce_counts,
    sum_counts,
)
from tessera_ray.vllm.tiers import open_tier
from tessera_ray.vllm.worker import WorkerMover

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = [
    "TesseraConnector",
    "TesseraConnectorMetadata",
    "TesseraConnectorStats",
    "TesseraWorkerMetadata",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TesseraConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc,unused-ignore]
    """What the scheduler's connector sends every worker for one step."""

    plan: StepPlan


@dataclass(frozen=True)
class TesseraWorkerMetadata(KVConnectorWorkerMetadata):  # type: ignore[misc,unused-ignore]
    """What the workers' connectors send the scheduler's for one step: the steps whose tier
    stores ended, so lookups stop waiting for their blocks."""

    done_saves: tuple[int, ...] = ()

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, TesseraWorkerMetadata)
        return TesseraWorkerMetadata(self.done_saves + other.done_saves)


@dataclass
class TesseraConnectorStats(KVConnectorStats):  # type: ignore[misc,unused-ignore]
    """The connector's counts over an interval (:mod:`~tessera_ray.vllm.stats`), as vLLM
    carries them from the workers to its stat loggers."""

    data: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        self.data.clear()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        self.data = sum_counts(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return reduce_counts(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


def _served_name(vllm_config: VllmConfig) -> str:
    name = vllm_config.model_config.served_model_name
    if isinstance(name, list | tuple):
        name = name[0]
    return str(name or vllm_config.model_config.model)


_FORMAT_OF_DTYPE: dict[tuple[bool, torch.dtype], str] = {
    (True, torch.bfloat16): "mla-bf16",
    (False, torch.bfloat16): "kv-bf16",
    (False, torch.float16): "kv-fp16",
}
"""(uses MLA, model dtype) -> the tier format of vLLM's cache at kv_cache_dtype "auto"."""


def _engine_layout(
    vllm_config: VllmConfig, config: TesseraConnectorConfig, model_name: str
) -> ModelLayout:
    """The tier layout of the engine's cache (its MLA or full-attention geometry, in
    ``config.format`` or the format of its dtype), in the tier's own block (whatever block
    size the engine runs)."""
    model = vllm_config.model_config
    fmt = config.format
    if fmt is None:
        cache_dtype = vllm_config.cache_config.cache_dtype
        fmt = _FORMAT_OF_DTYPE.get((model.use_mla, model.dtype)) if cache_dtype == "auto" else None
        if fmt is None:
            raise LayoutError(
                f"no tier format for model {model_name!r} in {model.dtype} with kv_cache_dtype "
                f"{cache_dtype!r}; name one with the connector's format setting"
            )
    hf = model.hf_text_config
    if model.use_mla:
        return build_layout(
            MLAConfig(
                name=model_name,
                num_layers=hf.num_hidden_layers,
                num_heads=hf.num_attention_heads,
                kv_lora_rank=hf.kv_lora_rank,
                qk_rope_head_dim=hf.qk_rope_head_dim,
                qk_nope_head_dim=getattr(hf, "qk_nope_head_dim", 128),
                v_head_dim=getattr(hf, "v_head_dim", 128),
                format=fmt,
            )
        )
    if vllm_config.parallel_config.tensor_parallel_size != 1:
        raise LayoutError(
            "tensor parallelism splits a full-attention model's KV heads across ranks; "
            "TesseraConnector stores them whole and does not support it yet"
        )
    if model.get_sliding_window() is not None:
        raise LayoutError(
            f"model {model_name!r} uses sliding-window attention, which the tier does not page"
        )
    return build_layout(
        FullAttentionConfig(
            name=model_name,
            num_layers=hf.num_hidden_layers,
            num_heads=hf.num_attention_heads,
            num_kv_heads=model.get_total_num_kv_heads(),
            head_dim=model.get_head_size(),
            format=fmt,
        )
    )


def _hybrid_layout(
    vllm_config: VllmConfig, config: TesseraConnectorConfig, name: str
) -> ModelLayout:
    """The tier layout of a hybrid model, read from its Hugging Face config as the tier reads
    it (``tessera-ray size --hf-config``)."""
    hf = vllm_config.model_config.hf_config
    return build_layout(config_from_hf(hf.to_dict(), name=name, format=config.format))


def _check_hybrid(tier: ModelLayout, engine: ModelLayout) -> None:
    """The tier's pages must be the engine's caches, layer for layer (the model's name may
    differ: the tier names it after its config, the engine after its path)."""
    if (tier.layers, tier.block_tokens) != (engine.layers, engine.block_tokens):
        raise LayoutError(
            f"the tier stores {tier.model}/{tier.format_name} in {tier.block_tokens}-token "
            f"blocks; the engine's hybrid cache is {engine.model}/{engine.format_name} in "
            f"{engine.block_tokens}-token blocks: start the tier with the model's config "
            "(tessera-ray start --hf-config)"
        )


def _entry_text(entry: EntryFormat) -> str:
    return " + ".join(f"{r.num_values} {r.dtype.value} {r.name}" for r in entry.regions)


def _check_engine(
    tier: ModelLayout,
    engine: ModelLayout,
    engine_tokens: int,
    kv_cache_config: KVCacheConfig | None,
) -> None:
    """The tier's pages must hold the engine's cache rows byte for byte (the same layers, each
    token's entry the same regions of the same dtypes), in blocks that divide one another."""
    page = check_paged_layout(tier)
    check_paged_layout(engine)
    row = page // tier.block_tokens
    entry, engine_entry = tier.groups[0].page.cache.entry, engine.groups[0].page.cache.entry
    if (tier.num_layers, entry.regions) != (engine.num_layers, engine_entry.regions):
        raise LayoutError(
            f"the tier stores {tier.model}/{tier.format_name}: {tier.num_layers} layers of "
            f"{_entry_text(entry)} per token; the engine has {engine.num_layers} layers of "
            f"{_entry_text(engine_entry)}"
        )
    check_block_sizes(tier.block_tokens, engine_tokens)
    if kv_cache_config is None:
        return
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    mla = engine.groups[0].page.cache.scheme is Scheme.MLA
    kind = "MLAAttentionSpec" if mla else "FullAttentionSpec"
    if type(spec).__name__ != kind:
        raise LayoutError(
            f"vLLM's cache is a {type(spec).__name__}, the tier stores {tier.format_name} pages "
            f"({kind} in vLLM)"
        )
    if spec.block_size != engine_tokens or spec.page_size_bytes != row * spec.block_size:
        raise LayoutError(
            f"vLLM's cache pages are {spec.block_size} tokens / {spec.page_size_bytes} B, the "
            f"tier's rows {row} B per token; match kv_cache_dtype to the tier's format"
        )


_FULL_SPECS = ("MLAAttentionSpec", "FullAttentionSpec")
"""vLLM cache specs that keep every position: stored as tier blocks."""
_WINDOW_SPECS = ("SlidingWindowSpec", "SlidingWindowMLASpec")
"""vLLM cache specs that keep a sliding window: stored as resume records (several groups)."""


def engine_groups(kv_cache_config: KVCacheConfig | None) -> list[EngineGroup]:
    """vLLM's KV cache groups as the connector stores them; a group it cannot store is refused
    at engine start, in one line naming it."""
    if kv_cache_config is None:
        return []
    groups = kv_cache_config.kv_cache_groups
    out: list[EngineGroup] = []
    for index, group in enumerate(groups):
        spec = group.kv_cache_spec
        # A group of layers whose specs differ only in page size (V4's compressed caches and
        # their indexer) wraps them: it is stored as their one kind.
        inner = getattr(spec, "kv_cache_specs", None)
        kinds = {type(s).__name__ for s in inner.values()} if inner else {type(spec).__name__}
        kind = kinds.pop() if len(kinds) == 1 else type(spec).__name__
        stored = _FULL_SPECS + (_WINDOW_SPECS if len(groups) > 1 else ())
        if kind not in stored:
            names = list(group.layer_names)
            layers = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
            raise LayoutError(
                f"TesseraConnector cannot store vLLM's KV cache group {index} of {len(groups)} "
                f"({kind}, {spec.block_size}-token blocks, layers {layers}): it stores "
                f"{', '.join(stored)} groups"
            )
        windows = {
            getattr(s, "sliding_window", None) for s in (inner.values() if inner else [spec])
        }
        if len(windows) != 1:
            raise LayoutError(f"vLLM's KV cache group {index} mixes sliding windows {windows}")
        window = windows.pop() if kind in _WINDOW_SPECS else None
        out.append(EngineGroup(spec.block_size, window))
    return out


def _check_backend(config: TesseraConnectorConfig, vllm_config: VllmConfig) -> None:
    """``backend: local`` keeps the tier in one process: the scheduler's lookups only see
    what the worker stored when both run in it."""
    executor = vllm_config.parallel_config.distributed_executor_backend
    if config.backend == "local" and executor != "uni":
        raise TierConfigError(
            "kv_connector_extra_config: backend 'local' keeps the tier inside one process, but "
            f"this engine runs its workers in other processes than its scheduler "
            f"(distributed_executor_backend={executor!r}), so it could never hit; use backend "
            "'ray' with a running tier (tessera-ray start), or a single-process engine "
            "(distributed_executor_backend='uni'; on vLLM's CPU build also "
            "VLLM_ENABLE_V1_MULTIPROCESSING=0)"
        )


def _tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    try:
        return int(get_tensor_model_parallel_rank())
    except AssertionError:  # no process groups: a single-process engine or a test
        return 0


class TesseraConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc,unused-ignore]
    """vLLM v1 KV connector over the tessera-ray tier (README, "vLLM connector").

    It declares support for vLLM's hybrid KV-cache manager (``SupportsHMA``): without it vLLM
    turns the manager off, and models that need it (DeepSeek-V4) cannot start. Every KV cache
    group then reaches the connector, which refuses at start any it cannot store.

    Enable with ``kv_transfer_config={"kv_connector": "TesseraConnector",
    "kv_connector_module_path": "tessera_ray.vllm.connector", "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {...}}``.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        self.config = TesseraConnectorConfig.from_extra_config(transfer.kv_connector_extra_config)
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size != 1 or parallel.decode_context_parallel_size != 1:
            raise LayoutError(
                "TesseraConnector stores whole blocks of every layer: pipeline and decode "
                "context parallelism are not supported"
            )
        _check_backend(self.config, vllm_config)
        self.groups = engine_groups(kv_cache_config)
        self.hybrid = len(self.groups) > 1
        model_name = self.config.model_name or _served_name(vllm_config)
        self.counters = ConnectorCounters()
        self.planner: SchedulerPlanner | None = None
        self.mover: WorkerMover | None = None
        self.hybrid_mover: HybridMover | None = None
        if self.hybrid:
            self._init_hybrid(vllm_config, role, model_name)
            return
        engine_layout = _engine_layout(vllm_config, self.config, model_name)
        engine_tokens = vllm_config.cache_config.block_size
        self.tier = open_tier(self.config, engine_layout)
        _check_engine(self.tier.layout, engine_layout, engine_tokens, kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            self.planner = SchedulerPlanner(
                self.tier,
                self.tier.layout,
                block_tokens=engine_tokens,
                # One worker reads a pin it ends when done: with several (tensor or pipeline
                # parallel ranks) the first to finish would end the others' pin.
                pin_on_lookup=vllm_config.parallel_config.world_size == 1,
                **self._planner_args(transfer, model_name),
            )
        else:
            self.mover = WorkerMover(
                self.tier,
                self.tier.layout,
                engine_tokens=engine_tokens,
                **self._mover_args(transfer),
            )

    def _planner_args(self, transfer: Any, model_name: str) -> dict[str, Any]:
        """What the scheduler side takes from the connector's config, whatever the model."""
        return {
            "namespace": self.config.namespace,
            "model_name": model_name,
            "can_load": transfer.is_kv_consumer,
            "can_save": transfer.is_kv_producer,
            "extra_keys": generate_block_hash_extra_keys,
            "lookup_wait_s": self.config.lookup_wait_s,
            "lookup_timeout_s": self.config.timeout_s,
            "store_wait_s": self.config.store_wait_s,
            "counters": self.counters,
            "local_pool": self.tier.local_pool,
        }

    def _mover_args(self, transfer: Any) -> dict[str, Any]:
        """What the worker side takes from the connector's config. MLA caches are replicated
        across tensor-parallel ranks: every rank loads, one rank saves."""
        return {
            "can_save": transfer.is_kv_producer and _tp_rank() == 0,
            "timeout_s": self.config.timeout_s,
            "max_pending_saves": self.config.max_pending_saves,
            "counters": self.counters,
        }

    def _init_hybrid(self, vllm_config: VllmConfig, role: KVConnectorRole, model_name: str) -> None:
        """Several KV cache groups (DeepSeek-V4): prefix blocks and resume records
        (:mod:`~tessera_ray.vllm.hybrid`)."""
        transfer = vllm_config.kv_transfer_config
        layout = _hybrid_layout(vllm_config, self.config, model_name)
        self.tier = open_tier(self.config, layout)
        _check_hybrid(self.tier.layout, layout)
        layout = self.tier.layout
        if role == KVConnectorRole.SCHEDULER:
            self.planner = HybridPlanner(
                self.tier,
                layout,
                groups=self.groups,
                resume_chunks=resume_chunks(layout),
                **self._planner_args(transfer, model_name),
            )
        else:
            self.hybrid_mover = HybridMover(
                self.tier, layout, groups=self.groups, **self._mover_args(transfer)
            )

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # Loads and saves happen in wait_for_layer_load / save_kv_layer around each attention
        # layer: Python that a full CUDA graph would skip on replay.
        return True

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a later miss, never lost output

    # ---------------------------------------------------------------- scheduler side

    def _planner(self) -> SchedulerPlanner:
        assert self.planner is not None, "scheduler-side call on a worker connector"
        return self.planner

    @counted("scheduler_s")
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        # None: the tier lookup is still on its way; vLLM skips the request this step and asks
        # again, so a slow tier never stalls the scheduler.
        matched = self._planner().matched_tokens(request, num_computed_tokens)
        # A hybrid hit loads asynchronously: only then does vLLM take a failed load per request.
        return matched, bool(matched) and self.hybrid

    @counted("scheduler_s")
    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        planner = self._planner()
        if isinstance(planner, HybridPlanner):
            planner.after_alloc_groups(request, blocks.get_block_ids(), num_external_tokens)
            return
        block_ids = blocks.get_block_ids()[0] if num_external_tokens > 0 else []
        planner.after_alloc(request, block_ids, num_external_tokens)

    @counted("scheduler_s", "scheduler_steps")
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        scheduled = scheduler_output.num_scheduled_tokens
        new = [
            NewScheduled(
                r.req_id,
                r.block_ids[0],
                r.num_computed_tokens,
                scheduled[r.req_id],
                tuple(r.block_ids) if self.hybrid else (),
            )
            for r in scheduler_output.scheduled_new_reqs
        ]
        c = scheduler_output.scheduled_cached_reqs
        cached = [
            CachedScheduled(
                req_id,
                ids[0] if ids is not None else None,
                req_id in c.resumed_req_ids,
                c.num_computed_tokens[i],
                scheduled.get(req_id, 0),
                tuple(ids) if self.hybrid and ids is not None else None,
            )
            for i, (req_id, ids) in enumerate(zip(c.req_ids, c.new_block_ids, strict=True))
        ]
        return TesseraConnectorMetadata(self._planner().build(new, cached))

    @counted("scheduler_s")
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        planner = self._planner()
        if isinstance(planner, HybridPlanner):
            planner.loads_failed(set(connector_output.failed_recving or ()))
        planner.load_failed(set(connector_output.invalid_block_ids or ()))
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, TesseraWorkerMetadata):
            self._planner().stores_done(meta.done_saves)

    @counted("scheduler_s")
    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        # A save copies its rows out of vLLM's cache within the step that completes them (the
        # tier store runs later from that copy), so vLLM may free the blocks at once. The
        # params reach the client (the OpenAI response's ``kv_transfer_params``): how much of
        # this prompt the tier supplied, beside vLLM's own count of cached tokens.
        return False, self._planner().finished(request.request_id).params()

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        # vLLM calls this instead of request_finished once the hybrid manager is on; the
        # connector stores one group (checked at start).
        return self.request_finished(request, block_ids[0] if block_ids else [])

    # ---------------------------------------------------------------- worker side

    def _mover(self) -> WorkerMover:
        assert self.mover is not None, "worker-side call on a scheduler connector"
        return self.mover

    def _plan(self) -> StepPlan:
        meta = self._get_connector_metadata()
        assert isinstance(meta, TesseraConnectorMetadata)
        return meta.plan

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.hybrid_mover is not None:
            assert self._kv_cache_config is not None
            group_of = {
                name: index
                for index, group in enumerate(self._kv_cache_config.kv_cache_groups)
                for name in group.layer_names
            }
            self.hybrid_mover.register(kv_caches, extract_layer_index, group_of)
            return
        planes = planes_for(self._vllm_config, self._mover().engine_tokens)
        self._mover().register(kv_caches, extract_layer_index, planes)

    @counted("forward_s")
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self.hybrid_mover is not None:
            self.hybrid_mover.start(self._plan())
        else:
            self._mover().start(self._plan())

    @counted("forward_s")
    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.hybrid_mover is None:  # a hybrid load ends before its request runs
            self._mover().wait_layer(self._plan(), layer_name)

    @counted("forward_s")
    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        if self.hybrid_mover is None:  # a hybrid save reads every cache after the forward
            self._mover().save_layer(self._plan(), layer_name, kv_layer)

    @counted("forward_s", "worker_steps")
    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        if self.hybrid_mover is not None:
            self.hybrid_mover.finish(self._plan())
        else:
            self._mover().finish(self._plan())

    @counted("forward_s")
    def get_block_ids_with_load_errors(self) -> set[int]:
        if self.hybrid_mover is not None:
            return set()  # reported per request, by get_transfer_results
        return self._mover().take_load_errors()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self.hybrid_mover is None:
            return super().get_transfer_results(finished_req_ids)
        done, failed = self.hybrid_mover.take_finished()
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        mover = self.hybrid_mover if self.hybrid_mover is not None else self._mover()
        done = mover.take_done_saves()
        return TesseraWorkerMetadata(tuple(done)) if done else None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        data = self.counters.take()
        return None if data is None else TesseraConnectorStats(data=data)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return TesseraConnectorStats(data=dict(data or {}))

    def shutdown(self) -> None:
        # The tier outlives the engine (a shared local tier serves the process's other
        # connectors; the Ray tier serves the cluster): only this worker's reader thread ends.
        for mover in (self.mover, self.hybrid_mover):
            if mover is not None:
                if not mover.flush(self.config.timeout_s):
                    log.warning("tier stores still running at shutdown; dropping them")
                mover.close()
