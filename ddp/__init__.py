"""Backend-agnostic data parallelism: gradient buckets and DistributedDataParallel."""

from __future__ import annotations

from ddp.auto_bucket import AutoBucketReport
from ddp.bucket import GradientBucket
from ddp.bucket_manager import GradientBucketManager, plan_buckets
from ddp.config import DDPConfig
from ddp.cost_model import CommCostModel, calibrate, fit_cost_model
from ddp.distributed import DistributedDataParallel
from ddp.errors import AbandonedBackwardError, MissingGradientsError, ModelMismatchError
from ddp.replicas import broadcast_module_states, verify_same_model
from ddp.stats import BucketTiming, StepStats
from ddp.timeline import TimelineWriter
from ddp.zero import ParameterPartition, ZeroRedundancyOptimizer

__all__ = [
    "AbandonedBackwardError",
    "AutoBucketReport",
    "BucketTiming",
    "CommCostModel",
    "DDPConfig",
    "DistributedDataParallel",
    "GradientBucket",
    "GradientBucketManager",
    "MissingGradientsError",
    "ModelMismatchError",
    "ParameterPartition",
    "StepStats",
    "TimelineWriter",
    "ZeroRedundancyOptimizer",
    "broadcast_module_states",
    "calibrate",
    "fit_cost_model",
    "plan_buckets",
    "verify_same_model",
]
