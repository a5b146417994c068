"""What ``benchmarks/gpu_bundle.sh`` packs for an offline GPU box, and the steps of it that are
easier in Python than in shell. Standard library only: it runs on the machine with the package
registries, before anything is installed.

    python benchmarks/_gpu_bundle.py plan [--python-version 3.12]   # what a bundle holds
    python benchmarks/_gpu_bundle.py requirements                   # the pinned wheels, one a line
    python benchmarks/_gpu_bundle.py source flashmla|cutlass        # "URL COMMIT PATH..."
    python benchmarks/_gpu_bundle.py unpack WHEELS_DIR SITE_DIR     # unzip the wheels, then trim
    python benchmarks/_gpu_bundle.py flashmla FLASHMLA_DIR          # reduce it to dense decode
    python benchmarks/_gpu_bundle.py check BUNDLE_DIR [--python PY] # an unpacked bundle

The bundle (docs/gpu-run.md) is one folder, ``gpu-bundle/``:

- ``tessera-ray/``: this checkout at HEAD (``git archive``);
- ``site/``: the wheels the box lacks (ray, nixl, jsonschema and its dependencies; what it has:
  docs/gpu-run.md), unzipped into one folder for ``PYTHONPATH`` and trimmed of what no check
  loads;
- ``flashmla/``: FlashMLA's sources reduced to its SM90 dense decode, with the CUTLASS headers
  they include, built on the box by ``benchmarks/gpu_box.sh``;
- ``on_box.sh``, ``MANIFEST.txt`` and ``python-version``.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

__all__ = [
    "Wheel",
    "Source",
    "WHEELS",
    "FLASHMLA",
    "CUTLASS",
    "DENSE_SOURCES",
    "BundleError",
    "unpack_wheels",
    "reduce_setup",
    "dense_sources",
    "unresolved_includes",
    "check_bundle",
]

HERE = Path(__file__).resolve().parent
DENSE_API = HERE / "flashmla_dense_api.cpp"
"""The reduced ``csrc/api/api.cpp``: the Python module binds dense decode alone."""


_Node = TypeVar("_Node", bound=ast.AST)


class BundleError(RuntimeError):
    """A source or wheel is not what this bundle was written for; the message says what."""


@dataclass(frozen=True, kw_only=True)
class Wheel:
    spec: str
    """``name==version``: pinned, so a bundle's size and content are what docs/gpu-run.md says."""
    why: str
    trim: tuple[str, ...] = ()
    """Paths (``fnmatch`` patterns, relative to the unpacked folder) left out of the bundle."""
    keep: tuple[str, ...] = ()
    """Paths the bundle must hold after trimming (``check``): the parts the checks load."""

    @property
    def name(self) -> str:
        return self.spec.split("==")[0]


# ray: no check imports it today (the checks use tessera_ray's core, kernels, transport, layout
# and models, none of which does) and none starts Ray (the engine check would, and it needs
# vLLM's GPU build, which no bundle can carry); packed so that a check reaching tessera_ray's
# actors or serve modules, which import it, still runs. Left out: the Java jars, the GCS and
# raylet binaries (so `import ray` works and `ray.init` does not), the dashboard's web build and
# the runtime-env agent's vendored packages.
# nixl-cu13: left out, the expert-parallel extension's builds for three torch versions and the
# wheel's .data (example programs and asio headers); the UCX libraries stay, gpu_pool's NIXL
# rows load them.
WHEELS: tuple[Wheel, ...] = (
    Wheel(
        spec="ray==2.60.0",
        why="imported by tessera_ray's actors and serve modules; no check starts Ray",
        trim=(
            "ray/jars",
            "ray/core/src/ray/gcs/gcs_server",
            "ray/core/src/ray/raylet/raylet",
            "ray/dashboard/client/build",
            "ray/_private/runtime_env/agent/thirdparty_files",
        ),
        keep=("ray/__init__.py", "ray/_raylet.so", "ray/thirdparty_files/psutil"),
    ),
    Wheel(
        spec="nixl==1.5.1",
        why="the meta package: `import nixl` loads nixl_cu13 for torch's CUDA 13",
        keep=("nixl/__init__.py", "nixl_meta_utils.py"),
    ),
    Wheel(
        spec="nixl-cu13==1.5.1",
        why="NIXL and its UCX for CUDA 13: gpu_pool's VRAM-to-VRAM rows",
        trim=("nixl_ep_cu13/*.so", "nixl_cu13-*.data"),
        keep=("nixl_cu13/_api.py", "nixl_cu13.libs/ucx", ".nixl_cu13.mesonpy.libs/libnixl.so"),
    ),
    Wheel(spec="jsonschema==4.26.0", why="imported by `import ray`", keep=("jsonschema",)),
    Wheel(spec="referencing==0.37.0", why="jsonschema's", keep=("referencing",)),
    Wheel(spec="rpds-py==2026.9.1", why="referencing's (compiled)", keep=("rpds",)),
    Wheel(
        spec="jsonschema-specifications==2025.9.1",
        why="jsonschema's",
        keep=("jsonschema_specifications",),
    ),
    # The box's list of packages (docs/gpu-run.md) names no attrs; jsonschema imports it: 68 KB.
    Wheel(spec="attrs==26.1.0", why="jsonschema's and referencing's", keep=("attrs", "attr")),
)


@dataclass(frozen=True, kw_only=True)
class Source:
    name: str
    url: str
    commit: str
    paths: tuple[str, ...]
    """What the bundle takes from the commit (``git archive`` pathspecs)."""
    dest: str
    """Where, under ``gpu-bundle/``."""


# The commit the H200 run built (docs/gpu-run.md); CUTLASS at the commit FlashMLA's submodule
# pins there.
FLASHMLA = Source(
    name="flashmla",
    url="https://github.com/deepseek-ai/FlashMLA.git",
    commit="9241ae3ef9bac614dd25e45e507e089f888280e0",
    paths=("setup.py", "flash_mla", "csrc", "LICENSE"),
    dest="flashmla",
)
CUTLASS = Source(
    name="cutlass",
    url="https://github.com/NVIDIA/cutlass.git",
    commit="147f5673d0c1c3dcf66f78d677fd647e4a020219",
    paths=("include", "tools/util/include", "LICENSE.txt"),
    dest="flashmla/csrc/cutlass",
)
SOURCES = {s.name: s for s in (FLASHMLA, CUTLASS)}

DENSE_SOURCES = (
    "csrc/api/api.cpp",
    "csrc/smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.cu",
    "csrc/smxx/decode/combine/combine.cu",
    "csrc/sm90/decode/dense/instantiations/bf16.cu",
)
"""What the reduced build compiles: the H200 run's dense decode (bf16, SM90; about 110 s on 16
cores, where the whole of FlashMLA takes far longer)."""
INCLUDE_DIRS = (
    "csrc",
    "csrc/kerutils/include",
    "csrc/sm90",
    "csrc/cutlass/include",
    "csrc/cutlass/tools/util/include",
)
"""FlashMLA's setup.py's include directories, relative to its root."""
PACKED = ("cutlass/", "cute/", "kerutils/")
"""Include prefixes the bundle must resolve itself; anything else (torch, CUDA, the C++ library)
comes from the box."""
# Forced, not left to the caller: the reduced sources do not hold the SM100 and fp16 kernels
# that the unset flags would compile or link against.
BUILD_FLAGS = {"FLASH_MLA_DISABLE_SM100": "1", "FLASH_MLA_DISABLE_FP16": "1"}


def plan(python_version: str) -> str:
    """The bundle's components as ``--dry-run`` lists them (and MANIFEST.txt records): one
    line a component (its folder in the bundle, then what it is), indented lines for its parts."""
    abi = f"cp{python_version.replace('.', '')}"

    def part(where: str, what: str) -> str:
        return f"{where:<24} {what}"

    lines = [
        part("tessera-ray/", "this checkout: git archive of HEAD"),
        part("site/", f"wheels for {abi} manylinux x86_64, unzipped, without their dependencies:"),
    ]
    for w in WHEELS:
        lines.append(part(f"  {w.spec}", w.why))
        lines += [part("", f"  left out: {t}") for t in w.trim]
    flags = " ".join(f"{k}={v}" for k, v in BUILD_FLAGS.items())
    for s in (FLASHMLA, CUTLASS):
        lines.append(part(f"{s.dest}/", f"{s.url} {s.commit[:7]}: {' '.join(s.paths)}"))
        if s is FLASHMLA:
            lines += [
                part("", f"  reduced to dense decode: {flags}, no git submodule step,"),
                part("", "  $CUDA_HOME/include/cccl among the includes; sources:"),
                *(part("", f"    {source}") for source in DENSE_SOURCES),
            ]
    lines += [
        part("on_box.sh", "the box's one command: build FlashMLA, then gpu_check.sh"),
        part("MANIFEST.txt", "this list, the commit and the wheel files"),
    ]
    return "\n".join(lines)


def _wheel_file(wheel: Wheel, files: Iterable[Path]) -> Path:
    # A wheel's file name starts with its name, "-" and "." as "_", then "-<version>-".
    name, version = wheel.spec.split("==")
    prefix = f"{re.sub(r'[-_.]+', '_', name).lower()}-{version}-"
    found = [f for f in files if f.name.lower().startswith(prefix) and f.suffix == ".whl"]
    if len(found) != 1:
        raise BundleError(f"expected one wheel for {wheel.spec}, found {[f.name for f in found]}")
    return found[0]


def _extract(wheel: Path, site: Path) -> None:
    """Unzip keeping each file's mode (zipfile drops it): UCX and ray load executables."""
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            path = Path(z.extract(info, site))
            mode = info.external_attr >> 16
            if mode and not info.is_dir():
                path.chmod(mode & 0o777)


def _matches(site: Path, pattern: str) -> list[Path]:
    parent, leaf = os.path.split(pattern)
    base = site / parent
    if not base.is_dir():
        return []
    return sorted(p for p in base.glob("*") if fnmatch.fnmatch(p.name, leaf))


def unpack_wheels(wheels_dir: Path, site: Path) -> list[str]:
    """Unzip every wheel of ``WHEELS`` into ``site`` and remove their ``trim`` paths; returns
    what was removed (``path: bytes``). A trim path that matches nothing is an error: the wheel
    is not the one this list was written for."""
    files = list(wheels_dir.iterdir())
    found = [_wheel_file(wheel, files) for wheel in WHEELS]  # all there before any is unpacked
    removed = []
    for wheel, file in zip(WHEELS, found, strict=True):
        _extract(file, site)
        for pattern in wheel.trim:
            hits = _matches(site, pattern)
            if not hits:
                raise BundleError(f"{wheel.spec} has nothing at {pattern}: update WHEELS")
            for hit in hits:
                size = _size(hit)
                shutil.rmtree(hit) if hit.is_dir() else hit.unlink()
                removed.append(f"{hit.relative_to(site)}: {size}")
    return removed


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _one(found: list[_Node], what: str) -> _Node:
    if len(found) != 1:
        raise BundleError(f"FlashMLA's setup.py has {len(found)} {what}, expected one")
    return found[0]


def _offset(lines: list[bytes], line: int, col: int) -> int:
    """A byte offset from the syntax tree's line and column (which counts UTF-8 bytes)."""
    return sum(len(text) for text in lines[: line - 1]) + col


def _list(items: list[str], first_line: bytes) -> str:
    """A list literal of ``items``, one a line, indented under the line it starts on."""
    indent = " " * (len(first_line) - len(first_line.lstrip()))
    return "[\n" + "".join(f"{indent}    {item},\n" for item in items) + f"{indent}]"


def reduce_setup(source: str) -> str:
    """FlashMLA's ``setup.py`` building dense decode alone: ``sources`` replaced by
    ``DENSE_SOURCES``; the statement that runs ``git submodule`` removed (the box has the
    headers, not a clone); ``$CUDA_HOME/include/cccl`` added to ``include_dirs`` (CUDA 13 moved
    ``cuda/std`` there); ``BUILD_FLAGS`` set at the top. Edits the syntax tree's spans, so a
    setup.py without exactly one of each is an error, never a silent no-op."""
    tree = ast.parse(source)
    raw = source.encode()
    lines = raw.splitlines(keepends=True)
    submodule = _one(
        [s for s in tree.body if isinstance(s, ast.Expr) and "submodule" in ast.unparse(s)],
        "statements running `git submodule`",
    )
    extension = _one(
        [
            n
            for n in ast.walk(tree)
            if isinstance(n, ast.Call) and ast.unparse(n.func).endswith("CUDAExtension")
        ],
        "CUDAExtension calls",
    )
    keywords = {k.arg: k.value for k in extension.keywords}
    sources, includes = keywords.get("sources"), keywords.get("include_dirs")
    if not isinstance(sources, ast.List) or not isinstance(includes, ast.List):
        raise BundleError("FlashMLA's CUDAExtension has no literal sources or include_dirs list")
    bound = {a.asname or a.name for s in tree.body if isinstance(s, ast.Import | ast.ImportFrom)
             for a in s.names}  # fmt: skip
    if not {"os", "CUDA_HOME"} <= bound:
        raise BundleError("FlashMLA's setup.py no longer imports os and CUDA_HOME")
    last_import = max(
        s.end_lineno or s.lineno for s in tree.body if isinstance(s, ast.Import | ast.ImportFrom)
    )
    items = [ast.get_source_segment(source, e) or "" for e in includes.elts]
    cccl = 'os.path.join(CUDA_HOME, "include", "cccl")'
    flags = "".join(f'os.environ["{k}"] = "{v}"\n' for k, v in BUILD_FLAGS.items())
    edits: list[tuple[ast.stmt | ast.expr, str]] = [
        (submodule, "# (tessera-ray's bundle: no `git submodule`; CUTLASS's headers are here)"),
        (sources, _list([f'"{s}"' for s in DENSE_SOURCES], lines[sources.lineno - 1])),
        (includes, _list([*items, cccl], lines[includes.lineno - 1])),
    ]
    head = _offset(lines, last_import + 1, 0)
    out = raw
    # From the last edit to the first, so each span's offsets still hold when it is replaced.
    for node, text in sorted(edits, key=lambda e: e[0].lineno, reverse=True):
        assert node.end_lineno is not None and node.end_col_offset is not None
        start = _offset(lines, node.lineno, node.col_offset)
        end = _offset(lines, node.end_lineno, node.end_col_offset)
        if start < head:
            raise BundleError("FlashMLA's setup.py has its build before its last import")
        out = out[:start] + text.encode() + out[end:]
    note = "# tessera-ray's bundle: the reduced sources hold neither SM100 nor fp16 kernels.\n"
    out = out[:head] + ("\n" + note + flags).encode() + out[head:]
    reduced = out.decode()
    if dense_sources(reduced) != DENSE_SOURCES:
        raise BundleError("the reduced setup.py does not list DENSE_SOURCES")
    return reduced


def dense_sources(setup_source: str) -> tuple[str, ...]:
    """The ``sources`` a setup.py's one CUDAExtension compiles."""
    tree = ast.parse(setup_source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("CUDAExtension"):
            for k in node.keywords:
                if k.arg == "sources" and isinstance(k.value, ast.List):
                    return tuple(ast.literal_eval(k.value))
    return ()


def reduce_flashmla(root: Path) -> None:
    """Reduce a FlashMLA tree in place: its setup.py (``reduce_setup``) and its api.cpp."""
    setup = root / "setup.py"
    setup.write_text(reduce_setup(setup.read_text()))
    shutil.copyfile(DENSE_API, root / "csrc" / "api" / "api.cpp")


_INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.MULTILINE)


def unresolved_includes(root: Path) -> list[str]:
    """Includes under ``PACKED`` prefixes that no file of the tree satisfies, followed from
    ``DENSE_SOURCES`` through every header they reach (inside ``#if`` branches too, so this
    over-approximates what the compiler opens). Each as ``header (from file)``."""
    dirs = [root / d for d in INCLUDE_DIRS]
    todo = [root / s for s in DENSE_SOURCES]
    seen: set[Path] = set(todo)
    missing = []
    while todo:
        current = todo.pop()
        for quote, name in _INCLUDE.findall(current.read_text(errors="replace")):
            near = [current.parent] if quote == '"' else []
            found = next((d / name for d in near + dirs if (d / name).is_file()), None)
            if found is None:
                if name.startswith(PACKED):
                    missing.append(f"{name} (from {current.relative_to(root)})")
                continue
            found = found.resolve()
            if found not in seen:
                seen.add(found)
                todo.append(found)
    return sorted(set(missing))


def check_bundle(bundle: Path) -> list[str]:
    """What is wrong with an unpacked bundle (empty: nothing found): each wheel's ``keep``
    paths present and ``trim`` paths absent, FlashMLA reduced, its packed includes resolved,
    the checkout's provenance stamped."""
    problems = []
    site = bundle / "site"
    for wheel in WHEELS:
        absent = [p for p in wheel.keep if not (site / p).exists()]
        problems += [f"site/{p} missing ({wheel.spec})" for p in absent]
        problems += [f"site/{t} not left out" for t in wheel.trim if _matches(site, t)]
    flashmla = bundle / FLASHMLA.dest
    setup = flashmla / "setup.py"
    if not setup.is_file():
        return [*problems, f"{setup.relative_to(bundle)} missing"]
    if dense_sources(setup.read_text()) != DENSE_SOURCES:
        problems.append("flashmla/setup.py does not build dense decode alone")
    if (flashmla / "csrc/api/api.cpp").read_text() != DENSE_API.read_text():
        problems.append("flashmla/csrc/api/api.cpp is not the reduced one")
    problems += [f"unresolved include {m}" for m in unresolved_includes(flashmla)]
    stamp = bundle / "tessera-ray" / "benchmarks" / "archive_commit.txt"
    if not stamp.is_file() or stamp.read_text().startswith("$Format"):
        problems.append(f"{stamp.relative_to(bundle)} holds no commit (not a git archive?)")
    for name in ("on_box.sh", "MANIFEST.txt", "python-version"):
        if not (bundle / name).is_file():
            problems.append(f"{name} missing")
    return problems


_IMPORTS = "import ray, jsonschema, nixl; print('imported ray', ray.__version__, 'and nixl')"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan")
    p.add_argument("--python-version", default="3.12")
    sub.add_parser("requirements")
    p = sub.add_parser("source")
    p.add_argument("name", choices=sorted(SOURCES))
    p = sub.add_parser("unpack")
    p.add_argument("wheels", type=Path)
    p.add_argument("site", type=Path)
    p = sub.add_parser("flashmla")
    p.add_argument("root", type=Path)
    p = sub.add_parser("check")
    p.add_argument("bundle", type=Path)
    p.add_argument(
        "--python",
        help="also import the trimmed wheels with this interpreter: the box's Python version "
        "with the box's packages (msgpack, pyyaml, numpy, typing-extensions, ...)",
    )
    ns = parser.parse_args(argv)
    try:
        if ns.command == "plan":
            print(plan(ns.python_version))
        elif ns.command == "requirements":
            print("\n".join(w.spec for w in WHEELS))
        elif ns.command == "source":
            s = SOURCES[ns.name]
            print(s.url, s.commit, s.dest, *s.paths)
        elif ns.command == "unpack":
            for line in unpack_wheels(ns.wheels, ns.site):
                print(f"left out {line} B")
        elif ns.command == "flashmla":
            reduce_flashmla(ns.root)
        else:
            problems = check_bundle(ns.bundle)
            for problem in problems:
                print(f"bundle: {problem}", file=sys.stderr)
            if ns.python and not problems:
                env = {**os.environ, "PYTHONPATH": str(ns.bundle / "site")}
                done = subprocess.run([ns.python, "-c", _IMPORTS], env=env, timeout=300)
                return done.returncode
            return 1 if problems else 0
    except BundleError as e:
        print(f"bundle: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
