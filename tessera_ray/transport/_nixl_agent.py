"""Starting a NIXL agent: importing NIXL, its release, and the progress-thread delay patch.

Kept apart from :mod:`tessera_ray.transport.nixl` because it is the one place that reaches
into NIXL's Python wrapper (a module-level swap of its bindings), pinned to known releases.
"""

from __future__ import annotations

import importlib.metadata
import logging
import sys
import threading
from typing import Any

from tessera_ray.errors import TransportUnavailableError

__all__ = ["PROGRESS_DELAY_RELEASES", "import_nixl", "new_agent", "nixl_version"]

# The transport's logger: its warnings keep the name they were configured and filtered by.
log = logging.getLogger("tessera_ray.transport.nixl")

PROGRESS_DELAY_RELEASES: tuple[str, ...] = ("1.5.",)
"""NIXL releases whose Python wrapper :func:`new_agent`'s patch was written against (the
wrapper calls ``nixlBind.nixlAgent(name, config)`` with a config it built itself). On any other
release the agent is built unpatched, its progress thread spinning, and a warning says so."""

_AGENT_LOCK = threading.Lock()
"""Serialises the bindings swap: two agents built at once must not restore each other's."""


def import_nixl() -> tuple[Any, Any]:
    """``(nixl_agent, nixl_agent_config)``, or :class:`TransportUnavailableError`.

    UCX's modules are the operator's choice (``UCX_MODULES``): the package never turns RDMA
    off. A host whose system libibverbs makes UCX crash a process at exit sets ``^ib`` itself.
    """
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except Exception as e:  # ImportError, or a broken wheel failing while loading its library
        raise TransportUnavailableError(f"NIXL is not importable here: {e}") from e
    return nixl_agent, nixl_agent_config


def nixl_version() -> str | None:
    """The installed NIXL release (its wheels are named per CUDA major), or ``None``."""
    for dist in ("nixl", "nixl-cu12", "nixl-cu13"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def new_agent(nixl_agent: Any, name: str, conf: Any, progress_delay_us: int) -> Any:
    """A NIXL agent whose progress thread pauses ``progress_delay_us`` between polls.

    NIXL's Python wrapper builds the native agent config itself and sets the progress-thread
    delay to 0 (a spinning thread, one core per agent). The native config has the field, so
    the wrapper's handle on the bindings is swapped, only while the agent is built, for one
    that sets the delay first; everything else passes through untouched. Only on the releases
    it was written for: a wrapper refactored upstream could drop the delay silently.
    """
    api: Any = sys.modules[nixl_agent.__module__]
    real: Any = getattr(api, "nixlBind", None)
    if real is None or progress_delay_us == 0:
        return nixl_agent(name, conf)
    version = nixl_version()
    if version is None or not version.startswith(PROGRESS_DELAY_RELEASES):
        log.warning(
            "NIXL %s is not a release the progress-thread delay was written for (%s); its "
            "progress thread spins a core per agent",
            version,
            ", ".join(f"{r}x" for r in PROGRESS_DELAY_RELEASES),
        )
        return nixl_agent(name, conf)

    class _Bindings:
        def __getattr__(self, attr: str) -> Any:
            return getattr(real, attr)

        @staticmethod
        def nixlAgent(agent_name: str, agent_config: Any) -> Any:
            agent_config.pthrDelay = progress_delay_us
            return real.nixlAgent(agent_name, agent_config)

    with _AGENT_LOCK:
        api.nixlBind = _Bindings()
        try:
            return nixl_agent(name, conf)
        finally:
            api.nixlBind = real
