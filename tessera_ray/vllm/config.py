"""The vLLM connector's one validated configuration, parsed from ``kv_connector_extra_config``.

vLLM hands a connector a free-form dict. It is turned into one frozen dataclass here, at engine
start: an unknown key or a value of the wrong type is an error that names the key and lists the
valid ones, never silently ignored (a typo in a tier address must not quietly disable caching).
No vLLM import here, so the main test suite checks the parser without vLLM installed.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

from tessera_ray.errors import TierConfigError

__all__ = ["TesseraConnectorConfig", "BackendKind", "BACKEND_KINDS"]

BackendKind = Literal["ray", "local"]
BACKEND_KINDS: tuple[str, ...] = get_args(BackendKind)

_WHERE = "kv_connector_extra_config"


@dataclass(frozen=True, kw_only=True)
class TesseraConnectorConfig:
    """How a vLLM engine reaches the tier (``kv_transfer_config.kv_connector_extra_config``)."""

    backend: BackendKind = "ray"
    """``"ray"``: the running tier on the Ray cluster (``tessera-ray start``), shared by every
    engine of the cluster. ``"local"``: an in-process tier (the core engine, no Ray), shared by
    the connectors of one process: for single-process engines (one GPU, ``uni`` executor) and
    tests."""
    namespace: str = "vllm"
    """Tier namespace of requests without a ``cache_salt``; a request's ``cache_salt`` selects
    its own tenant namespace under this one, so tenants never see each other's blocks."""
    model_name: str | None = None
    """The model's identity inside every token key; ``None``: vLLM's served model name. Two
    engines share blocks only when this (and the page layout) is equal, so a fine-tune needs
    its own name."""
    ray_namespace: str = "tessera"
    """Ray namespace holding the tier's named actors (``backend="ray"``)."""
    ray_address: str | None = None
    """Ray address to join when this process is not connected yet; ``None``: ``"auto"``."""
    pool: str | None = None
    """Pool actor that blocks are stored into and read through; ``None``: the pool on this
    process's node (else the first pool)."""
    local_num_blocks: int = 256
    """Token blocks the in-process tier holds (``backend="local"``); each block is one page of
    every layer (DeepSeek-V3 bf16: 61 x 72 KiB = 4.3 MiB)."""
    local_device: str = "cpu"
    """Where the in-process tier keeps its pages (``"cpu"`` or ``"cuda[:N]"``)."""
    format: str | None = None
    """Page format of the engine's cache as the tier stores it; ``None``: the format of the
    model's dtype (``mla-bf16`` for MLA, ``kv-bf16`` / ``kv-fp16`` for full attention). It must
    describe vLLM's cache bytes exactly; the Ray backend's tier must hold the same layout."""
    tenant_secret_file: str | None = None
    """File holding the tier's tenant secret, for a tier started with one (every call then
    needs a credential): the connector is the front end that maps ``cache_salt`` to tenants,
    so it issues itself a credential per tenant namespace. ``None``: an open tier."""
    timeout_s: float = 30.0
    """Longest one batched tier call (lookup, read, store) may take; a read that times out is
    reported as a load error and vLLM recomputes the blocks."""
    lookup_wait_s: float = 0.002
    """Longest vLLM's scheduler thread waits for a tier lookup in one step; a lookup still on
    its way then answers "ask again" and the request waits for the next step."""
    store_wait_s: float = 5.0
    """Longest a request waits for tier blocks this engine is still storing (its stores run
    behind the engine) before recomputing them; 0: never wait. A prompt repeated right after it
    was computed then loads its prefix instead of computing it again."""
    nixl_staging_bytes: int = 256 << 20
    """Host memory the worker registers with NIXL once, to read tier blocks from this node's
    pool one-sided (``backend="ray"``); a step's loads that do not fit, and pools without
    NIXL, go through Ray's object store. 0: always the object store."""
    max_pending_saves: int = 4
    """Steps whose tier stores may run behind the engine (each holds its staged blocks in host
    memory); a step beyond that waits for the oldest."""

    def __post_init__(self) -> None:
        if self.backend not in BACKEND_KINDS:
            raise TierConfigError(
                f"{_WHERE}: backend must be one of {', '.join(BACKEND_KINDS)}, got {self.backend!r}"
            )
        for name in ("namespace", "ray_namespace", "local_device"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise TierConfigError(f"{_WHERE}: {name} must be a non-empty string")
        for name in ("model_name", "ray_address", "pool", "tenant_secret_file", "format"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise TierConfigError(f"{_WHERE}: {name} must be a non-empty string or null")
        if (
            isinstance(self.nixl_staging_bytes, bool)
            or not isinstance(self.nixl_staging_bytes, int)
            or self.nixl_staging_bytes < 0
        ):
            raise TierConfigError(
                f"{_WHERE}: nixl_staging_bytes must be an integer >= 0, "
                f"got {self.nixl_staging_bytes!r}"
            )
        for name in ("local_num_blocks", "max_pending_saves"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise TierConfigError(f"{_WHERE}: {name} must be a positive integer, got {value!r}")
        for name in ("timeout_s", "lookup_wait_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise TierConfigError(f"{_WHERE}: {name} must be positive, got {value!r}")
        wait = self.store_wait_s
        if isinstance(wait, bool) or not isinstance(wait, int | float) or not wait >= 0:
            raise TierConfigError(f"{_WHERE}: store_wait_s must be >= 0, got {wait!r}")

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> TesseraConnectorConfig:
        """Parse vLLM's ``kv_connector_extra_config``: every key must be a field of this class
        and every value of the field's type; the error names the key and the valid keys."""
        if extra is None:
            return cls()
        if not isinstance(extra, Mapping):
            raise TierConfigError(
                f"{_WHERE} must be a mapping of settings, got {type(extra).__name__}"
            )
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(str(k) for k in extra if k not in fields)
        if unknown:
            raise TierConfigError(
                f"{_WHERE}: unknown key(s) {', '.join(unknown)} for TesseraConnector; "
                f"valid keys: {', '.join(sorted(fields))}"
            )
        hints = typing.get_type_hints(cls)
        for key, value in extra.items():
            if not _matches(value, hints[key]):
                raise TierConfigError(
                    f"{_WHERE}: {key} must be {_describe(hints[key])}, got {value!r}"
                )
        return cls(**dict(extra))


def _options(hint: Any) -> tuple[Any, ...]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


def _matches(value: Any, hint: Any) -> bool:
    for option in _options(hint):
        if option is type(None) and value is None:
            return True
        if typing.get_origin(option) is Literal and value in typing.get_args(option):
            return True
        if option is float and isinstance(value, int | float) and not isinstance(value, bool):
            return True
        if option in (int, str) and isinstance(value, option) and not isinstance(value, bool):
            return True
    return False


def _describe(hint: Any) -> str:
    names = []
    for option in _options(hint):
        if option is type(None):
            names.append("null")
        elif typing.get_origin(option) is Literal:
            names.append("one of " + ", ".join(repr(a) for a in typing.get_args(option)))
        else:
            names.append(f"a{'n' if option is int else ''} {option.__name__}")
    return " or ".join(names)
