"""Models that produce real MLA KV for tests, the demo and benchmarks (no Ray, no pool)."""

from tessera_ray.models.tiny_mla import (
    LayerKV,
    PrefillResult,
    TinyMLA,
    TinyMLAConfig,
    write_layer_kv,
)

__all__ = ["TinyMLA", "TinyMLAConfig", "LayerKV", "PrefillResult", "write_layer_kv"]
