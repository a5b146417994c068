"""The package keeps its logic in plain classes: only the Ray shells and the one Ray boundary
module import Ray, and the plain classes load without it."""

from __future__ import annotations

import ast
from pathlib import Path

import tessera_ray
from tests._imports import assert_loads_without

SHELLS = {
    # The boundary: actor names, handles, and typed calls that turn an unreachable actor into
    # one error; every call the actors, the client and the Serve gateway make goes through it.
    "actors/_ray_handles.py",
    # Ray actor classes and what starts them (the client calls through these two modules).
    "actors/pool_actor.py",
    "actors/directory_actor.py",
    "actors/deploy.py",
    "_cli_tier.py",
    # Ray Serve deployments and their router, and the demo that runs them.
    "serve/app.py",
    "serve/llm.py",
    "serve/router.py",
    "demo/serve_demo.py",
    # Ray's metrics API and the object-store transport are Ray features themselves.
    "metrics.py",
    "transport/ray_object.py",
}


def _imports_ray(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import) and any(
            a.name == "ray" or a.name.startswith("ray.") for a in node.names
        ):
            return True
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
            if node.module == "ray" or node.module.startswith("ray."):
                return True
    return False


def test_only_the_shells_and_the_boundary_import_ray() -> None:
    package = Path(tessera_ray.__file__).parent
    importing = {str(p.relative_to(package)) for p in package.rglob("*.py") if _imports_ray(p)}
    assert importing == SHELLS


REMOTE_CALLERS = {
    # The boundary: every call to a running actor goes through its typed calls.
    "actors/_ray_handles.py",
    # Starting the actors (``Actor.options(...).remote(...)``) is deployment.
    "actors/deploy.py",
    # Ray's object store as a transport: the owner's endpoint serves its pages.
    "transport/ray_object.py",
    # The demo asks each Serve replica where it runs (``__ray_call__``), a Ray feature.
    "demo/serve_demo.py",
}


def _remote_calls(path: Path) -> list[int]:
    """Lines that call ``.remote(...)`` on something other than the ``ray`` module itself (an
    actor method, an actor class, a task) or look an actor up by name (``get_actor``)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        owner = node.func.value
        if node.func.attr == "remote" and not (isinstance(owner, ast.Name) and owner.id == "ray"):
            lines.append(node.lineno)
        elif node.func.attr == "get_actor":
            lines.append(node.lineno)
    return sorted(lines)


def test_only_the_boundary_calls_actors() -> None:
    """No production module holds a raw actor handle to call: a pool is reached through its
    link (``actors/pool_link.py``), a directory shard through ``ShardRef``, both over the typed
    calls of ``_ray_handles`` (a deadline each, one error type when the actor is gone)."""
    package = Path(tessera_ray.__file__).parent
    calling = {
        str(p.relative_to(package)): _remote_calls(p)
        for p in package.rglob("*.py")
        if _remote_calls(p)
    }
    assert set(calling) == REMOTE_CALLERS, {k: v for k, v in calling.items()}


def test_the_remote_call_finder_sees_a_raw_actor_call(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import ray\n"
        "@ray.remote\n"
        "class A: ...\n"
        "def f(h):\n"
        "    ray.get(h.pin.remote(1))\n"
        "    return ray.get_actor('x')\n"
    )
    assert _remote_calls(sample) == [5, 6]


def test_plain_classes_load_without_ray() -> None:
    assert_loads_without(
        (
            "tessera_ray.actors.pool_service",
            "tessera_ray.actors.pool_api",
            "tessera_ray.actors.directory",
            "tessera_ray.actors.links",
            "tessera_ray.actors.fetcher",
        ),
        ("ray",),
    )
