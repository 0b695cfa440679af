"""ZeRO: optimizer state sharded across ranks (``ZeroRedundancyOptimizer``), and DDP's reduce-scatter side.

- ``optimizer``: ``ZeroRedundancyOptimizer``, each rank stepping its shard;
- ``partition``: ``ParameterPartition``, who owns which parameter elements;
- ``state``: moving optimizer state between ranks (consolidation, repartition);
- ``shard_sync``: ``gradient_sync="reduce_scatter"`` (DDP's buckets reduce-scattered,
  the layout the optimizer follows, the overlapped parameter all-gathers);
- ``gather_stats``: how long the parameter all-gathers took, and how much was exposed.
"""

from __future__ import annotations

from ddp.zero.gather_stats import ParamGatherStats
from ddp.zero.optimizer import ZeroRedundancyOptimizer
from ddp.zero.partition import ParameterPartition

__all__ = ["ParamGatherStats", "ParameterPartition", "ZeroRedundancyOptimizer"]
