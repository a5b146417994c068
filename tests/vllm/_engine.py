"""A vLLM engine without a model, for driving the connector through vLLM's real classes.

vLLM's real ``VllmConfig`` (built offline from a tiny DeepSeek-V2-style MLA ``config.json``; no
weights, no tokenizer), its real ``Scheduler`` (which creates the scheduler-side connector
through ``KVConnectorFactory``), real ``Request`` objects, and a worker-side connector made by
the same factory over CPU caches shaped as vLLM's MLA cache, ``[num_blocks, block_size, 576]``
bf16 per layer (``block_size`` as the platform settles it: vLLM's CPU build forces 16 for its
reference MLA backend). A step does what vLLM's model runner does around attention, in vLLM's
order: bind the metadata, start the loads, per layer write the step's KV (vLLM's cache update
runs before its attention op), wait for the layer's load, save the layer, then wait for the
saves and report load errors back to the scheduler.

The fake KV of a position depends on the layer and on every token up to it (a hash chain), so
equal prefixes give equal bytes, as a real model's KV would.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

BLOCK = 64  # the tier's block for MLA (FlashMLA's page); the engine's may differ
HEAD = 576  # kv_lora_rank 512 + qk_rope_head_dim 64 (docs/reference.md)
NUM_LAYERS = 2
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
SAMPLED = 5

# A tiny DeepSeek-V2-style model: vLLM reads the MLA geometry from it (use_mla, 576 head size).
TINY_MLA_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": NUM_LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": NUM_LAYERS,
    "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
    "rope_theta": 10000.0,
}


def write_model_dir(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(TINY_MLA_CONFIG))
    return root


def vllm_config(
    model_dir: Path,
    extra: dict[str, Any],
    kv_role: str = "kv_both",
    block_size: int = BLOCK,
    executor: str = "uni",
) -> VllmConfig:
    model = ModelConfig(
        model=str(model_dir),
        tokenizer=str(model_dir),
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=2048,
    )
    transfer = KVTransferConfig(
        kv_connector="TesseraConnector",
        kv_connector_module_path="tessera_ray.vllm.connector",
        kv_role=kv_role,  # type: ignore[arg-type]
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=extra,
    )
    # One process drives scheduler and worker; vLLM's CPU build turns a "uni" executor into
    # "mp" unless multiprocessing is off, and backend "local" refuses "mp" (it could never
    # hit across processes). Set only while the config is built: engines started later in this
    # process tree must keep vLLM's default.
    before = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if executor == "uni" else "1"
    try:
        return VllmConfig(
            model_config=model,
            cache_config=CacheConfig(block_size=block_size),
            kv_transfer_config=transfer,
            device_config=DeviceConfig(device="cpu"),
            parallel_config=ParallelConfig(distributed_executor_backend=executor),
        )
    finally:
        if before is None:
            del os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"]
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = before


def kv_cache_config(num_blocks: int, block_size: int) -> KVCacheConfig:
    spec = MLAAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=HEAD, dtype=torch.bfloat16
    )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)],
    )


def fake_kv(tokens: list[int], layer: int) -> torch.Tensor:
    """``[len(tokens), 576]`` bf16: position p's vector depends on ``tokens[: p + 1]``."""
    out = torch.empty((len(tokens), HEAD), dtype=torch.bfloat16)
    chain = hashlib.sha256(f"layer-{layer}".encode()).digest()
    for p, t in enumerate(tokens):
        chain = hashlib.sha256(chain + t.to_bytes(8, "little")).digest()
        g = torch.Generator().manual_seed(int.from_bytes(chain[:8], "little") >> 1)
        out[p] = torch.randn(HEAD, generator=g).to(torch.bfloat16)
    return out


@dataclass
class StepResult:
    output: SchedulerOutput
    load_errors: set[int]


@dataclass
class Engine:
    """One vLLM engine: scheduler (with its connector) and one worker connector."""

    config: VllmConfig
    num_tokens: int = 2048
    """Cache capacity in tokens (``num_blocks`` engine blocks of ``block`` tokens)."""
    block: int = field(init=False)
    num_blocks: int = field(init=False)
    scheduler: Scheduler = field(init=False)
    worker: Any = field(init=False)
    caches: dict[str, torch.Tensor] = field(init=False)
    block_ids: dict[str, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.block = self.config.cache_config.block_size
        self.num_blocks = self.num_tokens // self.block
        kcc = kv_cache_config(self.num_blocks, self.block)
        self.config.cache_config.num_gpu_blocks = self.num_blocks
        self.scheduler = Scheduler(
            self.config, kcc, StructuredOutputManager(self.config), block_size=self.block
        )
        self.worker = KVConnectorFactory.create_connector(self.config, KVConnectorRole.WORKER, kcc)
        self.caches = {
            name: torch.zeros((self.num_blocks, self.block, HEAD), dtype=torch.bfloat16)
            for name in LAYERS
        }
        self.worker.register_kv_caches(self.caches)
        hash_fn = get_hash_fn_by_name(self.config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self._hasher = get_request_block_hasher(self.block, hash_fn)

    @property
    def connector(self) -> Any:
        return self.scheduler.connector

    def request(self, req_id: str, tokens: list[int], cache_salt: str | None = None) -> Request:
        return Request(
            req_id,
            tokens,
            SamplingParams(max_tokens=2),
            None,
            cache_salt=cache_salt,
            block_hasher=self._hasher,
        )

    def rows(self, req_id: str, start: int, stop: int) -> list[torch.Tensor]:
        """Every layer's cache rows of positions ``[start, stop)`` of ``req_id``, as bytes."""
        ids = self.block_ids[req_id]
        index = [ids[p // self.block] * self.block + p % self.block for p in range(start, stop)]
        return [self.caches[n].view(-1, HEAD)[index].view(torch.uint8).clone() for n in LAYERS]

    def _track_blocks(self, out: SchedulerOutput) -> None:
        for r in out.scheduled_new_reqs:
            self.block_ids[r.req_id] = list(r.block_ids[0])
        c = out.scheduled_cached_reqs
        for req_id, ids in zip(c.req_ids, c.new_block_ids, strict=True):
            if req_id in c.resumed_req_ids:
                self.block_ids[req_id] = list(ids[0]) if ids else []
            elif ids:
                self.block_ids[req_id].extend(ids[0])

    def _compute_layer(self, out: SchedulerOutput, layer: int) -> None:
        kv = self.caches[LAYERS[layer]]
        for req_id, n in out.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            start = request.num_computed_tokens - n  # vLLM advances it when it schedules
            tokens = list(request.all_token_ids)
            values = fake_kv(tokens[: start + n], layer)[start:]
            for p in range(start, start + n):
                block = self.block_ids[req_id][p // self.block]
                kv[block, p % self.block] = values[p - start]

    def step(self, out: SchedulerOutput | None = None) -> StepResult:
        """One engine step (``out``: an already scheduled step, else schedule one)."""
        out = out if out is not None else self.scheduler.schedule()
        self._track_blocks(out)
        w = self.worker
        w.bind_connector_metadata(out.kv_connector_metadata)
        w.start_load_kv(None)
        for layer, name in enumerate(LAYERS):
            self._compute_layer(out, layer)  # vLLM's cache update, before its attention op
            w.wait_for_layer_load(name)
            w.save_kv_layer(name, self.caches[name], None)
        w.wait_for_save()
        w.mover.flush(30.0)  # stores run in the background; tests look at the tier next
        errors = w.get_block_ids_with_load_errors()
        w.clear_connector_metadata()
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            request = self.scheduler.requests[req_id]
            done = request.num_computed_tokens  # already advanced by this step's schedule
            sampled.append([SAMPLED] if done >= request.num_tokens else [])
        runner_output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=KVConnectorOutput(
                invalid_block_ids=set(errors),
                kv_connector_worker_meta=w.build_connector_worker_meta(),
            ),
        )
        self.scheduler.update_from_output(out, runner_output)
        return StepResult(out, set(errors))
