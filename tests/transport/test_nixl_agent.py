"""The NIXL progress-thread delay: set through the wrapper's bindings on the NIXL releases the
patch was written for, and not at all (with a warning) on any other, checked with a stand-in
wrapper module so it runs where NIXL is not installed."""

from __future__ import annotations

import logging
import os
import sys
import types
from typing import Any

import pytest

from tessera_ray.transport import _nixl_agent
from tessera_ray.transport import nixl as nixl_transport


class _Config:
    pthrDelay = 0


class _Bindings:
    def __init__(self) -> None:
        self.built: list[tuple[str, int]] = []

    def nixlAgent(self, name: str, config: _Config) -> tuple[str, int]:
        self.built.append((name, config.pthrDelay))
        return name, config.pthrDelay


@pytest.fixture
def wrapper(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, _Bindings]:
    """A module shaped like NIXL's ``_api``: ``nixl_agent`` builds a fresh native config (delay
    0) and hands it to ``nixlBind.nixlAgent``."""
    module = types.ModuleType("fake_nixl_api")
    bindings = _Bindings()
    module.nixlBind = bindings  # type: ignore[attr-defined]

    def nixl_agent(name: str, conf: Any) -> Any:
        return module.nixlBind.nixlAgent(name, _Config())  # type: ignore[attr-defined]

    nixl_agent.__module__ = module.__name__
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return nixl_agent, bindings


def test_the_delay_is_set_on_the_releases_it_was_written_for(
    monkeypatch: pytest.MonkeyPatch, wrapper: tuple[Any, _Bindings]
) -> None:
    nixl_agent, bindings = wrapper
    monkeypatch.setattr(_nixl_agent, "nixl_version", lambda: "1.5.1")
    assert _nixl_agent.new_agent(nixl_agent, "a", None, 200) == ("a", 200)
    assert sys.modules["fake_nixl_api"].nixlBind is bindings  # swapped back after the build
    assert _nixl_agent.new_agent(nixl_agent, "b", None, 0) == ("b", 0)  # 0: untouched


@pytest.mark.parametrize("version", ["1.6.0", "2.0.0", None])
def test_another_release_gets_an_unpatched_agent_and_a_warning(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    wrapper: tuple[Any, _Bindings],
    version: str | None,
) -> None:
    nixl_agent, bindings = wrapper
    monkeypatch.setattr(_nixl_agent, "nixl_version", lambda: version)
    with caplog.at_level(logging.WARNING, logger=nixl_transport.__name__):
        assert _nixl_agent.new_agent(nixl_agent, "c", None, 200) == ("c", 0)
    assert "progress thread spins" in caplog.text and str(version) in caplog.text
    assert bindings.built == [("c", 0)]


def test_the_installed_release_is_one_the_patch_knows() -> None:
    """Where NIXL is installed (as in this project's environment), the pinned release is one
    the patch was written for: upgrading NIXL must come with a look at its wrapper."""
    version = nixl_transport.nixl_version()
    if version is None:
        pytest.skip("NIXL is not installed here")
    assert version.startswith(nixl_transport.PROGRESS_DELAY_RELEASES), version


def test_the_package_never_switches_ucx_modules_off() -> None:
    """RDMA stays on unless the operator says otherwise: no module of the package writes
    ``UCX_MODULES``, and importing NIXL through it (and the actor and demo modules that start
    agents) leaves the variable as the environment had it."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    package = Path(__file__).resolve().parents[2] / "tessera_ray"
    writes = re.compile(r"environ[^\n]*UCX_MODULES|UCX_MODULES[^\n]*=")
    offenders = [
        str(p.relative_to(package.parent))
        for p in package.rglob("*.py")
        if writes.search(p.read_text())
    ]
    assert offenders == []
    code = (
        "import os\n"
        "from tessera_ray.transport.nixl import import_nixl\n"
        "import tessera_ray.actors.pool_actor, tessera_ray.demo.fleet\n"
        "import_nixl()\n"
        "print(repr(os.environ.get('UCX_MODULES')), flush=True)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "UCX_MODULES"}
    # Only stdout is read: where libibverbs crashes UCX at exit the return code may not be 0.
    run = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert run.stdout.strip().splitlines()[-1] == "None", run.stderr[-2000:]
