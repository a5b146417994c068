"""A direct control channel between pool actors, for the fetch's pin and unpin.

Why: on a 2-core node a Ray actor call takes 1.3-2.4 ms even when the method does nothing
(``bench_transport.py``, row ``actor_noop_call``), longer than the NIXL READ of the 256 MLA
pages it pins (1.2-2 ms). The pin sits on every fetch's critical path, so the owner also serves
it on a plain TCP connection, kept open per pair of pools: one small frame each way, handled on
the owner actor's own event loop (the same code as its Ray ``pin`` method, no thread to lock
against). Ray stays the way to find the channel and the fallback when it is down.

Trust: the listener takes a connection only after it presents the owner's 32-byte secret,
compared in constant time. Readers learn address and secret through a Ray call to the owner
(Ray's own authentication guards it); a new owner process has a new secret. Frames are pickles
(the same values Ray would carry) of at most ``MAX_FRAME_BYTES``, unpickled on the server only
after the secret matched. A connection that breaks fails every call waiting on it with
:class:`ChannelError` at once; the caller falls back to Ray or reports the owner unavailable.

No Ray import: tests drive both ends on one event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import logging
import pickle
import secrets
import struct
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tessera_ray.errors import TesseraError

__all__ = [
    "ChannelAddress",
    "ChannelClient",
    "ChannelError",
    "ChannelServer",
    "MAX_FRAME_BYTES",
    "PendingCall",
]

log = logging.getLogger(__name__)

MAX_FRAME_BYTES = 64 << 20
"""Largest frame either end accepts (a pin of 100,000 blocks is a few MB)."""
_HELLO = b"tessera-channel/1\n"
_SECRET_BYTES = 32
_HELLO_TIMEOUT_S = 5.0
_LENGTH = struct.Struct("!I")
Handler = Callable[..., Awaitable[Any]]


class ChannelError(TesseraError, ConnectionError):
    """The channel to a pool is closed, broken or refused; use the Ray call instead."""


class _BadFrameError(ValueError):
    """A frame no honest peer sends (not a broken connection)."""


@dataclass(frozen=True, slots=True)
class ChannelAddress:
    """Where a pool serves its channel, and the secret a connection must present."""

    host: str
    port: int
    secret: bytes = field(repr=False)


class ChannelServer:
    """Serves ``handlers`` (op name -> coroutine function) to authenticated connections."""

    def __init__(self, handlers: Mapping[str, Handler], *, host: str) -> None:
        self._handlers = dict(handlers)
        self._host = host
        self._secret = secrets.token_bytes(_SECRET_BYTES)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()  # the loop holds tasks weakly
        self._writers: set[asyncio.StreamWriter] = set()
        self.served: Counter[str] = Counter()
        """Requests answered (or run, for one-way ones), per op."""
        self.refused = 0
        """Connections closed because they did not present the secret or sent a bad frame."""
        self.address: ChannelAddress | None = None

    async def start(self) -> ChannelAddress:
        """Listen on a free port of ``host``; returns what readers need to connect."""
        self._server = await asyncio.start_server(self._serve, self._host, 0)
        port = self._server.sockets[0].getsockname()[1]
        self.address = ChannelAddress(self._host, port, self._secret)
        return self.address

    async def close(self) -> None:
        """Stop listening and drop every connection: callers waiting on one fail at once."""
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.close()
        for task in list(self._tasks):
            task.cancel()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), _HELLO_TIMEOUT_S)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            hello = await asyncio.wait_for(
                reader.readexactly(len(_HELLO) + _SECRET_BYTES), _HELLO_TIMEOUT_S
            )
            if not hmac.compare_digest(hello, _HELLO + self._secret):
                self.refused += 1
                return
            lock = asyncio.Lock()
            while True:
                req_id, op, args = pickle.loads(
                    await _read_frame(reader)
                )  # after the secret matched
                task = asyncio.get_running_loop().create_task(
                    self._answer(writer, lock, req_id, op, args)
                )
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
            pass  # the peer went away (or never said hello): nothing to answer
        except asyncio.CancelledError:
            pass  # the loop is shutting down: the connection ends with it
        except Exception as e:  # a malformed frame: drop the connection, keep serving others
            self.refused += 1
            log.warning("channel: dropped a connection after a bad frame: %s", e)
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _answer(
        self,
        writer: asyncio.StreamWriter,
        lock: asyncio.Lock,
        req_id: int | None,
        op: str,
        args: tuple[Any, ...],
    ) -> None:
        handler = self._handlers.get(op)
        try:
            if handler is None:
                raise ChannelError(f"unknown channel op {op!r}; known: {', '.join(self._handlers)}")
            self.served[op] += 1
            reply: tuple[Any, ...] = (req_id, True, await handler(*args))
        except Exception as e:  # the caller gets the error, as a Ray call would raise it
            reply = (req_id, False, e)
        if req_id is None:  # one-way message: nobody waits for an answer
            return
        try:
            frame = pickle.dumps(reply)
        except Exception as e:
            frame = pickle.dumps((req_id, False, ChannelError(f"unpicklable answer: {e!r}")))
        async with lock:  # frames of concurrent answers must not interleave
            with contextlib.suppress(ConnectionError):
                writer.write(_LENGTH.pack(len(frame)) + frame)
                await writer.drain()


class ChannelClient:
    """One connection to a pool's channel; calls may overlap (answers carry request ids)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[Any]] = {}
        self._broken: ChannelError | None = None
        self._pump = asyncio.get_running_loop().create_task(self._read_answers())

    @classmethod
    async def connect(cls, address: ChannelAddress, timeout_s: float) -> ChannelClient:
        """Connect and authenticate; :class:`ChannelError` when the pool cannot be reached."""
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(address.host, address.port), timeout_s
            )
        except (OSError, TimeoutError) as e:
            raise ChannelError(f"cannot reach {address.host}:{address.port}: {e!r}") from e
        writer.write(_HELLO + address.secret)
        return cls(reader, writer)

    @property
    def closed(self) -> bool:
        return self._broken is not None

    async def call(self, op: str, *args: Any, timeout_s: float) -> Any:
        """Run ``op`` on the pool and return its answer (or raise its error). Raises
        :class:`ChannelError` when the connection breaks, ``TimeoutError`` past ``timeout_s``
        (the connection is then closed: a late answer must not be taken for a later call's)."""
        return await self.request(op, *args).answer(timeout_s)

    def request(self, op: str, *args: Any) -> PendingCall:
        """Send ``op`` now and return without waiting: the caller works while the pool answers
        (a fetch reserves its slots while the owner pins), then awaits
        :meth:`PendingCall.answer`. Raises :class:`ChannelError` at once if it cannot be sent."""
        req_id = next(self._ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting[req_id] = future
        try:
            self._send((req_id, op, args))
        except BaseException:
            self._waiting.pop(req_id, None)
            raise
        return PendingCall(self, req_id, future)

    def send(self, op: str, *args: Any) -> None:
        """Run ``op`` on the pool without waiting for, or getting, an answer."""
        self._send((None, op, args))

    def close(self) -> None:
        self._fail(ChannelError("channel closed"))
        self._writer.close()

    def _send(self, message: tuple[Any, ...]) -> None:
        if self._broken is not None:
            raise self._broken
        frame = pickle.dumps(message)
        if len(frame) > MAX_FRAME_BYTES:
            raise ChannelError(f"a {len(frame)} B request exceeds {MAX_FRAME_BYTES} B")
        try:
            self._writer.write(_LENGTH.pack(len(frame)) + frame)
        except (ConnectionError, RuntimeError) as e:
            self._fail(ChannelError(f"channel broken: {e!r}"))
            raise self._broken from e  # type: ignore[misc]

    async def _read_answers(self) -> None:
        try:
            while True:
                req_id, ok, value = pickle.loads(await _read_frame(self._reader))
                future = self._waiting.get(req_id)
                if future is not None and not future.done():
                    future.set_result((ok, value))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # closed, reset, or garbage: every waiting call fails now
            self._fail(ChannelError(f"channel to the pool broke: {e!r}"))

    def _fail(self, err: ChannelError) -> None:
        if self._broken is None:
            self._broken = err
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(self._broken)
        self._waiting.clear()
        if not self._pump.done() and asyncio.current_task() is not self._pump:
            self._pump.cancel()


class PendingCall:
    """A request on the wire (:meth:`ChannelClient.request`); await :meth:`answer` once."""

    __slots__ = ("_client", "_future", "_req_id")

    def __init__(self, client: ChannelClient, req_id: int, future: asyncio.Future[Any]) -> None:
        self._client = client
        self._req_id = req_id
        self._future = future

    async def answer(self, timeout_s: float) -> Any:
        """The pool's answer (or its error raised); :class:`ChannelError` when the connection
        broke, ``TimeoutError`` past ``timeout_s`` (the connection is then closed: a late
        answer must not be taken for a later call's)."""
        try:
            ok, value = await asyncio.wait_for(self._future, timeout_s)
        except TimeoutError:
            self._client.close()
            raise
        finally:
            self._client._waiting.pop(self._req_id, None)
        if not ok:
            raise value
        return value

    def cancel(self) -> None:
        """Stop waiting for the answer (it is dropped when it comes)."""
        self._client._waiting.pop(self._req_id, None)
        self._future.cancel()


async def _read_frame(reader: asyncio.StreamReader) -> bytes:
    (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if length > MAX_FRAME_BYTES:
        raise _BadFrameError(f"a {length} B frame exceeds {MAX_FRAME_BYTES} B")
    return await reader.readexactly(length)
