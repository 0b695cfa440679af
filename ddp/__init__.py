"""Backend-agnostic data parallelism: gradient buckets and DistributedDataParallel."""

from __future__ import annotations

from ddp.bucket import GradientBucket
from ddp.bucket_manager import GradientBucketManager, plan_buckets
from ddp.config import DDPConfig
from ddp.distributed import DistributedDataParallel, MissingGradientsError
from ddp.replicas import ModelMismatchError, broadcast_module_states, verify_same_model
from ddp.stats import BucketTiming, StepStats

__all__ = [
    "BucketTiming",
    "DDPConfig",
    "DistributedDataParallel",
    "GradientBucket",
    "GradientBucketManager",
    "MissingGradientsError",
    "ModelMismatchError",
    "StepStats",
    "broadcast_module_states",
    "plan_buckets",
    "verify_same_model",
]
