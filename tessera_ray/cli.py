"""The ``tessera-ray`` command line.

Bad input ends with one line on stderr naming what was wrong, and exit code 2 (argparse's own
convention for usage errors, kept for errors found after parsing too).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from tessera_ray._cli_config import UsageError, add_geometry_options, model_config
from tessera_ray._cli_demo import add_demo_command
from tessera_ray._cli_status import add_status_command
from tessera_ray._cli_tier import add_tier_commands
from tessera_ray.errors import TesseraError
from tessera_ray.layout import (
    ENGINE_FORMATS,
    EnginePages,
    Family,
    ModelLayout,
    account,
    build_layout,
    engine_pages,
    format_info,
    parse_contexts,
    preset_layout,
)
from tessera_ray.layout.report import (
    engine_json,
    layout_json,
    render_layout,
    render_presets,
    usage_json,
)

__all__ = ["main", "UsageError"]

PROG = "tessera-ray"
PLOT_MODELS = (
    "deepseek-v3",
    "deepseek-v2-lite",
    "deepseek-v4-flash",
    "llama-3.1-70b",
    "dense-80l-mha",
)


class _Parser(argparse.ArgumentParser):
    """argparse prints usage plus the error; we print only the one line that says what is wrong."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{PROG}: error: {message}\n")


def _layouts(ns: argparse.Namespace) -> list[ModelLayout]:
    custom = model_config(ns, format=ns.format, block_tokens=ns.block_tokens)
    if custom is not None:
        if ns.model is not None:
            raise UsageError("give --model or a model file (--config, --hf-config), not both")
        return [build_layout(custom)]
    if ns.model is not None:
        names = [m.strip() for m in ns.model.split(",")]
    elif ns.plot is not None:
        names = list(PLOT_MODELS)
    else:
        names = ["deepseek-v3"]
    if any(not n for n in names):
        raise UsageError(f"empty model name in --model {ns.model!r}")
    return [preset_layout(n, format=ns.format, block_tokens=ns.block_tokens) for n in names]


def _engine(layout: ModelLayout) -> EnginePages | None:
    """vLLM's caches for a DeepSeek-V4 layout in its engine format (other families: one page per
    layer, already the layout's own figures, so not repeated)."""
    if format_info(layout.format_name).family is not Family.V4:
        return None
    return engine_pages(layout) if layout.format_name in ENGINE_FORMATS else None


def _cmd_size(ns: argparse.Namespace) -> int:
    if ns.list:
        print(render_presets())
        return 0
    if ns.block_tokens is not None and ns.block_tokens <= 0:
        raise UsageError(f"--block-tokens must be a positive integer, got {ns.block_tokens}")
    contexts = parse_contexts(ns.context)
    layouts = _layouts(ns)
    results = [
        (layout, [account(layout, c) for c in contexts], _engine(layout)) for layout in layouts
    ]
    if ns.plot is not None:
        from tessera_ray._plot import plot_sizes

        plot_sizes(layouts, Path(ns.plot), max_context=max(contexts))
    if ns.json:
        doc = {
            "models": [
                {
                    **layout_json(layout),
                    **({"engine": engine_json(engine)} if engine is not None else {}),
                    "contexts": [usage_json(u) for u in usages],
                }
                for layout, usages, engine in results
            ]
        }
        print(json.dumps(doc, indent=2))
    else:
        print("\n\n".join(render_layout(*result) for result in results))
        if ns.plot is not None:
            print(f"\nplot written to {ns.plot}")
    return 0


def _cmd_fsck(ns: argparse.Namespace) -> int:
    from tessera_ray.storage.fsck import fsck

    report = fsck(Path(ns.root), repair=ns.repair, progress=True if ns.progress else None)
    print(report.render())
    return 0 if report.ok else 1


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="A distributed KV-cache tier for Ray.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    size = sub.add_parser(
        "size",
        help="exact KV bytes of a model at given context lengths",
        description="Exact KV-cache bytes of a model in the format its engine stores.",
    )
    size.add_argument("--model", help="preset name(s), comma-separated (see --list)")
    add_geometry_options(size)
    size.add_argument("--context", default="8k,32k,128k", help="e.g. 8k,32k,128k,1m (k = 1024)")
    size.add_argument("--format", help="storage format (see --list); default: the engine's")
    size.add_argument("--block-tokens", type=int, help="pin tokens per page (default: derived)")
    size.add_argument("--json", action="store_true", help="exact figures as JSON")
    size.add_argument("--list", action="store_true", help="list presets and formats")
    size.add_argument("--plot", help="draw bytes against context to this PNG (log axes)")
    size.set_defaults(handler=_cmd_size)
    fsck = sub.add_parser(
        "fsck",
        help="check every record of a disk-tier root (exit 1 when anything is wrong)",
        description="Verify every record (header, checksum, content hash) of a disk-tier root; "
        "report corrupt, orphan and partial files. Exit 0 when clean, 1 otherwise.",
    )
    fsck.add_argument("root", help="the disk tier's root directory")
    fsck.add_argument(
        "--repair", action="store_true", help="quarantine corrupt records, drop leftovers"
    )
    fsck.add_argument("--progress", action="store_true", help="show progress even off a TTY")
    fsck.set_defaults(handler=_cmd_fsck)
    add_tier_commands(sub)
    add_status_command(sub)
    add_demo_command(sub)
    return parser


_VALUE_OPTIONS = ("--context", "--block-tokens", "--num-blocks", "--shards")


def _glue_values(argv: Sequence[str]) -> list[str]:
    """``--context -4k`` -> ``--context=-4k``: argparse would read ``-4k`` as an option and
    report a missing value instead of the bad one."""
    out: list[str] = []
    it = iter(argv)
    for arg in it:
        if arg in _VALUE_OPTIONS:
            value = next(it, None)
            out.append(arg if value is None else f"{arg}={value}")
        else:
            out.append(arg)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    ns = parser.parse_args(_glue_values(sys.argv[1:] if argv is None else argv))
    try:
        return int(ns.handler(ns))
    except TesseraError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
