"""Links between ranks on one host: message slots in shared memory, doorbells, lent chunks.

- The receiver owns an inbox of ``slots`` message slots, each a 192-byte
  header (kind, sizes, the metadata record) followed by up to ``chunk_bytes``
  of payload, and a control block with two doorbells (``backends.ring.doorbell``):
  the sender's count of messages posted and the receiver's count of messages
  consumed. The sender writes a message into the next free slot and advances
  its count; the receiver polls that count briefly, then sleeps in the kernel,
  reads (or reduces) straight out of the slot and advances its own count,
  which frees the slot. A sleeping end is woken through its wake pipe (a FIFO
  next to the inbox, opened by both ends); the TCP connection between them
  carries aborts and the end-of-file of a peer that died, which wakes a
  sleeping neighbour with an error.
- Lent chunks: a sender whose tensor lives in a shared buffer
  (``backends.ring.shared_buffers``) posts only a header naming the buffer and the
  chunk's offset, and the receiver reads the chunk straight from the sender's
  memory. The sender must not write that memory again until the receiver's
  count shows it has read it (``ShmSendLink.wait_returned``). A buffer that is
  gone is announced in the header of a later metadata message (one per
  message: a separate message could fill the slots of two ranks that both
  announce, each waiting for the other to free one), and the receiver unmaps
  it.
"""

from __future__ import annotations

import collections
import os
import socket
import struct
from typing import Any

import torch

from backends.common import kernels
from backends.common.kernels import Reducer
from backends.ring.doorbell import Doorbell
from backends.ring.links import META_BYTES, RecvLink, SendLink
from backends.ring.shm import HEADER_BYTES, Region, RegionId
from backends.ring.wire import SocketReader
from commlib.errors import CommError, PeerFailureError

__all__ = ["ShmSendLink", "ShmRecvLink", "Inbox", "WakePipes"]

# Control words of an inbox (indices of 64-bit words in its region's header),
# each on its own cache line.
_POSTED = 8  # messages the sender has posted
_RECV_SLEEPING = 16  # the receiver sleeps, waiting for _POSTED
_CONSUMED = 24  # messages the receiver has finished with (their slots are free)
_SEND_SLEEPING = 32  # the sender sleeps, waiting for _CONSUMED
_VERDICT = 40  # point-to-point: the receiver's verdict on a message (number, then 4 words of verdict)
_VERDICT_WORDS = struct.Struct("=5q")  # the five words at _VERDICT, as bytes of the region's mapping

# A slot: a header, then the payload. The header: kind, where a metadata message's payload is
# (_NO_PAYLOAD, _KIND_DATA: in the slot, _KIND_LENT: lent), payload bytes; for a lent chunk its
# offset and region (fd, size, token); a lent region that is gone (fd -1: none; token); then a
# metadata message's record. One pack and one unpack per message.
_SLOT_HEADER = struct.Struct(f"=IIQQqQ16sq16s{META_BYTES}s")
_PAYLOAD_AT = 192
_KIND_META = 1  # a metadata record, maybe with a payload
_KIND_DATA = 2  # a chunk in the slot
_KIND_LENT = 3  # a chunk at `offset` of the sender's region (fd, size, token)
_NO_PAYLOAD = 0
_NOTHING_RETIRED = (-1, b"")
_MAX_VIEWS = 256  # typed views of slot payloads kept per inbox (one per slot, dtype and size)
_KIND_NAMES = {_KIND_META: "metadata", _KIND_DATA: "data", _KIND_LENT: "lent data"}
assert _SLOT_HEADER.size <= _PAYLOAD_AT
# The same header seen by a metadata message whose payload is in the slot and which retires nothing:
# kind, payload, bytes, the lent chunk's fields (unused, zeroed), the retired region's fd (-1). Its
# record, at _RECORD_AT, is packed by the caller's own layout (``send_record`` / ``recv_record``).
_RECORD_SLOT = struct.Struct("=IIQ40xq")
_RECORD_AT = _SLOT_HEADER.size - META_BYTES
assert _RECORD_SLOT.size == _RECORD_AT - 16


class Inbox:
    """A receiver-owned region of ``slots`` message slots, and the control words of the link."""

    def __init__(self, region: Region, slots: int, chunk_bytes: int) -> None:
        self.region = region
        self.slots = slots
        self.chunk_bytes = chunk_bytes
        stride = _PAYLOAD_AT + chunk_bytes
        starts = [i * stride for i in range(slots)]
        self._headers = [HEADER_BYTES + s for s in starts]
        self.payloads = [region.data[s + _PAYLOAD_AT : s + stride] for s in starts]
        self._views: dict[tuple[int, torch.dtype, int], torch.Tensor] = {}

    @staticmethod
    def region_bytes(slots: int, chunk_bytes: int) -> int:
        """Data bytes of the region an inbox of this shape needs."""
        return slots * (_PAYLOAD_AT + chunk_bytes)

    def header_at(self, index: int) -> int:
        """Offset of slot ``index``'s header in the region's mapping."""
        return self._headers[index % self.slots]

    def payload(self, index: int, dtype: torch.dtype, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of slot ``index``'s payload, as ``dtype`` (views are kept for reuse)."""
        key = (index % self.slots, dtype, nbytes)
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= _MAX_VIEWS:
                self._views.clear()
            view = self._views[key] = self.payloads[key[0]][:nbytes].view(dtype)
        return view

    def close(self) -> None:
        """Drop the views of the mapping, so that it can be unmapped."""
        self.payloads = []
        self._views.clear()
        self.region.close()


class WakePipes:
    """The two FIFOs of a shared-memory link: one wakes the receiver, one the sender.

    Both ends open both for reading and writing (never blocking), so neither
    ever sees end-of-file or a broken pipe; the creator unlinks them once the
    other end has opened them.
    """

    def __init__(self, paths: tuple[str, str], *, create: bool) -> None:
        self.paths = paths
        self.fds: list[int] = []
        try:
            for path in paths:
                if create:
                    os.mkfifo(path, 0o600)
                self.fds.append(os.open(path, os.O_RDWR | os.O_NONBLOCK))
        except OSError:
            self.close()
            if create:
                self.unlink()
            raise

    @property
    def receiver(self) -> int:
        """The pipe that wakes the receiver (written by the sender)."""
        return self.fds[0]

    @property
    def sender(self) -> int:
        """The pipe that wakes the sender (written by the receiver)."""
        return self.fds[1]

    def unlink(self) -> None:
        """Remove the pipes' names; the open descriptors stay usable."""
        for path in self.paths:
            try:
                os.unlink(path)
            except OSError:
                pass

    def close(self) -> None:
        """Close both pipe descriptors."""
        for fd in self.fds:
            os.close(fd)
        self.fds = []


class ShmSendLink(SendLink):
    """Writes messages into the right neighbour's inbox, or lends it chunks of a shared buffer."""

    def __init__(
        self,
        sock: socket.socket,
        reader: SocketReader,
        peer: int,
        describe: str,
        inbox: Inbox,
        *,
        spin_s: float = 0.0,
        can_lend: bool = False,
        wake: WakePipes | None = None,
    ) -> None:
        super().__init__(sock, reader, peer, describe)
        self.transport = "shm"
        self.copies_at_once = True
        self.inbox = inbox
        self.chunk_bytes = inbox.chunk_bytes
        self.can_lend = can_lend
        self.wake = wake
        self.bell = Doorbell(
            inbox.region.words,
            mine=_POSTED,
            theirs=_CONSUMED,
            my_flag=_SEND_SLEEPING,
            their_flag=_RECV_SLEEPING,
            reader=reader,
            spin_s=spin_s,
            wake_in=wake.sender if wake is not None else -1,
            wake_out=wake.receiver if wake is not None else -1,
        )
        self._lent_until = 0
        self._retired: collections.deque[tuple[int, bytes]] = collections.deque()

    def _claim(self, nbytes: int, *, lent: bool = False) -> int:
        """Wait for a free slot and return its index (the number of the message it will hold)."""
        bell, inbox = self.bell, self.inbox
        if nbytes > inbox.chunk_bytes and not lent:
            raise CommError(
                f"a {nbytes}-byte message does not fit a {inbox.chunk_bytes}-byte slot of {self.describe}"
            )
        index = bell.count
        bell.wait_for(index + 1 - inbox.slots, "a free slot")
        return index

    def _post(
        self,
        index: int,
        kind: int,
        nbytes: int,
        *,
        payload: int = _NO_PAYLOAD,
        lent: tuple[RegionId, int] | None = None,
        retired: tuple[int, bytes] = _NOTHING_RETIRED,
        record: bytes = b"",
    ) -> None:
        """Write slot ``index``'s header and post the message."""
        region, offset = lent if lent is not None else (None, 0)
        fd, size, token = (region.fd, region.size, region.token) if region is not None else (-1, 0, b"")
        _SLOT_HEADER.pack_into(
            self.inbox.region.map,
            self.inbox.header_at(index),
            kind,
            payload,
            nbytes,
            offset,
            fd,
            size,
            token,
            *retired,
            record,
        )
        self.bell.advance()

    def send_meta(
        self, record: bytes, payload: torch.Tensor | None = None, lent: tuple[RegionId, int] | None = None
    ) -> None:
        """Post one metadata record with its payload in the same message: copied into the slot, or lent.

        The header also names one retired region, if any is waiting to be announced.
        """
        nbytes = 0 if payload is None else payload.nbytes
        lend = lent is not None and self.can_lend
        index = self._claim(nbytes, lent=lend)
        if payload is None:
            where = _NO_PAYLOAD
        elif lend:
            where = _KIND_LENT
        else:
            where = _KIND_DATA
            self._copy_in(index, payload, nbytes)
        retired = self._retired.popleft() if self._retired else _NOTHING_RETIRED
        lent = lent if lend else None
        self._post(index, _KIND_META, nbytes, payload=where, lent=lent, retired=retired, record=record)
        if lend:
            self._lent_until = self.bell.count

    def send_record(self, layout: struct.Struct, fields: tuple[Any, ...], payload: torch.Tensor) -> None:
        """Pack the record straight into the next free slot, copy the payload beside it, post both.

        The short way for what point-to-point sends most: a small message in one slot.
        """
        nbytes = payload.nbytes
        if self._retired or nbytes > self.chunk_bytes or not kernels.is_plain_host(payload):
            super().send_record(layout, fields, payload)
            return
        bell, inbox = self.bell, self.inbox
        index = bell.count
        if index - bell.peer_count >= inbox.slots:
            bell.wait_for(index + 1 - inbox.slots, "a free slot")
        at, region_map = inbox.header_at(index), inbox.region.map
        _RECORD_SLOT.pack_into(region_map, at, _KIND_META, _KIND_DATA, nbytes, -1)
        layout.pack_into(region_map, at + _RECORD_AT, *fields)
        kernels.move_bytes(inbox.payloads[index % inbox.slots], payload, nbytes)
        bell.advance()

    def send(self, chunk: torch.Tensor) -> None:
        """Copy ``chunk`` into the next free slot and post it."""
        nbytes = chunk.nbytes
        index = self._claim(nbytes)
        self._copy_in(index, chunk, nbytes)
        self._post(index, _KIND_DATA, nbytes)

    def _copy_in(self, index: int, chunk: torch.Tensor, nbytes: int) -> None:
        """Copy ``chunk`` into slot ``index`` (``_claim`` checked that it fits)."""
        if kernels.is_plain_host(chunk):
            kernels.move_bytes(self.inbox.payloads[index % self.inbox.slots], chunk, nbytes)
        elif nbytes:
            kernels.copy(self.inbox.payload(index, chunk.dtype, nbytes), chunk)

    def lend(self, chunk: torch.Tensor, region: RegionId, offset: int) -> None:
        """Post where ``chunk`` lies in ``region``; the receiver reads it from there."""
        if not self.can_lend:
            super().lend(chunk, region, offset)
        self._post(self._claim(0, lent=True), _KIND_LENT, chunk.nbytes, lent=(region, offset))
        self._lent_until = self.bell.count

    def wait_returned(self) -> None:
        """Wait until the receiver has consumed every message up to the last lent chunk."""
        self.bell.wait_for(self._lent_until, f"{self.describe} to finish reading this rank's buffer")

    def await_verdict(self, msg: int, what: str) -> tuple[int, ...]:
        """Wait until the receiver has consumed every message posted; read its verdict words.

        The receiver writes them before it consumes the message's last slot, so
        they are final once the counter has passed it.
        """
        self.bell.wait_for(self.bell.count, what)
        words = _VERDICT_WORDS.unpack_from(self.inbox.region.map, _VERDICT * 8)
        if words[0] != msg:
            raise CommError(
                f"protocol error from {self.describe} ({what}): its verdict names message {words[0]}, "
                f"not {msg}"
            )
        return words[1:]

    def retire(self, fd: int, token: bytes) -> None:
        """Tell the receiver, in a coming metadata record, that a lent region is gone (any thread)."""
        self._retired.append((fd, token))

    def close(self, linger: float) -> None:
        """Unmap the inbox and close the connection."""
        self.inbox.close()
        if self.wake is not None:
            self.wake.close()
        super().close(linger)


class ShmRecvLink(RecvLink):
    """Reads messages out of this rank's own inbox, and lent chunks out of the sender's buffers."""

    def __init__(
        self,
        sock: socket.socket,
        reader: SocketReader,
        peer: int,
        describe: str,
        inbox: Inbox,
        *,
        spin_s: float = 0.0,
        peer_pid: int = 0,
        wake: WakePipes | None = None,
    ) -> None:
        super().__init__(sock, reader, peer, describe)
        self.transport = "shm"
        self.inbox = inbox
        self.chunk_bytes = inbox.chunk_bytes
        self.peer_pid = peer_pid
        self.wake = wake
        self.bell = Doorbell(
            inbox.region.words,
            mine=_CONSUMED,
            theirs=_POSTED,
            my_flag=_RECV_SLEEPING,
            their_flag=_SEND_SLEEPING,
            reader=reader,
            spin_s=spin_s,
            wake_in=wake.receiver if wake is not None else -1,
            wake_out=wake.sender if wake is not None else -1,
        )
        self._held: tuple[int, int, int, int, int, bytes] | None = None  # a metadata message's payload
        self._lent: dict[tuple[int, bytes], Region] = {}

    @property
    def lent_regions(self) -> int:
        """How many of the sender's regions this rank has mapped."""
        return len(self._lent)

    def _next(self, what: str) -> tuple[Any, ...]:
        """Wait for the next message and return its header (see ``_SLOT_HEADER``)."""
        bell = self.bell
        bell.wait_for(bell.count + 1, what)
        return _SLOT_HEADER.unpack_from(self.inbox.region.map, self.inbox.header_at(bell.count))

    def _unexpected(self, kind: int, what: str) -> CommError:
        return CommError(
            f"protocol error from {self.describe} ({what}): got a {_KIND_NAMES.get(kind, repr(kind))} "
            "message. The ranks disagree on the sequence of collectives; every rank must issue the same "
            "ones in the same order"
        )

    def recv_meta(self) -> bytes:
        """Receive one metadata record; a payload that came with it is read by the next ``recv_*``."""
        kind, payload, nbytes, offset, fd, size, token, gone_fd, gone_token, record = self._next("metadata")
        if kind != _KIND_META:
            raise self._unexpected(kind, "metadata")
        if gone_fd >= 0:  # a region of the sender's is gone
            region = self._lent.pop((gone_fd, gone_token), None)
            if region is not None:
                region.close()
        if payload == _NO_PAYLOAD:
            self.bell.advance()
        else:
            self._held = (payload, nbytes, offset, fd, size, token)
        return record

    def recv_record(self, layout: struct.Struct) -> tuple[Any, ...]:
        """Unpack the next metadata record with ``layout`` straight out of its slot."""
        bell, inbox = self.bell, self.inbox
        bell.wait_for(bell.count + 1, "metadata")
        at, region_map = inbox.header_at(bell.count), inbox.region.map
        kind, payload, nbytes, gone_fd = _RECORD_SLOT.unpack_from(region_map, at)
        if kind != _KIND_META or payload == _KIND_LENT or gone_fd >= 0:
            return layout.unpack_from(self.recv_meta())  # the general case
        fields = layout.unpack_from(region_map, at + _RECORD_AT)
        if payload == _NO_PAYLOAD:
            bell.advance()
        else:
            self._held = (payload, nbytes, 0, -1, 0, b"")
        return fields

    def _incoming(self, dst: torch.Tensor) -> torch.Tensor:
        """A view of the next chunk, which must have ``dst``'s size and dtype."""
        return self._incoming_lent(dst)[0]

    def _incoming_lent(self, dst: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """A view of the next chunk, and whether it lies in the sender's buffer (lent)."""
        kind, *where = self._chunk_header(dst.nbytes)
        return self._view(dst, kind, *where), kind == _KIND_LENT

    def _view(
        self, like: torch.Tensor, kind: int, offset: int, fd: int, size: int, token: bytes
    ) -> torch.Tensor:
        """The chunk a header describes, as ``like``'s dtype and size: in the slot or the lender's buffer."""
        nbytes = like.nbytes
        if kind == _KIND_DATA:
            return self.inbox.payload(self.bell.count, like.dtype, nbytes)
        return self._lent_region(fd, size, token).data[offset : offset + nbytes].view(like.dtype)

    def _chunk_header(self, expected: int) -> tuple[int, int, int, int, bytes]:
        """The next chunk's kind and where a lent one lies (offset, fd, size, token); check its size."""
        if self._held is not None:
            (kind, nbytes, offset, fd, size, token), self._held = self._held, None
        else:
            kind, _, nbytes, offset, fd, size, token = self._next("data")[:7]
        if nbytes != expected:
            raise CommError(
                f"{self.describe} sent a {nbytes}-byte chunk where this rank expected {expected} bytes; "
                "the ranks disagree on the collective's tensor sizes"
            )
        if kind != _KIND_DATA and kind != _KIND_LENT:
            raise self._unexpected(kind, "data")
        return kind, offset, fd, size, token

    def _lent_region(self, fd: int, size: int, token: bytes) -> Region:
        region = self._lent.get((fd, token))
        if region is None:
            try:
                region = Region.open_descriptor(self.peer_pid, fd, size, token)
            except OSError as e:
                raise PeerFailureError(
                    f"cannot map the shared buffer of {self.describe} ({e}); its process ended?"
                ) from e
            self._lent[(fd, token)] = region
        return region

    def post_verdict(self, msg: int, verdict: tuple[int, int, int, int]) -> None:
        """Write the verdict words; the counter's next advance (fenced) publishes them."""
        _VERDICT_WORDS.pack_into(self.inbox.region.map, _VERDICT * 8, msg, *verdict)

    def take_into(self, msg: int, verdict: tuple[int, int, int, int], dst: torch.Tensor) -> None:
        """Write the verdict and copy the chunk out of its slot in one step, when it lies there."""
        held, nbytes = self._held, dst.nbytes
        if held is None or held[0] != _KIND_DATA or held[1] != nbytes or not kernels.is_plain_host(dst):
            super().take_into(msg, verdict, dst)
            return
        self._held = None
        self.post_verdict(msg, verdict)
        kernels.move_bytes(dst, self.inbox.payloads[self.bell.count % self.inbox.slots], nbytes)
        self.bell.advance()

    def ready(self) -> bool:
        """True if a message is posted (or held) and not yet consumed, or the peer aborted or left.

        The wait that reads an abort or a closed peer raises; a receive from any source that
        only reads ready links learns of it so.
        """
        return self._held is not None or self.bell.peer_count > self.bell.count or self.bell.peer_left()

    def recv_into(self, dst: torch.Tensor) -> None:
        """Copy the next chunk into ``dst``."""
        nbytes = dst.nbytes
        header = self._chunk_header(nbytes)
        # A peer's size is checked against the slot before a memmove reads it.
        if header[0] == _KIND_DATA and nbytes <= self.chunk_bytes and kernels.is_plain_host(dst):
            kernels.move_bytes(dst, self.inbox.payloads[self.bell.count % self.inbox.slots], nbytes)
        else:
            kernels.copy(dst, self._view(dst, *header))
        self.bell.advance()

    def forward(self, like: torch.Tensor, send: SendLink) -> None:
        """Pass the next chunk on straight out of the slot when ``send`` copies it at once."""
        if not send.copies_at_once:
            super().forward(like, send)
            return
        send.send(self._incoming(like))
        self.bell.advance()

    def recv_reduce(self, dst: torch.Tensor, reduce: Reducer) -> None:
        """Reduce the next chunk straight out of the slot (or the sender's buffer) into ``dst``."""
        reduce(dst, self._incoming(dst))
        self.bell.advance()

    def recv_reduce_back(self, dst: torch.Tensor, reduce: Reducer) -> bool:
        """Reduce the next chunk into ``dst``; a lent chunk gets the result written back, while in cache.

        The sender learns that its buffer holds the result when this rank's
        counter passes the chunk (``ShmSendLink.wait_returned``).
        """
        incoming, lent = self._incoming_lent(dst)
        reduce(dst, incoming)
        if lent:
            kernels.copy(incoming, dst)
        self.bell.advance()
        return lent

    def close(self, linger: float) -> None:
        """Unmap the inbox and the sender's buffers, and close the connection."""
        self.inbox.close()
        for region in self._lent.values():
            region.close()
        self._lent.clear()
        if self.wake is not None:
            self.wake.close()
        super().close(linger)
