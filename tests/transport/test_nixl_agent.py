"""The NIXL progress-thread delay: set through the wrapper's bindings on the NIXL releases the
patch was written for, and not at all (with a warning) on any other, checked with a stand-in
wrapper module so it runs where NIXL is not installed."""

from __future__ import annotations

import logging
import sys
import types
from typing import Any

import pytest

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
    monkeypatch.setattr(nixl_transport, "nixl_version", lambda: "1.5.1")
    assert nixl_transport._new_agent(nixl_agent, "a", None, 200) == ("a", 200)
    assert sys.modules["fake_nixl_api"].nixlBind is bindings  # swapped back after the build
    assert nixl_transport._new_agent(nixl_agent, "b", None, 0) == ("b", 0)  # 0: untouched


@pytest.mark.parametrize("version", ["1.6.0", "2.0.0", None])
def test_another_release_gets_an_unpatched_agent_and_a_warning(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    wrapper: tuple[Any, _Bindings],
    version: str | None,
) -> None:
    nixl_agent, bindings = wrapper
    monkeypatch.setattr(nixl_transport, "nixl_version", lambda: version)
    with caplog.at_level(logging.WARNING, logger=nixl_transport.__name__):
        assert nixl_transport._new_agent(nixl_agent, "c", None, 200) == ("c", 0)
    assert "progress thread spins" in caplog.text and str(version) in caplog.text
    assert bindings.built == [("c", 0)]


def test_the_installed_release_is_one_the_patch_knows() -> None:
    """Where NIXL is installed (as in this project's environment), the pinned release is one
    the patch was written for: upgrading NIXL must come with a look at its wrapper."""
    version = nixl_transport.nixl_version()
    if version is None:
        pytest.skip("NIXL is not installed here")
    assert version.startswith(nixl_transport.PROGRESS_DELAY_RELEASES), version
