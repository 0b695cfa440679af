"""Parity with torch's DDP on real ranks: Join with uneven inputs, buffers every forward, static graphs.

The bodies are in ``parity_bodies``; ``tests/test_ddp_parity.py`` runs the same ones on
threaded fake groups.
"""

from __future__ import annotations

import pytest

from tests.distributed.parity_bodies import (
    case_buffers_every_forward,
    case_join,
    case_repeated_gradient,
    case_static_graph,
    check_buffers,
    check_join,
)

pytestmark = pytest.mark.multiprocess

VARIANTS = ["ring-shm", "gloo"]


# Batches per rank: 3, 5 and 7, uneven; rank 0 runs out first in some (buffers then come from another).
@pytest.mark.parametrize("counts", [[3, 5], [7, 3], [5, 7, 3]], ids=["3-5", "7-3", "5-7-3"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_join_uneven_inputs(get_pool, variant: str, counts: list[int]) -> None:
    check_join(get_pool(variant, len(counts)).run(case_join, counts, timeout=120))


@pytest.mark.parametrize("variant", VARIANTS)
def test_buffers_from_rank0_every_forward(get_pool, variant: str) -> None:
    check_buffers(get_pool(variant, 2).run(case_buffers_every_forward, timeout=60))


@pytest.mark.parametrize("variant", VARIANTS)
def test_static_graph_reentrant_checkpointing(get_pool, variant: str) -> None:
    results = get_pool(variant, 2).run(case_static_graph, timeout=60)
    assert results[0]["params"] == results[1]["params"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_repeated_gradient_without_static_graph(get_pool, variant: str) -> None:
    results = get_pool(variant, 2).run(case_repeated_gradient, timeout=60)
    assert results[0]["parameter"] == results[1]["parameter"]
    assert [r["after"] for r in results] == [2.0, 2.0]
