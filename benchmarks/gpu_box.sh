#!/usr/bin/env bash
# The GPU validation on an offline GPU box, from the archive benchmarks/gpu_bundle.sh made:
# builds FlashMLA's dense decode from the bundle's sources, runs benchmarks/gpu_check.sh with the
# bundle's wheels on PYTHONPATH, and leaves every result and log in one folder. Time-boxed as a
# whole, so that one 10-minute command of a 15-minute device slot holds it.
#
#   tar xzf gpu-bundle.tar.gz && bash gpu-bundle/on_box.sh [options]   # on_box.sh calls this
#
#   --out DIR          results and logs (default: $OUT where set, which is what the device tool
#                      returns, else gpu-bundle/results)
#   --skip-build       use FlashMLA as already built (or go without it)
#   --budget-s S       the whole run, build and checks (default 570)
#   --build-limit-s S  the FlashMLA build alone (default 300; it took about 110 s on 16 cores)
#   --bundle DIR       the unpacked gpu-bundle/ (default: two folders above this script)
#
# Writes env.txt (what the box has), flashmla_build.log, gpu_check.log, gpu.json with the
# benchmarks' JSON beside it, and summary.txt. Exits with gpu_check's status (1: a check failed
# or timed out); 124 when the checks ran past the budget; 3 when they passed but a FlashMLA build
# that was tried failed (its checks then report FlashMLA skipped).
set -uo pipefail # no -e: a step that fails is recorded and the next one still runs

here=$(cd "$(dirname "$0")" && pwd)
bundle=$(cd "$here/../.." && pwd)
out=${OUT:-}
skip_build=0
budget_s=570
build_limit_s=300
while (($#)); do
    case $1 in
        --out) out=$2; shift 2 ;;
        --skip-build) skip_build=1; shift ;;
        --budget-s) budget_s=$2; shift 2 ;;
        --build-limit-s) build_limit_s=$2; shift 2 ;;
        --bundle) bundle=$(cd "$2" && pwd); shift 2 ;;
        -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
        *) echo "gpu_box: unknown argument $1 (--help)" >&2; exit 2 ;;
    esac
done
out=${out:-$bundle/results}
mkdir -p "$out"
out=$(cd "$out" && pwd)
PY=${PYTHON:-python3}
repo=$bundle/tessera-ray
started=$SECONDS
say() { echo "gpu_box: $*" | tee -a "$out/summary.txt"; }
left_s() { echo $((budget_s - (SECONDS - started))); }
: >"$out/summary.txt"

# The bundle's wheels and FlashMLA before the box's own packages; gpu_check.sh adds the checkout.
export PYTHONPATH="$bundle/flashmla:$bundle/site${PYTHONPATH:+:$PYTHONPATH}"

# What the box has, first: every later failure reads against it.
cp "$bundle/MANIFEST.txt" "$out/" 2>/dev/null
{
    date -u +%Y-%m-%dT%H:%M:%SZ
    head -1 "$bundle/MANIFEST.txt" 2>/dev/null
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv
    echo "cpus: $(nproc)"
    command -v nvcc >/dev/null && nvcc --version | tail -2
    "$PY" - <<'EOF'
import importlib, sys
print("python", sys.version.split()[0], sys.executable, "(imports before any FlashMLA build)")
for name in ("torch", "ray", "jsonschema", "nixl", "flash_mla", "flashinfer", "vllm"):
    try:
        module = importlib.import_module(name)
        print(f"{name}: {getattr(module, '__version__', '?')} {getattr(module, '__file__', '')}")
    except Exception as e:  # anything a broken install raises: recorded, not fatal
        print(f"{name}: not importable ({type(e).__name__}: {e})")
EOF
} >"$out/env.txt" 2>&1
want=$(cat "$bundle/python-version" 2>/dev/null)
have=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if [ -n "$want" ] && [ "$want" != "$have" ]; then
    say "the wheels are for Python $want, $PY is $have: ray, nixl and rpds-py will not import"
fi

# FlashMLA: built in place (setup.py build_ext --inplace puts flash_mla/cuda*.so beside its
# Python package, which PYTHONPATH already names). No nvcc: no build, said why.
build=skipped
flashmla=$bundle/flashmla
built() { compgen -G "$flashmla/flash_mla/cuda*.so" >/dev/null; }
if ((skip_build)); then
    say "FlashMLA build skipped (--skip-build)$(built && echo '; a build is there')"
elif built; then
    build=ok
    say "FlashMLA already built"
elif ! command -v nvcc >/dev/null && [ ! -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ]; then
    build=failed
    say "FlashMLA not built: no nvcc on PATH or in \${CUDA_HOME:-/usr/local/cuda}/bin"
elif (($(left_s) - 60 < 30)); then
    build=failed
    say "FlashMLA not built: under 90 s of the ${budget_s} s budget left"
else
    limit=$build_limit_s
    ((limit > $(left_s) - 60)) && limit=$(($(left_s) - 60)) # leave the checks a minute at least
    began=$SECONDS
    (cd "$flashmla" && MAX_JOBS=${MAX_JOBS:-$(nproc)} timeout "$limit" "$PY" setup.py build_ext --inplace) \
        >"$out/flashmla_build.log" 2>&1
    rc=$?
    if ((rc == 0)) && "$PY" -c 'import flash_mla.cuda' >>"$out/flashmla_build.log" 2>&1; then
        build=ok
        say "FlashMLA built in $((SECONDS - began)) s"
    else
        build=failed
        ((rc == 124)) && why="past its ${limit} s" || why="exit $rc, or the module does not import"
        say "FlashMLA build failed ($why): the tail of flashmla_build.log:"
        tail -5 "$out/flashmla_build.log" | tee -a "$out/summary.txt"
    fi
fi

# The checks, with what is left of the budget. gpu_check writes gpu.json at its end and the
# benchmarks' JSON beside it; each check's line goes to the log as it finishes, so a run cut
# short by the budget still says how far it got.
limit=$(left_s)
if ((limit < 30)); then
    say "no time left for the checks (${budget_s} s budget)"
    exit 124
fi
say "running gpu_check.sh (at most ${limit} s)"
timeout "$limit" env PYTHON="$PY" bash "$repo/benchmarks/gpu_check.sh" --out "$out/gpu.json" 2>&1 |
    tee "$out/gpu_check.log"
rc=${PIPESTATUS[0]}
((rc == 124)) && say "the checks ran past ${limit} s: gpu.json is not written; gpu_check.log has the checks that finished"
say "gpu_check exit $rc, FlashMLA build $build, $((SECONDS - started)) s in all; results in $out"
if ((rc == 0)) && [ "$build" = failed ]; then
    exit 3
fi
exit "$rc"
