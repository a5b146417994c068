"""Layering checks shared by the packages' tests: what importing a module pulls in."""

from __future__ import annotations

import subprocess
import sys

__all__ = ["assert_loads_without"]


def assert_loads_without(modules: tuple[str, ...], forbidden: tuple[str, ...]) -> None:
    """Import ``modules`` in a fresh interpreter and fail if any top-level package of
    ``forbidden`` (or one of its submodules) got loaded with them."""
    code = (
        f"import sys, {', '.join(modules)}; "
        f"bad = sorted({{m for m in sys.modules for f in {forbidden!r} "
        "if m == f or m.startswith(f + '.')}); "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
