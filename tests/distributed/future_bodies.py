"""Test bodies for ``Work.get_future()``: run on spawned ranks (ring, gloo) and under mpiexec (mpi).

Each body checks what one rank can check against closed-form values and
returns a small dict for the parent to compare.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from commlib import CommTimeoutError, IProcessGroup, ReduceOp


def futures_semantics(group: IProcessGroup) -> dict[str, Any]:
    """Values, ``then`` chains, an error inside a callback, and every collective's future value."""
    n, r = group.world_size, group.rank
    total = n * (n + 1) / 2

    t = torch.full((1000,), float(r + 1))
    fut = group.all_reduce(t, async_op=True).get_future()  # type: ignore[union-attr]
    doubled = fut.then(lambda f: f.value()[0] * 2)
    value = fut.wait()
    assert isinstance(value, list) and len(value) == 1 and value[0] is t, value
    assert torch.equal(t, torch.full((1000,), total)), t[:4]
    assert torch.equal(doubled.wait(), torch.full((1000,), 2 * total))

    # AVG: the value the future carries is the mean, whichever way the backend averages.
    mean = (
        group.all_reduce(torch.full((5,), float(r + 1)), ReduceOp.AVG, async_op=True).get_future().wait()[0]
    )  # type: ignore[union-attr]
    assert torch.equal(mean, torch.full((5,), total / n)), mean

    # A hook written as for torch: divide, all-reduce, then take the tensor out of the list.
    bucket = torch.full((8,), float(r + 1)).div_(n)
    hooked = group.all_reduce(bucket, async_op=True).get_future().then(lambda f: f.value()[0])  # type: ignore[union-attr]
    assert torch.allclose(hooked.wait(), torch.full((8,), total / n), rtol=1e-6, atol=0)

    # A future asked for after wait() is complete at once.
    work = group.all_reduce(torch.ones(3), async_op=True)
    assert work is not None
    work.wait()
    assert work.get_future().done()

    # An error inside a callback reaches the chained future, not the collective.
    bad = group.all_reduce(torch.ones(2), async_op=True).get_future().then(lambda f: 1 / 0)  # type: ignore[union-attr]
    try:
        bad.wait()
    except RuntimeError as e:
        callback_error = str(e).splitlines()[0]
    else:
        raise AssertionError("the callback's ZeroDivisionError did not reach the chained future")
    assert "ZeroDivisionError" in callback_error, callback_error

    # Every collective's future value, as torch gives it.
    b = torch.full((3,), float(r))
    assert group.broadcast(b, 0, async_op=True).get_future().wait()[0] is b  # type: ignore[union-attr]
    assert torch.equal(b, torch.zeros(3))
    out = torch.empty(2 * n)
    gathered = group.all_gather(out, torch.full((2,), float(r)), async_op=True).get_future().wait()  # type: ignore[union-attr]
    assert len(gathered) == 1 and gathered[0] is out  # torch's [output], so a hook's value()[0] is the output
    assert out.tolist() == [float(k) for k in range(n) for _ in range(2)]
    swapped = torch.empty(n)
    mine = torch.full((n,), float(r))
    value = group.all_to_all_single(swapped, mine, async_op=True).get_future().wait()  # type: ignore[union-attr]
    assert len(value) == 1 and value[0] is swapped and swapped.tolist() == [float(k) for k in range(n)]
    rs_out = torch.empty(2)
    rs_in = torch.arange(2 * n, dtype=torch.float32)
    assert group.reduce_scatter(rs_out, rs_in, async_op=True).get_future().wait()[0] is rs_out  # type: ignore[union-attr]
    assert rs_out.tolist() == [float(n * (2 * r)), float(n * (2 * r + 1))]
    assert group.barrier(async_op=True).get_future().wait() is None  # type: ignore[union-attr]

    # A large collective that nobody waits on through its Work: the future alone must complete.
    big = torch.full((300_000,), float(r + 1))
    first = group.all_reduce(big, async_op=True).get_future().then(lambda f: float(f.value()[0][0]))  # type: ignore[union-attr]
    assert first.wait() == total
    return {"callback_error": callback_error, "total": total}


def future_timeout(group: IProcessGroup, released: Any = None, linger_s: float = 0.0) -> dict[str, Any]:
    """The last rank never issues the all-reduce: the others' futures fail with ``CommTimeoutError``.

    ``released`` (a ``multiprocessing.Event``) lets the last rank return once the
    others have seen their error; without it (under mpiexec) the last rank stays
    away for ``linger_s`` seconds.
    """
    if group.rank == group.world_size - 1:
        if released is not None:
            released.wait(120)
        else:
            time.sleep(linger_s)
        return {}
    fut = group.all_reduce(torch.ones(10), async_op=True).get_future()  # type: ignore[union-attr]
    start = time.perf_counter()
    try:
        fut.wait()
    except CommTimeoutError as e:
        after = time.perf_counter() - start
        print(
            f"[body] rank {group.rank}: future failed with CommTimeoutError after {after:.2f} s", flush=True
        )
        return {"error_type": type(e).__name__, "error": str(e), "after_s": after}
    finally:
        if released is not None:
            released.set()
    return {"unexpected": "completed"}
