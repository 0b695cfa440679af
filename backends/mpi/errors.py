"""MPI's failures as commlib's errors: the table ``commlib.translation.translate`` applies.

A message whose dtype or size differs from its receive's buffer (``Mismatch``) is a
``MessageMismatchError`` that names both layouts; an ``MPI.Exception`` names MPI's error class and
string; anything else its type and text.
"""

from __future__ import annotations

import functools
from typing import Any

from backends.common.p2p_protocol import Mismatch
from commlib.errors import CommError
from commlib.translation import FALLBACK, Rule, translate

__all__ = ["failure", "rules"]


def _mpi_fields(error: Any, text: str) -> dict[str, Any]:
    """MPI's error class and its error string on one line."""
    return {
        "error_class": error.Get_error_class(),
        "mpi_text": error.Get_error_string().strip().replace("\n", "; "),
    }


@functools.cache
def rules(MPI: Any) -> tuple[Rule, ...]:  # noqa: N803 - the mpi4py module's own name
    """The table for ``MPI`` (the loaded ``mpi4py.MPI``, whose ``Exception`` the first rule matches)."""
    return (
        Rule(
            CommError,
            "{label}: MPI error class {error_class}: {mpi_text}. Every rank must call the same collectives "
            "in the same order, with tensors of the same size and dtype.",
            types=(MPI.Exception,),
            fields=_mpi_fields,
        ),
        FALLBACK,
    )


def failure(describe: object, error: BaseException, MPI: Any) -> CommError:  # noqa: N803
    """The error an MPI call or request failed with, for people: a dtype or size mismatch, or an MPI error."""
    if isinstance(error, Mismatch):
        return error.error(describe)
    return translate(describe, error, rules(MPI))
