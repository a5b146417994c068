"""A small MLA transformer with seeded random weights: the real producer of KV for tests, the
demo and the benchmarks.

It computes attention the way DeepSeek-V2/V3 do (docs/mla-math.md): per layer and token
it stores ``c_kv = RMSNorm(W_DKV h)`` (``kv_lora_rank`` values) and ``k_rope = RoPE(W_KR h, pos)``
(``qk_rope_head_dim`` values) and nothing else. Prefill runs the dense, non-absorbed form (keys
and values expanded per head through ``W_UK`` / ``W_UV``); decode runs the absorbed form over
pages through :func:`tessera_ray.kernels.mla_decode`. The two agreeing is a test of both.

Pages belong to the caller: one tensor per layer in FlashMLA layout
``[num_pages, page_tokens, 1, kv_lora_rank + rope_dim]`` plus an int32 block table, so the pool
can later hand the model views of its own memory. Compute is float32; pages may be bf16 (KV is
rounded once, when written). Weights depend only on the config (seed included), so two processes
build the same model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tessera_ray.errors import KernelError, LayoutError
from tessera_ray.kernels import mla_decode
from tessera_ray.kernels.adapter import Backend
from tessera_ray.kernels.rope import apply_rope

__all__ = ["TinyMLAConfig", "LayerKV", "PrefillResult", "TinyMLA", "write_layer_kv"]


@dataclass(frozen=True, kw_only=True)
class TinyMLAConfig:
    """Geometry of the tiny model. The latent and RoPE widths default to DeepSeek's (512 + 64),
    so its pages are real FlashMLA / fp8_ds_mla pages; the rest is scaled down."""

    vocab_size: int = 256
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 32
    v_head_dim: int = 32
    intermediate_size: int = 256
    rope_base: float = 10000.0
    rms_eps: float = 1e-6
    seed: int = 0
    """Seeds every weight; the same config always gives the same model."""

    def __post_init__(self) -> None:
        for name in (
            "vocab_size", "hidden_size", "num_layers", "num_heads", "kv_lora_rank",
            "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "intermediate_size",
        ):  # fmt: skip
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise LayoutError(f"TinyMLAConfig.{name} must be a positive integer, got {value!r}")
        if self.qk_rope_head_dim % 2:
            raise LayoutError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")

    @property
    def head_dim(self) -> int:
        """Stored values per token per layer: the FlashMLA key width (576 by default)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """``1/sqrt(qk_nope_head_dim + qk_rope_head_dim)``: the scale of the non-absorbed score,
        which absorption leaves unchanged."""
        return float((self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5)


@dataclass(frozen=True)
class LayerKV:
    """What one layer stores for a run of tokens: ``c_kv [T, kv_lora_rank]`` and ``k_rope
    [T, rope_dim]`` (already rotated to each token's position), float32."""

    c_kv: torch.Tensor
    k_rope: torch.Tensor


@dataclass(frozen=True)
class PrefillResult:
    """``logits [T, vocab]`` for every prompt position and each layer's :class:`LayerKV`."""

    logits: torch.Tensor
    kv: tuple[LayerKV, ...]


@dataclass
class _Layer:
    attn_norm: torch.Tensor  # [hidden]
    w_q: torch.Tensor  # [heads * (nope + rope), hidden]
    w_dkv: torch.Tensor  # [kv_lora_rank + rope, hidden]: W_DKV and W_KR in one matrix
    kv_norm: torch.Tensor  # [kv_lora_rank]
    w_uk: torch.Tensor  # [heads, nope, kv_lora_rank]
    w_uv: torch.Tensor  # [heads, v_dim, kv_lora_rank]
    w_o: torch.Tensor  # [hidden, heads * v_dim]
    mlp_norm: torch.Tensor  # [hidden]
    w_gate: torch.Tensor  # [inter, hidden]
    w_up: torch.Tensor  # [inter, hidden]
    w_down: torch.Tensor  # [hidden, inter]


def write_layer_kv(
    pages: torch.Tensor, block_table_row: torch.Tensor, kv: LayerKV, start: int = 0
) -> None:
    """Store ``kv`` for positions ``start .. start + T - 1`` of one sequence into ``pages``
    (``[num_pages, page_tokens, 1, head_dim]``), at the slots ``block_table_row`` names.
    Values are cast to the pages' dtype."""
    count = kv.c_kv.shape[0]
    if count == 0:
        return
    page = pages.shape[1]
    positions = torch.arange(start, start + count, device=block_table_row.device)
    needed = -(-(start + count) // page)
    if needed > block_table_row.shape[0] or bool((block_table_row[:needed] < 0).any()):
        raise KernelError(
            f"block table row has {block_table_row.shape[0]} entries; positions up to "
            f"{start + count - 1} need {needed} held pages"
        )
    ids = block_table_row.long()[positions // page].to(pages.device)
    offsets = (positions % page).to(pages.device)
    entry = torch.cat([kv.c_kv, kv.k_rope], dim=-1).to(device=pages.device, dtype=pages.dtype)
    pages[ids, offsets, 0] = entry


class TinyMLA:
    """The model. ``prefill`` and ``forward_dense`` take one sequence; ``decode_step`` a batch."""

    def __init__(self, config: TinyMLAConfig | None = None, *, device: str | torch.device = "cpu"):
        self.config = config or TinyMLAConfig()
        c = self.config
        gen = torch.Generator().manual_seed(c.seed)

        def linear(rows: int, cols: int) -> torch.Tensor:
            return torch.randn(rows, cols, generator=gen) / math.sqrt(cols)

        def norm(size: int) -> torch.Tensor:
            return 1.0 + 0.1 * torch.randn(size, generator=gen)

        self.embed = torch.randn(c.vocab_size, c.hidden_size, generator=gen)
        self.layers: list[_Layer] = []
        for _ in range(c.num_layers):
            self.layers.append(
                _Layer(
                    attn_norm=norm(c.hidden_size),
                    w_q=linear(
                        c.num_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim), c.hidden_size
                    ),
                    w_dkv=linear(c.head_dim, c.hidden_size),
                    kv_norm=norm(c.kv_lora_rank),
                    w_uk=linear(c.num_heads * c.qk_nope_head_dim, c.kv_lora_rank).view(
                        c.num_heads, c.qk_nope_head_dim, c.kv_lora_rank
                    ),
                    w_uv=linear(c.num_heads * c.v_head_dim, c.kv_lora_rank).view(
                        c.num_heads, c.v_head_dim, c.kv_lora_rank
                    ),
                    w_o=linear(c.hidden_size, c.num_heads * c.v_head_dim),
                    mlp_norm=norm(c.hidden_size),
                    w_gate=linear(c.intermediate_size, c.hidden_size),
                    w_up=linear(c.intermediate_size, c.hidden_size),
                    w_down=linear(c.hidden_size, c.intermediate_size),
                )
            )
        self.final_norm = norm(c.hidden_size)
        self.device = torch.device(device)
        self._to(self.device)

    def _to(self, device: torch.device) -> None:
        self.embed = self.embed.to(device)
        self.final_norm = self.final_norm.to(device)
        for layer in self.layers:
            for name, value in vars(layer).items():
                setattr(layer, name, value.to(device))

    # -- pieces shared by prefill and decode ------------------------------------------------

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.config.rms_eps) * weight

    def _queries(
        self, layer: _Layer, x: torch.Tensor, pos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        q = (x @ layer.w_q.T).view(-1, c.num_heads, c.qk_nope_head_dim + c.qk_rope_head_dim)
        q_nope, q_rope = q[..., : c.qk_nope_head_dim], q[..., c.qk_nope_head_dim :]
        return q_nope, apply_rope(q_rope, pos.unsqueeze(-1), base=c.rope_base)

    def _latents(self, layer: _Layer, x: torch.Tensor, pos: torch.Tensor) -> LayerKV:
        c = self.config
        kv = x @ layer.w_dkv.T
        c_kv = self._rms(kv[:, : c.kv_lora_rank], layer.kv_norm)
        k_rope = apply_rope(kv[:, c.kv_lora_rank :], pos, base=c.rope_base)
        return LayerKV(c_kv=c_kv, k_rope=k_rope)

    def _mlp(self, layer: _Layer, h: torch.Tensor) -> torch.Tensor:
        y = self._rms(h, layer.mlp_norm)
        return (
            h + (torch.nn.functional.silu(y @ layer.w_gate.T) * (y @ layer.w_up.T)) @ layer.w_down.T
        )

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self._rms(h, self.final_norm) @ self.embed.T

    def _tokens(self, tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
        ids = torch.as_tensor(tokens, dtype=torch.long, device=self.device).reshape(-1)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size):
            raise KernelError(f"token ids must be in [0, {self.config.vocab_size})")
        return ids

    # -- one layer, in two halves around attention (prefill, decode and chunked prefills) ---

    def layer_inputs(
        self, index: int, h: torch.Tensor, pos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, LayerKV]:
        """Layer ``index``'s attention inputs for hidden states ``h`` ``[T, hidden]`` at
        positions ``pos`` ``[T]``: ``q_nope`` ``[T, heads, qk_nope_head_dim]``, ``q_rope``
        ``[T, heads, qk_rope_head_dim]`` (rotated), and the KV the layer stores (a pool's
        bytes: the latent and the rotated RoPE key)."""
        layer = self.layers[index]
        x = self._rms(h, layer.attn_norm)
        q_nope, q_rope = self._queries(layer, x, pos)
        return q_nope, q_rope, self._latents(layer, x, pos)

    def layer_output(self, index: int, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Hidden states after layer ``index``, given its attention output ``attn``
        ``[T, heads * v_head_dim]``: output projection, residual, MLP."""
        layer = self.layers[index]
        return self._mlp(layer, h + attn @ layer.w_o.T)

    # -- public API ---------------------------------------------------------------------------

    def prefill(self, tokens: Sequence[int] | torch.Tensor) -> PrefillResult:
        """Dense, non-absorbed causal forward over one prompt from position 0; returns the
        logits and every layer's KV (the bytes a pool stores)."""
        c = self.config
        ids = self._tokens(tokens)
        pos = torch.arange(ids.numel(), device=self.device)
        h = self.embed[ids]
        kvs = []
        causal = torch.ones(ids.numel(), ids.numel(), dtype=torch.bool, device=self.device).tril()
        for i, layer in enumerate(self.layers):
            q_nope, q_rope, kv = self.layer_inputs(i, h, pos)
            kvs.append(kv)
            k_nope = torch.einsum("tc,hnc->thn", kv.c_kv, layer.w_uk)
            v = torch.einsum("tc,hvc->thv", kv.c_kv, layer.w_uv)
            scores = torch.einsum("shn,thn->hst", q_nope, k_nope)
            scores = (scores + torch.einsum("shr,tr->hst", q_rope, kv.k_rope)) * c.softmax_scale
            probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
            attn = torch.einsum("hst,thv->shv", probs, v).reshape(ids.numel(), -1)
            h = self.layer_output(i, h, attn)
        return PrefillResult(logits=self._logits(h), kv=tuple(kvs))

    def forward_dense(self, tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Logits ``[T, vocab]`` of the plain dense forward: the ground truth decode must match."""
        return self.prefill(tokens).logits

    def new_pages(
        self, num_pages: int, page_tokens: int = 64, *, dtype: torch.dtype = torch.float32
    ) -> list[torch.Tensor]:
        """Zeroed pages, one ``[num_pages, page_tokens, 1, head_dim]`` tensor per layer (a
        stand-in for the pool's memory)."""
        shape = (num_pages, page_tokens, 1, self.config.head_dim)
        return [torch.zeros(shape, dtype=dtype, device=self.device) for _ in self.layers]

    def write_prefill(
        self, kv: Sequence[LayerKV], pages: Sequence[torch.Tensor], block_table_row: torch.Tensor
    ) -> None:
        """Store a prefill's KV (positions from 0) into per-layer ``pages`` via one table row."""
        if len(kv) != len(self.layers) or len(pages) != len(self.layers):
            raise KernelError(f"need KV and pages for all {len(self.layers)} layers")
        for layer_kv, layer_pages in zip(kv, pages, strict=True):
            write_layer_kv(layer_pages, block_table_row, layer_kv)

    def decode_step(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        pages: Sequence[torch.Tensor],
        block_table: torch.Tensor,
        *,
        backend: Backend | str = "auto",
    ) -> torch.Tensor:
        """One decode step for a batch: token ``tokens[b]`` sits at ``positions[b]`` of sequence
        ``b`` (whose earlier KV is in ``pages`` via ``block_table[b]``). Writes the new token's
        KV into the pages, attends through :func:`~tessera_ray.kernels.mla_decode`, and returns
        logits ``[batch, vocab]`` float32.
        """
        c = self.config
        if len(pages) != len(self.layers):
            raise KernelError(f"need pages for all {len(self.layers)} layers, got {len(pages)}")
        ids = self._tokens(tokens)
        pos = torch.as_tensor(positions, dtype=torch.long, device=self.device).reshape(-1)
        if pos.shape != ids.shape:
            raise KernelError("tokens and positions must have one entry per sequence")
        seqlens = (pos + 1).to(torch.int32)
        h = self.embed[ids]
        for i, (layer, layer_pages) in enumerate(zip(self.layers, pages, strict=True)):
            q_nope, q_rope, kv = self.layer_inputs(i, h, pos)  # [B, heads, nope], [B, heads, rope]
            for b in range(ids.numel()):
                row_kv = LayerKV(c_kv=kv.c_kv[b : b + 1], k_rope=kv.k_rope[b : b + 1])
                write_layer_kv(layer_pages, block_table[b], row_kv, start=int(pos[b]))
            q_lat = torch.einsum("bhn,hnc->bhc", q_nope, layer.w_uk)  # absorb W_UK into q
            q = torch.cat([q_lat, q_rope], dim=-1).unsqueeze(1)  # [B, 1, heads, head_dim]
            if layer_pages.is_cuda and layer_pages.dtype != torch.float32:
                q = q.to(layer_pages.dtype)  # GPU kernels take q in the pages' dtype
            result = mla_decode(
                q,
                layer_pages,
                block_table,
                seqlens,
                c.softmax_scale,
                True,
                head_dim_v=c.kv_lora_rank,
                backend=backend,  # type: ignore[arg-type]
            )
            o = torch.einsum("bhc,hvc->bhv", result.out[:, 0].float(), layer.w_uv)
            h = self.layer_output(i, h, o.reshape(ids.numel(), -1))
        return self._logits(h)
