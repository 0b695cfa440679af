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

import subprocess
import sys
from typing import Any

import pytest
import torch

from commlib import PeerFailureError
from commlib.torch_adapter.work import PendingWork
from commlib.work import CompletedWork
from tests._launcher import run_ranks_outcomes
from tests.conftest import REPO_ROOT, scrubbed_env
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
        ("commlib_gloo", [3, 2, 3]),
    ],
    ids=["ring-rank1_larger", "ring-rank1_smaller", "gloo-rank1_larger", "gloo-rank1_smaller"],
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


# One rank of a job through the adapter: torch's env:// rendezvous, whose TCPStore rank 0 hosts.
_ADAPTER_RANK = """
import datetime, os, torch, torch.distributed as dist, commlib.torch_adapter
timeout = datetime.timedelta(seconds=float(os.environ["TIMEOUT"]))
dist.init_process_group(os.environ["BACKEND"], timeout=timeout)
t = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(t)
print("SUM", t.item(), flush=True)
dist.destroy_process_group()
"""


def _start_script(script: str, **env: str) -> subprocess.Popen[str]:
    """Run ``script`` in a fresh interpreter with ``env`` (beside a scrubbed environment), output piped."""
    return subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=REPO_ROOT,
        env=scrubbed_env(**env, PYTHONPATH=str(REPO_ROOT)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.waits
@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", ["commlib_ring", "commlib_gloo"])
def test_in_torchs_store_a_rank_with_another_token_waits_alone_and_the_job_forms(backend: str) -> None:
    """A process with another job token reaches rank 0's store first and claims rank 1: it alone fails.

    It waits in its own token's part of the store until its deadline; this job's rank 1, started
    once it has ended, joins this job's part (the stranger's visit counts nothing there), and the
    job sums 1 + 2.
    """
    from commlib.ports import free_port
    from tests._strangers import stranger_first

    port = free_port()

    def rank(r: int, token: str) -> subprocess.Popen[str]:
        env = {"RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        timeout = "60" if token == "ours" else "3"
        return _start_script(_ADAPTER_RANK, **env, BACKEND=backend, COMMLIB_JOB_TOKEN=token, TIMEOUT=timeout)

    stray, ours = stranger_first(rank)
    inner = backend.removeprefix("commlib_")
    assert stray.returncode != 0 and "SUM" not in stray.out
    assert (
        f"RendezvousTimeoutError: [rank 1/2] {inner}.rendezvous: no rank 0 holding this job's token"
    ) in stray.err, stray.err[-2000:]
    assert "came to the group's store within 3.0 s" in stray.err
    for finished in ours:
        assert finished.returncode == 0 and "SUM 3.0" in finished.out, finished.err[-3000:]


_SHARED_STORE_RANK = """
import datetime, os, torch, torch.distributed as dist, commlib.torch_adapter
rank = int(os.environ["RANK"])
store = dist.TCPStore("127.0.0.1", int(os.environ["STORE_PORT"]), is_master=False, wait_for_workers=False)
timeout = datetime.timedelta(seconds=60)
dist.init_process_group(os.environ["BACKEND"], store=store, rank=rank, world_size=2, timeout=timeout)
t = torch.tensor([float(os.environ["VALUE"])])
dist.all_reduce(t)
print("SUM", t.item(), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", ["commlib_ring", "commlib_gloo"])
def test_two_jobs_given_one_store_each_form_and_sum_their_own(backend: str) -> None:
    """Two 2-rank jobs with their own tokens are given the same store; the other job's rank 0 starts first.

    Each job meets in its own token's part of the store: neither rank 0 takes or answers the
    other's challenge, and each job sums its own ranks' values (1 + 2, 10 + 20).
    """
    from torch.distributed import TCPStore

    from commlib.ports import free_port

    port = free_port()
    server = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)

    def start(rank: int, token: str, value: float) -> subprocess.Popen[str]:
        env = {"RANK": str(rank), "STORE_PORT": str(port), "VALUE": str(value)}
        return _start_script(_SHARED_STORE_RANK, **env, BACKEND=backend, COMMLIB_JOB_TOKEN=token)

    procs: list[subprocess.Popen[str]] = []
    try:
        procs = [
            start(0, "theirs", 10.0),
            start(0, "ours", 1.0),
            start(1, "ours", 2.0),
            start(1, "theirs", 20.0),
        ]
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for p, (_out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    assert [out for out, _err in outs] == ["SUM 30.0\n", "SUM 3.0\n", "SUM 3.0\n", "SUM 30.0\n"]
    del server  # up until every rank had ended
