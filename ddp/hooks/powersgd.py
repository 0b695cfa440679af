"""PowerSGD: low-rank gradient compression with error feedback (Vogels, Karimireddy and Jaggi, NeurIPS 2019).

Each gradient matrix ``M`` (a parameter's gradient viewed as ``shape[0] x rest``)
is sent as two thin factors instead of ``n x m`` numbers. One step of the power
method per training step, on the sum of the ranks' matrices:

1. ``M += e``: add what compression dropped last step (error feedback).
2. ``P = M Q``, summed over ranks (``Q``, ``m x r``, is the same on every rank:
   last step's, the warm start, or seeded random at first).
3. ``P^ = orthonormal basis of P`` (a reduced QR; identical on every rank).
4. ``Q = M^T P^``, averaged over ranks.
5. The averaged gradient is approximated by ``P^ Q^T``; ``e = M - P^ Q^T``.

Per matrix that sends ``(n + m) r`` numbers instead of ``n m``. Vectors (biases,
norms) and matrices too small to gain ``min_compression_rate`` are averaged
uncompressed, in one all-reduce per bucket. Before ``start_powerSGD_iter``
backwards the hook is a plain average (the paper's warm-up). The P sums of all
the bucket's matrices travel in one all-reduce, waited for in the hook (Q needs
it), the Q sums and the uncompressed part in two more that complete the future;
every rank issues them in the same order from the thread that runs backward.

``e`` is taken against the averaged approximation, as torch's implementation
does; averaged over ranks it equals the paper's per-rank error, because the
compression is linear once ``P^`` is fixed.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch

from commlib.process_group import IProcessGroup
from commlib.types import ReduceOp
from ddp.bucket import GradientBucket
from ddp.hooks.default import allreduce_hook, resolve_hook_group

__all__ = ["PowerSGDState", "powerSGD_hook"]


class PowerSGDState:
    """Settings and memory of ``powerSGD_hook``: the ``Q`` factors and the error of each matrix.

    Args:
        process_group: The group (None: commlib's default group).
        matrix_approximation_rank: Rank ``r`` of the approximation (1 compresses
            most; 2 to 4 usually train as well as no compression).
        start_powerSGD_iter: Backwards averaged uncompressed first (the
            warm-up; error feedback then starts from sensible gradients).
        min_compression_rate: Compress a matrix only if ``n m / ((n + m) r)``
            is at least this; others travel uncompressed.
        use_error_feedback: Add what compression dropped to the next step's
            gradient (the paper's error feedback). Costs one gradient's memory per
            compressed matrix.
        warm_start: Reuse each matrix's ``Q`` from the previous step (one more
            power iteration); else a fresh random ``Q`` every step.
        random_seed: Seed of the initial ``Q`` factors (the same on every rank).

    Attributes:
        iter: Backwards seen so far (counted at each backward's last bucket).
        numel_before: Elements the compressed matrices would have sent, summed
            over steps.
        numel_after: Elements they sent instead (``P`` and ``Q``).
    """

    __slots__ = (
        "process_group",
        "matrix_approximation_rank",
        "start_powerSGD_iter",
        "min_compression_rate",
        "use_error_feedback",
        "warm_start",
        "random_seed",
        "iter",
        "numel_before",
        "numel_after",
        "_q",
        "_error",
    )

    def __init__(
        self,
        process_group: IProcessGroup | None = None,
        matrix_approximation_rank: int = 1,
        start_powerSGD_iter: int = 1000,  # noqa: N803 - torch's name
        min_compression_rate: float = 2.0,
        use_error_feedback: bool = True,
        warm_start: bool = True,
        random_seed: int = 0,
    ) -> None:
        if isinstance(matrix_approximation_rank, bool) or not isinstance(matrix_approximation_rank, int):
            raise TypeError(
                f"PowerSGDState.matrix_approximation_rank: expected an int, got {matrix_approximation_rank!r}"
            )
        if matrix_approximation_rank < 1:
            raise ValueError(
                f"PowerSGDState.matrix_approximation_rank: must be >= 1, got {matrix_approximation_rank}"
            )
        if isinstance(start_powerSGD_iter, bool) or not isinstance(start_powerSGD_iter, int):
            raise TypeError(
                f"PowerSGDState.start_powerSGD_iter: expected an int, got {start_powerSGD_iter!r}"
            )
        if start_powerSGD_iter < 0:
            raise ValueError(f"PowerSGDState.start_powerSGD_iter: must be >= 0, got {start_powerSGD_iter}")
        if not min_compression_rate > 0:
            raise ValueError(f"PowerSGDState.min_compression_rate: must be > 0, got {min_compression_rate!r}")
        self.process_group = process_group
        self.matrix_approximation_rank = matrix_approximation_rank
        self.start_powerSGD_iter = start_powerSGD_iter
        self.min_compression_rate = float(min_compression_rate)
        self.use_error_feedback = bool(use_error_feedback)
        self.warm_start = bool(warm_start)
        self.random_seed = int(random_seed)
        self.iter = 0
        self.numel_before = 0
        self.numel_after = 0
        self._q: dict[str, torch.Tensor] = {}
        self._error: dict[str, torch.Tensor] = {}
        """Each matrix's last ``Q`` and error, by its parameter's name: DDP lays its buckets out
        again (in arrival order, or re-sized), so a bucket's position does not name a matrix."""

    def __repr__(self) -> str:
        return (
            f"PowerSGDState(rank={self.matrix_approximation_rank}, start_powerSGD_iter="
            f"{self.start_powerSGD_iter}, iter={self.iter}, error_feedback={self.use_error_feedback}, "
            f"warm_start={self.warm_start}, compression={self.compression_rate:.1f}x)"
        )

    def __getstate__(self) -> dict[str, Any]:
        """The state to checkpoint (``torch.save``, pickle): all but the process group, as torch's."""
        return {slot: getattr(self, slot) for slot in self.__slots__ if slot != "process_group"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore a checkpoint; the group becomes None (commlib's default): set ``process_group`` after."""
        self.process_group = None
        for slot, value in state.items():
            setattr(self, slot, value)

    @property
    def compression_rate(self) -> float:
        """Elements before over elements after, for the compressed matrices so far (1.0 before any)."""
        return self.numel_before / self.numel_after if self.numel_after else 1.0

    def _initial_q(self, seed: int, m: int, r: int, like: torch.Tensor) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.random_seed * 1_000_003 + seed)
        q = torch.randn(m, r, generator=generator, dtype=torch.float64).to(like.dtype)
        out = torch.empty(m, r, dtype=like.dtype, device=like.device)
        out.copy_(q)
        return out


class _Matrix:
    """One gradient matrix of a bucket, and its P and Q: views into the flat factor buffers.

    ``key`` is its parameter's name (the same on every rank), ``seed`` a number drawn from it.
    """

    __slots__ = ("key", "m", "p", "q", "seed")

    def __init__(self, key: str, m: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> None:
        self.key = key
        self.seed = zlib.crc32(key.encode())
        self.m = m
        self.p = p
        self.q = q


def powerSGD_hook(state: PowerSGDState, bucket: GradientBucket) -> torch.futures.Future[Any]:  # noqa: N802 - torch's name
    """Average the bucket with PowerSGD's low-rank compression (see the module docstring).

    Args:
        state: The ``PowerSGDState`` (the same object every step).
        bucket: The bucket.

    Returns:
        A future whose value is the bucket's buffer, holding the approximated
        average.
    """
    if not isinstance(state, PowerSGDState):
        raise TypeError(f"powerSGD_hook: state must be a PowerSGDState, got {type(state).__name__}")
    group = resolve_hook_group(state.process_group)
    last = bucket.is_last()
    buffer = bucket.buffer()
    dense, shapes = _split(state, bucket)
    compress = state.iter >= state.start_powerSGD_iter and buffer.dtype in (torch.float32, torch.float64)
    if last:
        state.iter += 1
    if not compress or not shapes:
        return allreduce_hook(group, bucket)
    world = group.world_size
    matrices, p_flat, q_flat = _factors(shapes, buffer)
    for mat in matrices:
        error = state._error.get(mat.key) if state.use_error_feedback else None
        if error is not None and error.shape == mat.m.shape:
            mat.m.add_(error)
        q = state._q.get(mat.key) if state.warm_start else None
        if q is None or q.shape != mat.q.shape:
            seed = mat.seed if state.warm_start else mat.seed + 7919 * state.iter
            q = state._initial_q(seed, mat.q.shape[0], mat.q.shape[1], mat.m)
        mat.q.copy_(q)
        torch.matmul(mat.m, mat.q, out=mat.p)
    group.all_reduce(p_flat, ReduceOp.SUM)  # waited for: Q needs the summed P
    for mat in matrices:
        mat.p.copy_(torch.linalg.qr(mat.p, mode="reduced").Q)  # the same basis on every rank
        torch.matmul(mat.m.t(), mat.p, out=mat.q)
    futures = [_future(group.all_reduce(q_flat, ReduceOp.SUM, async_op=True))]
    dense_flat = torch.cat([t.reshape(-1) for t in dense]) if dense else None
    if dense_flat is not None:
        dense_flat.div_(world)
        futures.append(_future(group.all_reduce(dense_flat, ReduceOp.SUM, async_op=True)))
    state.numel_before += sum(mat.m.numel() for mat in matrices)
    state.numel_after += p_flat.numel() + q_flat.numel()

    def decompress(_: torch.futures.Future[Any]) -> torch.Tensor:
        for f in futures:
            f.wait()  # a failed collective's error goes into the returned future
        q_flat.div_(world)
        for mat in matrices:
            approx = torch.matmul(mat.p, mat.q.t())
            if state.use_error_feedback:
                state._error[mat.key] = mat.m - approx
            state._q[mat.key] = mat.q.clone()
            mat.m.copy_(approx)
        if dense_flat is not None:
            offset = 0
            for t in dense:
                t.copy_(dense_flat[offset : offset + t.numel()].view(t.shape))
                offset += t.numel()
        return buffer

    return torch.futures.collect_all(futures).then(decompress)


def _split(
    state: PowerSGDState, bucket: GradientBucket
) -> tuple[list[torch.Tensor], list[tuple[str, torch.Tensor, int]]]:
    """The bucket's gradients sent as they are, and ``(key, n x m view, rank)`` of those compressed."""
    dense: list[torch.Tensor] = []
    shapes: list[tuple[int, torch.Tensor, int]] = []
    for name, grad in zip(bucket.names, bucket.gradients(), strict=True):
        if grad.dim() < 2 or grad.numel() == 0:
            dense.append(grad)
            continue
        n = grad.shape[0]
        m = grad.numel() // n
        r = min(state.matrix_approximation_rank, n, m)
        if n * m <= state.min_compression_rate * (n + m) * r:  # torch: compress only if strictly better
            dense.append(grad)
        else:
            shapes.append((name, grad.reshape(n, m), r))
    return dense, shapes


def _factors(
    shapes: list[tuple[str, torch.Tensor, int]], like: torch.Tensor
) -> tuple[list[_Matrix], torch.Tensor, torch.Tensor]:
    """Flat P and Q buffers for the matrices (one all-reduce each), and each matrix's views into them."""
    p_flat = torch.empty(sum(m.shape[0] * r for _, m, r in shapes), dtype=like.dtype, device=like.device)
    q_flat = torch.empty(sum(m.shape[1] * r for _, m, r in shapes), dtype=like.dtype, device=like.device)
    matrices, p_at, q_at = [], 0, 0
    for key, m, r in shapes:
        n, k = m.shape
        p = p_flat[p_at : p_at + n * r].view(n, r)
        q = q_flat[q_at : q_at + k * r].view(k, r)
        matrices.append(_Matrix(key, m, p, q))
        p_at += n * r
        q_at += k * r
    return matrices, p_flat, q_flat


def _future(work: Any) -> torch.futures.Future[Any]:
    assert work is not None  # async_op=True always returns a handle
    return work.get_future()
