"""Run the collective test bodies under a real launcher: ``torchrun`` or ``mpirun``.

Usage::

    torchrun --nproc-per-node 2 tests/distributed/launcher_main.py
    mpirun -n 2 python tests/distributed/launcher_main.py
    COMMLIB_BACKEND=gloo torchrun --nproc-per-node 3 tests/distributed/launcher_main.py

Rank, world size and the backend come from the environment, exactly as in a
user's training script. Prints ``LAUNCHER-BODIES-OK <rank> <world> <backend>``
on success; exits non-zero with the failing body's error otherwise.
"""

from __future__ import annotations

import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

import commlib  # noqa: E402
from tests.distributed import bodies, object_bodies, p2p_bodies, subgroup_bodies  # noqa: E402

SIZES = (0, 1, 13, 1000)
"""The spawned tests cover 40003 elements; here the bodies check the launchers' wiring on every dtype."""


def main() -> int:
    group = commlib.init_process_group()
    label = f"rank {group.rank}/{group.world_size} backend {group.backend}"
    try:
        for body in bodies.ALL_BODIES.values():
            body(group, sizes=SIZES)
        bodies.body_async_order(group)
        bodies.body_shapes_and_views(group)
        p2p_bodies.body_ring_exchange(group)
        p2p_bodies.body_skipping_pairs(group)
        p2p_bodies.body_many_in_order(group, 50)
        p2p_bodies.body_size_mismatch(group)
        subgroup_bodies.body_split(group)
        if group.world_size >= 3:
            subgroup_bodies.body_overlapping_groups(group, rounds=1)
        object_bodies.body_objects(group)
        # Every rank must hold bitwise the same all_reduce results: compare digests.
        digests = bodies.body_all_reduce(group, "float32", (1000,))
        mine = torch.tensor([int(d, 16) % (1 << 52) for d in digests], dtype=torch.float64)
        everyone = torch.empty(group.world_size * mine.numel(), dtype=torch.float64)
        group.all_gather(everyone, mine)
        same = torch.equal(everyone.view(group.world_size, -1), mine.expand(group.world_size, -1))
        assert same, "ranks disagree bit for bit on all_reduce results"
    except Exception:
        print(f"LAUNCHER-BODIES-FAILED {label}\n{traceback.format_exc()}", flush=True)
        return 1
    finally:
        commlib.destroy_process_group()
    print(f"LAUNCHER-BODIES-OK {group.rank} {group.world_size} {group.backend}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
