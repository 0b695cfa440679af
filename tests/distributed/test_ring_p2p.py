"""The ring's own point-to-point and subgroup behaviour on spawned ranks, over shared memory and TCP.

The backend-agnostic bodies (tests/distributed/test_p2p.py, test_subgroups.py) cover the rest.
"""

from __future__ import annotations

import pytest

from tests._launcher import run_ranks
from tests.distributed import ring_p2p_bodies as bodies

pytestmark = pytest.mark.multiprocess


def test_a_send_nobody_receives_times_out_and_the_rest_goes_on() -> None:
    messages = run_ranks(bodies.body_send_nobody_receives, 3, env={"COMMLIB_TIMEOUT": "60"}, timeout=120)
    to_1, to_2 = messages[0]
    assert to_1.startswith(
        "[rank 0/3] ring.send #1 to rank 1 tag 9 (float32, 4 elements): rank 1 did not receive"
    ), to_1
    assert "within 1 s" in to_1 and "stays queued for a later recv" in to_1, to_1
    assert to_2.startswith("[rank 0/3] ring.send #1 to rank 2 tag 9"), to_2
    assert "posted no recv from this rank" in to_2, to_2


@pytest.mark.parametrize(("transport", "world_size"), [("shm", 4), ("tcp", 3)])
def test_subgroup_rings_and_closing_either_side(transport: str, world_size: int) -> None:
    env = {"COMMLIB_RING_TRANSPORT": transport, "COMMLIB_TIMEOUT": "60"}
    results = run_ranks(bodies.body_subgroup_links, world_size, env=env, timeout=120)
    for rank, (send, recv, values) in enumerate(results):
        members = [q for q in range(world_size) if q % 2 == rank % 2]
        if len(members) > 1:
            assert (send, recv) == (transport, transport)
        expected = [float(sum(members))]
        if len(members) > 1:
            expected.append(float(members[1 - members.index(rank)]))
        assert values == [*expected, float(world_size), float(world_size)]
