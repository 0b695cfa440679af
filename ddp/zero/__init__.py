"""ZeRO: optimizer state sharded across ranks (``ZeroRedundancyOptimizer``).

- ``optimizer``: ``ZeroRedundancyOptimizer``, each rank stepping its shard;
- ``partition``: ``ParameterPartition``, who owns which parameter elements;
- ``state``: moving optimizer state between ranks (consolidation, repartition);
- ``gather_stats``: how long the parameter all-gathers took, and how much was exposed.

ZeRO builds on DDP's bucket layer: with ``gradient_sync="reduce_scatter"`` the
optimizer follows the buckets' shards (``ddp.bucket_shards``) and leaves its
parameter all-gathers for the next forward to wait on (``ddp.param_gathers``).
"""

from __future__ import annotations

from ddp.zero.gather_stats import ParamGatherStats
from ddp.zero.optimizer import ZeroRedundancyOptimizer
from ddp.zero.partition import ParameterPartition

__all__ = ["ParamGatherStats", "ParameterPartition", "ZeroRedundancyOptimizer"]
