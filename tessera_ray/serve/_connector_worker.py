"""The worker side of the vLLM connector: moving whole blocks between vLLM's paged MLA cache and
the tier, layer by layer (torch only, no vLLM import).

vLLM's MLA cache is one tensor per layer, ``[num_blocks, block_size, 576]`` (the latent and the
RoPE key of each token); a tier block is one such page of every layer, in layer order. A page
moves as raw bytes (a dtype view, never a conversion), so what is loaded is byte-identical to
what was saved.

Loads never leave a partial block in vLLM's cache. The step's blocks are read into a staging
buffer first and each block's bytes are checked against the block hash the pool sealed them
under (recomputed from the bytes as the pool computes it). That hash, not the one the
scheduler's lookup returned, is the check: under one token key another pool may hold
different, equally valid bytes (KV recomputed by an engine that is not bitwise reproducible),
and refusing those would recompute the block on every request. Only verified blocks are
copied into the cache, one layer at a time as each attention layer asks for it; a block that is
missing or fails the check, and every later block of the same request, is not copied at all and
is reported as a load error, so vLLM recomputes from there. Zeroing or restoring failed blocks
afterwards would need a second copy of the cache; staging costs one block buffer per loaded
block instead.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from tessera_ray.actors.messages import BlockRead
from tessera_ray.core.results import BlockHash, TokenKey
from tessera_ray.errors import LayoutError
from tessera_ray.layout import ModelLayout
from tessera_ray.serve._connector_plan import BlockLoad, StepPlan, check_paged_layout
from tessera_ray.serve._connector_tier import TierBackend, payload_block_hash

__all__ = ["WorkerMover", "LoadOutcome"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class LoadOutcome:
    """A step's verified blocks (staged rows) and what failed."""

    block_ids: list[int] = field(default_factory=list)
    rows: torch.Tensor | None = None
    """uint8 ``[len(block_ids), block_bytes]``: the verified payloads, in ``block_ids`` order."""
    failed_blocks: set[int] = field(default_factory=set)
    failed_requests: set[str] = field(default_factory=set)


class WorkerMover:
    """Per worker: the registered caches and this step's loads and saves."""

    def __init__(
        self, tier: TierBackend, layout: ModelLayout, *, can_save: bool, timeout_s: float
    ) -> None:
        self.tier = tier
        self.layout = layout
        self.page_bytes = check_paged_layout(layout)
        self.can_save = can_save
        self.timeout_s = timeout_s
        self._layers: dict[str, tuple[int, torch.Tensor]] = {}
        # Reads run on their own thread, so start_load_kv returns at once and the first layers'
        # work before attention overlaps the tier round trip.
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="tessera-connector-read")
        self._reset()

    def _reset(self) -> None:
        self._plan = StepPlan()
        self._pending: Future[LoadOutcome] | None = None
        self._outcome: LoadOutcome | None = None
        self._copied: set[int] = set()
        self._save_ids: torch.Tensor | None = None
        self._save_rows: torch.Tensor | None = None
        self._saved_layers: set[int] = set()

    # ---------------------------------------------------------------- registration

    def register(
        self, kv_caches: Mapping[str, torch.Tensor], layer_index: Callable[[str], int]
    ) -> None:
        """Learn vLLM's per-layer caches; each must hold the layout's page per block."""
        layers: dict[str, tuple[int, torch.Tensor]] = {}
        for name, kv in kv_caches.items():
            index = layer_index(name)
            page = kv[0].numel() * kv.element_size() if kv.dim() > 1 and len(kv) else 0
            if page != self.page_bytes:
                raise LayoutError(
                    f"vLLM cache of layer {name} holds {page} bytes per block, the tier layout "
                    f"{self.layout.model}/{self.layout.format_name} {self.page_bytes}; the "
                    "kv_cache_dtype and block_size must match the tier's page format"
                )
            layers[name] = (index, kv)
        indices = sorted(i for i, _ in layers.values())
        if indices != list(range(self.layout.num_layers)):
            raise LayoutError(
                f"vLLM registered cache layers {indices}, the tier layout has layers "
                f"0..{self.layout.num_layers - 1}; pipeline parallelism and extra (MTP) layers "
                "are not supported by the connector"
            )
        self._layers = layers

    # ---------------------------------------------------------------- loads

    def _step(self, plan: StepPlan) -> None:
        # A new plan object is a new step. Keyed on the plan, not on start_load_kv: without
        # synchronous loads vLLM starts loads only after the forward, whose layers already saved.
        if plan is self._plan:
            return
        self._reset()
        self._plan = plan
        if plan.saves and self.can_save:
            ids = [b for s in plan.saves for b in s.block_ids]
            self._save_ids = torch.tensor(ids, dtype=torch.long)
            self._save_rows = torch.empty((len(ids), self.layout.block_bytes), dtype=torch.uint8)

    def start(self, plan: StepPlan) -> None:
        """Begin this step's loads: read and verify them in the background."""
        self._step(plan)
        if plan.loads and self._pending is None:
            self._pending = self._reader.submit(self._read_and_verify, plan.loads)

    def _read_and_verify(self, loads: Sequence[BlockLoad]) -> LoadOutcome:
        outcome = LoadOutcome()
        by_ns: dict[str, list[BlockLoad]] = {}
        for load in loads:
            by_ns.setdefault(load.namespace, []).append(load)
        staged: list[np.ndarray] = []
        unverified: dict[str, list[TokenKey]] = {}
        for namespace, group in by_ns.items():
            keys = [k for load in group for k in load.token_keys]
            try:
                blocks: list[BlockRead | None] = self.tier.read(namespace, keys)
            except Exception as exc:  # the tier is down or slow: recompute, never fail
                log.warning("tier read of %d blocks failed: %s", len(keys), exc)
                blocks = [None] * len(keys)
            it = iter(blocks)
            for load in group:
                ok = True
                for block_id, key, looked_up in zip(
                    load.block_ids, load.token_keys, load.block_hashes, strict=True
                ):
                    block = next(it)
                    if ok and block is not None and not self._verified(namespace, block, looked_up):
                        unverified.setdefault(namespace, []).append(key)
                        block = None
                    ok = ok and block is not None
                    if ok:
                        assert block is not None
                        outcome.block_ids.append(block_id)
                        staged.append(block.payload)
                    else:
                        # This block and every later one of the request: vLLM recomputes
                        # from the first failed block, so later ones would be overwritten.
                        outcome.failed_blocks.add(block_id)
                        outcome.failed_requests.add(load.req_id)
        if staged:
            outcome.rows = torch.from_numpy(np.stack(staged))
        for namespace, keys in unverified.items():
            try:  # the tier drops what rotted in it, so the next save stores it afresh
                self.tier.report_unverified(namespace, keys)
            except Exception as exc:
                log.warning("reporting %d unverified blocks failed: %s", len(keys), exc)
        return outcome

    def _verified(self, namespace: str, block: BlockRead, looked_up: BlockHash) -> bool:
        row = block.payload
        if row.dtype != np.uint8 or row.size != self.layout.block_bytes:
            log.warning("tier block of %d bytes, expected %d", row.size, self.layout.block_bytes)
            return False
        if payload_block_hash(self.layout, namespace, row) != block.block_hash:
            log.warning("tier block failed verification against its sealed hash; recomputing")
            return False
        if block.block_hash != looked_up:
            log.debug("the pool holds other valid bytes under this key than the lookup saw")
        return True

    def _loaded(self) -> LoadOutcome | None:
        if self._outcome is None and self._pending is not None:
            try:
                self._outcome = self._pending.result(self.timeout_s)
            except Exception as exc:
                log.warning("tier read did not finish: %s; recomputing its blocks", exc)
                self._outcome = LoadOutcome(
                    failed_blocks={b for load in self._plan.loads for b in load.block_ids},
                    failed_requests={load.req_id for load in self._plan.loads},
                )
        return self._outcome

    def _copy_layer(self, index: int, kv: torch.Tensor) -> None:
        outcome = self._loaded()
        if outcome is None or outcome.rows is None or index in self._copied:
            return
        self._copied.add(index)
        offset = index * self.page_bytes
        pages = outcome.rows[:, offset : offset + self.page_bytes].contiguous()
        src = pages.view(kv.dtype).reshape(len(outcome.block_ids), *kv.shape[1:])
        ids = torch.tensor(outcome.block_ids, dtype=torch.long, device=kv.device)
        kv.index_copy_(0, ids, src.to(kv.device))

    def wait_layer(self, plan: StepPlan, name: str) -> None:
        """Make layer ``name``'s share of this step's verified blocks present in its cache."""
        self._step(plan)
        entry = self._layers.get(name)
        if entry is not None and self._pending is not None:
            self._copy_layer(*entry)

    # ---------------------------------------------------------------- saves

    def save_layer(self, plan: StepPlan, name: str, kv: torch.Tensor) -> None:
        """Copy layer ``name``'s pages of the blocks completed this step into the staging rows
        (vLLM has written this step's KV of the layer by now)."""
        self._step(plan)
        entry = self._layers.get(name)
        if entry is None or self._save_ids is None or self._save_rows is None:
            return
        index = entry[0]
        n = len(self._save_ids)
        pages = kv.index_select(0, self._save_ids.to(kv.device)).reshape(n, -1)
        offset = index * self.page_bytes
        self._save_rows[:, offset : offset + self.page_bytes] = pages.view(torch.uint8).cpu()
        self._saved_layers.add(index)

    def finish(self, plan: StepPlan) -> None:
        """End of the step: complete every layer's loads, then store the staged blocks.

        Blocks of a request whose load failed this step are not stored: that request's tokens
        this step attended to blocks that were not there."""
        self._step(plan)
        if self._pending is not None:
            for index, kv in self._layers.values():
                self._copy_layer(index, kv)
        rows, save_ids = self._save_rows, self._save_ids
        self._save_rows = self._save_ids = None  # stored once, even if finish runs twice
        if rows is None or save_ids is None:
            return
        if len(self._saved_layers) != self.layout.num_layers:
            log.warning("only %d layers saved this step; not storing", len(self._saved_layers))
            return
        failed = self._outcome.failed_requests if self._outcome is not None else set()
        by_ns: dict[str, tuple[list[TokenKey], list[int]]] = {}
        at = 0
        for save in self._plan.saves:
            if save.req_id not in failed:
                keys, idx = by_ns.setdefault(save.namespace, ([], []))
                keys.extend(save.token_keys)
                idx.extend(range(at, at + len(save.block_ids)))
            at += len(save.block_ids)
        for namespace, (keys, idx) in by_ns.items():
            try:
                self.tier.store(namespace, keys, rows[idx].numpy())
            except Exception as exc:  # a save that fails is a later miss, never a failed step
                log.warning("tier store of %d blocks failed: %s", len(keys), exc)

    def take_load_errors(self) -> set[int]:
        """Block ids whose load failed this step (reported once)."""
        outcome = self._loaded() if self._pending is not None else None
        if outcome is None:
            return set()
        failed, outcome.failed_blocks = outcome.failed_blocks, set()
        return failed

    def close(self) -> None:
        self._reader.shutdown(wait=False, cancel_futures=True)
