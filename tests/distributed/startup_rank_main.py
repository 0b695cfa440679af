"""One rank, as a user's training script: join the group from the environment and all-reduce ``rank + 1``.

Usage (one process per rank, each perhaps under a wrapper of its own)::

    RANK=0 WORLD_SIZE=2 MASTER_PORT=29500 COMMLIB_BACKEND=ring python tests/distributed/startup_rank_main.py

Prints one JSON line: the sum, or the rendezvous error and when it came.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.distributed.startup_bodies import join_and_sum  # noqa: E402

if __name__ == "__main__":
    result = join_and_sum(os.environ.get("COMMLIB_BACKEND", "ring"))
    # One write of the whole line: the ranks share the stdout pipe, and print() writes the line and its
    # newline separately, so two ranks' lines could run together.
    sys.stdout.write(json.dumps({"rank": int(os.environ["RANK"]), **result}) + "\n")
    sys.stdout.flush()
