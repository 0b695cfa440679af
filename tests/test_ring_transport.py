"""Single-process tests of the ring's transport over socket pairs: framing, short reads, closes, aborts."""

from __future__ import annotations

import re
import select
import socket
import threading
import time

import pytest
import torch

from backends.ring import RingConfig, records, wire
from backends.ring.links import TcpRecvLink, TcpSendLink
from backends.ring.shm import Region
from backends.ring.shm_links import Inbox, ShmRecvLink, ShmSendLink
from backends.ring.wire import (
    PeerClosed,
    SocketReader,
    connect_with_retry,
    is_self_connected,
    recv_json,
    send_json,
)
from commlib import CommTimeoutError, PeerFailureError
from commlib.ports import free_port


@pytest.fixture
def pair():  # type: ignore[no-untyped-def]
    a, b = socket.socketpair()
    a.settimeout(5)
    b.settimeout(5)
    yield a, b
    a.close()
    b.close()


def test_json_frames_round_trip(pair) -> None:
    a, b = pair
    send_json(a, {"rank": 3, "peers": [1, 2]})
    send_json(a, {"second": True})
    reader = SocketReader(b, "rank 1")
    assert recv_json(reader, "hello") == {"rank": 3, "peers": [1, 2]}
    assert recv_json(reader, "hello") == {"second": True}


def test_peer_closing_mid_message_reports_the_byte_counts(pair) -> None:
    a, b = pair
    a.sendall(b"12345")
    a.close()
    reader = SocketReader(b, "rank 2 (left neighbour)")
    with pytest.raises(
        PeerClosed, match=r"rank 2 \(left neighbour\) closed the connection after 5/8 bytes \(data\)"
    ) as info:
        reader.readinto_exact(memoryview(bytearray(8)), "data")
    assert (info.value.received, info.value.expected) == (5, 8)


def test_a_silent_peer_times_out_with_the_wait_named(pair) -> None:
    _, b = pair
    b.settimeout(0.05)
    with pytest.raises(CommTimeoutError, match=r"timed out after 0\.1 s waiting for rank 1 \(metadata\)"):
        SocketReader(b, "rank 1").read_byte("metadata")


def test_spinning_reader_still_blocks_until_data_arrives(pair) -> None:
    a, b = pair
    reader = SocketReader(b, "rank 1", spin_s=20e-6)
    threading.Timer(0.05, lambda: a.sendall(b"X")).start()
    assert reader.read_byte("token") == ord("X")


def test_the_spin_polls_a_socket_with_a_timeout_without_waiting_for_it(pair) -> None:
    """Before each wait in the kernel a reader polls for ``spin_s``; on a socket with a timeout too."""
    a, b = pair
    reader = SocketReader(b, "rank 1", spin_s=1e-3)
    assert reader._poll(1) is None  # nothing there: back after the spin, not the socket's 5 s
    a.sendall(b"X")
    assert reader._poll(1) == b"X"


def _slow_reader(sock: socket.socket, total: int, pause_s: float) -> threading.Thread:
    def read() -> None:
        left = total
        while left:
            time.sleep(pause_s)  # a receiver that reads slowly, never stopping for a whole timeout
            view = bytearray(min(left, 1 << 20))
            got = memoryview(view)
            while len(got):
                n = sock.recv_into(got)
                got = got[n:]
                left -= n

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def test_a_tcp_send_times_out_on_no_progress_not_on_the_whole_transfer(pair) -> None:
    a, b = pair
    a.settimeout(1.0)
    sender = TcpSendLink(a, SocketReader(a, "rank 1"), 1, "rank 1", chunk_bytes=1 << 20)
    chunks = 4  # read one MiB each 0.4 s: 1.6 s in all, longer than the 1 s timeout
    for _ in range(chunks):
        sender.send(torch.ones(1 << 18))
    reader = _slow_reader(b, chunks * ((1 << 20) + 9), 0.4)  # 9 bytes of frame header each
    sender.flush()
    reader.join(10)
    assert not reader.is_alive()
    sender.shutdown()


def test_a_tcp_send_no_one_reads_raises_a_timeout(pair) -> None:
    a, _ = pair
    a.settimeout(0.3)
    sender = TcpSendLink(a, SocketReader(a, "rank 1"), 1, "rank 1", chunk_bytes=8 << 20)
    sender.send(torch.ones(2 << 20))  # 8 MiB: more than the socket's buffers
    with pytest.raises(CommTimeoutError, match=r"sending to rank 1.*it stopped reading"):
        sender.flush()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_tcp_link_moves_and_reduces_chunks(pair, dtype: torch.dtype) -> None:
    a, b = pair
    sender = TcpSendLink(a, SocketReader(a, "rank 1"), 1, "rank 1", chunk_bytes=4096)
    receiver = TcpRecvLink(b, SocketReader(b, "rank 0"), 0, "rank 0", chunk_bytes=4096)
    data = torch.arange(100).to(dtype)
    sender.send_meta(b"m" * 96, data[:10])
    sender.send(data)
    sender.send(data)
    assert receiver.recv_meta() == b"m" * 96
    small = torch.empty(10, dtype=dtype)
    receiver.recv_into(small)
    got = torch.empty(100, dtype=dtype)
    receiver.recv_into(got)
    total = torch.ones(100, dtype=dtype)
    receiver.recv_reduce(total, lambda dst, src: dst.add_(src))
    sender.flush()
    assert torch.equal(small, data[:10]) and torch.equal(got, data) and torch.equal(total, data + 1)
    sender.shutdown()


def test_tcp_link_rejects_a_chunk_of_the_wrong_size(pair) -> None:
    a, b = pair
    sender = TcpSendLink(a, SocketReader(a, "rank 1"), 1, "rank 1", chunk_bytes=4096)
    receiver = TcpRecvLink(b, SocketReader(b, "rank 0"), 0, "rank 0", chunk_bytes=4096)
    sender.send(torch.ones(12))
    sender.flush()
    with pytest.raises(Exception, match=r"rank 0 sent a 48-byte chunk where this rank expected 40 bytes"):
        receiver.recv_into(torch.empty(10))
    sender.shutdown()


def _inbox_pair(path: str, slots: int, chunk_bytes: int) -> tuple[Inbox, Inbox]:
    """The receiver's inbox and the sender's mapping of it, as two ranks would hold them."""
    size = Inbox.region_bytes(slots, chunk_bytes)
    mine = Region.create_file(path, size)
    theirs = Region.open_path(path, size, mine.token)
    mine.unlink()
    return Inbox(mine, slots, chunk_bytes), Inbox(theirs, slots, chunk_bytes)


def test_shm_link_moves_chunks_through_slots_with_flow_control(pair, tmp_path) -> None:
    a, b = pair
    inbox, remote = _inbox_pair(str(tmp_path / "inbox"), slots=2, chunk_bytes=4096)
    sender = ShmSendLink(a, SocketReader(a, "rank 1"), 1, "rank 1", remote)
    receiver = ShmRecvLink(b, SocketReader(b, "rank 0"), 0, "rank 0", inbox)
    chunks = [torch.full((1024,), float(i)) for i in range(6)]  # 3x more chunks than slots

    def send_all() -> None:
        for c in chunks:
            sender.send(c)

    thread = threading.Thread(target=send_all)
    thread.start()
    out = torch.zeros(1024)
    for _ in range(6):
        receiver.recv_reduce(out, lambda dst, src: dst.add_(src))
    thread.join(5)
    assert not thread.is_alive()
    assert torch.all(out == sum(range(6)))


def test_abort_frame_is_raised_with_the_reason(pair, tmp_path) -> None:
    a, b = pair
    sender = TcpSendLink(a, SocketReader(a, "rank 1"), 1, "rank 1", chunk_bytes=4096)
    receiver = TcpRecvLink(
        b, SocketReader(b, "rank 0 (left neighbour)"), 0, "rank 0 (left neighbour)", chunk_bytes=4096
    )
    sender.abort("rank 0 gave up: peer 3 died")
    with pytest.raises(
        PeerFailureError,
        match=r"rank 0 \(left neighbour\) aborted the collective \(data\): rank 0 gave up: peer 3 died",
    ):
        receiver.recv_into(torch.empty(4))
    sender.shutdown()


def test_an_abort_waits_for_the_frame_in_flight_and_the_peer_reads_both_whole(pair) -> None:
    """A rank gives up while its sender thread is half-way through a chunk no one reads yet.

    The abort goes after that chunk, never inside it: the receiver, reading later, gets the
    chunk intact and then the reason.
    """
    a, b = pair
    a.settimeout(30)
    sender = TcpSendLink(a, SocketReader(a, "rank 1"), 1, "rank 1", chunk_bytes=16 << 20)
    receiver = TcpRecvLink(
        b, SocketReader(b, "rank 0 (left neighbour)"), 0, "rank 0 (left neighbour)", chunk_bytes=16 << 20
    )
    chunk = torch.arange(4 << 20, dtype=torch.float32)  # 16 MiB: more than the socket's buffers
    sender.send(chunk)
    sender.send(torch.zeros(16))  # queued behind: dropped once the link aborts
    assert select.select([b], [], [], 10)[0]  # the chunk is being written: it fills the buffers, then waits
    sender.abort("rank 0 gave up: peer 3 died")  # returns after its bounded wait: nobody reads yet
    out = torch.empty_like(chunk)
    receiver.recv_into(out)
    assert torch.equal(out, chunk)
    with pytest.raises(
        PeerFailureError, match=r"aborted the collective \(data\): rank 0 gave up: peer 3 died"
    ):
        receiver.recv_into(torch.empty(16))


def test_a_send_that_fails_because_the_peer_left_names_the_reason_the_peer_wrote(pair) -> None:
    """The peer gave up, wrote why on this link, and ended: the broken pipe is reported as that abort."""
    from backends.ring.doorbell import abort_frame

    a, b = pair
    sender = TcpSendLink(
        a, SocketReader(a, "rank 1 (right neighbour)"), 1, "rank 1 (right neighbour)", 1 << 20
    )
    b.sendall(abort_frame("rank 1 gave up: timed out waiting for rank 0"))
    b.close()
    with pytest.raises(PeerFailureError) as failed:
        for _ in range(64):  # the first writes may land in the kernel before it notices the peer is gone
            sender.send(torch.ones(1 << 18))
            sender.flush()
    assert re.match(
        r"rank 1 \(right neighbour\) aborted the collective \((send|flush)\): rank 1 gave up: timed out",
        str(failed.value),
    ), failed.value


def test_shm_region_refuses_a_wrong_token_or_size(tmp_path) -> None:
    region = Region.create_file(str(tmp_path / "inbox"), 4096)
    with pytest.raises(OSError, match="does not hold the expected token"):
        Region.open_path(region.path, 4096, b"x" * 16)
    with pytest.raises(OSError, match=r"has 8192 bytes, expected 12288"):
        Region.open_path(region.path, 8192, region.token)
    region.unlink()
    region.close()


def test_ring_config_validates_and_reads_the_environment() -> None:
    with pytest.raises(
        ValueError, match=r"RingConfig\.chunk_bytes: must be a multiple of 64 and at least 4096, got 100"
    ):
        RingConfig(chunk_bytes=100)
    with pytest.raises(
        ValueError, match=r"RingConfig\.transport: expected 'auto', 'shm' or 'tcp', got 'udp'"
    ):
        RingConfig(transport="udp")  # type: ignore[arg-type]
    config = RingConfig.from_env(
        {
            "COMMLIB_RING_TRANSPORT": "TCP",
            "COMMLIB_RING_CHUNK_BYTES": "65600",
            "COMMLIB_RING_SMALL_BYTES": "0",
        }
    )
    assert (config.transport, config.chunk_bytes, config.small_bytes) == ("tcp", 65600, 0)
    with pytest.warns(RuntimeWarning, match=r"COMMLIB_RING_TRANSPORT: unexpected value 'udp'"):
        assert RingConfig.from_env({"COMMLIB_RING_TRANSPORT": "udp"}).transport == "auto"


def test_an_unusable_shm_dir_warns_and_the_default_is_used(tmp_path) -> None:
    assert RingConfig.from_env({"COMMLIB_RING_SHM_DIR": str(tmp_path)}).shm_dir == str(tmp_path)
    missing, a_file = tmp_path / "missing", tmp_path / "file"
    a_file.write_text("")
    for value, why in ((missing, "not a directory"), (a_file, "not a directory")):
        with pytest.warns(RuntimeWarning, match=rf"COMMLIB_RING_SHM_DIR: unexpected value .*\({why}\)"):
            assert RingConfig.from_env({"COMMLIB_RING_SHM_DIR": str(value)}).shm_dir is None


def _self_connected_socket() -> socket.socket:
    """A socket connected to itself: bound to a port nobody listens on, then connected to it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", free_port()))
    sock.connect(sock.getsockname())  # TCP simultaneous open with itself
    return sock


def test_a_socket_connected_to_itself_is_recognised() -> None:
    sock = _self_connected_socket()
    try:
        assert is_self_connected(sock)
    finally:
        sock.close()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        with socket.create_connection(listener.getsockname(), timeout=5) as client:
            assert not is_self_connected(client)
    with socket.socket() as unconnected:
        assert not is_self_connected(unconnected)


def test_connect_retries_when_a_connect_joins_itself(monkeypatch) -> None:
    """A self-connected attempt (the destination port handed out as source) is dropped and retried."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    real_connect = socket.create_connection
    attempts: list[socket.socket] = []

    def connect(address, timeout=None):  # type: ignore[no-untyped-def]
        sock = _self_connected_socket() if not attempts else real_connect(address, timeout=timeout)
        attempts.append(sock)
        return sock

    monkeypatch.setattr(wire.socket, "create_connection", connect)
    try:
        sock = connect_with_retry("127.0.0.1", port, time.monotonic() + 10, "rank 0")
        with sock:
            assert len(attempts) == 2
            assert attempts[0].fileno() == -1, "the self-connected socket was not closed"
            assert sock is attempts[1] and sock.getpeername()[1] == port
    finally:
        listener.close()


def test_connect_gives_up_at_the_deadline_naming_the_self_connection(monkeypatch) -> None:
    monkeypatch.setattr(
        wire.socket, "create_connection", lambda address, timeout=None: _self_connected_socket()
    )
    with pytest.raises(
        TimeoutError, match=r"could not connect to rank 0 at 127\.0\.0\.1:\d+: .*connected to itself"
    ):
        connect_with_retry("127.0.0.1", 1, time.monotonic() + 0.3, "rank 0")


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8, torch.bool, torch.float64])
def test_an_all_to_all_payload_carries_counts_and_a_block_exactly(dtype: torch.dtype) -> None:
    counts = [0, 5, -1, 2**40, 3]
    block = (torch.arange(24) % 3).to(dtype)
    payload = records.pack_counts(counts, block)
    assert payload.dtype is torch.uint8 and payload.numel() == 8 * len(counts) + block.nbytes
    assert records.read_counts(payload.view(dtype), len(counts), 1) == counts
    into = torch.zeros_like(block)
    records.read_carried(payload, len(counts), into, 1)
    assert torch.equal(into, block)
    assert records.read_counts(records.pack_counts(counts), len(counts), 1) == counts
    with pytest.raises(ValueError, match=f"rank 1's {payload.nbytes - 1}-byte record does not hold 5 split"):
        records.read_carried(payload[:-1], len(counts), into, 1)
    with pytest.raises(ValueError, match="rank 2's 39-byte record does not hold 5 split sizes$"):
        records.read_counts(payload[:39], len(counts), 2)
