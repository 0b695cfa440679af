"""Point-to-point over a torch.distributed backend: dtype and size checked first, a lane per peer and tag.

Gloo aborts the process when a message does not fit its receive buffer, and
lands another dtype's bytes as they are, so the data never travels before the
receiver has checked the message's dtype and size. One send to rank ``D`` with
tag ``T`` is three messages on the pair (torch tags ``3T``, ``3T+1``, ``3T+2``;
commlib tags stop at ``max_tag``, so these fit Gloo's 31 bits):

- header, sender -> receiver: int64 ``(MAGIC, bytes, elements, dtype code)``;
- verdict, receiver -> sender: int64 ``(TAKEN or REFUSED, bytes, elements,
  dtype code)`` of the receive's tensor: TAKEN when dtype and bytes agree;
- data, sender -> receiver: the tensor's bytes, only after TAKEN (none if empty).

The protocol itself (the header's layout, the verdict, the errors of a
mismatch) is ``backends.common.p2p_protocol``'s; Gloo's tagged send and receive
carry it, and this module's lanes drive it.

A dtype or size mismatch therefore raises ``MessageMismatchError``
(``MessageSizeError`` when the sizes differ) on both sides, naming both, and
leaves the pair in step: the group goes on. A receive from any rank posts its
header receive on any source; the header names the sender.

Matching: a message goes to the earliest issued receive that accepts it (its
tag; its source, or any source), the protocol's rule (``PostedReceives``). Gloo
matches headers itself, and gives one to a receive posted from its source before
one posted from any source, whichever came first. So Gloo gets the header
receives of the uncovered receives only (``PostedReceives.uncovered``: no
receive issued before has the tag and accepts all their sources), in the order
issued; the others reach Gloo when the receives covering them have their
headers. Of the receives Gloo holds, at most one from a source and one from any
source accept a message, and the one from its source, when held, was issued
first: Gloo's choice is the protocol's.

Order: one lane (``commlib.lanes``: a thread that lives while it has work) runs
the operations of each (send or recv, peer, tag) one after the other. Gloo completes a send only
once the peer has posted the matching receive, so a second header from one
sender can only be matched after its first data: messages between one pair
with one tag arrive in the order sent. Different lanes run at once, so sends
and receives never wait for each other (two ranks may send to each other in
one batch).

Timeouts: every message waits at most the group's timeout (Gloo's own). A send
whose receive never comes raises ``CommTimeoutError`` naming the peer and the
tag; Gloo then closes its connection to that peer, so the group is marked
unusable (every rank must create a new one).

Closing (``close()``, ``destroy_process_group``): the operations in flight
were issued before it, so sends get until the group's timeout to be received;
a send whose receiver never comes, and every receive still waiting then, fails
with ``GroupClosedError``. To end those waits, ``close`` times out one empty
receive of its own, at once, and Gloo closes the group's connections. A lane
must not be left inside a Gloo wait: one that returns while the interpreter
exits aborts the process ("terminate called without an active exception").
A receive from any rank is the one wait closing the connections does not end;
``close`` waits for it (Gloo bounds it by the timeout), saying so.

CUDA tensors travel through host memory over Gloo (the group's CPU backend).
"""

from __future__ import annotations

import datetime
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from backends.common.p2p_protocol import (
    MAGIC,
    TAKEN,
    PostedReceives,
    check_answer,
    check_header,
    layout_of,
    mismatch,
    verdict,
)
from backends.torch.errors import P2P_WAIT_RULES
from commlib.errors import CommError, CommTimeoutError, GroupClosedError, MessageMismatchError
from commlib.lanes import Lanes
from commlib.translation import translate
from commlib.work import CollectiveLabel, EventWork, Work

__all__ = ["P2PEngine"]

CLOSING_TAG = 3 * ((1 << 24) + 1) + 2
"""The torch tag of ``close``'s own receive: above all that operations use (``3 * (max_tag + 1) + 2``)."""

_EXIT_GRACE_S = 5.0
"""How long ``close`` waits for the lanes to leave Gloo once the connections are closed."""

_log = logging.getLogger(__name__)


class _Receive:
    """An issued receive: what matching reads (``wanted``, ``tag``), and Gloo's receive of its header."""

    __slots__ = ("failure", "handle", "header", "tag", "wanted")

    def __init__(self, wanted: int | None, tag: int) -> None:
        self.wanted = wanted
        """The source asked for (None: any)."""
        self.tag = tag
        self.header = torch.empty(4, dtype=torch.int64)
        self.handle: Any = None
        """Gloo's receive of the header, once posted (``P2PEngine._post_headers``)."""
        self.failure: Exception | None = None
        """Why posting it failed."""


class P2PEngine:
    """Sends and receives of one group over its CPU torch backend.

    Args:
        backend: The torch (Gloo) backend object: ``send``, ``recv``, ``recv_anysource``.
        timeout: The group's timeout, named in messages.
        mark_broken: Called with the error after a timeout or a lost peer (Gloo closed the pair).
        name: Names the lane threads (``commlib-<name>-<key>``).
    """

    def __init__(
        self,
        backend: Any,
        timeout: float,
        mark_broken: Callable[[BaseException], None],
        name: str,
    ) -> None:
        self._backend = backend
        self._timeout = timeout
        self._mark_broken = mark_broken
        self._lanes = Lanes(name, bound_s=3 * timeout + 30.0)
        self._lock = threading.Lock()
        self._open: dict[EventWork, tuple[str, int | None]] = {}
        """The works not finished yet: ``send`` or ``recv``, and the peer (None: any rank)."""
        self._closed = False
        self._posted: PostedReceives[_Receive] = PostedReceives()
        """The receives whose header has not come yet, in the order issued (under ``_lock``)."""
        self._headers_posted = threading.Condition(self._lock)
        """Notified when header receives are handed to Gloo, and at close."""

    def send(self, tensor: torch.Tensor, dst: int, tag: int, label: CollectiveLabel) -> Work:
        """Start a send of flat ``tensor``; the work completes once the receiver has the data."""
        work = self._open_work(label, tensor, "send", dst)
        self._lanes.post(("send", dst, tag), lambda: self._run(work, self._send, tensor, dst, tag))
        return work

    def recv(self, tensor: torch.Tensor, src: int | None, tag: int, label: CollectiveLabel) -> Work:
        """Start a receive into flat ``tensor`` from ``src`` (None: any rank)."""
        work = self._open_work(label, tensor, "recv", src)
        receive = _Receive(src, tag)
        with self._lock:
            self._posted.post(receive)
            self._post_headers()
        self._lanes.post(("recv", src, tag), lambda: self._run(work, self._recv, tensor, receive))
        return work

    def _post_headers(self) -> None:
        """Hand Gloo the header receives of the uncovered receives, in the order issued (holding ``_lock``).

        Gloo gives a message to a receive from its source before one from any source, so
        given only these it matches as ``PostedReceives`` does (see the module's docstring).
        """
        backend = self._backend
        for receive in self._posted.uncovered():
            if receive.handle is None and receive.failure is None:
                try:
                    if receive.wanted is None:
                        receive.handle = backend.recv_anysource([receive.header], 3 * receive.tag)
                    else:
                        receive.handle = backend.recv([receive.header], receive.wanted, 3 * receive.tag)
                except Exception as e:  # noqa: BLE001 - raised by the receive's own step
                    receive.failure = e
        self._headers_posted.notify_all()

    def close(self, prefix: str, close_connections: bool) -> None:
        """Finish or fail every operation in flight within the timeout, and leave no lane inside Gloo.

        Sends get until the group's timeout to be received (every operation
        does, where the connections are not this group's alone); then whatever
        is still open fails with ``GroupClosedError``, and Gloo's connections are
        closed, which ends the lanes' waits (see the module's docstring).

        Args:
            prefix: ``[rank R/N] gloo.close: ``, for messages.
            close_connections: The Gloo backend is this group's alone, and goes with it.
        """
        if close_connections:
            self._lanes.wait_idle(self._timeout, lambda key: key[0] == "send")
        else:
            self._lanes.wait_idle(self._timeout)
        with self._lock:
            works, self._open = self._open, {}
            self._closed = True
            self._headers_posted.notify_all()
        if not works:
            return
        for work, (kind, peer) in works.items():
            work._settle(GroupClosedError(f"{work.label}: {self._unfinished(kind, peer)}"))  # noqa: SLF001
        if close_connections:
            self._close_connections()
            self._lanes.wait_idle(_EXIT_GRACE_S, lambda key: key[1] is not None)
        left = self._lanes.busy_keys()
        if left:
            _log.warning(
                "%s%s still waiting in Gloo, which ends %s within %g s; closing waits for %s, as a Gloo "
                "wait that ends while the interpreter exits aborts the process",
                prefix,
                ", ".join(
                    f"a {kind} {'from any rank' if peer is None else f'with rank {peer}'} (tag {tag})"
                    for kind, peer, tag in left
                ),
                "them" if len(left) > 1 else "it",
                self._timeout,
                "them" if len(left) > 1 else "it",
            )
            self._lanes.wait_idle(self._timeout + _EXIT_GRACE_S)

    def _unfinished(self, kind: str, peer: int | None) -> str:
        if kind == "send":
            return (
                f"the group was closed with this send in flight, and rank {peer} did not receive it "
                f"within the group's timeout ({self._timeout:g} s); the data may not have arrived"
            )
        source = "any rank" if peer is None else f"rank {peer}"
        return f"the group was closed while this recv was waiting; nothing came from {source}"

    def _close_connections(self) -> None:
        """Time out an empty receive of this engine's own at once: Gloo then closes every connection."""
        if self._backend.size() < 2:
            return
        peer = 1 if self._backend.rank() == 0 else 0
        try:
            handle = self._backend.recv([torch.empty(1, dtype=torch.uint8)], peer, CLOSING_TAG)
            handle.wait(datetime.timedelta(milliseconds=1))
        except Exception:  # noqa: BLE001, S110 - the timeout is the point
            pass

    def _open_work(
        self, label: CollectiveLabel, tensor: torch.Tensor, kind: str, peer: int | None
    ) -> EventWork:
        work = EventWork(label, bound_s=3 * self._timeout + 30.0, keep_alive=tensor)
        with self._lock:
            self._open[work] = (kind, peer)
        return work

    def _run(self, work: EventWork, step: Callable[..., None], *args: Any) -> None:
        with self._lock:
            if self._closed:
                return  # ``close`` failed it already
        try:
            self._step(work, step, *args)
        finally:
            with self._lock:
                self._open.pop(work, None)

    def _step(self, work: EventWork, step: Callable[..., None], *args: Any) -> None:
        try:
            step(work, *args)
        except MessageMismatchError as e:
            work._settle(e)  # noqa: SLF001 - the pair is in step: the group goes on
        except CommError as e:
            self._broken(e)
            work._settle(e)  # noqa: SLF001
        except Exception as e:  # noqa: BLE001 - every failure becomes the work's error
            error = CommError(f"{work.label}: {type(e).__name__}: {e}")
            error.__cause__ = e
            self._broken(error)
            work._settle(error)  # noqa: SLF001
        else:
            work._settle()  # noqa: SLF001

    def _broken(self, error: CommError) -> None:
        with self._lock:
            closed = self._closed
        if not closed:  # a failure that closing caused does not break a group
            self._mark_broken(error)

    def _send(self, work: EventWork, tensor: torch.Tensor, dst: int, tag: int) -> None:
        label, backend = work.label, self._backend
        data = tensor.view(torch.uint8)
        if data.device.type != "cpu":
            data = data.cpu()
        mine = layout_of(tensor)
        header = torch.tensor([MAGIC, *mine], dtype=torch.int64)
        self._wait(backend.send([header], dst, 3 * tag), label, f"rank {dst} posted no matching recv")
        answer = torch.empty(4, dtype=torch.int64)
        self._wait(backend.recv([answer], dst, 3 * tag + 1), label, f"rank {dst} did not answer")
        check_answer(answer.tolist(), label, dst, mine)
        if mine[0]:
            self._wait(backend.send([data], dst, 3 * tag + 2), label, f"rank {dst} took no data")

    def _recv(self, work: EventWork, tensor: torch.Tensor, receive: _Receive) -> None:
        label, backend, src, tag = work.label, self._backend, receive.wanted, receive.tag
        try:
            handle = self._header_receive(receive, label)
            handle.wait()
        except CommError:
            raise
        except Exception as e:  # noqa: BLE001 - every torch failure becomes a CommError
            source = "any rank" if src is None else f"rank {src}"
            raise self._failed(label, e, f"no message from {source}") from e
        finally:
            with self._lock:  # matched (or failed): the receives it covered get their header receives
                self._posted.withdraw(receive)
                self._post_headers()
        if src is None:
            src = int(handle._source_rank())  # noqa: SLF001 - torch's name for it
        header = receive.header
        sent = check_header(header.tolist(), label, src)
        holds = layout_of(tensor)
        answer = verdict(tag, sent, tag, holds)
        reply = torch.tensor([answer, *holds], dtype=torch.int64)
        self._wait(backend.send([reply], src, 3 * tag + 1), label, f"rank {src} took no answer")
        work._set_source(src)  # noqa: SLF001
        if answer != TAKEN:
            raise mismatch(label, "recv", src, sent, holds)
        if not holds[0]:
            return
        data = tensor.view(torch.uint8)
        host = data if data.device.type == "cpu" else torch.empty(holds[0], dtype=torch.uint8)
        self._wait(backend.recv([host], src, 3 * tag + 2), label, f"the data from rank {src} never came")
        if host is not data:
            data.copy_(host)
            torch.cuda.current_stream(data.device).synchronize()

    def _header_receive(self, receive: _Receive, label: object) -> Any:
        """Gloo's receive of the header, once the receives issued before that cover this one are matched."""
        with self._lock:
            self._headers_posted.wait_for(
                lambda: receive.handle is not None or receive.failure is not None or self._closed,
                timeout=self._timeout,
            )
            if receive.failure is not None:
                raise receive.failure
            if receive.handle is None:
                if self._closed:
                    raise GroupClosedError(f"{label}: {self._unfinished('recv', receive.wanted)}")
                raise CommTimeoutError(
                    f"{label}: no message within {self._timeout:g} s: a recv issued before it, with tag "
                    f"{receive.tag}, that takes the same messages still waits"
                )
            return receive.handle

    def _wait(self, handle: Any, label: object, missing: str) -> None:
        """Wait for Gloo's ``handle``; a failure raises ``_failed``'s error."""
        try:
            handle.wait()
        except Exception as e:  # noqa: BLE001 - every torch failure becomes a CommError
            raise self._failed(label, e, missing) from e

    def _failed(self, label: object, error: Exception, missing: str) -> CommError:
        """A failed wait of a message, for people: what never came (``missing``), or Gloo's failure."""
        return translate(label, error, P2P_WAIT_RULES, limit=self._timeout, missing=missing)
