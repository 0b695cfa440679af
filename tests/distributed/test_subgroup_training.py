"""DDP, Join and ZeRO on data-parallel subgroups: 4 ranks, groups {0, 2} and {1, 3} beside pipeline pairs.

Each group's model must equal one process trained on that group's batches (in
float64, to rounding), and the two groups' models must differ: they never mix.
"""

from __future__ import annotations

import pytest

from tests.distributed import subgroup_bodies as bodies
from tests.distributed.conftest import VARIANTS

pytestmark = pytest.mark.multiprocess

BODIES = {
    "ddp": bodies.body_ddp_on_subgroups,
    "join": bodies.body_join_on_subgroups,
    "zero": bodies.body_zero_on_subgroups,
}


@pytest.mark.parametrize("what", list(BODIES))
@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "ring-tcp"])
def test_data_parallel_subgroups(get_pool, variant: str, what: str) -> None:
    values = get_pool(variant, 4).run(BODIES[what], timeout=240)
    for rank, value in enumerate(values):
        assert value["color"] == rank % 2
        assert value["diff"] < 1e-10, (
            f"rank {rank}: {what} on its group is {value['diff']:.3g} from one process"
        )
    assert values[0]["digest"] == values[2]["digest"] and values[1]["digest"] == values[3]["digest"]
    assert values[0]["digest"] != values[1]["digest"], "the two data-parallel groups trained the same model"
