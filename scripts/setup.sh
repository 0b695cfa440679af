#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv.
#
# Idempotent: a stamp keyed on pyproject.toml, constraints.txt, this script and
# the Python version makes a second run a no-op (well under a second).
#
# Environment:
#   PYTHON                  interpreter that creates the venv (default: python3)
#   COMMLIB_VENV            where the venv lives (default: <repo>/.venv)
#   COMMLIB_FORCE_SETUP=1   reinstall even if the stamp matches
#   COMMLIB_TORCH_PIP_ARGS  extra pip arguments for the torch install only
#                           (e.g. "--index-url https://download.pytorch.org/whl/cpu")
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${COMMLIB_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.commlib-setup-stamp"
TORCH_SPEC="torch==2.13.0"   # keep in step with constraints.txt

export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1

say() { echo "setup.sh: $*"; }
die() { echo "setup.sh: error: $*" >&2; exit 1; }

cd "$ROOT"
[[ -f pyproject.toml && -f constraints.txt ]] || die "pyproject.toml or constraints.txt missing in $ROOT"
grep -qx "$TORCH_SPEC" constraints.txt || die "constraints.txt must pin $TORCH_SPEC (found: $(grep -i '^torch' constraints.txt || echo nothing))"

# Serialise concurrent runs (test.sh and main.sh started together).
mkdir -p "$VENV"
if command -v flock >/dev/null 2>&1; then
    exec 9>"$VENV/.commlib-setup.lock"
    flock 9
fi

key() {
    {
        cat pyproject.toml constraints.txt "$ROOT/scripts/setup.sh"
        "$VENV/bin/python" -c 'import sys; print(sys.version)'
    } | sha256sum | cut -d' ' -f1
}

installed_ok() {
    # Cheap check (no torch import): the packages are still there.
    "$VENV/bin/python" - <<'PY' 2>/dev/null
import importlib.util, sys
mods = ("torch", "numpy", "commlib", "pytest", "pytest_timeout", "xdist", "mpi4py")
sys.exit(0 if all(importlib.util.find_spec(m) is not None for m in mods) else 1)
PY
}

if [[ ! -x "$VENV/bin/python" ]]; then
    command -v "$PYTHON" >/dev/null 2>&1 || die "$PYTHON not found; set PYTHON=/path/to/python3 (3.10 or newer)"
    "$PYTHON" -m venv "$VENV" || die "'$PYTHON -m venv $VENV' failed (on Debian/Ubuntu: apt-get install python3-venv)"
    say "created virtual environment $VENV"
fi

if [[ "${COMMLIB_FORCE_SETUP:-0}" != 1 && -f "$STAMP" && "$(cat "$STAMP")" == "$(key)" ]] && installed_ok; then
    say "$VENV is up to date (stamp matches; COMMLIB_FORCE_SETUP=1 reinstalls)"
    exit 0
fi

PIP=("$VENV/bin/python" -m pip -qq)   # -qq: errors only (this machine's pip config warns about every index)
rm -f "$STAMP"
"${PIP[@]}" install --upgrade pip || die "upgrading pip failed"
say "pip is $("$VENV/bin/python" -m pip --version | cut -d' ' -f1,2)"

# torch first and pinned, so that no later step resolves a newer (CUDA) build.
# shellcheck disable=SC2086
"${PIP[@]}" install ${COMMLIB_TORCH_PIP_ARGS:-} "$TORCH_SPEC" || die "installing $TORCH_SPEC failed"
say "installed torch $("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("torch"))')"

PYTHONWARNINGS=ignore "${PIP[@]}" install -c constraints.txt -e ".[mpi,dev]" || die "pip install -e '.[mpi,dev]' failed"
say "installed commlib (editable) with extras mpi,dev: $("$VENV/bin/python" -c 'import importlib.metadata as m; print(", ".join(p + " " + m.version(p) for p in ("mpi4py", "mpich", "pytest")))')"
[[ -x "$VENV/bin/mpiexec" ]] && say "MPI launcher: $VENV/bin/mpiexec"

installed_ok || die "packages still missing after install (torch, numpy, commlib, pytest, pytest_timeout, mpi4py)"
key >"$STAMP"
say "done; $VENV is ready"
