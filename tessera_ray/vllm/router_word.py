"""The tier-aware router's word to the engine it routes to: "the tier held none of this prompt's
blocks when I looked" (no vLLM import, no Ray import).

The router looks a prompt's tier blocks up in the directory before it picks a replica. When it
finds none (and sent none of them anywhere lately), the engine's own lookup a moment later would
almost always miss too, and on a busy engine it costs the request a scheduler step: the lookup
goes to the node's pool and on to the directory, and vLLM asks again next step when it is not
back within ``lookup_wait_s``. So the router writes the miss into the request's
``kv_transfer_params`` (vLLM hands them to the connector with the request), and the scheduler
answers "nothing to load" at once instead of looking again.

The word names the key of the prompt's first tier block: the scheduler takes it only for the
key it computes itself (the same tokens, tenant and model), only for :data:`ROUTER_WORD_S` after
it first sees the request, and never while this engine is storing that block itself. A wrong
or stale word costs at most a hit (the prefix is computed), never a wrong token: nothing is
loaded on its strength. A client may send the word itself, for a prompt it knows is new.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tessera_ray.core.results import TokenKey

__all__ = [
    "ROUTER_MISS_PARAM",
    "ROUTER_WORD_S",
    "ROUTER_WORD_TAKEN_PARAM",
    "router_missed",
    "tell_miss",
]

ROUTER_MISS_PARAM = "tessera_router_miss"
"""The ``kv_transfer_params`` key: the hex of the first tier block's key the router found no
copy of."""

ROUTER_WORD_TAKEN_PARAM = "tessera_router_word_taken"
"""In a finished request's ``kv_transfer_params`` (the OpenAI response's field): ``True`` where
the engine took the router's word and made no lookup of its own."""

ROUTER_WORD_S = 1.0
"""How long after the scheduler first sees a request it trusts the router's word: a request
that waits longer (for cache space, or preempted) is looked up afresh."""


def router_missed(params: Any, first_key: TokenKey) -> bool:
    """Whether ``params`` (a request's ``kv_transfer_params``) say the router found no copy of
    the block ``first_key`` names."""
    if not isinstance(params, Mapping):
        return False
    said = params.get(ROUTER_MISS_PARAM)
    return isinstance(said, str) and said == first_key.hex()


def tell_miss(request: Any, first_key: TokenKey) -> bool:
    """Write the router's miss of ``first_key`` into a Serve request's ``kv_transfer_params``
    (vLLM's OpenAI request object, or its body as a dict), keeping what else they hold;
    ``False`` where the request has no such field."""
    current = request.get("kv_transfer_params") if isinstance(request, dict) else None
    if not isinstance(request, dict):
        if not hasattr(request, "kv_transfer_params"):
            return False
        current = request.kv_transfer_params
    params = dict(current) if isinstance(current, Mapping) else {}
    params[ROUTER_MISS_PARAM] = first_key.hex()
    if isinstance(request, dict):
        request["kv_transfer_params"] = params
        return True
    try:
        request.kv_transfer_params = params
    except (AttributeError, TypeError, ValueError):  # a frozen or validating model refuses it
        return False
    return True
