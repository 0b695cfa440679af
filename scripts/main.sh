#!/usr/bin/env bash
# The project's main job.
#
#   bash scripts/main.sh            # train (if examples/train_gpt.py exists), else the benchmark
#   MAIN_JOB=bench bash scripts/main.sh --quick
#
# Arguments go to the job. Jobs:
#   bench  all-reduce benchmark, 2 local ranks: every commlib backend (default: ring)
#          beside raw torch.distributed Gloo and raw mpi4py; CSV in results/allreduce.csv
#   train  examples/train_gpt.py on 2 local ranks under torchrun
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

# The one line to change when the main job changes:
DEFAULT_JOB="$([[ -f examples/train_gpt.py ]] && echo train || echo bench)"
MAIN_JOB="${MAIN_JOB:-$DEFAULT_JOB}"
NPROC="${NPROC:-2}"

if [[ -n "${COMMLIB_PYTHON:-}" ]]; then
    PY="$COMMLIB_PYTHON"
else
    bash "$ROOT/scripts/setup.sh"
    PY="${COMMLIB_VENV:-$ROOT/.venv}/bin/python"
fi
BIN="$(dirname "$PY")"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

case "$MAIN_JOB" in
bench)
    mkdir -p results
    if [[ -x "$BIN/mpiexec" ]] && "$PY" -c 'import mpi4py' 2>/dev/null; then
        echo "main.sh: $BIN/mpiexec -n $NPROC $PY benchmarks/allreduce_bench.py $*"
        exec "$BIN/mpiexec" -n "$NPROC" "$PY" benchmarks/allreduce_bench.py --csv results/allreduce.csv "$@"
    fi
    echo "main.sh: no mpiexec/mpi4py beside $PY; spawning $NPROC ranks (no raw MPI reference)"
    exec "$PY" benchmarks/allreduce_bench.py --spawn "$NPROC" --csv results/allreduce.csv "$@"
    ;;
train)
    [[ -f examples/train_gpt.py ]] || { echo "main.sh: examples/train_gpt.py does not exist (yet); use MAIN_JOB=bench" >&2; exit 2; }
    echo "main.sh: torchrun --nproc-per-node $NPROC examples/train_gpt.py $*"
    exec "$PY" -m torch.distributed.run --nproc-per-node "$NPROC" examples/train_gpt.py "$@"
    ;;
*)
    echo "main.sh: unknown MAIN_JOB=$MAIN_JOB (expected bench or train)" >&2
    exit 2
    ;;
esac
