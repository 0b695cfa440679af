"""The mpi group's pieces that need no MPI: spans, the subgroup agreement, the launcher check, the wait.

The group's collectives and faults run under mpiexec in tests/distributed/test_mpi_backend.py;
here each piece runs in-process against exact expectations (fake requests stand in for MPI's).
"""

from __future__ import annotations

import pytest
import torch

from backends.mpi import waiting
from backends.mpi.launcher_check import check_launcher_agrees
from backends.mpi.layout import displacements, overlaps, receive_span, send_span, tiled
from backends.mpi.subgroups import check_agreement, digest
from commlib.env import DistEnv
from commlib.errors import CommError, RendezvousError


# ------------------------------------------------------------------ layout
def test_views_back_to_back_in_one_storage_go_as_they_are() -> None:
    base = torch.arange(10, dtype=torch.float32)
    views = [base[0:3], base[3:3], base[3:7], base[7:10]]
    span = tiled(views)
    assert span is not None and span.data_ptr() == base.data_ptr() and span.tolist() == base.tolist()
    assert send_span(views).data_ptr() == base.data_ptr()
    flat, copy_out = receive_span(views)
    assert flat.data_ptr() == base.data_ptr() and copy_out is None


def test_views_out_of_order_or_apart_are_copied() -> None:
    base = torch.arange(10, dtype=torch.int64)
    out_of_order = [base[5:10], base[0:5]]
    assert tiled(out_of_order) is None
    sent = send_span(out_of_order)
    assert sent.tolist() == [5, 6, 7, 8, 9, 0, 1, 2, 3, 4] and sent.data_ptr() != base.data_ptr()
    apart = [torch.zeros(2, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)]
    flat, copy_out = receive_span(apart)
    assert copy_out is not None and flat.numel() == 5
    flat.copy_(torch.arange(5))
    copy_out()
    assert [v.tolist() for v in apart] == [[0, 1], [2, 3, 4]]


def test_all_empty_views_give_an_empty_span() -> None:
    span = tiled([torch.empty(0), torch.empty(0)])
    assert span is not None and span.numel() == 0


def test_displacements_and_overlaps() -> None:
    assert displacements([3, 0, 2, 5]) == [0, 3, 3, 5]
    assert displacements([]) == []
    base = torch.zeros(8)
    assert overlaps(base[0:4], base[3:8]) and overlaps(base, base[2:3])
    assert not overlaps(base[0:4], base[4:8])
    assert not overlaps(base[0:0], base)
    assert not overlaps(base, torch.zeros(8))


# ------------------------------------------------------------------ subgroups
def test_the_digest_is_equal_for_equal_groups_only() -> None:
    assert digest([[0, 1], [2, 3]]) == digest([[0, 1], [2, 3]])
    assert digest([[0, 1], [2, 3]])[0] == 2
    assert digest([[0, 1], [2, 3]]) != digest([[1, 0], [2, 3]])
    assert 0 <= digest([[0]])[1] < 2**56


def test_the_agreement_names_the_ranks_that_asked_for_other_groups() -> None:
    mine, theirs = tuple(digest([[0, 1]])), tuple(digest([[0, 2]]))
    check_agreement("[rank 0/3] mpi.new_group: ", "new_group", [[0, 1]], [mine, mine, mine], 0)
    with pytest.raises(CommError) as caught:
        check_agreement("[rank 0/3] mpi.new_group: ", "new_group", [[0, 1]], [mine, theirs, theirs], 0)
    assert str(caught.value) == (
        "[rank 0/3] mpi.new_group: ranks [1, 2] asked for other groups than this rank ([[0, 1]]); every "
        "rank of the group must call new_group with the same arguments, in the same order of calls"
    )


# ------------------------------------------------------------------ launcher check
def test_the_launcher_check_passes_when_mpi_agrees_or_is_not_the_source() -> None:
    check_launcher_agrees(DistEnv(rank=1, world_size=2, launcher="mpich"), 1, 2, True)
    check_launcher_agrees(DistEnv(rank=0, world_size=4, launcher="torchrun"), 1, 2, False)
    check_launcher_agrees(DistEnv(rank=0, world_size=4, launcher="single"), 1, 2, True)


@pytest.mark.parametrize(
    ("rank", "size", "hint"),
    [
        (
            0,
            1,
            "this process is an MPI singleton: it was not started by mpiexec. Start the job with "
            "'mpiexec -n 2 python ...'",
        ),
        (0, 3, "mpiexec started 3 processes: start it with '-n 2', or unset the stale variables"),
        (1, 2, "the variables were not set by this MPI job: unset them, or pass matching arguments"),
    ],
)
def test_the_launcher_check_says_how_to_start_the_job(rank: int, size: int, hint: str) -> None:
    with pytest.raises(RendezvousError) as caught:
        check_launcher_agrees(DistEnv(rank=0, world_size=2, launcher="torchrun"), rank, size, True)
    message = str(caught.value)
    assert message.startswith(
        f"[rank {rank}/{size}] mpi.init: MPI.COMM_WORLD says rank {rank} of {size}, but the environment "
        "(torchrun: RANK/WORLD_SIZE) says rank 0 of 2; "
    ), message
    assert hint in message


# ------------------------------------------------------------------ waits
class _Request:
    """Finishes on its ``n``-th test (never if ``n`` is None)."""

    def __init__(self, n: int | None) -> None:
        self.n, self.tests = n, 0

    def Test(self) -> bool:  # noqa: N802 - MPI's name
        self.tests += 1
        return self.n is not None and self.tests >= self.n


class _Messages:
    def __init__(self, waiting: bool) -> None:
        self.waiting, self.matches = waiting, 0

    def match(self) -> None:
        self.matches += 1


class _Progress:
    def __init__(self, idle: bool) -> None:
        self._idle, self.entered, self.exited = idle, 0, 0

    def idle(self) -> bool:
        return self._idle

    def waiter_enter(self) -> None:
        self.entered += 1

    def waiter_exit(self) -> None:
        self.exited += 1


def test_a_quick_request_finishes_within_the_first_tests() -> None:
    request, progress = _Request(3), _Progress(idle=False)
    assert waiting.wait_here(request, _Messages(False), progress, 5.0, 0.0)  # type: ignore[arg-type]
    assert request.tests == 3 and (progress.entered, progress.exited) == (1, 1)


def test_an_idle_progress_thread_is_left_alone() -> None:
    progress = _Progress(idle=True)
    assert waiting.wait_here(_Request(1), _Messages(False), progress, 5.0, 0.0)  # type: ignore[arg-type]
    assert (progress.entered, progress.exited) == (0, 0)


def test_a_request_that_never_finishes_ends_at_the_deadline() -> None:
    request, progress = _Request(None), _Progress(idle=False)
    assert not waiting.wait_here(request, _Messages(False), progress, 0.01, 0.0)  # type: ignore[arg-type]
    assert request.tests > 16 and (progress.entered, progress.exited) == (1, 1)


def test_a_wait_matches_the_waiting_receives() -> None:
    request, messages = _Request(4), _Messages(True)
    assert waiting.wait_here(request, messages, None, 5.0, 0.0)  # type: ignore[arg-type]
    assert messages.matches == 4
    quiet = _Request(1)
    assert waiting.tester(quiet, _Messages(False)) == quiet.Test  # type: ignore[arg-type]
