"""A dependency-free progress line on stderr, for index rebuilds and fsck of large roots."""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """Redraws ``label: done/total (pct)`` at most ten times a second.

    Shown only when ``enabled`` (the caller decides: stderr is a TTY and the job is large, or a
    flag asked for it), so logs and test output stay clean.
    """

    def __init__(
        self, label: str, total: int, *, enabled: bool, stream: TextIO | None = None
    ) -> None:
        self.label = label
        self.total = max(total, 0)
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0
        self._last = 0.0

    @staticmethod
    def wanted(total: int, *, min_items: int, force: bool | None = None) -> bool:
        """Force wins; otherwise a TTY on stderr and at least ``min_items`` items."""
        if force is not None:
            return force
        return total >= min_items and sys.stderr.isatty()

    def advance(self, n: int = 1) -> None:
        self.done += n
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last >= 0.1 or self.done >= self.total:
            self._last = now
            self._draw()

    def _draw(self) -> None:
        pct = 100.0 * self.done / self.total if self.total else 100.0
        width = 30
        filled = int(width * min(pct, 100.0) / 100)
        bar = "#" * filled + "." * (width - filled)
        self.stream.write(f"\r{self.label}: [{bar}] {self.done}/{self.total} ({pct:5.1f}%)")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw()
            self.stream.write("\n")
            self.stream.flush()
