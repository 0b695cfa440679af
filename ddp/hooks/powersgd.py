"""PowerSGD: low-rank gradient compression with error feedback (Vogels, Karimireddy and Jaggi, NeurIPS 2019).

Each gradient matrix ``M`` (a parameter's gradient viewed as ``shape[0] x rest``)
is sent as two thin factors instead of ``n x m`` numbers. One step of the power
method per training step, on the sum of the ranks' matrices:

1. ``M += e``: add what compression dropped last step (error feedback).
2. ``P = M Q``, summed over ranks (``Q``, ``m x r``, is the same on every rank:
   last step's, the warm start, or seeded random at first).
3. ``P^ = orthonormal basis of P`` (a reduced QR, or Gram-Schmidt in half precision
   or with ``orthogonalization_epsilon``; identical on every rank).
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

``batched_powerSGD_hook`` compresses the whole bucket as one square matrix
instead (fewer, larger operations; less accurate).
"""

from __future__ import annotations

import logging
import math
import zlib
from typing import Any

import torch

from commlib.process_group import IProcessGroup
from commlib.types import ReduceOp
from ddp.bucket import GradientBucket
from ddp.hooks.default import allreduce_hook, resolve_hook_group

__all__ = ["PowerSGDState", "batched_powerSGD_hook", "powerSGD_hook"]

logger = logging.getLogger("commlib")

_COMPRESSIBLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""Bucket dtypes PowerSGD compresses (others are averaged uncompressed)."""


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
        orthogonalization_epsilon: Added to each column's norm when ``P`` is
            orthonormalised (Gram-Schmidt instead of QR), so an all-zero column gives
            zeros, not NaN; 0: the exact basis (QR in float32/float64).
        compression_stats_logging_frequency: Log ``compression_stats()`` at INFO on
            the ``commlib`` logger every this many backwards once compression starts.
        batch_tensors_with_same_shape: torch's option to compress same-shaped
            matrices in one batched operation. Accepted for compatibility: each matrix
            is computed on its own, with the same result.

    Attributes:
        iter: Backwards seen so far (counted at each backward's last bucket).
        total_numel_before_compression: Elements the buckets would have sent
            uncompressed, summed over the compressed steps (torch's accounting).
        total_numel_after_compression: Elements they sent instead: ``P`` and ``Q``
            of the compressed matrices, the rest as it is.
    """

    __slots__ = (
        "process_group",
        "matrix_approximation_rank",
        "start_powerSGD_iter",
        "min_compression_rate",
        "use_error_feedback",
        "warm_start",
        "random_seed",
        "orthogonalization_epsilon",
        "compression_stats_logging_frequency",
        "batch_tensors_with_same_shape",
        "iter",
        "total_numel_before_compression",
        "total_numel_after_compression",
        "next_stats_report",
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
        orthogonalization_epsilon: float = 0.0,
        random_seed: int = 0,
        compression_stats_logging_frequency: int = 10_000,
        batch_tensors_with_same_shape: bool = False,
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
        epsilon = orthogonalization_epsilon
        if isinstance(epsilon, bool) or not (isinstance(epsilon, int | float) and 0 <= epsilon < math.inf):
            raise ValueError(
                "PowerSGDState.orthogonalization_epsilon: must be a finite number >= 0 (e.g. 1e-8), got "
                f"{orthogonalization_epsilon!r}"
            )
        self.process_group = process_group
        self.matrix_approximation_rank = matrix_approximation_rank
        self.start_powerSGD_iter = start_powerSGD_iter
        self.min_compression_rate = float(min_compression_rate)
        self.use_error_feedback = bool(use_error_feedback)
        self.warm_start = bool(warm_start)
        self.random_seed = int(random_seed)
        self.orthogonalization_epsilon = float(orthogonalization_epsilon)
        self.compression_stats_logging_frequency = max(1, int(compression_stats_logging_frequency))
        self.batch_tensors_with_same_shape = bool(batch_tensors_with_same_shape)
        self.iter = 0
        self.total_numel_before_compression = 0
        self.total_numel_after_compression = 0
        self.next_stats_report = 0
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
        """Elements before over elements after, over the compressed steps so far (1.0 before any)."""
        after = self.total_numel_after_compression
        return self.total_numel_before_compression / after if after else 1.0

    def compression_stats(self) -> tuple[float, int, int]:
        """``(rate, total_numel_before_compression, total_numel_after_compression)``, as torch's.

        The rate is 0 before any compressed step (torch's convention; ``compression_rate`` says 1.0).
        """
        before, after = self.total_numel_before_compression, self.total_numel_after_compression
        return (before / after if after else 0, before, after)

    def _step(self, bucket: Any) -> bool:
        """Whether ``bucket`` is compressed (past the warm-up, of a dtype PowerSGD compresses).

        A backward is counted at its last bucket.
        """
        compress = self.iter >= self.start_powerSGD_iter and bucket.buffer().dtype in _COMPRESSIBLE
        if bucket.is_last():
            self.iter += 1
        return compress

    def _count(self, before: int, after: int, bucket: Any) -> None:
        """Add a compressed bucket's elements; at the step's last bucket, log the stats when due."""
        self.total_numel_before_compression += before
        self.total_numel_after_compression += after
        if bucket.is_last() and self.iter >= self.next_stats_report:
            rate, before, after = self.compression_stats()
            logger.info(
                "PowerSGD compression stats: iter %d, total before compression %d, after %d, rate %.2f",
                self.iter,
                before,
                after,
                rate,
            )
            self.next_stats_report = self.iter + self.compression_stats_logging_frequency

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
    if not state._step(bucket):
        return allreduce_hook(group, bucket)
    buffer = bucket.buffer()
    dense, shapes = _split(state, bucket)
    whole = sum(t.numel() for t in dense)
    before = whole + sum(m.numel() for _, m, _ in shapes)
    state._count(before, whole + sum((m.shape[0] + m.shape[1]) * r for _, m, r in shapes), bucket)
    if not shapes:
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
        _orthonormalise(mat.p, state.orthogonalization_epsilon)  # the same basis on every rank
        torch.matmul(mat.m.t(), mat.p, out=mat.q)
    futures = [_future(group.all_reduce(q_flat, ReduceOp.SUM, async_op=True))]
    dense_flat = torch.cat([t.reshape(-1) for t in dense]) if dense else None
    if dense_flat is not None:
        dense_flat.div_(world)
        futures.append(_future(group.all_reduce(dense_flat, ReduceOp.SUM, async_op=True)))

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


def batched_powerSGD_hook(state: PowerSGDState, bucket: GradientBucket) -> torch.futures.Future[Any]:  # noqa: N802 - torch's name
    """Average the bucket with PowerSGD, the whole bucket as one square matrix (torch's batched variant).

    The bucket's ``L`` elements, padded with zeros, form a ``s x s`` matrix (``s =
    ceil(sqrt(L))``), compressed at rank ``r``: ``2 s r`` numbers instead of ``L``.
    Fewer and larger operations than ``powerSGD_hook``, but the matrix mixes
    unrelated layers, so it approximates worse: rank 1 is rarely enough. The
    error and ``Q`` are kept per bucket (its index and size); ``min_compression_rate``
    does not apply, as in torch.

    Args:
        state: The ``PowerSGDState`` (the same object every step).
        bucket: The bucket.

    Returns:
        A future whose value is the bucket's buffer, holding the approximated average.
    """
    if not isinstance(state, PowerSGDState):
        raise TypeError(f"batched_powerSGD_hook: state must be a PowerSGDState, got {type(state).__name__}")
    group = resolve_hook_group(state.process_group)
    buffer = bucket.buffer()
    if not state._step(bucket) or buffer.numel() == 0:
        return allreduce_hook(group, bucket)
    length = buffer.numel()
    side = math.ceil(math.sqrt(length))
    r = min(state.matrix_approximation_rank, side)
    state._count(length, 2 * side * r, bucket)
    key = f"bucket {bucket.index()} of {length}"
    square = torch.zeros(side * side, dtype=buffer.dtype, device=buffer.device)
    square[:length].copy_(buffer)
    m = square.view(side, side)
    error = state._error.get(key) if state.use_error_feedback else None
    if error is not None:
        m.add_(error)
    q = state._q.get(key) if state.warm_start else None
    if q is None or q.shape != (side, r):
        seed = zlib.crc32(key.encode()) + (0 if state.warm_start else 7919 * state.iter)
        q = state._initial_q(seed, side, r, m)
    p = torch.matmul(m, q)
    group.all_reduce(p, ReduceOp.SUM)  # waited for: Q needs the summed P
    _orthonormalise(p, state.orthogonalization_epsilon)
    q = torch.matmul(m.t(), p)
    world = group.world_size

    def decompress(future: torch.futures.Future[Any]) -> torch.Tensor:
        future.wait()  # a failed collective's error goes into the returned future
        q.div_(world)
        approx = torch.matmul(p, q.t())
        if state.use_error_feedback:
            state._error[key] = m - approx
        state._q[key] = q
        buffer.copy_(approx.view(-1)[:length])
        return buffer

    return _future(group.all_reduce(q, ReduceOp.SUM, async_op=True)).then(decompress)


def _orthonormalise(p: torch.Tensor, epsilon: float) -> None:
    """Replace the columns of ``p`` (``n x r``) with an orthonormal basis of them, in place.

    A reduced QR where it is exact and available (float32/float64, no ``epsilon``),
    else Gram-Schmidt, column by column, with ``epsilon`` added to each norm (half
    precision has no QR; an all-zero column then gives zeros, not NaN).
    """
    if epsilon == 0 and p.dtype in (torch.float32, torch.float64):
        p.copy_(torch.linalg.qr(p, mode="reduced").Q)
        return
    for i in range(p.shape[1]):
        col = p[:, i : i + 1]
        norm = torch.linalg.vector_norm(col.float()).to(p.dtype)
        col.div_(norm + epsilon if epsilon else norm)
        if epsilon == 0:
            torch.nan_to_num_(col, nan=0.0, posinf=0.0, neginf=0.0)
        if i + 1 < p.shape[1]:
            rest = p[:, i + 1 :]
            rest.sub_((col * rest).sum(dim=0, keepdim=True) * col)


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
