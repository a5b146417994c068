"""The actors package keeps its logic in plain classes: only the thin Ray shells and the client
import Ray (STYLE rule 5), and the plain classes load without it."""

from __future__ import annotations

import ast
from pathlib import Path

import tessera_ray.actors
from tests._imports import assert_loads_without

SHELLS = {"_ray_names.py", "_ray_owner.py", "client.py", "directory_actor.py", "pool_actor.py"}


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


def test_only_the_shells_import_ray() -> None:
    package = Path(tessera_ray.actors.__file__).parent
    importing = {p.name for p in package.glob("*.py") if _imports_ray(p)}
    assert importing == SHELLS


def test_plain_classes_load_without_ray() -> None:
    assert_loads_without(
        (
            "tessera_ray.actors.pool_service",
            "tessera_ray.actors.directory",
            "tessera_ray.actors.fetcher",
        ),
        ("ray",),
    )
