"""Names of the ring's shared-memory files, which say whose they are, and the reaping of stale ones.

A link's inbox and wake pipes live in ``/dev/shm`` (or ``COMMLIB_RING_SHM_DIR``)
only for the moment between their creation and the neighbour's opening them;
then the creator unlinks them. A process killed inside that moment leaves them
behind. Each name therefore carries its creator's pid namespace, pid and start
time::

    commlib-ring-<pid namespace>-<pid>-<start ticks>-<random>[.wake-recv|.wake-send]

and every group start removes the files whose creator is gone: same pid
namespace, same user, and no process with that pid and start time. A live
process's files are never touched (a pid and start time name one process for
good), nor files of another pid namespace (a container sharing ``/dev/shm``,
where this process cannot see whether their creator lives).
"""

from __future__ import annotations

import logging
import os
import re
import secrets

from commlib.procfs import read_process

__all__ = ["new_path", "reap_stale"]

logger = logging.getLogger("commlib")

_NAME = re.compile(r"commlib-ring-(\d+)-(\d+)-(\d+)-[0-9a-f]{12}(?:\.wake-recv|\.wake-send)?")


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def new_path(directory: str) -> str:
    """A fresh path in ``directory`` for this process's next shared-memory file (its name says whose)."""
    me = read_process(os.getpid())
    start = me.start if me is not None else 0
    return os.path.join(
        directory, f"commlib-ring-{_pid_namespace()}-{os.getpid()}-{start}-{secrets.token_hex(6)}"
    )


def _owner_gone(pid: int, start: int) -> bool:
    info = read_process(pid)
    return info is None or info.start != start


def reap_stale(directory: str) -> list[str]:
    """Remove the ring's files in ``directory`` whose creator has exited; return the names removed."""
    namespace, uid = _pid_namespace(), os.geteuid()
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    removed = []
    for name in names:
        match = _NAME.fullmatch(name)
        if match is None or int(match[1]) != namespace or int(match[2]) == os.getpid():
            continue
        path = os.path.join(directory, name)
        try:
            if os.lstat(path).st_uid != uid or not _owner_gone(int(match[2]), int(match[3])):
                continue
            os.unlink(path)
        except OSError:  # gone meanwhile (another group reaped it), or not ours to remove
            continue
        removed.append(name)
    if removed:
        logger.debug("removed %d shared-memory file(s) of exited processes from %s", len(removed), directory)
    return removed
