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
