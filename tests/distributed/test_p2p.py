"""Point-to-point on every backend variant.

Ring exchanges, skipping pairs, batches both ways, order, 100 MiB, size and dtype mismatches
on both sides, and a send whose receive never comes (timeout, stall report, flight recorder).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests._launcher import RankPool
from tests.distributed import p2p_bodies as bodies
from tests.distributed.conftest import VARIANTS, variant_available

pytestmark = pytest.mark.multiprocess

CASES = [(v, w) for v in VARIANTS for w in (2, 3, 4) if not (v == "ring-tcp" and w == 4)]


@pytest.mark.parametrize(("variant", "world_size"), CASES)
def test_ring_exchange_pairs_and_order(get_pool, variant: str, world_size: int) -> None:
    """One call per world: the blocking ring, batches both ways, skipping pairs, any-source, many in order."""
    pool = get_pool(variant, world_size)
    digests = pool.run(bodies.body_ring_exchange, timeout=240)
    assert len(digests[0]) == len(bodies.DTYPES) * len(bodies.SIZES)
    skips = pool.run(bodies.body_skipping_pairs, timeout=120)
    if world_size >= 3:
        assert skips[0]["senders"] == list(range(1, world_size)), skips[0]
        assert skips[0]["empty_from"] == world_size - 1, skips[0]
    orders = pool.run(bodies.body_many_in_order, timeout=120)
    assert orders[0] == {"sent": 400}
    assert orders[1] == {"order_7": True, "order_8": True}
    numbered = pool.run(bodies.body_p2p_keeps_collectives_numbered, timeout=60)
    assert all(v == {"advanced": 1, "sum": float(world_size)} for v in numbered), numbered


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_message_goes_to_the_earliest_posted_receive_that_accepts_it(get_pool, variant: str) -> None:
    """Any source then rank 0, and rank 0 then any source: the first message lands in the first posted."""
    _, receiver = get_pool(variant, 2).run(bodies.body_earliest_posted_receive_wins, timeout=120)
    assert receiver == {"first_to_first_posted": [True] * 4, "sources": [0] * 4}, receiver


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_receive_waiting_for_one_tag_never_holds_up_another(get_pool, variant: str) -> None:
    receiver, _ = get_pool(variant, 2).run(bodies.body_tags_complete_apart, timeout=120)
    assert receiver == {"got": [[[5.0] * 4, [6.0] * 4]] * 2}, receiver


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_100_mib_and_size_mismatch(get_pool, variant: str) -> None:
    pool = get_pool(variant, 2)
    sender, receiver = pool.run(bodies.body_large, timeout=240)
    assert sender["equal"] and receiver["equal"]
    sender, receiver = pool.run(bodies.body_size_mismatch, timeout=120)
    assert (
        "sends 32 bytes (8 x float32), but this recv's tensor holds 20 bytes (5 x float32)"
        in receiver["smaller"]
    )
    assert (
        "matching recv holds 20 bytes (5 x float32), but this send has 32 bytes (8 x float32)"
        in sender["smaller"]
    )
    assert (
        "sends 20 bytes (5 x float32), but this recv's tensor holds 32 bytes (8 x float32)"
        in receiver["larger"]
    )
    assert (
        "matching recv holds 32 bytes (8 x float32), but this send has 20 bytes (5 x float32)"
        in sender["larger"]
    )
    for text in (sender["smaller"], receiver["smaller"]):
        assert "tag 11" in text and text.startswith(f"[rank {0 if text is sender['smaller'] else 1}/2] ")
    assert receiver["after"] == [4.0, 4.0, 4.0], "the pair must stay in step after a size mismatch"
    for side, kind in ((sender, "send"), (receiver, "recv")):
        batch = side["batch"]
        first, second = batch["errors"]
        assert second is None and batch["second"] == [4.0] * 3, batch
        assert f".{kind} #{batch['numbers'] - 1} " in first, first  # the first op's own number
    assert sender["seq"] == receiver["seq"], "point-to-point advanced the collective sequence"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_dtype_mismatch_raises_on_both_sides_by_every_route(get_pool, variant: str) -> None:
    """float32 into int32 (and float64 x10 into int32 x10): send/recv, isend/irecv, batch, any source."""
    pool = get_pool(variant, 2)
    sender, receiver = pool.run(bodies.body_dtype_mismatch, timeout=120)
    bodies.check_dtype_mismatch(VARIANTS[variant][0], sender, receiver)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tags_outside_the_users_range_are_refused_by_every_route(get_pool, variant: str) -> None:
    pool = get_pool(variant, 2)
    bodies.check_bad_tags(VARIANTS[variant][0], pool.run(bodies.body_bad_tags, timeout=120))


@pytest.fixture(scope="module")
def watched(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, RankPool], Path]]:
    """Per variant, 2 ranks with DETAIL, stall reports after 1 s and a flight recorder."""
    dump = tmp_path_factory.mktemp("p2p-dumps")
    env = {
        "COMMLIB_TIMEOUT": "60",
        "COMMLIB_STALL_S": "1",
        "COMMLIB_DEBUG": "DETAIL",
        "COMMLIB_FLIGHT_RECORDER": "32",
        "COMMLIB_DUMP_DIR": str(dump),
    }
    pools = {v: RankPool(2, VARIANTS[v][0], env={**VARIANTS[v][1], **env}) for v in VARIANTS}
    yield pools, dump
    for pool in pools.values():
        pool.close()


@pytest.mark.waits
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_send_whose_recv_never_comes(watched: tuple[dict[str, RankPool], Path], variant: str) -> None:
    reason = variant_available(variant)
    if reason:
        pytest.skip(reason)
    pools, dump = watched
    sender, waiter = pools[variant].run(bodies.body_unmatched_send, 4.0, timeout=120)
    error = sender["error"]
    assert error is not None and "send #1 to rank 1 tag 7" in error, error
    assert "within 4 s" in error, error
    assert sender["elapsed_s"] < 30, "the timeout is the subgroup's 4 s"
    stalls = [w for w in sender["warnings"] if ".send #1 to rank 1 tag 7" in w]
    assert stalls, sender["warnings"]
    assert "Rank 1 has posted 0 receive(s) from rank 0 and 0 from any rank with tag 7" in stalls[0], stalls[0]
    assert f"(group {sender['group']}: global ranks [0, 1])" in stalls[0], stalls[0]
    assert sender["after"] == waiter["after"] == 2.0, "the parent group goes on"
    document = json.loads(Path(sender["dump"]).read_text())
    (group,) = [g for g in document["groups"] if g["name"] == sender["group"]]
    (entry,) = [e for e in group["entries"] if e.get("tag") == 7]
    assert (entry["op"], entry["peer"], entry["seq"], entry["status"]) == ("send", 1, 1, "failed"), entry
    assert group["global_ranks"] == [0, 1]
