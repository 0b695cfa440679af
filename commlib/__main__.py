"""commlib's command line: ``python -m commlib COMMAND ...``.

Commands:

- ``flight DIR``: read every rank's flight-recorder dump in ``DIR`` (written with
  ``COMMLIB_FLIGHT_RECORDER=N`` and ``COMMLIB_DUMP_DIR``) and print where the
  ranks diverge (``commlib.diagnosis.flight_recorder.main``).

``import commlib`` does not import this module, so ``python -m commlib`` runs it
afresh rather than warning that it was imported already.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Sequence

from commlib.diagnosis.flight_recorder import main as flight_main

COMMANDS: dict[str, Callable[[Sequence[str]], int]] = {"flight": flight_main}
"""Command name -> its ``main(argv)``, which returns the exit status."""

USAGE = """usage: python -m commlib COMMAND ...
  flight DIR  print where the ranks' flight-recorder dumps diverge"""


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``COMMAND`` with the rest of ``argv``; return its exit status (2: no such command)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    if not args or args[0] not in COMMANDS:
        got = f"unknown command {args[0]!r}" if args else "no command given"
        print(f"{USAGE}\npython -m commlib: error: {got}", file=sys.stderr)
        return 2
    return COMMANDS[args[0]](args[1:])


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
