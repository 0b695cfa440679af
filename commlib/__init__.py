"""commlib: pluggable-backend collectives for data-parallel training."""

from __future__ import annotations

# First: an unsupported torch fails here with one clear message, before anything calls it.
from commlib import _torch_version  # noqa: F401  # isort: skip
from commlib.config import CommConfig
from commlib.diagnosis.flight_recorder import dump_flight_recorder
from commlib.env import DistEnv, detect
from commlib.errors import (
    BackendUnavailableError,
    CollectiveMismatchError,
    CommError,
    CommTimeoutError,
    GroupClosedError,
    NotInitializedError,
    PeerFailureError,
    RendezvousError,
    RendezvousTimeoutError,
)
from commlib.process_group import IProcessGroup
from commlib.registry import (
    available_backends,
    create_process_group,
    from_torch_group,
    is_available,
    register_backend,
    unregister_backend,
)
from commlib.types import ReduceOp
from commlib.work import CollectiveLabel, CompletedWork, EventWork, Work
from commlib.world import (
    DEFAULT_BACKEND,
    all_gather,
    all_reduce,
    barrier,
    broadcast,
    destroy_process_group,
    get_default_group,
    get_rank,
    get_world_size,
    init_process_group,
    is_initialized,
    reduce_scatter,
)

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailableError",
    "CollectiveLabel",
    "CollectiveMismatchError",
    "CommConfig",
    "CommError",
    "CommTimeoutError",
    "CompletedWork",
    "DEFAULT_BACKEND",
    "DistEnv",
    "EventWork",
    "GroupClosedError",
    "IProcessGroup",
    "NotInitializedError",
    "PeerFailureError",
    "ReduceOp",
    "RendezvousError",
    "RendezvousTimeoutError",
    "Work",
    "all_gather",
    "all_reduce",
    "available_backends",
    "barrier",
    "broadcast",
    "create_process_group",
    "destroy_process_group",
    "detect",
    "dump_flight_recorder",
    "from_torch_group",
    "get_default_group",
    "get_rank",
    "get_world_size",
    "init_process_group",
    "is_available",
    "is_initialized",
    "reduce_scatter",
    "register_backend",
    "unregister_backend",
]
