"""Tiny Hugging Face checkpoints with random weights, for real vLLM engines in tests, the engine
demo and benchmarks: DeepSeek-V2 (MLA) and Qwen2 (grouped-query full attention), written locally
by ``transformers`` (nothing downloaded), and DeepSeek-V4 (sliding-window, CSA and HCA layers),
written here in DeepSeek's own checkpoint format; each with a small byte-level BPE tokenizer and
a chat template so that an OpenAI server can take text and chat prompts. Needs ``transformers``,
``tokenizers`` and ``safetensors`` (vLLM brings all three); no Ray.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = [
    "GQA_HEADS",
    "GQA_KV_HEADS",
    "HEADS",
    "TINY_V4_CONFIG",
    "TOKENIZER_WORDS",
    "main",
    "tier_geometry",
    "write_tiny_gqa",
    "write_tiny_mla",
    "write_tiny_v4",
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


# The smallest DeepSeek-V4 vLLM's CPU build runs: one layer of each kind (compress ratio 0: sliding
# window only; 4: CSA, compressed KV picked by the indexer; 128: HCA, all compressed KV). Head,
# rope and indexer sizes are the ones the CPU kernels are built for; 64 routed experts, 6 per
# token, is the smallest routing the CPU router takes. No ``quantization_config`` and no
# ``expert_dtype``: vLLM then builds no quantization method and every layer is plain bf16.
TINY_V4_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 1024,
    "hidden_size": 256,
    "num_hidden_layers": 3,
    "compress_ratios": [0, 4, 128],
    "num_attention_heads": 16,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 128,
    "o_lora_rank": 128,
    "o_groups": 2,
    "sliding_window": 128,
    "n_routed_experts": 64,
    "num_experts_per_tok": 6,
    "n_shared_experts": 1,
    "moe_intermediate_size": 256,
    "num_hash_layers": 1,
    "first_k_dense_replace": 0,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.0,
    "swiglu_limit": 10.0,
    "hidden_act": "silu",
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 512,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "max_position_embeddings": 8192,
    "num_nextn_predict_layers": 0,
    "tie_word_embeddings": False,
    # The tokenizer's <|endoftext|> (write_tokenizer trains its special tokens first).
    "bos_token_id": 0,
    "eos_token_id": 0,
    "torch_dtype": "bfloat16",
}


def write_tiny_v4(root: Path, seed: int = 0, max_positions: int | None = None) -> Path:
    """:data:`TINY_V4_CONFIG` as ``config.json`` and seeded random weights under the checkpoint
    names DeepSeek publishes (``layers.N.attn.wq_a.weight``, ``embed.weight``, ...), which
    vLLM's DeepSeek-V4 loader maps onto its own modules. bf16 except where the model keeps
    fp32 (hyper-connection mixes, attention sinks, compressor position biases, router bias).
    Drawn wider than a training init, as the other tiny models, so that the next-token
    distribution is sharp and a wrong KV entry moves logprobs visibly. ``max_positions``
    overrides the config's ``max_position_embeddings`` (a benchmark's longest prompt)."""
    import torch
    from safetensors.torch import save_file

    root.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    weights = _v4_weights(TINY_V4_CONFIG, gen)
    save_file(weights, str(root / "model.safetensors"), metadata={"format": "pt"})
    config = dict(TINY_V4_CONFIG)
    if max_positions is not None:
        config["max_position_embeddings"] = max_positions
        # YaRN's rotary table covers factor x original positions: stretch it to cover them all.
        rope = dict(config["rope_scaling"])
        rope["original_max_position_embeddings"] = max(
            rope["original_max_position_embeddings"], -(-max_positions // rope["factor"])
        )
        config["rope_scaling"] = rope
    (root / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return write_tokenizer(root, seed)


def _v4_weights(cfg: dict[str, Any], gen: torch.Generator) -> dict[str, torch.Tensor]:
    import torch

    def normal(*shape: int, std: float, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    def linear(out_features: int, in_features: int, gain: float = 1.5) -> torch.Tensor:
        # Outputs of unit-RMS inputs come out with RMS ``gain``: wider than a training init.
        return normal(out_features, in_features, std=gain / in_features**0.5)

    def ones(n: int, scale: float = 1.0) -> torch.Tensor:
        return torch.full((n,), scale, dtype=torch.bfloat16)

    hidden, vocab, heads = cfg["hidden_size"], cfg["vocab_size"], cfg["num_attention_heads"]
    head_dim = cfg["head_dim"]
    hc, experts, inter = cfg["hc_mult"], cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    mix = (2 + hc) * hc  # pre, post and the hc x hc combination of the hyper-connections
    w: dict[str, torch.Tensor] = {
        "embed.weight": normal(vocab, hidden, std=1.0),
        # A wide head: logits with an RMS of a few units, so greedy picks are clear.
        "head.weight": linear(vocab, hidden, gain=4.0),
        "norm.weight": ones(hidden),
        "hc_head_fn": normal(hc, hc * hidden, std=0.5 / (hc * hidden) ** 0.5, dtype=torch.float32),
        "hc_head_base": torch.zeros(hc),
        "hc_head_scale": torch.ones(1),
    }
    for i, ratio in enumerate(cfg["compress_ratios"]):
        p = f"layers.{i}."
        for part in ("attn", "ffn"):
            w[p + f"hc_{part}_fn"] = normal(
                mix, hc * hidden, std=0.5 / (hc * hidden) ** 0.5, dtype=torch.float32
            )
            w[p + f"hc_{part}_base"] = torch.zeros(mix)
            w[p + f"hc_{part}_scale"] = torch.ones(3)
        w[p + "attn_norm.weight"] = ones(hidden)
        w[p + "ffn_norm.weight"] = ones(hidden)
        a = p + "attn."
        w[a + "attn_sink"] = normal(heads, std=1.0, dtype=torch.float32)
        w[a + "wq_a.weight"] = linear(cfg["q_lora_rank"], hidden)
        w[a + "wkv.weight"] = linear(head_dim, hidden)
        w[a + "q_norm.weight"] = ones(cfg["q_lora_rank"])
        # Keys are the cached latents; a wide norm sharpens attention over them.
        w[a + "kv_norm.weight"] = ones(head_dim, 2.0)
        w[a + "wq_b.weight"] = linear(heads * head_dim, cfg["q_lora_rank"])
        w[a + "wo_a.weight"] = linear(
            cfg["o_groups"] * cfg["o_lora_rank"], heads * head_dim // cfg["o_groups"]
        )
        w[a + "wo_b.weight"] = linear(hidden, cfg["o_groups"] * cfg["o_lora_rank"])
        if ratio > 1:
            w.update(_v4_compressor(a + "compressor.", ratio, head_dim, hidden, normal, linear))
        if ratio == 4:
            x = a + "indexer."
            index_heads, index_dim = cfg["index_n_heads"], cfg["index_head_dim"]
            w[x + "wq_b.weight"] = linear(index_heads * index_dim, cfg["q_lora_rank"])
            w[x + "weights_proj.weight"] = linear(index_heads, hidden)
            w.update(_v4_compressor(x + "compressor.", ratio, index_dim, hidden, normal, linear))
        f = p + "ffn."
        w[f + "gate.weight"] = linear(experts, hidden)
        if i < cfg["num_hash_layers"]:
            # Hash-routed layer: each token id picks its experts from this table.
            table = torch.stack(
                [torch.randperm(experts, generator=gen)[: cfg["num_experts_per_tok"]]
                 for _ in range(vocab)]
            )  # fmt: skip
            w[f + "gate.tid2eid"] = table.to(torch.int32)
        else:
            w[f + "gate.bias"] = torch.zeros(experts)
        for name, shape in (
            ("w1", (inter, hidden)),
            ("w3", (inter, hidden)),
            ("w2", (hidden, inter)),
        ):
            w[f + f"shared_experts.{name}.weight"] = linear(*shape)
            for e in range(experts):
                w[f + f"experts.{e}.{name}.weight"] = linear(*shape)
    return w


def _v4_compressor(
    prefix: str, ratio: int, head_dim: int, hidden: int, normal: Any, linear: Any
) -> dict[str, torch.Tensor]:
    """One compressor: key/value and gate projections, per-position biases, the output norm.
    Ratio-4 compressors overlap two windows, so their projections are twice as wide."""
    import torch

    width = (2 if ratio == 4 else 1) * head_dim
    return {
        prefix + "wkv.weight": linear(width, hidden),
        prefix + "wgate.weight": linear(width, hidden),
        prefix + "ape": normal(ratio, width, std=0.5, dtype=torch.float32),
        prefix + "norm.weight": torch.ones(head_dim, dtype=torch.bfloat16),
    }


def tier_geometry(name: str, num_layers: int, **more: Any) -> dict[str, Any]:
    """The ``tessera-ray start --config`` geometry of a tiny model's cache."""
    return {"family": "mla", "name": name, "num_layers": num_layers, "num_heads": HEADS, **more}


def main(argv: list[str] | None = None) -> int:
    """``python -m tessera_ray.models.hf_tiny {mla,gqa,v4} DIR [--layers N]``: write one model
    (``v4`` has its fixed three layers)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tessera_ray.models.hf_tiny")
    parser.add_argument("kind", choices=("mla", "gqa", "v4"))
    parser.add_argument("dir", type=Path)
    parser.add_argument("--layers", type=int, default=4)
    ns = parser.parse_args(argv)
    if ns.kind == "v4":
        print(write_tiny_v4(ns.dir))
    else:
        write = write_tiny_mla if ns.kind == "mla" else write_tiny_gqa
        print(write(ns.dir, ns.layers))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
