"""The mpi backend: collectives, async progress, equivalence with gloo, and faults, under real mpiexec.

Spawned ranks are MPI singletons, so every multi-rank test here starts
``mpiexec -n N python tests/distributed/mpi_bodies.py BODY`` in a subprocess
with a timeout, and asserts on its exit code, output and the values each rank
pickled. The interface's bodies (collective matrix, point-to-point, subgroups,
objects, training on subgroups) and mpi's own run in one job per world size
(``CALLS``), launched once and shared by the tests that read it. Unit tests
of the pieces (config, progress thread, wait loop) run in-process without
initialising MPI.
"""

from __future__ import annotations

import functools
import json
import math
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from commlib import BackendUnavailableError, CommConfig, DistEnv
from tests._launcher import run_ranks_outcomes
from tests.conftest import find_mpiexec, requires_gpu, requires_mpi
from tests.distributed import bodies, object_bodies, p2p_bodies, subgroup_bodies
from tests.distributed.mpi_bodies import LaunchResult, launch

pytestmark = [pytest.mark.mpi, pytest.mark.multiprocess, requires_mpi]

FAST_TIMEOUT = {"COMMLIB_TIMEOUT": "3"}
"""Collective timeout for the fault tests: short, so the tests are quick."""

TEST_TIMEOUT = {"COMMLIB_TIMEOUT": "30"}
"""Collective timeout for the others: a broken body fails in 30 s rather than hanging."""


def _ok(result: LaunchResult, nprocs: int) -> dict[int, dict]:
    assert result.returncode == 0, result.describe()
    assert sorted(result.results) == list(range(nprocs)), result.describe()
    return result.results


@functools.cache
def _is_hydra() -> bool:
    exe = find_mpiexec()
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired, TypeError):
        return False
    return "HYDRA" in out.upper()


# ------------------------- the interface's bodies and mpi's own: one job per size
FEATURES = "tests.distributed.mpi_feature_bodies"
BODIES = "tests.distributed.bodies"
P2P = "tests.distributed.p2p_bodies"
SUBGROUPS = "tests.distributed.subgroup_bodies"
OBJECTS = "tests.distributed.object_bodies"

_MATRIX = [(f"{BODIES}:{body.__name__}", []) for body in bodies.ALL_BODIES.values()]
_P2P = [
    (f"{P2P}:body_ring_exchange", []),
    (f"{P2P}:body_skipping_pairs", []),
    (f"{P2P}:body_many_in_order", []),
    (f"{P2P}:body_p2p_keeps_collectives_numbered", []),
    (f"{P2P}:body_earliest_posted_receive_wins", []),
]
_SUBGROUPS = [(f"{SUBGROUPS}:body_overlapping_groups", []), (f"{SUBGROUPS}:body_split", [])]
_NON_MEMBERS = (f"{SUBGROUPS}:body_non_members_are_refused", [])

CALLS: dict[int, list[tuple[str, list[Any]]]] = {
    1: [("collectives_matrix", []), *_MATRIX, (f"{OBJECTS}:body_objects", [])],
    2: [
        ("collectives_matrix", []),
        *_MATRIX,
        (f"{BODIES}:body_async_order", []),
        (f"{BODIES}:body_shapes_and_views", []),
        (f"{BODIES}:body_nan_max_min", []),
        (f"{BODIES}:body_in_place_bumps_version", []),
        *_P2P,
        (f"{P2P}:body_large", []),
        (f"{P2P}:body_size_mismatch", []),
        (f"{P2P}:body_dtype_mismatch", []),
        (f"{P2P}:body_bad_tags", []),
        (f"{FEATURES}:p2p_sizes_sources_order", []),
        (f"{FEATURES}:p2p_timeouts", []),
        # Last: a failure writes the flight recorder's file again, and the test reads this one's.
        (f"{P2P}:body_unmatched_send", [4.0]),
    ],
    3: [
        ("collectives_matrix", []),
        *_MATRIX,
        (f"{BODIES}:body_async_order", []),
        *_P2P,
        *_SUBGROUPS,
        (f"{SUBGROUPS}:body_mismatched_member_lists", []),
        _NON_MEMBERS,
        (f"{OBJECTS}:body_objects", []),
        (f"{OBJECTS}:body_object_limits", []),
        (f"{OBJECTS}:body_object_pickling_failures", []),
        (f"{FEATURES}:p2p_sizes_sources_order", []),
        (f"{FEATURES}:mpi_subgroups", []),
    ],
    4: [
        *_MATRIX,
        *_P2P,
        *_SUBGROUPS,
        (f"{SUBGROUPS}:body_ddp_on_subgroups", []),
        (f"{SUBGROUPS}:body_join_on_subgroups", []),
        (f"{SUBGROUPS}:body_zero_on_subgroups", []),
        (f"{FEATURES}:mpi_subgroups", []),
    ],
}
"""The bodies each world size runs, in one mpiexec job (MPICH ranks busy-poll: few launches)."""

Job = Callable[[int], dict[int, dict[str, Any]]]


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Job:
    """``job(n)``: ``{rank: {"module:body(args)": value}}`` of the job of ``n`` ranks, launched on first use.

    The job of 2 ranks also reports stalls after 1 s and keeps a flight recorder
    (for ``body_unmatched_send``).
    """
    launched: dict[int, LaunchResult] = {}
    dumps = tmp_path_factory.mktemp("mpi-dumps")
    watched = {"COMMLIB_STALL_S": "1", "COMMLIB_FLIGHT_RECORDER": "32", "COMMLIB_DUMP_DIR": str(dumps)}

    def get(nprocs: int) -> dict[int, dict[str, Any]]:
        if nprocs not in launched:
            env = {**TEST_TIMEOUT, **watched} if nprocs == 2 else TEST_TIMEOUT
            launched[nprocs] = launch("run_calls", nprocs, [CALLS[nprocs]], env=env, timeout=600)
        return {rank: values["run_calls"] for rank, values in _ok(launched[nprocs], nprocs).items()}

    return get


def _body(values: dict[str, Any], name: str, *args: Any) -> Any:
    module = FEATURES if ":" not in name else ""
    return values[f"{module}:{name}{args}" if module else f"{name}{args}"]


# ------------------------------------------------------------- correctness
@pytest.mark.launcher
@pytest.mark.parametrize("nprocs", [1, 2, 3])
def test_collectives_matrix(job: Job, nprocs: int) -> None:
    """op x dtype x size through the first four collectives (sync and async) against a float64 reference."""
    for rank, values in job(nprocs).items():
        matrix = values["collectives_matrix()"]
        assert matrix["failures"] == [], f"rank {rank}:\n" + "\n".join(matrix["failures"][:20])
        assert matrix["checked"] == 270


@pytest.mark.launcher
def test_async_semantics_progress_and_zero_copy() -> None:
    unchecked = {**TEST_TIMEOUT, "COMMLIB_DEBUG": "OFF"}
    closing = _ok(launch(["future_across_close"], 2, env=unchecked, timeout=90), 2)
    for values in closing.values():  # the progress thread stops at close; the close finishes it
        assert values["future_across_close"] == {"sum": 3.0, "same_tensor": True}
    results = _ok(launch(["async_semantics", "mpi_internals"], 2, env=TEST_TIMEOUT, timeout=90), 2)
    for rank, values in results.items():
        a = values["async_semantics"]
        assert a["avg"] == 1.5
        assert a["broadcast"] == [1.0, 1.0, 1.0]
        assert a["gathered"] == [0, 0, 0, 0, 1, 1, 1, 1]
        assert a["reduce_scatter"] == ([0.0, 2.0] if rank == 0 else [4.0, 6.0])
        assert a["completed"] == [True] * 5 and a["exceptions"] == [None] * 5
        assert a["late_sum"] == 2.0
        if rank == 0:
            assert "[rank 0/2] mpi.all_reduce #" in a["expired_message"]
            assert "Work.wait(timeout=0.05) expired" in a["expired_message"]
        uint16, avg_int, complex64 = a["errors"]
        assert uint16.startswith(f"TypeError: [rank {rank}/2] mpi.all_reduce:") and "uint16" in uint16
        assert avg_int.startswith("ReduceOpTypeError:") and "AVG on int32" in avg_int
        assert "complex64" in complex64

        m = values["mpi_internals"]
        assert m["correct"]
        assert m["zero_copy"] and m["bf16_zero_copy"], "CPU tensors must reach MPI as views, not copies"
        assert m["native"]["torch.float32"] and m["native"]["torch.int64"]
        assert isinstance(m["native"]["torch.bfloat16"], bool)
        assert m["thread_level"] == 3 and m["progress"] == "thread"
        assert not m["cuda_path_made"] and not m["cupy_imported"], "CPU-only jobs pay nothing for CUDA"
        # The progress thread finished the 25 MB all_reduce while the caller slept 0.2 s.
        assert m["done_during_compute"], m
        assert m["wait_after_compute_s"] < 0.05, m


@pytest.mark.launcher
def test_progress_none_is_correct() -> None:
    """Without a progress thread async collectives still complete (inside wait)."""
    env = {**TEST_TIMEOUT, "COMMLIB_MPI_PROGRESS": "none"}
    results = _ok(launch("mpi_internals", 2, env=env, timeout=60), 2)
    for values in results.values():
        assert values["mpi_internals"]["progress"] == "none"
        assert values["mpi_internals"]["correct"]


@pytest.mark.launcher
def test_equivalent_to_gloo_on_three_ranks() -> None:
    """The same seeded inputs through mpi and gloo (in one job) agree with the reference and each other."""
    results = _ok(launch("backend_equivalence", 3, env=TEST_TIMEOUT, timeout=120), 3)
    for rank, values in results.items():
        eq = values["backend_equivalence"]
        assert eq["backends"] == ["mpi", "gloo"]
        assert eq["failures"] == [], f"rank {rank}:\n" + "\n".join(eq["failures"])
        assert eq["compared"] == 48


@pytest.mark.launcher
@pytest.mark.parametrize("nprocs", [2, 3])
def test_p2p_sizes_any_source_and_order(job: Job, nprocs: int) -> None:
    """A size mismatch fails both sides and leaves the receiver's tensor as it was; any source; order."""
    for rank, values in job(nprocs).items():
        r = _body(values, "p2p_sizes_sources_order")
        if rank == 0:
            (larger, smaller) = r["send"]
            for error, sent in ((larger, 40), (smaller, 8)):
                name, is_value_error, message = error
                assert name == "MessageSizeError" and is_value_error, error
                assert message.startswith(f"[rank 0/{nprocs}] mpi.send #") and "to rank 1 tag 9" in message
                assert (
                    f"rank 1's matching recv holds 16 bytes (4 x float32), but this send has {sent} bytes "
                    f"({sent // 4} x float32)" in message
                )
            assert r["any_source"] == [(k, [10 * k, 10 * k]) for k in range(1, nprocs)]
        elif rank == 1:
            for ((name, is_value_error, message), tensor), sent in zip(r["recv"], (40, 8), strict=True):
                assert name == "MessageSizeError" and is_value_error
                assert "mpi.recv #" in message and "from rank 0 tag 9" in message
                holds = "this recv's tensor holds 16 bytes (4 x float32)"
                assert f"rank 0 sends {sent} bytes ({sent // 4} x float32), but {holds}" in message
                assert tensor == [7.0] * 4, "the receiving tensor is left as it was"
            assert r["after"] == [5.0] * 4, "the next message on the same tag arrives intact"
            assert r["order"] and r["order_sources"] == [0] and r["early"], r


@pytest.mark.launcher
def test_p2p_dtype_mismatch_raises_on_both_sides_by_every_route(job: Job) -> None:
    """float32 into int32 by send/recv, isend/irecv, batch and any source: both sides raise, nothing lands."""
    results = job(2)
    name = f"{P2P}:body_dtype_mismatch()"
    p2p_bodies.check_dtype_mismatch("mpi", results[0][name], results[1][name])


@pytest.mark.launcher
def test_tags_outside_the_users_range_are_refused_by_every_route(job: Job) -> None:
    """Negative, reserved and bool tags: MPI would take -1 as MPI_ANY_TAG and the reserved tag as a user's."""
    results = job(2)
    p2p_bodies.check_bad_tags("mpi", [results[r][f"{P2P}:body_bad_tags()"] for r in (0, 1)])


@pytest.mark.launcher
def test_p2p_timeouts_leave_the_group_usable(job: Job) -> None:
    for rank, values in job(2).items():
        r = _body(values, "p2p_timeouts")
        assert r["all_reduce"] == 2.0 and r["left_in_flight"] == 0, r
        if rank == 0:
            assert r["send"].startswith(
                "[rank 0/2] mpi.send #1 to rank 1 tag 12 (float32, 3 elements) in group [0, 1] "
                "(global ranks): "
            )
            assert "within 1.5 s" in r["send"] and "MPI cannot withdraw a send" in r["send"]
            assert r["back"] == [1.0, 1.0]
        else:
            assert r["recv"].startswith(
                "[rank 1/2] mpi.recv #1 from rank 0 tag 11 (float32, 3 elements) in group [0, 1] "
                "(global ranks): "
            )
            assert "no message arrived within 1.5 s" in r["recv"] and "withdrawn" in r["recv"]
            assert r["recv_tensor"] == [2.0] * 3
            # The send that timed out was still queued: the next recv with its tag receives it.
            assert r["late_source"] == 0 and r["late"] == [8.0] * 3


@pytest.mark.launcher
@pytest.mark.parametrize("nprocs", [3, 4])
def test_subgroups_are_mpi_communicators(job: Job, nprocs: int) -> None:
    """new_group is Create_group over the members, split one Comm.Split; a child outlives its parent."""
    for rank, values in job(nprocs).items():
        r = _body(values, "mpi_subgroups")
        last = nprocs - 1
        if rank in (0, last):
            assert r["pair"] == ([0, last].index(rank), 2, [0, last], [0, last])
        else:
            assert "pair" not in r
        # Same parity, ordered by key = -rank: the highest rank first.
        same = sorted((k for k in range(nprocs) if k % 2 == rank % 2), reverse=True)
        assert r["halves"] == (same.index(rank), len(same), same)
        assert r["split_none"] == (rank == 0)
        if rank > 0:
            assert r["child_after_parent_closed"] == [float(nprocs - 1)] * 3
            assert r["child_comms_freed"]
        assert r["parent_after"] == float(nprocs)


@pytest.mark.launcher
@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_interface_collective_matrix(job: Job, nprocs: int) -> None:
    """bodies.py: every collective x dtype x op x size, each result checked; ranks agree bit for bit."""
    values = job(nprocs)
    for name, args in _MATRIX:
        digests = [values[rank][f"{name}{tuple(args)}"] for rank in range(nprocs)]
        assert all(d == digests[0] for d in digests), f"{name}: ranks disagree bit for bit"
    if nprocs in (2, 3):
        orders = [values[rank][f"{BODIES}:body_async_order()"] for rank in range(nprocs)]
        assert all(d == orders[0] for d in orders)


@pytest.mark.launcher
@pytest.mark.parametrize("nprocs", [2, 3, 4])
def test_interface_p2p(job: Job, nprocs: int) -> None:
    """p2p_bodies.py: ring exchanges, batches both ways, skipping pairs, any source, order, numbering."""
    values = job(nprocs)
    ring = values[0][f"{P2P}:body_ring_exchange()"]
    assert len(ring) == len(p2p_bodies.DTYPES) * len(p2p_bodies.SIZES)
    skips = values[0][f"{P2P}:body_skipping_pairs()"]
    if nprocs >= 3:
        assert skips["senders"] == list(range(1, nprocs)), skips
        assert skips["empty_from"] == nprocs - 1, skips
    assert values[0][f"{P2P}:body_many_in_order()"] == {"sent": 400}
    assert values[1][f"{P2P}:body_many_in_order()"] == {"order_7": True, "order_8": True}
    numbered = [values[rank][f"{P2P}:body_p2p_keeps_collectives_numbered()"] for rank in range(nprocs)]
    assert all(v == {"advanced": 1, "sum": float(nprocs)} for v in numbered), numbered
    earliest = values[1][f"{P2P}:body_earliest_posted_receive_wins()"]
    assert earliest == {"first_to_first_posted": [True] * 4, "sources": [0] * 4}, earliest


@pytest.mark.launcher
def test_interface_p2p_large_mismatch_and_unmatched_send(job: Job) -> None:
    values = job(2)
    sender, receiver = (values[rank][f"{P2P}:body_large()"] for rank in (0, 1))
    assert sender["equal"] and receiver["equal"]
    sender, receiver = (values[rank][f"{P2P}:body_size_mismatch()"] for rank in (0, 1))
    for case, (sent, held) in {"smaller": (8, 5), "larger": (5, 8)}.items():
        assert (
            f"rank 0 sends {4 * sent} bytes ({sent} x float32), but this recv's tensor holds "
            f"{4 * held} bytes ({held} x float32)" in receiver[case]
        ), receiver[case]
        assert (
            f"rank 1's matching recv holds {4 * held} bytes ({held} x float32), but this send has "
            f"{4 * sent} bytes ({sent} x float32)" in sender[case]
        ), sender[case]
        assert "tag 11" in sender[case] and sender[case].startswith("[rank 0/2] ")
        assert "tag 11" in receiver[case] and receiver[case].startswith("[rank 1/2] ")
    assert receiver["after"] == [4.0, 4.0, 4.0], "the pair must stay in step after a size mismatch"
    for side, kind in ((sender, "send"), (receiver, "recv")):
        first, second = side["batch"]["errors"]  # the batch's mismatched op, by its own number
        assert second is None and f"mpi.{kind} #{side['batch']['numbers'] - 1} " in first, side["batch"]
    assert sender["seq"] == receiver["seq"], "point-to-point advanced the collective sequence"
    sender, waiter = (values[rank][f"{P2P}:body_unmatched_send(4.0,)"] for rank in (0, 1))
    error = sender["error"]
    assert error is not None and "send #1 to rank 1 tag 7" in error and "within 4 s" in error, error
    assert sender["elapsed_s"] < 30, "the timeout is the subgroup's 4 s"
    stalls = [w for w in sender["warnings"] if ".send #1 to rank 1 tag 7" in w]
    assert stalls, sender["warnings"]
    assert "Rank 1 has posted 0 receive(s) from rank 0 and 0 from any rank with tag 7" in stalls[0], stalls[0]
    assert sender["after"] == waiter["after"] == 2.0, "the parent group goes on"
    document = json.loads(Path(sender["dump"]).read_text())
    (group,) = [g for g in document["groups"] if g["name"] == sender["group"]]
    (entry,) = [e for e in group["entries"] if e.get("tag") == 7]
    assert (entry["op"], entry["peer"], entry["seq"], entry["status"]) == ("send", 1, 1, "failed"), entry


@pytest.mark.launcher
@pytest.mark.parametrize("nprocs", [3, 4])
def test_interface_subgroups(job: Job, nprocs: int) -> None:
    """subgroup_bodies.py: overlapping groups in turn, groups of one, nested, closed; split."""
    values = job(nprocs)
    overlapping = [values[rank][f"{SUBGROUPS}:body_overlapping_groups()"] for rank in range(nprocs)]
    a_ranks, b_ranks = subgroup_bodies._layout(nprocs)
    names = [v["names"] for v in overlapping]
    (a_name,) = {names[r]["a"] for r in a_ranks}
    (b_name,) = {names[r]["b"] for r in b_ranks}
    assert a_name.endswith(".0") and b_name.endswith(".1"), (a_name, b_name)
    assert len({n["single"] for n in names}) == nprocs
    assert all(overlapping[r]["timeouts"]["b"] == 45 for r in b_ranks)
    for rank in range(nprocs):
        split = values[rank][f"{SUBGROUPS}:body_split()"]
        assert split["global_ranks"] == sorted((k for k in range(nprocs) if k % 2 == rank % 2), reverse=True)


@pytest.mark.launcher
def test_interface_different_member_lists(job: Job) -> None:
    """subgroup_bodies.py: rank 2 lists other members; every rank raises at once, naming each rank's lists."""
    from tests.distributed.test_subgroups import mismatched_member_lists_expected

    values = job(3)
    for rank in range(3):
        value = values[rank][f"{SUBGROUPS}:body_mismatched_member_lists()"]
        assert value == mismatched_member_lists_expected("mpi", rank, 3), value


@pytest.mark.launcher
def test_a_non_member_is_refused_and_never_joins_the_world(job: Job) -> None:
    """subgroup_bodies.py: a rank outside a pair passes its placeholder to operations; each raises."""
    values = job(3)
    name = f"{_NON_MEMBERS[0]}()"
    subgroup_bodies.check_non_members_refused("mpi", [values[rank][name] for rank in range(3)])


@pytest.mark.launcher
def test_interface_objects(job: Job) -> None:
    """object_bodies.py on 1 and 3 ranks; the size limit and a pickling failure raise alike on every rank."""
    for nprocs in (1, 3):
        results = [values[f"{OBJECTS}:body_objects()"] for values in job(nprocs).values()]
        assert results == [{"ok": True}] * nprocs
    for rank, values in job(3).items():
        limits = values[f"{OBJECTS}:body_object_limits()"]
        assert limits["small"] == [0, 1, 2]
        errors = limits["errors"]
        start = f"[rank {rank}/3] mpi.broadcast_object_list: rank 0 sends 20"
        assert errors["broadcast_big"].startswith(start), errors["broadcast_big"]
        assert all("COMMLIB_MAX_OBJECT_BYTES" in errors[case] for case in ("broadcast_big", "gather_big"))
    object_bodies.check_pickling_failures(
        [job(3)[rank][f"{OBJECTS}:body_object_pickling_failures()"] for rank in range(3)], "mpi"
    )


@pytest.mark.launcher
def test_interface_training_on_data_parallel_subgroups(job: Job) -> None:
    """DDP, Join and ZeRO on groups {0, 2} and {1, 3}: each equals one process on its batches."""
    values = job(4)
    for what in ("ddp", "join", "zero"):
        results = [values[rank][f"{SUBGROUPS}:body_{what}_on_subgroups()"] for rank in range(4)]
        for rank, value in enumerate(results):
            assert value["color"] == rank % 2
            assert value["diff"] < 1e-10, f"rank {rank}: {what} is {value['diff']:.3g} from one process"
        assert results[0]["digest"] == results[2]["digest"] and results[1]["digest"] == results[3]["digest"]
        assert results[0]["digest"] != results[1]["digest"], f"{what}: the two groups trained the same model"


# ------------------------------------------------------------------- faults
@pytest.mark.waits
@pytest.mark.parametrize("debug", [None, "OFF"])
def test_missing_rank_times_out_then_aborts_the_job(debug: str | None) -> None:
    """Waiting in the default fingerprint check (it names the missing rank), or in MPI itself (OFF)."""
    env = FAST_TIMEOUT if debug is None else {**FAST_TIMEOUT, "COMMLIB_DEBUG": debug}
    result = launch("skip_collective", 2, env=env, timeout=60)
    assert not result.timed_out, result.describe()
    assert result.returncode != 0
    assert result.elapsed < 30, result.describe()
    err = result.stderr
    assert "CommTimeoutError: [rank 0/2] mpi.all_reduce #" in err, result.describe()
    if debug is None:
        assert "in the fingerprint check waiting for rank 1 to reach this collective" in err, err
    else:
        assert "no progress for 3 s" in err
    assert "aborts the MPI job (MPI_Abort" in err, result.describe()


@pytest.mark.waits
def test_a_timeout_on_a_subgroup_names_the_group_by_its_global_ranks() -> None:
    """Overlapping pairs called in a cyclic order deadlock until their 3 s timeout; then a recv is lost.

    The stuck collectives make the job abort at exit; each rank's report is written before.
    """
    from tests.distributed.test_subgroups import timeouts_name_the_group_expected

    result = launch(f"{SUBGROUPS}:body_timeouts_name_the_group", 3, env=TEST_TIMEOUT, timeout=120)
    assert not result.timed_out, result.describe()
    assert sorted(result.results) == [0, 1, 2], result.describe()
    for rank in range(3):
        value = result.results[rank][f"{SUBGROUPS}:body_timeouts_name_the_group"]
        for what, start in timeouts_name_the_group_expected("mpi", rank).items():
            assert value[what] is not None and value[what].startswith(start), (rank, what, value)


def test_dead_peer_ends_the_job() -> None:
    """MPICH's launcher kills the job as soon as a rank dies; no hang."""
    result = launch("die_after_first", 2, env=FAST_TIMEOUT, timeout=60)
    assert not result.timed_out, result.describe()
    assert result.returncode != 0
    assert result.elapsed < 30, result.describe()


def test_a_rank_that_dies_of_an_exception_in_ddp_backward_aborts_the_job() -> None:
    """Its uncaught exception aborts the MPI job: the survivor does not wait for its timeout."""
    result = launch("raise_in_ddp_backward", 2, env={"COMMLIB_TIMEOUT": "60"}, timeout=150)
    assert not result.timed_out, result.describe()
    assert result.returncode != 0, result.describe()
    err = result.stderr
    assert "ArithmeticError: this rank's backward failed half-way" in err, result.describe()
    assert (
        "[rank 1/2] mpi.exit: this rank is ending on an uncaught ArithmeticError, so it aborts the MPI job "
        "(MPI_Abort, exit code 1)" in err
    ), result.describe()
    assert "CommTimeoutError" not in err + result.stdout, result.describe()


@pytest.mark.waits
@pytest.mark.skipif(not _is_hydra(), reason="-disable-auto-cleanup is an MPICH (Hydra) flag")
@pytest.mark.parametrize("debug", ["off", "default"])
def test_dead_peer_survivor_raises_then_aborts_when_the_launcher_keeps_it(debug: str) -> None:
    """With the launcher's clean-up off, the survivor's collective fails, then it aborts the job.

    With the check off it times out; on the defaults the check's board sees the peer's
    process gone at once.
    """
    env = FAST_TIMEOUT | ({"COMMLIB_DEBUG": "OFF"} if debug == "off" else {})
    result = launch("die_after_first", 2, env=env, timeout=60, launcher_args=["-disable-auto-cleanup"])
    assert not result.timed_out, result.describe()
    assert result.returncode != 0
    survivor = result.results[0]["die_after_first"]
    assert survivor["error"].startswith("[rank 0/2] mpi.all_reduce #"), survivor
    if debug == "off":
        assert survivor["error_type"] == "CommTimeoutError", survivor
        assert 2.5 < survivor["after_s"] < 10, survivor
    else:
        assert survivor["error_type"] == "PeerFailureError", survivor
        assert "rank 1 (pid " in survivor["error"] and "exited while this rank waited" in survivor["error"]
        assert survivor["after_s"] < 2.5, survivor  # measured: ~0.02 s
    assert survivor["next"].startswith(
        "GroupClosedError: [rank 0/2] mpi.all_reduce: the process group is unusable"
    )
    assert "aborts the MPI job" in result.stderr, result.describe()
    if debug == "default":  # the check failed before the collective was issued: none is left in flight
        assert "a collective of this rank missed a peer" in result.stderr, result.describe()


def test_world_size_disagreeing_with_environment() -> None:
    result = launch("collectives_matrix", 2, env={"RANK": "0", "WORLD_SIZE": "4"}, timeout=60)
    assert not result.timed_out and result.returncode != 0, result.describe()
    assert (
        "RendezvousError: [rank 1/2] mpi.init: MPI.COMM_WORLD says rank 1 of 2, but the environment "
        "(torchrun: RANK/WORLD_SIZE) says rank 0 of 4" in result.stderr
    ), result.describe()
    assert "start it with '-n 4'" in result.stderr


def _noop(group: object) -> None:
    return None


def test_spawned_ranks_are_singletons_with_a_clear_error() -> None:
    outcomes = run_ranks_outcomes(_noop, 2, backend="mpi", timeout=60)
    for o in outcomes:
        assert o.error_type == "RendezvousError", o
        assert (
            "[rank 0/1] mpi.init: MPI.COMM_WORLD says rank 0 of 1, but the environment (torchrun" in o.error
        )
        assert "MPI singleton" in o.error and "mpiexec -n 2 python" in o.error


def test_missing_mpi4py_names_package_and_extra(monkeypatch: pytest.MonkeyPatch, clean_commlib: None) -> None:
    import commlib.registry

    monkeypatch.setitem(sys.modules, "mpi4py", None)
    monkeypatch.delitem(sys.modules, "backends.mpi", raising=False)
    commlib.registry._registry.pop("mpi", None)
    with pytest.raises(BackendUnavailableError) as info:
        commlib.registry.create_process_group("mpi", DistEnv(rank=0, world_size=1), CommConfig())
    assert "mpi4py" in str(info.value) and "commlib[mpi]" in str(info.value)


# --------------------------------------------------------------------- GPU
@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("cuda_aware", ["auto", "0"])
def test_cuda_tensors(cuda_aware: str) -> None:
    """CUDA tensors: zero-copy when the MPI is CUDA-aware, else staged through host memory (forced with 0)."""
    env = {**TEST_TIMEOUT, "COMMLIB_MPI_CUDA_AWARE": cuda_aware}
    results = _ok(launch("cuda_collectives", 2, env=env, timeout=120), 2)
    for values in results.values():
        assert values["cuda_collectives"]["failures"] == []


# ------------------------------------------------- in-process unit tests
def test_mpi_config_from_env() -> None:
    from backends.mpi import MPIConfig

    config = MPIConfig.from_env(
        {"COMMLIB_MPI_PROGRESS": "none", "COMMLIB_MPI_PROGRESS_US": "50", "COMMLIB_MPI_CUDA_AWARE": "1"}
    )
    assert (config.progress, config.progress_interval_us, config.cuda_aware) == ("none", 50.0, True)
    with pytest.warns(RuntimeWarning, match="COMMLIB_MPI_PROGRESS: unexpected value 'fast'"):
        assert MPIConfig.from_env({"COMMLIB_MPI_PROGRESS": "fast"}).progress == "thread"
    for bad in (-1, math.inf, math.nan):
        with pytest.raises(ValueError, match="MPIConfig.progress_interval_us: must be a finite number >= 0"):
            MPIConfig(progress_interval_us=bad)
    with pytest.warns(RuntimeWarning, match="COMMLIB_MPI_PROGRESS_US: .*must be a finite number >= 0"):
        assert MPIConfig.from_env({"COMMLIB_MPI_PROGRESS_US": "inf"}).progress_interval_us == 200.0


class _FakePollable:
    def __init__(self, ready_after: float) -> None:
        self.ready_at = time.monotonic() + ready_after
        self.polls = 0
        self.threads: set[str] = set()

    def _poll_background(self) -> bool:
        self.polls += 1
        self.threads.add(threading.current_thread().name)
        return time.monotonic() >= self.ready_at


def test_progress_thread_polls_until_done_then_idles() -> None:
    from backends.mpi.progress import ProgressThread

    thread = ProgressThread(1e-3, "test-progress")
    items = [_FakePollable(0.02), _FakePollable(0.05)]
    for item in items:
        thread.submit(item)
    deadline = time.monotonic() + 5
    while thread.pending() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert thread.pending() == 0
    assert all(item.threads == {"test-progress"} for item in items)
    polls = [item.polls for item in items]
    time.sleep(0.05)
    assert [item.polls for item in items] == polls, "an idle progress thread must not poll"
    thread.stop()


def test_wait_until_spins_naps_and_times_out() -> None:
    from backends.mpi.progress import wait_until

    calls = []
    start = time.monotonic()
    assert wait_until(lambda: calls.append(1) or time.monotonic() > start + 0.03, start + 5)
    assert not wait_until(lambda: False, time.monotonic() + 0.1)
    assert time.monotonic() - start < 2


@pytest.mark.launcher
def test_compare_backends_example(repo_root: object) -> None:
    """examples/compare_backends.py: mpi and gloo agree bit for bit on 2 ranks (sums of two are exact)."""
    from tests.conftest import mpiexec_command, mpiexec_env, run_job

    script = str(repo_root / "examples" / "compare_backends.py")  # type: ignore[operator]
    proc = run_job(
        [*mpiexec_command(2), sys.executable, script, "--backends", "mpi,gloo", "--strict"],
        timeout=120,
        env=mpiexec_env(OMP_NUM_THREADS="1", COMMLIB_TIMEOUT="30"),
        cwd=None,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "mpi vs gloo on 2 ranks, seed 0:" in proc.stdout
    assert proc.stdout.count("identical") == 4, proc.stdout
