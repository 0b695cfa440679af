"""The ring's own point-to-point and subgroup behaviour on spawned ranks, over shared memory and TCP.

The backend-agnostic bodies (tests/distributed/test_p2p.py, test_subgroups.py) cover the rest. Here:
a send nobody receives, subgroup rings, and ``isend`` followed at once by ``destroy_process_group``.
"""

from __future__ import annotations

import multiprocessing

import pytest

from tests._launcher import describe_failures, run_ranks, run_ranks_outcomes
from tests.distributed import ring_p2p_bodies as bodies

pytestmark = pytest.mark.multiprocess


@pytest.mark.waits
def test_a_send_nobody_receives_times_out_and_the_rest_goes_on() -> None:
    messages = run_ranks(bodies.body_send_nobody_receives, 3, env={"COMMLIB_TIMEOUT": "60"}, timeout=120)
    to_1, to_2 = messages[0]
    assert to_1.startswith(
        "[rank 0/3] ring.send #1 to rank 1 tag 9 (float32, 4 elements) in group [0-2] (global ranks): rank 1 "
        "did not receive"
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


def test_isend_then_destroy_delivers_the_message() -> None:
    """Rank 0's close waits for the send in flight, rank 1 takes it, and close returns.

    COMMLIB_TIMEOUT is far longer than the harness deadline: a close that waited for it fails the test.
    """
    events = [multiprocessing.get_context("forkserver").Event() for _ in range(2)]
    outcomes = run_ranks_outcomes(
        bodies.body_isend_then_destroy,
        2,
        init=False,
        args=(*events, True),
        env={"COMMLIB_TIMEOUT": "300"},
        timeout=90,
    )
    assert all(o.ok for o in outcomes), describe_failures(outcomes)
    sender, receiver = (o.value for o in outcomes)
    assert sender == {"completed": True, "error": None}, sender
    assert receiver == {"equal": True}, receiver


@pytest.mark.waits
def test_isend_then_destroy_fails_the_send_clearly_when_nobody_receives_it() -> None:
    events = [multiprocessing.get_context("forkserver").Event() for _ in range(2)]
    outcomes = run_ranks_outcomes(
        bodies.body_isend_then_destroy,
        2,
        init=False,
        args=(*events, False),
        env={"COMMLIB_TIMEOUT": "3"},
        timeout=90,
    )
    assert all(o.ok for o in outcomes), describe_failures(outcomes)
    sender = outcomes[0].value
    assert sender["completed"] and sender["error_type"] == "GroupClosedError", sender
    assert sender["error"] == (
        "[rank 0/2] ring.send #1 to rank 1 tag 0 (float32, 1000 elements): the group was closed before "
        "rank 1 took the message: close waited the group's timeout (3 s) for it. Rank 1 posted no matching "
        "recv, or is stuck"
    ), sender
