"""What the ``tessera-ray`` subcommands share: their usage error and reading a custom model
geometry from a JSON file (``--config``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tessera_ray.errors import TesseraError

__all__ = ["UsageError", "read_geometry"]


class UsageError(TesseraError, ValueError):
    """A command-line argument is wrong."""


def read_geometry(path: str) -> dict[str, Any]:
    """The JSON object of ``--config path`` (checked as a geometry by the layout package)."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise UsageError(f"cannot read --config {path!r}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise UsageError(f"--config {path!r} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise UsageError(f"--config {path!r} must hold a JSON object of geometry fields")
    return data
