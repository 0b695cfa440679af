"""Single-process tests of the error translation: the table function and each backend's table."""

from __future__ import annotations

import pytest
import torch

from backends.common.p2p_protocol import CODES, Mismatch
from backends.mpi import errors as mpi_errors
from backends.ring import errors as ring_errors
from backends.ring.wire import PeerClosed
from backends.torch import errors as torch_errors
from commlib.errors import (
    CommError,
    CommTimeoutError,
    GroupClosedError,
    MessageMismatchError,
    MessageSizeError,
    PeerFailureError,
)
from commlib.translation import FALLBACK, Rule, translate

LABEL = "[rank 0/2] gloo.all_reduce #2 (float32, 100 elements)"

# ----------------------------------------------------------------- the table function


def test_first_matching_rule_wins_by_type_or_substring() -> None:
    rules = (
        Rule(CommTimeoutError, "{label}: late ({first})", types=(TimeoutError,), contains=("too slow",)),
        Rule(PeerFailureError, "{label}: gone", contains=("RESET",)),
        Rule(CommError, "{label}: other: {error}"),
    )
    by_type = translate("op", TimeoutError("waited"), rules)
    by_text = translate("op", RuntimeError("far Too Slow\nsecond line"), rules)
    both = translate("op", RuntimeError("timed: too slow, connection reset"), rules)
    second = translate("op", OSError("Connection reset by peer"), rules)
    default = translate("op", ValueError("x"), rules)
    assert (type(by_type), str(by_type)) == (CommTimeoutError, "op: late (waited)")
    assert (type(by_text), str(by_text)) == (CommTimeoutError, "op: late (far Too Slow)")
    assert type(both) is CommTimeoutError  # order decides between two matching rules
    assert (type(second), str(second)) == (PeerFailureError, "op: gone")
    assert (type(default), str(default)) == (CommError, "op: other: x")


def test_no_matching_rule_applies_the_fallback() -> None:
    error = translate("op", KeyError("k"), (Rule(CommTimeoutError, "{label}", types=(TimeoutError,)),))
    assert (type(error), str(error)) == (FALLBACK.raises, "op: KeyError: 'k'")
    assert str(translate("op", ValueError("v"), ())) == "op: ValueError: v"


def test_fields_line_kind_context_and_rule_fields() -> None:
    rule = Rule(
        CommError,
        "{label}|{first}|{line}|{kind}|{limit:g}|{extra}",
        contains=("marker",),
        fields=lambda error, text: {"extra": text[-6:]},
    )
    error = translate("op", RuntimeError("  head\n  a MARKER here \n"), (rule,), limit=2.0)
    assert str(error) == "op|head|a MARKER here|RuntimeError|2|R here"
    empty = translate("op", RuntimeError(""), (Rule(CommError, "{label}: {first}"),))
    assert str(empty) == "op: RuntimeError"


def test_commlib_errors_pass_through_with_the_label() -> None:
    rules = (Rule(CommError, "{label}: never"),)
    peer = PeerFailureError("rank 1 exited", exited=(1,))
    out = translate("op", peer, rules)
    assert (type(out), str(out), out.exited) == (PeerFailureError, "op: rank 1 exited", (1,))
    closed = translate("op", GroupClosedError("closed"), rules)
    assert (type(closed), str(closed)) == (GroupClosedError, "op: closed")
    assert str(peer) == "rank 1 exited"  # the original is left alone


def test_a_backends_own_subclass_becomes_its_commlib_class() -> None:
    closed = translate("op", PeerClosed("rank 1 closed", 3, 8), ())
    assert (type(closed), str(closed), closed.received) == (PeerFailureError, "op: rank 1 closed", 3)


# ----------------------------------------------------------------- the ring's table


@pytest.mark.parametrize(
    ("error", "kind", "message"),
    [
        (CommTimeoutError("no frame in 2 s"), CommTimeoutError, "op: no frame in 2 s"),
        (TimeoutError("timed out"), CommTimeoutError, "op: timed out"),
        (
            PeerFailureError("rank 1 closed its connection"),
            PeerFailureError,
            "op: rank 1 closed its connection",
        ),
        (CommError("short read"), CommError, "op: short read"),
        (
            ConnectionResetError(104, "Connection reset by peer"),
            CommError,
            "op: [Errno 104] Connection reset by peer",
        ),
    ],
)
def test_ring_table(error: BaseException, kind: type, message: str) -> None:
    out = ring_errors.translate_failure("op", error)
    assert (type(out), str(out)) == (kind, message)


# ----------------------------------------------------------------- torch's table


def test_torch_timeout_by_text_or_type() -> None:
    tail = (
        "did not finish within 2.5 s; a peer rank is missing, stuck or called a different collective. "
        "Raise COMMLIB_TIMEOUT if the peers are just slow. (torch.distributed: "
    )
    by_text = torch_errors.translate(LABEL, RuntimeError("[gloo.cc:81] Timed out waiting 2000ms\nmore"), 2.5)
    by_type = torch_errors.translate(LABEL, TimeoutError(), 2.5)
    assert type(by_text) is CommTimeoutError
    assert str(by_text) == f"{LABEL}: {tail}[gloo.cc:81] Timed out waiting 2000ms)"
    assert str(by_type) == f"{LABEL}: {tail}TimeoutError)"


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("[a.cc:12] Connection closed by peer [127.0.0.1]:18838", " (peer [127.0.0.1]:18838)"),
        ("Broken pipe", ""),
        ("Gloo pair closure", ""),
        ("Connection reset by peer", ""),
    ],
)
def test_torch_peer_failure_names_the_address(text: str, where: str) -> None:
    error = torch_errors.translate(LABEL, RuntimeError(text), 2.0)
    assert type(error) is PeerFailureError
    assert str(error) == (
        f"{LABEL}: a peer process closed its connection{where}; it crashed or exited. Check the other "
        f"ranks' logs; every rank must create a new group. (torch.distributed: {text})"
    )


def test_torch_shared_gpu_and_default() -> None:
    text = "NCCL error in: x.cpp:1\nbad usage\nDuplicate GPU detected : rank 1 and rank 0 both on device 0 "
    shared = torch_errors.translate(LABEL, RuntimeError(text), 2.0)
    assert type(shared) is CommError
    assert str(shared) == (
        f"{LABEL}: NCCL refuses two ranks on one GPU (Duplicate GPU detected : rank 1 and rank 0 both on "
        "device 0). Give each rank a GPU of its own (torch.cuda.set_device(local_rank), one rank per GPU), "
        "or share the GPU over the ring, gloo or mpi backend. (torch.distributed: NCCL error in: x.cpp:1)"
    )
    other = torch_errors.translate(LABEL, RuntimeError("  bad things\nhappened"), 2.0)
    assert (type(other), str(other)) == (CommError, f"{LABEL}: torch.distributed failed: bad things")


def test_torch_message_wait_says_what_never_came() -> None:
    rules = torch_errors.P2P_WAIT_RULES
    late = translate(
        LABEL, RuntimeError("Timed out waiting"), rules, limit=3.0, missing="the size never came"
    )
    assert type(late) is CommTimeoutError
    assert str(late) == (
        f"{LABEL}: the size never came within 3 s; Gloo closed its connection to that rank, so this group is "
        "unusable: every rank must create a new one. (torch.distributed: Timed out waiting)"
    )
    gone = translate(LABEL, RuntimeError("Broken pipe"), rules, limit=3.0, missing="m")
    assert type(gone) is PeerFailureError


# ----------------------------------------------------------------- MPI's table


class _FakeMPI:
    class Exception(Exception):  # noqa: N818 - mpi4py's name
        def Get_error_class(self) -> int:  # noqa: N802 - mpi4py's name
            return 15

        def Get_error_string(self) -> str:  # noqa: N802 - mpi4py's name
            return "Other MPI error\nerror stack:\n"


def test_mpi_exception_names_class_and_string() -> None:
    error = mpi_errors.failure("op", _FakeMPI.Exception(), _FakeMPI)
    assert (type(error), str(error)) == (
        CommError,
        "op: MPI error class 15: Other MPI error; error stack:. Every rank must call the same collectives in "
        "the same order, with tensors of the same size and dtype.",
    )
    other = mpi_errors.failure("op", BufferError("not contiguous"), _FakeMPI)
    assert (type(other), str(other)) == (CommError, "op: BufferError: not contiguous")


def test_mpi_mismatch_names_both_layouts() -> None:
    sent, holds = (40, 10, CODES[torch.float32]), (80, 20, CODES[torch.float32])
    error = mpi_errors.failure("op", Mismatch("recv", 1, 7, sent, holds), _FakeMPI)
    assert isinstance(error, MessageSizeError) and isinstance(error, MessageMismatchError)
    assert str(error).startswith("op: ") and "rank 1" in str(error)


@pytest.mark.parametrize(
    ("error", "kind", "first"),
    [
        (RuntimeError("Socket Timeout\nsecond line"), "RendezvousTimeoutError", "Socket Timeout"),
        (RuntimeError("connect() timed out."), "RendezvousTimeoutError", "connect() timed out."),
        (RuntimeError("Connection refused\nwhile waiting: timeout"), "RendezvousError", "Connection refused"),
        (RuntimeError(""), "RendezvousError", "RuntimeError"),
    ],
)
def test_a_torch_set_up_failure_is_a_rendezvous_error_named_by_its_first_line(
    error: BaseException, kind: str, first: str
) -> None:
    made = torch_errors.setup_failure(error, lambda text: f"[rank 0/2] gloo.new_group: failed ({text})")
    assert type(made).__name__ == kind
    assert str(made) == f"[rank 0/2] gloo.new_group: failed ({first})"
