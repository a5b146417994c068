"""One pool API across the layers: :class:`PoolRef` (what callers hold) has exactly
:class:`PoolApi`'s signatures and type hints, and the Ray shell and the pool service answer
every verb under the same parameter names, less the caller's deadline (``timeout_s``), which
only the protocol and ``PoolRef`` name, and only where the protocol does."""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from typing import Any

import pytest

from tessera_ray.actors._ray_handles import PoolRef
from tessera_ray.actors.pool_actor import PoolActor
from tessera_ray.actors.pool_api import DEADLINE, PoolApi
from tessera_ray.actors.pool_service import PoolService

VERBS = sorted(n for n, _ in inspect.getmembers(PoolApi, inspect.isfunction) if n[0] != "_")
SHELL: type = PoolActor.__ray_actor_class__  # type: ignore[attr-defined]
"""The class ``ray.remote`` wrapped: the actor's methods as written."""

RAY_ADDED = "_ray_trace_ctx"
"""The keyword-only parameter ``ray.remote`` adds to every actor method (its tracing)."""

Params = list[tuple[str, inspect._ParameterKind]]


def _params(fn: Callable[..., Any]) -> Params:
    return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]


def _own_params(impl: type, fn: Callable[..., Any]) -> Params:
    """``fn``'s parameters as its class wrote them."""
    return [p for p in _params(fn) if impl is not SHELL or p[0] != RAY_ADDED]


def _less_deadline(fn: Callable[..., Any]) -> Params:
    """The protocol's parameters without the caller's deadline, which comes last if at all."""
    params = _params(fn)
    names = [n for n, _ in params]
    if DEADLINE in names:
        assert names[-1] == DEADLINE, f"{fn.__name__}: the deadline is not the last parameter"
        params.pop()
    return params


def test_the_api_holds_the_data_path_verbs() -> None:
    assert {"reserve", "commit", "abort", "pin", "unpin", "read_pinned", "read_blocks"} <= set(
        VERBS
    )
    assert SHELL.__name__ == "PoolActor" and not hasattr(SHELL, "remote")


@pytest.mark.parametrize("verb", VERBS)
def test_pool_ref_has_the_api_signature(verb: str) -> None:
    api, ref = getattr(PoolApi, verb), getattr(PoolRef, verb, None)
    assert ref is not None, f"PoolRef lacks {verb}"
    assert inspect.iscoroutinefunction(ref)
    assert _params(ref) == _params(api)
    assert typing.get_type_hints(ref) == typing.get_type_hints(api)
    for want, got in zip(
        inspect.signature(api).parameters.values(),
        inspect.signature(ref).parameters.values(),
        strict=True,
    ):
        if want.default is ...:  # the implementation chooses (status's control-call deadline)
            assert got.default is not inspect.Parameter.empty, (verb, got.name)
        else:
            assert got.default == want.default, (verb, got.name)


@pytest.mark.parametrize("impl", [SHELL, PoolService], ids=["PoolActor", "PoolService"])
@pytest.mark.parametrize("verb", VERBS)
def test_the_shell_and_the_service_answer_every_verb(impl: type, verb: str) -> None:
    method = getattr(impl, verb, None)
    assert method is not None, f"{impl.__name__} lacks {verb}"
    assert _own_params(impl, method) == _less_deadline(getattr(PoolApi, verb)), impl.__name__
    if impl is SHELL:  # an async actor: every method a coroutine, as the protocol has them
        assert inspect.iscoroutinefunction(method)


def test_the_comparison_catches_a_renamed_parameter() -> None:
    """The comparison the tests above make catches the drift this module was written for: a
    layer naming a parameter otherwise (``namespace`` for ``access``)."""

    class Drifted:
        async def contains(
            self, namespace: str, token_keys: list[bytes], touch: bool = False
        ) -> None:
            pass  # the shell's signature before this module

    assert _params(Drifted.contains) != _less_deadline(PoolApi.contains)
