"""A pytest plugin that prints a failing test's report the moment it fails (``-p tests.report_at_once``).

For runs that may be stopped before pytest's own summary: a stage of ``scripts/gpu_check.sh`` on a
lent machine has a fixed budget, and a run killed at its end prints no failures otherwise. Under
pytest-xdist the reports reach the controller, which prints them.
"""

from __future__ import annotations

import sys

import pytest

MAX_CHARS = 5000
"""The tail of each report that is printed (the error and the frames nearest it)."""


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.failed:
        name, text = report.nodeid, report.longreprtext[-MAX_CHARS:]
        sys.stdout.write(f"\n--- FAILED {name} ({report.when})\n{text}\n--- end of {name}\n")
        sys.stdout.flush()
