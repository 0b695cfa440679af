"""Multi-host faults for real: ranks on separate "hosts" (network namespaces), a link cut mid-collective.

Each rank runs in a network namespace of its own, with its own address on a
bridge and its own hostname (``tests/_netns.py``), so the ring links over TCP
between the addresses as it would between machines; the rendezvous crosses the
bridge too, with a job token. Mid-collective, the test takes one host's
interface down: no packet says goodbye, as when a cable or switch port dies.
Every rank must raise within its timeout and name the peer it lost.

On the ring, commlib names it from its own links. On gloo, the error wraps
Gloo's own, which says only that a send or receive timed out, not with whom;
there the survivors' stall reports (``COMMLIB_STALL_S`` below the timeout) name
the rank that stopped answering over the side channel.

Skipped, with the reason shown, where namespaces cannot be created (not root,
no iproute2, a container without the capability).
"""

from __future__ import annotations

import functools
import logging
import multiprocessing
import os
import socket
import threading
import time
from typing import Any

import pytest
import torch

from tests import _netns
from tests._launcher import run_ranks_outcomes

pytestmark = [pytest.mark.multiprocess, pytest.mark.waits]

TIMEOUT_S = 2.0
SLACK_S = 3.0
"""Past the timeout: the failing rank's abort notice to its other neighbour may wait up to 1 s on a full
send buffer, and a loaded machine schedules late."""
NUMEL = 2_000_000
"""8 MB all-reduces: each takes milliseconds, so the cut lands inside one."""
GLOO_TIMEOUT_S = 3.0
GLOO_STALL_TIMEOUT_S = 5.0
"""Room before the timeout for a stall report: 1 s stall, up to 2 s for the ranks' answers."""


@functools.cache
def _unavailable() -> str | None:
    return _netns.unavailable_reason()


@pytest.fixture
def hosts_available() -> None:
    reason = _unavailable()
    if reason is not None:
        pytest.skip(f"separate hosts need network namespaces: {reason}")


def _remote_addresses() -> list[str]:
    """Remote addresses of this process's established TCP connections, in its current namespace."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    remote = []
    with open("/proc/self/net/tcp") as f:
        next(f)
        for fields in (line.split() for line in f):
            if fields[3] == "01" and fields[9] in inodes:  # ESTABLISHED, ours
                hex_ip = fields[2].split(":")[0]
                remote.append(socket.inet_ntoa(bytes.fromhex(hex_ip)[::-1]))
    return remote


class _Warnings(logging.Handler):
    """The ``commlib`` logger's warnings, with when they came."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: list[tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append((time.monotonic(), record.getMessage()))


def _all_reduce_until_cut(
    backend: str, namespace: str, hostname: str, start: Any, running: Any
) -> dict[str, Any]:
    """On its own host: join the group, all-reduce until the link is cut, report the error and when."""
    _netns.enter_host(namespace, hostname)
    import commlib

    warnings = _Warnings()
    logging.getLogger("commlib").addHandler(warnings)
    start.wait(60)  # every rank has imported torch: the short timeout only has the cut to time
    group = commlib.init_process_group(backend)
    report: dict[str, Any] = {
        "transports": getattr(group, "transports", None),
        "hostname": socket.gethostname(),
    }
    t = torch.ones(NUMEL)
    group.all_reduce(t)
    report["peers_at"] = sorted(set(_remote_addresses()))
    report["first_sum"] = t[0].item()
    running.set()
    try:
        while True:
            t.fill_(1.0)
            group.all_reduce(t)
    except commlib.CommError as e:
        report.update(raised_at=time.monotonic(), error=str(e), error_type=type(e).__name__)
    finally:
        report["warnings"] = warnings.seen
        commlib.destroy_process_group()
    return report


def _run_and_cut(
    hosts: _netns.Hosts,
    victim: int,
    backend: str = "ring",
    timeout_s: float = TIMEOUT_S,
    stall_s: float = 0.0,
) -> tuple[list[dict[str, Any]], float]:
    world = len(hosts.namespaces)
    spawn = multiprocessing.get_context("spawn")
    start = spawn.Barrier(world)
    running = [spawn.Event() for _ in range(world)]
    cut_at: list[float] = []

    def cut_when_all_run() -> None:
        if all(event.wait(120) for event in running):
            cut_at.append(time.monotonic())
            hosts.cut(victim)

    cutter = threading.Thread(target=cut_when_all_run, daemon=True)
    cutter.start()
    outcomes = run_ranks_outcomes(
        _all_reduce_until_cut,
        world,
        backend=backend,
        init=False,
        per_rank_args=[
            (backend, hosts.namespaces[r], hosts.hostnames[r], start, running[r]) for r in range(world)
        ],
        env={
            "MASTER_ADDR": hosts.addresses[0],
            "COMMLIB_TIMEOUT": str(timeout_s),
            "COMMLIB_JOB_TOKEN": "netns-test-job",
            "COMMLIB_STALL_S": str(stall_s),
            # Gloo finds its address from the hostname, which no resolver here knows: name the interface,
            # as on a machine with several.
            "GLOO_SOCKET_IFNAME": "eth0",
            "LOCAL_RANK": "0",  # one rank per host
            "LOCAL_WORLD_SIZE": "1",
        },
        timeout=150,
    )
    cutter.join(5)
    for o in outcomes:
        assert o.ok, f"rank {o.rank}: {o.error}\n{o.traceback}"
    assert cut_at, "the ranks never all ran, so no link was cut"
    return [o.value for o in outcomes], cut_at[0]


def _check_separate_hosts(reports: list[dict[str, Any]], hosts: _netns.Hosts) -> None:
    world = len(reports)
    for rank, report in enumerate(reports):
        assert report["first_sum"] == world
        assert report["hostname"] == hosts.hostnames[rank]
        assert report["transports"] == ("tcp", "tcp"), "the ring took the other hosts for this one"
        others = {hosts.addresses[(rank - 1) % world], hosts.addresses[(rank + 1) % world]}
        assert set(report["peers_at"]) == others, report["peers_at"]


def _check_gloo_across_hosts(reports: list[dict[str, Any]], hosts: _netns.Hosts) -> None:
    """Every rank on its own host, connected to every other host's address (and never over loopback)."""
    for rank, report in enumerate(reports):
        assert report["first_sum"] == len(reports)
        assert report["hostname"] == hosts.hostnames[rank]
        others = set(hosts.addresses) - {hosts.addresses[rank]}
        assert others <= set(report["peers_at"]), report["peers_at"]
        assert set(report["peers_at"]) <= set(hosts.addresses), report["peers_at"]


def _check_raised_in_time(
    report: dict[str, Any],
    rank: int,
    world: int,
    cut_at: float,
    backend: str = "ring",
    timeout_s: float = TIMEOUT_S,
) -> None:
    assert report["error"].startswith(f"[rank {rank}/{world}] {backend}.all_reduce #"), report["error"]
    elapsed = report["raised_at"] - cut_at
    assert elapsed < timeout_s + SLACK_S, (
        f"rank {rank} raised {elapsed:.1f} s after the cut: {report['error']}"
    )


def _check_gloo_timeout(report: dict[str, Any], timeout_s: float) -> None:
    """What a survivor on gloo is told: the timeout ran out, in Gloo's own words (which name no peer)."""
    assert report["error_type"] == "CommTimeoutError", report["error"]
    expected = f"did not finish within {timeout_s:g} s; a peer rank is missing, stuck or called a"
    assert expected in report["error"], report["error"]
    assert "(torch.distributed: " in report["error"], report["error"]
    # Gloo words it by where its wait ran out: a pair's receive names the milliseconds, the
    # collective's own deadline says only that it timed out.
    gloo_words = (f"Timed out waiting {timeout_s * 1000:.0f}ms for ", "Operation timed out!")
    assert any(words in report["error"] for words in gloo_words), report["error"]


@pytest.mark.timeout(240)
def test_the_link_cut_between_two_hosts_is_named_by_both(hosts_available: None) -> None:
    with _netns.separate_hosts(2) as hosts:
        reports, cut_at = _run_and_cut(hosts, victim=1)
        _check_separate_hosts(reports, hosts)
    for rank, report in enumerate(reports):
        _check_raised_in_time(report, rank, 2, cut_at)
        assert report["error_type"] == "CommTimeoutError"
        assert (
            f"timed out after {TIMEOUT_S:.1f} s waiting for rank {1 - rank} (left neighbour)"
            in report["error"]
        )


@pytest.mark.timeout(240)
def test_a_host_cut_off_from_a_ring_of_three(hosts_available: None) -> None:
    """Host 2 loses its link. Rank 0 receives from it and names it; rank 2 names the neighbour it waited for.

    Rank 1 only sends to rank 2, so it hears of the loss from rank 0's abort notice (which names rank 2),
    unless its own wait on rank 0 expires first: then it names rank 0, the neighbour that went quiet.
    """
    with _netns.separate_hosts(3) as hosts:
        reports, cut_at = _run_and_cut(hosts, victim=2)
        _check_separate_hosts(reports, hosts)
    for rank, report in enumerate(reports):
        _check_raised_in_time(report, rank, 3, cut_at)
    assert f"timed out after {TIMEOUT_S:.1f} s waiting for rank 2 (left neighbour)" in reports[0]["error"]
    assert f"timed out after {TIMEOUT_S:.1f} s waiting for rank 1 (left neighbour)" in reports[2]["error"]
    relayed = "rank 0 (left neighbour) aborted the collective" in reports[1]["error"]
    assert (relayed and "waiting for rank 2 (left neighbour)" in reports[1]["error"]) or (
        f"timed out after {TIMEOUT_S:.1f} s waiting for rank 0 (left neighbour)" in reports[1]["error"]
    ), reports[1]["error"]


def test_no_namespace_is_left_behind(hosts_available: None) -> None:
    """Namespaces go also when the body fails half-way."""
    with pytest.raises(RuntimeError, match="half-way"), _netns.separate_hosts(2) as hosts:
        created = list(hosts.namespaces) + [hosts.switch]
        raise RuntimeError("the test body failed half-way")
    assert not set(created) & set(os.listdir("/var/run/netns"))


@pytest.mark.timeout(240)
def test_gloo_link_cut_between_two_hosts_times_out_on_both(hosts_available: None) -> None:
    """Gloo across two hosts: both raise when the group's timeout runs out after the cut.

    Gloo's error says which operation timed out (a send or a receive), not with whom;
    with two ranks the peer is the other one.
    """
    with _netns.separate_hosts(2) as hosts:
        reports, cut_at = _run_and_cut(hosts, victim=1, backend="gloo", timeout_s=GLOO_TIMEOUT_S)
        _check_gloo_across_hosts(reports, hosts)
    for rank, report in enumerate(reports):
        _check_raised_in_time(report, rank, 2, cut_at, "gloo", GLOO_TIMEOUT_S)
        _check_gloo_timeout(report, GLOO_TIMEOUT_S)
        assert report["warnings"] == [], "COMMLIB_STALL_S=0 reports no stall"


@pytest.mark.timeout(240)
def test_gloo_host_cut_off_from_three_is_named_by_the_stall_reports(hosts_available: None) -> None:
    """Host 2 loses its link; ranks 0 and 1, still joined over the side channel, warn that rank 2 went silent.

    The warning comes before the timeout's error. Rank 2 cannot reach rank 0's hub: only its error tells it.
    Ranks 0 and 1 time out within moments of each other; the one that does so second may first learn
    that the other closed its connection (it raised and left), and says so.
    """
    with _netns.separate_hosts(3) as hosts:
        reports, cut_at = _run_and_cut(
            hosts, victim=2, backend="gloo", timeout_s=GLOO_STALL_TIMEOUT_S, stall_s=1.0
        )
        _check_gloo_across_hosts(reports, hosts)
    timed_out = []
    for rank, report in enumerate(reports):
        _check_raised_in_time(report, rank, 3, cut_at, "gloo", GLOO_STALL_TIMEOUT_S)
        other_survivor = hosts.addresses[1 - rank] if rank in (0, 1) else None
        if other_survivor is not None and report["error_type"] == "PeerFailureError":
            assert f"a peer process closed its connection (peer [{other_survivor}]:" in report["error"]
            continue
        _check_gloo_timeout(report, GLOO_STALL_TIMEOUT_S)
        timed_out.append(rank)
    assert 2 in timed_out and len(timed_out) >= 2, "a survivor must have timed out before the other left"
    for rank in (0, 1):
        report = reports[rank]
        stalls = [(at, text) for at, text in report["warnings"] if "has waited" in text]
        assert stalls, f"rank {rank} logged no stall report: {report['warnings']}"
        at, text = stalls[0]
        assert cut_at < at < report["raised_at"], "the stall report came after the error"
        assert text.startswith(f"[rank {rank}/3] gloo.all_reduce #"), text
        assert f"(float32 ({NUMEL},) SUM) has waited " in text, text
        assert "(COMMLIB_STALL_S=1); it goes on waiting until the timeout (5 s" in text, text
        assert "Ranks that did not answer: rank 2 (no answer within 2 s (unreachable, hung" in text, text
        assert "rank 0 (" not in text and "rank 1 (" not in text, "a rank that answered was named"
