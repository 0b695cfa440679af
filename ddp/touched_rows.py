"""Exchange only the rows of embedding gradients that some rank touched.

The weight gradient of an ``nn.Embedding`` is zero except in the rows of the
tokens the batch looked up: with a 10,000-row table and 256 tokens a rank, 95% of
its bytes are zeros, and a dense all-reduce moves them all. A bucket that holds
only such gradients is reduced in two collectives instead:

1. at launch, each rank flags the rows of its bucket that hold any non-zero bit
   (``-0.0`` and NaN count) and all-reduces the flags with ``MAX``;
2. at the end of backward, the rows flagged on any rank are gathered into one
   small buffer, all-reduced with the bucket's op, and written back.

A row no rank touched is zero on every rank, which is what the dense all-reduce
would leave there, so each value is the same sum of the same terms (on two ranks,
the same bits; on more, the ring's order of additions may differ). Every rank gets
the same flags, so every rank takes the same path: when more than half the rows
are touched, the whole bucket is all-reduced instead.

Only rows are compacted, so the bucket must hold nothing else (the layout gives
row-sparse gradients buckets of their own). It works on CPU tensors.
"""

from __future__ import annotations

import time

import torch

from commlib.process_group import IProcessGroup
from commlib.types import ReduceOp
from commlib.work import Work
from ddp.bucket import GradientBucket
from ddp.config import DDPConfig
from ddp.devices import comm_device, control_tensor, to_host

__all__ = ["TouchedRows", "check_dense_tables", "embedding_tables", "row_sparse_tables"]


_TABLES = (torch.nn.Embedding, torch.nn.EmbeddingBag)
"""The modules whose weight gradient is row-sparse (dense layout), or sparse with ``sparse=True``."""


def _row_view(flat: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``flat`` (one parameter's gradient) as a 2-D table: one row per index of the first dimension."""
    rows = shape[0] if len(shape) else 1
    return flat.view(rows, flat.numel() // rows if rows else 0)


class TouchedRows:
    """The two-collective exchange of one bucket of row-sparse gradients (see the module docstring).

    Args:
        bucket: A CPU bucket holding only row-sparse gradients (embedding tables).
        group: The group to reduce over.
    """

    def __init__(self, bucket: GradientBucket, group: IProcessGroup) -> None:
        self.group = group
        self.bucket = bucket
        data = bucket.comm_data
        self._tables: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        start = 0
        for param, offset in zip(bucket.params, bucket.offsets, strict=True):
            table = _row_view(data[offset : offset + param.numel()], param.shape)
            if table.numel():
                # A row's bytes: its largest is non-zero exactly when some bit of the row is set
                # (one vectorised max, several times faster than ``torch.any`` over any width).
                self._tables.append((table, table.view(torch.uint8), start))
                start += table.shape[0]
        self.rows = start
        """Rows of all the bucket's tables."""
        self._largest_byte = torch.zeros(self.rows, dtype=torch.uint8)
        self._touched = torch.zeros(self.rows, dtype=torch.bool)
        self._flags = torch.zeros(self.rows, dtype=torch.int32)
        self._exchange_flags = group.prepare_all_reduce(self._flags, ReduceOp.MAX)
        self.touched_rows = 0
        """Rows flagged on some rank in the latest exchange (all of them when it went dense)."""

    def launch(self) -> Work:
        """Flag this rank's touched rows and start the all-reduce (``MAX``) of the flags."""
        largest = self._largest_byte
        for table, row_bytes, start in self._tables:
            torch.amax(row_bytes, dim=1, out=largest[start : start + table.shape[0]])
        self._flags.copy_(torch.ne(largest, 0, out=self._touched))
        return self._exchange_flags.start().annotate(
            lambda: f"DDP bucket {self.bucket.index()}: touched-row flags of {self.rows} embedding rows"
        )

    def finish(self, flags: Work, op: ReduceOp, timeout: float | None) -> None:
        """Wait for the flags, then reduce the rows flagged on any rank (or all of them) in place.

        Args:
            flags: The work ``launch`` returned.
            op: The bucket's reduction.
            timeout: Seconds for both waits together (None: the group's timeout).

        Raises:
            CommTimeoutError: Not finished within ``timeout``.
            CommError: A collective failed.
        """
        deadline = time.perf_counter() + (self.group.timeout if timeout is None else timeout)
        flags.wait(timeout)
        flagged = self._flags
        picked = [(t, flagged[start : start + t.shape[0]].nonzero().view(-1)) for t, _, start in self._tables]
        self.touched_rows = sum(int(rows.numel()) for _, rows in picked)
        if 2 * self.touched_rows > self.rows:
            self.touched_rows = self.rows
            self._all_reduce(self.bucket.comm_data, op, deadline)
            return
        if not self.touched_rows:
            return
        compact = torch.cat([table.index_select(0, rows).view(-1) for table, rows in picked])
        self._all_reduce(compact, op, deadline)
        at = 0
        for table, rows in picked:
            n = rows.numel() * table.shape[1]
            table.index_copy_(0, rows, compact[at : at + n].view(-1, table.shape[1]))
            at += n

    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp, deadline: float) -> None:
        """All-reduce ``tensor`` (the touched rows, or the whole bucket), waiting until ``deadline``."""
        work = self.group.all_reduce(tensor, op, async_op=True)
        assert work is not None  # async_op=True always returns a handle
        work.annotate(lambda: f"DDP bucket {self.bucket.index()}: {self.touched_rows} touched embedding rows")
        work.wait(max(deadline - time.perf_counter(), 1e-3))


def check_dense_tables(module: torch.nn.Module, prefix: str) -> None:
    """Raise ``ValueError`` for a trainable embedding with ``sparse=True`` (no communication).

    Its gradient is a sparse tensor, which cannot land in a bucket's flat buffer;
    the dense gradient with ``embedding_rows`` exchanges only the touched rows.
    """
    sparse = [
        (name, type(m).__name__)
        for name, m in module.named_modules()
        if isinstance(m, _TABLES) and m.sparse and m.weight.requires_grad
    ]
    if sparse:
        shown = ", ".join(f"{kind} {name or '(the module)'!r}" for name, kind in sparse[:4])
        raise ValueError(
            f"{prefix}{shown}{' and more' if len(sparse) > 4 else ''} has sparse=True: DDP reduces "
            "gradients in dense buckets and cannot take a sparse gradient. Fix: build the embedding with "
            "sparse=False (the default); DDP then exchanges only the rows some rank touched "
            "(embedding_rows='auto' on CPU), and use an optimizer for dense gradients (Adam or AdamW "
            "instead of SparseAdam)"
        )


def embedding_tables(module: torch.nn.Module, params: list[torch.Tensor]) -> list[int]:
    """Indices in ``params`` of the CPU embedding tables whose gradients are row-sparse.

    The weight of an ``nn.Embedding`` or ``nn.EmbeddingBag`` with ``sparse=False``
    qualifies if no other module holds it (a table tied to an output layer gets
    a dense gradient from it).
    """
    holders: dict[int, int] = {}
    for _, p in module.named_parameters(remove_duplicate=False):
        holders[id(p)] = holders.get(id(p), 0) + 1
    tables = {
        id(m.weight)
        for m in module.modules()
        if isinstance(m, _TABLES) and not m.sparse
    }
    return [
        i
        for i, p in enumerate(params)
        if id(p) in tables and holders.get(id(p)) == 1 and p.device.type == "cpu" and p.dim() == 2
    ]


def row_sparse_tables(
    module: torch.nn.Module, group: IProcessGroup, params: list[torch.Tensor], config: DDPConfig
) -> list[int]:
    """Indices in ``params`` of the tables DDP exchanges by touched rows (``embedding_rows``).

    The same on every rank: with ``"auto"`` the ranks agree (one small all-reduce)
    on whether every rank's group copies its buffers (sharing them makes the dense
    all-reduce cheap enough).
    """
    choice = config.embedding_rows
    if choice == "all" or config.gradient_sync != "allreduce" or group.world_size == 1:
        return []
    tables = [
        i
        for i in embedding_tables(module, params)
        if comm_device(group, params[i].dtype, params[i].device).type == "cpu"
    ]
    if not tables:  # the same on every rank: the models are the same
        return []
    if choice == "auto":
        # Agreed: whether a group shares buffers may differ between ranks (hosts).
        flag = control_tensor(group, [int(not group.shares_buffers)], torch.int32)
        group.all_reduce(flag, ReduceOp.MIN)
        if not to_host(flag).item():
            return []
    return tables
