#!/usr/bin/env bash
# The project's test command: set up .venv (fast when already done), then run pytest.
#
#   bash scripts/test.sh                       # the whole suite (tests/)
#   bash scripts/test.sh tests/test_env.py -q  # arguments go to pytest
#
# The suite runs in two passes: the tests that stay in one process on COMMLIB_TEST_WORKERS
# pytest-xdist workers (default 2), then the tests that spawn ranks (markers multiprocess,
# mpi, launcher, gpu) one at a time, so that ranks never compete with another test's for the
# cores their deadlines assume; beside them, in a second pytest whose output follows, run the
# ones marked `waits` (they spend their time waiting out a timeout, not on the cores).
# Arguments go to every run; with -m, -n,
# COMMLIB_TEST_WORKERS=0, or an interpreter without pytest-xdist it is one plain pytest run.
# Pass 2 is skipped when pass 1 was interrupted, or failed under -x / --maxfail.
#
# COMMLIB_PYTHON=/path/to/python skips setup.sh and runs pytest with that interpreter.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

if [[ -n "${COMMLIB_PYTHON:-}" ]]; then
    PY="$COMMLIB_PYTHON"
    echo "test.sh: using COMMLIB_PYTHON=$PY (setup.sh skipped)"
else
    bash "$ROOT/scripts/setup.sh"
    PY="${COMMLIB_VENV:-$ROOT/.venv}/bin/python"
fi

# Compile the sources once: the suite starts hundreds of interpreters, and under
# PYTHONDONTWRITEBYTECODE (CI sets it) each would compile what it imports again.
"$PY" -m compileall -q -j 0 commlib backends ddp tests benchmarks examples >/dev/null || true

SPAWNS="multiprocess or mpi or launcher or gpu"
WORKERS="${COMMLIB_TEST_WORKERS:-2}"
[[ "$WORKERS" =~ ^[0-9]+$ ]] || { echo "test.sh: COMMLIB_TEST_WORKERS must be a number, got '$WORKERS'" >&2; exit 2; }

two_passes=1
stop_early=0
for arg in "$@"; do
    case "$arg" in
        -m | -m* | -n | -n* | --numprocesses*) two_passes=0 ;;
        -x | --exitfirst | --maxfail*) stop_early=1 ;;
    esac
done
[[ "$WORKERS" -ge 2 ]] || two_passes=0
"$PY" -c 'import xdist' 2>/dev/null || two_passes=0

set +e
if [[ $two_passes -eq 1 ]]; then
    echo "test.sh: pass 1: the single-process tests on $WORKERS workers"
    "$PY" -m pytest -n "$WORKERS" -m "not ($SPAWNS)" "$@"
    rc_solo=$?
    if [[ $rc_solo -eq 2 || ( $stop_early -eq 1 && $rc_solo -ne 0 && $rc_solo -ne 5 ) ]]; then
        echo "test.sh: pass 1 exit $rc_solo: pass 2 skipped" >&2
        exit "$rc_solo"
    fi
    echo "test.sh: pass 2: the tests that spawn ranks ($SPAWNS), one at a time;" \
        "the ones marked waits run beside them (their output follows)"
    waits_log="$(mktemp "${TMPDIR:-/tmp}/commlib-waits.XXXXXX")"
    "$PY" -m pytest -p no:cacheprovider -m "($SPAWNS) and waits" "$@" >"$waits_log" 2>&1 &
    waits_pid=$!
    # On an interrupted run, stop the waiting tests (set -e holds in the trap: keep it true).
    trap 'kill "$waits_pid" 2>/dev/null || true; rm -f "$waits_log"' EXIT
    "$PY" -m pytest -m "($SPAWNS) and not waits" "$@"
    rc_spawn=$?
    wait "$waits_pid"
    rc_waits=$?
    echo "test.sh: pass 2, the tests marked waits (run beside the others):"
    cat "$waits_log"
    rm -f "$waits_log"
    trap - EXIT
    # Exit code 5 is "collected nothing": fine for one run when another ran tests.
    rc=0
    collected=0
    for code in "$rc_solo" "$rc_spawn" "$rc_waits"; do
        if [[ $code -ne 0 && $code -ne 5 && $rc -eq 0 ]]; then
            rc=$code
        fi
        [[ $code -eq 5 ]] || collected=1
    done
    [[ $collected -eq 1 ]] || rc=5
    echo "test.sh: pass 1 exit $rc_solo, pass 2 exit $rc_spawn, its waiting tests exit $rc_waits"
else
    "$PY" -m pytest "$@"
    rc=$?
fi
set -e

if [[ $rc -eq 5 ]]; then
    echo "test.sh: FAILED: pytest collected no tests (exit code 5) for arguments: ${*:-<none>}." >&2
    echo "test.sh: a run that tests nothing must not pass; check the paths, -k and -m filters." >&2
fi
exit "$rc"
