"""Object collective bodies: any picklable object, and the size limit that every rank enforces alike."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import torch

from commlib import IProcessGroup


def _obj(rank: int, k: int = 0) -> Any:
    """An object that differs by rank: nested containers, a tensor, a string that grows with the rank."""
    return {
        "rank": rank,
        "k": k,
        "text": "x" * (rank * 100 + k),
        "tensor": torch.arange(rank + 1),
        "none": None,
    }


def _same(a: Any, b: Any) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[key], b[key]) if isinstance(a[key], torch.Tensor) else a[key] == b[key] for key in a
    )


def body_objects(group: IProcessGroup) -> dict[str, Any]:
    """All four object collectives from every root, against the objects each rank can rebuild."""
    n, r = group.world_size, group.rank
    for root in range(n):
        objects = [_obj(root, k) for k in range(3)] if r == root else [None] * 3
        group.broadcast_object_list(objects, root)
        assert all(_same(objects[k], _obj(root, k)) for k in range(3)), f"broadcast_object_list src={root}"
        gathered = [None] * n if r == root else None
        group.gather_object(_obj(r, root), gathered, root)
        if r == root:
            assert all(_same(gathered[k], _obj(k, root)) for k in range(n)), f"gather_object dst={root}"
        out = [None]
        group.scatter_object_list(out, [_obj(k, root) for k in range(n)] if r == root else None, root)
        assert _same(out[0], _obj(r, root)), f"scatter_object_list src={root}"
    everyone = [None] * n
    group.all_gather_object(everyone, _obj(r))
    assert all(_same(everyone[k], _obj(k)) for k in range(n)), "all_gather_object"
    empty = [object] * 0
    group.broadcast_object_list(empty, 0)  # nothing to send: still a valid call on every rank
    return {"ok": True}


def body_object_limits(group: IProcessGroup, limit: int = 4096) -> dict[str, Any]:
    """Objects over a limit raise the same ValueError on every rank before their bytes move; bad lists too.

    The limit is set on a subgroup's config (rank 1 alone takes a smaller one),
    so the pool's group keeps its own.
    """
    n, r = group.world_size, group.rank
    sub = group.new_group(list(range(n)))
    assert sub is not None
    sub._config = dataclasses.replace(sub.config, max_object_bytes=limit // 4 if r == 1 else limit)
    errors: dict[str, str | None] = {}
    cases = {
        "broadcast_big": lambda: sub.broadcast_object_list(["y" * 2000] if r == 0 else [None], 0),
        "all_gather_big": lambda: sub.all_gather_object([None] * n, "z" * (5000 if r == n - 1 else 10)),
        "gather_big": lambda: sub.gather_object("w" * 2000, [None] * n if r == 1 else None, 1),
        "scatter_big": lambda: sub.scatter_object_list([None], ["v" * 2000] * n if r == 0 else None, 0),
        "broadcast_length": lambda: sub.broadcast_object_list([1, 2] if r == 0 else [None], 0),
        "gather_list_length": lambda: sub.gather_object(1, [None] * (n + 1) if r == 0 else None, 0),
    }
    for name, call in cases.items():
        try:
            call()
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)
        t = torch.ones(1)
        sub.all_reduce(t)  # nothing moved: the group goes on
        assert t.item() == n, name
    small = [None] * n
    sub.all_gather_object(small, r)
    sub.close()
    return {"errors": errors, "small": small}


def body_object_pickling_failures(group: IProcessGroup) -> dict[str, str | None]:
    """An object that does not pickle raises on every rank in the same call, naming the rank and the error.

    Three ranks. After each case the group goes on in step: an all_reduce sums to ``n``.
    """
    n, r = group.world_size, group.rank
    lock = threading.Lock()
    cases = {
        "all_gather": lambda: group.all_gather_object([None] * n, lock if r == n - 1 else r),
        "broadcast": lambda: group.broadcast_object_list([1, lock] if r == 1 else [None, None], 1),
        "gather": lambda: group.gather_object(lock if r != 1 else r, [None] * n if r == 1 else None, 1),
        "scatter": lambda: group.scatter_object_list([None], [0, 1, lock] if r == 0 else None, 0),
    }
    errors: dict[str, str | None] = {}
    for name, call in cases.items():
        try:
            call()
            errors[name] = None
        except TypeError as e:
            errors[name] = str(e)
        t = torch.ones(1)
        group.all_reduce(t)
        assert t.item() == n, name
    return errors


LOCK = "(lock): TypeError: cannot pickle '_thread.lock' object"
PICKLING_FAILURES = {
    "all_gather": f"all_gather_object: rank 2 cannot pickle obj {LOCK}.",
    "broadcast": f"broadcast_object_list: rank 1 cannot pickle object_list[1] {LOCK}.",
    "gather": f"gather_object: rank 0 cannot pickle obj {LOCK}; rank 2 cannot pickle obj {LOCK}.",
    "scatter": f"scatter_object_list: rank 0 cannot pickle scatter_object_input_list[2] {LOCK}.",
}
"""What every rank of three raises in ``body_object_pickling_failures``, after its prefix."""


def check_pickling_failures(values: list[dict[str, str | None]], backend: str) -> None:
    """Every rank raised the same TypeError in the same call; the group went on (checked in the body)."""
    for rank, errors in enumerate(values):
        for case, text in PICKLING_FAILURES.items():
            assert errors[case] == (
                f"[rank {rank}/3] {backend}.{text} No object moved on any rank; pass objects that pickle"
            ), (rank, case, errors[case])
