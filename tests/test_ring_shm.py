"""Single-process tests of the ring's shared memory: doorbells, slots, lent chunks, buffers, kernels."""

from __future__ import annotations

import gc
import os
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import warnings

import numpy as np
import pytest
import torch

from backends.common import kernels
from backends.ring import doorbell
from backends.ring.doorbell import Doorbell, abort_frame
from backends.ring.shared_buffers import SharedBuffers
from backends.ring.shm import HEADER_BYTES, Region, can_share_descriptors
from backends.ring.shm_links import Inbox, ShmRecvLink, ShmSendLink
from backends.ring.wire import PeerClosed, SocketReader
from commlib import CommError, CommTimeoutError, PeerFailureError, ReduceOp

needs_memfd = pytest.mark.skipif(not can_share_descriptors(), reason="needs memfd and /proc (Linux)")

# Control words, as the links lay them out: counters and sleep flags on separate cache lines.
POSTED, POSTED_FLAG, CONSUMED, CONSUMED_FLAG = 8, 16, 24, 32


@pytest.fixture
def pair():  # type: ignore[no-untyped-def]
    a, b = socket.socketpair()
    a.settimeout(5)
    b.settimeout(5)
    yield a, b
    a.close()
    b.close()


@pytest.fixture
def words(tmp_path):  # type: ignore[no-untyped-def]
    region = Region.create_file(str(tmp_path / "control"), 0)
    region.unlink()
    yield region.words
    region.close()


@pytest.fixture(params=["pipe", "socket"])
def wake(request):  # type: ignore[no-untyped-def]
    """How a sleeper is woken: through a pipe of its own, or over the socket."""
    if request.param == "socket":
        yield None
        return
    pipes = [os.pipe(), os.pipe()]  # wakes the waiter, wakes the poster
    for fd in (fd for pipe in pipes for fd in pipe):
        os.set_blocking(fd, False)
    yield pipes
    for fd in (fd for pipe in pipes for fd in pipe):
        os.close(fd)


def _bells(
    words: memoryview,
    a: socket.socket,
    b: socket.socket,
    spin_s: float = 0.0,
    wake: list[tuple[int, int]] | None = None,
) -> tuple[Doorbell, Doorbell]:
    """The poster's and the waiter's ends of one counter pair, on the two ends of a socket pair."""
    (to_waiter_r, to_waiter_w), (to_poster_r, to_poster_w) = wake or [(-1, -1), (-1, -1)]
    poster = Doorbell(
        words,
        mine=POSTED,
        theirs=CONSUMED,
        my_flag=CONSUMED_FLAG,
        their_flag=POSTED_FLAG,
        reader=SocketReader(a, "rank 1 (waiter)"),
        spin_s=spin_s,
        wake_in=to_poster_r,
        wake_out=to_waiter_w,
    )
    waiter = Doorbell(
        words,
        mine=CONSUMED,
        theirs=POSTED,
        my_flag=POSTED_FLAG,
        their_flag=CONSUMED_FLAG,
        reader=SocketReader(b, "rank 0 (poster)"),
        spin_s=spin_s,
        wake_in=to_waiter_r,
        wake_out=to_poster_w,
    )
    return poster, waiter


def _wait_in_thread(bell: Doorbell, target: int) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            bell.wait_for(target, "data")
        except BaseException as e:  # noqa: BLE001 - inspected by the test
            errors.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, errors


def _until_asleep(words: memoryview, flag: int, thread: threading.Thread) -> None:
    """Return once the waiting thread has raised its sleep flag (it then sleeps in the kernel)."""
    while not words[flag]:
        assert thread.is_alive(), "the waiter returned before it slept"
        os.sched_yield()


# ------------------------------------------------------------------ doorbells
def test_a_posted_count_is_seen_without_waiting(pair, words) -> None:
    poster, waiter = _bells(words, *pair)
    poster.advance()
    poster.advance()
    waiter.wait_for(2, "data")
    assert (poster.count, waiter.peer_count, words[POSTED_FLAG]) == (2, 2, 0)


@pytest.mark.parametrize("stores_need_fence", [False, True], ids=["x86-64", "weaker order"])
def test_advance_fences_its_data_before_the_count_only_where_stores_may_pass(
    pair, words, monkeypatch, stores_need_fence
) -> None:
    """One full fence (count before flag) always; one more before the count where stores reorder."""
    fences = []
    monkeypatch.setattr(doorbell, "fence", lambda: fences.append(words[POSTED]))
    monkeypatch.setattr(doorbell, "STORES_NEED_FENCE", stores_need_fence)
    poster, _ = _bells(words, *pair)
    poster.advance()
    assert fences == ([0, 1] if stores_need_fence else [1])  # the count as each fence saw it


def test_a_sleeping_waiter_is_woken_by_a_wake_byte(pair, words, wake) -> None:
    poster, waiter = _bells(words, *pair, wake=wake)
    thread, errors = _wait_in_thread(waiter, 1)
    _until_asleep(words, POSTED_FLAG, thread)
    poster.advance()  # sees the flag: sends a wake byte
    thread.join(5)
    assert not thread.is_alive() and not errors
    assert words[POSTED_FLAG] == 0  # cleared on the way out


def test_wake_bytes_left_over_do_not_confuse_the_next_wait(pair, words, wake) -> None:
    poster, waiter = _bells(words, *pair, wake=wake)
    words[POSTED_FLAG] = 1  # as if the waiter were asleep: the next advances each send a wake byte
    poster.advance()
    poster.advance()
    words[POSTED_FLAG] = 0
    waiter.wait_for(2, "data")
    thread, errors = _wait_in_thread(waiter, 3)  # sleeps despite the two stale bytes
    _until_asleep(words, POSTED_FLAG, thread)
    assert thread.is_alive()
    poster.advance()
    thread.join(5)
    assert not thread.is_alive() and not errors


def test_a_peer_that_exits_wakes_the_sleeper_with_an_error(pair, words, wake) -> None:
    a, b = pair
    _, waiter = _bells(words, a, b, wake=wake)
    thread, errors = _wait_in_thread(waiter, 1)
    _until_asleep(words, POSTED_FLAG, thread)
    a.close()
    thread.join(5)
    assert not thread.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], PeerClosed)
    assert "rank 0 (poster) closed the connection (data" in str(errors[0])


def test_a_message_posted_before_the_peer_exits_is_still_taken(pair, words, wake) -> None:
    a, b = pair
    poster, waiter = _bells(words, a, b, wake=wake)
    words[POSTED_FLAG] = 1
    poster.advance()  # posts, rings
    a.close()  # then the process ends
    words[POSTED_FLAG] = 0
    waiter.wait_for(1, "data")  # the message first
    with pytest.raises(PeerClosed):
        waiter.wait_for(2, "data")  # then the failure


def test_an_abort_wakes_the_sleeper_with_the_reason(pair, words, wake) -> None:
    a, b = pair
    _, waiter = _bells(words, a, b, wake=wake)
    thread, errors = _wait_in_thread(waiter, 1)
    _until_asleep(words, POSTED_FLAG, thread)
    a.sendall(abort_frame("rank 0 gave up: peer 3 died"))
    thread.join(5)
    assert len(errors) == 1 and isinstance(errors[0], PeerFailureError)
    assert str(errors[0]) == "rank 0 (poster) aborted the collective (data): rank 0 gave up: peer 3 died"


def test_a_silent_peer_times_out_naming_the_wait(pair, words) -> None:
    a, b = pair
    b.settimeout(0.2)
    _, waiter = _bells(words, a, b)
    with pytest.raises(
        CommTimeoutError, match=r"timed out after 0\.2 s waiting for rank 0 \(poster\) \(data\)"
    ):
        waiter.wait_for(1, "data")


def test_the_spin_window_finds_a_count_posted_meanwhile(pair, words) -> None:
    poster, waiter = _bells(words, *pair, spin_s=5.0)
    thread, errors = _wait_in_thread(waiter, 1)
    poster.advance()
    thread.join(5)
    assert not thread.is_alive() and not errors


# ------------------------------------------------------------- slot messages
def _links(pair, tmp_path, slots: int = 2, chunk_bytes: int = 4096, **send_kwargs):  # type: ignore[no-untyped-def]
    a, b = pair
    size = Inbox.region_bytes(slots, chunk_bytes)
    mine = Region.create_file(str(tmp_path / "inbox"), size)
    theirs = Region.open_path(mine.path, size, mine.token)
    mine.unlink()
    sender = ShmSendLink(
        a, SocketReader(a, "rank 1"), 1, "rank 1", Inbox(theirs, slots, chunk_bytes), **send_kwargs
    )
    receiver = ShmRecvLink(
        b, SocketReader(b, "rank 0"), 0, "rank 0", Inbox(mine, slots, chunk_bytes), peer_pid=os.getpid()
    )
    return sender, receiver


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_a_record_and_its_payload_share_one_slot(pair, tmp_path, dtype: torch.dtype) -> None:
    sender, receiver = _links(pair, tmp_path, slots=3)
    data = torch.arange(100).to(dtype)
    sender.send_meta(b"m" * 96, data)
    sender.send_meta(b"n" * 96, data[:0])  # an empty payload is still a payload
    sender.send_meta(b"o" * 96)
    assert sender.bell.count == 3  # three messages, three slots' worth
    assert receiver.recv_meta() == b"m" * 96
    total = torch.ones(100, dtype=dtype)
    receiver.recv_reduce(total, kernels.reducer(ReduceOp.SUM, dtype))  # straight out of the slot
    assert receiver.recv_meta() == b"n" * 96
    receiver.recv_into(torch.empty(0, dtype=dtype))
    assert receiver.recv_meta() == b"o" * 96
    assert torch.equal(total, data + 1)


def test_chunks_up_to_a_whole_slot_arrive_byte_for_byte(pair, tmp_path) -> None:
    """Small chunks move by one memmove each way; a strided destination takes torch's copy."""
    sender, receiver = _links(pair, tmp_path, slots=2, chunk_bytes=4096)
    for nbytes in (1, 13, 4095, 4096):
        packed = (torch.arange(nbytes) * 37 % 251).to(torch.uint8)
        sender.send(packed.view(torch.bool))  # bytes other than 0 and 1 stay as they are
        got = torch.empty(nbytes, dtype=torch.bool)
        receiver.recv_into(got)
        assert torch.equal(got.view(torch.uint8), packed)
    sender.send(torch.arange(8, dtype=torch.float32))
    strided = torch.zeros(16)
    receiver.recv_into(strided[::2])
    assert torch.equal(strided[::2], torch.arange(8, dtype=torch.float32)) and not strided[1::2].any()


def test_a_chunk_of_the_wrong_size_or_kind_is_refused(pair, tmp_path) -> None:
    sender, receiver = _links(pair, tmp_path)
    sender.send(torch.ones(12))
    with pytest.raises(CommError, match=r"rank 0 sent a 48-byte chunk where this rank expected 40 bytes"):
        receiver.recv_into(torch.empty(10))
    sender, receiver = _links(pair, tmp_path / "..", slots=2)
    sender.send(torch.ones(4))
    with pytest.raises(CommError, match=r"protocol error from rank 0 \(metadata\): got a data message"):
        receiver.recv_meta()


def test_a_message_larger_than_a_slot_is_refused(pair, tmp_path) -> None:
    sender, _ = _links(pair, tmp_path, chunk_bytes=4096)
    with pytest.raises(CommError, match=r"a 4100-byte message does not fit a 4096-byte slot of rank 1"):
        sender.send(torch.ones(1025))


_RECORD = struct.Struct("!4sQqB")


def test_a_record_packed_in_its_slot_reads_back_whichever_way_it_was_sent(pair, tmp_path) -> None:
    """``send_record`` / ``recv_record`` and ``send_meta`` / ``recv_meta`` read each other's messages."""
    sender, receiver = _links(pair, tmp_path, slots=2)
    data = torch.arange(7, dtype=torch.int16)
    sender.send_record(_RECORD, (b"p2p1", 5, -3, 9), data)  # packed straight into the slot
    assert receiver.recv_record(_RECORD) == (b"p2p1", 5, -3, 9)
    got = torch.zeros(7, dtype=torch.int16)
    receiver.recv_into(got)
    assert torch.equal(got, data)
    sender.send_meta(_RECORD.pack(b"abcd", 1, 2, 3).ljust(96, b"\0"), data[:0])  # the general way
    assert receiver.recv_record(_RECORD) == (b"abcd", 1, 2, 3)
    receiver.recv_into(torch.empty(0, dtype=torch.int16))
    sender.send_record(_RECORD, (b"wxyz", 2**63 - 1, -(2**63), 255), data)
    assert receiver.recv_meta()[: _RECORD.size] == _RECORD.pack(b"wxyz", 2**63 - 1, -(2**63), 255)
    receiver.recv_into(got)
    strided = torch.arange(14, dtype=torch.int16)[::2]  # not one block of memory: copied by torch
    sender.send_record(_RECORD, (b"strd", 0, 0, 0), strided)
    assert receiver.recv_record(_RECORD) == (b"strd", 0, 0, 0)
    receiver.recv_into(got)
    assert torch.equal(got, strided)
    assert sender.bell.count == receiver.bell.count == 4
    with pytest.raises(CommError, match=r"a 4100-byte message does not fit a 4096-byte slot of rank 1"):
        sender.send_record(_RECORD, (b"big!", 0, 0, 0), torch.ones(1025))


@needs_memfd
def test_a_record_read_in_place_still_retires_regions(pair, tmp_path) -> None:
    sender, receiver = _links(pair, tmp_path, slots=1, can_lend=True)
    region = Region.create_anonymous(64)
    sender.lend(region.data[:16].view(torch.float32), region.id, 0)
    receiver.recv_into(torch.empty(4))
    assert receiver.lent_regions == 1
    sender.retire(region.fd, region.token)
    sender.send_record(_RECORD, (b"gone", 1, 1, 1), torch.ones(2))
    assert receiver.recv_record(_RECORD) == (b"gone", 1, 1, 1)
    assert receiver.lent_regions == 0
    got = torch.zeros(2)
    receiver.recv_into(got)
    assert torch.equal(got, torch.ones(2))
    region.close()


# -------------------------------------------------------------- lent chunks
@needs_memfd
def test_lent_chunks_are_read_in_place_and_returned(pair, tmp_path) -> None:
    sender, receiver = _links(pair, tmp_path, can_lend=True)
    region = Region.create_anonymous(4 * 1000)
    buffer = region.data.view(torch.float32)
    buffer.copy_(torch.arange(1000, dtype=torch.float32))
    sender.lend(buffer[100:300], region.id, 400)
    sender.lend(buffer[300:1000], region.id, 1200)  # larger than a slot: only its header is posted
    got = torch.zeros(200)
    receiver.recv_reduce(got, kernels.reducer(ReduceOp.SUM, torch.float32))
    assert torch.equal(got, torch.arange(100, 300, dtype=torch.float32))
    assert receiver.lent_regions == 1  # mapped once, through /proc/<pid>/fd/<fd>
    returned = threading.Event()

    def wait_returned() -> None:
        sender.wait_returned()
        returned.set()

    thread = threading.Thread(target=wait_returned)
    thread.start()
    _until_asleep(sender.inbox.region.words, CONSUMED_FLAG, thread)  # the second chunk is still lent
    assert not returned.is_set()
    rest = torch.zeros(700)
    receiver.recv_into(rest)
    thread.join(5)
    assert returned.is_set() and torch.equal(rest, torch.arange(300, 1000, dtype=torch.float32))
    region.close()


@needs_memfd
def test_retired_regions_are_announced_one_per_record_and_unmapped(pair, tmp_path) -> None:
    """More regions retire than there are slots: each record carries one, none needs a slot of its own."""
    sender, receiver = _links(pair, tmp_path, slots=1, can_lend=True)
    regions = [Region.create_anonymous(64) for _ in range(3)]
    for region in regions:
        sender.lend(region.data[:16].view(torch.float32), region.id, 0)
        receiver.recv_into(torch.empty(4))
    assert receiver.lent_regions == 3
    for region in regions:
        sender.retire(region.fd, region.token)
    for left in (2, 1, 0, 0):
        sender.send_meta(b"r" * 96)  # with one slot, a separate announcement would block here
        assert receiver.recv_meta() == b"r" * 96
        assert receiver.lent_regions == left
    for region in regions:
        region.close()


@needs_memfd
def test_a_record_can_carry_a_lent_chunk(pair, tmp_path) -> None:
    sender, receiver = _links(pair, tmp_path, slots=1, can_lend=True)
    region = Region.create_anonymous(4 * 100)
    buffer = region.data.view(torch.float32)
    buffer.copy_(torch.arange(100, dtype=torch.float32))
    sender.send_meta(b"m" * 96, buffer[10:20], lent=(region.id, 40))
    assert receiver.recv_meta() == b"m" * 96
    assert sender.bell.peer_count == 0  # the slot stays taken until the chunk is read
    got = torch.ones(10)
    receiver.recv_reduce(got, kernels.reducer(ReduceOp.SUM, torch.float32))
    assert torch.equal(got, torch.arange(10, 20, dtype=torch.float32) + 1)
    sender.wait_returned()  # read: returns at once
    assert receiver.lent_regions == 1
    region.close()


def test_a_link_that_cannot_lend_says_so(pair, tmp_path) -> None:
    sender, _ = _links(pair, tmp_path, can_lend=False)
    with pytest.raises(CommError, match=r"the link to rank 1 cannot lend buffers"):
        sender.lend(torch.ones(4), Region.create_file(str(tmp_path / "r"), 16).id, 0)


@pytest.mark.parametrize("how", ["closed", "aborted"])
def test_a_link_is_ready_when_its_peer_left_between_messages(pair, tmp_path, how: str) -> None:
    """A receive from any source reads only ready links: a peer gone shows there, past its wake bytes."""
    sender, receiver = _links(pair, tmp_path)
    a, _ = pair
    a.sendall(bytes([doorbell.WAKE]) * 3)  # wake bytes alone are no message
    assert not receiver.ready()
    if how == "closed":
        a.close()
    else:
        a.sendall(abort_frame("rank 0 gave up"))
    assert receiver.ready()
    reason = "closed the connection" if how == "closed" else "rank 0 gave up"
    with pytest.raises(PeerFailureError, match=reason):
        receiver.recv_meta()


# ------------------------------------------------------------ shared buffers
@needs_memfd
def test_shared_buffers_are_zeroed_found_by_address_and_retired_with_their_last_view() -> None:
    retired: list[tuple[int, bytes]] = []
    buffers = SharedBuffers(lambda fd, token: retired.append((fd, token)))
    bucket = buffers.alloc(1000, torch.float64)
    assert bucket.dtype == torch.float64 and bucket.shape == (1000,) and not bucket.any()
    whole, part = buffers.find(bucket), buffers.find(bucket[10:20])
    assert whole is not None and part is not None and whole.region == part.region
    assert (whole.offset(bucket), part.offset(bucket[10:20])) == (0, 80)
    assert buffers.find(torch.zeros(1000, dtype=torch.float64)) is None  # ordinary memory
    fd = whole.region.fd
    assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:commlib-ring-buffer")
    view = bucket[500:]
    del bucket
    gc.collect()
    assert not retired and len(buffers) == 1  # a view keeps the buffer
    del view
    gc.collect()
    assert retired == [(fd, whole.region.token)] and len(buffers) == 0
    with pytest.raises(OSError):
        os.fstat(fd)  # the descriptor was closed


@needs_memfd
def test_a_buffer_collected_while_the_registry_is_locked_does_not_deadlock() -> None:
    """The collector may run a buffer's finalizer inside find(); the finalizer must not take the lock."""
    retired: list[int] = []
    buffers = SharedBuffers(lambda fd, token: retired.append(fd))
    holder = [buffers.alloc(100, torch.float32)]
    done = threading.Event()

    def collect_inside_the_lock() -> None:
        with buffers._lock:  # noqa: SLF001 - as if the collector ran inside find()
            holder.clear()
            gc.collect()
        done.set()

    thread = threading.Thread(target=collect_inside_the_lock, daemon=True)
    thread.start()
    thread.join(10)
    assert done.is_set(), "dropping a buffer inside the registry's lock deadlocked"
    assert len(retired) == 1 and len(buffers) == 0


@needs_memfd
def test_a_region_opened_through_proc_shares_the_creators_memory() -> None:
    region = Region.create_anonymous(64)
    other = Region.open_descriptor(os.getpid(), region.fd, 64, region.token)
    region.data[:8] = torch.arange(8, dtype=torch.uint8)
    assert other.data[:8].tolist() == list(range(8))
    with pytest.raises(OSError, match="does not hold the expected token"):
        Region.open_descriptor(os.getpid(), region.fd, 64, b"y" * 16)
    assert region.words.nbytes == HEADER_BYTES
    other.close()
    region.close()


# ------------------------------------------------------------------- kernels
_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64]
_TORCH_OPS = {
    ReduceOp.SUM: torch.add,
    ReduceOp.PRODUCT: torch.mul,
    ReduceOp.MIN: torch.minimum,
    ReduceOp.MAX: torch.maximum,
}


@pytest.mark.parametrize("dtype", _DTYPES)
@pytest.mark.parametrize("numel", [0, 5, kernels.PIECE + 7, 3 * kernels.PIECE])
def test_kernels_match_torch_bit_for_bit(dtype: torch.dtype, numel: int) -> None:
    gen = torch.Generator().manual_seed(numel)
    a = (torch.randn(numel, generator=gen) * 8).to(dtype)
    b = (torch.randn(numel, generator=gen) * 8).to(dtype)
    for op, func in _TORCH_OPS.items():
        out = a.clone()
        kernels.reducer(op, dtype)(out, b)
        assert torch.equal(out, func(a, b)), op
        out = b.clone()
        kernels.combine(op, dtype)(out, a, out)  # out may alias the second operand
        assert torch.equal(out, func(a, b)), op
    copied = torch.empty_like(a)
    kernels.copy(copied, a)
    assert torch.equal(copied, a)
    if dtype.is_floating_point:
        divided = a.clone()
        kernels.divide(divided, 3)
        assert torch.equal(divided, a / 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kernels_give_nan_for_inf_minus_inf_and_warn_nothing_even_when_warnings_are_errors(
    dtype: torch.dtype,
) -> None:
    numel = 2 * kernels.PIECE  # past the small pieces: numpy's loops
    a, b = torch.ones(numel, dtype=dtype), torch.ones(numel, dtype=dtype)
    a[3], b[3], a[4], b[4] = float("inf"), -float("inf"), float("inf"), 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # as python -W error or pytest's filterwarnings = error
        summed, product = a.clone(), a.clone()
        kernels.reducer(ReduceOp.SUM, dtype)(summed, b)
        kernels.reducer(ReduceOp.PRODUCT, dtype)(product, b)
        kernels.divide(product, 3)
    assert torch.equal(summed.isnan(), torch.add(a, b).isnan()) and bool(summed[3].isnan())
    assert bool(product[4].isnan()) and float(product[3]) == -float("inf")


@pytest.mark.parametrize("numel", [16, 65535, 3 * kernels.PIECE])
def test_a_copy_moves_bytes_as_they_are_even_in_bool_tensors(numel: int) -> None:
    packed = (torch.arange(numel, dtype=torch.int64) % 7).to(torch.uint8)  # bytes 2..6 are no canonical bool
    out = torch.empty(numel, dtype=torch.bool)
    kernels.copy(out, packed.view(torch.bool))
    assert torch.equal(out.view(torch.uint8), packed)


def test_a_copy_of_a_strided_or_shorter_tensor_takes_torchs_path() -> None:
    """The one-``memmove`` path is only for contiguous host tensors of equal size."""
    source = torch.arange(64, dtype=torch.float32)
    strided = torch.empty(32)
    kernels.copy(strided, source[::2])
    assert torch.equal(strided, source[::2])
    into_strided = torch.zeros(64)
    kernels.copy(into_strided[::2], source[:32])
    assert torch.equal(into_strided[::2], source[:32]) and not into_strided[1::2].any()
    with pytest.raises(RuntimeError):
        kernels.copy(torch.empty(32), source[:16])  # never reads past the shorter tensor


def test_kernels_never_start_torchs_thread_team() -> None:
    """With torch's default intra-op threads, the kernels run on the calling thread only."""
    script = textwrap.dedent(
        """
        import os, numpy as np, torch
        from backends.common import kernels
        from commlib import ReduceOp
        torch.set_num_threads(2)
        def threads():
            return len(os.listdir("/proc/self/task"))
        def ones(dtype):  # made by NumPy: torch.ones(1 << 20) would start the team itself
            bits = {torch.float16: 0x3C00, torch.bfloat16: 0x3F80}
            if dtype in bits:
                return torch.from_numpy(np.full(1 << 20, bits[dtype], np.int16)).view(dtype)
            return torch.from_numpy(np.ones(1 << 20, str(dtype).removeprefix("torch.")))
        before = threads()
        for dtype in (torch.float32, torch.int64, torch.float16, torch.bfloat16):
            a, b = ones(dtype), ones(dtype)
            kernels.reducer(ReduceOp.SUM, dtype)(a, b)
            kernels.copy(a, b)
            if dtype.is_floating_point:
                kernels.divide(a, 2)
        after = threads()
        a.add_(b)  # torch's own op on as many elements starts the team
        print(before, after, threads())
        """
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    before, after, with_team = map(int, result.stdout.split())
    assert after == before, f"the kernels started {after - before} threads"
    assert with_team > after, "the check cannot fail: torch's add did not start a team either"


def test_numpy_views_of_kernels_write_through() -> None:
    big = torch.zeros(kernels.PIECE * 2, dtype=torch.int32)
    kernels.reducer(ReduceOp.MAX, torch.int32)(big, torch.arange(big.numel(), dtype=torch.int32))
    assert np.array_equal(big.numpy(), np.arange(big.numel(), dtype=np.int32))


def test_a_neighbour_lost_during_link_set_up_leaves_no_shared_memory_files(tmp_path) -> None:
    """The inbox and wake files are unlinked even when set-up fails before the neighbour confirms."""
    import socket
    import threading

    from backends.ring.link_setup import connect_links
    from backends.ring.rendezvous import RingSockets, host_id
    from backends.ring.wire import PeerClosed, SocketReader, recv_json, send_json

    left, left_peer = socket.socketpair()
    right, right_peer = socket.socketpair()
    for sock in (left, right, left_peer, right_peer):
        sock.settimeout(10)

    def neighbour() -> None:
        # As the left neighbour: propose shared memory, read our offer, then vanish.
        send_json(left_peer, {"transport": "auto", "host": host_id(), "pid": 0, "probe": None})
        recv_json(SocketReader(left_peer, "rank 0"), "offer")
        # As the right neighbour: read our proposal, then vanish without an offer.
        recv_json(SocketReader(right_peer, "rank 0"), "proposal")
        left_peer.close()
        right_peer.close()

    thread = threading.Thread(target=neighbour)
    thread.start()
    sockets = RingSockets(
        peers=[], settings={}, right=right, left=left, left_reader=SocketReader(left, "rank 1")
    )
    with pytest.raises(PeerClosed):
        connect_links(
            sockets, 0, 2, transport="auto", chunk_bytes=4096, slots=2, shm_dir=str(tmp_path), prefix=""
        )
    thread.join(10)
    assert list(tmp_path.iterdir()) == []
    left.close()
    right.close()
