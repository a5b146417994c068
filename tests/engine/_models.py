"""Tiny models with random weights, written at test time by ``transformers`` (nothing
downloaded): DeepSeek-V2 (MLA) and Qwen2 (grouped-query full attention), and the tier geometry
that matches the MLA one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

HEADS = 4


def write_tiny_mla(root: Path, num_layers: int, seed: int = 0, max_positions: int = 8192) -> Path:
    """A ``num_layers``-layer DeepSeek-V2 with MLA (kv_lora_rank 512 + rope 64, no q_lora), no
    MoE layers. Weights are drawn wider than the usual init so that the next-token distribution
    is sharp: a wrong KV row then moves logprobs visibly instead of hiding in a flat one."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    torch.manual_seed(seed)
    config = DeepseekV2Config(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=num_layers,
        max_position_embeddings=max_positions,
        rope_theta=10000.0,
        initializer_range=0.15,
        torch_dtype="bfloat16",
    )
    DeepseekV2ForCausalLM(config).to(torch.bfloat16).save_pretrained(root)
    return root


GQA_HEADS, GQA_KV_HEADS = 8, 2


def write_tiny_gqa(root: Path, num_layers: int, seed: int = 0, max_positions: int = 8192) -> Path:
    """A ``num_layers``-layer Qwen2: 8 query heads over 2 KV heads of 32 values, bf16, no
    sliding window; weights drawn wide, as the MLA model's."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=num_layers,
        num_attention_heads=GQA_HEADS,
        num_key_value_heads=GQA_KV_HEADS,
        max_position_embeddings=max_positions,
        rope_theta=10000.0,
        initializer_range=0.15,
        use_sliding_window=False,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(root)
    return root


def tier_geometry(name: str, num_layers: int, **more: Any) -> dict[str, Any]:
    """The ``tessera-ray start --config`` geometry of a tiny model's cache."""
    return {"family": "mla", "name": name, "num_layers": num_layers, "num_heads": HEADS, **more}
