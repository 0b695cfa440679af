"""Backend-agnostic data parallelism: gradient buckets and DistributedDataParallel."""

from __future__ import annotations

from ddp.auto_bucket import AutoBucketReport
from ddp.bucket import GradientBucket
from ddp.bucket_manager import GradientBucketManager, plan_buckets
from ddp.config import DDPConfig, GradientScaling
from ddp.cost_model import CommCostModel, calibrate, fit_cost_model
from ddp.distributed import DistributedDataParallel
from ddp.errors import (
    AbandonedBackwardError,
    BucketOrderError,
    CommHookError,
    EarlyTerminationError,
    MissingGradientsError,
    ModelMismatchError,
    NonFiniteGradientError,
    ParametersChangedError,
    RanksOutOfStepError,
    RepeatedGradientError,
    StateNotConsolidatedError,
    UnsupportedCollectiveError,
)
from ddp.hooks import (
    PowerSGDState,
    allreduce_hook,
    batched_powerSGD_hook,
    bf16_compress_hook,
    bf16_compress_wrapper,
    fp16_compress_hook,
    fp16_compress_wrapper,
    noop_hook,
    powerSGD_hook,
)
from ddp.join import Join, Joinable, JoinHook
from ddp.observe.stats import BucketTiming, StepStats
from ddp.observe.timeline import TimelineWriter
from ddp.replicas import broadcast_module_states, verify_same_model
from ddp.zero import ParameterPartition, ZeroRedundancyOptimizer
from ddp.zero.gather_stats import ParamGatherStats

__all__ = [
    "AbandonedBackwardError",
    "AutoBucketReport",
    "BucketOrderError",
    "BucketTiming",
    "CommCostModel",
    "CommHookError",
    "DDPConfig",
    "DistributedDataParallel",
    "EarlyTerminationError",
    "GradientBucket",
    "GradientBucketManager",
    "GradientScaling",
    "Join",
    "JoinHook",
    "Joinable",
    "MissingGradientsError",
    "ModelMismatchError",
    "NonFiniteGradientError",
    "ParamGatherStats",
    "ParameterPartition",
    "ParametersChangedError",
    "PowerSGDState",
    "RepeatedGradientError",
    "RanksOutOfStepError",
    "StateNotConsolidatedError",
    "StepStats",
    "TimelineWriter",
    "UnsupportedCollectiveError",
    "ZeroRedundancyOptimizer",
    "allreduce_hook",
    "batched_powerSGD_hook",
    "bf16_compress_hook",
    "bf16_compress_wrapper",
    "broadcast_module_states",
    "calibrate",
    "fit_cost_model",
    "fp16_compress_hook",
    "fp16_compress_wrapper",
    "noop_hook",
    "plan_buckets",
    "powerSGD_hook",
    "verify_same_model",
]
