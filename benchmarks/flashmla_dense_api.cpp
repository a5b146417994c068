// FlashMLA's Python module with SM90 dense decode alone, for benchmarks/gpu_bundle.sh: it
// replaces FlashMLA's csrc/api/api.cpp in the bundle, so that the build compiles four sources
// (about 110 s on 16 cores) instead of every kernel. tessera_ray.kernels calls only
// flash_mla.get_mla_metadata and flash_mla.flash_mla_with_kvcache, which reach the extension
// through dense_decode_fwd for bf16 pages; the other entry points are not bound, and FlashMLA's
// Python functions that use them fail when called rather than at import.
#include <pybind11/pybind11.h>

#include "dense_decode.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "FlashMLA, SM90 dense decode only (tessera-ray's GPU bundle)";
    m.def("dense_decode_fwd", &dense_attn_decode_interface);
}
