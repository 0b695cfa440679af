"""Faults injected into a rank from inside a test body."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["die_after_first"]


def die_after_first(link: Any, method: str, exit_code: int = 17) -> None:
    """End this process (``os._exit(exit_code)``) right after the first call of ``link.<method>``.

    A rank then dies inside its collective for certain, one chunk sent or lent and the rest never,
    where issuing it asynchronously and exiting could let its thread finish it first.
    """
    original = getattr(link, method)

    def then_die(*args: object) -> None:
        original(*args)
        os._exit(exit_code)

    setattr(link, method, then_die)
