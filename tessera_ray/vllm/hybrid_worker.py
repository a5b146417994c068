"""The worker side of the connector for hybrid models (torch only, no vLLM import): prefix
blocks and resume records (:mod:`~tessera_ray.vllm.hybrid`, docs/v4-connector.md) moved between
the tier and every cache vLLM registered.

Each registered cache is a *stream* of entries: one per ``stride`` tokens (V4's CSA cache one per
4, HCA one per 128, a window or compressor state one per token), ``entries`` to an engine block
of its KV cache group. A prefix block holds, for every stream of a group that keeps all
positions, the entries of its tier block's tokens, in the tier layout's order (its paged
groups, then layers); a resume record holds, for every sliding-window stream, the
``window - 1`` positions it keeps at the record's boundary, in the layout's window order.

Loads are asynchronous and all or nothing: a request's prefix blocks and record chunks are read
together, each verified against the hash its pool sealed it under, and written into the
request's blocks only if every one verified; otherwise the request is reported failed and
vLLM computes it. The model reads no cache of a request while its load runs (the request waits
for it), so the copy runs on the reader thread. Saves read the caches after the step's forward
(V4's layers call no per-layer hook) and hand the staged blocks to the background store.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from tessera_ray.core.results import TokenKey
from tessera_ray.errors import LayoutError, TierUnavailableError
from tessera_ray.layout import CacheSpec, ModelLayout
from tessera_ray.vllm.backend import TierBackend
from tessera_ray.vllm.hybrid import EngineGroup
from tessera_ray.vllm.loads import staged, verified_block
from tessera_ray.vllm.planes import LayerPlanes
from tessera_ray.vllm.records import BlockLoad, BlockSave, StepPlan, TokenRows
from tessera_ray.vllm.stats import ConnectorCounters
from tessera_ray.vllm.store_queue import StoreBatch, StoreQueue

__all__ = ["HybridMover", "CacheStream", "build_streams", "resume_chunks"]

log = logging.getLogger(__name__)


def _window_specs(layout: ModelLayout) -> list[tuple[CacheSpec, int]]:
    return [(spec, layer) for spec, layers in layout.windows for layer in layers]


def resume_chunks(layout: ModelLayout) -> int:
    """Tier blocks one resume record takes (:attr:`ModelLayout.resume_bytes`)."""
    return -(-layout.resume_bytes // layout.block_bytes)


@dataclass(frozen=True, slots=True)
class CacheStream:
    """One registered cache as tier entries (see the module docstring)."""

    name: str
    group: int
    spec: CacheSpec
    stride: int
    planes: LayerPlanes
    """The cache as rows of entries: ``block_tokens`` is entries per engine block."""
    offset: int
    """Byte offset of this stream in a prefix block (or, windowed, in the resume record)."""

    @property
    def windowed(self) -> bool:
        return self.spec.windowed

    def entry_rows(self, rows: TokenRows) -> torch.Tensor:
        """The cache rows of the entries of positions ``rows`` (whole entries only)."""
        s = self.stride
        if rows.start % s or rows.stop % s or rows.first_position % s:
            raise LayoutError(f"{self.name}: positions {rows.start}..{rows.stop} split an entry")
        entries = TokenRows(
            rows.block_ids, rows.first_position // s, rows.start // s, rows.stop // s
        )
        return torch.tensor(entries.cache_rows(self.planes.block_tokens), dtype=torch.long)


SPLIT_ENTRIES: dict[str, int] = {"v4-model1": 576, "v4-indexer": 128}
"""Entry formats vLLM pages in two parts, by the bytes of the first: per engine block, every
token's first part (fp8 values and RoPE; the indexer key), then every token's rest (its scales),
as FlashMLA's fp8 cache and V4's indexer cache are laid out. Any other entry is token-major."""


def _entry_planes(kv: torch.Tensor, spec: CacheSpec) -> LayerPlanes:
    """``kv`` (``[blocks, (1,) entries, values]``, any dtype) as planes of uint8 entries:
    views, whatever the stride between blocks (vLLM's caches share one pool)."""
    raw = kv.view(torch.uint8)
    inner = [d for d in raw.shape[1:-1] if d != 1]
    if len(inner) != 1:
        raise LayoutError(f"cache {tuple(kv.shape)} is not [blocks, entries, values]")
    while raw.dim() > 3:  # squeeze, never reshape: a copy would take writes away from vLLM
        raw = raw.squeeze(next(d for d in range(1, raw.dim() - 1) if raw.shape[d] == 1))
    blocks, entries, width = raw.shape
    split = SPLIT_ENTRIES.get(spec.entry.name)
    if split is None:
        return LayerPlanes((raw.unsqueeze(2),), entries)
    if raw.stride(1) != width or raw.stride(2) != 1:
        raise LayoutError(f"cache {tuple(kv.shape)} is not contiguous within a block")
    flat = raw.as_strided((blocks, entries * width), (raw.stride(0), 1))
    first = flat[:, : entries * split].view(blocks, entries, split)
    rest = flat[:, entries * split :].view(blocks, entries, width - split)
    return LayerPlanes((first.unsqueeze(2), rest.unsqueeze(2)), entries)


def build_streams(
    layout: ModelLayout,
    groups: Sequence[EngineGroup],
    group_of: Mapping[str, int],
    kv_caches: Mapping[str, torch.Tensor],
    layer_index: Callable[[str], int],
) -> list[CacheStream]:
    """Match every registered cache to the tier spec it holds: the same layer, windowed or
    not as its group, the same tokens per entry and entry bytes (refused otherwise, by name)."""
    prefix: dict[tuple[CacheSpec, int], int] = {}
    at = 0
    for paged in layout.groups:
        for layer in paged.layers:
            prefix[(paged.page.cache, layer)] = at
            at += paged.page.page_bytes
    record: dict[tuple[CacheSpec, int], int] = {}
    at = 0
    for spec, layer in _window_specs(layout):
        assert spec.window_tokens is not None
        record[(spec, layer)] = at
        at += (spec.window_tokens - 1) * spec.entry.entry_bytes
    streams: list[CacheStream] = []
    for name, kv in kv_caches.items():
        if name not in group_of:
            raise LayoutError(f"vLLM registered cache {name}, which is in no KV cache group")
        g = group_of[name]
        group = groups[g]
        per_block = next((d for d in kv.shape[1:-1] if d != 1), 1)
        entry_bytes = kv.shape[-1] * kv.element_size()
        layer = layer_index(name)
        stride, rest = divmod(group.block_tokens, per_block)
        specs = layout.layers[layer] if 0 <= layer < layout.num_layers else ()
        found = [
            s
            for s in specs
            if not rest
            and s.stride_tokens == stride
            and s.entry.entry_bytes == entry_bytes
            and s.window_tokens == group.window_tokens
        ]
        if len(found) != 1:
            raise LayoutError(
                f"vLLM cache {name} ({tuple(kv.shape)} {kv.dtype}, {per_block} entries of "
                f"{entry_bytes} B per {group.block_tokens}-token block, window "
                f"{group.window_tokens}) matches {len(found)} caches of layer {layer} in the "
                f"tier layout {layout.model}/{layout.format_name} "
                f"({', '.join(s.label() for s in specs) or 'none'})"
            )
        spec = found[0]
        offset = record[(spec, layer)] if spec.windowed else prefix[(spec, layer)]
        planes = _entry_planes(kv, spec)
        streams.append(CacheStream(name, g, spec, stride, planes, offset))
    held = {(s.spec, layer_index(s.name)) for s in streams}
    missing = [
        f"{spec.label()} of layer {layer}"
        for spec, layer in (*prefix, *record)
        if (spec, layer) not in held
    ]
    if missing:
        raise LayoutError(f"vLLM registered no cache for {', '.join(missing)} of the tier layout")
    return streams


class HybridMover:
    """Per worker: the registered caches of a hybrid model, its loads in flight and its saves
    (see the module docstring)."""

    def __init__(
        self,
        tier: TierBackend,
        layout: ModelLayout,
        *,
        groups: Sequence[EngineGroup],
        can_save: bool,
        timeout_s: float,
        max_pending_saves: int = 4,
        counters: ConnectorCounters | None = None,
    ) -> None:
        self.tier = tier
        self.layout = layout
        self.groups = tuple(groups)
        self.tier_tokens = layout.block_tokens
        self.can_save = can_save
        self.timeout_s = timeout_s
        self.counters = counters if counters is not None else ConnectorCounters()
        for spec, layer in _window_specs(layout):
            assert spec.window_tokens is not None
            if spec.window_tokens - 1 > self.tier_tokens:
                # A record at the first boundary would reach before position 0.
                raise LayoutError(
                    f"layer {layer} keeps a {spec.window_tokens}-token window, longer than the "
                    f"tier block of {self.tier_tokens} tokens; use a larger block"
                )
        self.chunks = resume_chunks(layout)
        self._streams: list[CacheStream] = []
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="tessera-connector-read")
        self._stores = StoreQueue(tier, self.counters, max_pending=max_pending_saves)
        self._loads: dict[str, Future[bool]] = {}
        self._started: StepPlan | None = None
        self._saved: StepPlan | None = None
        self._closed = False

    def register(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        layer_index: Callable[[str], int],
        group_of: Mapping[str, int],
    ) -> None:
        """Learn vLLM's caches: ``group_of`` names each cache's KV cache group."""
        self._streams = build_streams(self.layout, self.groups, group_of, kv_caches, layer_index)
        self.tier.prepare_reads()

    # ---------------------------------------------------------------- loads

    def start(self, plan: StepPlan) -> None:
        """Begin this step's loads in the background (each request's at most once)."""
        if plan is self._started:
            return
        self._started = plan
        for load in plan.loads:
            if load.req_id not in self._loads:
                self._loads[load.req_id] = self._reader.submit(self._load, load)

    def _load(self, load: BlockLoad) -> bool:
        started = time.perf_counter()
        try:
            return self._read_into_caches(load)
        finally:
            self.counters.add(load_s=time.perf_counter() - started)

    def _read_into_caches(self, load: BlockLoad) -> bool:
        keys = [*load.token_keys, *load.resume_keys]
        hits = [*load.hits, *load.resume_hits]
        try:
            reads = self.tier.read(load.namespace, keys, hits)
        except TierUnavailableError as exc:  # the tier is down or slow: the engine computes
            self.counters.add(tier_failures=1)
            log.warning("tier read of %d blocks failed: %s", len(keys), exc)
            return False
        if len(reads) != len(keys):
            raise LayoutError(f"the tier read {len(reads)} blocks for {len(keys)} keys")
        for i, (key, hit) in enumerate(zip(keys, hits, strict=True)):
            block = reads[i]
            if block is None:
                return False
            ns = load.namespace
            if not verified_block(self.layout, ns, block, hit.block_hash, reads.verified):
                self._report_unverified(load.namespace, key)
                return False
        # Every key held: the payloads are their rows in key order, used where they lie.
        blocks = staged(reads.payloads[: len(keys)])
        n = len(load.token_keys)
        record = blocks[n:].reshape(-1)
        t = self.tier_tokens
        for stream in self._streams:
            rows = load.groups[stream.group]
            if rows.stop <= rows.start:
                continue
            eb = stream.spec.entry.entry_bytes
            if stream.windowed:
                assert stream.spec.window_tokens is not None
                kept = stream.spec.window_tokens - 1
                values = record[stream.offset : stream.offset + kept * eb].view(kept, eb)
                values = values[kept - len(rows) :]  # the record ends at rows.stop
            else:
                per_block = t // stream.stride
                page = blocks[:n, stream.offset : stream.offset + per_block * eb]
                skip = (rows.start - load.tier_position) // stream.stride
                values = page.reshape(n * per_block, eb)[skip : skip + len(rows) // stream.stride]
            stream.planes.scatter(stream.entry_rows(rows), values)
        self.counters.add(loaded_blocks=n)
        return True

    def _report_unverified(self, namespace: str, key: TokenKey) -> None:
        try:  # the tier drops what rotted in it, so the next save stores it afresh
            self.tier.report_unverified(namespace, [key])
        except TierUnavailableError as exc:
            self.counters.add(tier_failures=1)
            log.warning("reporting an unverified block failed: %s", exc)

    def take_finished(self) -> tuple[set[str], set[str]]:
        """Requests whose loads ended since the last call, and those of them that failed (vLLM
        wants a failed one in both)."""
        done: set[str] = set()
        failed: set[str] = set()
        for req_id, future in list(self._loads.items()):
            if future.done():
                del self._loads[req_id]
                done.add(req_id)
                if not future.result():
                    failed.add(req_id)
        self.counters.add(failed_blocks=len(failed))
        return done, failed

    # ---------------------------------------------------------------- saves

    def finish(self, plan: StepPlan) -> None:
        """End of the step (its forward wrote every cache): stage the tier blocks and resume
        records it completed and hand them to the background store."""
        self._stores.raise_error()
        if plan is self._saved or not plan.saves or not self.can_save:
            return
        self._saved = plan
        staged: list[torch.Tensor] = []
        batch: StoreBatch = {}
        at = 0
        for save in plan.saves:
            keys = [*save.token_keys, *save.resume_keys]
            staged.append(self._stage(save))
            names, rows = batch.setdefault(save.namespace, ([], []))
            names.extend(keys)
            rows.extend(range(at, at + len(keys)))
            at += len(keys)
        self._stores.submit(batch, torch.cat(staged), plan.save_seq)

    def _stage(self, save: BlockSave) -> torch.Tensor:
        n, c = len(save.token_keys), len(save.resume_keys)
        out = torch.zeros((n + c, self.layout.block_bytes), dtype=torch.uint8)
        record = out[n:].view(-1)
        t = self.tier_tokens
        for stream in self._streams:
            if stream.windowed and not c:
                continue
            values = stream.planes.gather(stream.entry_rows(save.groups[stream.group])).cpu()
            if stream.windowed:
                record[stream.offset : stream.offset + values.numel()] = values.reshape(-1)
            else:
                page = t // stream.stride * stream.spec.entry.entry_bytes
                out[:n, stream.offset : stream.offset + page] = values.reshape(n, page)
        return out

    def take_done_saves(self) -> list[int]:
        """The ``save_seq`` of every step whose stores ended since the last call."""
        return self._stores.take_done()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every store handed over so far is done; ``False`` on timeout."""
        return self._stores.flush(timeout_s)

    def close(self) -> None:
        """Stop reading, finish the stores handed over; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._reader.shutdown(wait=True, cancel_futures=True)
        self._stores.close()
        self.tier.release_reads()
