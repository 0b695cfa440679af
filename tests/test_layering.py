"""The architecture, enforced: which package may import which, and no import cycles."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

PACKAGES = ("commlib", "backends", "ddp")
BACKEND_SUBPACKAGES = ("ring", "torch", "mpi")


def _imports(path: Path) -> set[str]:
    """Every first-party module ``path`` imports, at any depth (``TYPE_CHECKING`` blocks included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name.split(".")[0] in PACKAGES}


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict[str, set[str]]:
    modules = {
        _module_name(path): path for package in PACKAGES for path in (REPO_ROOT / package).rglob("*.py")
    }
    graph = {}
    for name, path in modules.items():
        # "from package import module" names a module; "from module import name" names the module.
        graph[name] = {imp if imp in modules else imp.rsplit(".", 1)[0] for imp in _imports(path)}
        graph[name] = {imp for imp in graph[name] if imp in modules and imp != name}
    return graph


def test_commlib_imports_neither_backends_nor_ddp() -> None:
    bad = sorted(
        f"{m} imports {i}"
        for m, deps in _graph().items()
        if m.startswith("commlib")
        for i in deps
        if not i.startswith("commlib")
    )
    assert not bad, bad


def test_backends_and_ddp_never_import_each_other() -> None:
    graph = _graph()
    bad = sorted(
        f"{m} imports {i}"
        for m, deps in graph.items()
        for i in deps
        if {m.split(".")[0], i.split(".")[0]} == {"backends", "ddp"}
    )
    assert not bad, bad


def test_no_backend_imports_another() -> None:
    """Each backend subpackage imports commlib, backends.common and itself only."""
    bad = []
    for m, deps in _graph().items():
        parts = m.split(".")
        if parts[0] != "backends" or len(parts) < 2 or parts[1] not in BACKEND_SUBPACKAGES:
            continue
        for i in deps:
            other = i.split(".")
            if other[0] == "backends" and len(other) > 1 and other[1] != "common" and other[1] != parts[1]:
                bad.append(f"{m} imports {i}")
            if other[0] == "backends" and len(other) == 1:
                bad.append(f"{m} imports the backends package itself")
    assert not bad, sorted(bad)


DDP_LAYERS_ABOVE_THE_CORE = ("ddp.zero", "ddp.hooks", "ddp.observe")
"""Subpackages of ``ddp`` built on its core; the core (every other ``ddp`` module) imports none of ZeRO."""


def test_the_ddp_core_does_not_import_zero() -> None:
    """ZeRO builds on the bucket layer (``ddp.bucket_shards``, ``ddp.param_gathers``), never the reverse.

    ``ddp/__init__.py`` (the package's public names) re-exports ZeRO's and is not part of the core.
    """
    graph = _graph()
    core = [m for m in graph if m.startswith("ddp.") and not m.startswith(DDP_LAYERS_ABOVE_THE_CORE)]
    assert "ddp.bucket_manager" in core and "ddp.bucket_shards" in core and "ddp.distributed" in core
    bad = sorted(f"{m} imports {i}" for m in core for i in graph[m] if i.split(".")[:2] == ["ddp", "zero"])
    assert not bad, bad


def test_the_bucket_manager_writes_no_field_of_bucket_sync() -> None:
    """``BucketSync``'s state has one writer, itself: the manager calls its verbs (``begin``, ...)."""
    path = REPO_ROOT / "ddp" / "bucket_manager.py"
    tree = ast.parse(path.read_text(), str(path))
    aliases = {  # locals bound to self._sync (sync = self._sync)
        t.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and getattr(node.value, "attr", None) == "_sync"
        for t in node.targets
        if isinstance(t, ast.Name)
    }

    def inside_sync(node: ast.expr) -> bool:
        while isinstance(node, (ast.Attribute, ast.Subscript)):
            if isinstance(node, ast.Attribute) and node.attr == "_sync":
                return True
            node = node.value
        return isinstance(node, ast.Name) and node.id in aliases

    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets = [e for t in node.targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        else:
            continue
        bad += [
            f"{path.name}:{node.lineno}: {ast.unparse(t)}"
            for t in targets
            if isinstance(t, (ast.Attribute, ast.Subscript)) and inside_sync(t.value)
        ]
    assert not bad, bad


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycles(package: str) -> None:
    graph = _graph()
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append(path[path.index(dep) :] + [dep] if dep in path else [node, dep])
            elif dep not in state:
                visit(dep, [*path, dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    # A package's __init__ re-exporting its modules, which import siblings through the package,
    # is not a cycle in code that runs; count only cycles between modules.
    real = [c for c in cycles if not any(_is_package_init(m) for m in c) and c[0].split(".")[0] == package]
    assert not real, "import cycles:\n" + "\n".join(" -> ".join(c) for c in real)


def test_ddp_uses_only_the_public_process_group_api() -> None:
    """``ddp`` reads and advances nothing private of a group (sequence numbers, labels, diagnosis)."""
    from commlib.process_group import IProcessGroup

    members = {name for cls in IProcessGroup.__mro__ for name in vars(cls)}
    private = {name for name in members if name.startswith("_") and "__" not in name}
    # Instance attributes (_seq, _diagnostics, _p2p_counts...), of the interface and of its bases
    # (the mixins that hold its checks, point-to-point front end, subgroups...).
    for cls in IProcessGroup.__mro__:
        if not cls.__module__.startswith("commlib."):
            continue
        for node in ast.walk(ast.parse(inspect.getsource(cls))):
            if not isinstance(node, ast.Attribute) or not isinstance(node.value, ast.Name):
                continue
            if node.value.id == "self" and node.attr.startswith("_") and "__" not in node.attr:
                private.add(node.attr)
        for name in getattr(cls, "__annotations__", {}):
            if name.startswith("_") and "__" not in name:
                private.add(name)  # declared by a base for the attribute it reads (_closed, ...)
    assert {"_seq", "_diagnostics", "_p2p_counts", "_global_ranks", "_closing_with"} <= private
    bad = []
    for path in (REPO_ROOT / "ddp").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Attribute) or node.attr not in private:
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue  # ddp's own objects' members of the same name
            bad.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, bad


def _is_package_init(name: str) -> bool:
    return (REPO_ROOT / Path(*name.split(".")) / "__init__.py").exists()


@pytest.mark.parametrize(
    ("old", "new", "names"),
    [
        ("backends.ring", "backends.ring.group", ["RingProcessGroup", "RingConfig", "BACKENDS"]),
        ("backends.mpi", "backends.mpi.group", ["MPIProcessGroup"]),
        ("backends.mpi", "backends.mpi.config", ["MPIConfig"]),
        ("backends.mpi", "backends.mpi.factories", ["BACKENDS", "create_mpi_group", "from_mpi_comm"]),
        ("backends.torch", "backends.torch.group", ["TorchDistProcessGroup"]),
        (
            "backends.torch",
            "backends.torch.factories",
            ["BACKENDS", "create_gloo_group", "create_nccl_group", "from_torch_group"],
        ),
        ("commlib.torch_backend", "commlib.torch_adapter", ["CommlibProcessGroup", "BACKENDS", "register"]),
    ],
)
def test_public_names_stay_importable_where_users_import_them(old: str, new: str, names: list[str]) -> None:
    pytest.importorskip("torch.distributed")
    if old == "backends.mpi":
        pytest.importorskip("mpi4py")
    old_module, new_module = importlib.import_module(old), importlib.import_module(new)
    for name in names:
        assert getattr(old_module, name) is getattr(new_module, name), name
