"""The ring's point-to-point links and subgroup rings on spawned ranks, over shared memory and TCP."""

from __future__ import annotations

import pytest

from tests._launcher import run_ranks
from tests.distributed import ring_p2p_bodies as bodies

pytestmark = pytest.mark.multiprocess

TRANSPORTS = ("ring-shm", "ring-tcp")


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("variant", TRANSPORTS)
def test_ring_exchange_skipping_pairs_and_many_small_messages(
    get_pool, variant: str, world_size: int
) -> None:
    # 3000 floats: three 4 KiB pieces per message with the pools' small chunks.
    digests = get_pool(variant, world_size).run(bodies.body_p2p_patterns, 3000, timeout=120)
    assert len(set(digests)) == world_size  # every rank got its own left neighbour's data


@pytest.mark.parametrize("variant", TRANSPORTS)
def test_a_size_mismatch_raises_on_both_sides(get_pool, variant: str) -> None:
    messages = get_pool(variant, 2).run(bodies.body_size_mismatch, timeout=60)
    assert "refused the message" in messages[0] and "this recv's buffer holds" in messages[1]


def test_a_send_nobody_receives_times_out_and_the_rest_goes_on() -> None:
    messages = run_ranks(bodies.body_send_nobody_receives, 3, env={"COMMLIB_TIMEOUT": "60"}, timeout=120)
    assert len(messages[0]) == 2 and all("did not receive the message (tag 9" in m for m in messages[0])


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_100_mb_message_each_way(transport: str) -> None:
    numel = 25 * 1024 * 1024  # 100 MiB of float32
    env = {"COMMLIB_RING_TRANSPORT": transport, "COMMLIB_TIMEOUT": "120"}
    digests = run_ranks(bodies.body_big_message, 2, args=(numel,), env=env, timeout=240)
    assert digests[0] != digests[1]


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
