"""Rules of the repository a reader relies on, checked on the source itself: every path the
code and the docs cite exists, no control flow reads an error's text, and the Ray actors'
methods say what they take and return."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tessera_ray"

# A repo path in prose or code: a top directory, then a name; "<name>" and "*" are patterns.
_PATH = re.compile(
    r"(?<![\w/.<-])((?:tessera_ray|tests|benchmarks|docs|deploy|\.ci)/[\w./-]*\w)(?![<*\w])"
)
_TOP_DOC = re.compile(r"(?<![\w/.-])([A-Z][A-Z_]+\.md)\b")
# Written by a run (a GPU check, a benchmark), not kept in the repository until one ran.
_OUTPUTS = ("benchmarks/results/",)


def _citing_files() -> Iterator[Path]:
    yield from PACKAGE.rglob("*.py")
    yield from (ROOT / "benchmarks").glob("*.py")
    yield from (ROOT / "benchmarks").glob("*.sh")
    yield from (ROOT / "docs").glob("*.md")
    yield from (ROOT / "deploy").iterdir()
    yield from (ROOT / p for p in ("README.md", "BENCHMARKS.md", "RELIABILITY.md", "Makefile"))


def _test_docstrings() -> Iterator[tuple[Path, str]]:
    for path in (ROOT / "tests").rglob("*.py"):
        doc = ast.get_docstring(ast.parse(path.read_text()))
        if doc:
            yield path, doc


def test_every_cited_path_exists() -> None:
    texts = [(p, p.read_text(errors="replace")) for p in _citing_files() if p.is_file()]
    missing: dict[str, str] = {}
    for path, text in [*texts, *_test_docstrings()]:
        for match in (*_PATH.finditer(text), *_TOP_DOC.finditer(text)):
            cited = match.group(1).rstrip(".")
            if cited.startswith(_OUTPUTS) or (ROOT / cited).exists():
                continue
            missing.setdefault(cited, str(path.relative_to(ROOT)))
    assert not missing, f"cited but not in the repository (path: first file citing it): {missing}"


def _reads_error_text(node: ast.AST, caught: set[str]) -> bool:
    """Whether ``node`` (a condition) looks at the text of an exception or failure."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name):
            if sub.func.id in ("str", "repr") and any(
                isinstance(a, ast.Name) and a.id in caught for a in sub.args
            ):
                return True
        if isinstance(sub, ast.Attribute) and sub.attr in ("detail", "message", "args"):
            if isinstance(sub.value, ast.Name) and sub.value.id in caught | {"failure", "f"}:
                return True
    return False


def _conditions(tree: ast.AST) -> Iterator[tuple[ast.AST, set[str]]]:
    """Every branch condition with the names bound by the ``except`` clauses around it."""

    def walk(node: ast.AST, caught: set[str]) -> Iterator[tuple[ast.AST, set[str]]]:
        if isinstance(node, ast.ExceptHandler) and node.name:
            caught = caught | {node.name}
        if isinstance(node, (ast.If, ast.While, ast.IfExp, ast.Assert)):
            yield node.test, caught
        if isinstance(node, ast.comprehension):
            for cond in node.ifs:
                yield cond, caught
        if isinstance(node, ast.match_case) and node.guard is not None:
            yield node.guard, caught
        for child in ast.iter_child_nodes(node):
            yield from walk(child, caught)

    yield from walk(tree, set())


def test_no_control_flow_reads_an_error_message() -> None:
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for cond, caught in _conditions(tree):
            if _reads_error_text(cond, caught):
                offenders.append(f"{path.relative_to(ROOT)}:{cond.lineno}")
    assert not offenders, f"branches on an error's text (use its type or reason): {offenders}"


def test_the_error_text_check_catches_a_substring_branch() -> None:
    src = "try:\n    f()\nexcept OSError as e:\n    if 'refused' in str(e):\n        pass\n"
    conds = list(_conditions(ast.parse(src)))
    assert len(conds) == 1 and _reads_error_text(*conds[0])
    clean = "try:\n    f()\nexcept OSError as e:\n    if e.errno == 111:\n        pass\n"
    assert not any(_reads_error_text(c, k) for c, k in _conditions(ast.parse(clean)))


def _actor_classes() -> Iterator[tuple[Path, ast.ClassDef]]:
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ClassDef) and any(
                "ray.remote" in ast.unparse(d) for d in node.decorator_list
            ):
                yield path, node


@pytest.mark.parametrize("shell", ["pool_actor.py", "directory_actor.py"])
def test_the_actor_shells_are_found(shell: str) -> None:
    assert any(path.name == shell for path, _ in _actor_classes())


def test_no_actor_method_is_typed_any() -> None:
    untyped = []
    for path, cls in _actor_classes():
        for fn in cls.body:
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if fn.name.startswith("_") and fn.name != "__init__":
                continue
            annotations = [a.annotation for a in (*fn.args.args, *fn.args.kwonlyargs)]
            annotations.append(fn.returns)
            if any(a is not None and re.search(r"\bAny\b", ast.unparse(a)) for a in annotations):
                untyped.append(f"{path.name}:{cls.name}.{fn.name}")
    assert not untyped, f"actor methods typed Any at the Ray boundary: {untyped}"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package_modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imported(node: ast.Import | ast.ImportFrom, here: str, is_package: bool) -> Iterator[str]:
    """Dotted names an import statement in module ``here`` loads: ``from M import n`` yields
    ``M.n`` (a submodule, or a name of M: the caller keeps the longest part that is a module)."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    base = node.module or ""
    if node.level:
        package = here.split(".") if is_package else here.split(".")[:-1]
        anchor = package[: len(package) - (node.level - 1)]
        base = ".".join([*anchor, *([base] if base else [])])
    for alias in node.names:
        yield f"{base}.{alias.name}" if alias.name != "*" else base


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """``module -> modules of the package it imports``, from the source: every ``import`` and
    ``from ... import`` anywhere in the file (inside functions and ``TYPE_CHECKING`` blocks
    too), relative ones resolved. An import names the deepest module it reaches, so a package
    that re-exports a submodule's names has an edge to that submodule, and ``from pkg import
    name`` is an edge to ``pkg`` itself only when ``name`` is not a submodule of it."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = graph.setdefault(name, set())
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for dotted in _imported(node, name, is_package):
                parts = dotted.split(".")
                while parts and ".".join(parts) not in modules:
                    parts.pop()
                if parts and ".".join(parts) != name:
                    edges.add(".".join(parts))
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` as ``[a, b, ..., a]``, or ``None`` when it has none."""
    done: set[str] = set()
    for root in sorted(graph):
        if root in done:
            continue
        # Depth-first, iteratively: the path from the root, each module with its unseen edges.
        path = [root]
        edges = [iter(sorted(graph[root]))]
        while path:
            child = next(edges[-1], None)
            if child is None:
                done.add(path.pop())
                edges.pop()
            elif child in path:
                return [*path[path.index(child) :], child]
            elif child not in done:
                path.append(child)
                edges.append(iter(sorted(graph.get(child, ()))))
    return None


def test_the_package_import_graph_has_no_cycle() -> None:
    """No module of the package imports itself back through others (a circle is one design
    split over files: its modules cannot be read, tested or loaded one without the others)."""
    modules = _package_modules()
    assert "tessera_ray.core.pool" in modules and "tessera_ray.core" in modules
    graph = import_graph(modules)
    assert "tessera_ray.core.pool" in graph["tessera_ray.core"]  # a re-export is an edge
    cycle = find_cycle(graph)
    assert cycle is None, f"import circle: {' -> '.join(cycle)}"


def test_the_import_graph_sees_relative_guarded_and_submodule_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from pkg.sub import b\n",
        "sub/__init__.py": "X = 1\n",
        "sub/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..c import C\n",
        "c.py": "from pkg.sub import X\ndef f():\n    from . import d\n",
        "d.py": "import pkg.sub.b\n",
    }
    for rel, text in files.items():
        (pkg / rel).write_text(text)
    modules = {
        ".".join(p.relative_to(tmp_path).with_suffix("").parts).removesuffix(".__init__"): p
        for p in pkg.rglob("*.py")
    }
    graph = import_graph(modules)
    assert graph == {
        "pkg": {"pkg.sub.b"},
        "pkg.sub": set(),
        "pkg.sub.b": {"pkg.c"},
        "pkg.c": {"pkg.sub", "pkg.d"},
        "pkg.d": {"pkg.sub.b"},
    }
    assert find_cycle(graph) == ["pkg.sub.b", "pkg.c", "pkg.d", "pkg.sub.b"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def _foreign_private_attributes(tree: ast.AST) -> Iterator[ast.Attribute]:
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
            continue
        if node.attr.startswith("__") and node.attr.endswith("__"):
            continue  # dunders are protocol, not private state
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        yield node


def test_core_never_reaches_into_another_objects_private_state() -> None:
    """Each part of the engine changes its state only through its own methods: no module in
    ``tessera_ray/core`` reads or writes a ``_private`` attribute of anything but ``self`` or
    ``cls`` (another object, or another module's private names).

    Scoped to core, where the block pool's parts own the hot tables and no library private is
    needed. Elsewhere the package has uses this rule would have to carve out (a CLI typing
    argparse's ``_SubParsersAction``, a tokenizer's backing object, a channel pair in one
    module), which are not a pool's state."""
    offenders = []
    for path in sorted((PACKAGE / "core").rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        offenders += [
            f"{path.relative_to(ROOT)}:{n.lineno} {ast.unparse(n)}"
            for n in sorted(_foreign_private_attributes(tree), key=lambda n: n.lineno)
        ]
    assert not offenders, f"private state reached from outside its owner: {offenders}"


def test_the_private_state_check_sees_other_objects_only() -> None:
    src = "self._a\ncls._b\nother._c\nself.part._d\nx.__class__\nmod._helper()\n"
    found = [ast.unparse(n) for n in _foreign_private_attributes(ast.parse(src))]
    assert found == ["other._c", "self.part._d", "mod._helper"]
