"""Tests of ``commlib.lanes``: order, the inline fast path, works, threads, close, keyed lanes."""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any

import pytest

from commlib import GroupClosedError
from commlib.lanes import Lane, Lanes
from tests._listeners import wait_until


def test_a_lane_runs_inline_when_idle_and_in_order_behind_queued_work() -> None:
    lane = Lane("test", bound_s=30)
    order: list[str] = []
    gate = threading.Event()
    inline = lane.submit(
        "inline", lambda: threading.current_thread().name, False, on_value=lambda w, v: order.append(v)
    )
    assert order == [threading.current_thread().name]
    assert lane.idle
    first = lane.submit("first", lambda: (gate.wait(10), order.append("first")), True)
    second = lane.submit("second", lambda: order.append("second"), False)  # queued behind: not inline
    assert not lane.idle
    gate.set()
    first.wait()
    second.wait()
    assert order[1:] == ["first", "second"] and inline.is_completed()
    lane.close()


def test_a_lane_call_returns_the_value_inline_or_behind_queued_work_and_raises_its_error() -> None:
    lane = Lane("test", bound_s=30)
    here = threading.current_thread().name
    assert lane.call("inline", lambda a, b: (a + b, threading.current_thread().name), 2, 3) == (5, here)
    gate = threading.Event()
    order: list[str] = []
    lane.submit("first", lambda: (gate.wait(10), order.append("first")), True)
    with concurrent.futures.ThreadPoolExecutor(1) as caller:
        queued = caller.submit(
            lane.call, "queued", lambda: (order.append("call"), threading.current_thread().name)
        )
        wait_until(lambda: not lane.idle and lane._inflight == 2, 10, "the call to queue behind the first op")
        gate.set()
        _, thread = queued.result(timeout=10)
    assert order == ["first", "call"] and thread.startswith("commlib-test") and lane.idle

    def fail() -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        lane.call("failing", fail)
    held = threading.Event()
    lane.submit("busy", lambda: held.wait(10), True)
    with concurrent.futures.ThreadPoolExecutor(1) as caller:
        behind = caller.submit(lane.call, "failing behind", fail)
        wait_until(lambda: lane._inflight == 2, 10, "the failing call to queue behind the busy op")
        held.set()
        with pytest.raises(ValueError, match="boom"):
            behind.result(timeout=10)
    lane.close()


def test_a_lane_hands_errors_and_values_to_the_work() -> None:
    lane = Lane("test", bound_s=30)
    values: list[Any] = []

    def fail() -> None:
        raise ValueError("boom")

    work = lane.submit("failing", fail, True)
    with pytest.raises(ValueError, match="boom"):
        work.wait()
    work = lane.submit("value", lambda: 7, True, on_value=lambda w, v: values.append(v))
    work.wait()
    assert values == [7]
    lane.close()


def test_a_lane_thread_starts_on_first_queued_op_and_knows_itself() -> None:
    lane = Lane("test", bound_s=30)
    assert not lane.on_own_thread() and lane.idle and not lane.busy
    lane.submit("inline", lambda: None, False)
    assert lane._thread is None  # inline ops start no thread
    mine = lane.call("queued", lambda: None)  # idle: inline too
    assert mine is None and lane._thread is None
    values: list[Any] = []
    lane.submit("own", lambda: lane.on_own_thread(), True, on_value=lambda w, v: values.append(v)).wait()
    assert values == [True] and not lane.on_own_thread()
    assert lane.close(10) and lane._thread is not None and not lane._thread.is_alive()


def test_a_closed_lane_runs_what_was_queued_and_refuses_more() -> None:
    lane = Lane("test", bound_s=30)
    gate = threading.Event()
    order: list[str] = []
    first = lane.submit("first", lambda: (gate.wait(10), order.append("first")), True)
    second = lane.submit("second", lambda: order.append("second"), True)
    assert not lane.close(0)  # not waited for: the thread is still in ``first``
    with pytest.raises(GroupClosedError, match="third: the process group was closed"):
        lane.submit("third", lambda: None, True)
    with pytest.raises(GroupClosedError):
        lane.post(lambda: None)
    gate.set()
    first.wait()
    second.wait()
    assert order == ["first", "second"]
    assert lane.close(10)


def test_a_lane_that_does_not_linger_ends_its_thread_when_drained_and_starts_another() -> None:
    lane = Lane("test", bound_s=30, linger=False)
    names: list[str] = []
    threads: list[threading.Thread] = []
    lane.post(lambda: threads.append(threading.current_thread()))
    assert lane.wait_idle(10)
    wait_until(lambda: not threads[0].is_alive(), 10, "the drained lane's thread to end")
    lane.post(lambda: names.append(threading.current_thread().name))
    lane.post(lambda: names.append(threading.current_thread().name))
    assert lane.wait_idle(10) and names == ["commlib-test", "commlib-test"]
    assert lane.close(10)


def test_a_lane_that_lingers_for_a_while_keeps_its_thread_between_steps_then_ends_it() -> None:
    lane = Lane("test", bound_s=30, linger=1.0)
    threads: list[threading.Thread] = []
    for _ in range(3):  # back to back: one thread
        lane.post(lambda: threads.append(threading.current_thread()))
        assert lane.wait_idle(10)
    assert len(set(threads)) == 1
    wait_until(lambda: not threads[0].is_alive(), 10, "the idle lane's thread to end")
    work = lane.submit("after", lambda: threads.append(threading.current_thread()), async_op=True)
    work.wait()
    assert threads[-1] is not threads[0]  # a new thread took the next step
    assert lane.close(10) and not threads[-1].is_alive()


def test_a_failing_posted_step_is_logged_and_the_lane_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    lane = Lane("test", bound_s=30)

    def fail() -> None:
        raise ValueError("boom")

    order: list[int] = []
    lane.post(fail)
    lane.post(lambda: order.append(1))
    assert lane.wait_idle(10) and order == [1]
    assert "commlib-test: a queued step failed" in caplog.text and "boom" in caplog.text
    assert lane.close(10)


def test_wait_idle_times_out_while_busy() -> None:
    lane = Lane("test", bound_s=30)
    gate = threading.Event()
    lane.submit("held", lambda: gate.wait(10), True)
    assert not lane.wait_idle(0.05) and lane.busy
    gate.set()
    assert lane.wait_idle(10) and lane.close(10)


def test_keyed_lanes_run_each_key_in_order_and_keys_at_once() -> None:
    lanes = Lanes("test", bound_s=30)
    gate = threading.Event()
    order: list[str] = []
    lanes.post("a", lambda: (gate.wait(10), order.append("a1")))
    lanes.post("a", lambda: order.append("a2"))
    lanes.post("b", lambda: order.append("b"))  # not behind key a
    assert lanes.wait_idle(10, lambda key: key == "b") == [] and order == ["b"]  # key a still waits
    assert lanes.busy_keys() == ["a"] and lanes.wait_idle(0.05, lambda key: key == "a") == ["a"]
    gate.set()
    assert lanes.wait_idle(10) == [] and order == ["b", "a1", "a2"]


def test_keyed_lanes_drop_idle_lanes() -> None:
    lanes = Lanes("test", bound_s=30)
    for key in range(200):
        lanes.post(key, lambda: None)
        assert lanes.wait_idle(10, lambda k, key=key: k == key) == []
    assert len(lanes._lanes) <= 64


def test_close_waits_at_most_its_timeout_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    lane = Lane("test", bound_s=30)
    gate = threading.Event()
    held = lane.submit("held", lambda: gate.wait(10), True)
    assert not lane.close(0.05)
    assert "commlib-test: the lane's thread did not finish what was queued within 0.05 s" in caplog.text
    gate.set()
    held.wait()
    assert lane.close(10)


def test_a_lane_is_busy_until_its_work_is_settled_and_a_callback_may_issue_on_it() -> None:
    """What a finished work's callbacks issue is ordered before what is issued once the lane is idle."""
    lane = Lane("test", bound_s=30)
    order: list[str] = []
    in_callback, release, started = threading.Event(), threading.Event(), threading.Event()
    work = lane.submit("first", lambda: (started.wait(10), order.append("first")), True)

    def callback(_: Any) -> None:
        in_callback.set()
        release.wait(10)
        lane.submit("from the callback", lambda: order.append("callback, queued"), True)
        # A synchronous op on the lane's own thread runs there, not behind the step that waits for it.
        lane.submit("sync in the callback", lambda: order.append("callback, inline"), False)

    work.get_future().then(callback)  # before the op ends: the callback runs on the lane's thread
    started.set()
    assert in_callback.wait(10)
    assert not lane.wait_idle(0.05), "idle while the work's callback still runs"
    release.set()
    assert lane.wait_idle(10)
    assert order == ["first", "callback, inline", "callback, queued"]
    lane.close()


def test_a_failing_callback_is_logged_and_the_lane_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    lane = Lane("test", bound_s=30)
    gate = threading.Event()
    first = lane.submit("first", lambda: gate.wait(10), True)

    def explode(_: Any) -> None:
        raise RuntimeError("observer failed")

    first.add_observer(explode)
    second = lane.submit("second", lambda: 5, True)
    gate.set()
    first.wait(timeout=10)  # settled although its observer failed
    second.wait(timeout=10)  # and the lane went on
    assert first.is_completed() and second.is_completed() and lane.wait_idle(10)
    assert "an observer of the finished work failed" in caplog.text
    lane.close()


def test_a_thread_that_cannot_start_leaves_the_lane_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    lane = Lane("test", bound_s=30, linger=False)

    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    with monkeypatch.context() as patched:
        patched.setattr(threading.Thread, "start", refuse)
        with pytest.raises(RuntimeError, match="can't start"):
            lane.post(lambda: None)
    assert lane.idle and lane._thread is None
    ran = threading.Event()
    lane.post(ran.set)
    assert ran.wait(10) and lane.wait_idle(10)
    assert lane.close()
