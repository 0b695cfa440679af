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


def _member(group: object) -> bool:
    """True if ``group`` is a group, False if it is ``GroupMember.NON_GROUP_MEMBER`` (never None)."""
    member = isinstance(group, IProcessGroup)
    assert member or group == commlib.GroupMember.NON_GROUP_MEMBER, (
        f"not a group nor a placeholder: {group!r}"
    )
    return member


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
    assert (_member(a)) == (r in a_ranks) and (_member(b)) == (r in b_ranks)
    for k in range(rounds):
        if _member(a):
            _exercise(a, a_ranks, 10 * k + 1)
        if _member(b):
            _exercise(b, b_ranks, 10 * k + 2)
        t = torch.ones(1)
        group.all_reduce(t)
        assert t.item() == n
    names = {"a": a.group_name if _member(a) else None, "b": b.group_name if _member(b) else None}
    timeouts = {"b": b.timeout if _member(b) else None}
    # Module functions take global ranks (the pool's group is the default group).
    if _member(b):
        t = torch.full((2,), float(r))
        commlib.broadcast(t, src=b_ranks[0], group=b)
        assert torch.all(t == b_ranks[0]), "commlib.broadcast(src=global rank) on a subgroup"
        assert commlib.get_group_rank(b, b_ranks[-1]) == len(b_ranks) - 1
        assert commlib.get_global_rank(b, 0) == b_ranks[0]
    # Groups of one: every rank calls new_group for each rank; each gets its own.
    singles = [group.new_group([k]) for k in range(n)]
    assert [_member(s) for s in singles] == [k == r for k in range(n)]
    own = singles[r]
    assert _member(own)
    _exercise(own, [r], 5)
    own.barrier()
    names["single"] = own.group_name
    # A group made from a subgroup: global ranks follow through.
    nested: Any = commlib.GroupMember.NON_GROUP_MEMBER
    if _member(b):
        nested = b.new_group([len(b_ranks) - 1, 0])
        if _member(nested):
            _exercise(nested, [b_ranks[0], b_ranks[-1]], 7)
            names["nested"] = nested.group_name
    # Close one group on its members while the parent and the other group go on.
    if _member(a):
        a.close()
    t = torch.ones(2)
    group.all_reduce(t)
    assert torch.all(t == n), "the parent after a subgroup closed"
    if _member(b):
        _exercise(b, b_ranks, 30)
    again = group.new_group(a_ranks)
    if _member(again):
        _exercise(again, a_ranks, 40)
        again.close()
    for g in (b, nested, *singles):
        if _member(g):
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
    assert (not _member(lonely)) == (r == n - 1)
    if _member(lonely):
        _exercise(lonely, list(range(n - 1)), 4)
        lonely.close()
    out = {"halves": halves.group_name, "global_ranks": list(halves.global_ranks)}
    try:  # a global dst that is this rank: the error names the group rank and the global rank
        commlib.send(torch.ones(1), dst=r, group=halves)
    except ValueError as e:
        out["send_to_itself"] = str(e)
    halves.close()
    return out


def body_torch_split_functions(group: IProcessGroup) -> dict[str, Any]:
    """torch's ``split_group``, ``new_subgroups``, ``new_subgroups_by_enumeration``, 2.13's ``*_single``
    names, ``barrier(device_ids, timeout)`` and ``get_backend``, through the module functions.
    """
    n, r = group.world_size, group.rank
    out: dict[str, Any] = {"backend": commlib.get_backend(group)}
    # Disjoint lists, one left out: the last rank gets GroupMember.NON_GROUP_MEMBER.
    lists = [[k for k in range(n - 1) if k % 2 == 0], [k for k in range(n - 1) if k % 2 == 1]]
    part = commlib.split_group(group, lists, timeout=40)
    assert (not _member(part)) == (r == n - 1), (r, part)
    if _member(part):
        members = lists[r % 2]
        _exercise(part, members, 5)
        out["part_timeout"] = part.timeout
        part.close()
    # Groups of consecutive ranks; only this rank's is a group, the others NON_GROUP_MEMBER.
    size = n // 2 if n % 2 == 0 else n
    mine, every = commlib.new_subgroups(size, group=group)
    _exercise(mine, list(range(r // size * size, r // size * size + size)), 6)
    out["every"] = [_member(g) for g in every]
    # Enumerated global ranks of the default group.
    previous, commlib.world._default_group = commlib.world._default_group, group  # noqa: SLF001
    try:
        listed, groups = commlib.new_subgroups_by_enumeration([[n - 1, 0]] + ([[1]] if n > 2 else []))
        # torch's new_group arguments: the own backend named, the ranks' order kept.
        kept = commlib.new_group([n - 1, 0], backend=group.backend, sort_ranks=False, group_desc="pair")
    finally:
        commlib.world._default_group = previous  # noqa: SLF001
    out["kept"] = None if not _member(kept) else (kept.rank, list(kept.global_ranks))
    if _member(kept):
        kept.close()
    out["listed"] = None if not _member(listed) else list(listed.global_ranks)
    out["listed_every"] = [_member(g) for g in groups]
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
        if _member(g):
            g.close()
    return out


def body_non_members_are_refused(group: IProcessGroup) -> dict[str, Any]:
    """A rank outside a subgroup that passes what it got to an operation is refused; never the world.

    Ranks 0 and 1 reduce on their pair, then every rank reduces on the world; the rank
    outside the pair passes its placeholder to the same operations first (module
    functions and methods, from ``new_group``, ``group.new_group``, ``split`` and
    ``split_group``). Were it the world, the members' world sum would pair with it.
    """
    r = group.rank
    previous, commlib.world._default_group = commlib.world._default_group, group  # noqa: SLF001
    try:
        made = {
            "commlib.new_group": commlib.new_group([0, 1]),
            "group.new_group": group.new_group([0, 1]),
            "group.split": group.split(0 if r < 2 else None),
            "commlib.split_group": commlib.split_group(None, [[0, 1]]),
        }
    finally:
        commlib.world._default_group = previous  # noqa: SLF001
    out: dict[str, Any] = {"refused": {}, "sums": {}}
    for how, sub in made.items():
        t = torch.full((1,), 10.0 * (r + 1))
        if r < 2:
            assert _member(sub), how
            commlib.all_reduce(t, group=sub)
            out["sums"][how] = t.item()
        else:
            assert not _member(sub) and commlib.get_rank(sub) == -1, how
            calls = {
                "commlib.all_reduce": lambda sub=sub, t=t: commlib.all_reduce(t, group=sub),
                "commlib.barrier": lambda sub=sub: commlib.barrier(group=sub),
                "commlib.send": lambda sub=sub, t=t: commlib.send(t, dst=0, group=sub),
                "method all_reduce": lambda sub=sub, t=t: sub.all_reduce(t),
            }
            refused = {}
            for call, run in calls.items():
                try:
                    run()
                    refused[call] = None
                except commlib.NotGroupMemberError as e:
                    refused[call] = str(e)
            out["refused"][how] = refused
        world = torch.full((1,), 10.0 * (r + 1))
        group.all_reduce(world)
        out["sums"][f"{how} then world"] = world.item()
        if _member(sub):
            sub.close()
    return out


def check_non_members_refused(backend: str, values: list[dict[str, Any]]) -> None:
    """``body_non_members_are_refused``: every call of the rank outside the pair raised, naming it."""
    n = len(values)
    world = sum(10.0 * (k + 1) for k in range(n))
    for r, v in enumerate(values):
        for how in ("commlib.new_group", "group.new_group", "group.split", "commlib.split_group"):
            assert v["sums"][f"{how} then world"] == world, (r, how, v["sums"])
            if r < 2:
                assert v["sums"][how] == 30.0, (r, how, v["sums"])
                continue
            for call, text in v["refused"][how].items():
                assert text is not None, f"rank {r}: {call} on the placeholder from {how} was not refused"
                op = call.split()[-1].split(".")[-1]
                assert text.startswith(f"[rank {r}/{n}] {backend}.{op}: this rank (global rank {r}) "), text
                assert "(global ranks [0, 1])" in text and "GroupMember.NON_GROUP_MEMBER" in text, text


def body_parent_closed(group: IProcessGroup) -> dict[str, Any]:
    """A subgroup goes on after the group it was made from is closed."""
    n = group.world_size
    parent = group.new_group(list(range(n)))
    assert parent is not None
    members = list(range(0, n, 2)) if n > 2 else list(range(n))
    child = parent.new_group(members)
    parent.close()
    if _member(child):
        _exercise(child, members, 9)
        child.close()
    t = torch.ones(1)
    group.all_reduce(t)
    return {"member": _member(child), "sum": t.item()}


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
    assert first != commlib.GroupMember.NON_GROUP_MEMBER
    report: dict[str, Any] = {}
    try:
        first.all_reduce(torch.ones(4))
        report["deadlock"] = None
    except commlib.CommTimeoutError as e:
        report["deadlock"] = str(e)
    lost = group.new_group([1, 2], timeout=timeout_s)
    if group.rank == 2:
        assert lost != commlib.GroupMember.NON_GROUP_MEMBER
        try:
            lost.recv(torch.empty(4), 0, tag=5)
            report["recv"] = None
        except commlib.CommTimeoutError as e:
            report["recv"] = str(e)
    group.barrier()
    for sub in [*pairs, lost]:
        if sub != commlib.GroupMember.NON_GROUP_MEMBER:
            sub.close()
    return report


def body_destroy_closes_every_subgroup(group: IProcessGroup) -> dict[str, Any]:
    """``destroy_process_group()`` closes the default group and every group made from it, as torch's."""
    import gc
    import threading

    from commlib.membership import is_non_member

    whole = group.new_group(list(range(group.world_size)))
    first = whole.new_group([0])  # made from a subgroup; rank 1 gets the placeholder
    halves = group.split(group.rank % 2)
    between = group.new_group(list(range(group.world_size)))
    kept = between.new_group(list(range(group.world_size)))  # outlives the group it was made from
    between.close()
    del between
    gc.collect()
    made = [g for g in (whole, first, halves, kept) if not is_non_member(g)]
    commlib.destroy_process_group()
    return {
        "closed": [g._closed for g in made],
        "threads": sorted(t.name for t in threading.enumerate() if t.name.startswith("commlib")),
    }
