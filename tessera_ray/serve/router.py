"""A Ray Serve request router that routes on the tier's directory (the Serve shell around
:mod:`tessera_ray.serve.routing`).

For each request the router computes the request's tier block keys from its prompt token ids,
exactly as the connector's scheduler will (:func:`prompt_keys`), asks the directory for all of
them in one batched lookup, and hands :func:`choose_replica` each candidate replica's pool (the
pool on the replica's node) and queue length. The directory is authoritative and cluster-wide:
it knows what every pool holds, including prefixes other replicas or other deployments stored,
where a router that remembers the prompts it routed can only guess.

Used in a deployment's config::

    request_router_config:
      request_router_class: tessera_ray.serve.router:TesseraRequestRouter
      request_router_kwargs: {model_name: my-model, tokenizer: /models/my-model}

Prompts are read from the request's first argument (an OpenAI-style request object or dict):
``prompt`` as token ids is used as is; a text ``prompt`` or chat ``messages`` need
``tokenizer`` (a local path for ``transformers.AutoTokenizer``). A request whose tokens are
unknown, or whose lookup the tier does not answer within ``lookup_timeout_s``, is a fallback
(counted): routed on the blocks the router sent somewhere recently, else by power-of-two
choices. Blocks routed to a pool count as held there for
``routed_memory_s`` (:class:`~tessera_ray.serve.routing.RoutedBlocks`), so requests that share a
prefix and arrive before its first prefill has stored it are grouped; 0 turns that off. The
same memory per replica steers a prefix to the replica it was sent to among the replicas of
one node, whose own engine cache holds it.

Load: with ``balance_on="prompt_tokens"`` (the default) a replica's load is the prompt tokens of
the requests this router sent it that have not completed
(:class:`~tessera_ray.serve.routing.OutstandingTokens`), and the holder of a prefix may carry
``max_token_gap`` more than the least loaded replica; a request counts one prefill's worth of
work as the seconds it holds a replica for, which a queue length does not. With
``balance_on="requests"`` Serve's queue lengths are the load and ``max_queue_gap`` the bound.
A request whose tokens are unknown is routed on queue lengths either way.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Sequence
from typing import Any

from ray.serve._private.request_router.common import PendingRequest
from ray.serve._private.request_router.replica_wrapper import RunningReplica
from ray.serve._private.request_router.request_router import RequestRouter

from tessera_ray.actors.client import TesseraClient
from tessera_ray.core.results import TokenKey
from tessera_ray.errors import TierConfigError
from tessera_ray.metrics import Metrics, get_metrics
from tessera_ray.serve.routing import (
    BALANCE_ON,
    OutstandingTokens,
    ReplicaState,
    RouteChoice,
    RoutedBlocks,
    RouteReason,
    choose_replica,
    leading_blocks_by_pool,
)
from tessera_ray.vllm.backend import TIER_FAILURES
from tessera_ray.vllm.keys import prompt_keys, tenant_namespace
from tessera_ray.vllm.router_word import tell_miss

__all__ = ["TesseraRequestRouter", "request_prompt"]

log = logging.getLogger(__name__)
_CONNECT_RETRY_S = 10.0


def _field(obj: Any, name: str) -> Any:
    if isinstance(obj, dict):
        return obj.get(name)
    return getattr(obj, name, None)


def _request_id(pending: PendingRequest | None) -> str | None:
    """Serve's id of the request, the key its completion is reported under."""
    metadata = getattr(pending, "metadata", None)
    request_id = getattr(metadata, "internal_request_id", None)
    return request_id if isinstance(request_id, str) and request_id else None


def request_prompt(args: Sequence[Any]) -> tuple[Any, str | None] | None:
    """The prompt (token ids, text, or chat messages) and ``cache_salt`` of a Serve request's
    first argument; ``None`` when it carries none."""
    if not args:
        return None
    request = args[0]
    for name in ("prompt", "messages"):
        value = _field(request, name)
        if value is not None:
            salt = _field(request, "cache_salt")
            return value, salt if isinstance(salt, str) else None
    return None


class TesseraRequestRouter(RequestRouter):
    """Routes each request to the replica whose node's pool holds the longest leading run of
    its tier blocks, within ``max_queue_gap`` of the shortest queue (see
    :mod:`tessera_ray.serve.routing`)."""

    def initialize_state(  # type: ignore[override]  # Serve passes the config's kwargs
        self,
        *,
        model_name: str,
        ray_namespace: str = "tessera",
        namespace: str = "vllm",
        tokenizer: str | None = None,
        lookup_timeout_s: float = 0.05,
        max_queue_gap: int = 2,
        routed_memory_s: float = 30.0,
        balance_on: str = "prompt_tokens",
        max_token_gap: int = 16384,
        seed: int | None = None,
        client: TesseraClient | None = None,
        **_: Any,
    ) -> None:
        """``model_name`` and ``namespace`` must be the connector's (its ``model_name``, else
        vLLM's served model name; its ``namespace``), or no key will match."""
        if not model_name:
            raise TierConfigError("TesseraRequestRouter: model_name is required")
        if lookup_timeout_s <= 0 or max_queue_gap < 0 or routed_memory_s < 0 or max_token_gap < 0:
            raise TierConfigError(
                "TesseraRequestRouter: lookup_timeout_s must be > 0, max_queue_gap, "
                f"max_token_gap and routed_memory_s >= 0, got {lookup_timeout_s!r}, "
                f"{max_queue_gap!r}, {max_token_gap!r}, {routed_memory_s!r}"
            )
        if balance_on not in BALANCE_ON:
            raise TierConfigError(
                f"TesseraRequestRouter: balance_on must be one of {BALANCE_ON}, got {balance_on!r}"
            )
        self._by_tokens = balance_on == "prompt_tokens"
        self._max_token_gap = max_token_gap
        self._outstanding = OutstandingTokens()
        self._routed_replicas = RoutedBlocks(routed_memory_s)
        self._model_name = model_name
        self._ray_namespace = ray_namespace
        self._namespace = namespace
        self._tokenizer_path = tokenizer
        self._tokenizer: Any = None
        self._lookup_timeout_s = lookup_timeout_s
        self._max_queue_gap = max_queue_gap
        self._routed = RoutedBlocks(routed_memory_s)
        self._rng = random.Random(seed)
        self._client = client
        self._connect_after = 0.0
        self._metrics: Metrics = get_metrics()
        self.last_choice: RouteChoice | None = None
        """The most recent decision (for tests and logs)."""

    # ---------------------------------------------------------------- the facts

    async def _tier(self) -> TesseraClient | None:
        """The tier's client, connecting when there is none, at most every
        ``_CONNECT_RETRY_S`` (a tier that is not up costs requests nothing but the fallback)."""
        if self._client is None and time.monotonic() >= self._connect_after:
            self._connect_after = time.monotonic() + _CONNECT_RETRY_S
            try:
                self._client = await asyncio.to_thread(TesseraClient.connect, self._ray_namespace)
            except TIER_FAILURES as exc:  # counted as fallback routes until it is up
                log.info("no tier to route on yet: %s", exc)
        return self._client

    def _token_ids(self, prompt: Any) -> list[int] | None:
        """Token ids of a text prompt or chat messages, with the configured tokenizer."""
        if self._tokenizer_path is None:
            return None
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self._tokenizer_path)
        if isinstance(prompt, str):
            return list(self._tokenizer(prompt)["input_ids"])
        if isinstance(prompt, list):  # chat messages, as the engine renders them
            ids = self._tokenizer.apply_chat_template(
                prompt, tokenize=True, add_generation_prompt=True
            )
            return list(ids)
        return None

    async def _keys(
        self, client: TesseraClient, pending: PendingRequest | None
    ) -> tuple[str, list[TokenKey], int] | None:
        """The request's tier namespace, block keys (none for a prompt shorter than a block)
        and prompt length in tokens; ``None`` when its tokens are unknown."""
        found = request_prompt(pending.args) if pending is not None else None
        if found is None:
            return None
        prompt, salt = found
        try:
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                tokens: list[int] | None = prompt
            else:  # loading and running a tokenizer stays off Serve's event loop
                tokens = await asyncio.to_thread(self._token_ids, prompt)
        except (ValueError, TypeError, KeyError) as exc:  # the engine rejects such a prompt
            log.debug("router could not tokenize a prompt: %s", exc)
            tokens = None
        if tokens is None:
            return None
        layout = client.layout
        keys = prompt_keys(
            layout.fingerprint, self._model_name, tokens, layout.block_tokens, salt, self._namespace
        )
        return tenant_namespace(self._namespace, salt), keys, len(tokens)

    def _queue_len(self, replica: RunningReplica) -> int:
        queue = self._replica_queue_len_cache.get(replica.replica_id)
        return int(queue) if queue is not None else 0

    async def _held_by_pool(
        self, client: TesseraClient, namespace: str, keys: list[TokenKey]
    ) -> tuple[dict[str, int], dict[str, int]] | None:
        """Per pool, the leading run it holds: counting blocks routed there recently, and as
        the directory alone says; ``None`` when the directory did not answer in time."""
        if not keys:
            return {}, {}
        try:
            results = await asyncio.wait_for(
                client.alookup(namespace, keys, strict=True),
                self._lookup_timeout_s,
            )
        except TIER_FAILURES as exc:  # the tier is down or slow: route without it
            log.info("tier lookup for routing did not answer: %s", exc)
            return None
        return (
            leading_blocks_by_pool(results, self._routed.pools(keys)),
            leading_blocks_by_pool(results),
        )

    def _routed_only(self, keys: list[TokenKey]) -> dict[str, int]:
        """Per pool, the leading run of ``keys`` the router itself sent there recently."""
        return leading_blocks_by_pool([None] * len(keys), self._routed.pools(keys))

    # ---------------------------------------------------------------- Serve's hook

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        """The chosen replica first, the others after it (Serve tries them in order when the
        first is at capacity)."""
        if not candidate_replicas:
            return []
        held: tuple[dict[str, int], dict[str, int]] | None = None
        keys: list[TokenKey] = []
        tokens: int | None = None
        client = await self._tier()
        found = await self._keys(client, pending_request) if client is not None else None
        if client is not None and found is not None:
            namespace, keys, tokens = found
            held = await self._held_by_pool(client, namespace, keys)
            if held is not None and keys and not any(held[0].values()) and pending_request:
                # Nothing of it anywhere, nor sent anywhere lately: the engine need not look.
                tell_miss(pending_request.args[0], keys[0])
        by_tokens = self._by_tokens and tokens is not None
        states = [
            ReplicaState(
                str(r.replica_id),
                client.node_pool(r.node_id) if client is not None else None,
                self._outstanding.of(str(r.replica_id)) if by_tokens else self._queue_len(r),
            )
            for r in candidate_replicas
        ]
        answered = held is not None
        choice = choose_replica(
            states,
            held[0] if held is not None else (self._routed_only(keys) if keys else None),
            max_queue_gap=self._max_token_gap if by_tokens else self._max_queue_gap,
            rng=self._rng,
            stored_by_pool=held[1] if held is not None else None,
            answered=answered,
            routed_by_replica=(
                leading_blocks_by_pool([None] * len(keys), self._routed_replicas.pools(keys))
                if keys
                else None
            ),
        )
        pool = next(s.pool for s in states if s.replica_id == choice.replica_id)
        if keys:
            self._routed_replicas.note(keys, choice.replica_id)
            if pool is not None:
                self._routed.note(keys, pool)
        request_id = _request_id(pending_request)
        if tokens is not None and request_id is not None:
            self._outstanding.add(request_id, choice.replica_id, tokens)
        self._record(choice)
        chosen = next(r for r in candidate_replicas if str(r.replica_id) == choice.replica_id)
        return [[chosen], [r for r in candidate_replicas if r is not chosen]]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: Any, result: Any
    ) -> None:
        super().on_request_routed(pending_request, replica_id, result)
        request_id = _request_id(pending_request)
        if request_id is not None:
            self._outstanding.moved(request_id, str(replica_id))

    def on_request_completed(self, replica_id: Any, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        self._outstanding.done(internal_request_id)

    def _record(self, choice: RouteChoice) -> None:
        self.last_choice = choice
        deployment = getattr(self, "_deployment_id", None)
        tags = {
            "ray_namespace": self._ray_namespace,
            "deployment": getattr(deployment, "name", "") or "",
            "reason": choice.reason.value,
        }
        try:
            self._metrics.inc("tessera_route_requests", 1, tags)
            # Counted with the reason, beside the request: blocks per tier choice is then one
            # ratio of two counters that the same scrape carries.
            self._metrics.inc("tessera_route_held_blocks", choice.local_blocks, tags)
            if choice.reason is not RouteReason.FALLBACK:
                del tags["reason"]
                self._metrics.observe("tessera_route_local_blocks", choice.local_blocks, tags)
        except ValueError as exc:  # metrics never stop a request (a tag Ray refuses)
            log.debug("route metrics not recorded: %s", exc)
