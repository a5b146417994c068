"""Chunked causal prefill of the tiny MLA model: what recomputing blocks costs.

``TinyMLA.prefill`` runs one dense pass from position 0 and materialises ``T x T`` scores per
head, which at 32K tokens is tens of GB. An engine that misses the cache computes the prompt in
chunks, each attending over the context before it; this does the same with the model's own
weights and per-layer halves (``TinyMLA.layer_inputs`` / ``layer_output``, in the
non-absorbed form ``TinyMLA.prefill`` uses), keeping every layer's
latents (what the tier stores) and the per-head keys and values expanded from them (so a chunk
never re-expands the context: the cheapest recompute, which makes the comparison with a fetch
generous to recompute). :meth:`ChunkedPrefill.check` pins it to ``TinyMLA.prefill``.
"""

from __future__ import annotations

import torch

from tessera_ray.models import TinyMLA

__all__ = ["ChunkedPrefill"]


class ChunkedPrefill:
    """One sequence of up to ``max_tokens``; :meth:`extend` appends a chunk of tokens."""

    def __init__(self, model: TinyMLA, max_tokens: int) -> None:
        c = model.config
        self.model, self.length = model, 0
        layers = range(c.num_layers)
        self.latent = [torch.empty(max_tokens, c.head_dim) for _ in layers]  # c_kv | k_rope
        # Per head: [k_nope | k_rope] (q . k is then one matmul) and v, heads first so that a
        # prefix of the cache is a view the matmul takes as is.
        width = c.qk_nope_head_dim + c.qk_rope_head_dim
        self.key = [torch.empty(c.num_heads, max_tokens, width) for _ in layers]
        self.value = [torch.empty(c.num_heads, max_tokens, c.v_head_dim) for _ in layers]

    def truncate(self, length: int) -> None:
        """Forget every position from ``length`` on (to recompute them)."""
        self.length = min(self.length, length)

    @torch.inference_mode()
    def extend(self, tokens: torch.Tensor, *, kv_only: bool = False) -> None:
        """Append ``tokens``. ``kv_only``: skip what only the logits need (the last layer's
        attention and MLP), as a pass that only fills the cache may."""
        m, c = self.model, self.model.config
        start, n = self.length, tokens.numel()
        end = start + n
        pos = torch.arange(start, end)
        # Inside the chunk, query s sees keys up to itself; every earlier key is visible.
        hidden_in_chunk = torch.ones(n, n, dtype=torch.bool).triu(1)
        h = m.embed[tokens]
        for i, layer in enumerate(m.layers):
            # The model's own per-token halves; only the attention over the cache is done here.
            q_nope, q_rope, kv = m.layer_inputs(i, h, pos)
            self.latent[i][start:end] = torch.cat([kv.c_kv, kv.k_rope], dim=-1)
            key, value = self.key[i], self.value[i]
            key[:, start:end, : c.qk_nope_head_dim] = torch.einsum(
                "tc,hnc->htn", kv.c_kv, layer.w_uk
            )
            key[:, start:end, c.qk_nope_head_dim :] = kv.k_rope
            value[:, start:end] = torch.einsum("tc,hvc->htv", kv.c_kv, layer.w_uv)
            if kv_only and i == len(m.layers) - 1:
                break
            q = torch.cat([q_nope, q_rope], dim=-1).transpose(0, 1) * c.softmax_scale
            scores = torch.bmm(q, key[:, :end].transpose(1, 2))  # [heads, n, end]
            scores[:, :, start:end].masked_fill_(hidden_in_chunk, float("-inf"))
            attn = torch.bmm(scores.softmax(dim=-1), value[:, :end])  # [heads, n, v]
            h = m.layer_output(i, h, attn.transpose(0, 1).reshape(n, -1))
        self.length = end

    def payloads(self, block_tokens: int, first: int = 0) -> torch.Tensor:
        """uint8 ``[blocks, block_bytes]``: each full block's bf16 page per layer, in layer
        order (the demo engine's block payload), from block ``first`` on."""
        begin, end = first * block_tokens, self.length // block_tokens * block_tokens
        page_bytes = block_tokens * self.model.config.head_dim * torch.bfloat16.itemsize
        per_layer = [
            lat[begin:end].to(torch.bfloat16).view(torch.uint8).reshape(-1, page_bytes)
            for lat in self.latent
        ]
        return torch.cat(per_layer, dim=1)

    @staticmethod
    def check(model: TinyMLA, tokens: torch.Tensor, chunk: int) -> None:
        """Chunked latents equal the dense prefill's (float tolerance): raises otherwise."""
        chunked = ChunkedPrefill(model, tokens.numel())
        for at in range(0, tokens.numel(), chunk):
            chunked.extend(tokens[at : at + chunk])
        dense = model.prefill(tokens).kv
        for i, kv in enumerate(dense):
            want = torch.cat([kv.c_kv, kv.k_rope], dim=-1)
            torch.testing.assert_close(chunked.latent[i][: tokens.numel()], want)
