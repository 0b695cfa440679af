"""Subgroup test bodies: overlapping groups, groups of one, closing, split, DDP / Join / ZeRO on subgroups.

Every check is against values computed from the ranks' global ranks, so the
expected result is known on every rank; a body returns what the ranks must
agree on (group names, global ranks, digests).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import commlib
import commlib.world
from commlib import IProcessGroup, ReduceOp
from ddp import DistributedDataParallel, Join, ZeroRedundancyOptimizer
from tests.distributed.ddp_feature_bodies import batch, digest, mlp


def _layout(world: int) -> tuple[list[int], list[int]]:
    """Two overlapping groups: {0, 1} and {1, 2} on 3 ranks; {0, 1, 2} and {1, 2, 3} on 4."""
    if world == 3:
        return [0, 1], [1, 2]
    return [0, 1, 2], [1, 2, 3]


def _exercise(group: IProcessGroup, members: list[int], salt: int) -> None:
    """Collectives and point-to-point on ``group``, whose members are the parent ranks ``members``."""
    n, r = group.world_size, group.rank
    assert list(group.global_ranks) == members, (group.global_ranks, members)
    mine = members[r]
    t = torch.full((5,), float(mine + salt))
    group.all_reduce(t)
    assert torch.all(t == sum(m + salt for m in members)), f"all_reduce on {members}: {t.tolist()}"
    t = torch.full((3,), mine, dtype=torch.int16)
    group.broadcast(t, n - 1)
    assert torch.all(t == members[-1]), f"broadcast on {members}: {t.tolist()}"
    gathered = torch.empty(n, dtype=torch.int64)
    group.all_gather(gathered, torch.tensor([mine + salt]))
    assert gathered.tolist() == [m + salt for m in members], f"all_gather on {members}: {gathered.tolist()}"
    t = torch.tensor([mine], dtype=torch.int32)
    group.reduce(t, 0, ReduceOp.MAX)
    assert r != 0 or t.item() == max(members), f"reduce on {members}: {t.item()}"
    exchanged = torch.empty(n, dtype=torch.int64)
    group.all_to_all_single(exchanged, torch.tensor([mine * 10 + j for j in range(n)]))
    assert exchanged.tolist() == [m * 10 + r for m in members], f"all_to_all on {members}"
    if n > 1:
        got = torch.empty(2)
        work = group.isend(torch.full((2,), float(mine + salt)), (r + 1) % n, tag=salt)
        assert group.recv(got, (r - 1) % n, tag=salt) == (r - 1) % n
        work.wait()
        assert torch.all(got == members[(r - 1) % n] + salt), f"p2p on {members}: {got.tolist()}"


def body_overlapping_groups(group: IProcessGroup, rounds: int = 3) -> dict[str, Any]:
    """Overlapping groups in turn, a group of one per rank, a nested group, closing as the parent goes on."""
    n, r = group.world_size, group.rank
    a_ranks, b_ranks = _layout(n)
    a = group.new_group(a_ranks)
    b = group.new_group(b_ranks, timeout=45)
    assert (a is not None) == (r in a_ranks) and (b is not None) == (r in b_ranks)
    for k in range(rounds):
        if a is not None:
            _exercise(a, a_ranks, 10 * k + 1)
        if b is not None:
            _exercise(b, b_ranks, 10 * k + 2)
        t = torch.ones(1)
        group.all_reduce(t)
        assert t.item() == n
    names = {"a": a.group_name if a else None, "b": b.group_name if b else None}
    timeouts = {"b": b.timeout if b else None}
    # Module functions take global ranks (the pool's group is the default group).
    if b is not None:
        t = torch.full((2,), float(r))
        commlib.broadcast(t, src=b_ranks[0], group=b)
        assert torch.all(t == b_ranks[0]), "commlib.broadcast(src=global rank) on a subgroup"
        assert commlib.get_group_rank(b, b_ranks[-1]) == len(b_ranks) - 1
        assert commlib.get_global_rank(b, 0) == b_ranks[0]
    # Groups of one: every rank calls new_group for each rank; each gets its own.
    singles = [group.new_group([k]) for k in range(n)]
    assert [s is not None for s in singles] == [k == r for k in range(n)]
    own = singles[r]
    assert own is not None
    _exercise(own, [r], 5)
    own.barrier()
    names["single"] = own.group_name
    # A group made from a subgroup: global ranks follow through.
    nested = None
    if b is not None:
        nested = b.new_group([len(b_ranks) - 1, 0])
        if nested is not None:
            _exercise(nested, [b_ranks[0], b_ranks[-1]], 7)
            names["nested"] = nested.group_name
    # Close one group on its members while the parent and the other group go on.
    if a is not None:
        a.close()
    t = torch.ones(2)
    group.all_reduce(t)
    assert torch.all(t == n), "the parent after a subgroup closed"
    if b is not None:
        _exercise(b, b_ranks, 30)
    again = group.new_group(a_ranks)
    if again is not None:
        _exercise(again, a_ranks, 40)
        again.close()
    for g in (b, nested, *singles):
        if g is not None:
            g.close()
    return {"names": names, "timeouts": timeouts}


def body_split(group: IProcessGroup) -> dict[str, Any]:
    """``split``: colors make disjoint groups ordered by key; None joins none; the groups work apart."""
    n, r = group.world_size, group.rank
    halves = group.split(r % 2, key=-r)  # reverse rank order within each color
    assert halves is not None
    members = sorted((k for k in range(n) if k % 2 == r % 2), reverse=True)
    _exercise(halves, members, 3)
    lonely = group.split(None if r == n - 1 else 0)
    assert (lonely is None) == (r == n - 1)
    if lonely is not None:
        _exercise(lonely, list(range(n - 1)), 4)
        lonely.close()
    out = {"halves": halves.group_name, "global_ranks": list(halves.global_ranks)}
    halves.close()
    return out


def body_torch_split_functions(group: IProcessGroup) -> dict[str, Any]:
    """torch's ``split_group``, ``new_subgroups``, ``new_subgroups_by_enumeration``, 2.13's ``*_single``
    names, ``barrier(device_ids, timeout)`` and ``get_backend``, through the module functions.
    """
    n, r = group.world_size, group.rank
    out: dict[str, Any] = {"backend": commlib.get_backend(group)}
    # Disjoint lists, one left out: the last rank gets None.
    lists = [[k for k in range(n - 1) if k % 2 == 0], [k for k in range(n - 1) if k % 2 == 1]]
    part = commlib.split_group(group, lists, timeout=40)
    assert (part is None) == (r == n - 1), (r, part)
    if part is not None:
        members = lists[r % 2]
        _exercise(part, members, 5)
        out["part_timeout"] = part.timeout
        part.close()
    # Groups of consecutive ranks; only this rank's is a group, the others None.
    size = n // 2 if n % 2 == 0 else n
    mine, every = commlib.new_subgroups(size, group=group)
    _exercise(mine, list(range(r // size * size, r // size * size + size)), 6)
    out["every"] = [g is not None for g in every]
    # Enumerated global ranks of the default group.
    previous, commlib.world._default_group = commlib.world._default_group, group  # noqa: SLF001
    try:
        listed, groups = commlib.new_subgroups_by_enumeration([[n - 1, 0]] + ([[1]] if n > 2 else []))
        # torch's new_group arguments: the own backend named, the ranks' order kept.
        kept = commlib.new_group([n - 1, 0], backend=group.backend, sort_ranks=False, group_desc="pair")
    finally:
        commlib.world._default_group = previous  # noqa: SLF001
    out["kept"] = None if kept is None else (kept.rank, list(kept.global_ranks))
    if kept is not None:
        kept.close()
    out["listed"] = None if listed is None else list(listed.global_ranks)
    out["listed_every"] = [g is not None for g in groups]
    # 2.13's names, on the subgroup of consecutive ranks.
    k = mine.world_size
    gathered = torch.empty(2 * k, dtype=torch.int64)
    commlib.all_gather_single(gathered, torch.tensor([mine.rank, 7]), mine)
    out["gathered"] = gathered.tolist()
    scattered = torch.empty(3, dtype=torch.int32)
    commlib.reduce_scatter_single(scattered, torch.arange(3 * k, dtype=torch.int32), group=mine)
    out["scattered"] = scattered.tolist()
    commlib.barrier(mine, device_ids=[0], timeout=30)
    for g in (mine, listed):
        if g is not None:
            g.close()
    return out


def body_parent_closed(group: IProcessGroup) -> dict[str, Any]:
    """A subgroup goes on after the group it was made from is closed."""
    n = group.world_size
    parent = group.new_group(list(range(n)))
    assert parent is not None
    members = list(range(0, n, 2)) if n > 2 else list(range(n))
    child = parent.new_group(members)
    parent.close()
    if child is not None:
        _exercise(child, members, 9)
        child.close()
    t = torch.ones(1)
    group.all_reduce(t)
    return {"member": child is not None, "sum": t.item()}


# ------------------------------------------------------------------ training
def _dp_layout(group: IProcessGroup) -> tuple[IProcessGroup, int]:
    """Data-parallel groups {0, 2} and {1, 3} of 4 ranks, beside pipeline pairs {0, 1} and {2, 3}."""
    r = group.rank
    assert group.world_size == 4, "these bodies lay out 4 ranks"
    dp = group.split(r % 2)
    pipe = group.split(r // 2)
    assert dp is not None and pipe is not None
    pipe.close()  # made beside, as a model-parallel layout would; unused here
    return dp, r % 2


def _reference_step(model: nn.Module, grads: list[torch.Tensor], lr: float) -> None:
    with torch.no_grad():
        for p, g in zip(model.parameters(), grads, strict=True):
            p.sub_(lr * g)


def _local_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    nn.functional.mse_loss(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


def _max_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters(), strict=True))


def body_ddp_on_subgroups(group: IProcessGroup, steps: int = 4, lr: float = 0.1) -> dict[str, Any]:
    """DDP on each data-parallel group equals one process on that group's batches; the groups never mix."""
    dp, color = _dp_layout(group)
    model = mlp(100 + color).double()
    reference = mlp(100 + color).double()
    ddp = DistributedDataParallel(model, dp, bucket_size_mb=0.0005)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=lr)
    for step in range(steps):
        x, y = (t.double() for t in batch(50 * color + step, 2, dp.rank))
        optimizer.zero_grad(set_to_none=True)
        nn.functional.mse_loss(ddp(x), y).backward()
        optimizer.step()
        x, y = (t.double() for t in batch(50 * color + step, 2, None))
        _reference_step(reference, _local_grads(reference, x, y), lr)
    out = {"color": color, "diff": _max_diff(model, reference), "digest": digest(model)}
    dp.close()
    return out


def body_join_on_subgroups(group: IProcessGroup, lr: float = 0.1) -> dict[str, Any]:
    """Join on a data-parallel subgroup: dp rank 0 has 2 batches, dp rank 1 has 4; the result is known."""
    dp, color = _dp_layout(group)
    counts = (2, 4)
    model = mlp(200 + color).double()
    reference = mlp(200 + color).double()
    ddp = DistributedDataParallel(model, dp, bucket_size_mb=0.0005)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=lr)
    with Join([ddp]):
        for step in range(counts[dp.rank]):
            x, y = (t.double() for t in batch(70 * color + step, 2, dp.rank))
            optimizer.zero_grad(set_to_none=True)
            nn.functional.mse_loss(ddp(x), y).backward()
            optimizer.step()
    # The reference: while both train, the mean of their gradients; after, half of dp rank 1's.
    for step in range(max(counts)):
        shares = [
            _local_grads(reference, *(t.double() for t in batch(70 * color + step, 2, k)))
            for k in range(2)
            if step < counts[k]
        ]
        _reference_step(reference, [sum(gs) / 2 for gs in zip(*shares, strict=True)], lr)
    out = {"color": color, "diff": _max_diff(model, reference), "digest": digest(model)}
    dp.close()
    return out


def body_zero_on_subgroups(group: IProcessGroup, steps: int = 4, lr: float = 0.01) -> dict[str, Any]:
    """ZeRO (Adam) with DDP on a data-parallel subgroup equals Adam in one process on the group's batches."""
    dp, color = _dp_layout(group)
    model = mlp(300 + color).double()
    reference = mlp(300 + color).double()
    ddp = DistributedDataParallel(model, dp, bucket_size_mb=0.0005)
    optimizer = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.Adam, dp, lr=lr)
    plain = torch.optim.Adam(reference.parameters(), lr=lr)
    for step in range(steps):
        x, y = (t.double() for t in batch(90 * color + step, 2, dp.rank))
        optimizer.zero_grad(set_to_none=True)
        nn.functional.mse_loss(ddp(x), y).backward()
        optimizer.step()
        x, y = (t.double() for t in batch(90 * color + step, 2, None))
        plain.zero_grad(set_to_none=True)
        nn.functional.mse_loss(reference(x), y).backward()
        plain.step()
    out = {"color": color, "diff": _max_diff(model, reference), "digest": digest(model)}
    dp.close()
    return out


def body_mismatched_member_lists(group: IProcessGroup) -> dict[str, Any]:
    """The last rank passes other rank lists to ``new_group`` and ``split_group`` than the others.

    Every rank must get ``CollectiveMismatchError`` naming each rank's lists, and the parent must
    stay usable. Returns each error's text (None where none was raised) and a sum after them.
    """
    r, last = group.rank, group.world_size - 1
    others = list(range(1, last))
    lists = [0, last] if r == last else [0, 1]
    splits = [[0, last], others] if r == last else [[0, 1], list(range(2, last + 1))]
    report: dict[str, Any] = {}
    for name, call in (
        ("new_group", lambda: group.new_group(lists)),
        ("split_group", lambda: commlib.split_group(group, splits)),
    ):
        try:
            call()
            report[name] = None
        except commlib.CollectiveMismatchError as e:
            report[name] = str(e)
    t = torch.ones(1)
    group.all_reduce(t)
    report["sum_after"] = t.item()
    return report


def body_timeouts_name_the_group(group: IProcessGroup, timeout_s: float = 3.0) -> dict[str, Any]:
    """Three ranks, three overlapping pairs called in a cyclic order: a true deadlock, then a lost recv.

    Rank 0 all-reduces on [0, 1], rank 1 on [1, 2], rank 2 on [0, 2]: each waits for a rank that
    waits in another pair, until the pairs' timeout. Then rank 2 receives on [1, 2] a message rank 1
    never sends. Returns each error, to show that it names the group by its global ranks.
    """
    pairs = [group.new_group(members, timeout=timeout_s) for members in ([0, 1], [1, 2], [0, 2])]
    first = pairs[group.rank]  # rank 0: [0, 1]; rank 1: [1, 2]; rank 2: [0, 2]
    assert first is not None
    report: dict[str, Any] = {}
    try:
        first.all_reduce(torch.ones(4))
        report["deadlock"] = None
    except commlib.CommTimeoutError as e:
        report["deadlock"] = str(e)
    lost = group.new_group([1, 2], timeout=timeout_s)
    if group.rank == 2:
        assert lost is not None
        try:
            lost.recv(torch.empty(4), 0, tag=5)
            report["recv"] = None
        except commlib.CommTimeoutError as e:
            report["recv"] = str(e)
    group.barrier()
    for sub in [*pairs, lost]:
        if sub is not None:
            sub.close()
    return report
