"""commlib's backends under torch.distributed (``commlib.torch_adapter``).

The multi-rank tests run bodies in real ranks (a ``RankPool`` kept for the
module, and spawned ranks for 4) that call ``dist.init_process_group("commlib_ring")``
themselves; the mpi ones run the same bodies under mpiexec. Each integration (the functional API, DDP, FSDP2,
DTensor) is checked against closed-form values or one process on the full batch.
``commlib_gloo`` (Gloo through the same adapter) is the control.
"""

from __future__ import annotations

import datetime
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from commlib import BackendUnavailableError, PremulSum, ReduceOp
from commlib.torch_adapter import BACKENDS, registration
from commlib.torch_adapter.group import reduce_op
from commlib.torch_adapter.work import PendingWork, done
from commlib.work import CompletedWork, Work
from tests._launcher import RankPool, run_ranks
from tests.conftest import REPO_ROOT, requires_mpi
from tests.distributed import torch_adapter_bodies as bodies

pytestmark = pytest.mark.multiprocess

ENV = {"COMMLIB_TIMEOUT": "60", "CUDA_VISIBLE_DEVICES": ""}
"""CPU ranks, on a machine with a GPU too: torch's PowerSGD hook calls torch.cuda.synchronize(grad.device)
whenever CUDA is available, which fails for CPU gradients (docs/torch_adapter.md)."""

BACKENDS_2 = pytest.mark.parametrize("backend", ["commlib_ring", "commlib_gloo"])
"""The integrations run on the ring and, as the control, on Gloo through the same adapter."""


@pytest.fixture(scope="module")
def pool() -> Iterator[RankPool]:
    """Two ranks kept alive for the module: each body initialises torch.distributed on a port of its own."""
    ranks = RankPool(2, "ring", env=ENV)
    try:
        yield ranks
    finally:
        ranks.close()


def _on(pool: RankPool, body: str, backend: str, *args: Any) -> list[Any]:
    values = pool.run(bodies.on_torch, body, backend, *args, timeout=150)
    return [value[body] for value in values]


# ------------------------------------------------------------------- in one process
def test_registered_names_and_devices() -> None:
    for name, (inner, devices) in BACKENDS.items():
        assert name.upper() in dist.Backend._plugins, name
        assert dist.Backend._plugins[name.upper()].extended_api is True
        assert dist.Backend.backend_capability[name] == list(devices)
        assert inner in ("ring", "mpi", "gloo")
    registration.register()  # a second registration changes nothing
    assert sum(name.startswith("COMMLIB_") for name in dist.Backend._plugins) == 3


def test_import_commlib_torch_backend_registers_the_backends_in_a_fresh_process() -> None:
    """``import commlib.torch_backend`` (what users write) registers, as ``commlib.torch_adapter`` does."""
    code = (
        "import torch.distributed as dist, commlib.torch_backend as b, commlib.torch_adapter as a; "
        "assert b.CommlibProcessGroup is a.CommlibProcessGroup; "
        "print(sorted(n for n in dist.Backend._plugins if n.startswith('COMMLIB_')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['COMMLIB_GLOO', 'COMMLIB_MPI', 'COMMLIB_RING']"


def test_unsupported_torch_is_refused_at_registration() -> None:
    with pytest.raises(BackendUnavailableError, match=r"torch 2\.10\.0 is outside .*2\.11 to 2\.13"):
        registration.register("2.10.0")
    with pytest.raises(BackendUnavailableError, match=r"torch 3\.0\.1\+cpu is outside"):
        registration.register("3.0.1+cpu")


def test_reduce_ops_map_to_ours() -> None:
    expected = {
        dist.ReduceOp.SUM: ReduceOp.SUM,
        dist.ReduceOp.AVG: ReduceOp.AVG,
        dist.ReduceOp.PRODUCT: ReduceOp.PRODUCT,
        dist.ReduceOp.MIN: ReduceOp.MIN,
        dist.ReduceOp.MAX: ReduceOp.MAX,
        dist.ReduceOp.BAND: ReduceOp.BAND,
        dist.ReduceOp.BOR: ReduceOp.BOR,
        dist.ReduceOp.BXOR: ReduceOp.BXOR,
    }
    for theirs, ours in expected.items():
        options = dist.AllreduceOptions()
        options.reduceOp = theirs
        assert reduce_op(options.reduceOp) is ours
    premul = reduce_op(dist._make_nccl_premul_sum(0.25))
    assert isinstance(premul, PremulSum) and premul.scalar() == 0.25
    if callable(dist.ReduceOp.PREMUL_SUM):  # torch 2.13's factory; 2.11 has only _make_nccl_premul_sum
        assert reduce_op(dist.ReduceOp.PREMUL_SUM(0.5)).scalar() == 0.5  # type: ignore[union-attr]


def test_work_handles_carry_what_torch_expects() -> None:
    t = torch.ones(3)
    finished = done([t])
    assert finished.wait() is True and finished.is_completed() and finished.exception() is None
    assert finished.get_future().wait()[0] is t
    pending = PendingWork(CompletedWork(), [t])
    assert pending.wait(datetime.timedelta(seconds=1)) is True and pending.is_completed()
    assert pending.get_future().wait()[0] is t
    failed = PendingWork(CompletedWork(error=RuntimeError("[rank 0/2] ring.all_reduce: broken")), [t])
    with pytest.raises(RuntimeError, match=r"ring\.all_reduce: broken"):
        failed.wait()
    with pytest.raises(RuntimeError, match=r"ring\.all_reduce: broken"):
        failed.get_future().wait()
    # result(): torch's output tensors, as Gloo's works return them; a value may be made when asked for
    assert finished.result()[0] is t and pending.result()[0] is t
    assert done(lambda: [t, t]).result() == [t, t]
    assert PendingWork(CompletedWork(), lambda: [t]).get_future().wait()[0] is t
    with pytest.raises(RuntimeError, match=r"ring\.all_reduce: broken"):
        failed.result()
    with pytest.raises(RuntimeError, match=r"^running: Work\.result\(\) was called before .* call wait"):
        PendingWork(Work("running"), [t]).result()


# ------------------------------------------------------------------ two ranks
def test_init_methods_env_tcp_and_store(pool: RankPool, tmp_path: Any) -> None:
    """env://, tcp:// and an explicit store, one after another in the same ranks."""
    for seen in _on(pool, "init_methods", "commlib_ring", str(tmp_path / "store")):
        for how in ("env", "store", "tcp"):
            assert seen[how] == {"sum": [3.0, 3.0, 3.0], "backend": "commlib_ring", "inner": "ring"}, how


@BACKENDS_2
def test_functional_api(pool: RankPool, backend: str) -> None:
    _check_functional(_on(pool, "functional_api", backend), backend.removeprefix("commlib_"))


@BACKENDS_2
def test_one_collective_more_is_caught_at_dist_barrier(pool: RankPool, backend: str) -> None:
    """Rank 1's extra dist.all_reduce pairs with rank 0's; dist.barrier raises commlib's error everywhere."""
    inner = backend.removeprefix("commlib_")
    values = _on(pool, "extra_collective", backend)
    for rank, value in enumerate(values):
        assert value["error"] is not None, f"rank {rank}: nothing raised; its sum is {value['sum']}"
        kind, text = value["error"]
        assert kind == "CollectiveMismatchError", text
        op = "barrier" if rank == 0 else "all_reduce"
        assert text.startswith(f"[rank {rank}/2] {inner}.{op} #"), text
        assert "ranks called different collectives: rank 0: barrier #" in text, text
        assert "The ranks issued different numbers of collectives on this group before the barrier" in text
        assert " before its barrier #" in text and "rank 1: at least " in text, text
        assert "Each rank's collectives on this group: rank 0: " in text, text
    assert [value["sum"] for value in values] == [11.0, 2.0]


def _check_functional(values: list[dict[str, Any]], inner: str) -> None:
    for rank, value in enumerate(values):
        assert value["inner"] == inner and value["collectives"] and value["p2p"] and value["async"]
        assert value["any_source"] == (1 if rank == 0 else None)
        assert value["subgroup_inner"] == [inner, inner]
        assert value["subgroup_names"] == [f"commlib_{inner}"] * 2
        errors = value["errors"]
        assert errors["avg_int"].startswith(f"ReduceOpTypeError: [rank {rank}/2] {inner}.all_reduce: op AVG")
        assert errors["monitored_barrier"].startswith("ValueError: monitored_barrier is only implemented")
        if rank == 0:
            assert errors["wait_timeout"].startswith(f"[rank 0/2] {inner}.all_reduce #")
            assert "Work.wait(timeout=0.05) expired" in errors["wait_timeout"]


def _check_ddp(diffs: dict[str, float]) -> None:
    assert diffs["plain"] < 1e-6 and diffs["find_unused"] < 1e-6, diffs
    assert diffs["no_sync_fp16_hook"] < 1e-3, diffs  # gradients travel in float16


@BACKENDS_2
def test_all_gather_coalesced(pool: RankPool, backend: str) -> None:
    inner = backend.removeprefix("commlib_")
    for rank, value in enumerate(_on(pool, "all_gather_coalesced", backend)):
        # rank r's input i holds 10 * i + r: shapes (2,), (1,), (2, 3)
        expected = [[[float(r)] * 2, [10.0 + r], [[20.0 + r] * 3] * 2] for r in range(2)]
        assert value["sync"] == expected and value["async"] == expected, value
        assert value["wrong_layout"] == (
            f"[rank {rank}/2] {inner}.all_gather_coalesced: output_tensor_lists holds 3 lists of [2, 2, 2] "
            "tensors; it needs one list per rank (2), each with one tensor per input (3): "
            "output_tensor_lists[r][i] receives rank r's input i"
        )


@BACKENDS_2
def test_non_contiguous_and_channels_last_tensors(pool: RankPool, backend: str) -> None:
    """Every collective takes them, as Gloo does (the body checks the values); Gloo's refusals stay."""
    inner = backend.removeprefix("commlib_")
    for rank, value in enumerate(_on(pool, "layouts", backend)):
        refused = value["refused"]
        prefix = f"[rank {rank}/2] {inner}"
        assert refused["all_to_all_single"].startswith(
            f"{prefix}.all_to_all_single: 'input' is not contiguous (shape (4, 3), stride (1, 4))"
        ), refused
        assert refused["expanded"].startswith(
            f"{prefix}.all_reduce: 'tensor' is not contiguous (shape (3,), stride (0,))"
        ), refused
        if rank == 0:
            assert refused["send"].startswith(f"{prefix}.isend: 'tensor' is not contiguous"), refused
        assert len(refused) == 3 - rank


@BACKENDS_2
def test_complex_reductions_and_work_values_match_gloo(pool: RankPool, backend: str) -> None:
    """Complex reduce / reduce_scatter(_tensor) with SUM, AVG, PREMUL_SUM; futures and result() as Gloo's."""
    inner = backend.removeprefix("commlib_")
    for rank, value in enumerate(_on(pool, "complex_and_futures", backend)):
        assert value["complex_max"] == (
            f"[rank {rank}/2] {inner}.reduce: op MAX on complex64: a complex tensor reduces with SUM, AVG "
            "or PREMUL_SUM only (they act on the real and imaginary parts apart); for MAX, reduce "
            "torch.view_as_real(x) or x.abs() instead"
        )


@BACKENDS_2
def test_torch_ddp_equals_one_process(pool: RankPool, backend: str) -> None:
    for diffs in _on(pool, "ddp_parity", backend):
        _check_ddp(diffs)


@BACKENDS_2
def test_torch_ddp_features(pool: RankPool, backend: str) -> None:
    for rank, value in enumerate(_on(pool, "ddp_features", backend)):
        assert value["static_graph"] < 1e-6, value
        assert value["join_trained"] == rank + 2
        # PowerSGD approximates the gradients (no reference), but every rank applies the same ones
        for case in ("static_graph", "powersgd"):
            assert value[f"{case}_spread"] == 0.0, (case, value)


@BACKENDS_2
def test_fsdp2_equals_one_process(pool: RankPool, backend: str) -> None:
    for diffs in _on(pool, "fsdp2_parity", backend):
        assert diffs["avg"] < 1e-6 and diffs["premul_sum"] < 1e-6, diffs


@BACKENDS_2
def test_fsdp2_mixed_precision_equals_gloo(pool: RankPool, backend: str) -> None:
    for value in _on(pool, "fsdp2_mixed_precision", backend):
        assert value["vs_gloo"] < 1e-6, value


@BACKENDS_2
def test_dtensor_on_a_mesh(pool: RankPool, backend: str) -> None:
    for value in _on(pool, "dtensor", backend):
        assert value == {"ok": True, "local_shape": [4, 3]}


@BACKENDS_2
def test_pipelining_two_stages_equal_one_process(pool: RankPool, backend: str) -> None:
    for diffs in _on(pool, "pipeline_parity", backend):
        assert diffs["gpipe"] < 1e-6 and diffs["1f1b"] < 1e-6, diffs


# ----------------------------------------------------------------- four ranks
def test_dtensor_on_a_2x2_mesh() -> None:
    values = run_ranks(
        bodies.dtensor_2d, 4, backend=None, init=False, args=("commlib_ring",), env=ENV, timeout=240
    )
    names: dict[str, set[str]] = {}
    for r, value in enumerate(values):
        assert value["ok"] is True and value["inner"] == ["ring", "ring"], value
        for ranks, (name, global_ranks) in value["names"].items():
            assert str(list(global_ranks)) == ranks, (r, ranks, global_ranks)  # as torch knows them
            names.setdefault(ranks, set()).add(name)
        assert value["from_torch_group"] == (None if r in (0, 2) else [[1, 3], 4.0]), value
    assert sorted(names) == ["[0, 1]", "[0, 2]", "[1, 2, 3]", "[1, 3]", "[2, 3]"]
    assert all(len(alike) == 1 for alike in names.values()), names  # alike on every member
    assert len({alike.pop() for alike in names.values()}) == 5, names  # and a group's own


# -------------------------------------------------------------- under launchers
@pytest.mark.launcher
def test_functional_api_under_torchrun() -> None:
    """torchrun's agent serves the store env:// hands torch; the ring meets there."""
    from tests.distributed.mpi_bodies import launch

    name = "tests.distributed.torch_adapter_bodies:as_launched"
    result = launch(name, 2, ["functional_api", "commlib_ring"], launcher="torchrun", backend="ring", env=ENV)
    assert result.returncode == 0, result.describe()
    _check_functional([result.results[r][name]["functional_api"] for r in range(2)], "ring")


@requires_mpi
@pytest.mark.mpi
def test_functional_api_and_ddp_on_mpi() -> None:
    from tests.distributed.mpi_bodies import launch

    name = "tests.distributed.torch_adapter_bodies:on_torch"
    result = launch(name, 2, ["functional_api+ddp_parity", "commlib_mpi"], timeout=200, env=ENV)
    assert result.returncode == 0, result.describe()
    values = [result.results[r][name] for r in range(2)]
    _check_functional([v["functional_api"] for v in values], "mpi")
    for value in values:
        _check_ddp(value["ddp_parity"])


# ------------------------------------------------------------------ benchmark
def test_benchmark_quick(tmp_path: Any) -> None:
    """``torch_adapter_bench.py --quick`` runs every part and writes one row per mode and ratio."""
    import csv
    import subprocess
    import sys

    from tests.conftest import REPO_ROOT

    out = tmp_path / "bench.csv"
    script = REPO_ROOT / "benchmarks" / "torch_adapter_bench.py"
    args = [sys.executable, str(script), "--spawn", "2", "--quick", "--fsdp2", "--csv", str(out)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=240, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {row["mode"]: row for row in csv.DictReader(out.open())}
    for mode in ("adapter", "direct", "gloo", "adapter-direct"):
        assert rows[mode]["part"] == "allreduce" and rows[mode]["bytes"] == "4096"
    for mode in (
        "adapter",
        "direct",
        "gloo",
        "ddp-commlib_ring",
        "ddp-gloo",
        "fsdp2-commlib_ring",
        "fsdp2-gloo",
    ):
        assert float(rows[mode]["median_us"]) > 0, rows[mode]
    for ratio in (
        "adapter/direct",
        "gloo/adapter",
        "ddp-commlib_ring/ddp-gloo",
        "fsdp2-commlib_ring/fsdp2-gloo",
    ):
        assert float(rows[ratio]["ratio"]) > 0, rows[ratio]
