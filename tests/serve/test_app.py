"""The Serve app on the shared test cluster, called over HTTP on 127.0.0.1."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from tessera_ray.actors.client import TesseraClient
from tessera_ray.actors.config import PoolServiceConfig, TierConfig
from tessera_ray.actors.messages import PoolStatus
from tessera_ray.core import token_key
from tessera_ray.errors import BadRequestError
from tessera_ray.layout import MLAConfig, build_layout
from tessera_ray.serve.app import parse_lookup
from tests.conftest import SimCluster

NS = "tessera-test-serve"
LAYOUT = build_layout(MLAConfig(name="tiny-mla", num_layers=2, num_heads=4))


def _keys(ns: str, n: int) -> list[bytes]:
    out, parent = [], None
    for b in range(n):
        parent = token_key(ns, LAYOUT.fingerprint, parent, list(range(b, b + 64)))
        out.append(parent)
    return out


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{not json", "not JSON"),
        (b"[1, 2]", "JSON object"),
        (b'{"token_keys": ["00"]}', "namespace"),
        (b'{"namespace": "t"}', "token_keys must be"),
        (b'{"namespace": "t", "token_keys": ["abc"]}', "64 hex digits"),
        (json.dumps({"namespace": "t", "token_keys": ["zz" * 32]}).encode(), "not hex"),
    ],
)
def test_parse_lookup_rejects_malformed_bodies(body: bytes, message: str) -> None:
    with pytest.raises(BadRequestError, match=message):
        parse_lookup(body)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def served(tessera_cluster: SimCluster) -> Iterator[tuple[str, TesseraClient]]:
    from ray import serve

    from tessera_ray.serve.app import build_app

    client = TesseraClient.start(
        TierConfig(
            model="tiny-mla", pool=PoolServiceConfig(num_blocks=8), num_shards=2, ray_namespace=NS
        ),
        layout=LAYOUT,
        pools_on=tessera_cluster.node_ids[:2],
    )
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_app({"ray_namespace": NS}), name="tessera", route_prefix="/")
        yield f"http://127.0.0.1:{port}", client
    finally:
        serve.shutdown()
        client.stop()


def _call(url: str, data: bytes | None = None) -> tuple[int, Any]:
    req = urllib.request.Request(url, data=data, method="POST" if data is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _state(client: TesseraClient) -> list[Any]:
    pools, shards = client.status()
    return [
        *((p.blocks_in_memory, p.pins, p.reservations) for p in pools if isinstance(p, PoolStatus)),
        *shards,
    ]


@pytest.mark.ray
def test_endpoints_over_http(served: tuple[str, TesseraClient]) -> None:
    base, client = served
    keys = _keys("tenant", 3)
    client.store(
        "tenant", keys[:2], np.full((2, LAYOUT.block_bytes), 7, np.uint8), pool=client.pools[0]
    )

    status, health = _call(f"{base}/healthz")
    assert status == 200 and health["ok"] is True and health["pools"] == 2

    status, doc = _call(
        f"{base}/v1/lookup",
        json.dumps({"namespace": "tenant", "token_keys": [k.hex() for k in keys]}).encode(),
    )
    assert status == 200 and doc["hits"] == 2
    assert [r["hit"] for r in doc["results"]] == [True, True, False]
    assert doc["results"][0]["replicas"] == [{"pool": client.pools[0], "tier": "memory"}]

    status, stats = _call(f"{base}/v1/stats")
    assert status == 200 and len(stats["pools"]) == 2 and len(stats["shards"]) == 2
    assert sum(p["blocks_in_memory"] for p in stats["pools"]) == 2

    before = _state(client)
    for body in (b"{oops", b'{"namespace": "tenant"}', b'{"namespace": "t", "token_keys": ["xy"]}'):
        status, err = _call(f"{base}/v1/lookup", body)
        assert status == 400 and "error" in err
    status, err = _call(f"{base}/v1/nope")
    assert status == 404 and "error" in err
    status, err = _call(f"{base}/healthz", b"{}")
    assert status == 405 and "error" in err
    assert _state(client) == before  # no lookup ran, nothing changed
