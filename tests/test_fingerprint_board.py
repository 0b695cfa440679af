"""The fingerprint check's shared-memory board: exchanges, timeouts, its file, and the check over it."""

from __future__ import annotations

import multiprocessing
import os
import random
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from commlib import CollectiveMismatchError, CommError, CommTimeoutError, Work
from commlib.diagnosis import board as board_module
from commlib.diagnosis import diagnostics as diagnostics_module
from commlib.diagnosis.board import FingerprintBoard, host_identity, reap_stale_boards
from commlib.diagnosis.deferred import DeferredWork, Launcher
from commlib.diagnosis.diagnostics import Diagnostics
from commlib.diagnosis.watchdog import CollectiveTracker
from tests._fake_groups import FakeGroup, RecordingWork, make_env

CAPACITY = 256


def _boards(world: int, directory: Path) -> list[FingerprintBoard]:
    first, token = FingerprintBoard.create(world, CAPACITY, str(directory))
    boards = [first] + [FingerprintBoard.open(first.path, token, r, world) for r in range(1, world)]
    first.unlink()
    return boards


def _payload(rank: int, round_: int, size: int) -> bytes:
    return bytes([(rank * 7 + round_ + i) % 251 for i in range(size)])


def _run_threads(boards: list[FingerprintBoard], rounds: int, skew: bool) -> list[list[bytes]]:
    """Each rank exchanges ``rounds`` times (sizes cycling through 112, 256 and 8), optionally with jitter."""
    results: list[list[bytes]] = [[] for _ in boards]
    errors: list[BaseException] = []

    def rank_body(rank: int) -> None:
        rng = random.Random(rank)
        try:
            for n in range(rounds):
                if skew and rng.random() < 0.1:
                    time.sleep(rng.random() * 1e-3)
                size = (112, 256, 8)[n % 3]
                results[rank].append(boards[rank](_payload(rank, n, size), 10.0, f"rank {rank}", n % 2 == 1))
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    threads = [threading.Thread(target=rank_body, args=(r,)) for r in range(len(boards))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    return results


@pytest.mark.parametrize("world", [2, 3, 5])
def test_every_rank_gets_every_ranks_bytes_in_rank_order(tmp_path: Path, world: int) -> None:
    boards = _boards(world, tmp_path)
    rounds = 300
    results = _run_threads(boards, rounds, skew=True)
    for n in range(rounds):
        size = (112, 256, 8)[n % 3]
        expected = b"".join(_payload(r, n, size) for r in range(world))
        assert all(results[r][n] == expected for r in range(world)), f"exchange {n}"
    for board in boards:
        board.close()


def _process_rank(path: str, token: bytes, rank: int, world: int, rounds: int, out: object) -> None:
    board = FingerprintBoard.open(path, token, rank, world)
    rng = random.Random(rank)
    wrong = 0
    for n in range(rounds):
        if rng.random() < 0.05:
            time.sleep(rng.random() * 2e-3)
        got = board(_payload(rank, n, 112), 20.0, f"rank {rank}", False)
        wrong += got != b"".join(_payload(r, n, 112) for r in range(world))
    board.close()
    out.put((rank, wrong))  # type: ignore[attr-defined]


@pytest.mark.multiprocess
def test_processes_exchange_in_step_however_they_are_scheduled(tmp_path: Path) -> None:
    """Three processes (this one and two forks), 2000 exchanges with random pauses: none torn or stale."""
    world, rounds = 3, 2000
    first, token = FingerprintBoard.create(world, CAPACITY, str(tmp_path))
    context = multiprocessing.get_context("fork")
    out = context.Queue()
    children = [
        context.Process(target=_process_rank, args=(first.path, token, r, world, rounds, out))
        for r in range(1, world)
    ]
    for child in children:
        child.start()
    try:
        wrong = 0
        for n in range(rounds):
            got = first(_payload(0, n, 112), 20.0, "rank 0", n % 5 == 0)
            wrong += got != b"".join(_payload(r, n, 112) for r in range(world))
        reports = dict(out.get(timeout=60) for _ in children)
    finally:
        for child in children:
            child.join(30)
            if child.is_alive():
                child.kill()
        first.unlink()
        first.close()
    assert wrong == 0
    assert reports == {1: 0, 2: 0}


def test_a_rank_that_never_posts_is_named_at_the_timeout(tmp_path: Path) -> None:
    boards = _boards(3, tmp_path)
    other: list[BaseException] = []

    def rank_1() -> None:
        try:
            boards[1](b"x" * 112, 0.6, "rank 1", False)
        except CommTimeoutError as e:
            other.append(e)

    thread = threading.Thread(target=rank_1)
    thread.start()
    start = time.monotonic()
    with pytest.raises(CommTimeoutError) as raised:
        boards[0](b"x" * 112, 0.3, lambda: "[rank 0/3] gloo.all_reduce #7", False)
    assert 0.3 <= time.monotonic() - start < 5.0
    thread.join(10)
    assert len(other) == 1 and "waiting for rank 2 to reach" in str(other[0]), other
    message = str(raised.value)
    assert message.startswith("[rank 0/3] gloo.all_reduce #7: timed out after 0.3 s in the fingerprint check")
    assert "waiting for rank 2 to reach this collective" in message, message
    assert "COMMLIB_TIMEOUT" in message


def test_a_rank_that_closes_its_group_or_exits_is_reported_at_once_not_at_the_timeout(tmp_path: Path) -> None:
    from commlib import PeerFailureError

    boards = _boards(2, tmp_path)
    boards[1].close()  # rank 1 closed its group: rank 0 waits for nobody
    start = time.monotonic()
    with pytest.raises(PeerFailureError, match=r"rank 1 \(pid \d+\) closed the group while"):
        boards[0](b"x" * 112, 60.0, "[rank 0/2] gloo.all_reduce #3", False)
    assert time.monotonic() - start < 5.0  # LIVENESS_S, not the 60 s timeout
    boards[0].close()

    # A rank whose process is gone (killed: it never closed anything).
    first, token = FingerprintBoard.create(2, CAPACITY, str(tmp_path))
    code = (
        f"import sys; sys.path.insert(0, {os.getcwd()!r});"
        "from commlib.diagnosis.board import FingerprintBoard;"
        f"FingerprintBoard.open({first.path!r}, bytes.fromhex({token.hex()!r}), 1, 2);"
        "import os; os._exit(0)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    first.unlink()
    with pytest.raises(PeerFailureError, match="rank 1 .pid \\d+. exited while") as raised:
        first(b"x" * 112, 60.0, "[rank 0/2] gloo.all_reduce #3", False)
    assert raised.value.exited == (1,)
    first.close()


def test_poll_waits_only_as_long_as_asked(tmp_path: Path) -> None:
    zero, one = _boards(2, tmp_path)
    zero.post(b"a" * 112)
    start = time.monotonic()
    assert zero.poll(0.01) is None
    assert time.monotonic() - start < 1.0
    one.post(b"b" * 112)
    assert zero.poll() == b"a" * 112 + b"b" * 112
    assert one.poll() == b"a" * 112 + b"b" * 112


def test_agrees_compares_each_peer_with_its_expected_bytes_and_names_a_late_one(tmp_path: Path) -> None:
    boards = _boards(3, tmp_path)
    head, tails = b"#7:", (b"zero", b"one!", b"two!")
    labels: list[tuple[object, ...]] = []

    def label(*args: object) -> str:
        labels.append(args)
        return "[rank 0/3] mpi.all_reduce #7"

    for rank, board in enumerate(boards):
        board.post(head + tails[rank])
    assert all(board.agrees(head, tails, 5.0, label, "all_reduce", None) for board in boards)
    assert labels == []  # the name is built only for a failure

    # Rank 2 makes another call this time, so it expects other bytes of every rank: all see the difference.
    head, theirs = b"#8:", (b"ZERO", b"ONE!", b"TWO!")
    expected = (tails, tails, theirs)
    for rank, board in enumerate(boards):
        board.post(head + expected[rank][rank])
    assert [board.agrees(head, expected[r], 5.0, label) for r, board in enumerate(boards)] == [False] * 3

    # Rank 2 does not post: rank 0 waits its timeout and names it, with the label built from the args.
    boards[0].post(b"#9:" + tails[0])
    boards[1].post(b"#9:" + tails[1])
    with pytest.raises(CommTimeoutError, match=r"^\[rank 0/3\] mpi.all_reduce #7: timed out .* rank 2 to"):
        boards[0].agrees(b"#9:", tails, 0.2, label, "all_reduce", "t")
    assert labels == [("all_reduce", "t")]
    for board in boards:
        board.close()


def test_a_closed_board_refuses_to_exchange(tmp_path: Path) -> None:
    zero, one = _boards(2, tmp_path)
    zero.close()
    zero.close()  # twice is fine
    with pytest.raises(CommError, match="closed"):
        zero(b"a" * 112, 1.0, "rank 0", False)
    with pytest.raises(ValueError, match="do not fit"):
        one.post(b"a" * (CAPACITY + 1))
    one.close()


def test_the_file_is_private_unguessable_and_gone_after_set_up(tmp_path: Path) -> None:
    first, token = FingerprintBoard.create(2, CAPACITY, str(tmp_path))
    second, _ = FingerprintBoard.create(2, CAPACITY, str(tmp_path))
    info = os.stat(first.path)
    assert stat.S_IMODE(info.st_mode) == 0o600
    assert info.st_uid == os.geteuid()
    name = Path(first.path).name
    assert name.startswith("commlib-board-") and f"-{os.getpid()}-" in name
    assert name != Path(second.path).name and len(name.rsplit("-", 1)[1]) == 24  # 96 random bits
    with pytest.raises(OSError, match="another board"):
        FingerprintBoard.open(first.path, b"\0" * 16, 1, 2)
    with pytest.raises(OSError, match="another board"):
        FingerprintBoard.open(first.path, token, 1, 3)  # another world size
    opened = FingerprintBoard.open(first.path, token, 1, 2)
    first.unlink()
    second.unlink()
    assert list(tmp_path.iterdir()) == []
    first.post(b"a" * 112)
    assert opened(b"b" * 112, 1.0, "rank 1", False) == b"a" * 112 + b"b" * 112
    for board in (first, second, opened):
        board.close()


def test_a_missing_board_or_a_link_planted_at_its_name_is_refused(tmp_path: Path) -> None:
    """Another host's (or ``/dev/shm``'s) board is not there; a symbolic link is not followed."""
    first, token = FingerprintBoard.create(2, CAPACITY, str(tmp_path))
    with pytest.raises(FileNotFoundError):
        FingerprintBoard.open(str(tmp_path / ("commlib-board-0-1-2-" + "0" * 24)), token, 1, 2)
    link = tmp_path / "link"
    link.symlink_to(first.path)
    with pytest.raises(OSError):
        FingerprintBoard.open(str(link), token, 1, 2)
    first.unlink()
    first.close()


def test_boards_of_exited_creators_are_reaped_and_no_others(tmp_path: Path) -> None:
    command = [sys.executable, "-c", "import os; print(os.getpid())"]
    pid = int(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
    namespace = board_module._pid_namespace()  # noqa: SLF001
    stale = tmp_path / f"commlib-board-{namespace}-{pid}-12345-{'a' * 24}"
    alive, _ = FingerprintBoard.create(2, CAPACITY, str(tmp_path))  # this process: alive
    other = tmp_path / f"commlib-board-{namespace + 1}-{pid}-12345-{'b' * 24}"  # another pid namespace
    unrelated = tmp_path / "commlib-ring-1-2-3-abcdefabcdef"
    for path in (stale, other, unrelated):
        path.write_bytes(b"")
    assert reap_stale_boards(str(tmp_path)) == [stale.name]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [Path(alive.path).name, other.name, unrelated.name]
    )
    alive.unlink()
    alive.close()


def test_host_identity_names_the_host_and_its_boot() -> None:
    identity = host_identity()
    hostname, _, boot = identity.partition("/")
    assert hostname == os.uname().nodename
    if os.path.exists("/proc/sys/kernel/random/boot_id"):
        assert len(boot) == 36


# --------------------------------------------------- the check over a board, on threaded ranks
def _checked_pair(tmp_path: Path) -> list[FakeGroup]:
    """Two fake ranks whose diagnosis swaps fingerprints over one board, each with a launcher thread."""
    boards = _boards(2, tmp_path)
    groups = []
    for rank, board in enumerate(boards):
        group = FakeGroup(make_env(rank, 2))
        group._diagnostics = Diagnostics(  # noqa: SLF001 - attached as _start_diagnostics would
            tracker=CollectiveTracker(),
            recorder=None,
            exchange=board,
            world_size=2,
            launcher=Launcher(f"test-launcher-{rank}"),
            rank=rank,
            backend="fake",
            timeout=10.0,
        )
        groups.append(group)
    return groups


def _on_both(groups: list[FakeGroup], call: Callable[[FakeGroup], object]) -> list[object]:
    results: list[object] = [None, None]

    def run(rank: int) -> None:
        try:
            results[rank] = call(groups[rank])
        except BaseException as e:  # noqa: BLE001 - the test looks at it
            results[rank] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return results


def test_async_collectives_whose_peers_are_there_start_on_the_callers_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both ranks post within the poll: the backend's own work comes back, no launcher hop."""
    monkeypatch.setattr(diagnostics_module, "ASYNC_POLL_S", 10.0)
    groups = _checked_pair(tmp_path)
    works = _on_both(groups, lambda g: g.all_reduce(torch.ones(4), async_op=True))
    assert all(isinstance(work, RecordingWork) for work in works), works
    assert [g.calls[-1].method for g in groups] == ["all_reduce", "all_reduce"]
    assert [g._seq for g in groups] == [1, 1]  # noqa: SLF001
    for group in groups:
        group.close()


def test_an_async_mismatch_fails_the_work_on_every_rank_and_moves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(diagnostics_module, "ASYNC_POLL_S", 10.0)
    groups = _checked_pair(tmp_path)
    works = _on_both(groups, lambda g: g.all_reduce(torch.ones(4 if g.rank == 0 else 8), async_op=True))
    for rank, work in enumerate(works):
        assert isinstance(work, Work), work
        with pytest.raises(CollectiveMismatchError) as raised:
            work.wait()
        assert str(raised.value).startswith(f"[rank {rank}/2] fake.all_reduce #1 ")
        assert "rank 0: float32 (4,) [4 elements]; rank 1: float32 (8,) [8 elements]" in str(raised.value)
    assert [g.calls for g in groups] == [[], []], "no data may move after a mismatch"
    # The group goes on: the next collective pairs again.
    works = _on_both(groups, lambda g: g.all_reduce(torch.ones(2), async_op=True))
    assert all(isinstance(work, RecordingWork) for work in works), works
    for group in groups:
        group.close()


def test_a_late_rank_hands_the_wait_to_the_launcher_in_order(tmp_path: Path) -> None:
    """Rank 1 comes late: rank 0's async calls return at once, and start in issue order once it arrives."""
    groups = _checked_pair(tmp_path)
    zero, one = groups
    first = zero.all_reduce(torch.ones(4), async_op=True)
    second = zero.all_reduce(torch.ones(6), async_op=True)  # queued behind the first
    assert isinstance(first, DeferredWork) and isinstance(second, DeferredWork)
    assert zero.calls == []
    one.all_reduce(torch.ones(4))
    one.all_reduce(torch.ones(6))
    first.wait(10)
    second.wait(10)
    assert [call.args["tensor"].numel() for call in zero.calls] == [4, 6]
    for group in groups:
        group.close()


def test_a_deferred_work_waits_for_its_launcher_then_follows_the_backend() -> None:
    """Not started: ``wait(timeout)`` says so and may be retried; then it follows the started work."""
    launcher = Launcher("test-launcher")
    release = threading.Event()
    started = RecordingWork()
    deferred = DeferredWork("[rank 0/2] fake.all_reduce #1", launcher, bound_s=10.0, value=["v"])
    launcher.submit(deferred, lambda: release.wait(10), lambda: started, ())
    assert launcher.queued == 1 and not deferred.started
    with pytest.raises(CommTimeoutError, match="has not started yet"):
        deferred.wait(0.05)
    release.set()
    deferred.wait(10)
    assert deferred.started and deferred.is_completed()
    assert deferred.get_future().wait() == ["v"]

    def refuse() -> Work:
        raise CommError("refused")

    failing = DeferredWork("[rank 0/2] fake.all_reduce #2", launcher, bound_s=10.0)
    launcher.submit(failing, lambda: None, refuse, ())
    with pytest.raises(CommError, match="refused"):
        failing.wait(10)
    launcher.close()


def test_a_launcher_whose_thread_cannot_start_counts_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    launcher = Launcher("test-launcher")
    work = DeferredWork("[rank 0/2] fake.all_reduce #1", launcher, bound_s=10.0)

    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    with monkeypatch.context() as patched:
        patched.setattr(threading.Thread, "start", refuse)
        with pytest.raises(RuntimeError, match="can't start"):
            launcher.submit(work, lambda: None, RecordingWork, ())
    assert launcher.queued == 0 and launcher.drain(0)
    launcher.submit(work, lambda: None, RecordingWork, ())
    work.wait(10)
    assert work.started and launcher.drain(10)
    launcher.close()
