"""Faults and misconfigured ranks through commlib's torch.distributed backends (``commlib.torch_adapter``).

A peer that dies or raises mid-step: rank 1 ends its process (``os._exit``,
SIGKILL) or raises in the middle of its backward (torch's DDP, FSDP2
``fully_shard``) or instead of its next ``dist.all_reduce``. Rank 0 must raise
commlib's error on the thread that waits, well within the group's timeout, and
then exit normally: no signal.

Ranks started with different ``WORLD_SIZE``s: every rank raises commlib's
message, naming both sizes, rather than torch's lost connection.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from commlib import PeerFailureError
from commlib.torch_adapter.work import PendingWork
from commlib.work import CompletedWork
from tests._launcher import run_ranks_outcomes
from tests.distributed import adapter_fault_bodies as bodies

pytestmark = pytest.mark.multiprocess

TIMEOUT_S = 30
"""The group's timeout: an error well before it comes from the peer's failure, not from a timeout."""

ENV = {"COMMLIB_TIMEOUT": str(TIMEOUT_S), "CUDA_VISIBLE_DEVICES": ""}

LOST = {
    "commlib_ring": ("rank 1 (left neighbour) closed the connection",),
    "commlib_gloo": (
        "a peer process closed its connection",  # Gloo's connection, in the collective
        "while this rank waited in the fingerprint check",  # the check's board, before it
    ),
}
"""How each backend tells rank 0 that rank 1's process is gone (gloo: where rank 0 was waiting)."""

CASES = [
    ("ddp", "exit"),
    ("ddp", "kill"),
    ("ddp", "raise"),
    ("fsdp2", "kill"),
    ("fsdp2", "raise"),
    ("all_reduce", "kill"),
    ("all_reduce", "raise"),
    ("all_reduce_async", "exit"),
]


def test_a_failed_works_future_fails_where_torchs_cpp_looks() -> None:
    """torch's C++ (DDP's reducer, ``collect_all``) sees the failure, not a value that is an exception."""
    error = PeerFailureError(
        "[rank 0/2] ring.all_reduce #3 (float32, 8 elements): rank 1 closed the connection"
    )
    future = PendingWork(CompletedWork(error=error), [torch.ones(8)]).get_future()
    with pytest.raises(
        RuntimeError, match=r"PeerFailureError: \[rank 0/2\] ring\.all_reduce #3 .*rank 1 closed"
    ):
        torch.futures.collect_all([future]).wait()  # C++ collectAll: completes only if no future failed
    with pytest.raises(RuntimeError, match=r"PeerFailureError: \[rank 0/2\] ring\.all_reduce #3"):
        future.wait()
    ok = PendingWork(CompletedWork(), [torch.ones(8)]).get_future()
    assert torch.futures.collect_all([ok]).wait()[0].value()[0].tolist() == [1.0] * 8


def _run(backend: str, integration: str, fault: str) -> list[Any]:
    return run_ranks_outcomes(
        bodies.fault_in_backward,
        2,
        backend=None,
        init=False,
        args=(backend, integration, fault),
        timeout=120,
        env=ENV,
    )


@pytest.mark.parametrize("backend", ["commlib_ring", "commlib_gloo"])
@pytest.mark.parametrize(("integration", "fault"), CASES)
def test_survivor_raises_commlib_error_and_exits_normally(backend: str, integration: str, fault: str) -> None:
    survivor, faulty = _run(backend, integration, fault)
    assert survivor.ok and survivor.exitcode == 0, survivor  # no SIGSEGV, no abort
    value = survivor.value
    op = "reduce_scatter" if integration == "fsdp2" else "all_reduce"
    inner = backend.removeprefix("commlib_")
    if integration == "ddp":
        # torch's reducer reads the bucket's future in C++: the failure arrives as torch's RuntimeError,
        # with commlib's error (type and message) inside.
        assert value["error_type"] == "RuntimeError", value
        assert f"PeerFailureError: [rank 0/2] {inner}.{op} #" in value["error"], value
    else:
        assert value["error_type"] == "PeerFailureError", value
        assert value["error"].startswith(f"[rank 0/2] {inner}.{op} #"), value
    assert any(text in value["error"] for text in LOST[backend]), value
    assert value["after_s"] < TIMEOUT_S / 3, value  # measured: 0.01-0.05 s
    unusable = f"GroupClosedError: [rank 0/2] {inner}.barrier: the process group is unusable"
    assert value["next"].startswith(unusable), value
    expected_exit = {"exit": 3, "kill": -9, "raise": 0}[fault]
    assert faulty.exitcode == expected_exit, faulty
    if fault == "raise":
        assert faulty.error == f"RuntimeError: {bodies.FAULT_MESSAGE}", faulty


@pytest.mark.parametrize(
    ("backend", "sizes"),
    [
        ("commlib_ring", [2, 3]),
        ("commlib_ring", [3, 2, 3]),
        ("commlib_gloo", [2, 3]),
        # Not ("commlib_gloo", [3, 2, 3]): rank 2 may answer the store's job check after rank 0 has
        # refused rank 1 and left, and reads only "rank 0 dropped the rendezvous".
    ],
    ids=["ring-rank1_larger", "ring-rank1_smaller", "gloo-rank1_larger"],
)
def test_world_size_mismatch_gives_every_rank_commlibs_message(backend: str, sizes: list[int]) -> None:
    outcomes = run_ranks_outcomes(
        bodies.world_size_mismatch,
        len(sizes),
        backend=None,
        init=False,
        args=(backend, sizes),
        timeout=90,
        env=ENV,
    )
    inner = backend.removeprefix("commlib_")
    for rank, outcome in enumerate(outcomes):
        assert outcome.ok and outcome.exitcode == 0, outcome
        error = outcome.value
        assert error.startswith(f"RendezvousError: [rank {rank}/{sizes[rank]}] {inner}.rendezvous: "), error
        assert "start every rank with the same WORLD_SIZE" in error, error
        # Each names rank 1's size and a size it disagrees with.
        assert f"rank 1 was started with world size {sizes[1]}" in error, error
