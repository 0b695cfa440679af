"""Subgroups on every backend variant: overlapping groups used in turn, groups of one, closing, split,
and rank lists that differ across ranks."""

from __future__ import annotations

from typing import Any

import pytest

from tests.distributed import subgroup_bodies as bodies
from tests.distributed.conftest import VARIANTS

pytestmark = pytest.mark.multiprocess

CASES = [(v, w) for v in VARIANTS for w in (3, 4) if not (v == "ring-tcp" and w == 4)]


@pytest.mark.parametrize(("variant", "world_size"), CASES)
def test_overlapping_single_nested_and_closed_groups(get_pool, variant: str, world_size: int) -> None:
    values = get_pool(variant, world_size).run(bodies.body_overlapping_groups, timeout=240)
    a_ranks, b_ranks = bodies._layout(world_size)
    names = [v["names"] for v in values]
    # Members agree on each group's name; it is the parent's name and the call's number (the pool's
    # world group may have made subgroups for earlier tests, so the numbers are consecutive, not 0 and 1).
    (a_name,) = {names[r]["a"] for r in a_ranks}
    (b_name,) = {names[r]["b"] for r in b_ranks}
    (a_parent, a_call), (b_parent, b_call) = a_name.rsplit(".", 1), b_name.rsplit(".", 1)
    assert a_parent == b_parent and int(b_call) == int(a_call) + 1, (a_name, b_name)
    assert all(names[r]["a"] is None for r in range(world_size) if r not in a_ranks)
    singles = [n["single"] for n in names]
    assert len(set(singles)) == world_size, f"each rank's group of one has a name of its own: {singles}"
    (nested,) = {names[r]["nested"] for r in (b_ranks[0], b_ranks[-1])}
    assert nested.startswith(b_name + "."), nested
    assert all(values[r]["timeouts"]["b"] == 45 for r in b_ranks)


@pytest.mark.parametrize(("variant", "world_size"), CASES)
def test_split(get_pool, variant: str, world_size: int) -> None:
    values = get_pool(variant, world_size).run(bodies.body_split, timeout=120)
    for r, value in enumerate(values):
        mine = sorted((k for k in range(world_size) if k % 2 == r % 2), reverse=True)
        assert value["global_ranks"] == mine, value
        itself = f"dst={mine.index(r)} (group rank; global rank {r}) is this rank; a rank cannot send"
        assert itself in value["send_to_itself"], value
    assert values[0]["halves"] != values[1]["halves"], "two colors, two groups"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_subgroup_outlives_its_parent(get_pool, variant: str) -> None:
    values = get_pool(variant, 3).run(bodies.body_parent_closed, timeout=120)
    assert [v["member"] for v in values] == [True, False, True]
    assert all(v["sum"] == 3.0 for v in values)


@pytest.mark.parametrize(("variant", "world_size"), CASES)
def test_torchs_split_functions(get_pool, variant: str, world_size: int) -> None:
    values = get_pool(variant, world_size).run(bodies.body_torch_split_functions, timeout=180)
    n = world_size
    size = n // 2 if n % 2 == 0 else n
    for r, v in enumerate(values):
        assert v["backend"] == VARIANTS[variant][0], v
        assert r == n - 1 or v["part_timeout"] == 40
        assert v["every"] == [r // size == i for i in range(n // size)]
        assert v["listed"] == ([0, n - 1] if r in (0, n - 1) else [1] if r == 1 else None)
        # sort_ranks=False: the last rank is rank 0 of the pair.
        expected_pair = ({n - 1: 0, 0: 1}[r], [n - 1, 0]) if r in (0, n - 1) else None
        assert v["kept"] == expected_pair
        assert v["listed_every"] == [r in (0, n - 1)] + ([r == 1] if n > 2 else [])
        assert v["gathered"] == [x for k in range(size) for x in (k, 7)]
        k = r % size  # this rank's block of the sum of every member's arange(3 * size)
        assert v["scattered"] == [size * (3 * k + i) for i in range(3)]


def mismatched_member_lists_expected(backend: str, rank: int, world_size: int) -> dict[str, Any]:
    """What ``body_mismatched_member_lists`` reports on every rank, whatever the backend."""
    last = world_size - 1
    most = f"0-{last - 1}" if last > 2 else "0, 1"  # the ranks that passed the same lists
    fix = "in the same order relative to its other new_group / split / split_group calls; no group was made"
    return {
        "new_group": (
            f"[rank {rank}/{world_size}] {backend}.new_group: the ranks passed different rank lists to "
            f"new_group: ranks {most} passed [0, 1]; rank {last} passed [0, {last}]. Every rank of the group "
            f"must call new_group with the same ranks, {fix}"
        ),
        "split_group": (
            f"[rank {rank}/{world_size}] {backend}.split_group: the ranks passed different rank lists to "
            f"split_group: ranks {most} passed [[0, 1], {list(range(2, world_size))}]; rank {last} passed "
            f"[[0, {last}], {list(range(1, last))}]. Every rank of the group must call split_group with the "
            f"same ranks, {fix}"
        ),
        "sum_after": float(world_size),
    }


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_different_member_lists_raise_on_every_rank_before_any_set_up(get_pool, variant: str) -> None:
    """The last rank lists other members: every rank raises, naming each rank's lists; the parent works.

    The pool's COMMLIB_TIMEOUT is 60 s, the run's deadline 30 s: waiting for missing members fails.
    """
    values = get_pool(variant, 3).run(bodies.body_mismatched_member_lists, timeout=30)
    backend = VARIANTS[variant][0]
    for rank, value in enumerate(values):
        assert value == mismatched_member_lists_expected(backend, rank, 3), value


def timeouts_name_the_group_expected(backend: str, rank: int) -> dict[str, str]:
    """The start of each error ``body_timeouts_name_the_group`` reports on ``rank``."""
    pair = {0: (0, [0, 1]), 1: (0, [1, 2]), 2: (1, [0, 2])}[rank]
    expected = {
        "deadlock": f"[rank {pair[0]}/2] {backend}.all_reduce #1 (float32, 4 elements) in group {pair[1]} "
        "(global ranks): "
    }
    if rank == 2:
        expected["recv"] = (
            f"[rank 1/2] {backend}.recv #1 from rank 0 tag 5 (float32, 4 elements) in group [1, 2] "
            "(global ranks): "
        )
    return expected


@pytest.mark.waits
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_timeout_on_a_subgroup_names_the_group_by_its_global_ranks(get_pool, variant: str) -> None:
    """Overlapping pairs called in a cyclic order deadlock until their 3 s timeout; then a recv is lost."""
    values = get_pool(variant, 3).run(bodies.body_timeouts_name_the_group, timeout=90)
    backend = VARIANTS[variant][0]
    for rank, value in enumerate(values):
        for what, start in timeouts_name_the_group_expected(backend, rank).items():
            assert value[what] is not None and value[what].startswith(start), (rank, what, value)
        assert set(value) == {"deadlock"} | ({"recv"} if rank == 2 else set()), value


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_non_member_is_refused_and_never_joins_the_world(get_pool, variant: str) -> None:
    values = get_pool(variant, 3).run(bodies.body_non_members_are_refused, timeout=120)
    bodies.check_non_members_refused(VARIANTS[variant][0], values)


@pytest.mark.parametrize("variant", ["ring-shm", "gloo"])
def test_destroying_the_default_group_closes_every_group_made_from_it(variant: str) -> None:
    """As torch's ``destroy_process_group()``: no subgroup's threads or connections outlive the job's."""
    from tests._launcher import run_ranks

    backend, env = VARIANTS[variant]
    env = {**env, "COMMLIB_STALL_S": "5"}  # a watchdog per group, as a job with stall reports has
    values = run_ranks(bodies.body_destroy_closes_every_subgroup, 2, backend=backend, env=env, timeout=120)
    assert [v["closed"] for v in values] == [[True, True, True, True], [True, True, True]], values
    for v in values:
        assert not [t for t in v["threads"] if "watchdog" in t or "hub" in t], v["threads"]
