"""What NCCL lacks, built by the nccl backend: int16, and BAND, BOR and BXOR. Checked on CPU ranks.

The gloo pool's torch group is wrapped as if NCCL served its CPU tensors, so the
nccl backend's own paths run: int16 moved as float16 and reduced as int32, bool
BAND/BOR as MIN/MAX over the bytes, the all-gather and fold of ``all_reduce`` and
``reduce``, the all-to-all and fold of ``reduce_scatter``. Gloo underneath moves
the bytes. ``tests/gpu`` runs the same bodies on NCCL itself.
"""

from __future__ import annotations

import pytest
import torch

from backends.torch.group import TorchDistProcessGroup
from commlib import IProcessGroup, ReduceOp
from tests.distributed import bodies

pytestmark = pytest.mark.multiprocess

REDUCING = ("all_reduce", "reduce", "reduce_scatter")


def as_nccl(group: IProcessGroup) -> TorchDistProcessGroup:
    """The gloo pool's torch group, with NCCL named as the backend of its CPU tensors."""
    assert isinstance(group, TorchDistProcessGroup)
    return TorchDistProcessGroup(
        group.env, group.config, pg=group.torch_group, name="nccl", devices={"cpu": "nccl"}
    )


def nccl_matrix(group: IProcessGroup, collective: str) -> list[str]:
    emulated = as_nccl(group)
    try:
        return bodies.ALL_BODIES[collective](emulated)
    finally:
        emulated.close()


def nccl_paths_taken(group: IProcessGroup) -> dict[str, list[str]]:
    """Which torch calls each fallback makes: the NCCL calls that would have been refused are absent."""
    emulated = as_nccl(group)
    calls: list[str] = []
    pg = group.torch_group

    class Recording:
        def __getattr__(self, name: str):  # noqa: ANN204
            def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
                options = args[-1]
                op = getattr(options, "reduceOp", None)
                tensors = [a for a in args if isinstance(a, torch.Tensor)]
                tensors += [t for a in args if isinstance(a, list) for t in a if isinstance(t, torch.Tensor)]
                what = op.op if op is not None else ""
                calls.append(f"{name} {what} {tensors[0].dtype if tensors else ''}".strip())
                return getattr(pg, name)(*args, **kwargs)

            return call

    emulated._backends = {"cpu": Recording()}  # noqa: SLF001
    seen: dict[str, list[str]] = {}
    try:
        for label, tensor, op in [
            ("int32 BXOR", torch.tensor([1, 2, 4], dtype=torch.int32) << emulated.rank, ReduceOp.BXOR),
            ("bool BAND", torch.tensor([True, emulated.rank == 0]), ReduceOp.BAND),
            ("bool BXOR", torch.tensor([True, emulated.rank == 0]), ReduceOp.BXOR),
            ("int16 SUM", torch.full((3,), 30000, dtype=torch.int16), ReduceOp.SUM),
        ]:
            calls.clear()
            emulated.all_reduce(tensor, op)
            seen[label] = [*calls, str(tensor.tolist())]
    finally:
        emulated.close()
    return seen


@pytest.mark.parametrize("world_size", (1, 2, 3))
@pytest.mark.parametrize("collective", REDUCING)
def test_reductions_nccl_lacks(get_pool, world_size: int, collective: str) -> None:  # noqa: ANN001
    """Every op and dtype of the contract (bitwise ops on bool, int8..int64) against the float64 reference."""
    digests = get_pool("gloo", world_size).run(nccl_matrix, collective, timeout=240)
    assert all(d == digests[0] for d in digests), "ranks disagree bit for bit"


def test_each_fallback_calls_what_nccl_has(get_pool) -> None:  # noqa: ANN001
    first, second, third = get_pool("gloo", 3).run(nccl_paths_taken, timeout=120)
    assert first == second == third
    # Integers: gather every rank's tensor, fold in rank order: 1^2^4 << r for r = 0, 1, 2.
    assert first["int32 BXOR"] == ["_allgather_base  torch.int32", str([1 ^ 2 ^ 4, 2 ^ 4 ^ 8, 4 ^ 8 ^ 16])]
    # Bool BAND is NCCL's MIN over the bytes; BXOR gathers.
    assert first["bool BAND"] == ["allreduce RedOpType.MIN torch.uint8", str([True, False])]
    assert first["bool BXOR"] == ["_allgather_base  torch.bool", str([True, True])]
    # int16 SUM reduces as int32 and wraps back: 3 * 30000 = 90000 -> 90000 - 65536 * 1 = 24464.
    assert first["int16 SUM"] == ["allreduce RedOpType.SUM torch.int32", str([24464] * 3)]
