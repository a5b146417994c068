"""The demo's inference engine: the tiny MLA model, its KV as tier block payloads, and decode.

A block payload is what a pool stores for one 64-token block: each layer's bf16 FlashMLA page
of the block, in layer order (the layout's single MLA group). No Ray here.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tessera_ray.core import token_key
from tessera_ray.core.results import TokenKey
from tessera_ray.layout import MLAConfig, ModelLayout, build_layout
from tessera_ray.models import LayerKV, TinyMLA, TinyMLAConfig
from tessera_ray.models.tiny_mla import write_layer_kv

__all__ = ["Engine"]

_PAGE_DTYPE = torch.bfloat16


class Engine:
    """Prefill, block payloads and one decode step of the tiny model.

    Every prefill runs over ``padded_tokens`` positions (the prompt, then zeros). Why: float
    results of a matmul or a softmax row can change in the last bit with the number of rows, so
    a prefix computed inside a longer prompt would not be byte-identical to the same prefix
    inside a shorter one; at one fixed length, causal attention makes position ``p`` depend only
    on tokens ``<= p``, bit for bit. Equal prefixes then give equal pages, which is what lets
    the tier share them byte-verified, and what the parity check relies on.
    """

    def __init__(self, padded_blocks: int, *, model: TinyMLAConfig | None = None) -> None:
        self.model = TinyMLA(model or TinyMLAConfig())
        c = self.model.config
        self.layout: ModelLayout = build_layout(
            MLAConfig(
                name="tiny-mla",
                num_layers=c.num_layers,
                num_heads=c.num_heads,
                kv_lora_rank=c.kv_lora_rank,
                qk_rope_head_dim=c.qk_rope_head_dim,
                qk_nope_head_dim=c.qk_nope_head_dim,
                v_head_dim=c.v_head_dim,
            )
        )
        self.block_tokens = self.layout.block_tokens
        self.padded_tokens = padded_blocks * self.block_tokens
        self._layer_bytes = self.block_tokens * c.head_dim * _PAGE_DTYPE.itemsize

    @property
    def block_bytes(self) -> int:
        return self.layout.block_bytes

    def keys(self, namespace: str, tokens: torch.Tensor) -> list[TokenKey]:
        """Chained token keys of the prompt's full blocks."""
        out: list[TokenKey] = []
        parent: TokenKey | None = None
        for b in range(tokens.numel() // self.block_tokens):
            block = tokens[b * self.block_tokens : (b + 1) * self.block_tokens].tolist()
            parent = token_key(namespace, self.layout.fingerprint, parent, block)
            out.append(parent)
        return out

    def prefill(self, tokens: torch.Tensor) -> list[torch.Tensor]:
        """A real forward pass over the prompt; the KV of its full blocks in bf16 pages (page
        ``b`` holds block ``b``), plus one empty page for the next decoded token."""
        if tokens.numel() > self.padded_tokens:
            raise ValueError(f"prompt of {tokens.numel()} tokens exceeds {self.padded_tokens}")
        full = tokens.numel() // self.block_tokens
        padded = torch.zeros(self.padded_tokens, dtype=torch.long)
        padded[: tokens.numel()] = tokens
        kv = self.model.prefill(padded).kv
        pages = self.model.new_pages(full + 1, self.block_tokens, dtype=_PAGE_DTYPE)
        row = torch.arange(full + 1, dtype=torch.int32)
        n = full * self.block_tokens
        for layer_kv, layer_pages in zip(kv, pages, strict=True):
            write_layer_kv(layer_pages, row, LayerKV(layer_kv.c_kv[:n], layer_kv.k_rope[:n]))
        return pages

    def payloads(self, pages: Sequence[torch.Tensor], blocks: Sequence[int]) -> np.ndarray:
        """uint8 ``[len(blocks), block_bytes]``: the tier's payload of each listed block."""
        rows = [torch.cat([p[b].reshape(-1).view(torch.uint8) for p in pages]) for b in blocks]
        if not rows:
            return np.zeros((0, self.block_bytes), dtype=np.uint8)
        return torch.stack(rows).numpy()

    def pages_from(self, rows: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """Pages rebuilt from block payloads read back from the tier (plus one empty page)."""
        pages = self.model.new_pages(len(rows) + 1, self.block_tokens, dtype=_PAGE_DTYPE)
        for b, row in enumerate(rows):
            data = torch.from_numpy(np.array(row))  # a writable copy: Ray hands out read-only
            for layer, p in enumerate(pages):
                chunk = data[layer * self._layer_bytes : (layer + 1) * self._layer_bytes]
                p[b].reshape(-1).view(torch.uint8).copy_(chunk)
        return pages

    def decode(self, pages: list[torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
        """Logits of decoding the first token after the prompt's full blocks, attending over
        ``pages`` (which it writes that token's KV into)."""
        full = len(pages) - 1
        at = full * self.block_tokens
        nxt = tokens[at : at + 1] if tokens.numel() > at else torch.zeros(1, dtype=torch.long)
        table = torch.arange(full + 1, dtype=torch.int32)[None]
        return self.model.decode_step(nxt, torch.tensor([at]), pages, table)
