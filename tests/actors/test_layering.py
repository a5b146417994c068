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
    # The connector's side of the tier inside vLLM's processes (joins Ray as a driver).
    "serve/_connector_tier.py",
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
