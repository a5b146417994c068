"""The vLLM v1 KV connector of tessera-ray: vLLM engines (and Ray Serve LLM deployments) read and
write their prefix KV through the tier.

vLLM loads it by module path::

    kv_transfer_config = {
        "kv_connector": "TesseraConnector",
        "kv_connector_module_path": "tessera_ray.vllm.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"backend": "ray", "namespace": "my-app"},
    }

Each finished request's ``kv_transfer_params`` (returned in vLLM's OpenAI responses) carries
``{TIER_TOKENS_PARAM: n, TIER_SOURCES_PARAM: {"local": a, "remote": b, "disk": c}}``: the
prompt tokens the tier supplied to it, and where it read them (this node's pool, another
node's pool, a disk tier).

``kv_connector_extra_config`` is parsed into :class:`TesseraConnectorConfig` (unknown keys and
wrong types are refused). This module imports without vLLM: ``TesseraConnector`` and
``TesseraConnectorMetadata`` are loaded on first access (only vLLM asks for them), so the rest of
tessera-ray never needs vLLM installed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tessera_ray.vllm.config import BACKEND_KINDS, TesseraConnectorConfig
from tessera_ray.vllm.keys import tenant_namespace
from tessera_ray.vllm.records import BlockLoad, BlockSave, StepPlan, TokenRows
from tessera_ray.vllm.scheduler import TIER_SOURCES_PARAM, TIER_TOKENS_PARAM

if TYPE_CHECKING:
    from tessera_ray.vllm.adapter import TesseraConnector, TesseraConnectorMetadata

__all__ = [
    "TesseraConnector",
    "TesseraConnectorMetadata",
    "TesseraConnectorConfig",
    "BACKEND_KINDS",
    "StepPlan",
    "BlockLoad",
    "BlockSave",
    "TokenRows",
    "tenant_namespace",
    "TIER_TOKENS_PARAM",
    "TIER_SOURCES_PARAM",
]

_NEEDS_VLLM = ("TesseraConnector", "TesseraConnectorMetadata")


def __getattr__(name: str) -> Any:
    if name in _NEEDS_VLLM:
        try:
            module = importlib.import_module("tessera_ray.vllm.adapter")
        except ImportError as exc:
            raise ImportError(
                f"tessera_ray.vllm.connector.{name} needs vLLM ({exc}); install vllm in this "
                "environment (see `make test-vllm`)"
            ) from exc
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
