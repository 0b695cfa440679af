"""Bad input and faults on the ring backend: a clear error on every rank, within the timeout, never a hang."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from commlib import (
    CollectiveMismatchError,
    CommTimeoutError,
    GroupClosedError,
    PeerFailureError,
    RendezvousError,
    RendezvousTimeoutError,
)
from tests._faults import die_after_first
from tests._launcher import free_port, run_ranks, run_ranks_outcomes

pytestmark = pytest.mark.multiprocess

FAST = {"COMMLIB_TIMEOUT": "20"}


# ------------------------------------------------------------ bodies (spawned)
def _mismatched_all_reduce(group, numel: int, dtype_name: str) -> tuple[str, str, list[float]]:
    t = torch.ones(numel, dtype=getattr(torch, dtype_name))
    try:
        group.all_reduce(t)
    except CollectiveMismatchError as e:
        message, kind = str(e), type(e).__name__
    else:
        raise AssertionError("mismatched all_reduce did not raise")
    again = torch.ones(4) * (group.rank + 1)  # the group is still usable
    group.all_reduce(again)
    return kind, message, again.tolist()


def _different_collectives(group) -> str:
    t = torch.ones(8)
    try:
        if group.rank == 0:
            group.all_reduce(t)
        else:
            group.broadcast(t, 0)
    except CollectiveMismatchError as e:
        return str(e)
    raise AssertionError("different collectives did not raise")


def _die_mid_collective(group, victim: int, numel: int) -> tuple[str, str, float]:
    t = torch.ones(numel)
    if group.rank == victim:
        die_after_first(group._right, "send")  # noqa: SLF001 - the victim dies inside its collective
        group.all_reduce(t)
    start = time.monotonic()
    try:
        group.all_reduce(t)
    except PeerFailureError as e:
        elapsed = time.monotonic() - start
        try:
            group.all_reduce(torch.ones(2))
        except GroupClosedError as closed:
            return str(e), str(closed), elapsed
        raise AssertionError("collective after a failure did not raise GroupClosedError") from None
    raise AssertionError("all_reduce with a dead peer did not raise")


def _stuck_peer(group) -> str:
    if group.rank == 1:
        threading.Event().wait(4.0)  # stand in for a rank stuck in computation, longer than the timeout
        return ""
    try:
        group.all_reduce(torch.ones(100))
    except CommTimeoutError as e:
        return str(e)
    raise AssertionError("all_reduce with a stuck peer did not time out")


def _init_only() -> None:
    import commlib

    commlib.init_process_group()


def _closed_group(group) -> str:
    group.close()
    try:
        group.all_reduce(torch.ones(3))
    except GroupClosedError as e:
        return str(e)
    raise AssertionError("collective after close did not raise")


def _transports(group) -> tuple[str, str]:
    return group.transports


# ----------------------------------------------------------------- the tests
@pytest.mark.parametrize("world_size", [2, 3])
def test_mismatched_sizes_raise_on_every_rank_naming_both_shapes(world_size: int) -> None:
    sizes = [(10, "float32")] * world_size
    sizes[-1] = (12, "float32")
    results = run_ranks(_mismatched_all_reduce, world_size, per_rank_args=sizes, env=FAST, timeout=60)
    for rank, (kind, message, again) in enumerate(results):
        assert kind == "CollectiveMismatchError"
        assert message.startswith(f"[rank {rank}/{world_size}] ring.all_reduce #1 (float32, ")
        assert "float32 (10,) [10 elements]" in message and "float32 (12,) [12 elements]" in message
        assert f"rank {world_size - 1}: float32 (12,)" in message
        assert again == [world_size * (world_size + 1) / 2] * 4


def test_mismatched_dtypes_raise_on_every_rank() -> None:
    results = run_ranks(
        _mismatched_all_reduce, 2, per_rank_args=[(6, "float32"), (6, "float64")], env=FAST, timeout=60
    )
    for _, message, _ in results:
        assert "rank 0: float32 (6,)" in message and "rank 1: float64 (6,)" in message


def test_different_collectives_raise_on_every_rank() -> None:
    for message in run_ranks(_different_collectives, 2, env=FAST, timeout=60):
        assert "rank 0: all_reduce #1" in message and "rank 1: broadcast #1" in message


@pytest.mark.parametrize(("world_size", "victim"), [(2, 1), (4, 2)])
def test_peer_dying_mid_collective_raises_on_every_survivor(world_size: int, victim: int) -> None:
    outcomes = run_ranks_outcomes(
        _die_mid_collective, world_size, args=(victim, 4_000_000), env={"COMMLIB_TIMEOUT": "60"}, timeout=90
    )
    assert outcomes[victim].exitcode == 17
    for o in outcomes:
        if o.rank == victim:
            continue
        assert o.ok, o.error
        failure, closed, elapsed = o.value
        assert elapsed < 30, f"rank {o.rank} took {elapsed:.1f} s to notice"
        assert failure.startswith(f"[rank {o.rank}/{world_size}] ring.all_reduce #1")
        assert f"rank {victim}" in failure, failure
        assert "unusable after an earlier failure" in closed


@pytest.mark.waits
def test_missing_rank_at_rendezvous_names_it() -> None:
    start = time.monotonic()
    outcomes = run_ranks_outcomes(
        _init_only, 2, init=False, env={"WORLD_SIZE": "3", "COMMLIB_TIMEOUT": "3"}, timeout=60
    )
    assert time.monotonic() - start < 30
    assert outcomes[0].error_type == RendezvousTimeoutError.__name__
    assert "ranks [2] never did" in (outcomes[0].error or "")
    assert "2/3 ranks arrived" in (outcomes[0].error or "")
    assert outcomes[1].error_type == RendezvousTimeoutError.__name__
    assert "rendezvous failed on rank 0" in (
        outcomes[1].error or ""
    )  # rank 0 tells the others who is missing
    assert "ranks [2] never did" in (outcomes[1].error or "")


@pytest.mark.waits
def test_port_in_use_is_reported_with_the_fix() -> None:
    port = free_port()
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", port))
        squatter.listen(4)
        outcomes = run_ranks_outcomes(
            _init_only, 2, init=False, port=port, env={"COMMLIB_TIMEOUT": "3"}, timeout=60
        )
    assert outcomes[0].error_type == RendezvousError.__name__
    assert f"cannot listen on 127.0.0.1:{port}" in (outcomes[0].error or "")
    assert "set MASTER_PORT" in (outcomes[0].error or "")
    assert not outcomes[1].ok  # it found the squatter, not rank 0, and gave up within the timeout


def test_world_size_disagreement_is_refused() -> None:
    outcomes = run_ranks_outcomes(
        _init_only,
        2,
        init=False,
        per_rank_env=[{}, {"WORLD_SIZE": "3"}],
        env={"COMMLIB_TIMEOUT": "5"},
        timeout=60,
    )
    assert "rank 1 was started with world size 3, rank 0 with 2" in (outcomes[0].error or "")
    assert "rank 1 was started with world size 3" in (outcomes[1].error or "")


@pytest.mark.waits
def test_stuck_peer_times_out_naming_it() -> None:
    results = run_ranks(_stuck_peer, 2, env={"COMMLIB_TIMEOUT": "1.5"}, timeout=60)
    assert results[0].startswith("[rank 0/2] ring.all_reduce #1")
    assert "timed out after 1.5 s waiting for rank 1" in results[0]


def test_collective_after_close_is_refused() -> None:
    for rank, message in enumerate(run_ranks(_closed_group, 2, env=FAST, timeout=60)):
        assert message.startswith(f"[rank {rank}/2] ring.all_reduce: the process group was closed")


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_transport_can_be_forced(transport: str) -> None:
    results = run_ranks(_transports, 3, env={**FAST, "COMMLIB_RING_TRANSPORT": transport}, timeout=60)
    assert all(r == (transport, transport) for r in results)


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device: the host-staging path for CUDA tensors is not exercised",
)
def test_cuda_tensors_are_staged_through_host_memory() -> None:
    results = run_ranks(_cuda_all_reduce, 2, env=FAST, timeout=60)
    assert results == [[3.0] * 5] * 2


def _cuda_all_reduce(group) -> list[float]:
    t = torch.full((5,), float(group.rank + 1), device="cuda")
    group.all_reduce(t)
    return t.cpu().tolist()
