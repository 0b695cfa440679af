"""The backend registry: built-in backends load lazily, others register or come by entry point."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import importlib.util
import threading
from collections.abc import Callable

from commlib.config import CommConfig
from commlib.env import DistEnv
from commlib.errors import BackendUnavailableError
from commlib.process_group import IProcessGroup

__all__ = [
    "BackendFactory",
    "ENTRY_POINT_GROUP",
    "register_backend",
    "unregister_backend",
    "available_backends",
    "is_available",
    "create_process_group",
    "from_torch_group",
]

BackendFactory = Callable[[DistEnv, CommConfig], IProcessGroup]
"""Creates a connected process group: ``factory(env, config) -> IProcessGroup``."""

ENTRY_POINT_GROUP = "commlib.backends"
"""Entry-point group through which a third-party package adds a backend.

In that package's ``pyproject.toml``::

    [project.entry-points."commlib.backends"]
    mybackend = "my_package.backend:create_group"
"""


@dataclasses.dataclass(frozen=True)
class _BuiltinBackend:
    module: str
    requires: tuple[str, ...]
    pip_hint: str


_BUILTINS: dict[str, _BuiltinBackend] = {
    "ring": _BuiltinBackend("backends.ring", ("torch",), "pip install commlib"),
    "gloo": _BuiltinBackend("backends.torch", ("torch",), "pip install commlib"),
    "nccl": _BuiltinBackend("backends.torch", ("torch",), "pip install commlib"),
    "mpi": _BuiltinBackend(
        "backends.mpi",
        ("mpi4py",),
        "pip install 'commlib[mpi]' (brings mpi4py and MPICH's mpirun), or run scripts/setup.sh",
    ),
}

_registry: dict[str, BackendFactory] = {}
_lock = threading.Lock()


def register_backend(name: str, factory: BackendFactory, *, replace: bool = False) -> None:
    """Make ``name`` selectable by ``init_process_group(name)`` and ``COMMLIB_BACKEND``.

    Args:
        name: Backend name; case-insensitive, stored lower-case.
        factory: ``factory(env, config)`` returns a connected ``IProcessGroup``.
        replace: Allow replacing a registered backend of the same name.

    Raises:
        ValueError: ``name`` is empty or already registered (and not ``replace``).
        TypeError: ``factory`` is not callable.
    """
    key = _normalise(name)
    if not callable(factory):
        raise TypeError(f"register_backend({name!r}): factory must be callable, got {factory!r}")
    with _lock:
        if key in _registry and not replace:
            raise ValueError(
                f"register_backend: backend {key!r} is already registered; pass replace=True to override it"
            )
        _registry[key] = factory


def unregister_backend(name: str) -> None:
    """Remove a registered backend (built-ins load again on next use)."""
    with _lock:
        _registry.pop(_normalise(name), None)


def _normalise(name: str) -> str:
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"backend name must be a non-empty string, got {name!r}")
    return name.strip().lower()


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name.lower(): ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def is_available(name: str) -> bool:
    """Return True if backend ``name`` is registered or its packages are installed.

    This does not import the backend, so it is cheap; creating the group can
    still fail (no GPU for ``nccl`` on CUDA tensors, no ``mpirun`` for ``mpi``).
    """
    key = _normalise(name)
    if key in _registry or key in _entry_points():
        return True
    builtin = _BUILTINS.get(key)
    if builtin is None:
        return False
    needed = (builtin.module, *builtin.requires)
    return all(importlib.util.find_spec(pkg) is not None for pkg in needed)


def available_backends() -> list[str]:
    """Return the sorted names of backends that can be chosen in this environment."""
    names = set(_registry) | set(_BUILTINS) | set(_entry_points())
    return sorted(n for n in names if is_available(n))


def _resolve(key: str) -> BackendFactory:
    with _lock:
        factory = _registry.get(key)
    if factory is not None:
        return factory
    builtin = _BUILTINS.get(key)
    if builtin is not None:
        try:
            module = importlib.import_module(builtin.module)
        except ImportError as e:
            if e.name == builtin.module:
                raise BackendUnavailableError(
                    f"backend {key!r}: its module {builtin.module} is missing from this installation; "
                    "reinstall commlib"
                ) from e
            missing = e.name or "a required package"
            raise BackendUnavailableError(
                f"backend {key!r} needs {missing}, which is not installed: {builtin.pip_hint}. "
                f"Other backends are unaffected (available: {', '.join(available_backends())})"
            ) from e
        factory = getattr(module, "BACKENDS", {}).get(key)
        if factory is None:
            raise BackendUnavailableError(f"module {builtin.module} does not define backend {key!r}")
        with _lock:
            _registry.setdefault(key, factory)
        return factory
    entry_point = _entry_points().get(key)
    if entry_point is not None:
        try:
            factory = entry_point.load()
        except Exception as e:
            raise BackendUnavailableError(
                f"backend {key!r} from entry point {entry_point.value!r} failed to load: {e}"
            ) from e
        with _lock:
            _registry.setdefault(key, factory)
        return factory
    raise BackendUnavailableError(
        f"unknown backend {key!r}; available: {', '.join(available_backends())}. Register one "
        f"with commlib.register_backend() or the {ENTRY_POINT_GROUP!r} entry-point group"
    )


def create_process_group(
    name: str,
    env: DistEnv,
    config: CommConfig,
    *,
    global_ranks: tuple[int, ...] | None = None,
    group_name: str | None = None,
) -> IProcessGroup:
    """Create and connect a process group of backend ``name``, with the diagnosis ``config`` asks for.

    ``global_ranks`` / ``group_name``: where a group made by someone else's ``new_group`` (torch's,
    through the adapter) sits in the job: its members' global ranks (None for the job's default
    group) and a name alike on every member. Set before the diagnosis starts, which names the
    group by them.

    Raises:
        BackendUnavailableError: Unknown backend, or its package is not installed.
        CommError: The group, or its diagnosis side channel (``COMMLIB_DEBUG=DETAIL``), could not be set up.
    """
    key = _normalise(name)
    group = _resolve(key)(env, config)
    if not isinstance(group, IProcessGroup):
        raise TypeError(f"backend {key!r} factory returned {type(group).__name__}, not an IProcessGroup")
    group._place_in_job(global_ranks, group_name)
    group._start_diagnostics()
    return group


def from_torch_group(pg: object = None, *, config: CommConfig | None = None) -> IProcessGroup:
    """Wrap an initialised torch.distributed process group as a commlib ``IProcessGroup``.

    For code that set up torch.distributed itself. The torch group stays owned
    by the caller: closing the commlib group leaves it alone. The wrapper is the
    ``gloo``/``nccl`` backend, loaded through this registry like any other.

    Args:
        pg: A ``torch.distributed.ProcessGroup``; default: torch's default group.
        config: Shared settings; default from ``COMMLIB_*`` variables.

    Raises:
        CommError: torch.distributed is not initialised.
    """
    module = importlib.import_module(_BUILTINS["gloo"].module)
    group: IProcessGroup = module.from_torch_group(pg, config=config)
    return group
