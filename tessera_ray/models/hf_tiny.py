"""Tiny Hugging Face checkpoints with random weights, for real vLLM engines in tests, the engine
demo and benchmarks: DeepSeek-V2 (MLA) and Qwen2 (grouped-query full attention), written locally
by ``transformers`` (nothing downloaded), each with a small byte-level BPE tokenizer and a chat
template so that an OpenAI server can take text and chat prompts. Needs ``transformers`` and
``tokenizers`` (vLLM brings both); no Ray.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

__all__ = [
    "GQA_HEADS",
    "GQA_KV_HEADS",
    "HEADS",
    "TOKENIZER_WORDS",
    "main",
    "tier_geometry",
    "write_tiny_gqa",
    "write_tiny_mla",
    "write_tokenizer",
]

HEADS = 4
# Words the tokenizer is trained on: prompts made of them tokenize to a few ids per word.
TOKENIZER_WORDS = tuple(f"w{i}" for i in range(600))
_VOCAB = 1000  # below both models' 1024 rows, so every id the tokenizer makes is a real row
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tokenizer(root: Path, seed: int = 0) -> Path:
    """A byte-level BPE tokenizer trained here on :data:`TOKENIZER_WORDS`, with a chat template,
    saved beside a model's weights. Byte-level, so any text tokenizes; whichever tokenizer class
    ``transformers`` maps the model type to rebuilds it from the same vocabulary and merges."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    corpus = [" ".join(rng.choices(TOKENIZER_WORDS, k=50)) for _ in range(2000)]
    bpe = ByteLevelBPETokenizer()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe.train_from_iterator(corpus, vocab_size=_VOCAB, min_frequency=1, special_tokens=special)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer, eos_token=special[0], pad_token=special[0]
    )
    fast.chat_template = _CHAT_TEMPLATE
    fast.save_pretrained(root)
    return root


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
    return write_tokenizer(root, seed)


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
    return write_tokenizer(root, seed)


def tier_geometry(name: str, num_layers: int, **more: Any) -> dict[str, Any]:
    """The ``tessera-ray start --config`` geometry of a tiny model's cache."""
    return {"family": "mla", "name": name, "num_layers": num_layers, "num_heads": HEADS, **more}


def main(argv: list[str] | None = None) -> int:
    """``python -m tessera_ray.models.hf_tiny {mla,gqa} DIR [--layers N]``: write one model."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tessera_ray.models.hf_tiny")
    parser.add_argument("kind", choices=("mla", "gqa"))
    parser.add_argument("dir", type=Path)
    parser.add_argument("--layers", type=int, default=4)
    ns = parser.parse_args(argv)
    write = write_tiny_mla if ns.kind == "mla" else write_tiny_gqa
    print(write(ns.dir, ns.layers))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
