"""The pin channel between pool actors (``actors/channel.py``), both ends on one event loop:
answers, errors, concurrency, and what a hostile or broken peer gets (no Ray here)."""

from __future__ import annotations

import asyncio
import pickle
import struct
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import pytest

from tessera_ray.actors import channel
from tessera_ray.actors.channel import (
    MAX_FRAME_BYTES,
    ChannelAddress,
    ChannelClient,
    ChannelError,
    ChannelServer,
)
from tessera_ray.errors import TenantError


class Owner:
    """Handlers standing in for a pool: records what ran."""

    def __init__(self) -> None:
        self.pinned: list[tuple[str, list[bytes]]] = []
        self.unpinned: list[int] = []
        self.release = asyncio.Event()

    async def pin(self, namespace: str, keys: list[bytes]) -> dict[str, Any]:
        if namespace == "forbidden":
            raise TenantError(f"namespace {namespace!r} is not granted")
        self.pinned.append((namespace, keys))
        return {"id": len(self.pinned), "keys": keys}

    async def slow(self, seconds: float) -> str:
        await asyncio.sleep(seconds)
        return "late"

    async def gated(self, tag: str) -> str:
        await self.release.wait()
        return tag

    async def unpin(self, pin_id: int) -> None:
        self.unpinned.append(pin_id)


def run(test: Callable[[ChannelServer, ChannelAddress, Owner], Awaitable[None]]) -> None:
    async def main() -> None:
        owner = Owner()
        server = ChannelServer(
            {
                "pin": owner.pin,
                "unpin": owner.unpin,
                "slow": owner.slow,
                "gated": owner.gated,
            },
            host="127.0.0.1",
        )
        address = await server.start()
        try:
            await test(server, address, owner)
        finally:
            await server.close()

    asyncio.run(main())


async def still_serves(address: ChannelAddress) -> None:
    """A new connection with the secret gets its pin answered (the server survived)."""
    client = await ChannelClient.connect(address, 5.0)
    assert (await client.call("pin", "tenant", [], timeout_s=5.0))["id"] >= 1
    client.close()


async def settle(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.005)


def test_call_returns_the_handlers_answer() -> None:
    async def body(server: ChannelServer, address: ChannelAddress, owner: Owner) -> None:
        assert address.host == "127.0.0.1" and address.port > 0
        assert "secret" not in repr(address) and address.secret.hex() not in repr(address)
        client = await ChannelClient.connect(address, 5.0)
        keys = [i.to_bytes(2, "big") * 16 for i in range(300)]
        answer = await client.call("pin", "tenant", keys, timeout_s=5.0)
        assert answer == {"id": 1, "keys": keys}
        assert owner.pinned == [("tenant", keys)]
        assert server.served["pin"] == 1 and server.refused == 0
        client.close()

    run(body)


def test_handler_errors_reach_the_caller_as_raised() -> None:
    async def body(server: ChannelServer, address: ChannelAddress, owner: Owner) -> None:
        client = await ChannelClient.connect(address, 5.0)
        with pytest.raises(TenantError, match="not granted"):
            await client.call("pin", "forbidden", [], timeout_s=5.0)
        with pytest.raises(ChannelError, match="unknown channel op 'drop_all'"):
            await client.call("drop_all", timeout_s=5.0)
        # The connection survives both: errors are answers, not breakage.
        assert await client.call("pin", "tenant", [b"k" * 32], timeout_s=5.0) == {
            "id": 1,
            "keys": [b"k" * 32],
        }
        client.close()

    run(body)


def test_overlapping_calls_get_their_own_answers() -> None:
    async def body(server: ChannelServer, address: ChannelAddress, owner: Owner) -> None:
        client = await ChannelClient.connect(address, 5.0)
        first = asyncio.ensure_future(client.call("gated", "first", timeout_s=5.0))
        second = asyncio.ensure_future(client.call("pin", "tenant", [], timeout_s=5.0))
        # The second answer arrives while the first call still waits on its handler.
        assert await second == {"id": 1, "keys": []}
        assert not first.done()
        owner.release.set()
        assert await first == "first"
        client.close()

    run(body)


def test_one_way_send_runs_without_an_answer() -> None:
    async def body(server: ChannelServer, address: ChannelAddress, owner: Owner) -> None:
        client = await ChannelClient.connect(address, 5.0)
        client.send("unpin", 7)
        client.send("unpin", 8)
        await settle(lambda: owner.unpinned == [7, 8])
        assert server.served["unpin"] == 2
        client.close()

    run(body)


def test_a_wrong_secret_is_refused_before_any_frame_is_read() -> None:
    async def body(server: ChannelServer, address: ChannelAddress, owner: Owner) -> None:
        forged = replace(address, secret=bytes(32))
        client = await ChannelClient.connect(forged, 5.0)
        with pytest.raises(ChannelError):
            await client.call("pin", "tenant", [b"k" * 32], timeout_s=5.0)
        assert client.closed
        assert owner.pinned == [] and server.refused == 1
        await still_serves(address)  # for those who know the secret

    run(body)


@pytest.mark.parametrize("frame", ["garbage", "oversize"])
def test_a_malformed_frame_drops_only_that_connection(frame: str) -> None:
    async def body(server: ChannelServer, address: ChannelAddress, owner: Owner) -> None:
        reader, writer = await asyncio.open_connection(address.host, address.port)
        writer.write(b"tessera-channel/1\n" + address.secret)
        if frame == "garbage":
            junk = b"\x80\x05not a pickle"
            writer.write(struct.pack("!I", len(junk)) + junk)
        else:
            writer.write(struct.pack("!I", MAX_FRAME_BYTES + 1))
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 5.0) == b""  # closed, nothing answered
        writer.close()
        assert server.refused == 1 and owner.pinned == []
        await still_serves(address)

    run(body)


def test_a_request_larger_than_a_frame_is_refused_by_the_client() -> None:
    async def body(server: ChannelServer, address: ChannelAddress, owner: Owner) -> None:
        client = await ChannelClient.connect(address, 5.0)
        with pytest.raises(ChannelError, match="exceeds"):
            await client.call("pin", "tenant", [b"x" * (MAX_FRAME_BYTES + 1)], timeout_s=5.0)
        assert owner.pinned == []
        client.close()

    run(body)


def test_a_closed_server_fails_waiting_calls_at_once() -> None:
    async def body(server: ChannelServer, address: ChannelAddress, owner: Owner) -> None:
        client = await ChannelClient.connect(address, 5.0)
        waiting = asyncio.ensure_future(client.call("gated", "never", timeout_s=30.0))
        await settle(lambda: server.served["gated"] == 1)
        await server.close()
        began = asyncio.get_running_loop().time()
        with pytest.raises(ChannelError):
            await waiting
        assert asyncio.get_running_loop().time() - began < 5.0  # not the 30 s timeout
        with pytest.raises(ChannelError):
            await client.call("pin", "tenant", [], timeout_s=5.0)
        with pytest.raises(ChannelError, match="cannot reach"):
            await ChannelClient.connect(address, 5.0)

    run(body)


def test_a_call_past_its_timeout_closes_the_connection() -> None:
    async def body(server: ChannelServer, address: ChannelAddress, owner: Owner) -> None:
        client = await ChannelClient.connect(address, 5.0)
        with pytest.raises(TimeoutError):
            await client.call("slow", 2.0, timeout_s=0.05)
        # A late answer must never be taken for a later call's: the connection is gone.
        assert client.closed
        with pytest.raises(ChannelError):
            await client.call("pin", "tenant", [], timeout_s=5.0)

    run(body)


def test_frames_are_length_prefixed_pickles() -> None:
    """The wire format the server reads after the hello (pinned so both ends agree)."""

    async def body(server: ChannelServer, address: ChannelAddress, owner: Owner) -> None:
        reader, writer = await asyncio.open_connection(address.host, address.port)
        payload = pickle.dumps((5, "pin", ("tenant", [])))
        writer.write(b"tessera-channel/1\n" + address.secret)
        writer.write(struct.pack("!I", len(payload)) + payload)
        await writer.drain()
        (length,) = struct.unpack("!I", await reader.readexactly(4))
        assert pickle.loads(await reader.readexactly(length)) == (5, True, {"id": 1, "keys": []})
        writer.close()

    run(body)


def test_a_handler_that_returns_its_answer_is_answered_without_a_task() -> None:
    """Sync handlers (the pool's resident pin) answer in the read callback; their errors reach
    the caller like an async handler's."""

    def resident(keys: list[bytes]) -> list[bytes]:
        if not keys:
            raise TenantError("nothing asked")
        return keys[::-1]

    async def main() -> None:
        server = ChannelServer({"resident": resident}, host="127.0.0.1")
        address = await server.start()
        client = await ChannelClient.connect(address, 5.0)
        tasks_before = len(asyncio.all_tasks())
        assert await client.call("resident", [b"a", b"b"], timeout_s=5.0) == [b"b", b"a"]
        assert len(asyncio.all_tasks()) == tasks_before  # no task was made for it
        with pytest.raises(TenantError, match="nothing asked"):
            await client.call("resident", [], timeout_s=5.0)
        assert server.served["resident"] == 2
        client.close()
        await server.close()

    asyncio.run(main())


def _server_in_thread(handlers: dict[str, Any]) -> tuple[ChannelAddress, Callable[[], None]]:
    """A channel server on its own loop in another thread (as the owner is another process):
    returns its address and a function that closes it."""
    import threading

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = ChannelServer(handlers, host="127.0.0.1")
    address = asyncio.run_coroutine_threadsafe(server.start(), loop).result(5.0)

    def stop() -> None:
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(5.0)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5.0)

    return address, stop


def test_an_answer_is_read_on_the_socket_before_the_loop_runs_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the owner elsewhere, the client reads a prompt answer itself: callbacks queued on
    its loop before it awaited have not run when the answer is back."""
    # A generous wait, so that a stall of this machine cannot send the answer the slow way.
    monkeypatch.setattr(channel, "ANSWER_POLL_S", 2.0)
    address, stop = _server_in_thread({"echo": lambda x: x})

    async def main() -> None:
        client = await ChannelClient.connect(address, 5.0)
        assert await client.call("echo", 0, timeout_s=5.0) == 0  # connected and authenticated
        ran: list[int] = []
        for i in range(5):
            pending = client.request("echo", i)
            asyncio.get_running_loop().call_soon(ran.append, i)
            assert await pending.answer(5.0) == i
            assert ran == list(range(i))  # this round's callback waits for the loop
            await asyncio.sleep(0)
        client.close()

    try:
        asyncio.run(main())
    finally:
        stop()


def test_an_owner_that_goes_away_while_the_client_waits_on_the_socket_fails_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(channel, "ANSWER_POLL_S", 2.0)  # the close lands inside the wait

    async def wait_forever() -> None:
        await asyncio.Event().wait()

    address, stop = _server_in_thread({"hang": wait_forever})

    async def main() -> None:
        client = await ChannelClient.connect(address, 5.0)
        pending = client.request("hang")
        loop = asyncio.get_running_loop()
        loop.call_later(0.2, stop)  # the owner closes while the answer is awaited
        began = loop.time()
        with pytest.raises(ChannelError):
            await pending.answer(30.0)
        assert loop.time() - began < 5.0 and client.closed

    asyncio.run(main())
