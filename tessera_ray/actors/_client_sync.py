"""The client's blocking methods: each runs its ``a``-prefixed coroutine to completion.

Each operation of :class:`~tessera_ray.actors.client.TesseraClient` is written once, as a
coroutine; :func:`blocking` derives the plain method from it, so the two cannot drift apart.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine
from typing import Any, ParamSpec, TypeVar

from tessera_ray.actors._channel_book import ONE_CALL_LOOP

__all__ = ["blocking", "run_blocking"]

_P = ParamSpec("_P")
_T = TypeVar("_T")


def run_blocking(coro: Coroutine[Any, Any, _T]) -> _T:
    """Run a client coroutine from synchronous code (scripts, tests)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        token = ONE_CALL_LOOP.set(True)  # the loop asyncio.run makes ends with this call
        try:
            return asyncio.run(coro)
        finally:
            ONE_CALL_LOOP.reset(token)
    coro.close()
    raise RuntimeError(
        "TesseraClient's blocking methods cannot run inside an event loop; await the "
        "a-prefixed form instead (astore, alookup, afetch, aattend, aread, aevict, astatus)"
    )


def blocking(method: Callable[_P, Coroutine[Any, Any, _T]]) -> Callable[_P, _T]:
    """The blocking form of the coroutine method ``method``, with its parameters and docstring,
    named without the ``a`` (``store = blocking(astore)``)."""

    @functools.wraps(method)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> _T:
        return run_blocking(method(*args, **kwargs))

    # Named for itself, so tracebacks and reprs show the method the caller called.
    run.__name__ = method.__name__.removeprefix("a")
    run.__qualname__ = method.__qualname__.removesuffix(method.__name__) + run.__name__
    return run
