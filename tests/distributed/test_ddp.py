"""DistributedDataParallel on real backends (spawned ranks), and the test bodies shared with the unit tests.

Each ``case_*`` function is a test body ``fn(group, *args)``: it runs on every rank,
with a real process group here (``RankPool``) and with threaded fake groups in
``tests/test_ddp_unit.py``. A body checks what one rank can check and returns
numbers for the parent to compare across ranks.

Equivalence bodies train DDP on this rank's share of each batch, and beside it a
plain model on the whole batch (every rank computes that reference itself, from
rank 0's initial weights), and return the largest parameter difference.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import subprocess
import sys
import threading

import pytest
import torch
from torch import nn

from ddp import DistributedDataParallel, MissingGradientsError, ModelMismatchError
from ddp.config import MB
from examples.gpt import GPT, GPTConfig, synthetic_batch
from tests._launcher import RankPool, run_ranks
from tests.conftest import available_backend_names, run_job, scrubbed_env
from tests.distributed import ddp_feature_bodies as features
from tests.distributed import parity_bodies as parity

# ----------------------------------------------------------------- models
PER_RANK = 4


class Branches(nn.Module):
    """Parallel linear branches summed: gradients stay integer-valued (or dyadic) with integer data."""

    def __init__(self, n: int = 4, d_in: int = 6, d_out: int = 4, *, extra: int = 0) -> None:
        super().__init__()
        self.branches = nn.ModuleList(nn.Linear(d_in, d_out) for _ in range(n))
        self.unused = nn.Linear(d_in, d_out) if extra else None

    def forward(self, x: torch.Tensor, use: tuple[int, ...] | None = None) -> torch.Tensor:
        use = tuple(range(len(self.branches))) if use is None else use
        out = self.branches[use[0]](x)
        for i in use[1:]:
            out = out + self.branches[i](x)
        return out


def integer_init(model: nn.Module, seed: int) -> nn.Module:
    """Small integer weights (exactly representable, so sums are exact)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randint(-3, 4, p.shape, generator=gen).to(p.dtype))
    return model


def int_batch(step: int, world: int, d_in: int = 6, d_out: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    n = PER_RANK * world
    x = torch.randint(-4, 5, (n, d_in), generator=gen).double()
    y = torch.randint(-4, 5, (n, d_out), generator=gen).double()
    return x, y


def shard(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = t.shape[0] // world
    return t[rank * n : (rank + 1) * n]


TINY_GPT = dict(vocab_size=50, context=8, d_model=16, n_layers=2, n_heads=2)


_BUILD_LOCK = threading.Lock()  # threaded fake ranks share torch's global generator


def build(kind: str, seed: int) -> nn.Module:
    """A fresh model of ``kind``, initialised from ``seed`` (float64)."""
    with _BUILD_LOCK:
        torch.manual_seed(seed)
        return _build(kind, seed)


def _build(kind: str, seed: int) -> nn.Module:
    if kind == "branches":
        return integer_init(Branches().double(), seed)
    if kind == "gpt":
        return GPT(GPTConfig(**TINY_GPT)).double()
    if kind == "gpt_tied":
        return GPT(GPTConfig(**TINY_GPT, tie_weights=True)).double()
    if kind == "frozen":
        model = integer_init(Branches().double(), seed)
        model.branches[1].requires_grad_(False)
        model.register_buffer("counter", torch.tensor([seed], dtype=torch.int64))
        return model
    raise ValueError(kind)


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=2.0**-6, momentum=0.5)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def loss_on(kind: str, model: nn.Module, step: int, world: int, rank: int | None) -> torch.Tensor:
    """Loss of ``model`` on this step's batch: rank ``rank``'s share, or the whole batch (None).

    The batch goes to the device of the model's parameters.
    """
    device = next(model.parameters()).device
    if kind.startswith("gpt"):
        x, y = synthetic_batch(GPTConfig(**TINY_GPT), PER_RANK * world, seed=3, step=step)
        if rank is not None:
            x, y = shard(x, rank, world), shard(y, rank, world)
        return GPT.loss(model(x.to(device)), y.to(device))
    x, y = int_batch(step, world)
    if rank is not None:
        x, y = shard(x, rank, world), shard(y, rank, world)
    return nn.functional.mse_loss(model(x.to(device)), y.to(device))


def bucket_cap_mb(model: nn.Module, buckets: str) -> float:
    """``one``: everything in one bucket; ``several``: about three; ``per_param``: 0."""
    total = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return {"one": 25.0, "several": total / 3 / MB, "per_param": 0.0}[buckets]


def max_diff(a: nn.Module, b: nn.Module) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters(), strict=True))


# ------------------------------------------------------------ test bodies
def case_equivalence(
    group, kind: str, opt_name: str, buckets: str, steps: int = 3, device: str = "cpu"
) -> dict:
    """DDP on shards == one process on the whole batch, step after step (models on ``device``)."""
    rank, world = group.rank, group.world_size
    model = build(kind, seed=100 + rank).to(device)  # ranks start different: the broadcast must fix it
    reference = build(kind, seed=100).to(device)
    ddp = DistributedDataParallel(model, group, bucket_size_mb=bucket_cap_mb(model, buckets))
    opt = make_optimizer(opt_name, ddp.parameters())
    ref_opt = make_optimizer(opt_name, reference.parameters())
    diffs = [max_diff(ddp.module, reference)]
    for step in range(steps):
        opt.zero_grad()
        loss_on(kind, ddp, step, world, rank).backward()
        opt.step()
        ref_opt.zero_grad()
        loss_on(kind, reference, step, world, None).backward()
        ref_opt.step()
        diffs.append(max_diff(ddp.module, reference))
    stats = ddp.last_step_stats
    frozen_ok = all(p.grad is None for p in model.parameters() if not p.requires_grad)
    buffers = [b.cpu().tolist() for b in model.buffers()]
    return {
        "diffs": diffs,
        "buckets": ddp.bucket_manager.num_buckets,
        "table_buckets": len(ddp.bucket_manager.row_sparse_buckets),
        "trainable": sum(1 for p in model.parameters() if p.requires_grad),
        "collectives": stats.collectives,
        "bytes": stats.bytes_reduced,
        "frozen_grads_none": frozen_ok,
        "buffers": buffers,
        "checksum": float(sum(p.detach().double().sum() for p in model.parameters())),
    }


def _branch_plan(step: int, rank: int) -> tuple[int, ...]:
    """Which branches rank ``rank`` uses at ``step``: differs by rank and by step.

    Branch 3 is used by nobody at odd steps (globally unused: its grad must stay None).
    """
    plans = [(0, 1, 2, 3), (0, 2), (1,), (0, 1, 3)]
    use = plans[(step + rank) % len(plans)]
    if step % 2:
        use = tuple(i for i in use if i != 3) or (0,)
    return use


def case_conditional(group, opt_name: str, steps: int = 4, device: str = "cpu") -> dict:
    """find_unused_parameters=True with branches that differ by rank and by step."""
    rank, world = group.rank, group.world_size
    model = integer_init(Branches(extra=1).double(), 200 + rank).to(device)
    reference = integer_init(Branches(extra=1).double(), 200).to(device)
    ddp = DistributedDataParallel(model, group, bucket_size_mb=0.0001, find_unused_parameters=True)
    opt = make_optimizer(opt_name, ddp.parameters())
    ref_opt = make_optimizer(opt_name, reference.parameters())
    diffs, unused, none_grads = [], [], []
    for step in range(steps):
        x, y = (t.to(device) for t in int_batch(step, world))
        opt.zero_grad()
        out = ddp(shard(x, rank, world), _branch_plan(step, rank))
        nn.functional.mse_loss(out, shard(y, rank, world)).backward()
        unused.append(ddp.unused_parameters)
        none_grads.append(sorted(n for n, p in model.named_parameters() if p.grad is None))
        opt.step()
        ref_opt.zero_grad()
        losses = [
            nn.functional.mse_loss(reference(shard(x, r, world), _branch_plan(step, r)), shard(y, r, world))
            for r in range(world)
        ]
        (sum(losses) / world).backward()
        ref_opt.step()
        diffs.append(max_diff(ddp.module, reference))
    return {"diffs": diffs, "unused": unused, "none_grads": none_grads}


def case_missing_gradients(group, asymmetric: bool) -> str:
    """Without find_unused_parameters, a backward that misses gradients raises (never hangs)."""
    rank = group.rank
    model = integer_init(Branches().double(), 7)
    ddp = DistributedDataParallel(model, group, bucket_size_mb=0)
    x, y = int_batch(0, group.world_size)
    use = (0, 1) if (not asymmetric or rank == 0) else None
    try:
        nn.functional.mse_loss(
            ddp(shard(x, rank, group.world_size), use), shard(y, rank, group.world_size)
        ).backward()
    except MissingGradientsError as e:
        # The module stays usable: a full step afterwards works on every rank (symmetric case).
        if not asymmetric:
            ddp(x).sum().backward()
        return f"raised: {e}"
    return "ok"


def case_mismatch(group) -> str:
    """Ranks whose models differ: every rank raises, naming the parameter and the ranks."""
    width = 5 if group.rank == group.world_size - 1 else 4
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2), nn.Linear(2, width))
    try:
        DistributedDataParallel(model, group)
    except ModelMismatchError as e:
        return str(e)
    return "no error"


def case_no_sync(group, find_unused: bool, micro: int = 3, device: str = "cpu") -> dict:
    """Gradient accumulation: micro-batches inside no_sync, then one synchronised backward."""
    rank, world = group.rank, group.world_size
    model = integer_init(Branches().double(), 300 + rank).to(device)
    reference = integer_init(Branches().double(), 300).to(device)
    ddp = DistributedDataParallel(model, group, bucket_size_mb=0.0001, find_unused_parameters=find_unused)
    opt = make_optimizer("sgd", ddp.parameters())
    ref_opt = make_optimizer("sgd", reference.parameters())
    # With find_unused, branch 3 is used only in the first micro-batch: its accumulated gradient is reduced.
    plans = [(0, 1, 2, 3)] + [(0, 1, 2)] * (micro - 1) if find_unused else [None] * micro
    diffs, synced, collectives = [], [], []
    for step in range(2):
        opt.zero_grad()
        ref_opt.zero_grad()
        for k in range(micro):
            x, y = (t.to(device) for t in int_batch(10 * step + k, world))
            ctx = ddp.no_sync() if k < micro - 1 else contextlib.nullcontext()
            with ctx:
                nn.functional.mse_loss(ddp(shard(x, rank, world), plans[k]), shard(y, rank, world)).backward()
            synced.append(ddp.last_step_stats.synced)
            collectives.append(ddp.last_step_stats.collectives)
            losses = [
                nn.functional.mse_loss(reference(shard(x, r, world), plans[k]), shard(y, r, world))
                for r in range(world)
            ]
            (sum(losses) / world).backward()
        opt.step()
        ref_opt.step()
        diffs.append(max_diff(ddp.module, reference))
    return {"diffs": diffs, "synced": synced, "collectives": collectives}


def case_zero_parameters(group) -> dict:
    """A model without trainable parameters: no buckets, no communication in backward."""
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    model.requires_grad_(False)
    ddp = DistributedDataParallel(model, group)
    x = torch.ones(2, 3, requires_grad=True)
    ddp(x).sum().backward()
    empty = DistributedDataParallel(nn.Identity(), group)
    empty(x).sum().backward()
    return {
        "buckets": ddp.bucket_manager.num_buckets + empty.bucket_manager.num_buckets,
        "stats": (ddp.last_step_stats, empty.last_step_stats),
        "params_equal_rank0": True,
    }


class TwoWays(nn.Module):
    """Two layers whose gradients arrive in an order that depends on the rank."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rank == 0:  # 'first' runs last in forward, so its gradients arrive first
            return self.second(x) + self.first(x)
        return self.first(x) + self.second(x)


def case_rebuild(group) -> dict:
    """Arrival order differs across ranks; after step 1 every rank uses rank 0's order."""
    rank = group.rank
    ddp = DistributedDataParallel(TwoWays(rank).double(), group, bucket_size_mb=0)
    layouts, ptrs = [ddp.bucket_manager.layout], []
    for _ in range(3):
        ddp.zero_grad(set_to_none=True)
        ddp(torch.ones(2, 4, dtype=torch.float64) * (rank + 1)).sum().backward()
        layouts.append(ddp.bucket_manager.layout)
        ptrs.append([p.grad.data_ptr() for p in ddp.parameters()])
        grads = [p.grad.clone() for p in ddp.parameters()]
    return {"layouts": layouts, "ptrs": ptrs, "grads": grads, "copied": ddp.last_step_stats.grads_copied}


# ----------------------------------------------------------------- checks
def check_equivalence(results: list[dict], tol: float, buckets: str) -> None:
    for r in results:
        assert r["diffs"][0] == 0.0, "rank 0's weights were not broadcast"
        assert max(r["diffs"]) <= tol, r["diffs"]
    # Embedding tables exchanged by touched rows get buckets of their own.
    expected = {"one": 1 + results[0]["table_buckets"], "per_param": results[0]["trainable"]}.get(buckets)
    n = results[0]["buckets"]
    assert n == expected if expected else 1 < n < results[0]["trainable"]
    assert len({r["checksum"] for r in results}) == 1


def check_conditional(results: list[dict]) -> None:
    for r in results:
        assert max(r["diffs"]) <= 1e-12, r["diffs"]
        assert all({"unused.weight", "unused.bias"} <= set(names) for names in r["unused"])
    # Branch 3 is used by nobody at odd steps: its gradient is None there on every rank.
    assert all("branches.3.weight" in r["none_grads"][s] for r in results for s in (1, 3))


def check_missing(results: list[str]) -> None:
    for r in results:
        assert r.startswith("raised: [rank ") and "ddp.backward" in r
        assert "branches.2.weight" in r and "gradients ready" in r and "find_unused_parameters=True" in r


def check_mismatch(results: list[str]) -> None:
    for r in results:
        assert "differs across ranks" in r and "2.weight" in r and "(5, 2)" in r and "(4, 2)" in r
        assert "rank 0" in r and "rank 1" in r


def check_no_sync(results: list[dict]) -> None:
    for r in results:
        assert max(r["diffs"]) == 0.0, r["diffs"]
        assert r["synced"] == [False, False, True] * 2
        assert r["collectives"][0] == r["collectives"][1] == 0 and r["collectives"][2] > 0


# -------------------------------------------------------------- the real backends
pytestmark = pytest.mark.multiprocess

SPAWNABLE = [b for b in available_backend_names() if b != "mpi"]  # mpi: see test_mpi_backend_under_mpiexec


@pytest.fixture(
    scope="module",
    params=SPAWNABLE or [pytest.param("none", marks=pytest.mark.skip("no backend importable"))],
)
def pool(request):
    p = RankPool(2, request.param, env={"COMMLIB_TIMEOUT": "30"})
    try:
        yield p
    finally:
        p.close()


@pytest.mark.parametrize("buckets", ["one", "several", "per_param"])
@pytest.mark.parametrize(("kind", "opt_name", "tol"), [("branches", "sgd", 0.0), ("gpt", "adamw", 1e-10)])
def test_equivalence(pool, kind, opt_name, tol, buckets):
    check_equivalence(pool.run(case_equivalence, kind, opt_name, buckets, timeout=60), tol, buckets)


def test_tied_and_frozen(pool):
    check_equivalence(
        pool.run(case_equivalence, "gpt_tied", "adamw", "several", 2, timeout=60), 1e-10, "several"
    )
    frozen = pool.run(case_equivalence, "frozen", "sgd", "per_param", 2, timeout=60)
    check_equivalence(frozen, 0.0, "per_param")
    assert all(r["frozen_grads_none"] for r in frozen)
    assert frozen[0]["buffers"] == frozen[1]["buffers"] == [[100]]


def test_unused_parameters_and_conditional_branches(pool):
    check_conditional(pool.run(case_conditional, "adamw", timeout=60))


def test_missing_gradients_raise_on_every_rank(pool):
    check_missing(pool.run(case_missing_gradients, False, timeout=60))


def test_missing_gradients_on_one_rank_do_not_hang_the_others(pool):
    outcomes = pool.run_outcomes(case_missing_gradients, True, timeout=60)
    assert not any(o.timed_out for o in outcomes)
    assert outcomes[0].value.startswith("raised:") and "branches.2" in outcomes[0].value
    assert outcomes[1].ok


def test_mismatched_models_raise_on_every_rank(pool):
    check_mismatch(pool.run(case_mismatch, timeout=60))


@pytest.mark.parametrize("find_unused", [False, True])
def test_no_sync_accumulation(pool, find_unused):
    check_no_sync(pool.run(case_no_sync, find_unused, timeout=60))


def test_zero_parameters_and_rebuild(pool):
    for r in pool.run(case_zero_parameters, timeout=60):
        assert r["buckets"] == 0 and r["stats"] == (None, None)
    r0, r1 = pool.run(case_rebuild, timeout=60)
    assert r0["layouts"][1] == r1["layouts"][1] == r0["layouts"][3] == r1["layouts"][3]
    assert r0["layouts"][1] != r0["layouts"][0] and r0["layouts"][1][0][0].startswith("first.")
    assert r0["ptrs"][1] == r0["ptrs"][2]
    assert all(torch.equal(a, b) for a, b in zip(r0["grads"], r1["grads"], strict=True))


def test_world_size_one():
    (result,) = run_ranks(
        case_equivalence, 1, backend="ring", args=("gpt", "adamw", "several", 2), timeout=60
    )
    assert max(result["diffs"]) <= 1e-10


# ------------------------------------------------------ under mpiexec (mpi)
MPI_CASES = {
    "sgd_several": (case_equivalence, ("branches", "sgd", "several")),
    "sgd_per_param": (case_equivalence, ("branches", "sgd", "per_param")),
    "adamw_one": (case_equivalence, ("gpt", "adamw", "one")),
    "conditional": (case_conditional, ("adamw",)),
    "no_sync": (case_no_sync, (True,)),
    "missing": (case_missing_gradients, (False,)),
    "mismatch": (case_mismatch, ()),
    "hook_allreduce": (features.case_hook_gradients, ("allreduce",)),
    "hook_bf16": (features.case_hook_gradients, ("bf16",)),
    "powersgd": (features.case_powersgd_training, ()),
    "nonfinite": (features.case_nonfinite, ("nan", 1)),
    "join": (parity.case_join, ([3, 5],)),
    "buffers": (parity.case_buffers_every_forward, ()),
    "static_graph": (parity.case_static_graph, ()),
    "repeated_gradient": (parity.case_repeated_gradient, ()),
}
_OUT_VAR = "COMMLIB_DDP_CASES_OUT"


@pytest.mark.mpi
def test_mpi_backend_under_mpiexec(mpiexec, repo_root, tmp_path):
    """The mpi backend needs ranks started by mpiexec: run the same bodies there."""
    env = scrubbed_env(
        PYTHONPATH=str(repo_root),
        COMMLIB_BACKEND="mpi",
        COMMLIB_TIMEOUT="60",
        OMP_NUM_THREADS="1",
        **{_OUT_VAR: str(tmp_path)},
    )
    proc = run_job(
        [*mpiexec(2), sys.executable, "-m", "tests.distributed.test_ddp"], timeout=180, env=env, cwd=repo_root
    )
    files = sorted(tmp_path.glob("rank*.json"))
    assert proc.returncode == 0 and len(files) == 2, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    ranks = [json.loads(f.read_text()) for f in files]
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["backend"] == "mpi" for r in ranks)
    by_case = {name: [r[name] for r in ranks] for name in MPI_CASES}
    check_equivalence(by_case["sgd_several"], 0.0, "several")
    check_equivalence(by_case["sgd_per_param"], 0.0, "per_param")
    check_equivalence(by_case["adamw_one"], 1e-10, "one")
    check_conditional(by_case["conditional"])
    check_no_sync(by_case["no_sync"])
    check_missing(by_case["missing"])
    check_mismatch(by_case["mismatch"])
    features.check_hooks({"allreduce": by_case["hook_allreduce"], "bf16": by_case["hook_bf16"]})
    features.check_powersgd(by_case["powersgd"])
    features.check_nonfinite(by_case["nonfinite"], 1)
    parity.check_join(by_case["join"])
    parity.check_buffers(by_case["buffers"])
    assert len({r["params"] for r in by_case["static_graph"]}) == 1
    assert [r["after"] for r in by_case["repeated_gradient"]] == [2.0, 2.0]


def _main() -> None:
    """Run ``MPI_CASES`` on this rank (under a launcher); write ``$COMMLIB_DDP_CASES_OUT/rank<r>.json``."""
    import pathlib

    import commlib

    torch.set_num_threads(1)
    group = commlib.init_process_group()
    try:
        results = {name: fn(group, *args) for name, (fn, args) in MPI_CASES.items()}
        out = pathlib.Path(os.environ[_OUT_VAR]) / f"rank{group.rank}.json"
        out.write_text(json.dumps({"rank": group.rank, "backend": group.backend, **results}))
    finally:
        commlib.destroy_process_group()


# ------------------------------------------------------- the main job, the benchmark
def _run_script(args: list[str], repo_root, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = scrubbed_env(PYTHONPATH=str(repo_root), OMP_NUM_THREADS="1")
    try:
        return run_job([sys.executable, *args], timeout=timeout, env=env, cwd=repo_root)
    except subprocess.TimeoutExpired as e:  # run_job killed the script and the ranks it started
        pytest.fail(f"{args} did not finish within {timeout} s:\n{e.stdout}\n{e.stderr}")


def test_main_job_trains_on_two_ranks(repo_root):
    small = ["--steps", "6", "--d-model", "32", "--layers", "1", "--heads", "2", "--vocab", "100"]
    proc = _run_script(["examples/train_gpt.py", "--nproc", "2", *small, "--context", "16"], repo_root)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "train_gpt: 2 ranks, backend ring" in out
    assert out.count("loss") >= 6 and "step   6/6" in out and "coll" in out and "exposed" in out
    assert "parameters identical on all 2 ranks" in out


def test_ddp_step_benchmark_quick(repo_root, tmp_path):
    csv_path = tmp_path / "ddp.csv"
    proc = _run_script(
        [
            "benchmarks/ddp_step_bench.py",
            "--spawn",
            "2",
            "--quick",
            "--backends",
            "ring",
            "--zero",
            "--csv",
            str(csv_path),
        ],
        repo_root,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    modes = [
        "none",
        "ddp-ring",
        "ddp-ring+bf16",
        "ddp-ring+powersgd",
        "ddp-ring+zero",
        "ddp-ring+rs",
        "ddp-ring+rs-overlap",
        "ddp-null",
        "torch-ddp",
        "naive",
        "flat",
    ]
    modes.append("flat-reuse")
    for mode in modes:
        assert f"\n{mode} " in proc.stdout, proc.stdout
    assert "target ddp-ring within +8% of none" in proc.stdout
    assert "ddp-ring+bf16: bytes x0.500 of ddp-ring (bf16 target: half: met)" in proc.stdout
    rows = {r["mode"]: r for r in csv.DictReader(csv_path.open())}
    assert list(rows) == modes
    assert all(r["identical"] == "True" for name, r in rows.items() if name not in ("none", "ddp-null"))
    for name, row in rows.items():  # the step's phases, each a median of its own: they add up roughly
        phases = [float(row[k]) for k in ("forward_ms", "backward_ms", "optimizer_ms")]
        assert min(phases) > 0 and 0.5 < sum(phases) / float(row["median_ms"]) < 1.5, (name, row)
        # The tail (last gradient's arrival to the end of the sync) holds the exposed wait.
        assert 0 <= float(row["tail_ms"]) < float(row["backward_ms"]), (name, row)
        if row["exposed_ms"]:
            assert float(row["tail_ms"]) >= float(row["exposed_ms"]), (name, row)
    assert float(rows["ddp-ring+bf16"]["bytes_sent_mb"]) * 2 == pytest.approx(
        float(rows["ddp-ring"]["bytes_sent_mb"])
    )
    # Sharded AdamW: half the state per rank (plus at most a parameter's), and the reduce-scatter
    # half of the all-reduce's wire bytes (plus padding), then an all-gather in the step.
    ddp, zero, rs = (rows[m] for m in ("ddp-ring", "ddp-ring+zero", "ddp-ring+rs"))
    for row in (zero, rs):
        assert float(row["opt_state_mb"]) < 0.6 * float(ddp["opt_state_mb"]), row
        assert float(row["step_mb"]) > 0 and row["vs_no_hook"], row
    assert ddp["step_mb"] == "" and float(zero["wire_mb"]) == pytest.approx(float(ddp["wire_mb"]))
    assert float(rs["wire_mb"]) / float(ddp["wire_mb"]) == pytest.approx(0.5, abs=0.01)
    assert "ddp-ring+rs: state x" in proc.stdout and "backward wire bytes x0.50" in proc.stdout
    # The parameter all-gather: timed in every ZeRO mode (all of it held the step up without
    # overlap); with overlap, its hidden share is measured against the +rs mode's all-gather.
    overlap = rows["ddp-ring+rs-overlap"]
    assert float(overlap["wire_mb"]) == pytest.approx(float(rs["wire_mb"]))
    assert float(overlap["step_mb"]) == pytest.approx(float(rs["step_mb"])) and overlap["vs_no_hook"]
    for row in (zero, rs):
        assert float(row["gather_ms"]) > 0 and row["gather_wait_ms"] == row["gather_ms"], row
        assert row["hidden"] == "", row
    assert float(overlap["gather_ms"]) > 0 and float(overlap["gather_wait_ms"]) > 0, overlap
    hidden = 1 - float(overlap["gather_wait_ms"]) / float(rs["gather_ms"])
    assert float(overlap["hidden"]) == pytest.approx(hidden), overlap
    assert "ddp-ring+rs-overlap: state x" in proc.stdout and "% hidden" in proc.stdout
    assert "4 timed steps per mode" in proc.stdout  # --quick: 3 steps, rounded up to 2 turns of 3
    assert int(overlap["steps"]) == int(ddp["steps"]) == 4


if __name__ == "__main__":
    _main()
