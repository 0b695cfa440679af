"""Bodies for commlib's backends under torch.distributed (``commlib.torch_adapter``).

Each body initialises torch.distributed itself (``dist.init_process_group`` on
the backend it is given), checks torch's own API against closed-form values or a
one-process reference, and destroys the group. They run on spawned ranks whose
environment is torchrun's (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``), so ``env://`` needs no arguments.
"""

from __future__ import annotations

import copy
import datetime
import math
import os
from typing import Any

import torch
import torch.distributed as dist

import commlib.torch_adapter  # noqa: F401 - registers the backends
from commlib import CommTimeoutError
from commlib.torch_adapter import CommlibProcessGroup


def _init(backend: str, how: str = "env", store_path: str = "") -> None:
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=60)
    if how == "env":
        dist.init_process_group(backend, timeout=timeout)
    elif how == "tcp":
        url = f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        dist.init_process_group(backend, init_method=url, rank=rank, world_size=size, timeout=timeout)
    elif how == "store":
        store = dist.FileStore(store_path, size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    else:
        raise ValueError(how)


def _inner_backend(group: Any = None) -> str:
    pg = group if group is not None else dist.group.WORLD
    assert isinstance(pg, CommlibProcessGroup), type(pg)
    return pg.commlib_group.backend


# --------------------------------------------------------------- functional
def init_methods(backend: str, store_path: str) -> dict[str, Any]:
    """Initialise through env://, an explicit store and tcp://, one after another; each runs an all_reduce."""
    seen = {}
    for how in ("env", "store", "tcp"):
        _init(backend, how, store_path)
        try:
            t = torch.full((3,), float(dist.get_rank() + 1))
            dist.all_reduce(t)
            seen[how] = {"sum": t.tolist(), "backend": dist.get_backend(), "inner": _inner_backend()}
        finally:
            dist.destroy_process_group()
    return seen


def _ops(n: int) -> list[tuple[str, Any, float, torch.dtype]]:
    """(name, torch op, expected result of ranks contributing rank + 1, dtype)."""
    total = n * (n + 1) / 2
    return [
        ("sum", dist.ReduceOp.SUM, total, torch.float32),
        ("avg", dist.ReduceOp.AVG, total / n, torch.float32),
        ("product", dist.ReduceOp.PRODUCT, float(math.factorial(n)), torch.float64),
        ("min", dist.ReduceOp.MIN, 1.0, torch.float32),
        ("max", dist.ReduceOp.MAX, float(n), torch.int64),
        ("premul_sum", dist._make_nccl_premul_sum(0.5), total / 2, torch.float32),
        ("bor", dist.ReduceOp.BOR, float(sum(1 << r for r in range(n)) | 0), torch.int32),
    ]


def functional_api(backend: str) -> dict[str, Any]:
    """Every torch.distributed function on the group, against closed-form results."""
    _init(backend)
    r, n = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {"inner": _inner_backend()}
    try:
        # all_reduce with every reduce operation, and reduce_scatter_tensor with AVG / PREMUL_SUM
        for name, op, expected, dtype in _ops(n):
            value = (1 << r) if name == "bor" else r + 1
            t = torch.full((5,), value, dtype=dtype)
            dist.all_reduce(t, op=op)
            assert t.tolist() == [expected] * 5, (name, t)
        for name, op, expected, _ in _ops(n)[:2] + _ops(n)[5:6]:
            full = torch.full((2 * n,), float(r + 1))
            part = torch.empty(2)
            dist.reduce_scatter_tensor(part, full, op=op)
            assert part.tolist() == [expected] * 2, (f"reduce_scatter_tensor {name}", part)
        for root in range(n):
            t = torch.full((4,), float(r))
            dist.broadcast(t, src=root)
            assert t.tolist() == [float(root)] * 4
            t = torch.full((4,), float(r + 1))
            dist.reduce(t, dst=root)
            if r == root:
                assert t.tolist() == [n * (n + 1) / 2] * 4
            gathered = [torch.empty(2) for _ in range(n)] if r == root else None
            dist.gather(torch.full((2,), float(r)), gathered, dst=root)
            if r == root:
                assert [g.tolist() for g in gathered] == [[float(k)] * 2 for k in range(n)]  # type: ignore[union-attr]
            got = torch.empty(3)
            dist.scatter(got, [torch.full((3,), float(k)) for k in range(n)] if r == root else None, src=root)
            assert got.tolist() == [float(r)] * 3
        lists = [torch.empty(3) for _ in range(n)]
        dist.all_gather(lists, torch.full((3,), float(r)))
        assert [x.tolist() for x in lists] == [[float(k)] * 3 for k in range(n)]
        flat = torch.empty(3 * n)
        dist.all_gather_into_tensor(flat, torch.full((3,), float(r)))
        assert flat.tolist() == [float(k) for k in range(n) for _ in range(3)]
        part = torch.empty(2)
        dist.reduce_scatter(part, [torch.full((2,), float(r + k)) for k in range(n)])
        assert part.tolist() == [float(sum(q + r for q in range(n)))] * 2
        outs = [torch.empty(2) for _ in range(n)]
        dist.all_to_all(outs, [torch.full((2,), float(10 * r + k)) for k in range(n)])
        assert [o.tolist() for o in outs] == [[float(10 * k + r)] * 2 for k in range(n)]
        # uneven all_to_all_single: rank r sends k + 1 elements to rank k
        send = torch.cat([torch.full((k + 1,), float(10 * r + k)) for k in range(n)])
        recv = torch.empty((r + 1) * n)
        dist.all_to_all_single(recv, send, [r + 1] * n, [k + 1 for k in range(n)])
        assert recv.tolist() == [float(10 * k + r) for k in range(n) for _ in range(r + 1)]
        dist.barrier()
        # objects
        objs = [{"from": r, "text": "x" * r}] if r == 0 else [None]
        dist.broadcast_object_list(objs, src=0)
        assert objs == [{"from": 0, "text": ""}]
        everyone: list[Any] = [None] * n
        dist.all_gather_object(everyone, ("rank", r))
        assert everyone == [("rank", k) for k in range(n)]
        at_root: list[Any] | None = [None] * n if r == 0 else None
        dist.gather_object({"r": r}, at_root, dst=0)
        if r == 0:
            assert at_root == [{"r": k} for k in range(n)]
        mine: list[Any] = [None]
        dist.scatter_object_list(mine, [k * k for k in range(n)] if r == 0 else None, src=0)
        assert mine == [r * r]
        out["collectives"] = True
        out.update(_point_to_point(r, n))
        out.update(_async(r, n))
        out.update(_subgroups(r, n, backend))
        out.update(_errors(r, n))
    finally:
        dist.destroy_process_group()
    return out


def _point_to_point(r: int, n: int) -> dict[str, Any]:
    right, left = (r + 1) % n, (r - 1) % n
    if r % 2 == 0:
        dist.send(torch.full((4,), float(r)), dst=right)
        got = torch.empty(4)
        dist.recv(got, src=left)
    else:
        got = torch.empty(4)
        dist.recv(got, src=left)
        dist.send(torch.full((4,), float(r)), dst=right)
    assert got.tolist() == [float(left)] * 4
    # a receive from any rank names its sender
    any_source = None
    if r == 0:
        buf = torch.empty(2)
        any_source = dist.recv(buf, src=None, tag=3)
        assert buf.tolist() == [float(n - 1)] * 2
    elif r == n - 1:
        dist.send(torch.full((2,), float(r)), dst=0, tag=3)
    # isend / irecv and batch_isend_irecv around the ring
    incoming = torch.empty(3)
    works = [dist.isend(torch.full((3,), float(r)), right), dist.irecv(incoming, left)]
    for work in works:
        work.wait()
    assert incoming.tolist() == [float(left)] * 3
    incoming = torch.empty(3)
    ops = [
        dist.P2POp(dist.isend, torch.full((3,), float(-r)), right),
        dist.P2POp(dist.irecv, incoming, left),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    assert incoming.tolist() == [float(-left)] * 3
    return {"p2p": True, "any_source": any_source}


def _async(r: int, n: int) -> dict[str, Any]:
    t = torch.full((8,), float(r + 1))
    work = dist.all_reduce(t, async_op=True)
    future = work.get_future()
    assert work.wait() is True
    assert work.is_completed()
    value = future.wait()
    assert isinstance(value, list) and value[0] is t, value
    doubled = dist.all_reduce(torch.ones(2), async_op=True).get_future().then(lambda f: f.value()[0] * 2)
    assert doubled.wait().tolist() == [2.0 * n] * 2
    flat = torch.empty(2 * n)
    work = dist.all_gather_into_tensor(flat, torch.full((2,), float(r)), async_op=True)
    work.wait()
    assert flat.tolist() == [float(k) for k in range(n) for _ in range(2)]
    # torch's coalescing manager: the operations reach the group as one coalesced call
    for async_ops in (False, True):
        a, b = torch.full((3,), float(r + 1)), torch.full((5,), float(2 * r))
        with dist._coalescing_manager(async_ops=async_ops) as manager:
            dist.all_reduce(a)
            dist.all_reduce(b)
        if async_ops:
            manager.wait()
        assert a.tolist() == [n * (n + 1) / 2] * 3 and b.tolist() == [float(n * (n - 1))] * 5
    return {"async": True}


def _subgroups(r: int, n: int, backend: str) -> dict[str, Any]:
    pair = dist.new_group(list(range(n)))
    t = torch.full((2,), float(r + 1))
    dist.all_reduce(t, group=pair)
    assert t.tolist() == [n * (n + 1) / 2] * 2
    mine, _ = dist.new_subgroups(group_size=1)
    t = torch.full((2,), float(r + 1))
    dist.all_reduce(t, group=mine)
    assert t.tolist() == [float(r + 1)] * 2
    return {
        "subgroup_inner": [_inner_backend(pair), _inner_backend(mine)],
        "subgroup_names": [pair.getBackendName(), mine.getBackendName()],
    }


def _errors(r: int, n: int) -> dict[str, Any]:
    errors: dict[str, str] = {}
    try:
        dist.all_reduce(torch.ones(2, dtype=torch.int32), op=dist.ReduceOp.AVG)
    except Exception as e:  # noqa: BLE001 - the message is the result
        errors["avg_int"] = f"{type(e).__name__}: {e}"
    try:
        dist.monitored_barrier()
    except Exception as e:  # noqa: BLE001
        errors["monitored_barrier"] = f"{type(e).__name__}: {e}"
    # a wait with a timeout raises our timeout while a peer is late, and the collective still completes
    store = dist.distributed_c10d._get_default_store()
    t = torch.full((2,), float(r + 1))
    if r == 0:
        work = dist.all_reduce(t, async_op=True)
        try:
            work.wait(datetime.timedelta(milliseconds=50))
        except CommTimeoutError as e:
            errors["wait_timeout"] = str(e)
        store.set("adapter-test/late", "1")
        work.wait()
    else:
        store.wait(["adapter-test/late"])
        dist.all_reduce(t)
    assert t.tolist() == [n * (n + 1) / 2] * 2
    return {"errors": errors}


def extra_collective(backend: str) -> dict[str, Any]:
    """Through ``dist.*``: rank 1 issues one all_reduce more (same shape), then every rank a barrier.

    Rank 0's barrier pairs with rank 1's second all_reduce; commlib's checks raise on every rank.
    """
    _init(backend)
    try:
        r = dist.get_rank()
        t = torch.full((4,), float(r + 1))
        error = None
        try:
            if r == 1:
                dist.all_reduce(torch.full((4,), 10.0))
            dist.all_reduce(t)
            dist.barrier()
        except Exception as e:  # noqa: BLE001 - the message is the result
            error = (type(e).__name__, str(e))
        return {"error": error, "sum": t[0].item()}
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------- DDP
class _Net(torch.nn.Module):
    def __init__(self, unused: bool) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4)
        if unused:
            self.unused = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _batches(n: int, steps: int, per_rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    return [
        (torch.randn(n * per_rank, 8, generator=gen), torch.randn(n * per_rank, 4, generator=gen))
        for _ in range(steps)
    ]


def _max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters(), strict=True))


def ddp_parity(backend: str) -> dict[str, float]:
    """torch's DDP against one process on the full batch: plain, unused parameters, no_sync with a hook."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    _init(backend)
    r, n = dist.get_rank(), dist.get_world_size()
    b = 4
    diffs: dict[str, float] = {}
    try:
        for case in ("plain", "find_unused", "no_sync_fp16_hook"):
            torch.manual_seed(0)
            ref = _Net(unused=case == "find_unused")
            ddp = DDP(copy.deepcopy(ref), find_unused_parameters=case == "find_unused")
            if case == "no_sync_fp16_hook":
                ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
            ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
            micro = 2 if case == "no_sync_fp16_hook" else 1
            batches = _batches(n, 3 * micro, b)
            for step in range(3):
                opt.zero_grad()
                ref_opt.zero_grad()
                for m in range(micro):
                    x, y = batches[step * micro + m]
                    mine = slice(r * b, (r + 1) * b)
                    torch.nn.functional.mse_loss(ref(x), y).backward()
                    if m < micro - 1:
                        with ddp.no_sync():
                            torch.nn.functional.mse_loss(ddp(x[mine]), y[mine]).backward()
                    else:
                        torch.nn.functional.mse_loss(ddp(x[mine]), y[mine]).backward()
                opt.step()
                ref_opt.step()
            diffs[case] = _max_diff(ddp.module, ref)
            del ddp
    finally:
        dist.destroy_process_group()
    return diffs


# --------------------------------------------------------------------- FSDP2
def fsdp2_parity(backend: str) -> dict[str, float]:
    """FSDP2 ``fully_shard`` against one process: AVG, then ``set_gradient_divide_factor`` (PREMUL_SUM)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    _init(backend)
    r, n = dist.get_rank(), dist.get_world_size()
    b = 4
    diffs: dict[str, float] = {}
    try:
        mesh = init_device_mesh("cpu", (n,))
        for case, factor in (("avg", None), ("premul_sum", 2.0 * n)):
            torch.manual_seed(0)
            ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
            model = copy.deepcopy(ref)
            for layer in (model[0], model[2]):
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            if factor is not None:
                for module in (model[0], model[2], model):
                    module.set_gradient_divide_factor(factor)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
            scale = 1.0 if factor is None else n / factor  # the reference's gradient, as FSDP divides it
            for x, y in _batches(n, 3, b):
                opt.zero_grad()
                ref_opt.zero_grad()
                mine = slice(r * b, (r + 1) * b)
                torch.nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
                (torch.nn.functional.mse_loss(ref(x), y) * scale).backward()
                opt.step()
                ref_opt.step()
            full = [p.full_tensor() for p in model.parameters()]
            diffs[case] = max((p - q).abs().max().item() for p, q in zip(full, ref.parameters(), strict=True))
    finally:
        dist.destroy_process_group()
    return diffs


# ------------------------------------------------------------------ DTensor
def dtensor(backend: str) -> dict[str, Any]:
    """distribute_tensor, redistribute and full_tensor on a 1-D mesh, against the full tensor."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    _init(backend)
    r, n = dist.get_rank(), dist.get_world_size()
    try:
        mesh = init_device_mesh("cpu", (n,))
        full = torch.arange(4 * n * 3, dtype=torch.float32).reshape(4 * n, 3)
        sharded = distribute_tensor(full, mesh, [Shard(0)])
        assert torch.equal(sharded.to_local(), full[4 * r : 4 * (r + 1)])
        assert torch.equal(sharded.full_tensor(), full)
        replicated = sharded.redistribute(mesh, [Replicate()])
        assert torch.equal(replicated.to_local(), full)
        by_column = replicated.redistribute(mesh, [Shard(1)])
        assert torch.equal(by_column.full_tensor(), full)
        partial = DTensor.from_local(full * (r + 1), mesh, [Partial()])
        summed = partial.redistribute(mesh, [Replicate()]).to_local()
        assert torch.equal(summed, full * (n * (n + 1) // 2)), "Partial -> Replicate sums the ranks"
        product = (sharded @ distribute_tensor(torch.ones(3, 2), mesh, [Replicate()])).full_tensor()
        assert torch.equal(product, full @ torch.ones(3, 2))
        return {"ok": True, "local_shape": list(sharded.to_local().shape)}
    finally:
        dist.destroy_process_group()


def ddp_features(backend: str) -> dict[str, Any]:
    """torch's DDP with static_graph, the PowerSGD hook, and Join over uneven inputs."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel as DDP

    _init(backend)
    r, n = dist.get_rank(), dist.get_world_size()
    b = 4
    out: dict[str, Any] = {}
    try:
        for case in ("static_graph", "powersgd"):
            torch.manual_seed(0)
            ref = _Net(unused=False)
            ddp = DDP(copy.deepcopy(ref), static_graph=case == "static_graph")
            if case == "powersgd":
                state = powerSGD_hook.PowerSGDState(
                    process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2
                )
                ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
            ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
            for x, y in _batches(n, 4, b):
                opt.zero_grad()
                ref_opt.zero_grad()
                mine = slice(r * b, (r + 1) * b)
                torch.nn.functional.mse_loss(ddp(x[mine]), y[mine]).backward()
                torch.nn.functional.mse_loss(ref(x), y).backward()
                opt.step()
                ref_opt.step()
            out[case] = _max_diff(ddp.module, ref)
            out[f"{case}_spread"] = _spread(ddp.module)
        # Join: rank r trains r + 2 batches; a rank that runs out shadows the others' all-reduces
        # (without Join the last rank would wait in its extra all-reduce until the timeout)
        torch.manual_seed(0)
        ddp = DDP(_Net(unused=False))
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        trained = 0
        with Join([ddp]):
            for x, y in _batches(1, r + 2, b):
                opt.zero_grad()
                torch.nn.functional.mse_loss(ddp(x), y).backward()
                opt.step()
                trained += 1
        out["join_trained"] = trained
    finally:
        dist.destroy_process_group()
    return out


def _spread(model: torch.nn.Module) -> float:
    """The largest difference between any rank's parameters and rank 0's (0 when DDP kept them equal)."""
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    first = flat.clone()
    dist.broadcast(first, src=0)
    return (flat - first).abs().max().item()


def fsdp2_mixed_precision(backend: str) -> dict[str, float]:
    """FSDP2 with bfloat16 parameters and float32 reduction: the same on this backend as on Gloo."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    _init(backend)
    r, n = dist.get_rank(), dist.get_world_size()
    b = 4
    try:
        gloo = dist.new_group(backend="gloo")
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        models = []
        for group in (dist.group.WORLD, gloo):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
            mesh = DeviceMesh.from_group(group, "cpu")
            for layer in (model[0], model[2]):
                fully_shard(layer, mesh=mesh, mp_policy=policy)
            fully_shard(model, mesh=mesh, mp_policy=policy)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for x, y in _batches(n, 3, b):
                opt.zero_grad()
                mine = slice(r * b, (r + 1) * b)
                torch.nn.functional.mse_loss(model(x[mine]).float(), y[mine]).backward()
                opt.step()
            models.append([p.full_tensor() for p in model.parameters()])
        ours, theirs = models
        return {"vs_gloo": max((p - q).abs().max().item() for p, q in zip(ours, theirs, strict=True))}
    finally:
        dist.destroy_process_group()


def dtensor_2d(backend: str) -> dict[str, Any]:
    """DTensor on a 2x2 mesh (4 ranks): shard on both dimensions, redistribute, full_tensor."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    _init(backend)
    r = dist.get_rank()
    try:
        # Ranks 1-3 make one group more than rank 0 before the mesh's: each group must still be named
        # alike on its members (not by each process's count) and know its global ranks.
        last_three = dist.new_group([1, 2, 3])
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        full = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
        both = distribute_tensor(full, mesh, [Shard(0), Shard(1)])
        row, col = divmod(r, 2)
        assert torch.equal(both.to_local(), full[4 * row : 4 * (row + 1), 3 * col : 3 * (col + 1)])
        assert torch.equal(both.full_tensor(), full)
        rows = both.redistribute(mesh, [Shard(0), Replicate()])
        assert torch.equal(rows.to_local(), full[4 * row : 4 * (row + 1)])
        everywhere = rows.redistribute(mesh, [Replicate(), Replicate()])
        assert torch.equal(everywhere.to_local(), full)
        inner = [_inner_backend(mesh.get_group(d)) for d in ("dp", "tp")]
        groups = [mesh.get_group(d) for d in ("dp", "tp")] + ([last_three] if r else [])
        names = {}
        for g in groups:
            ours = g.commlib_group
            names[str(dist.get_process_group_ranks(g))] = [ours.group_name, ours.global_ranks]
        made_from_torch_group = None
        if r:  # a commlib group made from a torch subgroup: global ranks 1 and 3
            sub = last_three.commlib_group.new_group([0, 2])
            if r != 2:
                t = torch.tensor([float(r)])
                sub.all_reduce(t)
                made_from_torch_group = [list(sub.global_ranks), t.item()]
                sub.close()
        return {"ok": True, "inner": inner, "names": names, "from_torch_group": made_from_torch_group}
    finally:
        dist.destroy_process_group()


def pipeline_parity(backend: str) -> dict[str, float]:
    """A 2-stage pipeline (GPipe, then 1F1B) over the backend's send/recv, against one process."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    _init(backend)
    r, n = dist.get_rank(), dist.get_world_size()
    assert n == 2, "one stage per rank"
    diffs: dict[str, float] = {}
    try:
        for name, schedule_class in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)):
            torch.manual_seed(0)
            ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
            part = copy.deepcopy(ref[:2] if r == 0 else ref[2:])
            stage = PipelineStage(part, r, n, torch.device("cpu"))
            schedule = schedule_class(stage, n_microbatches=4, loss_fn=torch.nn.functional.mse_loss)
            opt = torch.optim.SGD(part.parameters(), lr=0.1)
            ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
            for x, y in _batches(1, 3, 8):
                opt.zero_grad()
                ref_opt.zero_grad()
                if r == 0:
                    schedule.step(x)
                else:
                    schedule.step(target=y)
                torch.nn.functional.mse_loss(ref(x), y).backward()
                opt.step()
                ref_opt.step()
            mirror = ref[:2] if r == 0 else ref[2:]
            diffs[name] = _max_diff(part, mirror)
    finally:
        dist.destroy_process_group()
    return diffs


def all_gather_coalesced(backend: str) -> dict[str, Any]:
    """``dist.all_gather_coalesced``, sync and async: ``outputs[r][i]`` receives rank ``r``'s input ``i``."""
    import warnings

    _init(backend)
    r, n = dist.get_rank(), dist.get_world_size()
    shapes = [(2,), (1,), (2, 3)]
    out: dict[str, Any] = {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch plans to deprecate the function
            for async_op in (False, True):
                inputs = [torch.full(s, float(10 * i + r)) for i, s in enumerate(shapes)]
                outputs = [[torch.full(s, -1.0) for s in shapes] for _ in range(n)]
                work = dist.all_gather_coalesced(outputs, inputs, async_op=async_op)
                if async_op:
                    work.wait()
                out["async" if async_op else "sync"] = [[t.tolist() for t in row] for row in outputs]
            by_input = [[torch.empty(s) for _ in range(n)] for s in shapes]  # the layout torch does not use
            try:
                dist.all_gather_coalesced(by_input, [torch.zeros(s) for s in shapes])
            except ValueError as e:
                out["wrong_layout"] = str(e)
    finally:
        dist.destroy_process_group()
    return out


def layouts(backend: str) -> dict[str, Any]:
    """Transposed, sliced and channels_last tensors in every collective, sync and async, against closed forms.

    The adapter runs each on a contiguous copy and copies the result back before the call, ``wait()``
    or the future completes. What Gloo refuses stays refused: a non-contiguous ``all_to_all_single``
    input or ``send`` tensor; so is an ``expand()``ed output. Returns the refusals' messages.
    """
    _init(backend)
    r, n = dist.get_rank(), dist.get_world_size()
    base = torch.arange(6.0).reshape(2, 3)
    mine = base + 10 * r  # rank q holds base + 10 q
    total = n * base + 10 * (n * (n - 1) // 2)  # their sum
    every = torch.cat([base + 10 * q for q in range(n)])  # their concatenation, (2n, 3)
    refused: dict[str, str] = {}
    try:
        t = mine.t().contiguous().t()  # (2, 3), stride (1, 2)
        dist.all_reduce(t)
        assert torch.equal(t, total), t
        # async: the result is back in x before the future's callback and wait() see it
        x = (torch.arange(24.0).reshape(1, 2, 3, 4) + r).to(memory_format=torch.channels_last)
        work = dist.all_reduce(x, async_op=True)
        seen = work.get_future().then(lambda f: f.value()[0].sum().item())
        assert work.wait() is True
        expected = n * torch.arange(24.0).reshape(1, 2, 3, 4) + n * (n - 1) // 2
        assert torch.equal(x, expected) and x.is_contiguous(memory_format=torch.channels_last)
        assert seen.wait() == expected.sum().item()
        t = mine.t().contiguous().t()
        dist.broadcast(t, src=n - 1)
        assert torch.equal(t, base + 10 * (n - 1)), t
        # all_gather along dim 1, in place: into column views of one tensor, from this rank's view
        wide = torch.zeros(2, 3 * n)
        columns = list(wide.chunk(n, dim=1))
        columns[r].copy_(mine)
        dist.all_gather(columns, columns[r])
        assert torch.equal(wide, torch.cat([base + 10 * q for q in range(n)], dim=1)), wide
        flat = torch.zeros(3, 2 * n).t()
        dist.all_gather_into_tensor(flat, mine.t().contiguous().t(), async_op=True).wait()
        assert torch.equal(flat, every), flat
        part = torch.zeros(3, 2).t()
        dist.reduce_scatter_tensor(part, (every * (r + 1)).t().contiguous().t())
        assert torch.equal(part, (base + 10 * r) * (n * (n + 1) // 2)), part
        part = torch.zeros(3, 2).t()
        dist.reduce_scatter(part, [(base + 10 * q).t().contiguous().t() for q in range(n)])
        assert torch.equal(part, mine * n), part
        gathered = [torch.zeros(3, 2).t() for _ in range(n)] if r == 0 else None
        dist.gather(mine.t().contiguous().t(), gathered, dst=0)
        if gathered is not None:
            assert torch.equal(torch.cat(gathered), every), gathered
        got = torch.zeros(3, 2).t()
        dist.scatter(got, [(base + 10 * q).t().contiguous().t() for q in range(n)] if r == 0 else None, src=0)
        assert torch.equal(got, mine), got
        outs = [torch.zeros(3, 2).t() for _ in range(n)]
        dist.all_to_all(outs, [(base + 10 * r + q).t().contiguous().t() for q in range(n)])
        assert all(torch.equal(o, base + 10 * q + r) for q, o in enumerate(outs)), outs
        received = torch.zeros(3, 2 * n).t()
        dist.all_to_all_single(received, torch.cat([base + 10 * r + q for q in range(n)]))
        assert torch.equal(received, torch.cat([base + 10 * q + r for q in range(n)])), received
        a, b = mine.t().contiguous().t(), torch.full((3,), float(r))
        with dist._coalescing_manager(async_ops=True) as manager:
            dist.all_reduce(a)
            dist.all_reduce(b)
        manager.wait()
        assert torch.equal(a, total) and b.tolist() == [float(n * (n - 1) // 2)] * 3, (a, b)
        strided = every.t().contiguous().t()
        for name, call in (
            ("all_to_all_single", lambda: dist.all_to_all_single(torch.zeros(2 * n, 3), strided)),
            ("expanded", lambda: dist.all_reduce(torch.ones(1).expand(3))),
            ("send", lambda: dist.send(mine.t(), dst=1) if r == 0 else None),
        ):
            try:
                call()
            except ValueError as e:
                refused[name] = str(e)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return {"refused": refused}


def complex_and_futures(backend: str) -> dict[str, Any]:
    """Complex ``reduce`` and reduce-scatters (SUM, AVG, PREMUL_SUM); futures and ``result()`` as Gloo's.

    Returns the message of a complex MAX, which is refused.
    """
    _init(backend)
    r, n = dist.get_rank(), dist.get_world_size()
    v = torch.tensor([1 + 2j, -3j], dtype=torch.complex64)  # rank q contributes (q + 1) v
    total = n * (n + 1) / 2
    try:
        for name, op, k in (
            ("sum", dist.ReduceOp.SUM, total),
            ("avg", dist.ReduceOp.AVG, total / n),
            ("premul_sum", dist._make_nccl_premul_sum(0.5), total / 2),
        ):
            t = v * (r + 1)
            dist.reduce(t, dst=0, op=op)
            if r == 0:
                assert torch.equal(t, v * k), (name, t)
            part = torch.zeros(2, dtype=torch.complex64)
            dist.reduce_scatter_tensor(part, (v * (r + 1)).repeat(n), op=op)
            assert torch.equal(part, v * k), (name, part)
            spaced = torch.zeros(4, dtype=torch.complex64)  # its [::2] is not contiguous
            dist.reduce_scatter(spaced[::2], [v * (r + 1) * (q + 1) for q in range(n)], op=op)
            assert torch.equal(spaced[::2], v * k * (r + 1)) and not spaced[1::2].any(), (name, spaced)
        try:
            dist.reduce(v.clone(), dst=0, op=dist.ReduceOp.MAX)
            complex_max = ""
        except TypeError as e:
            complex_max = str(e)
        # the futures hold Gloo's values: all_gather's output list, gather's (empty off dst),
        # all_gather_into_tensor's per-rank blocks; result() returns the same
        outs = [torch.empty(2) for _ in range(n)]
        work = dist.all_gather(outs, torch.full((2,), float(r)), async_op=True)
        last = work.get_future().then(lambda f: f.value()[-1].sum().item())
        assert work.wait() is True and last.wait() == 2.0 * (n - 1)
        assert len(work.result()) == n and all(a is b for a, b in zip(work.result(), outs, strict=True))
        gathered = [torch.empty(1) for _ in range(n)] if r == 0 else None
        work = dist.gather(torch.full((1,), float(r)), gathered, dst=0, async_op=True)
        value = work.get_future().wait()
        assert [t.item() for t in value] == ([float(q) for q in range(n)] if r == 0 else []), value
        flat = torch.empty(2 * n)
        work = dist.all_gather_into_tensor(flat, torch.full((2,), float(r)), async_op=True)
        blocks = work.get_future().wait()
        assert [b.tolist() for b in blocks] == [[float(q)] * 2 for q in range(n)], blocks
        assert blocks[0].data_ptr() == flat.data_ptr() and len(work.result()) == n
        t = torch.full((2,), float(r + 1))
        work = dist.all_reduce(t, async_op=True)
        work.wait()
        assert work.result()[0] is t and t.tolist() == [total] * 2
    finally:
        dist.destroy_process_group()
    return {"complex_max": complex_max}


def on_torch(group: Any, bodies: str, backend: str, *args: Any) -> dict[str, Any]:
    """Run each of ``bodies`` (names joined by ``+``) as ``body(backend, *args)``; return ``{name: value}``.

    In ranks that already hold a commlib ``group``: ranks a ``RankPool`` keeps
    alive between tests, and jobs mpiexec started (``mpi_bodies.launch``),
    which set no torchrun variables. The rank and size
    come from ``group``; torch's store listens at a port rank 0 picks and shares
    over ``group``, a new one for each body.
    """
    from commlib.ports import free_port

    values = {}
    for body in bodies.split("+"):
        port = [free_port() if group.rank == 0 else None]
        group.broadcast_object_list(port, 0)
        os.environ.update(
            RANK=str(group.rank),
            WORLD_SIZE=str(group.world_size),
            MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"),
            MASTER_PORT=str(port[0]),
        )
        values[body] = globals()[body](backend, *args)
    return values


def as_launched(group: Any, bodies: str, backend: str) -> dict[str, Any]:
    """Run each of ``bodies`` (joined by ``+``) in ranks as the launcher set them up (torchrun: its store)."""
    return {body: globals()[body](backend) for body in bodies.split("+")}
