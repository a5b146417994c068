"""Ray Serve LLM over the tier: an OpenAI-compatible app (``/v1/completions``,
``/v1/chat/completions``, ``/v1/models``) whose vLLM replicas keep their prefix KV in the tier
through :mod:`tessera_ray.vllm.connector`, routed by :class:`TesseraRequestRouter`.

Ray's ``ray.serve.llm`` runs the replicas (GPU nodes and, with ``device: cpu``, vLLM's CPU
build); this module only writes its ``LLMConfig`` so that the connector and the router agree on
the settings a token key depends on (the model name and the tier namespace), which two
hand-written blocks of YAML can silently disagree on. A config file names it::

    applications:
      - name: llm
        route_prefix: /
        import_path: tessera_ray.serve.llm:build_app
        args: {model_source: /models/tiny-qwen2, num_replicas: 2, device: cpu}

Needs ``vllm`` and ``pyarrow`` (Ray's LLM library imports it) where the app is built.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import TYPE_CHECKING, Any

from tessera_ray.errors import TierConfigError
from tessera_ray.serve.routing import BALANCE_ON

if TYPE_CHECKING:
    from ray.serve import Application
    from ray.serve.llm import LLMConfig

__all__ = [
    "RESERVED_CPUS_ENV",
    "ROUTERS",
    "ServeLLMSettings",
    "build_app",
    "llm_config",
    "openai_app",
]

ROUTERS = {
    "tessera": "tessera_ray.serve.router:TesseraRequestRouter",
    "power_of_two": (
        "ray.serve._private.request_router.pow_2_router:PowerOfTwoChoicesRequestRouter"
    ),
    "prefix_affinity": "ray.serve.llm.request_router:PrefixCacheAffinityRouter",
}
"""The request routers an app can run: the tier-aware one, and Ray's two for comparison."""

_DEVICES = ("gpu", "cpu")
RESERVED_CPUS_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"
"""vLLM's CPU build: how many cores its engine keeps off the workers' bound compute."""
# Set here, from the settings: a caller's copy could disagree with the router's.
_OWNED_ENGINE_KWARGS = ("kv_transfer_config", "model", "served_model_name")


@dataclass(frozen=True, kw_only=True)
class ServeLLMSettings:
    """One model served by ``num_replicas`` vLLM replicas over the tier."""

    model_source: str
    """A local checkpoint directory or a model hub id (what vLLM loads)."""
    model_id: str = ""
    """The name clients ask for (``model`` in a request); default: the source's last part."""
    num_replicas: int = 2
    device: str = "gpu"
    """``gpu``: one GPU per replica; ``cpu``: vLLM's CPU build, no accelerator."""
    accelerator_type: str | None = None
    """A GPU type replicas must run on (``H200``); GPU only."""
    ray_namespace: str = "tessera"
    """The Ray namespace of the running tier's pools and directory shards."""
    namespace: str = ""
    """The tier namespace of this app's blocks (requests' ``cache_salt`` picks tenants under
    it); default: ``model_id``."""
    router: str = "tessera"
    """One of :data:`ROUTERS`."""
    lookup_timeout_s: float = 0.05
    """How long the tier-aware router waits for the directory before power-of-two choices."""
    balance_on: str = "prompt_tokens"
    """The tier-aware router's load per replica: ``prompt_tokens`` of its unfinished requests,
    or ``requests`` (Serve's queue lengths)."""
    max_token_gap: int = 16384
    """How many more outstanding prompt tokens the replica holding a prefix may carry than the
    least loaded one before the router sends the request elsewhere (``prompt_tokens``)."""
    max_queue_gap: int = 2
    """As ``max_token_gap``, in queued requests (``requests``, and requests whose tokens the
    router cannot know)."""
    routed_memory_s: float = 30.0
    """How long the router counts a block it routed to a pool as held there before the
    directory says so (0: only the directory counts)."""
    timeout_s: float = 30.0
    """The connector's bound on one tier call."""
    connector: bool = True
    """False: the engines run without the tier's connector (vLLM's own caches only), behind
    the same router: the baseline a tier's worth is measured against."""
    bundle_per_worker: dict[str, float] = field(default_factory=dict)
    """Ray resources of each replica's engine worker (its placement group bundle), e.g. a
    custom resource every node has one of, for one replica per node; empty: Ray's default."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """vLLM engine arguments (``block_size``, ``max_model_len``, ...), passed as they are."""
    env_vars: dict[str, str] = field(default_factory=dict)
    """Environment of the replicas' processes (``VLLM_CPU_KVCACHE_SPACE``, ``UCX_MODULES``)."""

    def __post_init__(self) -> None:
        if not self.model_source:
            raise TierConfigError("serve LLM: model_source is required")
        if self.num_replicas < 1:
            raise TierConfigError(f"serve LLM: num_replicas must be >= 1, got {self.num_replicas}")
        if self.device not in _DEVICES:
            raise TierConfigError(
                f"serve LLM: device must be one of {_DEVICES}, got {self.device!r}"
            )
        if self.device == "cpu" and self.accelerator_type:
            raise TierConfigError("serve LLM: accelerator_type needs device 'gpu'")
        if self.router not in ROUTERS:
            raise TierConfigError(
                f"serve LLM: router must be one of {sorted(ROUTERS)}, got {self.router!r}"
            )
        gaps = (self.max_queue_gap, self.max_token_gap, self.routed_memory_s)
        if self.lookup_timeout_s <= 0 or min(gaps) < 0:
            raise TierConfigError(
                "serve LLM: lookup_timeout_s must be > 0, max_queue_gap, max_token_gap and "
                f"routed_memory_s >= 0, got {self.lookup_timeout_s!r}, {self.max_queue_gap!r}, "
                f"{self.max_token_gap!r}, {self.routed_memory_s!r}"
            )
        if self.balance_on not in BALANCE_ON:
            raise TierConfigError(
                f"serve LLM: balance_on must be one of {BALANCE_ON}, got {self.balance_on!r}"
            )
        owned = sorted(set(self.engine_kwargs) & set(_OWNED_ENGINE_KWARGS))
        if owned:
            raise TierConfigError(
                f"serve LLM: engine_kwargs may not set {owned}: they follow from model_source, "
                "model_id and the tier settings"
            )

    @classmethod
    def from_args(cls, args: dict[str, Any]) -> ServeLLMSettings:
        """Settings from a config file's ``args``; unknown keys are refused by name."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(args) - known)
        if unknown:
            raise TierConfigError(f"serve LLM: unknown settings {unknown}; known: {sorted(known)}")
        return cls(**args)

    @property
    def served_name(self) -> str:
        return self.model_id or PurePath(self.model_source.rstrip("/")).name

    @property
    def tier_namespace(self) -> str:
        return self.namespace or self.served_name

    def connector_config(self) -> dict[str, Any]:
        """``kv_connector_extra_config``: the running tier, this app's namespace and name."""
        return {
            "backend": "ray",
            "ray_namespace": self.ray_namespace,
            "namespace": self.tier_namespace,
            "model_name": self.served_name,
            "timeout_s": self.timeout_s,
        }

    def router_config(self) -> dict[str, Any]:
        """Serve's ``request_router_config``; the tier-aware router gets the connector's key
        settings and the tokenizer of text and chat prompts."""
        config: dict[str, Any] = {"request_router_class": ROUTERS[self.router]}
        if self.router == "tessera":
            config["request_router_kwargs"] = {
                "model_name": self.served_name,
                "namespace": self.tier_namespace,
                "ray_namespace": self.ray_namespace,
                "tokenizer": self.engine_kwargs.get("tokenizer", self.model_source),
                "lookup_timeout_s": self.lookup_timeout_s,
                "max_queue_gap": self.max_queue_gap,
                "routed_memory_s": self.routed_memory_s,
                "balance_on": self.balance_on,
                "max_token_gap": self.max_token_gap,
            }
        return config

    def replica_env(self) -> dict[str, str]:
        """The replicas' environment: :attr:`env_vars`, and on vLLM's CPU build with the
        connector, the cores vLLM holds back from the engine's bound compute as many as
        without it (``VLLM_CPU_NUM_OF_RESERVED_CPU``, unless set here). vLLM's CPU build
        holds back one more core whenever any KV connector is configured (for NIXL's own
        connector); where there is no core to spare (two cores, say) it then holds back none
        and the engine's compute spreads over every core, the engine core's too. The tier's
        connector needs no core of its own, so the tier leaves the engine's layout as it
        was: the same compute threads with the tier as without, and the same bits
        (docs/engine-parity.md)."""
        env = dict(self.env_vars)
        if self.connector and self.device == "cpu":
            workers = int(self.engine_kwargs.get("tensor_parallel_size", 1)) * int(
                self.engine_kwargs.get("pipeline_parallel_size", 1)
            )
            env.setdefault(RESERVED_CPUS_ENV, str(workers))
        return env

    def llm_config_dict(self) -> dict[str, Any]:
        """The ``LLMConfig`` fields (plain data: tests read it without Ray's LLM library)."""
        engine_kwargs: dict[str, Any] = {
            # vLLM's count of cached prompt tokens in each response's usage.
            "enable_prompt_tokens_details": True,
            **self.engine_kwargs,
        }
        if self.connector:
            engine_kwargs["kv_transfer_config"] = {
                "kv_connector": "TesseraConnector",
                "kv_connector_module_path": "tessera_ray.vllm.connector",
                "kv_role": "kv_both",
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": self.connector_config(),
            }
        config: dict[str, Any] = {
            "model_loading_config": {
                "model_id": self.served_name,
                "model_source": self.model_source,
            },
            "deployment_config": {
                "num_replicas": self.num_replicas,
                "request_router_config": self.router_config(),
            },
            "engine_kwargs": engine_kwargs,
        }
        if self.device == "cpu":
            config["accelerator_config"] = {"kind": "cpu"}
        elif self.accelerator_type:
            config["accelerator_type"] = self.accelerator_type
        env_vars = self.replica_env()
        if env_vars:
            config["runtime_env"] = {"env_vars": env_vars}
        if self.bundle_per_worker:
            config["placement_group_config"] = {
                "bundle_per_worker": dict(self.bundle_per_worker),
                "strategy": "STRICT_PACK",
            }
        return config


def llm_config(settings: ServeLLMSettings) -> LLMConfig:
    """Ray Serve LLM's ``LLMConfig`` of ``settings``."""
    from ray.serve.llm import LLMConfig

    return LLMConfig(**settings.llm_config_dict())


def openai_app(settings: ServeLLMSettings) -> Application:
    """The OpenAI app of one model over the tier."""
    from ray.serve.llm import build_openai_app

    return build_openai_app({"llm_configs": [llm_config(settings)]})


def build_app(args: dict[str, Any]) -> Application:
    """:func:`openai_app` of a Serve config file's ``args`` (its ``import_path``)."""
    return openai_app(ServeLLMSettings.from_args(dict(args)))
