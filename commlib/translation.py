"""A transport's failure as commlib's error, by a table of rules each backend declares.

A backend lists its rules in its ``errors`` module (``backends/ring/errors.py``,
``backends/torch/errors.py``, ``backends/mpi/errors.py``) and calls ``translate`` with them
when an operation fails; nothing here runs on a successful call.

A rule's message is a ``str.format`` template over these fields:

- ``label``: the failed operation (``[rank 0/2] gloo.all_reduce #2 (float32, 100 elements)``);
- ``error``: the error's text as ``str`` gives it;
- ``first``: the first line of that text, stripped (the error's type name if it has none);
- ``line``: the first line that holds one of the rule's substrings, stripped (else ``first``);
- ``kind``: the error's type name;
- the keyword arguments given to ``translate`` (a backend's ``limit``, ...);
- what the rule's ``fields`` function returns for the error (a peer's address, MPI's error class, ...).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from commlib.errors import CommError

__all__ = ["FALLBACK", "Rule", "first_line", "translate"]


@dataclass(frozen=True)
class Rule:
    """One line of a backend's table: which errors it matches, and the error it makes of them.

    Attributes:
        raises: The commlib error class to raise.
        message: A ``str.format`` template (see the module's docstring for its fields).
        types: The rule matches an error that is an instance of one of these...
        contains: ...or whose text holds one of these substrings (compared case-insensitively).
            A rule with neither matches every error: a table's default, placed last.
        fields: Extra template fields computed from the error and its stripped text.
    """

    raises: type[CommError]
    message: str
    types: tuple[type[BaseException], ...] = ()
    contains: tuple[str, ...] = ()
    fields: Callable[[BaseException, str], Mapping[str, Any]] | None = None

    def matches(self, error: BaseException, lowered: str) -> bool:
        """Return True if the rule applies to ``error`` (``lowered``: its text in lower case)."""
        if not self.types and not self.contains:
            return True
        return isinstance(error, self.types) or any(s.lower() in lowered for s in self.contains)


FALLBACK = Rule(CommError, "{label}: {kind}: {error}")
"""What ``translate`` applies when no rule of the table matches."""


def translate(describe: object, error: BaseException, rules: Sequence[Rule], **context: Any) -> CommError:
    """Return the commlib error for ``error``: the first rule of ``rules`` that matches it, or ``FALLBACK``.

    An error that is already a ``CommError`` keeps its class as ``commlib.errors`` names it (a
    backend's own subclass becomes the commlib class it derives from) and its attributes; its
    message gains the label (``"{label}: {error}"``).

    Args:
        describe: The failed operation (a ``CollectiveLabel`` or text), the message's prefix.
        error: What the transport raised.
        rules: The backend's table, tried in order.
        **context: Further template fields (the group's ``limit``, ...).
    """
    label = str(describe)
    if isinstance(error, CommError):
        cls = next(c for c in type(error).__mro__ if c.__module__ == CommError.__module__)
        kept = cls(f"{label}: {error}")
        kept.__dict__.update(error.__dict__)  # a PeerFailureError's ``exited``
        return kept
    text = str(error).strip()
    lowered = text.lower()
    rule = next((rule for rule in rules if rule.matches(error, lowered)), FALLBACK)
    first = first_line(error)
    line = next(
        (ln.strip() for ln in text.splitlines() if any(s.lower() in ln.lower() for s in rule.contains)), first
    )
    fields = {"label": label, "error": str(error), "first": first, "line": line, "kind": type(error).__name__}
    fields.update(context)
    if rule.fields is not None:
        fields.update(rule.fields(error, text))
    return rule.raises(rule.message.format(**fields))


def first_line(error: BaseException) -> str:
    """The first line of ``error``'s message, or its type's name when the message is empty."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
