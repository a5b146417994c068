"""The worker side of the vLLM connector: moving tier blocks between vLLM's paged cache and the
tier, layer by layer (torch only, no vLLM import).

vLLM's cache is one tensor per layer. Seen as tier rows (:mod:`~tessera_ray.vllm.planes`: per
token, the MLA latent and RoPE key, or K then V of every head, wherever the kernels keep them),
position ``p`` of a request is a row that :class:`TokenRows` names; a tier block is the rows of its
positions in every layer, in layer order. Rows move as raw bytes (a dtype view, never a
conversion), so what is loaded is byte-identical to what was saved, and the engine's block size
may differ from the tier's.

Loads never leave a partial tier block in vLLM's cache. The step's tier blocks are read first
(the pool's pinned pages themselves where its memory is mapped here, else a staging buffer) and
each block's bytes are checked against the block hash the pool sealed them under (recomputed
from the bytes as the pool computes it); pins end once the step's copies are done. That hash,
not the one the scheduler's lookup returned, is the check: under one token key another pool may
hold different, equally valid bytes (KV recomputed by an engine that is not bitwise
reproducible), and refusing those would recompute the block on every request. Only verified
blocks are copied into the cache, and only the positions vLLM counts as loaded; a block that is
missing or fails the check, and every later block of the same request, is not copied at all and
its engine blocks are reported as load errors, so vLLM recomputes from there.

The read thread lands the verified blocks one layer at a time, in layer order, while the forward
computes the layers before (:mod:`~tessera_ray.vllm.landing`); a layer's attention waits for its
own layer only (``wait_for_layer_load``). vLLM writes the step's own KV at other positions, so
the two never touch the same rows. A layer whose attention ran without asking may have attended
to missing context: its loads are reported as failed, so vLLM recomputes them, as are the loads
of a step whose landing missed its deadline.

Saves copy the rows of tier blocks completed this step into host staging rows as each layer's
attention finishes; the tier store itself runs on a background thread, off the forward path.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from tessera_ray.actors.messages import BlockReads, PinTicket
from tessera_ray.core.results import TokenKey
from tessera_ray.errors import LayoutError, TierUnavailableError, TransportError
from tessera_ray.layout import ModelLayout
from tessera_ray.transport import MAPPED
from tessera_ray.vllm.backend import TierBackend
from tessera_ray.vllm.cpus import off_compute_cores
from tessera_ray.vllm.landing import StepLanding
from tessera_ray.vllm.loads import (
    LoadOutcome,
    LoadRun,
    PartCheck,
    land_run,
    staged,
    verified_block,
)
from tessera_ray.vllm.planes import LayerPlanes, mla_planes
from tessera_ray.vllm.records import BlockLoad, StepPlan
from tessera_ray.vllm.scheduler import check_block_sizes, check_paged_layout
from tessera_ray.vllm.stats import ConnectorCounters
from tessera_ray.vllm.store_queue import StoreQueue

__all__ = ["WorkerMover"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Layer:
    index: int
    planes: LayerPlanes
    """The layer's cache as tier rows (views, no copy)."""


class WorkerMover:
    """Per worker: the registered caches and this step's loads and saves."""

    def __init__(
        self,
        tier: TierBackend,
        layout: ModelLayout,
        *,
        engine_tokens: int,
        can_save: bool,
        timeout_s: float,
        max_pending_saves: int = 4,
        counters: ConnectorCounters | None = None,
    ) -> None:
        self.tier = tier
        self.counters = counters if counters is not None else ConnectorCounters()
        self.layout = layout
        self.page_bytes = check_paged_layout(layout)
        self.tier_tokens = layout.block_tokens
        check_block_sizes(self.tier_tokens, engine_tokens)
        self.engine_tokens = engine_tokens
        self.row_bytes = self.page_bytes // self.tier_tokens
        self.can_save = can_save
        self.timeout_s = timeout_s
        self._layers: dict[str, _Layer] = {}
        # Reads and landings run on their own thread, so start_load_kv returns at once and the
        # forward's work overlaps the tier round trip and the copies into the cache; stores on
        # another, off the forward path, at most max_pending_saves steps behind.
        self._reader = ThreadPoolExecutor(
            1, thread_name_prefix="tessera-connector-read", initializer=off_compute_cores
        )
        self._stores = StoreQueue(tier, self.counters, max_pending=max_pending_saves)
        self._closed = False
        self._landing: StepLanding | None = None
        self._order: list[_Layer] = []
        self._reset()

    def _reset(self) -> None:
        if self._landing is not None:  # a step that never finished: its pins end here
            self._landing.stop()
            self.tier.end_reads()
        self._plan = StepPlan()
        self._landing = None
        self._outcome: LoadOutcome | None = None
        self._waited: set[int] = set()
        self._save_src: torch.Tensor | None = None
        self._save_rows: torch.Tensor | None = None
        self._saved_layers: set[int] = set()

    # ---------------------------------------------------------------- registration

    def register(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        layer_index: Callable[[str], int],
        planes_of: Callable[[str, torch.Tensor], LayerPlanes] | None = None,
    ) -> None:
        """Learn vLLM's per-layer caches as tier rows: ``planes_of(name, tensor)`` says how
        the layer's kernels lay a token's values out (default: MLA, one contiguous row per
        token: ``[blocks, tokens, 576]`` on GPU, ``[blocks, 1, tokens, 576]`` on vLLM's CPU
        build)."""
        layers: dict[str, _Layer] = {}
        for name, kv in kv_caches.items():
            index = layer_index(name)
            planes = (
                planes_of(name, kv) if planes_of is not None else mla_planes(kv, self.engine_tokens)
            )
            row = planes.row_values * kv.element_size()
            if row != self.row_bytes or planes.block_tokens != self.engine_tokens:
                raise LayoutError(
                    f"vLLM cache of layer {name} ({tuple(kv.shape)} {kv.dtype}) holds {row} bytes "
                    f"per token in {planes.block_tokens}-token blocks, the tier layout "
                    f"{self.layout.model}/{self.layout.format_name} {self.row_bytes} in "
                    f"{self.engine_tokens}-token blocks; the kv_cache_dtype must match the "
                    "tier's page format"
                )
            layers[name] = _Layer(index, planes)
        indices = sorted(layer.index for layer in layers.values())
        if indices != list(range(self.layout.num_layers)):
            raise LayoutError(
                f"vLLM registered cache layers {indices}, the tier layout has layers "
                f"0..{self.layout.num_layers - 1}; pipeline parallelism and extra (MTP) layers "
                "are not supported by the connector"
            )
        self._layers = layers
        self._order = sorted(layers.values(), key=lambda layer: layer.index)
        self.tier.prepare_reads()

    # ---------------------------------------------------------------- loads

    def _step(self, plan: StepPlan) -> None:
        # A new plan object is a new step. Keyed on the plan, not on start_load_kv: without
        # synchronous loads vLLM starts loads only after the forward, whose layers already saved.
        if plan is self._plan:
            return
        self._reset()
        self._plan = plan
        if plan.saves and self.can_save:
            rows = [r for s in plan.saves for r in s.rows.cache_rows(self.engine_tokens)]
            self._save_src = torch.tensor(rows, dtype=torch.long)
            blocks = len(rows) // self.tier_tokens
            self._save_rows = torch.empty((blocks, self.layout.block_bytes), dtype=torch.uint8)

    def start(self, plan: StepPlan) -> None:
        """Begin this step's loads: read and verify them in the background."""
        self._step(plan)
        if plan.loads and self._landing is None and self._order:
            landing = self._landing = StepLanding(len(self._order))
            self._reader.submit(
                landing.run,
                functools.partial(self._read_and_verify, plan.loads),
                self._land_layer,
                range(len(self._order)),
                self._order[0].planes.device,
            )

    def _read_and_verify(self, loads: Sequence[BlockLoad]) -> LoadOutcome:
        outcome = LoadOutcome()
        by_ns: dict[str, list[BlockLoad]] = {}
        for load in loads:
            by_ns.setdefault(load.namespace, []).append(load)
        unverified: dict[str, list[TokenKey]] = {}
        t, e = self.tier_tokens, self.engine_tokens
        verified = mapped = in_place = 0
        for i, (namespace, group) in enumerate(by_ns.items()):
            keys = [k for load in group for k in load.token_keys]
            hits = [h for load in group for h in load.hits]
            ticket = self._lookup_pin(group)
            try:
                reads = self.tier.read(namespace, keys, hits, ticket)
            except TierUnavailableError as exc:  # the tier is down or slow: recompute
                self.counters.add(tier_failures=1)
                log.warning("tier read of %d blocks failed: %s", len(keys), exc)
                empty = np.empty((0, self.layout.block_bytes), dtype=np.uint8)
                reads = BlockReads.of([None] * len(keys), empty)
            if len(reads) != len(keys):
                raise LayoutError(f"the tier read {len(reads)} blocks for {len(keys)} keys")
            payloads = reads.payloads
            if reads.lent and i + 1 < len(by_ns):
                payloads = payloads.copy()  # the next read reuses the memory these rows are in
            part = len(outcome.parts)
            outcome.parts.append(staged(payloads))
            checked = reads.verified or reads.check_layer is not None  # else hashed here
            if reads.check_layer is not None:
                row_keys: list[TokenKey | None] = [None] * len(payloads)
                for key, row in zip(keys, reads.rows, strict=True):
                    if row >= 0:
                        row_keys[row] = key
                outcome.checks[part] = PartCheck(reads.check_layer, namespace, row_keys)
            first = 0  # the load's first key among ``keys``
            for load in group:
                # The load's verified leading tier blocks: consecutive rows of the payloads.
                n = 0
                for j, (key, hit) in enumerate(zip(load.token_keys, load.hits, strict=True)):
                    block = reads[first + j]
                    if block is None:
                        break
                    if not verified_block(self.layout, namespace, block, hit.block_hash, checked):
                        unverified.setdefault(namespace, []).append(key)
                        break
                    n += 1
                row = reads.rows[first] if n else 0
                if n and reads.rows[first + n - 1] - row != n - 1:
                    raise LayoutError("a tier read's held blocks are not in key order")
                first += len(load.token_keys)
                verified += n
                mapped += n if reads.carrier == MAPPED else 0
                in_place += n if reads.pinned else 0
                end = min(load.rows.stop, load.tier_position + n * t)
                if end > load.rows.start:
                    skip = load.rows.start - load.tier_position
                    used = -(-(end - load.tier_position) // t)
                    to = dataclasses.replace(load.rows, stop=end)
                    outcome.runs.append(LoadRun(part, row, used, skip, to, load.req_id))
                if end < load.rows.stop:
                    # This tier block and every later one of the request: vLLM recomputes
                    # from the first failed engine block, so later ones would be overwritten.
                    outcome.failed_blocks |= load.rows.blocks_from(end, e)
                    outcome.failed_requests.add(load.req_id)
        self.counters.add(loaded_blocks=verified, mapped_blocks=mapped, in_place_blocks=in_place)
        for namespace, keys in unverified.items():
            try:  # the tier drops what rotted in it, so the next save stores it afresh
                self.tier.report_unverified(namespace, keys)
            except TierUnavailableError as exc:
                self.counters.add(tier_failures=1)
                log.warning("reporting %d unverified blocks failed: %s", len(keys), exc)
        return outcome

    def _lookup_pin(self, group: Sequence[BlockLoad]) -> PinTicket | None:
        """The pin the scheduler's lookup made of a lone load's blocks, read in place without
        asking the pool again; several loads of a namespace are read in one call, so their
        lookups' pins (each of one request's blocks) are ended and the read pins them all."""
        if len(group) == 1:
            return group[0].ticket
        for load in group:
            if load.ticket is not None:
                self.tier.unpin(load.ticket)
        return None

    def _loaded(self) -> LoadOutcome | None:
        if self._outcome is None and self._landing is not None:
            try:
                self._outcome = self._landing.outcome(self.timeout_s)
            except TimeoutError:
                self.counters.add(tier_failures=1)
                log.warning("tier read took over %.1f s; recomputing its blocks", self.timeout_s)
                self._landing.stop()
                self._outcome = self._all_failed()
        return self._outcome

    def _all_failed(self) -> LoadOutcome:
        e = self.engine_tokens
        return LoadOutcome(
            failed_blocks={b for load in self._plan.loads for b in load.rows.blocks_from(0, e)},
            failed_requests={load.req_id for load in self._plan.loads},
        )

    def _land_layer(self, index: int, outcome: LoadOutcome) -> None:
        """On the read thread (:class:`StepLanding`): layer ``index``'s share of the verified
        runs, written into its cache; a part read in place has this layer's pages checked
        against their seals first, and lands nothing more once one does not match."""
        layer = self._order[index]
        offset = layer.index * self.page_bytes
        for index_of_part, check in outcome.checks.items():
            if not check.failed:
                self._check_layer(outcome, index_of_part, check, layer.index)
        for run in outcome.runs:
            failed = outcome.checks.get(run.part)
            if failed is not None and failed.failed:
                continue
            # The layer's pages of the part's blocks, as [blocks, T, row] (a strided view).
            part = outcome.parts[run.part]
            pages = part[:, offset : offset + self.page_bytes].view(layer.planes.dtype)
            pages = pages.reshape(len(part), self.tier_tokens, -1)
            land_run(layer.planes, pages, run, self.engine_tokens)

    def _check_layer(self, outcome: LoadOutcome, part: int, check: PartCheck, layer: int) -> None:
        """Hash layer ``layer``'s pages of the part's rows that land; where one does not match
        (or the pool exited), the part's loads fail from their first position: vLLM recomputes
        them (the layers landed before held verified bytes, which it overwrites)."""
        runs = [run for run in outcome.runs if run.part == part]
        rows = sorted({r for run in runs for r in range(run.first, run.first + run.count)})
        try:
            bad = check.check(layer, rows)
        except TransportError as exc:
            log.warning("an in-place read failed at layer %d (%s); recomputing it", layer, exc)
            self.counters.add(tier_failures=1)
            bad = []
            check.failed = True
        if not bad and not check.failed:
            return
        check.failed = True
        e = self.engine_tokens
        for run in runs:
            outcome.failed_blocks |= run.rows.blocks_from(run.rows.start, e)
            outcome.failed_requests.add(run.req_id)
        keys = [key for r in bad if (key := check.keys[r]) is not None]
        if keys:
            try:  # the tier drops what rotted in it, so the next save stores it afresh
                self.tier.report_unverified(check.namespace, keys)
            except TierUnavailableError as exc:
                self.counters.add(tier_failures=1)
                log.warning("reporting %d unverified blocks failed: %s", len(keys), exc)

    def wait_layer(self, plan: StepPlan, name: str) -> None:
        """Return once layer ``name``'s share of this step's verified blocks is in its cache
        (landed by the read thread, usually while earlier layers computed)."""
        self._step(plan)
        layer = self._layers.get(name)
        landing = self._landing
        if layer is None or landing is None or layer.index in self._waited:
            return
        self._waited.add(layer.index)
        outcome = self._loaded()
        if outcome is not None and outcome.runs:
            landing.wait_layer(layer.index, self.timeout_s)

    # ---------------------------------------------------------------- saves

    def save_layer(self, plan: StepPlan, name: str, kv: torch.Tensor) -> None:
        """Copy layer ``name``'s rows of the tier blocks completed this step into the staging
        rows (vLLM has written this step's KV of the layer by now)."""
        self._step(plan)
        layer = self._layers.get(name)
        if layer is None or self._save_src is None or self._save_rows is None:
            return
        n = len(self._save_rows)
        rows = layer.planes.gather(self._save_src)
        offset = layer.index * self.page_bytes
        self._save_rows[:, offset : offset + self.page_bytes] = (
            rows.view(torch.uint8).reshape(n, self.page_bytes).cpu()
        )
        self._saved_layers.add(layer.index)

    def finish(self, plan: StepPlan) -> None:
        """End of the step: settle this step's loads, then hand the staged tier blocks to the
        background store.

        Tier blocks of a request whose load failed this step are not stored: that request's
        tokens this step attended to blocks that were not there."""
        self._stores.raise_error()
        self._step(plan)
        if self._landing is not None:
            missed = [layer for layer in self._order if layer.index not in self._waited]
            outcome = self._loaded()
            # Nothing is written into the cache after this: the pinned pages may be reused.
            landed = self._landing.finish(self.timeout_s)
            pinned = self.tier.end_reads()  # every layer's copy out of pinned pages is done
            self._waited.update(layer.index for layer in self._order)
            if outcome is not None and outcome.runs and (missed or not pinned or not landed):
                if missed:
                    log.error(
                        "vLLM ran attention of %d layers without waiting for their loads; "
                        "reporting this step's loaded blocks as failed so vLLM recomputes them",
                        len(missed),
                    )
                elif not landed:
                    log.error(
                        "this step's loads did not land in vLLM's cache within %.1f s; "
                        "reporting them as failed so vLLM recomputes them",
                        self.timeout_s,
                    )
                else:
                    log.error(
                        "this step's loads were copied out of pool pages whose pin may have "
                        "lapsed; reporting them as failed so vLLM recomputes them"
                    )
                late = self._all_failed()
                outcome.failed_blocks |= late.failed_blocks
                outcome.failed_requests |= late.failed_requests
        rows, save_src = self._save_rows, self._save_src
        self._save_rows = self._save_src = None  # stored once, even if finish runs twice
        if rows is None or save_src is None:
            return
        seq = self._plan.save_seq
        if len(self._saved_layers) != self.layout.num_layers:
            log.warning("only %d layers saved this step; not storing", len(self._saved_layers))
            self._stores.done(seq)
            return
        failed = self._outcome.failed_requests if self._outcome is not None else set()
        by_ns: dict[str, tuple[list[TokenKey], list[int]]] = {}
        at = 0
        for save in self._plan.saves:
            if save.req_id not in failed:
                keys, idx = by_ns.setdefault(save.namespace, ([], []))
                keys.extend(save.token_keys)
                idx.extend(range(at, at + len(save.token_keys)))
            at += len(save.token_keys)
        if not by_ns:
            self._stores.done(seq)
            return
        self._stores.submit(by_ns, rows, seq)

    def take_done_saves(self) -> list[int]:
        """The ``save_seq`` of every step whose stores ended (landed or not) since the last
        call: the scheduler stops waiting for their blocks."""
        return self._stores.take_done()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every store handed over so far is done; ``False`` on timeout."""
        return self._stores.flush(timeout_s)

    def take_load_errors(self) -> set[int]:
        """Engine block ids whose load failed this step (reported once)."""
        outcome = self._loaded() if self._landing is not None else None
        if outcome is None:
            return set()
        failed, outcome.failed_blocks = outcome.failed_blocks, set()
        self.counters.add(failed_blocks=len(failed))
        return failed

    def close(self) -> None:
        """Stop reading, finish the stores handed over; idempotent (vLLM may shut down twice)."""
        if self._closed:
            return
        self._closed = True
        self._reader.shutdown(wait=True, cancel_futures=True)  # no read into staging after
        self._stores.close()
        self.tier.release_reads()
