#!/usr/bin/env bash
# Installs the peers bench_peers.py compares against: the pip extra `bench` (redis-py with
# hiredis, Mooncake Store's non-CUDA wheel) into the given Python's environment, and the Debian
# packages redis-server and libibverbs1 (Mooncake's wheel links libibverbs) where apt-get and
# root are available. It never fails `make bench`: a peer it cannot install is reported by the
# benchmark as "not available" with the reason.
#
# usage: benchmarks/install_peers.sh [PYTHON]   (run from the repository root)
set -u
PY=${1:-.venv/bin/python}

debs=()
command -v redis-server >/dev/null 2>&1 || debs+=(redis-server)
ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1' || debs+=(libibverbs1)
if ((${#debs[@]})); then
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "install_peers: no apt-get here; not installed: ${debs[*]}" >&2
    elif [ "$(id -u)" != 0 ]; then
        echo "install_peers: not root; not installed: ${debs[*]} (apt-get install -y ${debs[*]})" >&2
    elif DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${debs[@]}"; then
        # The benchmark starts its own redis-server on a free port; the packaged service would
        # sit on 6379, which a Ray GCS may want.
        if [[ " ${debs[*]} " == *" redis-server "* ]]; then
            (systemctl disable --now redis-server || service redis-server stop) >/dev/null 2>&1 || true
        fi
    else
        echo "install_peers: apt-get could not install ${debs[*]}" >&2
    fi
fi

# The Python clients: skip pip when they import already.
if ! "$PY" -c 'import redis, hiredis, mooncake.store' >/dev/null 2>&1; then
    if ! "$PY" -m pip install --quiet -e ".[bench]"; then
        echo "install_peers: the bench extra failed as a whole; trying each package" >&2
        "$PY" -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["bench"]))' |
            while read -r pkg; do
                "$PY" -m pip install --quiet "$pkg" || echo "install_peers: pip could not install $pkg" >&2
            done
    fi
fi
exit 0
