"""The Ray boundary's typed calls turn every way of not reaching an actor into one error,
including a call whose arguments could not be moved to it (their owner is gone), which a caller
would otherwise take for a bug."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import ray

from tessera_ray.actors._ray_handles import ActorCache, PoolRef
from tessera_ray.errors import PoolUnavailableError


class _Method:
    def __init__(self, error: BaseException) -> None:
        self.error = error

    def remote(self, *args: Any) -> Any:
        async def fail() -> None:
            raise self.error

        return fail()


class _Handle:
    def __init__(self, error: BaseException) -> None:
        self.commit = _Method(error)


@pytest.mark.parametrize(
    "error",
    [
        ray.exceptions.OwnerDiedError("00ff", None, ""),
        ray.exceptions.GetTimeoutError("late"),
        ValueError("no actor of that name"),
    ],
    ids=["owner-died", "timeout", "no-name"],
)
def test_a_call_that_cannot_reach_its_pool_is_one_error(error: BaseException) -> None:
    cache = ActorCache("ns")
    cache.get = lambda name: _Handle(error)  # type: ignore[method-assign]
    with pytest.raises(PoolUnavailableError, match="did not answer commit"):
        asyncio.run(PoolRef(cache, "p").commit(1, "t", [], None))  # type: ignore[arg-type]


def test_an_error_inside_the_pool_is_not_taken_for_an_unreachable_one() -> None:
    cache = ActorCache("ns")
    cache.get = lambda name: _Handle(KeyError("a bug"))  # type: ignore[method-assign]
    with pytest.raises(KeyError):
        asyncio.run(PoolRef(cache, "p").commit(1, "t", [], None))  # type: ignore[arg-type]
