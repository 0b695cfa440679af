"""What ``/proc/<pid>/stat`` says about a process: its name, parent, process group and start time."""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["ProcessInfo", "read_process"]


class ProcessInfo(NamedTuple):
    """The fields of stat(5) that commlib uses.

    Attributes:
        name: The command name (``comm``, at most 15 characters).
        ppid: The parent's pid.
        pgid: The process group's id.
        start: Start time in clock ticks since boot: with the pid, it names one
            process for good (a pid is reused, a pid and start time are not).
    """

    name: str
    ppid: int
    pgid: int
    start: int


def read_process(pid: int) -> ProcessInfo | None:
    """Return what ``/proc/<pid>/stat`` says about ``pid``, or None if there is no such process to read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    try:
        # The name is in parentheses and may itself hold spaces and parentheses: split after the last one.
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        return ProcessInfo(name, int(fields[1]), int(fields[2]), int(fields[19]))
    except (ValueError, IndexError):
        return None
