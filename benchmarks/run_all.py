"""Run every ``benchmarks/bench_*.py`` (each alone, in its own process), then BENCHMARKS.md.

``python benchmarks/run_all.py [--quick]``; a benchmark that fails is reported and the rest
still run, and the script exits non-zero at the end.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    extra = sys.argv[1:]
    failed = []
    # The repository first on the path, so every benchmark imports this checkout's tessera_ray
    # whether or not the package is installed.
    paths = [str(HERE.parent), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    for script in sorted(HERE.glob("bench_*.py")):
        start = time.monotonic()
        print(f"== {script.name} {' '.join(extra)}", flush=True)
        code = subprocess.call([sys.executable, str(script), *extra], cwd=HERE.parent, env=env)
        print(f"== {script.name}: exit {code} in {time.monotonic() - start:.1f} s", flush=True)
        if code:
            failed.append(script.name)
    subprocess.check_call([sys.executable, str(HERE / "render.py")])
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
