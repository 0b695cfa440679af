"""The backend registry, entry-point plug-ins, ``init_process_group`` and the default group."""

from __future__ import annotations

import datetime
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import commlib
import commlib.registry as registry
import commlib.world as world
from commlib import (
    BackendUnavailableError,
    CommConfig,
    CommError,
    GroupClosedError,
    NotInitializedError,
)
from commlib.registry import _BuiltinBackend
from tests._fake_groups import FakeGroup, fake_factory, make_env
from tests.conftest import REPO_ROOT, scrubbed_env

pytestmark = pytest.mark.usefixtures("clean_commlib")

CONFIG = CommConfig(timeout=5)


def factory_for(cls: type[FakeGroup] = FakeGroup):  # noqa: ANN201 - a BackendFactory
    def factory(env: commlib.DistEnv, config: CommConfig) -> FakeGroup:
        return cls(env, config)

    return factory


# ------------------------------------------------------------ registration
def test_register_and_create() -> None:
    commlib.register_backend("unit-fake", fake_factory)
    env = make_env(0, 1)
    group = commlib.create_process_group("unit-fake", env, CONFIG)
    assert isinstance(group, FakeGroup)
    assert group is fake_factory.created[-1]  # type: ignore[attr-defined]
    assert group.env is env and group.config is CONFIG
    assert commlib.is_available("unit-fake")
    assert "unit-fake" in commlib.available_backends()


def test_names_are_case_insensitive_and_stripped() -> None:
    commlib.register_backend("  Unit-Fake ", fake_factory)
    assert commlib.is_available("UNIT-FAKE")
    assert isinstance(commlib.create_process_group("unit-FAKE", make_env(), CONFIG), FakeGroup)
    assert "unit-fake" in commlib.available_backends()


def test_duplicate_registration_is_refused() -> None:
    commlib.register_backend("unit-dup", fake_factory)
    with pytest.raises(ValueError, match=r"backend 'unit-dup' is already registered; pass replace=True"):
        commlib.register_backend("UNIT-DUP", factory_for())


def test_replace_swaps_the_factory() -> None:
    commlib.register_backend("unit-rep", fake_factory)
    replacement = factory_for()
    commlib.register_backend("unit-rep", replacement, replace=True)
    group = commlib.create_process_group("unit-rep", make_env(), CONFIG)
    assert group not in fake_factory.created  # type: ignore[attr-defined]


def test_unregister_makes_it_unknown_again() -> None:
    commlib.register_backend("unit-gone", fake_factory)
    commlib.unregister_backend("Unit-Gone")
    assert not commlib.is_available("unit-gone")
    with pytest.raises(BackendUnavailableError, match="unknown backend 'unit-gone'"):
        commlib.create_process_group("unit-gone", make_env(), CONFIG)
    commlib.unregister_backend("unit-gone")  # a second time is harmless


@pytest.mark.parametrize("name", ["", "   ", None, 3])
def test_bad_names_are_refused(name: object) -> None:
    with pytest.raises(ValueError, match=rf"backend name must be a non-empty string, got {name!r}"):
        commlib.register_backend(name, fake_factory)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="backend name must be a non-empty string"):
        commlib.is_available(name)  # type: ignore[arg-type]


def test_factory_must_be_callable() -> None:
    with pytest.raises(TypeError, match=r"register_backend\('unit-x'\): factory must be callable, got 42"):
        commlib.register_backend("unit-x", 42)  # type: ignore[arg-type]
    assert not commlib.is_available("unit-x")


def test_factory_must_return_a_process_group() -> None:
    commlib.register_backend("unit-bad", lambda env, config: object())  # type: ignore[arg-type,return-value]
    with pytest.raises(TypeError, match=r"backend 'unit-bad' factory returned object, not an IProcessGroup"):
        commlib.create_process_group("unit-bad", make_env(), CONFIG)


def test_unknown_backend_lists_the_available_ones() -> None:
    commlib.register_backend("unit-listed", fake_factory)
    with pytest.raises(BackendUnavailableError) as info:
        commlib.create_process_group("rign", make_env(), CONFIG)
    message = str(info.value)
    assert "unknown backend 'rign'" in message
    available = commlib.available_backends()
    assert "unit-listed" in available
    assert f"available: {', '.join(available)}" in message
    assert "commlib.register_backend()" in message and "'commlib.backends' entry-point group" in message
    assert isinstance(info.value, ImportError) and isinstance(info.value, CommError)


# --------------------------------------------------------------- built-ins
def test_builtin_table_names_the_backends_and_the_mpi_extra() -> None:
    assert {"ring", "gloo", "nccl", "mpi"} <= set(registry._BUILTINS)
    assert registry._BUILTINS["mpi"].requires == ("mpi4py",)
    assert "commlib[mpi]" in registry._BUILTINS["mpi"].pip_hint


_LAZY_CHECK = """
import sys
import commlib
heavy = [m for m in ("backends.ring", "backends.torch", "backends.mpi", "mpi4py", "cupy") if m in sys.modules]
print("LOADED", heavy)
commlib.available_backends()
commlib.is_available("mpi")
heavy = [m for m in ("backends.ring", "backends.torch", "backends.mpi", "mpi4py", "cupy") if m in sys.modules]
print("AFTER_QUERY", heavy)
"""


@pytest.mark.timeout(120)
def test_importing_commlib_loads_no_backend() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _LAZY_CHECK],
        cwd=REPO_ROOT,
        env=scrubbed_env(PYTHONPATH=str(REPO_ROOT)),
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 0, proc.stderr
    assert "LOADED []" in proc.stdout, proc.stdout
    assert "AFTER_QUERY []" in proc.stdout, proc.stdout


def _write_module(directory: Path, name: str, source: str) -> None:
    (directory / f"{name}.py").write_text(textwrap.dedent(source))


@pytest.fixture
def module_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory on sys.path for modules written by the test; they are forgotten afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        if name.startswith("commlib_unit_"):
            del sys.modules[name]


def test_builtin_is_imported_on_first_use_only(module_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write_module(
        module_dir,
        "commlib_unit_lazy",
        """
        from tests._fake_groups import FakeGroup

        class LazyGroup(FakeGroup):
            backend_name = "unitlazy"

        BACKENDS = {"unitlazy": LazyGroup}
        """,
    )
    monkeypatch.setitem(
        registry._BUILTINS, "unitlazy", _BuiltinBackend("commlib_unit_lazy", ("torch",), "pip install x")
    )
    assert commlib.is_available("unitlazy")
    assert "unitlazy" in commlib.available_backends()
    assert "commlib_unit_lazy" not in sys.modules
    group = commlib.create_process_group("unitlazy", make_env(), CONFIG)
    assert "commlib_unit_lazy" in sys.modules
    assert group.backend == "unitlazy"
    assert registry._registry["unitlazy"] is sys.modules["commlib_unit_lazy"].BACKENDS["unitlazy"]


def test_missing_package_names_the_pip_extra(module_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write_module(
        module_dir, "commlib_unit_needs_pkg", "import commlib_unit_not_installed_pkg\nBACKENDS = {}\n"
    )
    hint = "pip install 'commlib[unitextra]' (brings commlib_unit_not_installed_pkg)"
    monkeypatch.setitem(
        registry._BUILTINS,
        "unitmpi",
        _BuiltinBackend("commlib_unit_needs_pkg", ("commlib_unit_not_installed_pkg",), hint),
    )
    assert not commlib.is_available("unitmpi")
    assert "unitmpi" not in commlib.available_backends()
    with pytest.raises(BackendUnavailableError) as info:
        commlib.create_process_group("unitmpi", make_env(), CONFIG)
    message = str(info.value)
    assert "backend 'unitmpi' needs commlib_unit_not_installed_pkg, which is not installed" in message
    assert hint in message
    assert "Other backends are unaffected" in message
    assert isinstance(info.value.__cause__, ImportError)
    assert "unitmpi" not in registry._registry


def test_builtin_module_without_the_backend(module_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write_module(module_dir, "commlib_unit_empty", "BACKENDS = {}\n")
    monkeypatch.setitem(
        registry._BUILTINS, "unitempty", _BuiltinBackend("commlib_unit_empty", ("torch",), "x")
    )
    with pytest.raises(
        BackendUnavailableError, match=r"module commlib_unit_empty does not define backend 'unitempty'"
    ):
        commlib.create_process_group("unitempty", make_env(), CONFIG)


def test_registered_backend_shadows_builtin() -> None:
    commlib.register_backend("ring", fake_factory, replace=True)
    assert isinstance(commlib.create_process_group("ring", make_env(), CONFIG), FakeGroup)


# ------------------------------------------------------------- entry points
def _write_plugin(site: Path, dist: str, entry_points: str) -> None:
    info = site / f"{dist}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(entry_points))


def test_entry_point_plugin_is_discovered(module_dir: Path) -> None:
    _write_module(
        module_dir,
        "commlib_unit_plugin",
        """
        from tests._fake_groups import FakeGroup

        class PluginGroup(FakeGroup):
            backend_name = "unitplug"

        def create_group(env, config):
            return PluginGroup(env, config)
        """,
    )
    _write_plugin(
        module_dir,
        "commlib_unit_plugin_dist",
        "[commlib.backends]\nUnitPlug = commlib_unit_plugin:create_group\n",
    )
    assert commlib.is_available("unitplug")
    assert "unitplug" in commlib.available_backends()
    assert "commlib_unit_plugin" not in sys.modules  # discovered without importing
    group = commlib.create_process_group("UnitPlug", make_env(), CONFIG)
    assert type(group).__name__ == "PluginGroup" and group.backend == "unitplug"
    assert "unitplug" in registry._registry


def test_broken_entry_point_names_it(module_dir: Path) -> None:
    _write_module(module_dir, "commlib_unit_broken", "raise RuntimeError('plugin exploded at import')\n")
    _write_plugin(
        module_dir, "commlib_unit_broken_dist", "[commlib.backends]\nunitbroken = commlib_unit_broken:make\n"
    )
    with pytest.raises(BackendUnavailableError) as info:
        commlib.create_process_group("unitbroken", make_env(), CONFIG)
    message = str(info.value)
    assert "backend 'unitbroken' from entry point 'commlib_unit_broken:make' failed to load" in message
    assert "plugin exploded at import" in message


def test_other_entry_point_groups_are_ignored(module_dir: Path) -> None:
    _write_plugin(
        module_dir, "commlib_unit_other_dist", "[console_scripts]\nunitother = commlib_unit_x:main\n"
    )
    assert not commlib.is_available("unitother")


# ------------------------------------------------- init_process_group / default
def test_init_process_group_makes_the_default_group() -> None:
    commlib.register_backend("unit-init", fake_factory)
    assert not commlib.is_initialized()
    group = commlib.init_process_group("unit-init", rank=1, world_size=3, master_port=1234, timeout=9)
    assert isinstance(group, FakeGroup)
    assert commlib.is_initialized() and commlib.get_default_group() is group
    assert (commlib.get_rank(), commlib.get_world_size()) == (1, 3)
    assert group.env.launcher == "explicit" and group.env.master_port == 1234
    assert group.timeout == 9


def test_module_functions_route_to_the_default_group() -> None:
    commlib.register_backend("unit-init", fake_factory)
    group = commlib.init_process_group("unit-init", world_size=1)
    assert isinstance(group, FakeGroup)
    t = torch.ones(3)
    assert commlib.all_reduce(t, commlib.ReduceOp.MAX) is None
    work = commlib.broadcast(t, 0, async_op=True)
    commlib.all_gather([torch.empty(3)], t)
    commlib.reduce_scatter(torch.empty(3), [torch.ones(3)])
    commlib.barrier()
    assert [c.method for c in group.calls] == [
        "all_reduce",
        "broadcast",
        "all_gather",
        "reduce_scatter",
        "barrier",
    ]
    assert group.calls[0].args["op"] is commlib.ReduceOp.MAX
    assert work is group.calls[1].work and work.waits == []  # type: ignore[union-attr]
    other = FakeGroup(make_env())
    commlib.all_reduce(t, group=other)
    assert len(other.calls) == 1 and len(group.calls) == 5


def test_second_init_is_refused_until_destroy() -> None:
    commlib.register_backend("unit-init", fake_factory)
    first = commlib.init_process_group("unit-init", world_size=1)
    with pytest.raises(
        CommError,
        match=r"a default process group exists already \(<FakeGroup backend=fake rank=0/1 open>\); "
        r"call commlib\.destroy_process_group\(\) first",
    ):
        commlib.init_process_group("unit-init", world_size=1)
    assert commlib.get_default_group() is first
    commlib.destroy_process_group()
    second = commlib.init_process_group("unit-init", world_size=1)
    assert second is not first


def test_destroy_closes_the_group_once_and_forgets_it() -> None:
    commlib.register_backend("unit-init", fake_factory)
    group = commlib.init_process_group("unit-init", world_size=1)
    assert isinstance(group, FakeGroup)
    commlib.destroy_process_group()
    assert group.close_calls == 1
    assert not commlib.is_initialized()
    commlib.destroy_process_group()  # nothing left: harmless
    assert group.close_calls == 1
    with pytest.raises(
        GroupClosedError, match=r"\[rank 0/1\] fake\.all_reduce: the process group was closed"
    ):
        group.all_reduce(torch.ones(1))


def test_destroy_of_another_group_keeps_the_default() -> None:
    commlib.register_backend("unit-init", fake_factory)
    default = commlib.init_process_group("unit-init", world_size=1)
    other = FakeGroup(make_env())
    commlib.destroy_process_group(other)
    assert other.close_calls == 1
    assert commlib.get_default_group() is default


@pytest.mark.parametrize(
    "call",
    [
        lambda: commlib.get_default_group(),
        lambda: commlib.get_rank(),
        lambda: commlib.get_world_size(),
        lambda: commlib.all_reduce(torch.ones(1)),
        lambda: commlib.broadcast(torch.ones(1)),
        lambda: commlib.barrier(),
    ],
)
def test_not_initialized_error_says_what_to_call(call) -> None:  # noqa: ANN001
    with pytest.raises(NotInitializedError) as info:
        call()
    assert str(info.value) == (
        "commlib: the default process group has not been initialized; call commlib.init_process_group() first"
    )
    assert isinstance(info.value, CommError)


def test_backend_comes_from_commlib_backend_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    commlib.register_backend("unit-env", fake_factory)
    monkeypatch.setenv("COMMLIB_BACKEND", " unit-env ")
    group = commlib.init_process_group(world_size=1)
    assert group is fake_factory.created[-1]  # type: ignore[attr-defined]


def test_argument_wins_over_commlib_backend_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    commlib.register_backend("unit-arg", factory_for())
    monkeypatch.setenv("COMMLIB_BACKEND", "definitely-not-registered")
    assert isinstance(commlib.init_process_group("unit-arg", world_size=1), FakeGroup)


def test_default_backend_is_ring() -> None:
    assert commlib.DEFAULT_BACKEND == world.DEFAULT_BACKEND == "ring"
    commlib.register_backend("ring", fake_factory, replace=True)
    assert commlib.init_process_group(world_size=1) is fake_factory.created[-1]  # type: ignore[attr-defined]


def test_unknown_backend_leaves_no_default_group() -> None:
    with pytest.raises(BackendUnavailableError, match="unknown backend 'nope'"):
        commlib.init_process_group("nope", world_size=1)
    assert not commlib.is_initialized()


def test_rank_and_size_come_from_the_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    commlib.register_backend("unit-env", fake_factory)
    monkeypatch.setenv("PMI_RANK", "1")
    monkeypatch.setenv("PMI_SIZE", "2")
    monkeypatch.setenv("MASTER_PORT", "31111")
    group = commlib.init_process_group("unit-env")
    assert (group.env.launcher, group.rank, group.world_size, group.env.master_port) == ("mpich", 1, 2, 31111)


def test_timeout_comes_from_argument_then_env(monkeypatch: pytest.MonkeyPatch) -> None:
    commlib.register_backend("unit-t", fake_factory)
    monkeypatch.setenv("COMMLIB_TIMEOUT", "17")
    assert commlib.init_process_group("unit-t", world_size=1).timeout == 17.0
    commlib.destroy_process_group()
    assert (
        commlib.init_process_group("unit-t", world_size=1, timeout=datetime.timedelta(seconds=3)).timeout
        == 3.0
    )
    commlib.destroy_process_group()
    config = CommConfig(timeout=11)
    assert commlib.init_process_group("unit-t", world_size=1, config=config).config is config
    commlib.destroy_process_group()
    assert commlib.init_process_group("unit-t", world_size=1, config=config, timeout=2).timeout == 2.0


def test_bad_environment_fails_before_the_backend_is_created(monkeypatch: pytest.MonkeyPatch) -> None:
    commlib.register_backend("unit-env", fake_factory)
    created = len(fake_factory.created)  # type: ignore[attr-defined]
    monkeypatch.setenv("RANK", "two")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="environment variable RANK: expected an integer, got 'two'"):
        commlib.init_process_group("unit-env")
    assert len(fake_factory.created) == created  # type: ignore[attr-defined]
    assert not commlib.is_initialized()
