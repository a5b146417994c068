#!/usr/bin/env bash
# Packs the GPU validation for an offline GPU box into one archive under 60 MiB (a lent GPU
# machine takes 64 MiB per transfer, this checkout's files included): this checkout at HEAD, the
# wheels the box lacks, trimmed, and FlashMLA's dense-decode sources with the CUTLASS headers
# they include. On the box, `bash gpu-bundle/on_box.sh` builds FlashMLA and runs gpu_check.sh
# (benchmarks/gpu_box.sh). What goes in, and why: benchmarks/_gpu_bundle.py; docs/gpu-run.md.
#
#   bash benchmarks/gpu_bundle.sh [--out PATH] [--python-version 3.12]
#        [--flashmla-src DIR] [--cutlass-src DIR] [--work DIR] [--dry-run]
#   bash benchmarks/gpu_bundle.sh --check ARCHIVE [--import-python PY]
#
# Runs on a machine with the package registries (pip's own configuration: no index is named
# here). --flashmla-src / --cutlass-src: a clone, a bare git directory or a plain source tree of
# deepseek-ai/FlashMLA / NVIDIA/cutlass; without them the pinned commits are fetched from their
# public git URLs, which needs network to that host. --dry-run lists what would be packed and
# downloads nothing. --check unpacks an archive and checks it as far as a machine without a GPU
# can (the same check ends every build); --import-python also imports the trimmed wheels with
# an interpreter of the box's Python version.
set -euo pipefail
caller=$PWD
usage() { sed -n '2,18p' "$0"; }
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
HELPER=benchmarks/_gpu_bundle.py
LIMIT_MIB=60

out=$PWD/build/gpu-bundle.tar.gz
pyver=3.12
flashmla_src=
cutlass_src=
work=
dry_run=0
check=
import_python=
while (($#)); do
    case $1 in
        --out) out=$2; shift 2 ;;
        --python-version) pyver=$2; shift 2 ;;
        --flashmla-src) flashmla_src=$2; shift 2 ;;
        --cutlass-src) cutlass_src=$2; shift 2 ;;
        --work) work=$2; shift 2 ;;
        --dry-run) dry_run=1; shift ;;
        --check) check=$2; shift 2 ;;
        --import-python) import_python=$2; shift 2 ;;
        -h|--help) (cd "$caller" && usage); exit 0 ;;
        *) echo "gpu_bundle: unknown argument $1 (--help)" >&2; exit 2 ;;
    esac
done

# Paths given on the command line are the caller's, not the repository root's.
for name in out flashmla_src cutlass_src work check; do
    if [ -n "${!name}" ] && [[ ${!name} != /* ]]; then
        printf -v "$name" '%s/%s' "$caller" "${!name}"
    fi
done

mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }

# Temporary folders, removed however the script ends.
scratch=()
trap 'rm -rf "${scratch[@]}"' EXIT

# Unpacks ARCHIVE into a temporary folder and checks what a machine without the box's GPU and
# Python can: the files each component needs are there and the trimmed ones are not, FlashMLA is
# reduced and its CUTLASS includes resolve, the scripts parse, the checkout compiles, and
# gpu_check.py lists its checks from the unpacked tree.
check_archive() {
    local archive=$1 tmp bundle script
    tmp=$(mktemp -d)
    scratch+=("$tmp")
    tar xzf "$archive" -C "$tmp"
    bundle=$tmp/gpu-bundle
    "$PY" "$HELPER" check "$bundle" ${import_python:+--python "$import_python"}
    for script in on_box.sh tessera-ray/benchmarks/gpu_box.sh tessera-ray/benchmarks/gpu_check.sh; do
        bash -n "$bundle/$script"
    done
    "$PY" -m compileall -q "$bundle/tessera-ray" >/dev/null
    "$PY" -m py_compile "$bundle/flashmla/setup.py"
    echo "gpu_bundle: the unpacked checkout's gpu_check.py --dry-run:"
    "$PY" "$bundle/tessera-ray/benchmarks/gpu_check.py" --dry-run | sed 's/^/  /'
    echo "gpu_bundle: $archive checked"
}

if [ -n "$check" ]; then
    check_archive "$check"
    exit 0
fi

echo "gpu_bundle: $out would hold gpu-bundle/ with"
"$PY" "$HELPER" plan --python-version "$pyver" | sed 's/^/  /'
((dry_run)) && exit 0

if [ -n "$(git status --porcelain --untracked-files=no)" ]; then
    echo "gpu_bundle: uncommitted changes are not packed: the bundle is HEAD ($(git rev-parse --short HEAD))" >&2
fi
if [ -z "$work" ]; then
    work=$(mktemp -d)
    scratch+=("$work")
fi
stage=$work/gpu-bundle
rm -rf "$stage" && mkdir -p "$stage"

# 1. The checkout. git archive rather than a copy: exactly HEAD, and benchmarks/archive_commit.txt
# gets HEAD's hash (export-subst), so results written on the box record the commit they ran.
git archive --prefix=tessera-ray/ HEAD | tar x -C "$stage"

# 2. The wheels, for the box's interpreter rather than this one's. pip's --platform takes no
# older manylinux for a newer one, so each tag the pinned wheels use is named; --no-deps since
# the box has the rest (docs/gpu-run.md) and _gpu_bundle.py lists exactly what it lacks.
abi=cp${pyver//./}
mkdir -p "$work/wheels"
# shellcheck disable=SC2046  # one requirement a word
"$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --python-version "$pyver" --implementation cp --abi "$abi" \
    -d "$work/wheels" $("$PY" "$HELPER" requirements)
"$PY" "$HELPER" unpack "$work/wheels" "$stage/site" | sed 's/^/gpu_bundle: /'

# 3. FlashMLA and CUTLASS at their pinned commits (only the paths the build reads).
# SRC: a clone or bare git directory holding the commit (git archive of it), or a plain tree
# (copied as it is: its commit cannot be checked, so say so). No SRC: fetch just that commit.
take_source() {
    local name=$1 src=$2 url commit dest paths
    read -r url commit dest paths <<<"$("$PY" "$HELPER" source "$name")"
    mkdir -p "$stage/$dest"
    if [ -z "$src" ]; then
        src=$work/src-$name
        git init --quiet --bare "$src"
        echo "gpu_bundle: fetching $name $commit from $url"
        git -C "$src" fetch --quiet --depth 1 "$url" "$commit"
    fi
    if [ -e "$src/.git" ] || git -C "$src" rev-parse --is-bare-repository 2>/dev/null | grep -q true; then
        if ! git -C "$src" cat-file -e "$commit^{commit}" 2>/dev/null; then
            echo "gpu_bundle: $src does not hold $name's commit $commit" >&2
            return 1
        fi
        # shellcheck disable=SC2086  # paths: one a word
        git -C "$src" archive "$commit" -- $paths | tar x -C "$stage/$dest"
    else
        echo "gpu_bundle: $src is not a git checkout: copied as it is, its commit unchecked" >&2
        # shellcheck disable=SC2086
        tar c -C "$src" $paths | tar x -C "$stage/$dest"
    fi
}
take_source flashmla "$flashmla_src"
take_source cutlass "$cutlass_src"
"$PY" "$HELPER" flashmla "$stage/flashmla"

# 4. The box's one command, what the bundle holds, and which Python its wheels are for.
cat >"$stage/on_box.sh" <<'EOF'
#!/usr/bin/env bash
# Written by benchmarks/gpu_bundle.sh: builds FlashMLA and runs the GPU checks (the options:
# tessera-ray/benchmarks/gpu_box.sh).
here=$(cd "$(dirname "$0")" && pwd)
exec bash "$here/tessera-ray/benchmarks/gpu_box.sh" --bundle "$here" "$@"
EOF
echo "$pyver" >"$stage/python-version"
{
    echo "gpu-bundle of tessera-ray $(git rev-parse HEAD), made $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    "$PY" "$HELPER" plan --python-version "$pyver"
    echo "wheels:"
    for wheel in "$work"/wheels/*.whl; do echo "  ${wheel##*/}"; done
} >"$stage/MANIFEST.txt"

# 5. The archive, its size against the limit, and what each part costs of it.
mkdir -p "$(dirname "$out")"
tar czf "$out" -C "$work" gpu-bundle
size=$(stat -c %s "$out")
for part in tessera-ray site flashmla; do
    echo "gpu_bundle:   $part/ $(mib "$(tar czf - -C "$stage" "$part" | wc -c)") compressed, $(du -sh "$stage/$part" | cut -f1) unpacked"
done
echo "gpu_bundle: $out is $(mib "$size") ($size B; limit $LIMIT_MIB MiB)"
if ((size >= LIMIT_MIB * 1048576)); then
    echo "gpu_bundle: over $LIMIT_MIB MiB: it and the checkout must fit one 64 MiB transfer to the box" >&2
    exit 1
fi
check_archive "$out"
