"""What the ``tessera-ray`` subcommands share: their usage error and reading a model's geometry
from a JSON file: our own fields (``--config``) or the model's Hugging Face ``config.json``
(``--hf-config``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from tessera_ray.errors import TesseraError
from tessera_ray.layout import ModelConfig, config_from_dict, config_from_hf

__all__ = ["UsageError", "read_geometry", "model_config", "add_geometry_options"]


class UsageError(TesseraError, ValueError):
    """A command-line argument is wrong."""


def read_geometry(path: str, option: str = "--config") -> dict[str, Any]:
    """The JSON object in the file ``path`` names (checked as a geometry by the layout
    package)."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise UsageError(f"cannot read {option} {path!r}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise UsageError(f"{option} {path!r} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise UsageError(f"{option} {path!r} must hold a JSON object")
    return data


def add_geometry_options(parser: argparse.ArgumentParser) -> None:
    """``--config`` and ``--hf-config``, the two ways to describe a model no preset names."""
    parser.add_argument("--config", help="JSON file with a custom model geometry (see README)")
    parser.add_argument(
        "--hf-config",
        help="the model's Hugging Face config.json, or its directory (nothing is downloaded)",
    )


def model_config(
    ns: argparse.Namespace, *, format: str | None = None, block_tokens: int | None = None
) -> ModelConfig | None:
    """The geometry ``--config`` or ``--hf-config`` describes (``None`` if neither is given),
    in ``format`` and with ``block_tokens`` where those are given."""
    if ns.config is not None and ns.hf_config is not None:
        raise UsageError("give at most one of --config and --hf-config")
    changes: dict[str, Any] = {}
    if format is not None:
        changes["format"] = format
    if block_tokens is not None:
        changes["block_tokens"] = block_tokens
    if ns.config is not None:
        return config_from_dict({**read_geometry(ns.config), **changes})
    if ns.hf_config is None:
        return None
    path = Path(ns.hf_config)
    if path.is_dir():
        path = path / "config.json"
    name = (path.parent.name if path.name == "config.json" else path.stem) or "model"
    data = read_geometry(str(path), "--hf-config")
    config = config_from_hf(data, name=name, format=format, source=str(path))
    return dataclasses.replace(config, block_tokens=block_tokens) if block_tokens else config
