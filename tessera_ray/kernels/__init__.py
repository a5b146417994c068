"""MLA decode over paged blocks: a PyTorch reference and FlashMLA / FlashInfer adapters.

- :func:`mla_decode`: the one entry point; checks inputs, picks FlashMLA, FlashInfer or the
  reference, and says which ran.
- :func:`mla_decode_reference`: float32 PyTorch decode, the contract every kernel is tested
  against (FlashMLA's ``flash_mla_with_kvcache``: ``(out, lse)``).
- :func:`merge_attention_states`: exact LSE merge of partials over disjoint pages.
- :func:`rope_shift`: re-rotates stored ``k_rope`` to a new position.
- ``fp8_ds_mla`` pages (656 B/token): :func:`quantize_fp8_ds_mla`,
  :func:`dequantize_fp8_ds_mla`, :func:`mla_decode_fp8_reference` (the reference is the only
  fp8 decode: FlashMLA's fp8 kernel is its sparse path, not wired here).
"""

from tessera_ray.kernels.adapter import (
    BACKENDS,
    DecodeResult,
    available_backends,
    mla_decode,
    select_backend,
)
from tessera_ray.kernels.fp8_ds_mla import (
    Fp8DsMlaLayout,
    dequantize_fp8_ds_mla,
    fp8_ds_mla_error_bound,
    fp8_ds_mla_layout,
    mla_decode_fp8_reference,
    quantize_fp8_ds_mla,
)
from tessera_ray.kernels.merge import mask_block_table, merge_attention_states
from tessera_ray.kernels.reference import DEFAULT_HEAD_DIM_V, mla_decode_reference
from tessera_ray.kernels.rope import DEFAULT_ROPE_BASE, apply_rope, rope_cos_sin, rope_shift

__all__ = [
    "mla_decode",
    "select_backend",
    "available_backends",
    "DecodeResult",
    "BACKENDS",
    "mla_decode_reference",
    "DEFAULT_HEAD_DIM_V",
    "merge_attention_states",
    "mask_block_table",
    "rope_shift",
    "apply_rope",
    "rope_cos_sin",
    "DEFAULT_ROPE_BASE",
    "Fp8DsMlaLayout",
    "fp8_ds_mla_layout",
    "quantize_fp8_ds_mla",
    "dequantize_fp8_ds_mla",
    "fp8_ds_mla_error_bound",
    "mla_decode_fp8_reference",
]
