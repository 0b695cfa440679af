"""Hangs and desyncs explained on ring, gloo and mpi; MAX/MIN and autograd semantics that agree across them.

Each scenario that used to corrupt silently or abort (mismatched sizes,
dtypes, ops, roots and collectives; the Gloo abort on 100 against 200 elements;
an in-place all_reduce on a tensor saved for backward; NaN under MAX/MIN) is a
case here, plus a 3 s stall with ``COMMLIB_STALL_S=1``, flight-recorder dumps
and the divergence report. Spawned ranks cover ring and gloo; the mpi cases run
under ``mpiexec``.
"""

from __future__ import annotations

import json
import math
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from commlib import ReduceOp
from commlib.diagnosis.flight_recorder import main as flight_main
from tests._launcher import RankPool, run_ranks_outcomes
from tests.conftest import requires_mpi
from tests.distributed import diagnosis_bodies as bodies
from tests.distributed.mpi_bodies import launch

pytestmark = pytest.mark.multiprocess

BACKENDS = ("ring", "gloo")
MODULE = "tests.distributed.diagnosis_bodies"

EXPECTED = {
    "size": "ranks passed tensors of different sizes or dtypes: rank 0: float32 (100,) [100 elements]; "
    "rank 1: float32 (200,) [200 elements]",
    "size_1m": "rank 0: float32 (1048576,) [1048576 elements]; rank 1: float32 (2097152,) [2097152 elements]",
    "dtype": "rank 0: float32 (64,) [64 elements]; rank 1: int32 (64,) [64 elements]",
    "op": "ranks disagree on the reduce op: rank 0: SUM; rank 1: MAX",
    "root": "ranks disagree on the source rank: rank 0: src=0; rank 1: src=1",
    "collective": "ranks called different collectives: rank 0: all_reduce #{seq}; rank 1: broadcast #{seq}",
    "gather_scatter": "ranks called different collectives: rank 0: gather #{seq}; rank 1: scatter #{seq}",
    "reduce_dst": "ranks disagree on the destination rank: rank 0: dst=0; rank 1: dst=1",
    "a2a_splits": "ranks disagree on the all_to_all splits: rank 0 sends 3 elements to rank 1, which "
    "expects 2. Rank i's input split j must equal rank j's output split i",
    "reduce_scatter_size": "rank 0: float32 (50,) [50 elements]; rank 1: float32 (100,) [100 elements]",
    "gather_reduce": "ranks called different collectives: rank 0: gather #{seq}; rank 1: reduce #{seq}",
    "barrier_all_reduce": "ranks called different collectives: rank 0: barrier #{seq}; "
    "rank 1: all_reduce #{seq}",
}
"""What each desync case's error must say (on every rank)."""

RING_EXPECTED = {
    "a2a_splits": "ranks disagree on the split sizes: rank 0 sends 3 to rank 1, which expects 2",
}
"""Where the ring's own record check (its default) words a mismatch otherwise."""

FIRST_OP = {
    "root": ("broadcast", "broadcast"),
    "collective": ("all_reduce", "broadcast"),
    "gather_scatter": ("gather", "scatter"),
    "reduce_dst": ("reduce", "reduce"),
    "a2a_splits": ("all_to_all", "all_to_all"),
    "reduce_scatter_size": ("reduce_scatter", "reduce_scatter"),
    "gather_reduce": ("gather", "reduce"),
    "barrier_all_reduce": ("barrier", "all_reduce"),
}


@pytest.fixture(scope="module")
def dump_dirs() -> Iterator[dict[str, Path]]:
    with tempfile.TemporaryDirectory(prefix="commlib-diag-") as root:
        dirs = {}
        for name in ("detail", "plain", "defaults"):
            for backend in (*BACKENDS, "mpi"):
                path = Path(root) / f"{name}-{backend}"
                path.mkdir()
                dirs[f"{name}-{backend}"] = path
        yield dirs


@pytest.fixture(scope="module")
def pools(dump_dirs: dict[str, Path]) -> Iterator[dict[str, RankPool]]:
    """Per backend: ``detail`` (fingerprint check, stall reports after 1 s, flight recorder) and ``plain``."""
    made: dict[str, RankPool] = {}
    for backend in BACKENDS:
        for name, extra in (
            ("detail", {"COMMLIB_DEBUG": "DETAIL"}),
            ("plain", {"COMMLIB_DEBUG": "OFF"}),
            ("defaults", {}),
        ):
            env = {
                "COMMLIB_TIMEOUT": "60",
                "COMMLIB_STALL_S": "1",
                "COMMLIB_FLIGHT_RECORDER": "64",
                "COMMLIB_DUMP_DIR": str(dump_dirs[f"{name}-{backend}"]),
                **extra,
            }
            made[f"{name}-{backend}"] = RankPool(2, backend, env=env)
    yield made
    for pool in made.values():
        pool.close()


def _check_desync(case: str, backend: str, outcome: list[dict[str, Any]], each_call: bool = True) -> None:
    for rank, value in enumerate(outcome):
        assert value["error"] is not None, f"rank {rank}: {case} raised nothing"
        kind, message = value["error"]
        seq = value["seq"]
        assert kind == "CollectiveMismatchError", message
        op = FIRST_OP.get(case, ("all_reduce", "all_reduce"))[rank]
        head = f"[rank {rank}/2] {backend}.{op} #{seq}"
        # A subgroup's messages name it (`` in group [0, 1] (global ranks)``); the world's do not.
        subgroup = f"{head} in group [0, 1] (global ranks)"
        assert message.startswith((f"{head} (", f"{head}: ", subgroup)), message
        expected = EXPECTED[case] if each_call else RING_EXPECTED.get(case, EXPECTED[case])
        assert expected.format(seq=seq) in message, message
        if each_call:  # the fingerprint check's; the ring's own records name the calls in the text above
            assert "each rank's call: rank 0: " in message
        assert value["elapsed_s"] < 10, "a mismatch must raise within seconds"
        assert value["after"] == 2.0, "the group must stay usable after a mismatch"


def _check_extra_collective(backend: str, outcome: list[dict[str, Any]]) -> None:
    """``extra_collective_counts``: at the barrier and at destroy, every rank raised naming the counts."""
    for rank, value in enumerate(outcome):
        case = value["barrier"]
        seq = case["seq"]
        assert case["error"] is not None, f"rank {rank}: the barrier after an extra all_reduce raised nothing"
        kind, text = case["error"]
        op = "barrier" if rank == 0 else "all_reduce"
        assert kind == "CollectiveMismatchError", text
        assert text.startswith(f"[rank {rank}/2] {backend}.{op} #{seq}"), text
        assert f"rank 0: barrier #{seq}; rank 1: all_reduce #{seq}" in text, text
        assert (
            f"before the barrier: rank 0: {seq - 1} before its barrier #{seq}; "
            f"rank 1: at least {seq} (it is in all_reduce #{seq})" in text
        ), text
        assert f"rank 0: {seq} issued (last: " in text and f"all_reduce #{seq - 1}, barrier #{seq})" in text
        assert (
            f"rank 1: {seq} issued (last: " in text and f"all_reduce #{seq - 1}, all_reduce #{seq})" in text
        )
        assert value["after"] == 2.0, "the ranks are in step again after the error"
    # Rank 0's all_reduce paired with rank 1's extra one (1 + 10); rank 1's own never ran.
    assert [value["barrier"]["sum"] for value in outcome] == [11.0, 2.0]
    rank0, rank1 = (value["destroy"] for value in outcome)
    seq = rank0["seq"]
    assert rank0["error"] is None and rank0["sum"] == 11.0, rank0
    assert rank0["at_destroy"] is not None, "destroy_process_group after an extra all_reduce raised nothing"
    kind, text = rank0["at_destroy"]
    assert kind == "CollectiveMismatchError", text
    assert text.startswith(f"[rank 0/2] {backend}.destroy_process_group: the barrier it runs first"), text
    assert f"rank 0: barrier #{seq}; rank 1: all_reduce #{seq}" in text, text
    assert f"rank 0: {seq - 1} before its barrier #{seq}; rank 1: at least {seq}" in text, text
    assert f"barrier #{seq}, in destroy_process_group)" in text, text
    assert rank1["error"] is not None and rank1["at_destroy"] is None, rank1
    kind, text = rank1["error"]
    assert kind == "CollectiveMismatchError" and text.startswith(f"[rank 1/2] {backend}.all_reduce #{seq}")
    assert f"barrier #{seq}, in destroy_process_group)" in text, text


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_collective_more_is_caught_at_the_next_barrier_and_at_destroy_on_the_defaults(
    pools: dict[str, RankPool], backend: str
) -> None:
    """Rank 1 issues one all_reduce more (same shape): the barrier, or destroy_process_group, raises."""
    _check_extra_collective(
        backend, pools[f"defaults-{backend}"].run(bodies.extra_collective_counts, timeout=90)
    )


def _check_extra_collective_in_ddp(backend: str, outcome: list[dict[str, Any]]) -> None:
    for rank, value in enumerate(outcome):
        assert value["error"] is not None, (
            f"rank {rank}: an extra all_reduce between DDP steps raised nothing"
        )
        kind, text = value["error"]
        assert kind == "CollectiveMismatchError", text
        start = (
            "[rank 0/2] ddp.backward: waiting for the DDP step agreement"
            if rank == 0
            else f"[rank 1/2] {backend}.all_reduce #"
        )
        assert text.startswith(start), text
        assert (
            "ranks called different collectives: rank 0: all_gather #" in text
            and "rank 1: all_reduce #" in text
        )
        assert "Each rank's collectives on this group: rank 0: " in text, text


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_collective_more_between_ddp_steps_is_caught_in_the_next_backward(
    pools: dict[str, RankPool], backend: str
) -> None:
    _check_extra_collective_in_ddp(
        backend, pools[f"defaults-{backend}"].run(bodies.extra_collective_in_ddp, timeout=90)
    )


# ----------------------------------------------------------------- desyncs
@pytest.mark.parametrize("case", list(bodies.DESYNCS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_desync_raises_on_every_rank(pools: dict[str, RankPool], backend: str, case: str) -> None:
    outcome = pools[f"detail-{backend}"].run(bodies.desync, case, timeout=90)
    assert [value["transport"] for value in outcome] == ["shared memory"] * 2
    _check_desync(case, backend, outcome)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fingerprints_cross_hosts_over_the_fallback(pools: dict[str, RankPool], backend: str) -> None:
    """A rank on another host: no shared-memory board, and every desync still raises on every rank."""
    outcome = pools[f"detail-{backend}"].run(bodies.desyncs_across_hosts, timeout=180)
    fallback = {"gloo": "backend", "ring": "side channel"}[backend]
    assert [value["transport"] for value in outcome] == [fallback] * 2
    assert outcome[0]["left"] == [], "rank 0 left its board's file in /dev/shm"
    for case in bodies.DESYNCS:
        _check_desync(case, backend, [value[case] for value in outcome])


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_board_is_mapped_and_its_file_removed(pools: dict[str, RankPool], backend: str) -> None:
    """Once the group is up, every rank maps the board and no file is left in /dev/shm."""
    outcome = pools[f"detail-{backend}"].run(bodies.board_set_up, timeout=90)
    for value in outcome:
        assert value["transport"] == "shared memory"
        assert len(value["mapped"]) == 1 and value["mapped"][0].endswith(" (deleted)"), value["mapped"]
        assert value["mapped"][0].startswith("/dev/shm/commlib-board-")
    assert outcome[0]["mapped"] == outcome[1]["mapped"]
    assert outcome[0]["left"] == []


@pytest.mark.parametrize("case", list(bodies.DESYNCS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_desync_raises_on_every_rank_on_the_backends_defaults(
    pools: dict[str, RankPool], backend: str, case: str
) -> None:
    """Without COMMLIB_DEBUG: gloo runs the fingerprint check by default, the ring its own records."""
    outcome = pools[f"defaults-{backend}"].run(bodies.desync_on_defaults, case, timeout=90)
    assert all(value["debug"] is None for value in outcome), "the pool must run without COMMLIB_DEBUG"
    assert all(value["fingerprints"] is (backend == "gloo") for value in outcome)
    expected = "shared memory" if backend == "gloo" else "none"
    assert [value["transport"] for value in outcome] == [expected] * 2
    _check_desync(case, backend, outcome, each_call=backend == "gloo")


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_collective_more_on_one_rank_names_both_call_sites(
    pools: dict[str, RankPool], backend: str
) -> None:
    """Rank 0 issues one all_reduce more, of the same shape: DETAIL compares call sites and catches it."""
    outcome = pools[f"detail-{backend}"].run(bodies.extra_collective, timeout=90)
    for rank, value in enumerate(outcome):
        assert value["error"] is not None, f"rank {rank}: raised nothing; its sum is {value['value']}"
        kind, message = value["error"]
        assert kind == "CollectiveMismatchError", message
        assert message.startswith(f"[rank {rank}/2] {backend}.all_reduce #{value['seq']} ("), message
        assert f"ranks issued collective #{value['seq']} from different lines of code" in message, message
        assert "called from rank 0: " in message and "diagnosis_bodies.py:" in message, message
        assert " in _one_more; rank 1: " in message and message.endswith(" in extra_collective)"), message
        assert value["value"] == rank + 1, "no data may move before the check"


@pytest.mark.parametrize("case", ["op", "root"])
def test_ring_catches_op_and_root_mismatches_without_detail(pools: dict[str, RankPool], case: str) -> None:
    """With COMMLIB_DEBUG off (the ring's default) the ring's own record exchange names both sides."""
    outcome = pools["plain-ring"].run(bodies.desync_checked_by, case, timeout=90)
    for rank, value in enumerate(outcome):
        assert value["fingerprints"] is False, "the side channel's check ran: this tests the ring's own"
        assert value["error"] is not None, f"rank {rank}: {case} raised nothing"
        kind, message = value["error"]
        assert kind == "CollectiveMismatchError", message
        op = FIRST_OP.get(case, ("all_reduce", "all_reduce"))[rank]
        assert message.startswith(f"[rank {rank}/2] ring.{op} #{value['seq']} ("), message
        fix = "Every rank must pass the same op" if case == "op" else "Every rank must name the same src"
        assert f"{EXPECTED[case]}. {fix}" in message, message
        assert value["elapsed_s"] < 10, "a mismatch must raise within seconds"
        assert value["after"] == 2.0, "the group must stay usable after a mismatch"


@pytest.mark.parametrize("backend", BACKENDS)
def test_async_collectives_do_not_wait_for_the_check(pools: dict[str, RankPool], backend: str) -> None:
    rank0, rank1 = pools[f"detail-{backend}"].run(bodies.async_under_check, timeout=90)
    assert rank0["issue_s"] < 0.5, "async_op=True waited for the late rank"
    assert rank0["expired"] is not None and "Work.wait(timeout=0.05) expired" in rank0["expired"]
    assert rank0["sum"] == rank1["sum"] == 2.0
    for rank, value in enumerate((rank0, rank1)):
        assert value["mismatch"].startswith(
            f"CollectiveMismatchError: [rank {rank}/2] {backend}.all_reduce #{value['mismatch_seq']} "
        ), value["mismatch"]
        assert "rank 0: float32 (10,) [10 elements]; rank 1: float32 (20,) [20 elements]" in value["mismatch"]
        assert value["after"] == 2.0


def test_rank0s_settings_apply_to_the_group() -> None:
    """Rank 1 asks for no check and no stall reports; rank 0 for both: the group checks, on both ranks."""
    per_rank_env = [{"COMMLIB_DEBUG": "DETAIL"}, {"COMMLIB_DEBUG": "OFF", "COMMLIB_STALL_S": "0"}]
    outcomes = run_ranks_outcomes(
        bodies.settings_of_rank0, 2, backend="gloo", per_rank_env=per_rank_env, timeout=90
    )
    assert all(o.ok for o in outcomes), [o.error for o in outcomes]
    for outcome in outcomes:
        assert outcome.value["checked"] is True
        assert outcome.value["error"][0] == "CollectiveMismatchError"
        assert outcome.value["after"] == 2.0


# ------------------------------------------------------------------ stalls
def _check_stall(value: dict[str, Any], backend: str) -> None:
    warnings, seq = value["warnings"], value["seq"]
    assert 1 <= len(warnings) <= 4, warnings  # at most one per COMMLIB_STALL_S while it waits 3 s
    text = warnings[0]
    assert text.startswith(f"[rank 0/2] {backend}.all_reduce #{seq} (float32 (1000,) SUM) has waited "), text
    assert "(COMMLIB_STALL_S=1); it goes on waiting until the timeout (60 s" in text
    assert (
        f"Ranks that have not reached it: rank 1 (last completed: #{seq - 1} all_reduce float32 (10,) SUM; "
        in text
    ), text


@pytest.mark.waits
@pytest.mark.parametrize("mode", ["plain", "detail"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_stall_is_reported_then_the_collective_completes(
    pools: dict[str, RankPool], backend: str, mode: str
) -> None:
    rank0, rank1 = pools[f"{mode}-{backend}"].run(bodies.stall, timeout=90)
    _check_stall(rank0, backend)
    assert rank1["warnings"] == [], "the late rank did not wait"
    assert rank0["sum"] == rank1["sum"] == 2.0
    assert rank0["waited_s"] > 2.0


@pytest.mark.waits
def test_stall_in_different_calls_names_each_ranks_call() -> None:
    """Gloo, no fingerprint check: every rank reached #N, in different collectives; the report names them."""
    env = {"COMMLIB_DEBUG": "OFF", "COMMLIB_STALL_S": "1", "COMMLIB_TIMEOUT": "3"}
    outcomes = run_ranks_outcomes(bodies.stall_in_different_calls, 2, backend="gloo", env=env, timeout=90)
    assert all(o.ok for o in outcomes), [o.error for o in outcomes]
    errors = [o.value["error"] for o in outcomes]
    # Gloo closes a pair whose operation timed out: a rank whose own deadline comes a little
    # later sees its peer's connection close first. At least one rank reports its timeout.
    assert any(e.startswith("CommTimeoutError: ") for e in errors), errors
    for rank, outcome in enumerate(outcomes):
        value = outcome.value
        seq = value["seq"]
        op = ("all_reduce", "broadcast")[rank]
        error = value["error"]
        call = f"[rank {rank}/2] gloo.{op} #{seq} "
        assert error.startswith((f"CommTimeoutError: {call}", f"PeerFailureError: {call}")), error
        assert value["warnings"], f"rank {rank} logged no stall report before the timeout"
        text = value["warnings"][0]
        assert text.startswith(f"[rank {rank}/2] gloo.{op} #{seq} "), text
        assert (
            f"Every rank has reached #{seq}, but in different calls: rank 0: #{seq} all_reduce float32 (64,) "
            f"SUM; rank 1: #{seq} broadcast float32 (64,) src=0. Every rank must issue the same collectives"
        ) in text, text


@pytest.mark.waits
@pytest.mark.parametrize("backend", BACKENDS)
def test_stall_in_ddp_names_the_bucket(pools: dict[str, RankPool], backend: str) -> None:
    rank0, rank1 = pools[f"plain-{backend}"].run(bodies.stall_in_ddp, timeout=90)
    assert rank0["grad_sum"] == rank1["grad_sum"]
    assert rank0["warnings"], "no stall warning"
    text = rank0["warnings"][0]
    assert "Context: DDP bucket 0, 4 parameters, first: " in text, text
    assert "2.bias" in text or "0.weight" in text, text
    assert "Ranks that have not reached it: rank 1" in text, text


# ----------------------------------------------------------- flight recorder
def _divergence(directory: Path, capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()
    assert flight_main([str(directory)]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("backend", BACKENDS)
def test_dump_after_a_mismatch_and_the_divergence_report(
    tmp_path: Path, backend: str, capsys: pytest.CaptureFixture[str]
) -> None:
    chosen = tmp_path / "chosen"
    env = {"COMMLIB_DEBUG": "DETAIL", "COMMLIB_FLIGHT_RECORDER": "16", "COMMLIB_DUMP_DIR": str(tmp_path)}
    outcomes = run_ranks_outcomes(bodies.dumps, 2, backend=backend, args=(str(chosen),), env=env, timeout=90)
    assert all(o.ok for o in outcomes), [o.error for o in outcomes]
    values = [o.value for o in outcomes]
    seq = values[0]["mismatch"]["seq"]
    for rank, value in enumerate(values):
        assert value["mismatch"]["error"] is not None
        assert f"commlib_flight_rank{rank}.json" in value["mismatch"]["files"]
    document = json.loads((tmp_path / "commlib_flight_rank1.json").read_text())
    assert document["reason"].startswith("CollectiveMismatchError: [rank 1/2]")
    (group,) = document["groups"]
    last = group["entries"][-1]
    assert (last["seq"], last["op"], last["shape"], last["status"]) == (seq, "all_reduce", [200], "failed")
    report = _divergence(tmp_path, capsys)
    assert f"first divergence at #{seq} (the ranks' calls differ):" in report, report
    assert f"rank 0: all_reduce #{seq} float32 (100,) SUM [failed: CollectiveMismatchError" in report
    assert f"rank 1: all_reduce #{seq} float32 (200,) SUM [failed: CollectiveMismatchError" in report
    # On request, into a directory of the caller's choosing: the same history, as far as it went.
    names = [Path(v["request"]["path"]).name for v in values]
    assert names == ["commlib_flight_rank0.json", "commlib_flight_rank1.json"]
    assert f"first divergence at #{seq}" in _divergence(chosen, capsys)


@pytest.mark.waits
def test_sigusr1_dumps_while_blocked_inside_gloo(
    pools: dict[str, RankPool], dump_dirs: dict[str, Path]
) -> None:
    rank0, _ = pools["plain-gloo"].run(bodies.dump_on_sigusr1, timeout=90)
    assert rank0["written"] is not None, "no dump on SIGUSR1"
    # Written ~1 s in, while the all_reduce still waited for rank 1 (3 s): not when it returned.
    assert rank0["written"] < rank0["finished"] - 1.0, rank0
    document = json.loads(Path(rank0["path"]).read_text())
    assert document["reason"] == "SIGUSR1"
    entry = document["groups"][0]["entries"][-1]
    assert (entry["seq"], entry["status"]) == (rank0["seq"], "in flight")


@pytest.mark.waits
def test_a_missing_rank_shows_in_the_dumps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    env = {"COMMLIB_TIMEOUT": "3", "COMMLIB_FLIGHT_RECORDER": "8", "COMMLIB_DUMP_DIR": str(tmp_path)}
    outcomes = run_ranks_outcomes(bodies.miss_then_dump, 2, backend="gloo", env=env, timeout=90)
    assert all(o.ok for o in outcomes), [o.error for o in outcomes]
    rank0, rank1 = (o.value for o in outcomes)
    assert rank0["error"].startswith(f"CommTimeoutError: [rank 0/2] gloo.all_reduce #{rank0['seq']}")
    report = _divergence(tmp_path, capsys)
    assert f"first divergence at #{rank0['seq']} (some rank never reached it):" in report, report
    assert f"rank 0: all_reduce #{rank0['seq']} float32 (4,) SUM [failed: CommTimeoutError" in report
    assert f"rank 1: missing (its last recorded collective is all_reduce #{rank1['seq']}" in report


# --------------------------------------------------------------- semantics
def _reference_nan(world: int) -> dict[str, list[str]]:
    out = {}
    for dtype in bodies.FLOATS:
        for op, combine in ((ReduceOp.MAX, torch.maximum), (ReduceOp.MIN, torch.minimum)):
            result = bodies.nan_inputs(0, dtype)
            for r in range(1, world):
                result = combine(result, bodies.nan_inputs(r, dtype))
            text = ["nan" if math.isnan(v) else repr(v) for v in result.double().tolist()]
            for kind in ("all_reduce", "all_reduce async", "reduce_scatter"):
                out[f"{kind} {dtype} {op.name}"] = text
    return out


def _check_semantics(values: dict[str, Any], world: int) -> None:
    reference = _reference_nan(world)
    assert values["nan"] == reference
    assert values["version"] == {
        "all_reduce": "RuntimeError",
        "broadcast": True,
        "all_gather": True,
        "reduce_scatter": True,
        "all_reduce async": True,
    }


def test_nan_and_autograd_semantics_agree_on_ring_and_gloo(pools: dict[str, RankPool]) -> None:
    results = {backend: pools[f"plain-{backend}"].run(bodies.semantics, timeout=120) for backend in BACKENDS}
    for per_rank in results.values():
        for value in per_rank:
            _check_semantics(value, 2)
    assert results["ring"] == results["gloo"]


def test_semantics_and_futures_under_gloos_default_check(pools: dict[str, RankPool]) -> None:
    """The same on gloo's defaults, where async collectives go through the check's launcher thread.

    ``work.get_future().wait()`` with no other waiter must complete there too.
    """
    plain = pools["plain-gloo"].run(bodies.semantics, timeout=120)
    checked = pools["defaults-gloo"].run(bodies.semantics, timeout=120)
    for value in checked:
        _check_semantics(value, 2)
    assert checked == plain


# --------------------------------------------------------------------- mpi
MPI_ENV = {"COMMLIB_TIMEOUT": "30", "COMMLIB_STALL_S": "1", "COMMLIB_FLIGHT_RECORDER": "64"}


@pytest.mark.mpi
@pytest.mark.launcher
@requires_mpi
def test_mpi_desyncs_dumps_and_semantics(
    dump_dirs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """Under mpiexec, with the mpi backend's default COMMLIB_DEBUG: every desync raises; dumps; semantics."""
    directory = dump_dirs["detail-mpi"]
    # The dump test first: the report names the first divergence, and the desyncs come after it.
    names = [
        f"{MODULE}:{b}"
        for b in (
            "dump_after_mismatch",
            "desyncs",
            "extra_collective_counts",
            "extra_collective_in_ddp",
            "semantics_equivalence",
        )
    ]
    result = launch(names, 2, env={**MPI_ENV, "COMMLIB_DUMP_DIR": str(directory)}, timeout=240)
    assert result.returncode == 0, result.describe()
    per_rank = [result.results[r] for r in range(2)]
    for case in bodies.DESYNCS:
        _check_desync(case, "mpi", [v[f"{MODULE}:desyncs"][case] for v in per_rank])
        assert [v[f"{MODULE}:desyncs"][case]["transport"] for v in per_rank] == ["shared memory"] * 2
    _check_extra_collective("mpi", [v[f"{MODULE}:extra_collective_counts"] for v in per_rank])
    _check_extra_collective_in_ddp("mpi", [v[f"{MODULE}:extra_collective_in_ddp"] for v in per_rank])
    seq = per_rank[0][f"{MODULE}:dump_after_mismatch"]["seq"]
    report = _divergence(directory, capsys)
    assert f"first divergence at #{seq} (the ranks' calls differ):" in report, report
    for values in per_rank:
        equivalence = values[f"{MODULE}:semantics_equivalence"]
        assert sorted(equivalence) == ["gloo", "mpi", "ring"]
        for value in equivalence.values():
            _check_semantics(value, 2)
        assert equivalence["mpi"] == equivalence["gloo"] == equivalence["ring"]


@pytest.mark.mpi
@pytest.mark.launcher
@requires_mpi
def test_mpi_fingerprints_over_the_board_and_across_hosts() -> None:
    """The default check maps the board (file removed); a rank on another host: MPI exchanges, same errors."""
    names = [f"{MODULE}:{b}" for b in ("board_set_up", "desyncs_across_hosts")]
    result = launch(names, 2, env=MPI_ENV, timeout=240)
    assert result.returncode == 0, result.describe()
    per_rank = [result.results[r] for r in range(2)]
    for value in (v[f"{MODULE}:board_set_up"] for v in per_rank):
        assert value["transport"] == "shared memory"
        assert len(value["mapped"]) == 1 and value["mapped"][0].endswith(" (deleted)"), value["mapped"]
        assert value["left"] == []
    across = [v[f"{MODULE}:desyncs_across_hosts"] for v in per_rank]
    assert [value["transport"] for value in across] == ["backend"] * 2
    assert across[0]["left"] == []
    for case in bodies.DESYNCS:
        _check_desync(case, "mpi", [value[case] for value in across])


@pytest.mark.waits
@pytest.mark.mpi
@pytest.mark.launcher
@requires_mpi
@pytest.mark.parametrize("debug", ["DETAIL", "OFF"])
def test_mpi_stall_warns_on_stderr_without_logging_set_up(debug: str) -> None:
    """The rank waits in the fingerprint exchange (DETAIL, the default) or in MPI itself (OFF)."""
    result = launch(f"{MODULE}:stall", 2, [3.0, False], env={**MPI_ENV, "COMMLIB_DEBUG": debug}, timeout=120)
    assert result.returncode == 0, result.describe()
    rank0 = result.results[0][f"{MODULE}:stall"]
    assert rank0["sum"] == 2.0 and rank0["waited_s"] > 2.0
    seq = rank0["seq"]
    assert f"[rank 0/2] mpi.all_reduce #{seq} (float32 (1000,) SUM) has waited " in result.stderr, (
        result.describe()
    )
    assert (
        f"Ranks that have not reached it: rank 1 (last completed: #{seq - 1} all_reduce float32 (10,) SUM"
        in result.stderr
    ), result.describe()
