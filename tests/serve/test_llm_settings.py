"""The Ray Serve LLM app's settings (``tessera_ray.serve.llm``): the config files in ``deploy/``
parse, the connector and the router agree on what a token key depends on, and bad settings are
refused by name. Ray's LLM library is not needed here (the engine tests start the app)."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest
import ray
import yaml

from tessera_ray.errors import TierConfigError
from tessera_ray.serve.llm import RESERVED_CPUS_ENV, ROUTERS, ServeLLMSettings
from tessera_ray.serve.router import TesseraRequestRouter

ROOT = Path(__file__).resolve().parents[2]


def _args() -> dict[str, Any]:
    config = yaml.safe_load((ROOT / "deploy" / "serve_llm_cpu.yaml").read_text())
    (app,) = config["applications"]
    assert app["import_path"] == "tessera_ray.serve.llm:build_app"
    return dict(app["args"])


def test_the_cpu_config_file_gives_one_key_setting_to_connector_and_router() -> None:
    config = ServeLLMSettings.from_args(_args()).llm_config_dict()
    connector = config["engine_kwargs"]["kv_transfer_config"]["kv_connector_extra_config"]
    router = config["deployment_config"]["request_router_config"]
    kwargs = router["request_router_kwargs"]
    assert router["request_router_class"] == ROUTERS["tessera"]
    for name in ("model_name", "namespace", "ray_namespace"):
        assert kwargs[name] == connector[name], name
    assert connector["model_name"] == config["model_loading_config"]["model_id"] == "tiny-qwen2"
    assert kwargs["tokenizer"] == config["model_loading_config"]["model_source"]
    assert config["accelerator_config"] == {"kind": "cpu"}
    assert config["deployment_config"]["num_replicas"] == 2
    assert config["engine_kwargs"]["enable_prompt_tokens_details"] is True
    assert config["runtime_env"]["env_vars"]["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_defaults_follow_the_model_source() -> None:
    settings = ServeLLMSettings(model_source="/models/my-model/", accelerator_type="H200")
    config = settings.llm_config_dict()
    assert settings.served_name == settings.tier_namespace == "my-model"
    assert config["accelerator_type"] == "H200" and "accelerator_config" not in config
    assert "runtime_env" not in config and "placement_group_config" not in config
    one_per_node = ServeLLMSettings(model_source="m", bundle_per_worker={"CPU": 1, "node": 1})
    assert one_per_node.llm_config_dict()["placement_group_config"] == {
        "bundle_per_worker": {"CPU": 1, "node": 1},
        "strategy": "STRICT_PACK",
    }


def test_without_the_connector_the_engines_and_the_router_are_otherwise_the_same() -> None:
    """The baseline of a tier-on / tier-off comparison: no ``kv_transfer_config``, nothing else
    changed (the same router and its settings, the same engine arguments)."""
    on = ServeLLMSettings.from_args(_args()).llm_config_dict()
    off = ServeLLMSettings.from_args({**_args(), "connector": False}).llm_config_dict()
    assert "kv_transfer_config" not in off["engine_kwargs"]
    assert off["engine_kwargs"] == {
        k: v for k, v in on["engine_kwargs"].items() if k != "kv_transfer_config"
    }
    # On vLLM's CPU build the tier keeps the cores vLLM holds back from the engine's compute
    # as many as without a connector (vLLM holds one more back for any connector).
    on_env = on["runtime_env"]["env_vars"]
    assert on_env.pop(RESERVED_CPUS_ENV) == "1" and RESERVED_CPUS_ENV not in off["runtime_env"]
    assert {k: v for k, v in off.items() if k != "engine_kwargs"} == {
        k: v for k, v in on.items() if k != "engine_kwargs"
    }


def test_the_tier_leaves_vllm_cpu_builds_core_layout_as_without_it() -> None:
    """vLLM's CPU build holds back one core per worker from the bound compute, one more for
    any connector: the tier's replicas hold back as many as without it, one per worker of
    the engine, unless the deployment says otherwise; GPU replicas are left alone."""

    def env(**kw: Any) -> dict[str, str]:
        settings = ServeLLMSettings(model_source="m", device="cpu", **kw)
        return settings.llm_config_dict().get("runtime_env", {}).get("env_vars", {})

    assert env() == {RESERVED_CPUS_ENV: "1"}
    assert env(connector=False) == {}
    parallel = {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}
    assert env(engine_kwargs=parallel)[RESERVED_CPUS_ENV] == "4"
    assert env(env_vars={RESERVED_CPUS_ENV: "3", "UCX_MODULES": "^ib"}) == {
        RESERVED_CPUS_ENV: "3",
        "UCX_MODULES": "^ib",
    }
    assert "runtime_env" not in ServeLLMSettings(model_source="m").llm_config_dict()


def test_every_router_named_is_a_class_serve_can_load() -> None:
    module, name = ROUTERS["tessera"].split(":")
    assert getattr(importlib.import_module(module), name) is TesseraRequestRouter
    module, name = ROUTERS["power_of_two"].split(":")
    assert isinstance(getattr(importlib.import_module(module), name), type)
    # Ray's LLM library needs pyarrow to import: the class is looked for in its source.
    module, name = ROUTERS["prefix_affinity"].split(":")
    source = Path(ray.__file__).parent.joinpath(*module.split(".")[1:]).with_suffix(".py")
    assert f"class {name}(" in source.read_text()
    config = ServeLLMSettings(model_source="m", router="power_of_two").llm_config_dict()
    assert "request_router_kwargs" not in config["deployment_config"]["request_router_config"]


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"replicas": 2}, "replicas"),
        ({"num_replicas": 0}, "num_replicas"),
        ({"device": "tpu"}, "device"),
        ({"device": "cpu", "accelerator_type": "H200"}, "accelerator_type"),
        ({"router": "round_robin"}, "router"),
        ({"engine_kwargs": {"kv_transfer_config": {}}}, "kv_transfer_config"),
        ({"engine_kwargs": {"served_model_name": "x"}}, "served_model_name"),
        ({"model_source": ""}, "model_source"),
        ({"routed_memory_s": -1.0}, "routed_memory_s"),
        ({"lookup_timeout_s": 0.0}, "lookup_timeout_s"),
    ],
)
def test_bad_settings_are_refused_by_name(change: dict[str, Any], named: str) -> None:
    with pytest.raises(TierConfigError, match=named):
        ServeLLMSettings.from_args({**_args(), **change})
