"""A Ray Serve front for the tier: lookups and status over HTTP, as JSON.

Routes (every answer is JSON; a malformed request gets 4xx and ``{"error": ...}`` and changes
nothing in the tier):

- ``POST /v1/lookup`` ``{"namespace": str, "token_keys": [64 hex digits, ...]}`` -> per key
  ``hit`` and the replicas (pool, tier) that hold it; one directory round trip per shard.
- ``GET /v1/stats`` -> every pool's and directory shard's counters.
- ``GET /healthz`` -> ``{"ok": true, "pools": N, "shards": M}``.

Build it with :func:`build_app` (``serve run deploy/serve_config.yaml``, or
``serve.run(build_app({"ray_namespace": "tessera"}))``). The replica connects to the tier that
``tessera-ray start`` (or ``TesseraClient.start``) runs in that Ray namespace, and awaits the
client's ``a``-forms: a replica is an event loop, so blocking calls would stall it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import json
from collections.abc import Awaitable
from typing import Any

from ray import serve
from ray.serve import Application
from starlette.requests import Request
from starlette.responses import JSONResponse

from tessera_ray.actors.client import TesseraClient
from tessera_ray.core.hashing import TOKEN_KEY_BYTES
from tessera_ray.core.results import TokenKey
from tessera_ray.errors import (
    BadRequestError,
    DirectoryUnavailableError,
    PoolUnavailableError,
    TierConfigError,
)

__all__ = ["TierGateway", "build_app", "parse_lookup", "MAX_KEYS"]

MAX_KEYS = 4096
"""Most token keys one lookup may name (64 prompts of 64 blocks): bounds the request's cost."""
_STATUS_TIMEOUT_S = 10.0


def parse_lookup(body: bytes) -> tuple[str, list[TokenKey]]:
    """Validate a ``/v1/lookup`` body; raises :class:`BadRequestError` saying what is wrong."""
    try:
        doc = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequestError(f"body is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise BadRequestError("body must be a JSON object with namespace and token_keys")
    namespace, raw = doc.get("namespace"), doc.get("token_keys")
    if not isinstance(namespace, str) or not namespace:
        raise BadRequestError("namespace must be a non-empty string")
    if not isinstance(raw, list) or not raw:
        raise BadRequestError("token_keys must be a non-empty list of hex strings")
    if len(raw) > MAX_KEYS:
        raise BadRequestError(f"at most {MAX_KEYS} token_keys per lookup, got {len(raw)}")
    keys: list[TokenKey] = []
    for i, k in enumerate(raw):
        if not isinstance(k, str) or len(k) != 2 * TOKEN_KEY_BYTES:
            raise BadRequestError(f"token_keys[{i}] must be {2 * TOKEN_KEY_BYTES} hex digits")
        try:
            keys.append(TokenKey(bytes.fromhex(k)))
        except ValueError:
            raise BadRequestError(f"token_keys[{i}] is not hex: {k!r:.80}") from None
    return namespace, keys


def _plain(value: Any) -> Any:
    """Status dataclasses as JSON-ready values (enum keys by name)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {(k.name.lower() if isinstance(k, enum.Enum) else str(k)): _plain(v)
                for k, v in value.items()}  # fmt: skip
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


@serve.deployment(ray_actor_options={"num_cpus": 0})
class TierGateway:
    """One replica: a client of the tier in ``ray_namespace``, routes dispatched by path."""

    def __init__(self, ray_namespace: str = "tessera") -> None:
        self.client = TesseraClient.connect(ray_namespace)

    async def __call__(self, request: Request) -> JSONResponse:
        route = (request.method, request.url.path.rstrip("/") or "/")
        handler = {
            ("POST", "/v1/lookup"): self.lookup,
            ("GET", "/v1/stats"): self.stats,
            ("GET", "/healthz"): self.healthz,
        }.get(route)
        if handler is None:
            known = {"/v1/lookup", "/v1/stats", "/healthz"}
            if route[1] in known:
                return _error(405, f"{route[0]} not allowed on {route[1]}")
            return _error(404, f"no route {route[1]}; try /v1/lookup, /v1/stats, /healthz")
        try:
            return await handler(request)
        except BadRequestError as exc:
            return _error(400, str(exc))

    async def lookup(self, request: Request) -> JSONResponse:
        namespace, keys = parse_lookup(await request.body())
        results = await self.client.alookup(namespace, keys)
        out = []
        for key, r in zip(keys, results, strict=True):
            entry: dict[str, Any] = {"token_key": key.hex(), "hit": r is not None}
            if r is not None:
                entry["block_hash"] = f"{r.block_hash:032x}"
                entry["replicas"] = [
                    {"pool": rep.pool, "tier": rep.tier.name.lower()} for rep in r.replicas
                ]
            out.append(entry)
        hits = sum(e["hit"] for e in out)
        return JSONResponse({"namespace": namespace, "hits": hits, "results": out})

    async def _gather(self, calls: list[Awaitable[object]], names: list[str]) -> list[Any]:
        async def one(call: Awaitable[object], name: str) -> Any:
            try:
                return _plain(await call)
            except (PoolUnavailableError, DirectoryUnavailableError) as exc:
                # A dead actor is reported, not fatal to the answer.
                cause = exc.__cause__ or exc
                return {"name": name, "down": type(cause).__name__}

        return list(await asyncio.gather(*(one(c, n) for c, n in zip(calls, names, strict=True))))

    async def stats(self, request: Request) -> JSONResponse:
        c = self.client
        shards = [f"shard-{s}" for s in range(c.config.num_shards)]
        pools = await self._gather(
            [c.pool_ref(p).status(_STATUS_TIMEOUT_S) for p in c.pools], c.pools
        )
        dirs = await self._gather(
            [c.shard_ref(s).stats(_STATUS_TIMEOUT_S) for s in range(c.config.num_shards)], shards
        )
        return JSONResponse(
            {
                "ray_namespace": c.config.ray_namespace,
                "layout": c.layout.model,
                "block_bytes": c.layout.block_bytes,
                "pools": pools,
                "shards": dirs,
            }
        )

    async def healthz(self, request: Request) -> JSONResponse:
        c = self.client
        return JSONResponse(
            {
                "ok": True,
                "pools": len(c.pools),
                "shards": c.config.num_shards,
                "ray_namespace": c.config.ray_namespace,
            }
        )


def build_app(args: dict[str, Any] | None = None) -> Application:
    """The Serve application (an app builder: ``serve run`` passes the config's ``args``).

    ``args``: ``ray_namespace`` (default ``"tessera"``), ``num_replicas`` (default 1).
    """
    args = dict(args or {})
    unknown = set(args) - {"ray_namespace", "num_replicas"}
    if unknown:
        raise TierConfigError(
            f"unknown build_app args {sorted(unknown)}; known: ray_namespace, num_replicas"
        )
    replicas = int(args.get("num_replicas", 1))
    gateway = TierGateway.options(num_replicas=replicas)  # type: ignore[attr-defined]
    app: Application = gateway.bind(str(args.get("ray_namespace", "tessera")))
    return app
