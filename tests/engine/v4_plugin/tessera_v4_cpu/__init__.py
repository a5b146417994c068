"""A vLLM general plugin, test support for tessera-ray's engine tests (not part of the
tessera_ray package): it lets a DeepSeek-V4 model run on vLLM 0.32.0's CPU build with plain
Triton, which has no CPU backend.

vLLM loads general plugins in every process it starts (the front end, the engine core and the
workers), so what :func:`register` installs reaches the processes that build and run the model:

* a hook that waits for vLLM to import its DeepSeek-V4 CPU attention module and then arms
  :mod:`tessera_v4_cpu.patches`: building the first V4 attention layer applies them (torch
  stand-ins for the V4 metadata kernels and, where vLLM's library lacks them, its C++
  kernels; the ``build_tile_scheduler`` fix). vLLM imports that module in every CPU worker,
  but builds its layers only for a V4 model: serving any other, nothing is changed.

A reference engine that needs vLLM's own prefix caching on this CPU turns it back on itself
(``tests/engine/_run_engine.py``, ``force_prefix_caching``), as for the MLA models.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType

__all__ = ["register"]


def register() -> None:
    """vLLM's entry point (group ``vllm.general_plugins``). vLLM may call it more than once
    in a process; each step is idempotent."""
    from tessera_v4_cpu import patches

    if patches.TRIGGER_MODULE in sys.modules:
        patches.arm()
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(patches.TRIGGER_MODULE, patches.arm))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``then`` right after module ``name`` has been executed by its own loader, then
    leaves ``sys.meta_path``."""

    def __init__(self, name: str, then: Callable[[], None]) -> None:
        self._name, self._then = name, then

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self._name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _ThenLoader(spec.loader, self._then)
        return spec


class _ThenLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, then: Callable[[], None]) -> None:
        self._inner, self._then = inner, then

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        self._then()
