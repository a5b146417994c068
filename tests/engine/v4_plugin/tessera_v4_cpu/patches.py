"""What the plugin changes in vLLM 0.32.0's CPU build, at run time, once its DeepSeek-V4 CPU
model is imported (no vLLM file is edited):

0. on a CPU whose vLLM library lacks the V4 C++ kernels (they are built for AVX512-BF16 only),
   their torch stand-ins of :mod:`tessera_v4_cpu.kernels` are registered under vLLM's op names;
1. the Triton metadata kernels of the V4 path become the torch stand-ins of
   :mod:`tessera_v4_cpu.metadata`, everywhere vLLM holds them: module-level kernel objects and
   the token-to-request function are imported by name into other modules, so every module
   attribute that is one of the originals is rebound, not only the defining one;
2. the CPU SWA metadata builder's ``build_tile_scheduler`` returns an entry for every layer
   type: vLLM's returns ``swaonly``/``c4a``/``c128a`` only and ``sparse_swa.py`` then reads
   ``c1a`` (``KeyError: 'c1a'``). The CPU never plans FlashMLA tiles, so every entry is None.

vLLM 0.32.0 imports its V4 CPU model module in every CPU worker, whatever the model (its model
runner imports ``vllm.models.deepseek_v4`` for an EPLB helper, and that package imports the
platform's model), so importing it proves nothing: :func:`arm` makes the construction of the
first V4 attention layer apply the changes, which only a V4 model does.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from tessera_v4_cpu import kernels, metadata

__all__ = ["TRIGGER_MODULE", "apply", "arm", "replacements"]

# The module of vLLM's CPU V4 attention layer. Once it is imported, every module holding a
# kernel below has been too (it imports the metadata builders).
TRIGGER_MODULE = "vllm.models.deepseek_v4.cpu.cpu_sparse"
_ARMED = "_tessera_v4_cpu_armed"

_METADATA = "vllm.v1.attention.ops.metadata"
_SPARSE_SWA = "vllm.v1.attention.backends.mla.sparse_swa"
_COMPRESSOR = "vllm.v1.attention.backends.mla.compressor_utils"
_INDEXER = "vllm.v1.attention.backends.mla.indexer"
_CPU_MLA = "vllm.models.deepseek_v4.cpu.cpu_mla"

_applied = False


def arm() -> None:
    """Make the first construction of vLLM's CPU V4 attention layer :func:`apply` the changes
    (needs :data:`TRIGGER_MODULE` imported; once per process)."""
    attention = sys.modules[TRIGGER_MODULE].DeepseekV4CPUAttention
    if getattr(attention.__init__, _ARMED, False):
        return
    original = attention.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        apply()
        original(self, *args, **kwargs)

    setattr(__init__, _ARMED, True)
    attention.__init__ = __init__


def replacements() -> dict[tuple[str, str], Any]:
    """(module, attribute) of each vLLM original -> its stand-in."""
    return {
        (_METADATA, "compute_token_to_req_indices"): metadata.token_to_request,
        (_SPARSE_SWA, "_COMPUTE_SWA_INDICES_AND_LENS_KERNEL"): metadata.SWAIndicesAndLens(),
        (_SPARSE_SWA, "_COMPUTE_PREFILL_METADATA_KERNEL"): metadata.PrefillGatherLens(),
        (_COMPRESSOR, "_COMPRESSED_SLOT_MAPPING_KERNEL"): metadata.CompressedSlotMapping(),
        (_INDEXER, "_BUILD_PREFILL_CHUNK_METADATA_KERNEL"): metadata.PrefillChunkMetadata(),
        (_INDEXER, "_PREPARE_UNIFORM_DECODE_KERNEL"): metadata.UniformDecode(),
    }


def apply() -> None:
    """Install every change above (once per process)."""
    global _applied
    if _applied:
        return
    kernels.register_missing()
    pairs = [
        (getattr(sys.modules[module], attr), stand_in)
        for (module, attr), stand_in in replacements().items()
    ]
    _rebind(pairs)
    _fix_tile_scheduler()
    _applied = True


def _rebind(pairs: list[tuple[Any, Any]]) -> None:
    """Point every module attribute that is one of the originals at its stand-in. Compared by
    identity only: some module attributes (lazy placeholders) import or raise on ``==``."""
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for attr, value in list(namespace.items()):
            for original, stand_in in pairs:
                if value is original:
                    setattr(module, attr, stand_in)
                    break


def _fix_tile_scheduler() -> None:
    sparse_swa = sys.modules[_SPARSE_SWA]
    builder = sys.modules[_CPU_MLA].DeepseekV4CPUSparseSWAMetadataBuilder
    # Every layer type sparse_swa names (and so reads back when it builds the metadata).
    layer_types = [
        value for name, value in vars(sparse_swa).items() if name.startswith("_LAYER_TYPE_")
    ]

    def build_tile_scheduler(self: Any, num_decode_tokens: int) -> dict[str, None]:
        return dict.fromkeys(layer_types)

    fixed: Callable[..., dict[str, None]] = build_tile_scheduler
    builder.build_tile_scheduler = fixed
