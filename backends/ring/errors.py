"""The ring's failures as commlib's errors: the table ``commlib.translation.translate`` applies.

The links raise commlib's errors themselves (``PeerFailureError`` when a peer closes its
connection, ``CommTimeoutError`` at a deadline); those keep their class and gain the
operation's label. What else a socket raises is translated here.
"""

from __future__ import annotations

from commlib.errors import CommError, CommTimeoutError
from commlib.translation import Rule, translate

__all__ = ["RULES", "translate_failure"]

RULES = (
    Rule(CommTimeoutError, "{label}: {error}", types=(TimeoutError,)),
    Rule(CommError, "{label}: {error}"),
)
"""A socket's timeout is a ``CommTimeoutError``; any other ``OSError`` a ``CommError``."""


def translate_failure(describe: object, error: BaseException) -> CommError:
    """Return the error a failed ring operation raises: ``error`` as commlib's, with ``describe``'s label."""
    return translate(describe, error, RULES)
