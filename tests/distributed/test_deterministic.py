"""The deterministic mode across backends: the left fold in rank order, bit for bit, on 2 to 4 ranks.

Spawned ring (shared memory and TCP, tiny chunks) and gloo ranks run the bodies of
``deterministic_bodies`` on a deterministic group of all their ranks; one mpiexec job per
world size runs them on an mpi, a gloo and a ring group side by side. Every result is
compared with ``commlib.deterministic.left_fold`` of the same inputs, computed in one
process, bit for bit, and the digests of the results and of DDP's parameters with each
other across backends.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests._launcher import run_ranks
from tests.conftest import requires_mpi
from tests.distributed import deterministic_bodies as bodies
from tests.distributed.conftest import VARIANTS
from tests.distributed.mpi_bodies import launch

pytestmark = pytest.mark.multiprocess

def _checks_per_rank(sizes: tuple[int, ...] = bodies.SIZES) -> int:
    return len(bodies.DTYPES) * len(bodies.OPS) * len(sizes) * 9


CHECKS_PER_RANK = _checks_per_rank()


def _one_collective_all_reduces(variant: str, world: int, sizes: tuple[int, ...]) -> int:
    """How many of a rank's all-reduces in ``body_reductions`` issue one collective, not two.

    On two ranks the backend's own sum of two is the fold (but AVG of float16 and bfloat16); from
    three ranks the ring all-reduces float32 and float64 in rank order itself (``backends.ring.ordered``).
    """
    forms = 5 * len(sizes)
    if world == 2:
        return forms * (len(bodies.DTYPES) * len(bodies.OPS) - 2)
    return forms * 2 * len(bodies.OPS) if variant.startswith("ring") else 0


def _spawned(get_pool: Any, body: Any, world: int, variants: list[str], *args: Any) -> dict[str, list[Any]]:
    return {v: get_pool(v, world).run(body, *args, timeout=240) for v in variants}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_reductions_are_the_left_fold_on_every_backend(get_pool: Any, world: int) -> None:
    """Every float dtype x SUM, AVG, PRODUCT, PREMUL_SUM x every form: the fold's bits, on every backend.

    Over TCP on two ranks only (the fold is the same over either link); on four ranks without the
    size of many chunks, which ``test_large_shards_beside_a_users_point_to_point`` streams there.
    """
    variants = [v for v in VARIANTS if v != "ring-tcp" or world == 2]
    sizes = bodies.SIZES if world < 4 else bodies.SIZES[:-1]
    results = _spawned(get_pool, bodies.body_reductions, world, variants, 1, sizes)
    for variant, ranks in results.items():
        for values in ranks:
            assert values["failures"] == [], f"{variant}:\n" + "\n".join(values["failures"][:10])
            assert values["checked"] == _checks_per_rank(sizes)
            assert values["single"] == _one_collective_all_reduces(variant, world, sizes), variant
    first = results[variants[0]]
    for variant in variants[1:]:
        assert [r["digest"] for r in results[variant]] == [r["digest"] for r in first], variant


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("variant", ["ring-shm", "gloo"])
def test_async_folds_run_in_issue_order_among_other_collectives(
    get_pool: Any, variant: str, world: int
) -> None:
    for values in get_pool(variant, world).run(bodies.body_in_flight, timeout=120):
        assert values["failures"] == [], "\n".join(values["failures"])
        # 12 async folds and 4 synchronous ones, two collectives each (on two ranks one, but two for
        # the two AVGs of float16 / bfloat16; on the ring one for the 6 + 4 of float32 and float64),
        # 4 broadcasts and 4 MAX in between.
        if world == 2:
            assert values["collectives"] == 16 + 2 + 8
        else:
            assert values["collectives"] == (6 * 2 + 10 if variant == "ring-shm" else 16 * 2) + 8


@pytest.mark.parametrize("world", [3, 4])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_large_shards_beside_a_users_point_to_point(get_pool: Any, variant: str, world: int) -> None:
    """Shards past 1 MiB with a user's irecv pending: the exchange never waits behind it."""
    for values in get_pool(variant, world).run(bodies.body_large, timeout=180):
        assert values["failures"] == [], "\n".join(values["failures"])


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("variant", ["ring-shm", "gloo"])
def test_shapes_and_tensors_that_require_grad(get_pool: Any, variant: str, world: int) -> None:
    for values in get_pool(variant, world).run(bodies.body_two_dimensional_and_grad, timeout=60):
        assert values["failures"] == []


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("variant", ["ring-shm", "gloo"])
def test_collectives_each_call_issues(get_pool: Any, variant: str, world: int) -> None:
    """Off (the group as made): one backend collective per call. On: two for a fold (one on two ranks)."""
    for counts in get_pool(variant, world).run(bodies.body_collective_counts, timeout=60):
        assert counts["deterministic"] == 0
        assert all(counts[f"off {kind}"] == 1 for kind in ("all_reduce", "reduce", "reduce_scatter"))
        fold = 2 if world > 2 else 1
        assert counts["on reduce"] == fold
        assert counts["on all_reduce"] == (1 if variant == "ring-shm" else fold)  # the ring's own fold
        assert counts["on all_reduce_avg_bf16"] == 2  # float32 before the division, also on two ranks
        assert counts["on reduce_scatter"] == 1
        assert counts["on all_reduce_int"] == 1
        assert counts["on all_reduce_max"] == 2  # folded, also on two ranks: the signs of zeros and NaNs


@pytest.mark.parametrize("world", [3, 4])
def test_off_by_default_the_backend_sums_in_its_own_order(get_pool: Any, world: int) -> None:
    """Nothing changes for a group that did not ask: gloo's own order is not the fold on these inputs."""
    for values in get_pool("gloo", world).run(bodies.body_off_by_default, timeout=60):
        assert values["deterministic"] is False and values["config"] is None
        assert values["collectives"] == 1
        assert values["equals_fold"] is False


@pytest.mark.parametrize("variant", ["ring-shm", "gloo"])
def test_subgroups_inherit_the_mode_unless_told_otherwise(get_pool: Any, variant: str) -> None:
    """Also: a rank alone in the mode issues other collectives than the rest, and every rank says so."""
    for values in get_pool(variant, 3).run(bodies.body_subgroups_inherit, timeout=60):
        mixed = values.pop("mixed_modes")
        assert values == {"parent": True, "inherited": True, "told_otherwise": False, "split": True}
        assert "ranks called different collectives: rank 0: " in mixed, mixed
        assert "; ranks 1, 2: all_reduce #1. " in mixed, mixed
        assert ("rank 0: deterministic_all_reduce #1" in mixed) == (variant == "ring-shm"), mixed


def _init_with_torch_flag() -> dict[str, Any]:
    import torch

    import commlib

    torch.use_deterministic_algorithms(True)
    group = commlib.init_process_group()
    try:
        return {"deterministic": group.deterministic, **bodies.body_in_flight(group)}
    finally:
        commlib.destroy_process_group()


def _init_from_environment(group: Any) -> dict[str, Any]:
    return {"deterministic": group.deterministic, **bodies.body_in_flight(group)}


@pytest.mark.parametrize("backend", ["ring", "gloo"])
def test_torch_flag_and_variable_turn_it_on(backend: str) -> None:
    for values in run_ranks(_init_with_torch_flag, 3, backend=backend, init=False, timeout=120):
        assert values["deterministic"] is True and values["failures"] == []
    env = {"COMMLIB_DETERMINISTIC": "1"}
    for values in run_ranks(_init_from_environment, 3, backend=backend, env=env, timeout=120):
        assert values["deterministic"] is True and values["failures"] == []


@pytest.mark.slow
@pytest.mark.parametrize("world", [3, 4])
def test_ddp_gives_the_same_parameters_on_every_backend(get_pool: Any, world: int) -> None:
    """5 steps: bucketed all-reduce, bf16 compression, ZeRO's reduce-scatter; two bucket sizes each."""
    results = _spawned(get_pool, bodies.body_ddp, world, ["ring-shm", "gloo"])
    hashes = results["ring-shm"][0]
    for variant, ranks in results.items():
        assert all(h == hashes for h in ranks), f"{variant}: the ranks or the backends disagree"
    assert hashes["buckets"] == hashes["buckets_large"]
    assert hashes["zero"] == hashes["zero_large"]


# --------------------------------------------------------------------- mpi
@pytest.mark.mpi
@pytest.mark.launcher
@requires_mpi
def test_mpi_gloo_and_ring_give_the_same_bits() -> None:
    """Under mpiexec: an mpi, a gloo and a ring group in one job, the same extrema and DDP runs.

    The mpi group also runs every folded reduction, against the left fold bit for bit, as the test
    above does for the ring and Gloo (so all three give the fold's bits). At 3 ranks: the mpi
    backend has no deterministic code of its own (its folds are the interface's, over its
    collectives), and the left-fold test above checks those folds at 4 ranks on the ring and Gloo
    (the suite's time on two cores).
    """
    world, ddp = 3, True
    args = [list(bodies.SIZES), ddp]
    name = f"{bodies.__name__}:across_backends"
    result = launch(name, world, args, env={"COMMLIB_TIMEOUT": "60"}, timeout=600)
    assert result.returncode == 0, result.describe()
    assert sorted(result.results) == list(range(world)), result.describe()
    ddp_hashes = set()
    for rank, values in result.results.items():
        by_backend = values[f"{bodies.__name__}:across_backends"]
        assert sorted(by_backend) == ["gloo", "mpi", "ring"]
        reductions = by_backend["mpi"]["reductions"]
        assert reductions["failures"] == [], f"rank {rank} mpi:\n" + "\n".join(reductions["failures"][:10])
        assert reductions["checked"] == CHECKS_PER_RANK
        for backend, out in by_backend.items():
            extrema = out["extrema"]["failures"]
            assert extrema == [], f"rank {rank} {backend}:\n" + "\n".join(extrema[:10])
        digests = {out["extrema"]["digest"] for out in by_backend.values()}
        assert len(digests) == 1, f"rank {rank}: the backends' extrema differ"
        ddp_hashes |= {tuple(sorted(out["ddp"].items())) for out in by_backend.values()}
    assert len(ddp_hashes) == 1, "DDP's parameters differ between ranks or backends"
    hashes = dict(next(iter(ddp_hashes)))
    assert hashes["buckets"] == hashes["buckets_large"] and hashes["zero"] == hashes["zero_large"]


@pytest.mark.mpi
@pytest.mark.launcher
@requires_mpi
def test_compare_backends_exact_mode(repo_root: Any) -> None:
    """compare_backends.py --exact: ring, gloo and mpi on 3 ranks agree bit for bit, else it names where."""
    import sys

    from tests.conftest import mpiexec_command, mpiexec_env, run_job

    script = [
        sys.executable,
        str(repo_root / "examples" / "compare_backends.py"),
        "--backends",
        "ring,gloo,mpi",
    ]
    env = mpiexec_env(OMP_NUM_THREADS="1", COMMLIB_TIMEOUT="30")
    proc = run_job([*mpiexec_command(3), *script, "--exact"], timeout=180, env=env, cwd=None)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ring vs gloo on 3 ranks, seed 0 (deterministic):" in proc.stdout
    assert "ring vs mpi on 3 ranks, seed 0 (deterministic):" in proc.stdout
    assert proc.stdout.count("identical") == 8, proc.stdout
    assert "the same bits on ring, gloo, mpi" in proc.stdout

    step = ["--step", f"{bodies.__name__}:perturbed_step"]
    proc = run_job([*mpiexec_command(3), *script, *step, "--exact"], timeout=180, env=env, cwd=None)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "summed                   float32   float   1 of 1536 elements differ" in proc.stdout
    assert "not the same bits: first difference summed[2, 3] on rank 1: ring " in proc.stdout
    assert "gloo 1.0 (0x3f800000)" in proc.stdout or "gloo 2.0 (0x40000000)" in proc.stdout


@pytest.mark.parametrize("world", [2, 3])
def test_min_and_max_give_the_folds_signs_of_zeros_and_nans(get_pool: Any, world: int) -> None:
    """Zeros and NaNs of both signs across ranks: the backends' own MIN/MAX disagree on the signs."""
    results = {v: get_pool(v, world).run(bodies.body_extrema, timeout=120) for v in ("ring-shm", "gloo")}
    for variant, ranks in results.items():
        for values in ranks:
            assert values["failures"] == [], f"{variant}:\n" + "\n".join(values["failures"][:10])
    assert [r["digest"] for r in results["ring-shm"]] == [r["digest"] for r in results["gloo"]]
