#!/usr/bin/env bash
# The one command that proves commlib's GPU paths on a machine with a CUDA device.
#
#   bash scripts/gpu_check.sh
#
# Without a GPU (no nvidia-smi, or it lists none) it says so in one line and exits 0,
# before installing anything. With one it:
#   1. creates its own venv (.venv-gpu), installs torch with CUDA (on Linux x86_64 the
#      PyPI wheel is the CUDA build), CuPy for torch's CUDA major version, mpi4py and
#      MPICH, and commlib (editable) with its dev extra;
#   2. runs every test marked gpu (pytest -m gpu);
#   3. runs the GPU benchmarks: benchmarks/gpu_ddp_bench.py at world size 1 (NCCL) and
#      on 2 ranks sharing the GPU (Gloo and ring), and
#      benchmarks/allreduce_bench.py --device cuda on 2 ranks (ring, gloo, mpi);
#   4. prints one table (check, result, figures) and exits non-zero if a check failed.
# Logs and CSVs go to results/gpu_check/.
#
# Environment:
#   PYTHON                  interpreter that creates the venv (default python3)
#   GPU_CHECK_VENV          where the venv lives (default <repo>/.venv-gpu)
#   GPU_CHECK_TORCH         torch requirement, with any pip arguments
#                           (default "torch==2.13.0"; e.g. "torch==2.13.0 --index-url URL")
#   GPU_CHECK_CUPY          CuPy package (default: cupy-cuda12x, or cupy-cuda13x for a CUDA 13 torch)
#   GPU_CHECK_OUT           where logs and CSVs go (default <repo>/results/gpu_check)
#   GPU_CHECK_SKIP_INSTALL=1  use the venv as it is (offline re-runs)
#   GPU_CHECK_TEST_TIMEOUT  seconds for pytest -m gpu (default 3600)
#   GPU_CHECK_BENCH_TIMEOUT seconds for each benchmark (default 1200)
set -uo pipefail

say() { echo "gpu_check: $*"; }

# ---------------------------------------------------------------- is there a GPU?
if ! command -v nvidia-smi >/dev/null 2>&1; then
    say "no CUDA device here (no nvidia-smi on PATH): nothing installed, nothing run"
    exit 0
fi
GPUS="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | sed '/^[[:space:]]*$/d')"
if [[ -z "$GPUS" ]]; then
    say "no CUDA device here (nvidia-smi lists no GPU): nothing installed, nothing run"
    exit 0
fi

set -e
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${GPU_CHECK_VENV:-$ROOT/.venv-gpu}"
PYTHON="${PYTHON:-python3}"
TORCH_REQ="${GPU_CHECK_TORCH:-torch==2.13.0}"
OUT="${GPU_CHECK_OUT:-$ROOT/results/gpu_check}"
TEST_TIMEOUT="${GPU_CHECK_TEST_TIMEOUT:-3600}"
BENCH_TIMEOUT="${GPU_CHECK_BENCH_TIMEOUT:-1200}"
PY="$VENV/bin/python"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
mkdir -p "$OUT"
say "GPU(s): $(echo "$GPUS" | paste -sd ';' -); logs in $OUT"

# ------------------------------------------------------------------------ install
install() {
    # Called as the condition of an 'if', where set -e is off: every step says '|| return 1'.
    if [[ ! -x "$PY" ]]; then
        "$PYTHON" -m venv "$VENV" || { say "error: '$PYTHON -m venv $VENV' failed"; return 1; }
    fi
    local pip=("$PY" -m pip -q)
    "${pip[@]}" install --upgrade pip || return 1
    # shellcheck disable=SC2086  # GPU_CHECK_TORCH may carry pip arguments
    "${pip[@]}" install $TORCH_REQ || return 1
    local cuda
    cuda="$("$PY" -c 'import torch; print(torch.version.cuda or "")')" || return 1
    if [[ -z "$cuda" ]]; then
        say "error: the torch installed from '$TORCH_REQ' is a CPU build; set GPU_CHECK_TORCH to a CUDA build"
        return 1
    fi
    local cupy="${GPU_CHECK_CUPY:-cupy-cuda12x}"
    [[ -z "${GPU_CHECK_CUPY:-}" && "${cuda%%.*}" == 13 ]] && cupy="cupy-cuda13x"
    # Keep the torch just installed: the project's own requirements must not replace it.
    "$PY" -c 'import importlib.metadata as m; print("torch==" + m.version("torch"))' \
        >"$VENV/gpu-constraints.txt" || return 1
    "${pip[@]}" install -c "$VENV/gpu-constraints.txt" "$cupy" mpi4py mpich || return 1
    "${pip[@]}" install -c "$VENV/gpu-constraints.txt" -e ".[mpi,dev]" || return 1
    say "installed torch $("$PY" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)'), $cupy"
}

if [[ "${GPU_CHECK_SKIP_INSTALL:-0}" == 1 && -x "$PY" ]]; then
    say "GPU_CHECK_SKIP_INSTALL=1: using $VENV as it is"
else
    say "installing into $VENV (torch with CUDA is a few GB; this takes minutes the first time)"
    if ! install >"$OUT/install.log" 2>&1; then
        tail -n 20 "$OUT/install.log"
        say "FAILED: installing the GPU environment (full log: $OUT/install.log)"
        exit 1
    fi
fi
set +e

# ------------------------------------------------------------------------- checks
CHECKS=()
RESULTS=()
FIGURES=()
record() { CHECKS+=("$1"); RESULTS+=("$2"); FIGURES+=("$3"); }

# run NAME TIMEOUT_S COMMAND...: run a check with its output in $OUT/NAME.log; sets $RC.
run() {
    local name="$1" limit="$2"
    shift 2
    say "running $name: $*"
    timeout --kill-after=30 "$limit" "$@" >"$OUT/$name.log" 2>&1
    RC=$?
    [[ $RC -eq 124 ]] && echo "gpu_check: $name: stopped after $limit s" >>"$OUT/$name.log"
    return 0
}

# 1. What the machine and the libraries say.
run environment 300 "$PY" - <<'PY'
import torch
from mpi4py import MPI
from backends.mpi.cuda import detect_cuda_aware
assert torch.cuda.is_available(), "torch.cuda.is_available() is False"
import cupy
version = torch.cuda.nccl.version()
nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s): "
      f"{torch.cuda.get_device_name(0)}; NCCL {nccl}; "
      f"CuPy {cupy.__version__} sees {cupy.cuda.runtime.getDeviceCount()} GPU(s); "
      f"{MPI.Get_library_version().splitlines()[0].strip()}")
print(detect_cuda_aware(MPI).log_line())
PY
if [[ $RC -eq 0 ]]; then
    record "environment" PASS "$(paste -sd '|' "$OUT/environment.log" | sed 's/|/; /g')"
else
    record "environment" FAIL "$(tail -n 1 "$OUT/environment.log")"
fi

# 2. Every test marked gpu.
run pytest_gpu "$TEST_TIMEOUT" "$PY" -m pytest -m gpu -rs -q -p no:cacheprovider --timeout 900 \
    --junitxml "$OUT/pytest_gpu.xml" tests
summary="$(grep -E '(passed|failed|error|skipped|no tests ran)' "$OUT/pytest_gpu.log" | tail -n 1 | tr -d '=' | sed 's/^ *//')"
if [[ $RC -eq 0 ]] && ! grep -q "passed" <<<"$summary"; then
    # On a machine with a GPU every gpu test should run: all skipped means the device was not seen.
    record "pytest -m gpu" FAIL "no gpu test ran: ${summary:-nothing collected}; reasons in $OUT/pytest_gpu.log"
elif [[ $RC -eq 0 ]]; then
    if grep -q "skipped" <<<"$summary"; then
        record "pytest -m gpu" PASS "$summary (skips and their reasons: $OUT/pytest_gpu.log)"
    else
        record "pytest -m gpu" PASS "$summary"
    fi
else
    record "pytest -m gpu" FAIL "exit $RC: ${summary:-see the log}; $OUT/pytest_gpu.log"
fi

# Figures of a gpu_ddp_bench.py CSV: each commlib DDP against torch's, hooks, calls.
bench_figures() {
    "$PY" - "$1" <<'PY'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
parts = []
for r in rows:
    if r["mode"].startswith("ddp-") and r["vs_torch_ddp"]:
        text = f"{r['mode']}/torch-ddp {float(r['vs_torch_ddp']):.3f}"
        if r["hooks_ms"]:
            text += f", hooks {float(r['hooks_ms']):.2f} ms/step"
        if r["py_calls_per_param"]:
            text += f", {float(r['py_calls_per_param']):.1f} py calls/param"
        parts.append(text)
step = {r["mode"]: float(r["median_ms"]) for r in rows}
if "torch-ddp" in step:
    parts.append(f"torch-ddp step {step['torch-ddp']:.1f} ms")
print("; ".join(parts))
PY
}

# 3. The DDP benchmark: NCCL at world size 1, then 2 ranks sharing the GPU (Gloo, ring).
run gpu_ddp_nccl "$BENCH_TIMEOUT" "$PY" benchmarks/gpu_ddp_bench.py --csv "$OUT/gpu_ddp_nccl.csv"
if [[ $RC -eq 0 ]]; then
    result=PASS
    grep -q "NOT met" "$OUT/gpu_ddp_nccl.log" && result="PASS (target not met)"
    record "gpu_ddp_bench nccl, world 1" "$result" "$(bench_figures "$OUT/gpu_ddp_nccl.csv")"
else
    record "gpu_ddp_bench nccl, world 1" FAIL "exit $RC: $(tail -n 1 "$OUT/gpu_ddp_nccl.log")"
fi

run gpu_ddp_2ranks "$BENCH_TIMEOUT" "$PY" benchmarks/gpu_ddp_bench.py --spawn 2 --csv "$OUT/gpu_ddp_2ranks.csv"
if [[ $RC -eq 0 ]]; then
    record "gpu_ddp_bench 2 ranks, gloo+ring" PASS "$(bench_figures "$OUT/gpu_ddp_2ranks.csv")"
else
    why="$(grep -E 'could not run|differ|Error' "$OUT/gpu_ddp_2ranks.log" | head -n 2 | paste -sd ' ' -)"
    figures="exit $RC: ${why:-$(tail -n 1 "$OUT/gpu_ddp_2ranks.log")}"
    [[ -f "$OUT/gpu_ddp_2ranks.csv" ]] && figures="$figures; $(bench_figures "$OUT/gpu_ddp_2ranks.csv")"
    record "gpu_ddp_bench 2 ranks, gloo+ring" FAIL "$figures"
fi

# 4. The all-reduce benchmark on CUDA tensors: bus bandwidth at 1, 25 and 100 MiB for ring and
#    mpi beside Gloo's CUDA all-reduce, each against its own backend on host tensors, and the
#    share of the staging copies hidden.
allreduce_figures() {
    "$PY" - "$1" <<'PY'
import csv, sys
parts = []
for r in csv.DictReader(open(sys.argv[1])):
    if r["mode"] in ("ring", "mpi", "torch-gloo") and r["busbw_GBps"]:
        text = f"{r['size'].replace(' ', '')} {r['mode']} {float(r['busbw_GBps']):.2f} GB/s"
        if r["busbw_vs_host"]:
            text += f" ({float(r['busbw_vs_host']):.2f}x host"
            text += f", {float(r['copy_hidden']):.0%} of copies hidden)" if r["copy_hidden"] else ")"
        parts.append(text)
print("; ".join(parts))
PY
}
run allreduce_cuda "$BENCH_TIMEOUT" "$VENV/bin/mpiexec" -n 2 "$PY" benchmarks/allreduce_bench.py \
    --device cuda --backends ring,gloo,mpi --sizes 1M,25M,100M --csv "$OUT/allreduce_cuda.csv"
if [[ $RC -eq 0 ]]; then
    record "allreduce_bench --device cuda" PASS "$(allreduce_figures "$OUT/allreduce_cuda.csv")"
else
    figures="exit $RC: $(tail -n 1 "$OUT/allreduce_cuda.log")"
    [[ -f "$OUT/allreduce_cuda.csv" ]] && figures="$figures; $(allreduce_figures "$OUT/allreduce_cuda.csv")"
    record "allreduce_bench --device cuda" FAIL "$figures"
fi

# ---------------------------------------------------------------------- the table
echo
printf '%-34s %-22s %s\n' "check" "result" "figures"
printf '%-34s %-22s %s\n' "-----" "------" "-------"
failed=0
for i in "${!CHECKS[@]}"; do
    printf '%-34s %-22s %s\n' "${CHECKS[$i]}" "${RESULTS[$i]}" "${FIGURES[$i]}"
    [[ "${RESULTS[$i]}" == FAIL* ]] && failed=$((failed + 1))
done
echo
if [[ $failed -gt 0 ]]; then
    say "$failed check(s) FAILED (logs in $OUT)"
    exit 1
fi
say "every check passed (logs in $OUT)"
exit 0
