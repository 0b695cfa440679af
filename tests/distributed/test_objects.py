"""Object collectives on every backend variant, and their size limit."""

from __future__ import annotations

import pytest

from tests.distributed import object_bodies as bodies
from tests.distributed.conftest import VARIANTS

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("world_size", (1, 3))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_object_collectives(get_pool, variant: str, world_size: int) -> None:
    assert get_pool(variant, world_size).run(bodies.body_objects, timeout=120) == [{"ok": True}] * world_size


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_object_size_limit_raises_on_every_rank(get_pool, variant: str) -> None:
    values = get_pool(variant, 3).run(bodies.body_object_limits, timeout=120)
    for rank, value in enumerate(values):
        errors = value["errors"]
        assert value["small"] == [0, 1, 2]
        prefix = f"[rank {rank}/3] {variant.split('-')[0]}."
        big = {
            "broadcast_big": "broadcast_object_list: rank 0 sends 20",
            "all_gather_big": "all_gather_object: rank 2 sends 50",
            "gather_big": "gather_object: rank 0 sends 20",
            "scatter_big": "scatter_object_list: rank 0 sends 20",
        }
        for case, start in big.items():
            assert errors[case] is not None and errors[case].startswith(prefix + start), (
                rank,
                case,
                errors[case],
            )
            assert "over rank 1's limit of 1024 bytes" in errors[case] or "limit of 4096" in errors[case]
            assert "COMMLIB_MAX_OBJECT_BYTES" in errors[case]
        assert (
            "rank 0 sends 2 objects, but the object_list of rank(s) 1, 2 has 1, 1 entries"
            in errors["broadcast_length"]
        ), errors["broadcast_length"]
        assert (
            "object_gather_list must hold one entry per rank (3) (rank 0: 4)" in errors["gather_list_length"]
        )


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_pickling_failure_reaches_every_rank(get_pool, variant: str) -> None:
    values = get_pool(variant, 3).run(bodies.body_object_pickling_failures, timeout=120)
    bodies.check_pickling_failures(values, VARIANTS[variant][0])
