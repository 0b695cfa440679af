"""The fingerprint check across hosts: one all-gather per collective, on a Gloo group of its own.

On one host the diagnosis's shared-memory board carries the fingerprints. Across
hosts a ``ProcessGroupGloo`` built like a subgroup, over a ``PrefixStore`` of the
job's store keyed by the group's name, carries them: it needs no port beyond
those Gloo already uses, and it carries nothing but the fixed-size
fingerprints, one all-gather per collective on every rank, so it stays in step
whatever the ranks pass to the data path.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from backends.torch.calls import AllgatherOptions, async_options
from backends.torch.errors import translate
from commlib.errors import CommError, RendezvousError
from commlib.translation import first_line
from commlib.work import CollectiveLabel

if TYPE_CHECKING:
    from commlib.diagnosis.diagnostics import FingerprintExchange

__all__ = ["fingerprint_exchange", "fingerprint_group"]


def fingerprint_group(store: Any, scope: str, rank: int, world: int, timeout: float, prefix: str) -> Any:
    """The Gloo group that carries the fingerprints, over ``PrefixStore(scope, store)``.

    Raises:
        RendezvousError: The ranks did not all connect within ``timeout`` seconds.
    """
    try:
        return dist.ProcessGroupGloo(
            dist.PrefixStore(scope, store), rank, world, datetime.timedelta(seconds=timeout)
        )
    except Exception as e:  # noqa: BLE001 - every torch failure becomes a CommError
        raise RendezvousError(
            f"{prefix}the fingerprint check's Gloo group did not form within {timeout:g} s "
            f"({first_line(e)}); every rank "
            "must create the group with the same COMMLIB_DEBUG"
        ) from e


def fingerprint_exchange(current: Callable[[], Any], world: int) -> FingerprintExchange:
    """Return the exchange: every rank's fingerprint, in rank order, from one all-gather.

    Args:
        current: Returns the fingerprint group, or None once the group closed. The group
            holds it alone: ``close`` must destroy it (which joins its worker threads). Left to
            the interpreter's exit, a worker still finishing the last all-gather would drop
            that work's tensors when Python can no longer take them back, and the process
            aborts after a clean run ("terminate called without an active exception").
        world: The number of ranks.
    """

    def exchange(mine: bytes, timeout: float, label: object, background: bool) -> bytes:
        where = label if isinstance(label, CollectiveLabel) else str(label)
        pg = current()
        if pg is None:
            raise CommError(f"{where}: the group is closed; create a new one")
        send = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
        everyone = torch.empty(len(mine) * world, dtype=torch.uint8)
        try:
            pg._allgather_base(everyone, send, async_options(AllgatherOptions)).wait(  # noqa: SLF001
                datetime.timedelta(seconds=timeout)
            )
        except Exception as e:  # noqa: BLE001
            # Worded as the collective's own failure: a dead or missing peer is what the user must see.
            raise translate(where, e, timeout) from e
        return everyone.numpy().tobytes()

    return exchange
