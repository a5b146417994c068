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
