"""The engine demo's quiet output: what Ray, Serve and vLLM print (this process's and the
processes it starts) goes to the log file; the demo's own lines reach the terminal."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_SCRIPT = """
import logging, subprocess, sys
from pathlib import Path
from tessera_ray._cli_demo import _logs_to

logging.basicConfig()
with _logs_to(Path(sys.argv[1])) as out:
    print("a library's line")
    logging.getLogger("vllm").warning("a library's warning")
    subprocess.run([sys.executable, "-c", "print('a child process line')"], check=True)
    print("the demo's line", file=out)
print("after the run")
"""


def test_library_output_goes_to_the_log_and_the_demo_lines_to_the_terminal(
    tmp_path: Path,
) -> None:
    log = tmp_path / "demo.log"
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(log)], capture_output=True, text=True, check=True
    )
    assert out.stdout.splitlines() == ["the demo's line", "after the run"]
    assert out.stderr == ""
    written = log.read_text()
    for line in ("a library's line", "a library's warning", "a child process line"):
        assert line in written
    assert "the demo's line" not in written
