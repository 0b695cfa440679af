"""Gloo never takes a process down at exit: operations in flight at ``close``.

A thread left inside a Gloo wait or torch's store client when the interpreter
exits aborts the process ("terminate called without an active exception")
if its wait ends then. ``close`` (``destroy_process_group``) therefore finishes
or fails every point-to-point operation within the group's timeout (a store
connection given up on behind a flood is shut down at once:
``tests/test_store_rendezvous.py``). Each test checks the exit
status of the ranks (0, or a Python exception: never a signal) and what every
operation ended with.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

import commlib
from tests._launcher import run_ranks_outcomes

pytestmark = [pytest.mark.multiprocess, pytest.mark.waits]

TIMEOUT_S = 3.0
"""The group's timeout: how long ``close`` gives a send whose receiver never comes."""


def _outcome(work: Any) -> str:
    try:
        work.wait()
    except Exception as e:  # noqa: BLE001 - reported to the test
        return f"{type(e).__name__}: {e}"
    return "ok"


def _isend_then_destroy(group: Any, late_s: float | None, destroying: Any, done: Any) -> dict[str, Any]:
    """Rank 0 sends, then closes at once; rank 1 posts its receive ``late_s`` after that (None: never)."""
    if group.rank == 0:
        t = torch.arange(1000, dtype=torch.float32)
        work = group.isend(t, 1)
        destroying.set()
        start = time.perf_counter()
        commlib.destroy_process_group()
        closed_s = time.perf_counter() - start
        finished = work.is_completed()
        done.set()
        return {"send": _outcome(work), "finished_at_close": finished, "closed_s": closed_s}
    destroying.wait(60)
    if late_s is None:
        done.wait(60)  # rank 0 has closed: nothing can arrive any more
        return {}
    # A receiver that comes late, while rank 0 is closing (a close that returned early sets ``done``).
    closed_early = done.wait(late_s)
    got = torch.zeros(1000)
    group.recv(got, 0)
    return {"received": got.tolist(), "closed_early": closed_early}


def _ranks(body: Any, *args: Any, world: int = 2, timeout: float = TIMEOUT_S) -> list[Any]:
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    events = (ctx.Event(), ctx.Event())
    return run_ranks_outcomes(
        body, world, backend="gloo", args=(*args, *events), timeout=90, env={"COMMLIB_TIMEOUT": str(timeout)}
    )


def test_isend_then_destroy_delivers_to_a_late_receiver_and_exits_cleanly() -> None:
    sender, receiver = _ranks(_isend_then_destroy, 2.0, timeout=20.0)
    assert sender.ok and sender.exitcode == 0, sender  # not SIGABRT (-6)
    assert receiver.ok and receiver.exitcode == 0, receiver
    assert receiver.value == {"received": [float(i) for i in range(1000)], "closed_early": False}
    assert sender.value["send"] == "ok" and sender.value["finished_at_close"] is True, sender.value


def test_isend_nobody_receives_fails_at_destroy_within_the_timeout() -> None:
    sender, receiver = _ranks(_isend_then_destroy, None)
    assert sender.ok and sender.exitcode == 0, sender
    assert receiver.ok and receiver.exitcode == 0, receiver
    value = sender.value
    assert value["send"].startswith(
        "GroupClosedError: [rank 0/2] gloo.send #1 to rank 1 tag 0 (float32, 1000 elements): the group "
        "was closed with this send in flight, and rank 1 did not receive it within the group's timeout (3 s)"
    ) or value["send"].startswith("CommTimeoutError: [rank 0/2] gloo.send #1 to rank 1 tag 0"), value
    assert value["closed_s"] < TIMEOUT_S + 10, value  # bounded by the timeout, not by the peer


def _irecv_then_destroy(group: Any, any_source: bool, destroying: Any, done: Any) -> dict[str, Any]:
    """Rank 0 posts a receive nobody answers (from the last rank, or from any rank) and closes."""
    if group.rank != 0:
        done.wait(60)
        return {}
    work = group.irecv(torch.zeros(4), None if any_source else group.world_size - 1)
    start = time.perf_counter()
    commlib.destroy_process_group()
    closed_s = time.perf_counter() - start
    done.set()
    return {"recv": _outcome(work), "closed_s": closed_s}


@pytest.mark.parametrize("any_source", [False, True], ids=["from_rank_2", "from_any_rank"])
def test_pending_irecv_fails_at_destroy(any_source: bool) -> None:
    outcomes = _ranks(_irecv_then_destroy, any_source, world=3)
    for outcome in outcomes:
        assert outcome.ok and outcome.exitcode == 0, outcome
    value = outcomes[0].value
    source = "any rank" if any_source else "rank 2"
    assert value["recv"] == (
        f"GroupClosedError: [rank 0/3] gloo.recv #1 from {source} tag 0 (float32, 4 elements): the group "
        f"was closed while this recv was waiting; nothing came from {source}"
    ), value
    assert value["closed_s"] < TIMEOUT_S + 10, value
