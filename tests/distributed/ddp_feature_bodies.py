"""Test bodies for DDP's communication hooks, gradient scaling and precision, and the NaN check.

Each ``case_*`` runs on every rank as ``fn(group, *args)``: on threaded fake groups
(``tests/test_ddp_features.py``) and on spawned ranks of real backends
(``tests/distributed/test_ddp_features.py``). A body checks what one rank can and
returns plain values for the caller to compare across ranks.
"""

from __future__ import annotations

import hashlib
import threading
from typing import Any

import torch
from torch import nn

from commlib.process_group import IProcessGroup
from ddp import (
    DistributedDataParallel,
    GradientBucketManager,
    NonFiniteGradientError,
    PowerSGDState,
    allreduce_hook,
    bf16_compress_hook,
    fp16_compress_hook,
    powerSGD_hook,
)

_BUILD_LOCK = threading.Lock()  # threaded fake ranks share torch's global generator


def mlp(seed: int, widths: tuple[int, ...] = (12, 16, 8, 4)) -> nn.Module:
    """A float32 MLP with matrices and biases, from ``seed``."""
    with _BUILD_LOCK:
        torch.manual_seed(seed)
        layers: list[nn.Module] = []
        for a, b in zip(widths[:-1], widths[1:], strict=False):
            layers += [nn.Linear(a, b), nn.Tanh()]
        return nn.Sequential(*layers[:-1])


def batch(step: int, world: int, rank: int | None, d_in: int = 12, d_out: int = 4, per_rank: int = 6):
    """Random data of ``step``: rank ``rank``'s share, or the whole batch (None)."""
    gen = torch.Generator().manual_seed(500 + step)
    x = torch.randn(per_rank * world, d_in, generator=gen)
    y = torch.randn(per_rank * world, d_out, generator=gen)
    if rank is None:
        return x, y
    return x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank]


def local_grads(model: nn.Module, step: int, world: int, rank: int) -> list[torch.Tensor]:
    """The gradients rank ``rank`` computes alone at ``step`` (no communication), in float64."""
    model.zero_grad(set_to_none=True)
    x, y = batch(step, world, rank)
    nn.functional.mse_loss(model(x), y).backward()
    return [p.grad.double().clone() for p in model.parameters()]


def exact_average(step: int, world: int) -> list[torch.Tensor]:
    """The float64 average of every rank's float32 gradients at ``step`` (each rank recomputes all)."""
    model = mlp(7)
    per_rank = [local_grads(model, step, world, r) for r in range(world)]
    return [sum(gs) / world for gs in zip(*per_rank, strict=True)]  # type: ignore[misc]


def torch_style_hook(process_group: IProcessGroup, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """A hook written as one writes it for torch: divide, all-reduce, take the tensor from the future."""
    tensor = bucket.buffer()
    tensor.div_(process_group.world_size)
    work = process_group.all_reduce(tensor, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


HOOKS = {
    "none": None,
    "allreduce": allreduce_hook,
    "fp16": fp16_compress_hook,
    "bf16": bf16_compress_hook,
    "torch_style": torch_style_hook,
}


def case_hook_gradients(group, hook: str, bucket_size_mb: float = 0.0005, steps: int = 2) -> dict:
    """Gradients with ``hook`` against DDP without one and against the exact float64 average.

    Returns, per step: whether the gradients equal the no-hook ones bit for bit,
    the largest error relative to the exact average's scale, and the bytes sent
    and reduced; plus the order in which the hook saw the buckets.
    """
    rank, world = group.rank, group.world_size
    plain = DistributedDataParallel(mlp(7), group, bucket_size_mb=bucket_size_mb, rebuild_buckets=False)
    hooked = DistributedDataParallel(mlp(7), group, bucket_size_mb=bucket_size_mb, rebuild_buckets=False)
    seen: list[tuple[int, bool]] = []
    if HOOKS[hook] is not None:
        inner = HOOKS[hook]

        def recording(state: Any, bucket: Any) -> torch.futures.Future[Any]:
            seen.append((bucket.index(), bucket.is_last()))
            return inner(state, bucket)

        hooked.register_comm_hook(group, recording)
    out: dict[str, list[Any]] = {"identical": [], "error": [], "bytes_sent": [], "bytes_reduced": []}
    for step in range(steps):
        grads = []
        for model in (plain, hooked):
            model.zero_grad(set_to_none=True)
            x, y = batch(step, world, rank)
            nn.functional.mse_loss(model(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        exact = exact_average(step, world)
        out["identical"].append(all(torch.equal(a, b) for a, b in zip(*grads, strict=True)))
        out["error"].append(
            max(
                float((g.double() - e).abs().max() / e.abs().max())
                for g, e in zip(grads[1], exact, strict=True)
            )
        )
        stats = hooked.last_step_stats
        out["bytes_sent"].append(stats.bytes_sent)
        out["bytes_reduced"].append(stats.bytes_reduced)
    out["seen"] = seen
    out["buckets"] = hooked.bucket_manager.num_buckets
    out["digest"] = digest(hooked.module)
    return out


def digest(model: nn.Module) -> str:
    """SHA-256 of the parameters and their gradients (to compare ranks bit for bit)."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
        if p.grad is not None:
            h.update(p.grad.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def case_powersgd_training(group, steps: int = 60, rank_r: int = 4) -> dict:
    """Train a regression MLP with and without PowerSGD; return full-batch losses and a digest."""
    rank, world = group.rank, group.world_size
    gen = torch.Generator().manual_seed(11)
    teacher = torch.randn(24, 16, generator=gen) / 4
    x_all = torch.randn(16 * world, 24, generator=gen)
    y_all = x_all @ teacher + 0.3 * torch.randn(16 * world, 16, generator=gen)  # noise floor 0.09
    x, y = x_all[rank * 16 : (rank + 1) * 16], y_all[rank * 16 : (rank + 1) * 16]
    results: dict[str, Any] = {}
    for name in ("plain", "powersgd"):
        model = DistributedDataParallel(mlp(3, (24, 32, 16)), group, bucket_size_mb=0.002)
        state = None
        if name == "powersgd":
            state = PowerSGDState(group, matrix_approximation_rank=rank_r, start_powerSGD_iter=3)
            model.register_comm_hook(state, powerSGD_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        first = None
        for _ in range(steps):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            first = first if first is not None else loss.item()
        with torch.no_grad():
            full = float(nn.functional.mse_loss(model.module(x_all), y_all))
        results[name] = {
            "initial": first,
            "final": full,
            "digest": digest(model.module),
            "bytes_sent": model.last_step_stats.bytes_sent,
            "bytes_reduced": model.last_step_stats.bytes_reduced,
            "compression": state.compression_rate if state is not None else 1.0,
        }
    return results


def case_nonfinite(group, kind: str, bad_rank: int, check: bool = True) -> list[Any]:
    """Step 0 clean; at step 1 rank ``bad_rank`` gets ``kind`` (nan, inf, none) in one gradient; step 2 clean.

    Returns, per step, "ok" or the error's (type, ranks, parameters, message), and
    whether the gradient of ``1.weight`` held non-finite values after the step.
    """
    rank, world = group.rank, group.world_size
    model = mlp(5)
    ddp = DistributedDataParallel(model, group, bucket_size_mb=0.0005, check_for_nan_in_grad=check)
    target = dict(model.named_parameters())["2.weight"]
    poison = {"nan": float("nan"), "inf": float("inf")}.get(kind)
    out: list[Any] = []
    for step in range(3):
        handle = None
        if step == 1 and rank == bad_rank and poison is not None:

            def spoil(grad: torch.Tensor, value: float = poison) -> torch.Tensor:
                grad = grad.clone()
                grad[0, 0] = value
                return grad

            handle = target.register_hook(spoil)
        ddp.zero_grad(set_to_none=True)
        x, y = batch(step, world, rank)
        try:
            nn.functional.mse_loss(ddp(x), y).backward()
            outcome: Any = "ok"
        except NonFiniteGradientError as e:
            outcome = (
                "NonFiniteGradientError",
                list(e.ranks),
                {str(k): v for k, v in e.parameters.items()},
                str(e),
            )
        finally:
            if handle is not None:
                handle.remove()
        out.append((outcome, not bool(torch.isfinite(target.grad).all())))
    return out


def bf16_gradients(rank: int, numel: int) -> torch.Tensor:
    """Rank ``rank``'s bfloat16 gradient for the precision test (every rank can make every rank's)."""
    gen = torch.Generator().manual_seed(900 + rank)
    return (torch.randn(numel, generator=gen, dtype=torch.float64) * 3).to(torch.bfloat16)


def case_grad_reduce_dtype(group, numel: int = 4096) -> dict:
    """Average bfloat16 gradients summed in bfloat16 and in float32; errors against float64, in bf16 ulps."""
    rank, world = group.rank, group.world_size
    exact = sum(bf16_gradients(r, numel).double() for r in range(world)) / world
    rounded = exact.to(torch.bfloat16).double()
    ulp = _bf16_ulp(exact)
    out: dict[str, Any] = {}
    for name, reduce_dtype in (("bf16", None), ("fp32", torch.float32)):
        param = nn.Parameter(torch.zeros(numel, dtype=torch.bfloat16))
        manager = GradientBucketManager([param], group, grad_reduce_dtype=reduce_dtype)
        param.grad = bf16_gradients(rank, numel)
        manager.reduce_all_async()
        manager.finish_grad_sync(30)
        got = param.grad.double()
        out[name] = {
            "dtype": str(param.grad.dtype),
            "staged": manager.buckets[0].staged,
            "max_ulps": float(((got - exact).abs() / ulp).max()),
            "mean_abs_error": float((got - exact).abs().mean()),
            "correctly_rounded": float((got == rounded).double().mean()),
            "digest": hashlib.sha256(param.grad.view(torch.int16).numpy().tobytes()).hexdigest(),
        }
    return out


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bfloat16 numbers at ``|x|`` (8 significant bits)."""
    exponent = torch.floor(torch.log2(x.abs().clamp_min(2.0**-126)))
    return torch.pow(2.0, exponent - 7)


# ------------------------------------------------------------------ checks
def check_hooks(by_hook: dict[str, list[dict]]) -> None:
    """The default hooks give DDP's bits; the compressing ones are close, not exact, and send half."""
    for name in ("allreduce", "torch_style"):
        for r in by_hook.get(name, []):
            assert all(r["identical"]) and max(r["error"]) < 1e-6, (name, r)
            expected = [[b, b == r["buckets"] - 1] for b in range(r["buckets"])] * 2
            assert [list(s) for s in r["seen"]] == expected
    for name, tolerance in (("fp16", 2.0**-9), ("bf16", 2.0**-6)):
        for r in by_hook.get(name, []):
            assert not any(r["identical"]) and 0 < min(r["error"]) and max(r["error"]) < tolerance, (name, r)
            agreement = 8 * len(by_hook[name])  # the outcome agreement: one int64 per rank
            assert [2 * (s - agreement) for s in r["bytes_sent"]] == r["bytes_reduced"]
    for results in by_hook.values():
        assert len({r["digest"] for r in results}) == 1


def check_nonfinite(results: list[list], bad_rank: int) -> None:
    for r in results:  # lists, not tuples, after JSON (under mpiexec)
        assert list(r[0]) == ["ok", False] and list(r[2]) == ["ok", False]
        (name, ranks, params, message), _ = r[1]
        assert (
            name == "NonFiniteGradientError"
            and ranks == [bad_rank]
            and params == {str(bad_rank): ["2.weight"]}
        )
        assert "2.weight" in message


def check_powersgd(results: list[dict]) -> None:
    for r in results:
        plain, psgd = r["plain"], r["powersgd"]
        assert plain["final"] < 0.5 * plain["initial"] and psgd["final"] <= 2 * plain["final"], (plain, psgd)
        assert psgd["bytes_sent"] < 0.6 * plain["bytes_sent"]
    assert len({r["powersgd"]["digest"] for r in results}) == 1


class Tables(nn.Module):
    """Two embedding tables (one a bag), a table tied to the output head, and a dense layer (float64)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        with _BUILD_LOCK:
            torch.manual_seed(seed)
            self.words = nn.Embedding(40, 6)
            self.bag = nn.EmbeddingBag(30, 5, mode="sum")
            self.tied = nn.Embedding(20, 6)
            self.mix = nn.Linear(11, 6)
            self.head = nn.Linear(6, 20, bias=False)
            self.head.weight = self.tied.weight  # tied: its gradient is dense
        self.double()

    def forward(self, words: torch.Tensor, bags: torch.Tensor, tied: torch.Tensor) -> torch.Tensor:
        h = torch.cat([self.words(words).sum(1), self.bag(bags)], dim=1)
        return self.head(self.mix(h) + self.tied(tied).sum(1))


def table_inputs(step: int, rank: int) -> tuple[torch.Tensor, ...]:
    """Rank ``rank``'s lookups at ``step``: few rows at steps 0 and 1, most rows at step 2."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    lookups = 2 if step < 2 else 40
    words = torch.randint(0, 40, (lookups, 3), generator=g)
    return (
        words,
        torch.randint(0, 30, (lookups, 2), generator=g),
        torch.randint(0, 20, (lookups, 2), generator=g),
    )


def case_embedding_rows(group, steps: int = 3) -> dict:
    """DDP with ``embedding_rows="touched"`` against ``"all"`` and against the exact average.

    Returns per step: whether the two DDPs' gradients are bit-identical, the largest
    error against the float64 average over ranks, both DDPs' bytes sent, and whether
    every row no rank touched holds +0.0 bits; plus the tables each DDP exchanged by
    touched rows and what ``"auto"`` chose.
    """
    rank, world = group.rank, group.world_size
    touched = DistributedDataParallel(Tables(5), group, embedding_rows="touched")
    dense = DistributedDataParallel(Tables(5), group, embedding_rows="all")
    auto = DistributedDataParallel(Tables(5), group)
    reference = Tables(5)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (touched, dense, reference)]
    out: dict[str, Any] = {"identical": [], "error": [], "bytes": [], "untouched_zero": []}
    for step in range(steps):
        for model, opt in zip((touched, dense), opts, strict=False):
            opt.zero_grad(set_to_none=True)
            model(*table_inputs(step, rank)).square().mean().backward()
        opts[2].zero_grad(set_to_none=True)
        for r in range(world):
            (reference(*table_inputs(step, r)).square().mean() / world).backward()
        pairs = list(zip(touched.parameters(), dense.parameters(), reference.parameters(), strict=True))
        out["identical"].append(all(torch.equal(a.grad, b.grad) for a, b, _ in pairs))
        out["error"].append(
            max(float((a.grad - e.grad).abs().max() / e.grad.abs().max()) for a, _, e in pairs)
        )
        out["bytes"].append((touched.last_step_stats.bytes_sent, dense.last_step_stats.bytes_sent))
        inputs = [table_inputs(step, r) for r in range(world)]
        seen = torch.cat([i[0].flatten() for i in inputs]).unique()
        bagged = torch.cat([i[1].flatten() for i in inputs]).unique()
        out.setdefault("rows", []).append((seen.numel(), bagged.numel()))
        untouched = torch.ones(40, dtype=torch.bool)
        untouched[seen] = False
        out["untouched_zero"].append(
            bool((touched.module.words.weight.grad.view(torch.int64)[untouched] == 0).all())
        )
        for opt in opts:
            opt.step()

    def tables(model: DistributedDataParallel) -> list[str]:
        layout = model.bucket_manager.layout
        return sorted(name for b in model.bucket_manager.row_sparse_buckets for name in layout[b])

    out["tables"] = {"touched": tables(touched), "all": tables(dense), "auto": tables(auto)}
    out["shares_buffers"] = group.shares_buffers
    out["digest"] = digest(touched.module)
    return out


def check_embedding_rows(results: list[dict]) -> None:
    """Touched rows give the dense all-reduce's bits, fewer bytes while few are touched, +0.0 elsewhere."""
    for r in results:
        assert r["identical"] == [True] * 3, r["identical"]
        assert max(r["error"]) < 1e-12, r["error"]
        assert r["untouched_zero"] == [True] * 3
        flags, tables = 4 * (40 + 30), 8 * (40 * 6 + 30 * 5)  # int32 flags; float64 tables
        for step, ((sent, dense_sent), (words, bags)) in enumerate(zip(r["bytes"], r["rows"], strict=True)):
            if 2 * (words + bags) > 70:  # most rows touched (step 2): the whole bucket, after the flags
                assert step == 2 and sent == dense_sent + flags, (step, sent, dense_sent)
            else:  # the flags, then the rows some rank touched instead of the whole tables
                assert sent == dense_sent - tables + flags + 8 * (6 * words + 5 * bags), (
                    step,
                    sent,
                    dense_sent,
                )
        assert r["tables"]["touched"] == ["bag.weight", "words.weight"], r["tables"]
        assert r["tables"]["all"] == []
        assert r["tables"]["auto"] == ([] if r["shares_buffers"] else r["tables"]["touched"])
    assert len({r["digest"] for r in results}) == 1
