"""The config, the chooser with its logged and counted fallback, and the import rules."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from tessera_ray.errors import TransportConfigError, TransportUnavailableError
from tessera_ray.transport import (
    LocalTransport,
    NixlTransport,
    RayObjectTransport,
    TransportConfig,
    factory,
    fallback_counts,
    make_transport,
)
from tessera_ray.transport import config as config_module

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "kw",
    [
        {"kind": "tcp"},
        {"timeout_s": 0},
        {"timeout_s": float("nan")},
        {"timeout_s": True},
        {"nixl_backends": ()},
        {"nixl_num_threads": -1},
        {"fetch_chunk_bytes": -1},
        {"fetch_chunk_bytes": True},
        {"fetch_chunk_bytes": 1.5},
    ],
)
def test_config_rejects(kw: dict[str, object]) -> None:
    with pytest.raises(TransportConfigError):
        TransportConfig(**kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(("cpus", "chunk"), [(1, 0), (2, 0), (3, 0), (4, 4 << 20), (64, 4 << 20)])
def test_fetch_chunking_by_default_follows_the_cpus(
    monkeypatch: pytest.MonkeyPatch, cpus: int, chunk: int
) -> None:
    monkeypatch.setattr(config_module.os, "sched_getaffinity", lambda _: set(range(cpus)))
    assert config_module.usable_cpus() == cpus
    assert TransportConfig().chunk_bytes == chunk
    # A size set by hand is kept whatever the machine.
    assert TransportConfig(fetch_chunk_bytes=12288).chunk_bytes == 12288
    assert TransportConfig(fetch_chunk_bytes=0).chunk_bytes == 0


def test_make_transport_by_kind() -> None:
    t = make_transport(TransportConfig(kind="local"), name="factory-local")
    assert isinstance(t, LocalTransport)
    t.close()
    assert isinstance(make_transport(TransportConfig(kind="ray")), RayObjectTransport)
    n = make_transport(TransportConfig(kind="nixl"))
    assert isinstance(n, NixlTransport) and n.name.startswith("tessera-")
    n.close()
    auto = make_transport(TransportConfig(kind="auto"))
    assert isinstance(auto, NixlTransport)  # NIXL works here, so auto takes it
    auto.close()


def test_auto_falls_back_with_logged_and_counted_reason(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    class NoNixl:
        def __init__(self, *a: object, **kw: object) -> None:
            try:
                raise ImportError("No module named 'nixl'")
            except ImportError as e:
                raise TransportUnavailableError(f"NIXL is not importable here: {e}") from e

    monkeypatch.setattr(factory, "NixlTransport", NoNixl)
    before = fallback_counts().get(("nixl", "ray", "ImportError"), 0)
    with caplog.at_level(logging.WARNING, logger="tessera_ray.transport.factory"):
        t = make_transport(TransportConfig(kind="auto"), name="fallback-1")
    assert isinstance(t, RayObjectTransport)
    assert fallback_counts()[("nixl", "ray", "ImportError")] == before + 1
    assert "falling back to Ray" in caplog.text and "not importable" in caplog.text
    with pytest.raises(TransportUnavailableError):
        factory.TRANSPORTS["nixl"] = NoNixl  # type: ignore[assignment]
        try:
            make_transport(TransportConfig(kind="nixl"))
        finally:
            factory.TRANSPORTS["nixl"] = NixlTransport


def test_local_names_are_unique_per_process() -> None:
    t = LocalTransport(TransportConfig(), name="dup")
    with pytest.raises(TransportConfigError, match="exists"):
        LocalTransport(TransportConfig(), name="dup")
    t.close()
    LocalTransport(TransportConfig(), name="dup").close()  # free again once closed


def test_import_loads_neither_ray_nor_nixl() -> None:
    code = (
        "import sys, tessera_ray.transport; "
        "print(sorted(m for m in ('ray', 'nixl') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


def test_transport_never_imports_actors() -> None:
    for path in (ROOT / "tessera_ray" / "transport").rglob("*.py"):
        text = path.read_text()
        assert "tessera_ray.actors" not in text, path
        if path.name != "ray_object.py":
            assert "import ray" not in text, f"{path} imports ray (only ray_object.py may, lazily)"
