"""``python -m commlib.flight DIR``: read every rank's flight-recorder dump and print where they diverge.

The recorder itself is ``commlib.diagnosis.flight_recorder`` (``COMMLIB_FLIGHT_RECORDER=N``
and ``COMMLIB_DUMP_DIR``). This module is only the command line, and ``import
commlib`` does not import it: ``python -m`` runs a module that is not yet
imported, and would otherwise warn that it was. Its names are re-exported here
for code that imported them from ``commlib.flight``.
"""

from __future__ import annotations

import contextlib
import sys

from commlib.diagnosis.flight_recorder import (
    DUMP_PATTERN,
    FlightRecorder,
    dump_flight_recorder,
    find_divergence,
    load_dumps,
    main,
)

__all__ = ["DUMP_PATTERN", "FlightRecorder", "dump_flight_recorder", "find_divergence", "load_dumps", "main"]

if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
