"""Spawn real ranks on loopback for multi-process tests.

Two ways to run a test body on N ranks:

- ``run_ranks(fn, world_size, backend=...)`` spawns fresh processes, runs
  ``fn(group, *args)`` on each with a connected group, and returns the values
  (or raises ``RanksFailed`` describing every rank that failed). Fault tests use
  ``run_ranks_outcomes`` to look at each rank's exit instead.
- ``RankPool`` keeps N ranks (and their group) alive across many calls, so a
  large test matrix pays the start-up (importing torch) once.

Every wait has a deadline; every child is killed on the way out. A rank still
running at the deadline first prints every thread's Python stack (faulthandler,
on SIGUSR1) into a file; the stacks go into the failure report, so a hang in CI
says where each rank was stuck.
Test bodies must be module-level functions (spawned children import them).
"""

from __future__ import annotations

import dataclasses
import faulthandler
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

from commlib.ports import free_port

_CTX = multiprocessing.get_context("forkserver")
_CTX.set_forkserver_preload(
    ["torch", "torch._dynamo", "commlib", "backends.ring.group", "backends.torch.group", "ddp"]
)
"""Ranks are forked from a server that imported torch and commlib once (a fresh interpreter each
costs about 2 s of CPU, most of the suite's time; a rank's first optimizer imports ``torch._dynamo``,
almost as much again). Each rank still gets the parent's environment as it is when the rank starts,
as a spawned one would (``_process_env``)."""

EXIT_GRACE_S = 30.0
"""How long a rank that has reported may take to exit before it is killed and counted as failed."""


def rank_env(
    rank: int, world_size: int, port: int, backend: str | None, extra: Mapping[str, str] | None
) -> dict[str, str]:
    """Environment of one spawned rank, as torchrun would set it."""
    env = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
    }
    if backend is not None:
        env["COMMLIB_BACKEND"] = backend
    env.update(extra or {})
    return env


@dataclasses.dataclass
class RankOutcome:
    """How one spawned rank ended."""

    rank: int
    value: Any = None
    error: str | None = None  # "ExceptionType: message"
    error_type: str | None = None
    traceback: str | None = None
    exitcode: int | None = None
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None and not self.timed_out and self.exitcode in (0, None)


class RanksFailed(AssertionError):
    """One or more ranks failed; the message has every rank's error and traceback."""


_STACKS_VAR = "COMMLIB_TEST_STACKS_FILE"
"""Where a spawned rank writes its threads' stacks when the parent sends SIGUSR1."""
_stacks_file: Any = None  # kept open in the child for faulthandler


def _process_env(extra: Mapping[str, str]) -> dict[str, str]:
    """The whole environment of a rank: this process's as it is now, with ``extra`` on top."""
    return {**os.environ, **extra}


def _apply_env(env: Mapping[str, str]) -> None:
    global _stacks_file
    os.environ.clear()  # the fork server's environment is as old as the server: take the parent's
    os.environ.update(env)
    if env.get(_STACKS_VAR) and hasattr(signal, "SIGUSR1"):
        _stacks_file = open(env[_STACKS_VAR], "w")  # noqa: SIM115 - open for the process's life
        faulthandler.register(signal.SIGUSR1, file=_stacks_file, all_threads=True)
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))


class _StackDumps:
    """One stacks file per rank, and the SIGUSR1 that fills it before a stuck rank is killed."""

    def __init__(self, world_size: int) -> None:
        self._dir = tempfile.mkdtemp(prefix="commlib-stacks-")
        self.paths = [os.path.join(self._dir, f"rank{r}.txt") for r in range(world_size)]

    def env(self, rank: int) -> dict[str, str]:
        return {_STACKS_VAR: self.paths[rank]}

    def collect(self, procs: list[Any], ranks: list[int], outcomes: list[RankOutcome]) -> None:
        """Ask each stuck rank for its stacks and put them in its outcome's traceback."""
        if not hasattr(signal, "SIGUSR1"):
            return
        asked = [r for r in ranks if procs[r].is_alive()]
        for r in asked:
            try:
                os.kill(procs[r].pid, signal.SIGUSR1)
            except OSError:
                continue
        deadline = time.monotonic() + 3.0
        for r in asked:
            text = self._read_when_written(self.paths[r], deadline)
            if text:
                outcomes[r].traceback = f"Python stacks of rank {r} when it was killed:\n{text}"

    @staticmethod
    def _read_when_written(path: str, deadline: float) -> str:
        size = -1
        while time.monotonic() < deadline:  # faulthandler writes from its signal handler; wait until it stops
            now = os.path.getsize(path) if os.path.exists(path) else 0
            if now and now == size:
                break
            size = now
            time.sleep(0.05)
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def remove(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)


def _child_once(
    conn: Any,
    env: Mapping[str, str],
    pickled_fn: bytes,
    args: tuple[Any, ...],
    init: bool,
    backend_kwargs: Mapping[str, Any],
) -> None:
    """Run one rank: its environment first, then ``fn``'s module is imported (``pickled_fn``).

    A test module may ask torch about CUDA at import (``skipif(torch.cuda.device_count() < 2)``),
    which fixes the devices the process sees: ``CUDA_VISIBLE_DEVICES`` in ``env`` must be set
    before that. ``args`` come as multiprocessing passes them (an ``Event`` may be among them).
    """
    _apply_env(env)
    fn = pickle.loads(pickled_fn)
    try:
        if init:
            import commlib

            group = commlib.init_process_group(**backend_kwargs)
            try:
                value = fn(group, *args)
            finally:
                commlib.destroy_process_group()
        else:
            value = fn(*args)
        conn.send(("ok", value, None, None))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        conn.send(("error", f"{type(e).__name__}: {e}", type(e).__name__, traceback.format_exc()))
    finally:
        conn.close()


def run_ranks_outcomes(
    fn: Callable[..., Any],
    world_size: int,
    *,
    backend: str | None = "ring",
    args: tuple[Any, ...] = (),
    per_rank_args: list[tuple[Any, ...]] | None = None,
    timeout: float = 60.0,
    env: Mapping[str, str] | None = None,
    per_rank_env: list[Mapping[str, str]] | None = None,
    init: bool = True,
    init_kwargs: Mapping[str, Any] | None = None,
    port: int | None = None,
) -> list[RankOutcome]:
    """Spawn ``world_size`` ranks, run ``fn`` on each, and return how each ended.

    Args:
        fn: Module-level function; called as ``fn(group, *args)`` when ``init``,
            else ``fn(*args)`` (the rank's environment is set either way).
        world_size: Number of ranks.
        backend: ``COMMLIB_BACKEND`` for the children (None: leave unset).
        args: Arguments for every rank.
        per_rank_args: Arguments per rank (overrides ``args``).
        timeout: Seconds for the whole run; ranks still running are killed
            and reported as timed out.
        env: Extra environment for every rank.
        per_rank_env: Extra environment per rank.
        init: Call ``commlib.init_process_group(**init_kwargs)`` first.
        init_kwargs: Keyword arguments for ``init_process_group``.
        port: Rendezvous port (default: a free one).
    """
    port = free_port() if port is None else port
    stacks = _StackDumps(world_size)
    procs, conns, child_conns = [], [], []
    pickled_fn = pickle.dumps(fn)
    for rank in range(world_size):
        rank_extra = dict(env or {}, **stacks.env(rank))
        if per_rank_env is not None:
            rank_extra.update(per_rank_env[rank])
        child_env = rank_env(rank, world_size, port, backend, rank_extra)
        rank_args = per_rank_args[rank] if per_rank_args is not None else args
        parent_conn, child_conn = _CTX.Pipe(duplex=False)
        proc = _CTX.Process(
            target=_child_once,
            args=(child_conn, _process_env(child_env), pickled_fn, rank_args, init, dict(init_kwargs or {})),
            name=f"commlib-test-rank{rank}",
            daemon=True,
        )
        procs.append(proc)
        conns.append(parent_conn)
        child_conns.append(child_conn)
    try:
        for proc in procs:
            proc.start()
        for child_conn in child_conns:  # the children hold the write ends now: EOF means a child died
            child_conn.close()
        deadline = time.monotonic() + timeout
        outcomes = [RankOutcome(rank=r) for r in range(world_size)]
        pending = dict(enumerate(conns))
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            ready = multiprocessing.connection.wait(list(pending.values()), timeout=remaining)
            for conn in ready:
                rank = next(r for r, c in pending.items() if c is conn)
                del pending[rank]
                try:
                    status, value, error_type, tb = conn.recv()
                except EOFError:  # died without reporting (killed, os._exit)
                    outcomes[rank].error = "died without reporting"
                    continue
                if status == "ok":
                    outcomes[rank].value = value
                else:
                    outcomes[rank].error, outcomes[rank].error_type, outcomes[rank].traceback = (
                        value,
                        error_type,
                        tb,
                    )
        for rank in pending:
            outcomes[rank].timed_out = True
        stacks.collect(procs, list(pending), outcomes)
        for rank, proc in enumerate(procs):
            # A rank that reported may still take seconds to exit: tearing down torch alone took 5-7 s
            # on the 2-core machine under load, so it gets EXIT_GRACE_S before it counts as stuck.
            grace = max(0.0, min(EXIT_GRACE_S, deadline - time.monotonic()))
            proc.join(timeout=grace if rank not in pending else 0)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
            outcomes[rank].exitcode = proc.exitcode
            if outcomes[rank].error == "died without reporting" or (
                proc.exitcode not in (0, None)
                and outcomes[rank].error is None
                and not outcomes[rank].timed_out
            ):
                outcomes[rank].error = f"exited with code {proc.exitcode} without reporting"
        return outcomes
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in conns:
            conn.close()
        stacks.remove()


def describe_failures(outcomes: list[RankOutcome]) -> str:
    """Text listing every failed rank with its error and traceback."""
    lines = []
    for o in outcomes:
        if o.timed_out:
            lines.append(f"rank {o.rank}: timed out (killed)\n{o.traceback or ''}")
        elif o.error is not None:
            lines.append(f"rank {o.rank}: {o.error}\n{o.traceback or ''}")
    return "\n".join(lines)


def run_ranks(fn: Callable[..., Any], world_size: int, **kwargs: Any) -> list[Any]:
    """Like ``run_ranks_outcomes`` but return the values, raising ``RanksFailed`` if any rank failed."""
    outcomes = run_ranks_outcomes(fn, world_size, **kwargs)
    if not all(o.ok for o in outcomes):
        raise RanksFailed(describe_failures(outcomes))
    return [o.value for o in outcomes]


# ------------------------------------------------------------------ rank pool
def _child_pool(conn: Any, env: Mapping[str, str], init_kwargs: Mapping[str, Any]) -> None:
    _apply_env(env)
    import commlib

    try:
        group = commlib.init_process_group(**init_kwargs)
    except BaseException as e:  # noqa: BLE001
        conn.send(("error", f"{type(e).__name__}: {e}", type(e).__name__, traceback.format_exc()))
        return
    conn.send(("ready", None, None, None))
    try:
        while True:
            try:
                message = conn.recv()
            except EOFError:
                return
            if message is None:
                return
            fn, args = message
            try:
                conn.send(("ok", fn(group, *args), None, None))
            except BaseException as e:  # noqa: BLE001
                conn.send(("error", f"{type(e).__name__}: {e}", type(e).__name__, traceback.format_exc()))
    finally:
        commlib.destroy_process_group()


class RankPool:
    """``world_size`` live ranks with a connected group, reused across test calls.

    After a call in which any rank fails or times out, the pool is torn down
    and the next call starts fresh ranks, so one failing test cannot poison
    the next.
    """

    def __init__(
        self,
        world_size: int,
        backend: str,
        *,
        env: Mapping[str, str] | None = None,
        start_timeout: float = 60.0,
    ) -> None:
        self.world_size = world_size
        self.backend = backend
        self._env = dict(env or {})
        self._start_timeout = start_timeout
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._stacks: _StackDumps | None = None

    def _start(self) -> None:
        port = free_port()
        self._stacks = _StackDumps(self.world_size)
        for rank in range(self.world_size):
            parent_conn, child_conn = _CTX.Pipe()
            env = rank_env(rank, self.world_size, port, self.backend, {**self._env, **self._stacks.env(rank)})
            proc = _CTX.Process(
                target=_child_pool,
                args=(child_conn, _process_env(env), {}),
                name=f"commlib-pool-{self.backend}-rank{rank}",
                daemon=True,
            )
            proc.start()
            child_conn.close()
            self._procs.append(proc)
            self._conns.append(parent_conn)
        # Once one rank fails to join, the others cannot: stop waiting for them soon after.
        replies = self._collect(self._start_timeout, "start", grace_after_error=2.0)
        if not all(o.ok for o in replies):
            self.close()
            raise RanksFailed(
                f"RankPool({self.backend}, {self.world_size}) failed to start:\n{describe_failures(replies)}"
            )

    def _collect(
        self, timeout: float, what: str, grace_after_error: float | None = None
    ) -> list[RankOutcome]:
        deadline = time.monotonic() + timeout
        outcomes = [RankOutcome(rank=r) for r in range(self.world_size)]
        pending = dict(enumerate(self._conns))
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            for conn in multiprocessing.connection.wait(list(pending.values()), timeout=remaining):
                rank = next(r for r, c in pending.items() if c is conn)
                del pending[rank]
                try:
                    status, value, error_type, tb = conn.recv()
                except EOFError:
                    outcomes[
                        rank
                    ].error = f"rank process died during {what} (exit code {self._procs[rank].exitcode})"
                    continue
                if status in ("ok", "ready"):
                    outcomes[rank].value = value
                else:
                    outcomes[rank].error, outcomes[rank].error_type, outcomes[rank].traceback = (
                        value,
                        error_type,
                        tb,
                    )
                    if grace_after_error is not None:
                        deadline = min(deadline, time.monotonic() + grace_after_error)
        for rank in pending:
            outcomes[rank].timed_out = True
        if pending and self._stacks is not None:
            self._stacks.collect(self._procs, list(pending), outcomes)
        return outcomes

    def run_outcomes(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout: float = 60.0,
        per_rank_args: list[tuple[Any, ...]] | None = None,
    ) -> list[RankOutcome]:
        """Run ``fn(group, *args)`` on every rank; return how each call ended."""
        if not self._procs:
            self._start()
        for rank, conn in enumerate(self._conns):
            conn.send((fn, per_rank_args[rank] if per_rank_args is not None else args))
        outcomes = self._collect(timeout, fn.__name__)
        if not all(o.ok for o in outcomes):
            self.close()
        return outcomes

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout: float = 60.0,
        per_rank_args: list[tuple[Any, ...]] | None = None,
    ) -> list[Any]:
        """Run ``fn(group, *args)`` on every rank and return the values; raise ``RanksFailed`` on failure."""
        outcomes = self.run_outcomes(fn, *args, timeout=timeout, per_rank_args=per_rank_args)
        if not all(o.ok for o in outcomes):
            raise RanksFailed(describe_failures(outcomes))
        return [o.value for o in outcomes]

    def close(self) -> None:
        """Stop the ranks (politely, then by force)."""
        for conn in self._conns:
            try:
                conn.send(None)
            except (OSError, BrokenPipeError):
                pass
        deadline = time.monotonic() + 5
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        if self._stacks is not None:
            self._stacks.remove()
            self._stacks = None
