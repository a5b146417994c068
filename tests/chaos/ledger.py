"""What the chaos suite counts, and the JSON it leaves for RELIABILITY.md.

Every page a request gets back from the tier is compared with ground truth the tiny model
computed for that request's own tokens (never with what the tier says it stored); every block
the tier acknowledged is remembered with its true bytes, and at the end each one must be
served byte-exact or be listed as destroyed by an injected fault (and then it was detected, not
served).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["Ledger", "results_path"]

ROOT = Path(__file__).resolve().parents[2]


def results_path() -> Path:
    """Where the run's figures go (``TESSERA_RELIABILITY_JSON`` or ``build/reliability.json``)."""
    return Path(os.environ.get("TESSERA_RELIABILITY_JSON", ROOT / "build" / "reliability.json"))


@dataclass
class Fault:
    injected: int = 0
    survived: int = 0
    notes: list[str] = field(default_factory=list)


@dataclass
class Rejection:
    tried: int = 0
    rejected: int = 0
    state_unchanged: int = 0
    errors: set[str] = field(default_factory=set)


@dataclass
class Ledger:
    pages_checked: int = 0
    wrong_pages: int = 0
    wrong: list[str] = field(default_factory=list)
    truth: dict[tuple[str, bytes], bytes] = field(default_factory=dict)
    """(namespace, token key) -> sha256 of the true block bytes, for every acknowledged block."""
    destroyed: set[tuple[str, bytes]] = field(default_factory=set)
    """Blocks whose only copy an injected fault destroyed (detected, never served)."""
    faults: dict[str, Fault] = field(default_factory=dict)
    rejections: dict[str, Rejection] = field(default_factory=dict)
    figures: dict[str, Any] = field(default_factory=dict)
    retries: int = 0
    started: float = field(default_factory=time.time)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def check(self, namespace: str, key: bytes, got: np.ndarray | None, truth: np.ndarray) -> bool:
        """Compare one served block with ground truth; ``None`` (not served) is not a page."""
        return self.check_digest(namespace, key, got, hashlib.sha256(truth.tobytes()).digest())

    def check_digest(
        self, namespace: str, key: bytes, got: np.ndarray | None, want: bytes | None = None
    ) -> bool:
        """Compare a served block with the sha256 of its true bytes (by default: the truth
        recorded when the block was acknowledged)."""
        if got is None:
            return False
        want = self.truth[(namespace, key)] if want is None else want
        ok = hashlib.sha256(np.ascontiguousarray(got).tobytes()).digest() == want
        with self.lock:
            self.pages_checked += 1
            if not ok:
                self.wrong_pages += 1
                self.wrong.append(f"{namespace}/{key[:6].hex()}")
        return ok

    def acknowledge(self, namespace: str, key: bytes, truth: np.ndarray) -> None:
        with self.lock:
            self.truth[(namespace, key)] = hashlib.sha256(truth.tobytes()).digest()

    def fault(self, name: str, *, survived: bool, note: str = "") -> None:
        with self.lock:
            f = self.faults.setdefault(name, Fault())
            f.injected += 1
            f.survived += survived
            if note:
                f.notes.append(note)

    def rejection(self, name: str, *, rejected: bool, unchanged: bool, error: str) -> None:
        with self.lock:
            r = self.rejections.setdefault(name, Rejection())
            r.tried += 1
            r.rejected += rejected
            r.state_unchanged += unchanged
            r.errors.add(error)

    def write(self, path: Path, *, duration_s: float) -> None:
        data = {
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.started)),
            "machine": f"{os.cpu_count()} CPUs, {platform.machine()}, Python "
            f"{platform.python_version()}",
            "duration_s": round(duration_s, 1),
            "pages_checked": self.pages_checked,
            "wrong_pages": self.wrong_pages,
            "wrong": self.wrong[:20],
            "acknowledged_blocks": len(self.truth),
            "destroyed_blocks": len(self.destroyed),
            "retries": self.retries,
            "faults": {k: vars(v) for k, v in self.faults.items()},
            "rejections": {
                k: {**vars(v), "errors": sorted(v.errors)} for k, v in self.rejections.items()
            },
            "figures": self.figures,
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
