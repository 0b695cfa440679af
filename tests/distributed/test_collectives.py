"""The collective matrix: op x dtype x size x world size on every backend, against float64 references.

Each test runs one collective over every dtype of the contract in one call to
the ranks (the bodies name the dtype, op and size of any wrong result).
"""

from __future__ import annotations

import pytest

from tests._launcher import run_ranks
from tests.distributed import bodies
from tests.distributed.conftest import VARIANTS

pytestmark = pytest.mark.multiprocess
# (variant, world size): every world size on the default transports; TCP on 2 and 3 ranks
# (a world of 1 has no links, and 4 adds nothing over 3 for the framing it tests).
CASES = [(v, w) for v in VARIANTS if v != "ring-tcp" for w in (1, 2, 3, 4)] + [
    ("ring-tcp", 2),
    ("ring-tcp", 3),
]


@pytest.mark.parametrize(("variant", "world_size"), CASES)
@pytest.mark.parametrize("collective", list(bodies.ALL_BODIES))
def test_collective_matrix(get_pool, variant: str, world_size: int, collective: str) -> None:
    pool = get_pool(variant, world_size)
    digests = pool.run(bodies.ALL_BODIES[collective], timeout=240)
    assert all(d == digests[0] for d in digests), "ranks disagree bit for bit"


@pytest.mark.parametrize("world_size", (2, 3))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_async_collectives_run_in_issue_order(get_pool, variant: str, world_size: int) -> None:
    digests = get_pool(variant, world_size).run(bodies.body_async_order, timeout=60)
    assert all(d == digests[0] for d in digests)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_multidimensional_tensors_and_views(get_pool, variant: str) -> None:
    get_pool(variant, 2).run(bodies.body_shapes_and_views, timeout=60)


@pytest.mark.parametrize(("variant", "world_size"), CASES)
def test_max_min_propagate_nan_as_torch_maximum(get_pool, variant: str, world_size: int) -> None:
    """Whichever rank holds the NaN, on a chunk or segment boundary or not: the result is NaN there."""
    digests = get_pool(variant, world_size).run(bodies.body_nan_max_min, timeout=120)
    assert all(d == digests[0] for d in digests), "ranks disagree bit for bit"


@pytest.mark.parametrize(("variant", "world_size"), CASES)
def test_in_place_collectives_bump_the_autograd_version(get_pool, variant: str, world_size: int) -> None:
    digests = get_pool(variant, world_size).run(bodies.body_in_place_bumps_version, timeout=60)
    assert all(d == digests[0] for d in digests)


@pytest.mark.parametrize("variant", ["ring-shm", "ring-tcp"])
def test_a_ring_collective_reaches_its_algorithm_in_three_plumbing_frames(get_pool, variant: str) -> None:
    """From the hook: ``_submit``, the lane's ``submit``, and ``_execute`` (it turns failures into errors)."""
    for chains in get_pool(variant, 2).run(bodies.body_ring_plumbing_frames, timeout=60):
        assert len(chains) == 4
        for chain in chains:
            assert chain == ["RingProcessGroup._execute", "Lane.submit", "RingProcessGroup._submit"], chain


def test_with_the_small_message_path_off_a_tensor_of_fewer_elements_than_ranks_reduces() -> None:
    """``COMMLIB_RING_SMALL_BYTES=0`` (off): on two ranks, one rank's half of a 1-element tensor is empty."""
    env = {"COMMLIB_RING_SMALL_BYTES": "0", "COMMLIB_TIMEOUT": "30"}
    for variant in ("ring-shm", "ring-tcp"):
        env["COMMLIB_RING_TRANSPORT"] = VARIANTS[variant][1]["COMMLIB_RING_TRANSPORT"]
        args = (("float32", "int64"), (1, 2, 3))
        digests = run_ranks(bodies.body_all_reduce, 2, backend="ring", args=args, env=env, timeout=120)
        assert digests[0] == digests[1] and digests[0], variant  # each checked against the reference
