"""A direct control channel between pool actors, for the fetch's pin and unpin.

Why: a Ray actor call costs milliseconds even when the method does nothing, as long as the
NIXL READ of the pages it pins (docs/measured-choices.md). The pin sits on every fetch's
critical path, so the owner also serves it on a plain TCP connection, kept open per pair of
pools: one small frame each way, handled on the owner actor's own event loop (the same code as
its Ray ``pin`` method, no thread to lock against). Ray stays the way to find the channel and
the fallback when it is down.

Both ends are asyncio protocols, not streams, and each side takes the shortest way through its
loop. The server calls a handler in the callback that read the request; a handler that returns
its answer (rather than an awaitable) is answered in that same callback, with no task and no
further loop iteration. The client, awaiting an answer, first waits for it on the socket itself
for up to :data:`ANSWER_POLL_S` and reads it there, before it lets the loop wait: the pool
actor's loop is about to be held by the fetch's read anyway, and the answer is nearly always
that close (this took a round trip to a quarter of what asyncio streams took).

Trust: the listener takes a connection only after it presents the owner's 32-byte secret,
compared in constant time. Readers learn address and secret through a Ray call to the owner
(Ray's own authentication guards it); a new owner process has a new secret. Frames are pickles
(the same values Ray would carry) of at most ``MAX_FRAME_BYTES``, unpickled on the server only
after the secret matched. A connection that breaks fails every call waiting on it with
:class:`ChannelError` at once; the caller falls back to Ray or reports the owner unavailable.

No Ray import: tests drive both ends on one event loop (where the client's wait on the socket
finds nothing, since the server cannot run meanwhile, and falls back to the loop).
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import itertools
import logging
import os
import pickle
import secrets
import select
import struct
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from tessera_ray.errors import TesseraError

__all__ = [
    "ANSWER_POLL_S",
    "ChannelAddress",
    "ChannelClient",
    "ChannelError",
    "ChannelServer",
    "MAX_FRAME_BYTES",
    "PendingCall",
    "send_if_open",
]

log = logging.getLogger(__name__)

MAX_FRAME_BYTES = 64 << 20
"""Largest frame either end accepts (a pin of 100,000 blocks is a few MB)."""
ANSWER_POLL_S = 0.002
"""How long a client waits on the socket itself for an answer before yielding to its loop (the
loop is held meanwhile; about as long as an owner takes to answer a large pin)."""
_HELLO = b"tessera-channel/1\n"
_SECRET_BYTES = 32
_HELLO_TIMEOUT_S = 5.0
_LENGTH = struct.Struct("!I")
_READ_BYTES = 1 << 16
Handler = Callable[..., Any]
"""Called with the request's arguments; returns the answer, or an awaitable of it."""


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


def _frames(buffer: bytearray) -> list[bytes]:
    """Take every whole frame off the front of ``buffer`` (a partial one stays)."""
    out: list[bytes] = []
    start = 0
    while len(buffer) - start >= _LENGTH.size:
        (length,) = _LENGTH.unpack_from(buffer, start)
        if length > MAX_FRAME_BYTES:
            raise _BadFrameError(f"a {length} B frame exceeds {MAX_FRAME_BYTES} B")
        end = start + _LENGTH.size + length
        if len(buffer) < end:
            break
        out.append(bytes(buffer[start + _LENGTH.size : end]))
        start = end
    del buffer[:start]
    return out


def _framed(message: tuple[Any, ...]) -> bytes:
    frame = pickle.dumps(message)
    return _LENGTH.pack(len(frame)) + frame


class ChannelServer:
    """Serves ``handlers`` (op name -> callable) to authenticated connections."""

    def __init__(self, handlers: Mapping[str, Handler], *, host: str) -> None:
        self._handlers = dict(handlers)
        self._host = host
        self._secret = secrets.token_bytes(_SECRET_BYTES)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()  # the loop holds tasks weakly
        self._connections: set[_ServerConnection] = set()
        self.served: Counter[str] = Counter()
        """Requests answered (or run, for one-way ones), per op."""
        self.refused = 0
        """Connections closed because they did not present the secret or sent a bad frame."""
        self.address: ChannelAddress | None = None

    async def start(self) -> ChannelAddress:
        """Listen on a free port of ``host``; returns what readers need to connect."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _ServerConnection(self, _HELLO + self._secret), self._host, 0
        )
        port = self._server.sockets[0].getsockname()[1]
        self.address = ChannelAddress(self._host, port, self._secret)
        return self.address

    async def close(self) -> None:
        """Stop listening and drop every connection: callers waiting on one fail at once."""
        if self._server is not None:
            self._server.close()
        for connection in list(self._connections):
            connection.close()
        for task in list(self._tasks):
            task.cancel()
        if self._server is not None:
            try:
                await asyncio.wait_for(self._server.wait_closed(), _HELLO_TIMEOUT_S)
            except (TimeoutError, OSError):
                pass

    def _dispatch(
        self, connection: _ServerConnection, req_id: int | None, op: str, args: Any
    ) -> None:
        handler = self._handlers.get(op)
        try:
            if handler is None:
                raise ChannelError(f"unknown channel op {op!r}; known: {', '.join(self._handlers)}")
            self.served[op] += 1
            result = handler(*args)
        except Exception as e:  # the caller gets the error, as a Ray call would raise it
            connection.answer(req_id, False, e)
            return
        if not inspect.isawaitable(result):
            connection.answer(req_id, True, result)  # in this callback: no task, no wake-up
            return
        task = asyncio.get_running_loop().create_task(self._finish(connection, req_id, result))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @staticmethod
    async def _finish(
        connection: _ServerConnection, req_id: int | None, result: Awaitable[Any]
    ) -> None:
        try:
            value = await result
        except Exception as e:
            connection.answer(req_id, False, e)
        else:
            connection.answer(req_id, True, value)


class _ServerConnection(asyncio.Protocol):
    """One reader's connection: the hello first, then length-prefixed request frames."""

    def __init__(self, server: ChannelServer, hello: bytes) -> None:
        self._server = server
        self._hello = hello
        self._buffer = bytearray()
        self._authenticated = False
        self._transport: asyncio.Transport | None = None
        self._hello_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Not an asyncio.Transport under uvloop (Ray's async actors run on it): same methods.
        self._transport = cast(asyncio.Transport, transport)
        self._server._connections.add(self)
        self._hello_timer = asyncio.get_running_loop().call_later(_HELLO_TIMEOUT_S, self.close)

    def connection_lost(self, exc: Exception | None) -> None:
        self._server._connections.discard(self)
        if self._hello_timer is not None:
            self._hello_timer.cancel()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def data_received(self, data: bytes) -> None:
        if self._transport is None or self._transport.is_closing():
            return
        self._buffer += data
        if not self._authenticated:
            if len(self._buffer) < len(self._hello):
                return
            hello = bytes(self._buffer[: len(self._hello)])
            del self._buffer[: len(self._hello)]
            if self._hello_timer is not None:
                self._hello_timer.cancel()
            if not hmac.compare_digest(hello, self._hello):
                self._server.refused += 1
                self.close()
                return
            self._authenticated = True
        try:
            for frame in _frames(self._buffer):
                req_id, op, args = pickle.loads(frame)  # after the secret matched
                if not isinstance(op, str) or not isinstance(args, tuple):
                    raise _BadFrameError(f"a request names op {op!r} with {type(args).__name__}")
                self._server._dispatch(self, req_id, op, args)
                if self._transport.is_closing():
                    return
        except Exception as e:  # a malformed frame: drop the connection, keep serving others
            self._server.refused += 1
            log.warning("channel: dropped a connection after a bad frame: %s", e)
            self.close()

    def answer(self, req_id: int | None, ok: bool, value: Any) -> None:
        if req_id is None:  # one-way message: nobody waits for an answer
            if not ok:
                log.debug("channel: a one-way request failed: %s", value)
            return
        try:
            frame = _framed((req_id, ok, value))
        except Exception as e:
            frame = _framed((req_id, False, ChannelError(f"unpicklable answer: {e!r}")))
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(frame)


class _ClientConnection(asyncio.Protocol):
    """Feeds what the loop reads to its :class:`ChannelClient`."""

    def __init__(self) -> None:
        self.client: ChannelClient | None = None
        self.lost: Exception | None = None

    def data_received(self, data: bytes) -> None:
        if self.client is not None:
            self.client._received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = exc or ConnectionResetError("closed by the pool")
        if self.client is not None:
            self.client._fail(ChannelError(f"channel to the pool broke: {self.lost!r}"))


class ChannelClient:
    """One connection to a pool's channel; calls may overlap (answers carry request ids)."""

    def __init__(self, transport: asyncio.Transport, connection: _ClientConnection) -> None:
        self._transport = transport
        self._fd: int = transport.get_extra_info("socket").fileno()
        self._buffer = bytearray()
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[Any]] = {}
        self._broken: ChannelError | None = None
        connection.client = self
        if connection.lost is not None:
            self._fail(ChannelError(f"channel to the pool broke: {connection.lost!r}"))

    @classmethod
    async def connect(cls, address: ChannelAddress, timeout_s: float) -> ChannelClient:
        """Connect and authenticate; :class:`ChannelError` when the pool cannot be reached."""
        loop = asyncio.get_running_loop()
        try:
            transport, connection = await asyncio.wait_for(
                loop.create_connection(_ClientConnection, address.host, address.port), timeout_s
            )
        except (OSError, TimeoutError) as e:
            raise ChannelError(f"cannot reach {address.host}:{address.port}: {e!r}") from e
        transport.write(_HELLO + address.secret)
        return cls(transport, connection)

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
        self._transport.close()

    def _send(self, message: tuple[Any, ...]) -> None:
        if self._broken is not None:
            raise self._broken
        frame = _framed(message)
        if len(frame) - _LENGTH.size > MAX_FRAME_BYTES:
            raise ChannelError(f"a {len(frame)} B request exceeds {MAX_FRAME_BYTES} B")
        if self._transport.is_closing():
            self._fail(ChannelError("channel broken: the connection is closing"))
            raise self._broken  # type: ignore[misc]
        self._transport.write(frame)

    def _received(self, data: bytes) -> None:
        self._buffer += data
        try:
            for frame in _frames(self._buffer):
                req_id, ok, value = pickle.loads(frame)
                future = self._waiting.get(req_id)
                if future is not None and not future.done():
                    future.set_result((ok, value))
        except Exception as e:  # garbage from the pool: every waiting call fails now
            self._fail(ChannelError(f"channel to the pool broke: {e!r}"))
            self._transport.close()

    def _poll(self, future: asyncio.Future[Any], budget_s: float) -> None:
        """Wait on the socket itself, up to ``budget_s``, until ``future`` has its answer
        (see the module docstring); what arrives goes where the loop would have put it."""
        if self._transport.get_write_buffer_size():
            return  # the request still waits in the loop's buffer: only the loop can send it
        deadline = time.monotonic() + budget_s
        while not future.done() and self._broken is None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._fd], [], [], left)[0]:
                return
            try:
                data = os.read(self._fd, _READ_BYTES)
            except BlockingIOError:
                continue
            except OSError as e:
                self._fail(ChannelError(f"channel to the pool broke: {e!r}"))
                return
            if not data:  # closed by the pool: the loop sees it too and closes the transport
                self._fail(ChannelError("channel to the pool broke: closed by the pool"))
                return
            self._received(data)

    def _fail(self, err: ChannelError) -> None:
        if self._broken is None:
            self._broken = err
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(self._broken)
        self._waiting.clear()


class PendingCall:
    """A request on the wire (:meth:`ChannelClient.request`); await :meth:`answer` once."""

    __slots__ = ("_client", "_future", "_req_id")

    def __init__(self, client: ChannelClient, req_id: int, future: asyncio.Future[Any]) -> None:
        self._client = client
        self._req_id = req_id
        self._future = future

    async def answer(self, timeout_s: float, poll_s: float = ANSWER_POLL_S) -> Any:
        """The pool's answer (or its error raised); :class:`ChannelError` when the connection
        broke, ``TimeoutError`` past ``timeout_s`` (the connection is then closed: a late
        answer must not be taken for a later call's). ``poll_s``: how long to wait on the
        socket before yielding to the loop (0: at once, for a caller whose loop has other
        work meanwhile)."""
        began = time.monotonic()
        try:
            if not self._future.done() and poll_s > 0:
                self._client._poll(self._future, min(timeout_s, poll_s))
            if self._future.done():
                ok, value = self._future.result()
            else:
                left = max(timeout_s - (time.monotonic() - began), 0.0)
                ok, value = await asyncio.wait_for(self._future, left)
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


def send_if_open(channel: ChannelClient | None, op: str, *args: Any) -> bool:
    """Send ``op`` on ``channel`` without an answer; False when it cannot go that way (no
    channel, or a closed or broken one), and the caller uses the Ray call instead."""
    if channel is None or channel.closed:
        return False
    try:
        channel.send(op, *args)
    except ChannelError:
        return False
    return True
