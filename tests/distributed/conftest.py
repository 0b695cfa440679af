"""Rank pools shared by the multi-process tests: one per (backend variant, world size)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest

from tests._launcher import RankPool

# Ring variants run with tiny chunks so that moderate sizes stream through many
# chunks (pipelining, slot reuse) and the small-message path covers tiny tensors.
_SMALL_CHUNKS = {
    "COMMLIB_RING_CHUNK_BYTES": "4096",
    "COMMLIB_RING_SMALL_BYTES": "1024",
    "COMMLIB_TIMEOUT": "60",
}
VARIANTS: dict[str, tuple[str, dict[str, str]]] = {
    "ring-shm": ("ring", {**_SMALL_CHUNKS, "COMMLIB_RING_TRANSPORT": "shm"}),
    "ring-tcp": ("ring", {**_SMALL_CHUNKS, "COMMLIB_RING_TRANSPORT": "tcp"}),
    "gloo": ("gloo", {"COMMLIB_TIMEOUT": "60"}),
}


def variant_available(variant: str) -> str | None:
    """Return why ``variant`` cannot run here, or None."""
    backend = VARIANTS[variant][0]
    if backend == "gloo" and importlib.util.find_spec("backends.torch") is None:
        return "backends/torch/group.py (the gloo backend) is not present"
    return None


@pytest.fixture(scope="session")
def pools() -> Iterator[dict[tuple[str, int], RankPool]]:
    cache: dict[tuple[str, int], RankPool] = {}
    yield cache
    for pool in cache.values():
        pool.close()


@pytest.fixture
def get_pool(pools: dict[tuple[str, int], RankPool]):  # type: ignore[no-untyped-def]
    def get(variant: str, world_size: int) -> RankPool:
        reason = variant_available(variant)
        if reason:
            pytest.skip(reason)
        key = (variant, world_size)
        if key not in pools:
            backend, env = VARIANTS[variant]
            pools[key] = RankPool(world_size, backend, env=env)
        return pools[key]

    return get
