"""``tessera_ray.storage`` imports neither Ray nor the pool (``tessera_ray.core``)."""

from __future__ import annotations

import subprocess
import sys


def test_storage_imports_neither_ray_nor_core() -> None:
    code = (
        "import sys, tessera_ray.storage; "
        "bad = [m for m in sys.modules "
        "if m == 'ray' or m.startswith(('ray.', 'tessera_ray.core'))]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
