"""Writing a benchmark's rows to CSV, the one way every benchmark here does it.

Not named ``_csv``: a script's own folder comes first on ``sys.path`` and would hide the standard
library's module of that name.
"""

from __future__ import annotations

import csv
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["write_csv"]


def write_csv(path: Path | str, columns: Sequence[str], rows: Sequence[Mapping[str, Any]]) -> None:
    """Write ``rows`` under the header ``columns`` to ``path`` (folder created; None: an empty cell)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns))
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if row.get(k) is None else row[k]) for k in columns})
