"""List the benchmark results whose measured code changed since the commit they recorded.

    python benchmarks/results_check.py [--results DIR]    # make bench-check; exit 1 when stale

A result (``benchmarks/results/*.json``) is stale when it records no commit, a ``-dirty`` one
(the run measured uncommitted code), a commit this history does not have, or when a file under
its ``measures`` paths differs between that commit and the work tree. A Python file counts as
changed only where its code did: docstrings and comments are left out of the comparison (its
syntax tree), so rewording a docstring never makes a number stale, and any change of code does.
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from common import MEASURES, measured_paths  # noqa: E402

__all__ = ["Stale", "stale", "code_of", "main"]


@dataclass(frozen=True)
class Stale:
    """One result that no longer measures the code in this checkout, and why."""

    name: str
    path: Path
    reason: str


def _git(root: Path, *argv: str) -> str:
    done = subprocess.run(["git", *argv], cwd=root, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise LookupError(done.stderr.strip() or f"git {' '.join(argv)} failed")
    return done.stdout


def _is_text(stmt: ast.stmt) -> bool:
    return (
        isinstance(stmt, ast.Expr)
        and isinstance(stmt.value, ast.Constant)
        and isinstance(stmt.value.value, str)
    )


def code_of(source: str) -> str | None:
    """The code of a Python file without its docstrings and comments (``None``: not Python).
    A string on a line of its own (a docstring, an attribute's docstring) does nothing when run,
    so every one is left out."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            stmts = getattr(node, field, None)
            if isinstance(stmts, list) and stmts and isinstance(stmts[0], ast.stmt):
                setattr(node, field, [s for s in stmts if not _is_text(s)] or [ast.Pass()])
    return ast.dump(tree)


def _changed(root: Path, commit: str, path: str) -> bool:
    try:
        old: str | None = _git(root, "show", f"{commit}:{path}")
    except LookupError:
        old = None  # the file is new since the commit
    file = root / path
    new = file.read_text(errors="replace") if file.exists() else None
    if old is None or new is None:
        return old != new
    if path.endswith(".py"):
        before, after = code_of(old), code_of(new)
        if before is not None and after is not None:
            return before != after
    return old != new


def stale(doc: dict[str, Any], name: str, root: Path = ROOT) -> str | None:
    """Why the result ``doc`` of benchmark ``name`` no longer measures this checkout's code, or
    ``None``. The paths are those it recorded and those ``MEASURES`` names today (a path added
    there since counts too)."""
    commit, recorded = doc.get("commit"), doc.get("measures")
    if not commit or not recorded:
        return "records no commit (measured before results recorded one)"
    if commit.endswith("-dirty"):
        return f"measured {commit}: uncommitted changes to the paths it measures"
    try:
        _git(root, "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}")
    except LookupError:
        return f"commit {commit} is not in this history"
    paths = sorted({*recorded, *(measured_paths(name) if name in MEASURES else ())})
    touched = _git(root, "diff", "--name-only", commit, "--", *paths).split()
    touched += _git(root, "ls-files", "--others", "--exclude-standard", "--", *paths).split()
    changed = sorted({p for p in touched if _changed(root, commit, p)})
    if not changed:
        return None
    shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
    return f"code changed since {commit}: {shown}"


def check(results: Path, root: Path = ROOT) -> tuple[list[Stale], int]:
    """Every stale result under ``results``, and how many results were checked."""
    found, checked = [], 0
    for path in sorted(results.glob("*.json")):
        doc = json.loads(path.read_text())
        name = doc.get("benchmark") or ("gpu" if "checks" in doc else None)
        if name is None:
            continue
        checked += 1
        reason = stale(doc, name, root)
        if reason is not None:
            found.append(Stale(name, path, reason))
    return found, checked


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=HERE / "results")
    ns = parser.parse_args(argv)
    found, checked = check(ns.results)
    for s in found:
        print(f"stale: {s.name} ({s.path.name}): {s.reason}")
    print(f"bench-check: {checked - len(found)} of {checked} results measure this checkout's code")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
