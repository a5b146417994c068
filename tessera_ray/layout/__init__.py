"""The KV format as data: dtypes, regions, page specs, per-layer scheme maps, presets, bytes.

Pure Python: imports neither Ray nor torch, so schedulers and planners can use it (a test pins
this). Everything else in tessera-ray sizes its memory from here.
"""

from tessera_ray.layout.accounting import ContextUsage, SpecUsage, account
from tessera_ray.layout.dtypes import DType
from tessera_ray.layout.engine_pages import ENGINE_FORMATS, EngineCache, EnginePages, engine_pages
from tessera_ray.layout.formats import FORMATS, Family, FormatInfo, format_info
from tessera_ray.layout.hf import HF_ARCHITECTURES, config_from_hf
from tessera_ray.layout.models import (
    DEFAULT_FORMATS,
    PRESETS,
    FullAttentionConfig,
    HybridV4Config,
    MLAConfig,
    ModelConfig,
    build_layout,
    config_from_dict,
    preset,
    preset_layout,
)
from tessera_ray.layout.spec import (
    CacheSpec,
    EntryFormat,
    LayerGroup,
    ModelLayout,
    PageSpec,
    Region,
    Scheme,
)
from tessera_ray.layout.units import format_bytes, format_context, parse_context, parse_contexts

__all__ = [
    "DType",
    "Region",
    "EntryFormat",
    "Scheme",
    "CacheSpec",
    "PageSpec",
    "LayerGroup",
    "ModelLayout",
    "Family",
    "FormatInfo",
    "FORMATS",
    "format_info",
    "FullAttentionConfig",
    "MLAConfig",
    "HybridV4Config",
    "ModelConfig",
    "PRESETS",
    "DEFAULT_FORMATS",
    "build_layout",
    "preset",
    "preset_layout",
    "config_from_dict",
    "config_from_hf",
    "HF_ARCHITECTURES",
    "EngineCache",
    "EnginePages",
    "ENGINE_FORMATS",
    "engine_pages",
    "ContextUsage",
    "SpecUsage",
    "account",
    "parse_context",
    "parse_contexts",
    "format_bytes",
    "format_context",
]
