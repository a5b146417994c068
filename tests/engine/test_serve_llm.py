"""Ray Serve LLM over the tier, started from ``deploy/serve_llm_cpu.yaml`` as a user starts it
(``serve deploy``): two vLLM CPU replicas of a tiny Qwen2 behind one OpenAI endpoint, each engine
keeping its prefix KV in the tier, requests routed by ``TesseraRequestRouter``; the ``openai``
client is the user's.

Which replica answered is not visible to a client; what each answer says is: ``usage``'s cached
prompt tokens (vLLM's own prefix cache and the tier together) and ``kv_transfer_params``' tier
tokens (the connector's share). A repeated prompt with no tier tokens but cached ones was
answered by the replica that computed it, from vLLM's own prefix cache; one with tier tokens by
the other replica, which had never seen it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import yaml

from tessera_ray.models.hf_tiny import TOKENIZER_WORDS, write_tiny_gqa
from tessera_ray.vllm.connector import TIER_TOKENS_PARAM
from tessera_ray.vllm.router_word import ROUTER_WORD_TAKEN_PARAM
from tests.engine._harness import ROOT
from tests.engine.conftest import run

openai = pytest.importorskip("openai")
pytest.importorskip("pyarrow")  # Ray's LLM library imports it

MODEL_ID = "tiny-qwen2"
NAMESPACE = "tessera-serve-llm"
URL = "http://127.0.0.1:8000/v1"
_START_S = 900.0  # two CPU engines starting at once on two cores
# 16 whole tier blocks (64 tokens) and 8 whole engine blocks (the CPU build's 128): vLLM's own
# prefix cache and the tier hold the same 1024 tokens of it, so a hit is one or the other.
PROMPT_TOKENS = 1050


@dataclass
class Answer:
    tokens: list[int]
    logprobs: list[float]
    cached: int
    tier: int
    router_word: bool = False
    """The engine took the router's word that the tier held none of the prompt's blocks."""


def _text(seed: int, words: int) -> str:
    step = 7 + seed
    return " ".join(TOKENIZER_WORDS[(i * step + seed) % len(TOKENIZER_WORDS)] for i in range(words))


def _prompt(seed: int, n: int = PROMPT_TOKENS) -> list[int]:
    """Token ids (OpenAI's other prompt form), so that the length is exact."""
    return [(seed * 7919 + i * 31) % 1000 + 1 for i in range(n)]


def _complete(
    client: openai.OpenAI, prompt: list[int] | str, salt: str, max_tokens: int = 8
) -> Answer:
    r = client.completions.create(
        model=MODEL_ID,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        logprobs=1,
        extra_body={"cache_salt": salt, "return_token_ids": True},
    )
    choice = r.choices[0]
    details = r.usage.prompt_tokens_details
    params = getattr(r, "kv_transfer_params", None) or {}
    return Answer(
        tokens=list(choice.token_ids),
        logprobs=list(choice.logprobs.token_logprobs),
        cached=(details.cached_tokens or 0) if details is not None else 0,
        tier=int(params.get(TIER_TOKENS_PARAM, 0)),
        router_word=params.get(ROUTER_WORD_TAKEN_PARAM) is True,
    )


def _serve_status() -> dict[str, object]:
    status = yaml.safe_load(run("serve", "status").stdout) or {}
    return status.get("applications", {}).get("llm", {})  # type: ignore[no-any-return]


def _wait_running(timeout_s: float = _START_S) -> None:
    deadline = time.monotonic() + timeout_s
    app: dict[str, object] = {}
    while time.monotonic() < deadline:
        app = _serve_status()
        if app.get("status") == "RUNNING":
            return
        time.sleep(2.0)  # Serve has no blocking wait for an app deployed by config
    raise AssertionError(f"the Serve app did not start in {timeout_s:.0f} s: {app}")


def _tier_blocks() -> dict[str, int]:
    snapshot = json.loads(
        run("tessera-ray", "status", "--json", "--ray-namespace", NAMESPACE).stdout
    )
    return {p["name"]: p["blocks_in_memory"] + p["blocks_on_disk"] for p in snapshot["pools"]}


@pytest.fixture(scope="module")
def client(ray_cluster: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    work = tmp_path_factory.mktemp("serve-llm")
    model = write_tiny_gqa(work / MODEL_ID, 2)
    run(
        "tessera-ray", "start", "--hf-config", str(model), "--num-blocks", "512",
        "--ray-namespace", NAMESPACE,
    )  # fmt: skip
    config = yaml.safe_load((ROOT / "deploy" / "serve_llm_cpu.yaml").read_text())
    # The router's memory off: both replicas share this node's pool, so a repeat's choice
    # between them is then a coin flip, and both kinds of hit (own cache, tier) occur below.
    config["applications"][0]["args"].update(
        model_source=str(model), ray_namespace=NAMESPACE, routed_memory_s=0.0
    )
    path = work / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    run("serve", "deploy", str(path))
    try:
        _wait_running()
        yield openai.OpenAI(base_url=URL, api_key="unused", max_retries=0, timeout=300)
    finally:
        run("serve", "shutdown", "--yes", check=False)
        run("tessera-ray", "stop", "--ray-namespace", NAMESPACE, check=False)


def test_the_openai_routes_answer(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL_ID]
    chat = client.chat.completions.create(
        model=MODEL_ID,
        messages=[{"role": "user", "content": _text(9, 40)}],
        max_tokens=4,
        temperature=0.0,
    )
    assert chat.choices[0].message.content and chat.usage.completion_tokens == 4


def test_a_prefix_computed_by_one_replica_reaches_the_other_through_the_tier(
    client: openai.OpenAI,
) -> None:
    """Each round: a new tenant (``cache_salt``) asks a prompt twice. The second answer comes
    from the replica that computed it (all from vLLM's own prefix cache, no tier tokens) or from
    the other one (every cached token from the tier). Both kinds must give the same greedy
    tokens and logprobs. A first answer is a miss the router can tell the engine of."""
    prompt = _prompt(1)
    own: Answer | None = None
    tier: Answer | None = None
    words: list[bool] = []
    for i in range(12):
        cold = _complete(client, prompt, f"tenant-{i}")
        assert cold.cached == 0 and cold.tier == 0, cold
        words.append(cold.router_word)
        again = _complete(client, prompt, f"tenant-{i}")
        assert again.cached == 1024 and again.tier in (0, 1024), again
        assert not again.router_word, again
        if again.tier:
            tier = tier or again
        else:
            own = own or again
        if own and tier:
            break
    assert own is not None and tier is not None, "every repeat went to one replica"
    assert (tier.tokens, tier.logprobs) == (own.tokens, own.logprobs)
    # A new tenant's prompt: the router found it nowhere and said so, and the engine took its
    # word (it crossed Serve to the replica and vLLM to the connector). Not every time: a
    # router whose lookup is not answered within its timeout says nothing.
    assert any(words), words


def test_a_malformed_request_gets_an_openai_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_ID, prompt="w1 w2", max_tokens=-3)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_ID, prompt=_prompt(2, 5000), max_tokens=4)
    assert _complete(client, _prompt(3, 20), "after-400").tokens


def test_replicas_killed_mid_stream_are_replaced_and_the_tier_loses_nothing(
    client: openai.OpenAI,
) -> None:
    prompt = _prompt(4)
    _complete(client, prompt, "survivor")  # computed, stored in the tier
    hit = _complete(client, prompt, "survivor")
    assert hit.cached == 1024
    blocks = _tier_blocks()
    assert sum(blocks.values()) > 0
    longest = 3900
    with _ReplicaKiller() as killer:
        stream = client.completions.create(
            model=MODEL_ID,
            prompt=_prompt(5, 100),
            max_tokens=longest,
            temperature=0.0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        chunks = 0
        try:
            for _ in stream:
                chunks += 1
                if chunks == 1:
                    assert killer.kill() == 2
        except openai.APIError:
            pass  # the stream may end with an error or just end: either way, cut short
    assert 0 < chunks < longest
    # Every block is still there (the stream's own full blocks may have been added).
    kept = _tier_blocks()
    assert kept.keys() == blocks.keys() and all(kept[p] >= n for p, n in blocks.items())
    _wait_running()
    after = _complete(client, prompt, "survivor")
    assert after.tier == after.cached == 1024  # a new replica: all from the tier
    assert (after.tokens, after.logprobs) == (hit.tokens, hit.logprobs)


class _ReplicaKiller:
    """A Ray driver of its own (this process is not one), connected before the stream starts so
    that the kill lands mid-stream: on ``kill()`` it kills every engine replica of the app, as
    a node failure would; Serve's controller starts new ones."""

    _CODE = (
        "import sys, ray\n"
        "ray.init(address='auto', logging_level='ERROR')\n"
        "print('ready', flush=True)\n"
        "sys.stdin.readline()\n"
        "names = [a['name'] for a in ray.util.list_named_actors(all_namespaces=True)\n"
        "         if a['namespace'] == 'serve' and 'LLMServer' in a['name']]\n"
        "for n in names:\n"
        "    ray.kill(ray.get_actor(n, namespace='serve'), no_restart=True)\n"
        "print(len(names), flush=True)\n"
    )

    def __enter__(self) -> _ReplicaKiller:
        self._proc = subprocess.Popen(
            [sys.executable, "-c", self._CODE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert self._proc.stdout is not None
        assert self._proc.stdout.readline().strip() == "ready"
        return self

    def kill(self) -> int:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write("kill\n")
        self._proc.stdin.flush()
        return int(self._proc.stdout.readline())

    def __exit__(self, *exc: object) -> None:
        self._proc.kill()
        self._proc.wait()


@pytest.mark.parametrize("example", ["serve_llm_tessera.yaml", "serve_llm_cpu.yaml"])
def test_ray_builds_each_example_config_and_sets_up_its_connector_backend(example: str) -> None:
    """Ray Serve LLM's own path for a KV connector: the example's ``LLMConfig`` is built and
    its connector backend set up as a replica does. Ray's registry does not know
    TesseraConnector, so it takes its default backend, whose setup changes nothing: vLLM gets
    the connector settings exactly as written (so the tier needs no backend of its own)."""
    from ray.llm._internal.serve.engines.vllm.kv_transfer.base import DefaultConnectorBackend
    from ray.serve.llm import LLMConfig

    app = yaml.safe_load((ROOT / "deploy" / example).read_text())
    args = app["applications"][0]["args"]
    if "llm_configs" in args:
        (fields,) = args["llm_configs"]
    else:  # the CPU example goes through our builder, which writes the LLMConfig itself
        from tessera_ray.serve.llm import ServeLLMSettings

        fields = ServeLLMSettings.from_args(args).llm_config_dict()
    config = LLMConfig(**fields)
    written = json.loads(json.dumps(config.engine_kwargs["kv_transfer_config"]))
    assert written["kv_connector"] == "TesseraConnector"
    config.setup_engine_backend()
    assert type(config.kv_connector_backend) is DefaultConnectorBackend
    assert config.engine_kwargs["kv_transfer_config"] == written
