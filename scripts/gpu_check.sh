#!/usr/bin/env bash
# The one command that proves commlib's GPU paths on a machine with a CUDA device.
#
#   bash scripts/gpu_check.sh [--stage STAGE]... [--python PY | --online] [--wheels DIR]
#                             [--out DIR] [--budget S]
#
# Without a GPU (no nvidia-smi, or it lists none) it says so in one line and exits 0,
# before installing anything.
#
# Offline (the default): PY (--python, else $GPU_CHECK_PYTHON, else python3) must already hold
# torch with CUDA. The project goes on PYTHONPATH, nothing is installed into PY, and every pip
# call fails rather than download (PIP_NO_INDEX=1). --wheels DIR makes a venv over PY
# (--system-site-packages, at $GPU_CHECK_VENV) and installs DIR's wheels into it from DIR alone:
# the way to add what PY lacks (mpich, pytest, pytest-timeout).
# Online (--online): creates $GPU_CHECK_VENV and installs torch with CUDA, the CuPy for its CUDA,
# mpi4py, MPICH and commlib's dev extra from the package index.
#
# Every run first reports the environment: torch and its CUDA, the CuPy wheel that CUDA needs
# (cupy-cuda<major>x) and whether it is installed, mpi4py, the MPI library, mpiexec, pytest. A
# missing piece is named (and fails the run at the end), but the stages still run.
#
# Stages, each within --budget seconds (default 540: one stage fits a 10-minute run):
#   gpu-tests  pytest -m gpu (with pytest-xdist: on half the cores' worth of workers, two ranks each)
#   cpu-tests  the CPU suite (pytest -m "not gpu"; with pytest-xdist: a worker per core but two)
#   tests      gpu-tests, then cpu-tests
#   bench      gpu_ddp_bench.py (NCCL at world size 1; 2 ranks sharing the GPU over gloo and ring),
#              allreduce_bench.py --device cuda on 2 ranks (ring, gloo, mpi; 1, 25, 100 MiB)
#   cores      allreduce_bench.py on host tensors at 4, 8 and 16 ranks (4 KiB, 1, 25, 100 MiB): ring and
#              gloo, and mpi under mpiexec where MPI is there
#   all        every stage above (the default)
# Within a stage each step may use at most an equal share of what is left of the budget.
#
# Outputs (logs, CSVs, JUnit XML, environment.txt, summary.txt) go to --out, else $GPU_CHECK_OUT,
# else $OUT, else <repo>/results/gpu_check. Exit status: 0 when every check passed, 1 when one
# failed or something is missing, 2 for bad arguments.
#
# Environment:
#   GPU_CHECK_PYTHON        offline interpreter (default python3)
#   GPU_CHECK_VENV          the venv of --wheels and --online (default <repo>/.venv-gpu)
#   GPU_CHECK_PYTEST_ARGS   more pytest arguments for both test stages (e.g. "-x" or "-k ddp")
#   GPU_CHECK_WORKERS       pytest-xdist workers for both test stages (0: none)
# A failing test's report is printed when it fails (tests/report_at_once.py), so a stage stopped at
# its budget still shows what failed.
#   PYTHON                  interpreter that creates the --online venv (default python3)
#   GPU_CHECK_TORCH         --online torch requirement, with any pip arguments (default "torch==2.13.0")
#   GPU_CHECK_CUPY          --online CuPy package (default: the one for torch's CUDA major version)
set -uo pipefail

say() { echo "gpu_check: $*"; }
usage() {
    sed -n '3,5p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
    say "error: $*" >&2
    exit 2
}

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ALL_STAGES=(gpu-tests cpu-tests bench cores)
STAGES=()
ONLINE=0
BASE_PY="${GPU_CHECK_PYTHON:-python3}"
WHEELS=""
OUT_DIR="${GPU_CHECK_OUT:-${OUT:-$ROOT/results/gpu_check}}"
BUDGET=540
while [[ $# -gt 0 ]]; do
    case "$1" in
        --stage)
            [[ $# -ge 2 ]] || usage "--stage needs a name"
            case "$2" in
                gpu-tests | cpu-tests | bench | cores) STAGES+=("$2") ;;
                tests) STAGES+=(gpu-tests cpu-tests) ;;
                all) STAGES+=("${ALL_STAGES[@]}") ;;
                *) usage "unknown stage '$2' (gpu-tests, cpu-tests, tests, bench, cores, all)" ;;
            esac
            shift 2 ;;
        --python) [[ $# -ge 2 ]] || usage "--python needs an interpreter"; BASE_PY="$2"; shift 2 ;;
        --wheels) [[ $# -ge 2 ]] || usage "--wheels needs a directory"; WHEELS="$2"; shift 2 ;;
        --out) [[ $# -ge 2 ]] || usage "--out needs a directory"; OUT_DIR="$2"; shift 2 ;;
        --budget)
            [[ $# -ge 2 && "$2" =~ ^[0-9]+$ && "$2" -gt 0 ]] || usage "--budget needs whole seconds"
            BUDGET="$2"; shift 2 ;;
        --online) ONLINE=1; shift ;;
        -h | --help) sed -n '2,40p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) usage "unknown argument '$1'" ;;
    esac
done
[[ ${#STAGES[@]} -gt 0 ]] || STAGES=("${ALL_STAGES[@]}")
# Paths given relative to where the script was started (it runs in the repository root).
absolute() { if [[ "$1" == /* ]]; then echo "$1"; else echo "$PWD/$1"; fi; }
[[ -n "$WHEELS" ]] && WHEELS="$(absolute "$WHEELS")"
[[ "$BASE_PY" == */* ]] && BASE_PY="$(absolute "$BASE_PY")"
OUT_DIR="$(absolute "$OUT_DIR")"
VENV="$(absolute "${GPU_CHECK_VENV:-$ROOT/.venv-gpu}")"
[[ $ONLINE == 1 && -n "$WHEELS" ]] && usage "--wheels is for offline runs; --online installs from the index"

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

cd "$ROOT"
mkdir -p "$OUT_DIR" || { say "error: cannot create $OUT_DIR"; exit 1; }
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
say "GPU(s): $(echo "$GPUS" | paste -sd ';' -); stages: ${STAGES[*]}; outputs in $OUT_DIR"

# --------------------------------------------------------------- the interpreter
install_online() {
    # Called as the condition of an 'if', where set -e is off: every step says '|| return 1'.
    local py="$VENV/bin/python"
    if [[ ! -x "$py" ]]; then
        "${PYTHON:-python3}" -m venv "$VENV" || { say "error: '${PYTHON:-python3} -m venv $VENV' failed"; return 1; }
    fi
    local pip=("$py" -m pip -q)
    "${pip[@]}" install --upgrade pip || return 1
    # shellcheck disable=SC2086  # GPU_CHECK_TORCH may carry pip arguments
    "${pip[@]}" install ${GPU_CHECK_TORCH:-torch==2.13.0} || return 1
    local cuda
    cuda="$("$py" -c 'import torch; print(torch.version.cuda or "")')" || return 1
    if [[ -z "$cuda" ]]; then
        say "error: the torch installed is a CPU build; set GPU_CHECK_TORCH to a CUDA build"
        return 1
    fi
    # Keep the torch just installed: the project's own requirements must not replace it.
    "$py" -c 'import importlib.metadata as m; print("torch==" + m.version("torch"))' \
        >"$VENV/gpu-constraints.txt" || return 1
    "${pip[@]}" install -c "$VENV/gpu-constraints.txt" "${GPU_CHECK_CUPY:-cupy-cuda${cuda%%.*}x}" mpi4py mpich \
        || return 1
    "${pip[@]}" install -c "$VENV/gpu-constraints.txt" -e ".[mpi,dev]" || return 1
}

install_wheels() {
    # A venv that sees everything the offline interpreter has, plus DIR's wheels, from DIR alone.
    local py="$VENV/bin/python" wheels=("$WHEELS"/*.whl) site
    [[ -e "${wheels[0]}" ]] || { say "error: no .whl file in $WHEELS"; return 1; }
    if [[ ! -x "$py" ]]; then
        "$BASE_PY" -m venv --without-pip --system-site-packages "$VENV" \
            || { say "error: '$BASE_PY -m venv --system-site-packages $VENV' failed"; return 1; }
    fi
    # --system-site-packages sees the base installation's packages only; where PY is itself a
    # venv, a .pth adds its site-packages too (after the venv's own, so DIR's wheels come first).
    # site.addsitedir also reads the .pth files there: PY may reach its packages through one
    # (a venv made by this script over another venv).
    site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" || return 1
    "$BASE_PY" -c 'import site; print("\n".join(f"import site; site.addsitedir({p!r})" for p in site.getsitepackages()))' \
        >"$site/gpu_check_base.pth" || return 1
    # pip comes from PY's packages and installs into the venv.
    "$py" -m pip install -q --no-index --find-links "$WHEELS" "${wheels[@]}" || return 1
}

if [[ $ONLINE == 1 ]]; then
    say "online: installing into $VENV (torch with CUDA is a few GB; minutes the first time)"
    if ! install_online >"$OUT_DIR/install.log" 2>&1; then
        tail -n 20 "$OUT_DIR/install.log"
        say "FAILED: installing the GPU environment (full log: $OUT_DIR/install.log)"
        exit 1
    fi
    PY="$VENV/bin/python"
else
    # Offline: any attempt to reach a package index fails at once, and loudly.
    export PIP_NO_INDEX=1
    command -v "$BASE_PY" >/dev/null 2>&1 || { say "error: no interpreter '$BASE_PY' (set --python)"; exit 1; }
    BASE_PY="$(command -v "$BASE_PY")"
    PY="$BASE_PY"
    if [[ -n "$WHEELS" ]]; then
        say "offline: installing $WHEELS/*.whl into $VENV (a venv over $BASE_PY; no index)"
        if ! install_wheels >"$OUT_DIR/install.log" 2>&1; then
            tail -n 20 "$OUT_DIR/install.log"
            say "FAILED: installing the wheels of $WHEELS (full log: $OUT_DIR/install.log)"
            exit 1
        fi
        PY="$VENV/bin/python"
        # An MPI library that came with PY's own prefix (an mpich wheel in a venv) stays in reach.
        base_prefix="$("$BASE_PY" -c 'import sys; print(sys.prefix)')"
        if compgen -G "$base_prefix/lib/libmpi*.so*" >/dev/null; then
            export LD_LIBRARY_PATH="$base_prefix/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
            export PATH="$PATH:$(dirname "$BASE_PY")"
        fi
    fi
    say "offline: using $PY, the project from PYTHONPATH, PIP_NO_INDEX=1"
fi

# ------------------------------------------------------------------- environment
timeout --kill-after=10 300 "$PY" "$ROOT/scripts/gpu_env.py" >"$OUT_DIR/environment.txt" 2>"$OUT_DIR/environment.err"
declare -A ENV_OF=()
while IFS='=' read -r key value; do
    [[ -n "$key" ]] && ENV_OF["$key"]="$value"
done <"$OUT_DIR/environment.txt"
env_of() { echo "${ENV_OF[$1]:-}"; }

fatal() {
    say "error: $*"
    say "nothing run (the environment report: $OUT_DIR/environment.txt, $OUT_DIR/environment.err)"
    exit 1
}
if [[ -z "$(env_of torch)" ]]; then
    why="$(env_of torch_error)"
    fatal "$PY cannot import torch (${why:-$(tail -n 1 "$OUT_DIR/environment.err")})"
fi
[[ -n "$(env_of torch_cuda)" ]] \
    || fatal "torch $(env_of torch) in $PY is a CPU build: use an interpreter whose torch has CUDA (--python), or --online"
[[ "$(env_of commlib)" == ok ]] || fatal "commlib does not import with $PY: $(env_of commlib)"
[[ "$(env_of cuda_available)" == 1 ]] \
    || fatal "torch.cuda.is_available() is False with torch $(env_of torch) (CUDA $(env_of torch_cuda)) although nvidia-smi lists a GPU $(env_of cuda_error)"

MISSING=()
CUPY="$(env_of cupy_wanted)"
if ! grep -qiw -- "$CUPY" <<<"$(env_of cupy_dists)"; then
    found="$(env_of cupy_dists)"
    MISSING+=("$CUPY is not installed in $PY (torch's CUDA is $(env_of torch_cuda); CuPy found: ${found:-none}); carry its wheel (--wheels)")
elif [[ "$(env_of cupy_import)" != ok* ]]; then
    MISSING+=("$CUPY is installed but 'import cupy' fails: $(env_of cupy_import)")
fi
MPIEXEC=""
for candidate in "$(dirname "$PY")/mpiexec" "$(command -v mpiexec || true)" "$(command -v mpirun || true)"; do
    if [[ -n "$candidate" && -x "$candidate" && ! -d "$candidate" ]]; then MPIEXEC="$candidate"; break; fi
done
MPI_OK=0
if [[ -z "$(env_of mpi4py)" ]]; then
    MISSING+=("MPI: mpi4py is not installed in $PY; carry the mpi4py and mpich wheels (--wheels)")
elif [[ "$(env_of mpi_library)" == error:* || -z "$(env_of mpi_library)" ]]; then
    MISSING+=("MPI: mpi4py $(env_of mpi4py) finds no MPI library ($(env_of mpi_library)); carry the mpich wheel (--wheels)")
elif [[ -z "$MPIEXEC" ]]; then
    MISSING+=("MPI: no mpiexec beside $PY or on PATH; carry the mpich wheel (--wheels)")
else
    MPI_OK=1
fi
[[ -n "$(env_of pytest)" ]] || MISSING+=("pytest is not installed in $PY; carry the pytest wheels (--wheels)")
[[ -n "$(env_of pytest_timeout)" ]] \
    || MISSING+=("pytest-timeout is not installed in $PY (tests run without a per-test timeout); carry its wheel")

ENV_LINE="torch $(env_of torch) (CUDA $(env_of torch_cuda)); $(env_of devices); NCCL $(env_of nccl)"
ENV_LINE+="; CuPy wanted: $CUPY (found: $(env_of cupy_dists))"
ENV_LINE+="; mpi4py $(env_of mpi4py) with $(env_of mpi_library), mpiexec ${MPIEXEC:-none}"
ENV_LINE+="; pytest $(env_of pytest), pytest-timeout $(env_of pytest_timeout), pytest-xdist $(env_of pytest_xdist); $(env_of cores) cores"
say "environment: $ENV_LINE"
[[ -n "$(env_of mpi_path)" ]] && say "$(env_of mpi_path)"
for gap in "${MISSING[@]}"; do say "missing: $gap"; done

# ------------------------------------------------------------------------- checks
CHECKS=()
RESULTS=()
FIGURES=()
record() { CHECKS+=("$1"); RESULTS+=("$2"); FIGURES+=("$3"); }
if [[ ${#MISSING[@]} -eq 0 ]]; then
    record "environment" PASS "$ENV_LINE"
else
    gaps="$(printf '%s; ' "${MISSING[@]}")"
    record "environment" "FAIL (missing)" "${gaps%; }"
fi

STAGE_START=0
# run NAME STEPS_LEFT COMMAND...: run a step with its output in $OUT_DIR/NAME.log; sets $RC
# (124: stopped at its share of the stage's budget; 125: not started, the budget was spent).
run() {
    local name="$1" left="$2"
    shift 2
    local remaining=$((BUDGET - (SECONDS - STAGE_START)))
    local limit=$((remaining / left))
    if [[ $limit -lt 5 ]]; then
        echo "gpu_check: $name: not started, the stage's budget of $BUDGET s is spent" >"$OUT_DIR/$name.log"
        RC=125
        return 0
    fi
    say "running $name (at most ${limit} s): $*"
    timeout --kill-after=10 "$limit" "$@" >"$OUT_DIR/$name.log" 2>&1
    RC=$?
    [[ $RC -eq 124 || $RC -eq 137 ]] && RC=124 && echo "gpu_check: $name: stopped after $limit s" >>"$OUT_DIR/$name.log"
    return 0
}

# failed NAME: the result and figures of a step that did not pass.
failed() {
    case $RC in
        124) echo "FAIL (stopped)|its share of the stage's $BUDGET s ran out; $OUT_DIR/$1.log" ;;
        125) echo "NOT RUN|the stage's $BUDGET s were spent before it" ;;
        *) echo "FAIL|exit $RC: $(grep -E 'could not run|differ|Error' "$OUT_DIR/$1.log" | head -n 2 | paste -sd ' ' -) $(tail -n 1 "$OUT_DIR/$1.log")" ;;
    esac
}
record_step() {  # record_step CHECK NAME FIGURES: PASS when RC is 0, else what failed() says.
    if [[ $RC -eq 0 ]]; then
        record "$1" PASS "$3"
    else
        local what
        what="$(failed "$2")"
        record "$1" "${what%%|*}" "${what#*|}${3:+; $3}"
    fi
}

PYTEST_ARGS=(-rs -q -p no:cacheprovider -p tests.report_at_once)
[[ -n "$(env_of pytest_timeout)" ]] && PYTEST_ARGS+=(--timeout 900)
# workers RANKS_PER_TEST: pytest-xdist's arguments for a test stage (none without pytest-xdist).
workers() {
    local cores n
    cores="$(env_of cores)"
    n="${GPU_CHECK_WORKERS:-$(((${cores:-1} - 2) / $1))}"
    [[ -n "$(env_of pytest_xdist)" && "$n" =~ ^[0-9]+$ && $n -ge 2 ]] && echo "-n $n"
}
# shellcheck disable=SC2206  # GPU_CHECK_PYTEST_ARGS is a list of words
PYTEST_ARGS+=(${GPU_CHECK_PYTEST_ARGS:-})

pytest_summary() { grep -E '(passed|failed|error|skipped|no tests ran)' "$OUT_DIR/$1.log" | tail -n 1 | tr -d '=' | sed 's/^ *//'; }

stage_gpu_tests() {
    # shellcheck disable=SC2046  # workers prints words
    run pytest_gpu 1 "$PY" -m pytest -m gpu "${PYTEST_ARGS[@]}" $(workers 2) --junitxml "$OUT_DIR/pytest_gpu.xml" tests
    local summary
    summary="$(pytest_summary pytest_gpu)"
    if [[ $RC -eq 0 ]] && ! grep -q "passed" <<<"$summary"; then
        # With a GPU every gpu test should run: all skipped means the device was not seen.
        record "pytest -m gpu" FAIL "no gpu test ran: ${summary:-nothing collected}; reasons in $OUT_DIR/pytest_gpu.log"
    else
        record_step "pytest -m gpu" pytest_gpu "${summary}"
    fi
}

stage_cpu_tests() {
    # shellcheck disable=SC2046  # workers prints words
    run pytest_cpu 1 "$PY" -m pytest -m "not gpu" "${PYTEST_ARGS[@]}" $(workers 1) --junitxml "$OUT_DIR/pytest_cpu.xml" tests
    record_step "pytest (CPU suite)" pytest_cpu "$(pytest_summary pytest_cpu)"
}

# csv_figures KIND FILE: one line of figures from a benchmark's CSV (stdlib only).
csv_figures() {
    [[ -f "$2" ]] || { echo "no CSV written"; return; }
    "$PY" - "$1" "$2" <<'PY'
import csv, sys
kind, path = sys.argv[1], sys.argv[2]
rows = list(csv.DictReader(open(path)))
parts = []
if kind == "ddp":
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
else:
    for r in rows:
        if r["mode"] not in ("ring", "mpi", "gloo", "torch-gloo", "mpi4py") or not r["busbw_GBps"]:
            continue
        where = f"{r['world_size']} ranks {r['size'].replace(' ', '')} {r['mode']}"
        if int(r["size_bytes"]) <= 65536:  # small messages: the latency is the figure
            parts.append(f"{where} {float(r['median_us']):.1f} us")
        else:
            text = f"{where} {float(r['busbw_GBps']):.2f} GB/s"
            if r.get("busbw_vs_host"):
                text += f" ({float(r['busbw_vs_host']):.2f}x host"
                text += f", {float(r['copy_hidden']):.0%} of copies hidden)" if r.get("copy_hidden") else ")"
            parts.append(text)
print("; ".join(parts))
PY
}

stage_bench() {
    run gpu_ddp_nccl 3 "$PY" benchmarks/gpu_ddp_bench.py --csv "$OUT_DIR/gpu_ddp_nccl.csv" \
        --hook-profile "$OUT_DIR/hook_profile_nccl.txt"
    local figures
    figures="$(csv_figures ddp "$OUT_DIR/gpu_ddp_nccl.csv")"
    record_step "gpu_ddp_bench nccl, world 1" gpu_ddp_nccl "$figures"
    [[ $RC -eq 0 ]] && grep -q "NOT met" "$OUT_DIR/gpu_ddp_nccl.log" \
        && RESULTS[${#RESULTS[@]} - 1]="PASS (target not met)"

    # Each 2-rank step all-reduces 500 MB of gradients through host memory: the fewest steps that give medians.
    run gpu_ddp_2ranks 2 "$PY" benchmarks/gpu_ddp_bench.py --spawn 2 --steps 12 --warmup 2 \
        --csv "$OUT_DIR/gpu_ddp_2ranks.csv"
    figures="$(csv_figures ddp "$OUT_DIR/gpu_ddp_2ranks.csv")"
    record_step "gpu_ddp_bench 2 ranks, gloo+ring" gpu_ddp_2ranks "$figures"

    local bench=(benchmarks/allreduce_bench.py --device cuda --sizes 1M,25M,100M --csv "$OUT_DIR/allreduce_cuda.csv")
    if [[ $MPI_OK == 1 ]]; then
        run allreduce_cuda 1 "$MPIEXEC" -n 2 "$PY" "${bench[@]}" --backends ring,gloo,mpi
        figures=""
    else
        run allreduce_cuda 1 "$PY" "${bench[@]}" --spawn 2 --backends ring,gloo
        figures="mpi not measured (no MPI); "
    fi
    figures+="$(csv_figures allreduce "$OUT_DIR/allreduce_cuda.csv")"
    record_step "allreduce_bench --device cuda" allreduce_cuda "$figures"
}

stage_cores() {
    # Host tensors at 4, 8 and 16 ranks: the 4 KiB latency and the bus bandwidth at 1, 25 and 100 MiB,
    # MPICH beside the ring and Gloo where MPI is there (mpiexec starts the ranks).
    local n csv figures left=3
    local bench=(benchmarks/allreduce_bench.py --sizes 4K,1M,25M,100M)
    for n in 4 8 16; do
        csv="$OUT_DIR/allreduce_cpu_$n.csv"
        if [[ $MPI_OK == 1 ]]; then
            run "allreduce_cpu_$n" $left "$MPIEXEC" -n "$n" "$PY" "${bench[@]}" --backends ring,gloo,mpi --csv "$csv"
            figures=""
        else
            run "allreduce_cpu_$n" $left "$PY" "${bench[@]}" --spawn "$n" --backends ring,gloo --csv "$csv"
            figures="mpi not measured (no MPI); "
        fi
        record_step "allreduce_bench cpu, $n ranks" "allreduce_cpu_$n" "$figures$(csv_figures allreduce "$csv")"
        left=$((left - 1))
    done
}

for stage in "${STAGES[@]}"; do
    STAGE_START=$SECONDS
    say "stage $stage (budget $BUDGET s)"
    "stage_${stage//-/_}"
done

# ---------------------------------------------------------------------- the table
{
    echo
    printf '%-44s %-22s %s\n' "check" "result" "figures"
    printf '%-44s %-22s %s\n' "-----" "------" "-------"
    for i in "${!CHECKS[@]}"; do
        printf '%-44s %-22s %s\n' "${CHECKS[$i]}" "${RESULTS[$i]}" "${FIGURES[$i]}"
    done
    echo
} | tee "$OUT_DIR/summary.txt"
failed_count=0
for result in "${RESULTS[@]}"; do
    [[ "$result" == FAIL* || "$result" == "NOT RUN" ]] && failed_count=$((failed_count + 1))
done
if [[ $failed_count -gt 0 ]]; then
    say "$failed_count check(s) FAILED or did not run (outputs in $OUT_DIR)"
    exit 1
fi
say "every check passed (outputs in $OUT_DIR)"
exit 0
