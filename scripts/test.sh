#!/usr/bin/env bash
# The project's test command: set up .venv (fast when already done), then run pytest.
#
#   bash scripts/test.sh                       # the whole suite (tests/)
#   bash scripts/test.sh tests/test_env.py -q  # arguments go to pytest
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

set +e
"$PY" -m pytest "$@"
rc=$?
set -e

if [[ $rc -eq 5 ]]; then
    echo "test.sh: FAILED: pytest collected no tests (exit code 5) for arguments: ${*:-<none>}." >&2
    echo "test.sh: a run that tests nothing must not pass; check the paths, -k and -m filters." >&2
fi
exit "$rc"
