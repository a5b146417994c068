"""The vLLM connector's old module path, kept for one release: vLLM configs that name
``kv_connector_module_path: tessera_ray.serve.connector`` keep working, with a warning to move
to ``tessera_ray.vllm.connector`` (the connector now has a package of its own)."""

from __future__ import annotations

import warnings
from typing import Any

from tessera_ray.vllm import connector as _connector

__all__ = list(_connector.__all__)

warnings.warn(
    "tessera_ray.serve.connector moved to tessera_ray.vllm.connector; set "
    "kv_connector_module_path to the new path (the old one goes in the next release)",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str) -> Any:
    return getattr(_connector, name)
