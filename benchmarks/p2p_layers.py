"""Where a small ring send/recv spends its time: one 2-rank ping-pong through each layer, beside MPICH.

Run (two ranks on one host)::

    mpiexec -n 2 python benchmarks/p2p_layers.py [--size 4K] [--rounds 5] [--iters 3000] [--csv out.csv]

Modes, taking turns in every round:

- ``mpi4py``: ``Comm.Send`` / ``Recv`` of the tensor's NumPy view (the reference);
- ``interface``: ``group.send`` / ``recv``, what users call (checks, diagnosis);
- ``backend``: the ring group's ``_p2p_now``, what ``send`` / ``recv`` call once checked (its lanes;
  no checks, no diagnosis);
- ``links``: the ring's ``PointToPoint.send`` / ``recv`` (the link protocol alone: header, the
  receiver's verdict, the copies through shared memory);
- ``bare``: no library at all, the least a Python process does per message (``_Bare``): a header
  and a ``memmove`` into a shared-memory slot, a counter to post it (fenced as the ring's
  doorbell fences its own), the same back out, and a counter the sender waits on until the
  receiver has taken it, as a send that hears the receiver's verdict must. It bounds what any
  pure-Python protocol could reach here.

Each round times ``--iters`` round trips per mode; printed per mode: the median half round trip
over the rounds [min-max], and its ratio to MPICH's. The layers below the interface are private
APIs, reached here only to measure them.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import commlib  # noqa: E402
from backends.ring.shm import STORES_NEED_FENCE, fence  # noqa: E402
from benchmarks._rows import write_csv  # noqa: E402
from commlib.p2p import P2PRequest  # noqa: E402
from commlib.ports import free_port  # noqa: E402

CSV_COLUMNS = ["size_bytes", "mode", "round", "half_rtt_us"]
_BARE_TIMEOUT_S = 60.0  # the longest a bare-mode rank spins for the other


def _size(text: str) -> int:
    units = {"K": 1024, "M": 1024**2}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def _ping_pong(
    first: bool, send: Callable[..., Any], send_args: tuple, recv: Callable[..., Any], recv_args: tuple
) -> Callable[[int], None]:
    """``n`` round trips: rank 0 sends first, rank 1 answers (the same loop for every mode)."""

    def run(n: int) -> None:
        for _ in range(n):
            if first:
                send(*send_args)
                recv(*recv_args)
            else:
                recv(*recv_args)
                send(*send_args)

    return run


class _Bare:
    """Two ranks' shared-memory slots for the ``bare`` mode: one slot and two counters per sender."""

    _HEADER = struct.Struct("=4sQqQQQB")  # what the ring's header holds
    _SLOT_AT = 4096  # control words in the first page, each on its own cache line

    def __init__(self, comm: Any, rank: int, tensor: torch.Tensor) -> None:
        nbytes = tensor.nbytes
        stride = (256 + nbytes + 4095) // 4096 * 4096
        size = self._SLOT_AT + 2 * stride
        path = None
        if rank == 0:
            fd, path = tempfile.mkstemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
            os.ftruncate(fd, size)
            os.close(fd)
        path = comm.bcast(path, root=0)
        with open(path, "r+b") as file:
            self.map = mmap.mmap(file.fileno(), size)
        comm.Barrier()
        if rank == 0:
            os.unlink(path)
        self.words = memoryview(self.map).cast("q")
        base = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        self.out_at, self.in_at = self._SLOT_AT + rank * stride, self._SLOT_AT + (1 - rank) * stride
        self.out_data, self.in_data = base + self.out_at + 256, base + self.in_at + 256
        self.posted, self.their_posted = 8 + 16 * rank, 8 + 16 * (1 - rank)  # written by each sender
        self.taken, self.their_taken = 16 + 16 * (1 - rank), 16 + 16 * rank  # written by each receiver
        self.rank, self.tensor, self.nbytes, self.sent, self.received = rank, tensor, nbytes, 0, 0

    def send(self) -> None:
        """Post one message and wait until the other rank has taken it."""
        self.sent += 1
        nbytes, words = self.nbytes, self.words
        self._HEADER.pack_into(self.map, self.out_at, b"p2p1", self.sent, 0, nbytes, nbytes // 4, nbytes, 0)
        ctypes.memmove(self.out_data, self.tensor.data_ptr(), nbytes)
        if STORES_NEED_FENCE:  # as the ring's doorbell: a fence before the count where stores reorder
            fence()
        words[self.posted] = self.sent
        fence()
        self._wait(self.their_taken, self.sent, "take message")

    def _wait(self, word: int, count: int, what: str) -> None:
        """Spin until the other rank's counter reaches ``count``, as the ring's doorbell does."""
        words = self.words
        if words[word] >= count:
            return
        deadline = time.perf_counter() + _BARE_TIMEOUT_S
        while words[word] < count:
            if time.perf_counter() > deadline:
                raise TimeoutError(
                    f"p2p_layers bare mode, rank {self.rank}: the other rank did not {what} {count} "
                    f"within {_BARE_TIMEOUT_S:g} s (it stopped, or ran another mode)"
                )

    def recv(self) -> None:
        """Wait for the next message, read its header, copy it out, tell the sender."""
        self.received += 1
        words = self.words
        self._wait(self.their_posted, self.received, "post message")
        self._HEADER.unpack_from(self.map, self.in_at)
        ctypes.memmove(self.tensor.data_ptr(), self.in_data, self.nbytes)
        if STORES_NEED_FENCE:
            fence()
        words[self.taken] = self.received
        fence()


def _modes(group: commlib.IProcessGroup, tensor: torch.Tensor) -> dict[str, Callable[[int], None]]:
    from mpi4py import MPI

    comm, array = MPI.COMM_WORLD, tensor.numpy()
    peer = 1 - group.rank
    first = group.rank == 0
    links = group._peer_links_for("send")  # type: ignore[attr-defined]
    group._peer_links_for("recv")  # type: ignore[attr-defined]
    run = group._p2p_now  # type: ignore[attr-defined]
    labelled = (tensor, peer, 0, "p2p_layers")
    sending, receiving = P2PRequest("send", tensor, peer, 0, 1), P2PRequest("recv", tensor, peer, 0, 1)
    bare = _Bare(comm, group.rank, tensor)

    return {
        "mpi4py": _ping_pong(first, comm.Send, (array, peer), comm.Recv, (array, peer)),
        "interface": _ping_pong(first, group.send, (tensor, peer), group.recv, (tensor, peer)),
        "backend": _ping_pong(first, run, (sending,), run, (receiving,)),
        "links": _ping_pong(first, links.send, labelled, links.recv, labelled),
        "bare": _ping_pong(first, bare.send, (), bare.recv, ()),
    }


def main() -> int:
    """Time every mode, taking turns; print (and write) the half round trips."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="4K", help="bytes per message (default 4K)")
    p.add_argument("--rounds", type=int, default=5, help="rounds; every mode runs once per round (default 5)")
    p.add_argument("--iters", type=int, default=3000, help="round trips per mode and round (default 3000)")
    p.add_argument("--csv", type=Path, default=None, help="write every round's figure here (rank 0)")
    args = p.parse_args()
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if comm.size != 2:
        print(f"p2p_layers: run on 2 ranks (mpiexec -n 2), not {comm.size}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    port = comm.bcast(free_port() if comm.rank == 0 else None, root=0)
    group = commlib.init_process_group("ring", master_port=port)  # rank and size from mpiexec
    size = _size(args.size)
    tensor = torch.zeros(size // 4, dtype=torch.float32)
    modes = _modes(group, tensor)
    for run in modes.values():  # warm up: links opened, caches filled
        run(max(1, args.iters // 10))
    rows, times = [], {name: [] for name in modes}
    for round_ in range(args.rounds):
        for name, run in modes.items():
            group.barrier()
            start = time.perf_counter()
            run(args.iters)
            half_rtt = (time.perf_counter() - start) / args.iters / 2 * 1e6
            times[name].append(half_rtt)
            rows.append({"size_bytes": size, "mode": name, "round": round_, "half_rtt_us": f"{half_rtt:.3f}"})
    if group.rank == 0:
        reference = statistics.median(times["mpi4py"])
        print(f"{size} B ping-pong, half round trip: median of {args.rounds} rounds [min-max], rank 0")
        for name, values in times.items():
            median = statistics.median(values)
            print(
                f"  {name:10s} {median:7.2f} us  [{min(values):.2f}-{max(values):.2f}]  "
                f"{median / reference:5.2f}x MPICH"
            )
        if args.csv is not None:
            write_csv(args.csv, CSV_COLUMNS, rows)
    commlib.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
