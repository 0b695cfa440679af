"""Subgroups on every backend variant: overlapping groups used in turn, groups of one, closing, split."""

from __future__ import annotations

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


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_non_member_is_refused_and_never_joins_the_world(get_pool, variant: str) -> None:
    values = get_pool(variant, 3).run(bodies.body_non_members_are_refused, timeout=120)
    bodies.check_non_members_refused(VARIANTS[variant][0], values)
