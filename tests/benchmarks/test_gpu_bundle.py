"""The offline GPU bundle (``benchmarks/gpu_bundle.sh``, ``benchmarks/gpu_box.sh``) without the
network or a GPU: what ``--dry-run`` lists, the wheel trimming, FlashMLA's reduction to dense
decode on a setup.py of the same shape, the include check, the archive check, and the box
script run end to end on CPU (every check skipped, no FlashMLA build)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from tests.benchmarks.contract import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import _gpu_bundle as bundle
import common

sys.path.pop(0)


def _run(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env or _env()
    )


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "OUT"}  # OUT: the device tool's folder
    return {**env, "PYTHON": sys.executable, **extra}


def test_the_scripts_parse() -> None:
    for script in ("gpu_bundle.sh", "gpu_box.sh", "gpu_check.sh"):
        assert _run("bash", "-n", f"benchmarks/{script}").returncode == 0, script


def test_dry_run_lists_every_component_and_fetches_nothing(tmp_path: Path) -> None:
    out = tmp_path / "b.tar.gz"
    # No network reaches pip or git here: a dry run that tried either would fail.
    env = _env(PIP_NO_INDEX="1", GIT_ALLOW_PROTOCOL="none")
    done = _run("bash", "benchmarks/gpu_bundle.sh", "--dry-run", "--out", str(out), env=env)
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert "tessera-ray/" in text and "git archive of HEAD" in text and "cp312" in text
    for wheel in bundle.WHEELS:
        assert wheel.spec in text
        assert all(f"left out: {t}" in text for t in wheel.trim)
    assert {"ray==2.60.0", "nixl==1.5.1", "nixl-cu13==1.5.1", "jsonschema==4.26.0"} <= {
        w.spec for w in bundle.WHEELS
    }
    assert bundle.FLASHMLA.commit.startswith("9241ae3") and bundle.CUTLASS.commit[:7] in text
    assert all(s in text for s in bundle.DENSE_SOURCES) and len(bundle.DENSE_SOURCES) == 4
    assert "FLASH_MLA_DISABLE_SM100=1" in text and "include/cccl" in text and "on_box.sh" in text
    assert not out.exists()
    assert "--python-version" in _run("bash", "benchmarks/gpu_bundle.sh", "--help").stdout


def _wheel(dist: Path, spec: str, files: dict[str, int]) -> None:
    """A wheel file as pip names it, holding ``files`` (path -> mode)."""
    name, version = spec.split("==")
    path = dist / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for file, mode in files.items():
            info = zipfile.ZipInfo(file)
            info.external_attr = (0o100000 | mode) << 16
            z.writestr(info, b"x")


def _site(tmp_path: Path) -> Path:
    """Every wheel of the list, each holding its ``keep`` and ``trim`` paths (an executable
    among them), unpacked into one folder."""
    dist, site = tmp_path / "wheels", tmp_path / "bundle" / "site"
    dist.mkdir()
    for wheel in bundle.WHEELS:
        paths = [*wheel.keep, *(t.replace("*", "a") for t in wheel.trim)]
        files = {f"{p}/f" if "." not in p.rsplit("/", 1)[-1] else p: 0o644 for p in paths}
        files[f"{wheel.name.replace('-', '_')}_tool"] = 0o755
        if wheel.name == "nixl-cu13":
            files["nixl_ep_cu13/__init__.py"] = 0o644  # beside the trimmed .so: kept
        _wheel(dist, wheel.spec, files)
    removed = bundle.unpack_wheels(dist, site)
    assert len(removed) == sum(len(w.trim) for w in bundle.WHEELS)
    return site


def test_unpacking_trims_what_no_check_loads_and_keeps_the_rest(tmp_path: Path) -> None:
    site = _site(tmp_path)
    for wheel in bundle.WHEELS:
        assert all((site / p).exists() for p in wheel.keep)
        assert all(not list(site.glob(t)) for t in wheel.trim)
    assert (site / "nixl_ep_cu13" / "__init__.py").exists()
    assert os.access(site / "ray_tool", os.X_OK)  # modes survive the unzip
    assert not os.access(site / "ray" / "__init__.py", os.X_OK)


def test_a_wheel_that_changed_layout_or_is_missing_is_an_error(tmp_path: Path) -> None:
    dist = tmp_path / "wheels"
    dist.mkdir()
    for wheel in bundle.WHEELS:
        _wheel(dist, wheel.spec, {"x/y.py": 0o644})  # none has its trim paths
    with pytest.raises(bundle.BundleError, match=r"ray==2\.60\.0 has nothing at ray/jars"):
        bundle.unpack_wheels(dist, tmp_path / "site")
    next(dist.glob("attrs-*")).unlink()
    with pytest.raises(bundle.BundleError, match="one wheel for attrs"):
        bundle.unpack_wheels(dist, tmp_path / "site2")
    assert not (tmp_path / "site2").exists()  # nothing unpacked before the check


# A setup.py of FlashMLA's shape (not its text): the imports, the submodule step, and one
# CUDAExtension with more sources than dense decode needs.
SETUP = textwrap.dedent(
    """\
    import os
    import subprocess
    from pathlib import Path

    from setuptools import setup
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension, CUDA_HOME

    subprocess.run(["git", "submodule", "update", "--init", "csrc/cutlass"])
    here = Path(__file__).parent

    setup(
        name="flash_mla",
        ext_modules=[
            CUDAExtension(
                name="flash_mla.cuda",
                sources=[
                    # the bindings
                    "csrc/api/api.cpp",
                    "csrc/other/prefill.cu",  # ünïcode in a comment shifts byte offsets
                    "csrc/sm90/decode/dense/instantiations/fp16.cu",
                ],
                extra_compile_args={"nvcc": ["-O3"]},
                include_dirs=[
                    here / "csrc",
                    here / "csrc" / "cutlass" / "include",
                ],
            )
        ],
        cmdclass={"build_ext": BuildExtension},
    )
    """
)


def test_the_setup_is_reduced_to_dense_decode() -> None:
    reduced = bundle.reduce_setup(SETUP)
    assert bundle.dense_sources(reduced) == bundle.DENSE_SOURCES
    compile(reduced, "setup.py", "exec")
    assert '"submodule"' not in reduced
    assert 'os.environ["FLASH_MLA_DISABLE_SM100"] = "1"' in reduced
    assert 'os.environ["FLASH_MLA_DISABLE_FP16"] = "1"' in reduced
    # The flags are set before anything reads them, and the includes keep their order.
    assert reduced.index("FLASH_MLA_DISABLE_FP16") < reduced.index("setup(")
    includes = reduced[reduced.index("include_dirs=[") :]
    assert includes.index('"csrc"') < includes.index('"include", "cccl"') < includes.index("]")
    assert 'extra_compile_args={"nvcc": ["-O3"]}' in reduced


@pytest.mark.parametrize(
    ("before", "after", "message"),
    [
        ('subprocess.run(["git", "submodule"', 'print(["git", "sub"', "has 0 statements"),
        ("    CUDAExtension(", "    dict(", "has 0 CUDAExtension calls"),
        (", CUDA_HOME", "", "no longer imports os and CUDA_HOME"),
        ("sources=[", "sources=[] + [", "no literal sources"),
    ],
)
def test_a_setup_of_another_shape_is_an_error_not_a_silent_no_op(
    before: str, after: str, message: str
) -> None:
    assert before in SETUP
    with pytest.raises(bundle.BundleError, match=message):
        bundle.reduce_setup(SETUP.replace(before, after))


def _flashmla(root: Path) -> None:
    """A FlashMLA tree whose dense-decode sources reach CUTLASS, CuTe and kerutils headers."""
    files = {
        "setup.py": SETUP,
        "csrc/api/api.cpp": "",
        "csrc/api/dense_decode.h": '#include "common.h"\n#include <cutlass/a.h>\n',
        "csrc/api/common.h": "#include <torch/extension.h>\n#include <kerutils/k.h>\n",
        "csrc/kerutils/include/kerutils/k.h": "",
        "csrc/smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.cu": "",
        "csrc/smxx/decode/combine/combine.cu": '#include "params.h"\n',
        "csrc/params.h": "  #  include <cute/tensor.hpp>\n",
        "csrc/sm90/decode/dense/instantiations/bf16.cu": '#include "../traits.h"\n',
        "csrc/sm90/decode/dense/traits.h": "#include <cutlass/a.h>\n#include <cuda_runtime.h>\n",
        "csrc/cutlass/include/cutlass/a.h": "#include <cute/tensor.hpp>\n",
        "csrc/cutlass/include/cute/tensor.hpp": "#include <vector>\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    bundle.reduce_flashmla(root)  # api.cpp becomes the reduced one: it includes dense_decode.h


def test_the_include_check_follows_headers_to_what_the_bundle_must_hold(tmp_path: Path) -> None:
    _flashmla(tmp_path)
    assert bundle.unresolved_includes(tmp_path) == []
    (tmp_path / "csrc/cutlass/include/cute/tensor.hpp").unlink()
    (tmp_path / "csrc/kerutils/include/kerutils/k.h").unlink()
    assert bundle.unresolved_includes(tmp_path) == [
        "cute/tensor.hpp (from csrc/cutlass/include/cutlass/a.h)",
        "cute/tensor.hpp (from csrc/params.h)",
        "kerutils/k.h (from csrc/api/common.h)",
    ]


def test_the_archive_check_names_what_is_wrong(tmp_path: Path) -> None:
    site = _site(tmp_path)
    root = site.parent
    _flashmla(root / "flashmla")
    stamp = root / "tessera-ray" / "benchmarks" / "archive_commit.txt"
    stamp.parent.mkdir(parents=True)
    stamp.write_text("0123456789abcdef0123456789abcdef01234567\n")
    for name in ("on_box.sh", "MANIFEST.txt", "python-version"):
        (root / name).write_text("")
    assert bundle.check_bundle(root) == []

    shutil.rmtree(site / "ray" / "thirdparty_files")
    (site / "ray" / "jars").mkdir()
    stamp.write_text("$Format:%H$\n")
    (root / "flashmla" / "csrc" / "api" / "api.cpp").write_text("// the whole module\n")
    (root / "MANIFEST.txt").unlink()
    assert bundle.check_bundle(root) == [
        "site/ray/thirdparty_files/psutil missing (ray==2.60.0)",
        "site/ray/jars not left out",
        "flashmla/csrc/api/api.cpp is not the reduced one",
        "tessera-ray/benchmarks/archive_commit.txt holds no commit (not a git archive?)",
        "MANIFEST.txt missing",
    ]


def test_an_archive_records_the_commit_it_was_made_from(tmp_path: Path) -> None:
    # What `git archive` makes of the stamp (export-subst): results on the box name HEAD.
    attributes = (ROOT / ".gitattributes").read_text()
    assert "benchmarks/archive_commit.txt export-subst" in attributes
    assert (ROOT / "benchmarks" / "archive_commit.txt").read_text().strip() == "$Format:%H$"
    assert common.archived_commit(ROOT) is None  # a clone asks git
    stamp = tmp_path / "benchmarks" / "archive_commit.txt"
    stamp.parent.mkdir()
    stamp.write_text("0123456789abcdef0123456789abcdef01234567\n")
    assert common.source_commit(["benchmarks"], root=tmp_path) == "0123456789ab"


def test_the_box_script_runs_the_checks_and_says_why_flashmla_is_missing(tmp_path: Path) -> None:
    """gpu_box.sh on a bundle whose checkout is this one, on a machine without a GPU or nvcc:
    every check skipped, no build tried, every file it promises written, exit 3."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("with a GPU the checks would really run; this is the CPU path")
    box = tmp_path / "gpu-bundle"
    for name in ("site", "flashmla"):
        (box / name).mkdir(parents=True)
    (box / "tessera-ray").symlink_to(ROOT)
    (box / "MANIFEST.txt").write_text("gpu-bundle of tessera-ray (a test)\n")
    (box / "python-version").write_text("3.99\n")
    no_nvcc = [d for d in os.environ["PATH"].split(":") if d and not Path(d, "nvcc").exists()]
    env = _env(PATH=":".join(no_nvcc), CUDA_HOME=str(tmp_path / "no-cuda"))
    out = tmp_path / "out"
    done = _run(
        "bash", "benchmarks/gpu_box.sh", "--bundle", str(box), "--out", str(out), env=env
    )  # fmt: skip
    assert done.returncode == 3, done.stdout + done.stderr
    summary = (out / "summary.txt").read_text()
    assert "the wheels are for Python 3.99" in summary
    assert "FlashMLA not built: no nvcc" in summary
    assert "gpu_check exit 0, FlashMLA build failed" in summary
    assert {"env.txt", "gpu_check.log", "gpu.json", "MANIFEST.txt"} <= {
        p.name for p in out.iterdir()
    }
    doc = json.loads((out / "gpu.json").read_text())
    assert {c["status"] for c in doc["checks"]} == {"skipped"}
    assert "torch:" in (out / "env.txt").read_text()
