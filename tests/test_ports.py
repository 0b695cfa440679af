"""commlib.ports: MASTER_PORT candidates outside the kernel's ephemeral range."""

from __future__ import annotations

import socket

import pytest

from commlib import ports


def test_reads_the_kernel_range_and_falls_back_to_linux_defaults(tmp_path) -> None:
    good = tmp_path / "range"
    good.write_text("40000\t50000\n")
    assert ports.ephemeral_port_range(str(good)) == (40000, 50000)
    for text in ("garbage", "50000 40000", "0 10"):
        bad = tmp_path / "bad"
        bad.write_text(text)
        assert ports.ephemeral_port_range(str(bad)) == (32768, 60999), text
    assert ports.ephemeral_port_range(str(tmp_path / "missing")) == (32768, 60999)


def test_ports_are_distinct_bindable_and_outside_the_ephemeral_range() -> None:
    low, high = ports.ephemeral_port_range()
    picked = ports.free_ports(8)
    assert len(set(picked)) == 8
    for port in picked:
        assert not low <= port <= high, (port, low, high)
        assert port >= 20000
        with socket.socket() as s:  # free now: rank 0 can listen on it
            s.bind(("127.0.0.1", port))


def test_a_port_is_not_handed_out_twice_by_one_process() -> None:
    seen = [ports.free_port() for _ in range(200)]
    assert len(set(seen)) == 200


def test_a_port_in_use_is_skipped(monkeypatch) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", ports.free_port()))
        busy.listen(1)
        taken = busy.getsockname()[1]
        monkeypatch.setattr(ports, "_candidates", lambda ephemeral: [taken, taken + 1])
        monkeypatch.setattr(ports, "_handed_out", set())
        assert ports.free_ports(1) == [taken + 1]


def test_falls_back_to_kernel_ports_when_the_range_covers_everything(monkeypatch) -> None:
    monkeypatch.setattr(ports, "ephemeral_port_range", lambda: (1024, 65535))
    picked = ports.free_ports(2)
    assert len(set(picked)) == 2 and all(0 < p < 65536 for p in picked)


def test_count_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="count must be >= 1, got 0"):
        ports.free_ports(0)


def test_a_port_from_a_key_is_outside_the_ephemeral_range_and_the_same_for_every_caller() -> None:
    low, high = ports.ephemeral_port_range()
    derived = [ports.port_from_key(pid) for pid in range(1, 5000, 7)]
    assert derived == [ports.port_from_key(pid) for pid in range(1, 5000, 7)]
    assert all(20000 <= p < 65536 and not low <= p <= high for p in derived)
    assert len(set(derived)) == len(derived)  # distinct keys below the candidate count get distinct ports


def test_a_port_from_a_key_falls_back_when_the_range_covers_everything(monkeypatch) -> None:
    monkeypatch.setattr(ports, "ephemeral_port_range", lambda: (1024, 65535))
    assert ports.port_from_key(12345) == 20000 + 12345 % 20000
