"""The gloo / nccl backends (torch.distributed): collectives, adoption, fallbacks and faults.

Multi-rank tests spawn real ranks (``tests._launcher``); Gloo under ``torchrun`` and
``mpiexec`` runs the interface's bodies in ``test_launchers``. Bodies are module-level
functions, as spawned children import them.
"""

from __future__ import annotations

import datetime
import gc
import os
import time
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

import commlib
from commlib import CommConfig, CommTimeoutError, DistEnv, PeerFailureError, ReduceOp
from tests._launcher import RankPool, run_ranks, run_ranks_outcomes
from tests.distributed import mpi_bodies, p2p_bodies

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def gloo_pool() -> Iterator[RankPool]:
    pool = RankPool(2, "gloo", env={"COMMLIB_TIMEOUT": "30"})
    try:
        yield pool
    finally:
        pool.close()


# ------------------------------------------------------------- correctness
def test_collectives_matrix_two_ranks(gloo_pool: RankPool) -> None:
    for rank, matrix in enumerate(gloo_pool.run(mpi_bodies.collectives_matrix, timeout=120)):
        assert matrix["failures"] == [], f"rank {rank}:\n" + "\n".join(matrix["failures"][:20])
        assert matrix["checked"] == 270


def test_async_semantics(gloo_pool: RankPool) -> None:
    for rank, a in enumerate(gloo_pool.run(mpi_bodies.async_semantics, timeout=60)):
        assert a["avg"] == 1.5 and a["broadcast"] == [1.0, 1.0, 1.0]
        assert a["gathered"] == [0, 0, 0, 0, 1, 1, 1, 1]
        assert a["reduce_scatter"] == ([0.0, 2.0] if rank == 0 else [4.0, 6.0])
        assert a["completed"] == [True] * 5 and a["exceptions"] == [None] * 5
        assert a["late_sum"] == 2.0
        if rank == 0:
            assert "[rank 0/2] gloo.all_reduce #" in a["expired_message"]
            assert "Work.wait(timeout=0.05) expired" in a["expired_message"]
        assert a["errors"][0].startswith(f"TypeError: [rank {rank}/2] gloo.all_reduce:")
        assert "AVG on int32" in a["errors"][1]


def test_collectives_matrix_three_ranks() -> None:
    values = run_ranks(
        mpi_bodies.collectives_matrix,
        3,
        backend="gloo",
        args=((0, 7, 1000),),
        timeout=120,
        env={"COMMLIB_TIMEOUT": "30"},
    )
    for rank, matrix in enumerate(values):
        assert matrix["failures"] == [], f"rank {rank}:\n" + "\n".join(matrix["failures"][:20])


def test_upcast_fallback_for_low_precision(tmp_path: Any) -> None:
    """Where Gloo cannot reduce fp16/bf16 they go through float32 (forced here) and stay correct."""
    values = run_ranks(
        _upcast_body,
        2,
        backend="gloo",
        timeout=90,
        env={"COMMLIB_TIMEOUT": "30", "COMMLIB_GLOO_UPCAST": "bfloat16,float16"},
    )
    for matrix, upcast in values:
        assert matrix["failures"] == [], "\n".join(matrix["failures"][:20])
        assert upcast == ["torch.bfloat16", "torch.float16"]


def _upcast_body(group: Any) -> tuple[dict[str, Any], list[str]]:
    matrix = mpi_bodies.collectives_matrix(group, (0, 7, 1000), ("float16", "bfloat16"))
    from commlib.capabilities import Route

    wide = [
        d
        for d in (torch.float16, torch.bfloat16)
        if group.reduction_plan(ReduceOp.SUM, d).route is Route.UPCAST
    ]
    return matrix, sorted(str(d) for d in wide)


# ---------------------------------------------------------- nccl flavour
def _nccl_on_cpu_body() -> dict[str, Any]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        group = commlib.init_process_group("nccl", timeout=30)
        t = torch.full((4,), float(group.rank + 1))
        group.all_reduce(t, ReduceOp.AVG)
        first = dict(
            backend=group.backend,
            devices=sorted(group.supported_devices),
            cuda_ok=group.supports(ReduceOp.SUM, torch.float32, "cuda"),
            torch_backend=group.torch_backend_for("cpu"),
            value=t.tolist(),
        )
        commlib.destroy_process_group()
        group = commlib.init_process_group("nccl", timeout=30)  # warns only once per process
        group.barrier()
        commlib.destroy_process_group()
    first["warnings"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    return first


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour of the nccl backend")
def test_nccl_without_cuda_is_gloo_and_says_so_once() -> None:
    for rank, value in enumerate(run_ranks(_nccl_on_cpu_body, 2, backend=None, init=False, timeout=90)):
        assert value["backend"] == "nccl" and value["devices"] == ["cpu"] and not value["cuda_ok"]
        assert value["torch_backend"] == "gloo" and value["value"] == [1.5] * 4
        assert len(value["warnings"]) == 1, value["warnings"]
        assert value["warnings"][0].startswith(
            f"[rank {rank}/2] nccl.init: no CUDA device: CPU tensors use Gloo"
        )


# ------------------------------------------------------ adoption and wrapping
def _init_torch_gloo(rank: int, world: int) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=30),
    )


def _adopt_body() -> dict[str, Any]:
    """Code that set up torch.distributed itself hands the default group to commlib."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out: dict[str, Any] = {}
    _init_torch_gloo(rank, world)
    try:
        commlib.init_process_group("gloo", rank=(rank + 1) % world, world_size=world)
    except commlib.RendezvousError as e:
        out["mismatch"] = str(e)
    group = commlib.init_process_group("gloo", timeout=30)
    t = torch.full((3,), float(rank))
    group.all_reduce(t)
    out["adopted_sum"] = t.tolist()
    commlib.destroy_process_group()
    out["torch_alive_after_close"] = dist.is_initialized()
    dist.destroy_process_group()
    return out


def test_adopts_torch_default_group() -> None:
    values = run_ranks(_adopt_body, 3, backend=None, init=False, timeout=90)
    for rank, out in enumerate(values):
        assert out["mismatch"].startswith(
            f"[rank {(rank + 1) % 3}/3] gloo.init: torch.distributed is already initialised "
            f"as rank {rank} of 3"
        )
        assert "from_torch_group" in out["mismatch"]
        assert out["adopted_sum"] == [3.0] * 3
        assert out["torch_alive_after_close"] is True


def _subgroup_body() -> dict[str, Any] | None:
    """A torch sub-group wrapped by commlib: group ranks differ from global ranks (src is a group rank)."""
    from backends.torch import from_torch_group

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    _init_torch_gloo(rank, world)
    sub = dist.new_group([0, 2])
    out = None
    if rank in (0, 2):
        wrapped = from_torch_group(sub, config=CommConfig(timeout=30))
        b = torch.full((2,), float(rank))
        wrapped.broadcast(b, src=1)
        s = torch.ones(2)
        wrapped.all_reduce(s)
        out = dict(rank=wrapped.rank, size=wrapped.world_size, broadcast=b.tolist(), sum=s.tolist())
        # A commlib subgroup of the wrapped one, in reverse order: built over torch's default store.
        child = wrapped.split(0, key=-wrapped.rank)
        assert child is not None and child.rank == 1 - wrapped.rank
        c = torch.full((1,), float(rank))
        child.broadcast(c, src=0)  # the wrapped group's rank 1: global rank 2
        got = torch.empty(1)
        child.send(c, 1 - child.rank) if child.rank == 0 else child.recv(got, 0)
        out["child"] = c.tolist()
        child.close()
        wrapped.close()
    dist.barrier()
    dist.destroy_process_group()
    return out


def test_wraps_a_torch_subgroup() -> None:
    values = run_ranks(_subgroup_body, 3, backend=None, init=False, timeout=90)
    assert values[1] is None
    for rank in (0, 2):
        assert values[rank] == dict(rank=rank // 2, size=2, broadcast=[2.0, 2.0], sum=[2.0, 2.0], child=[2.0])


def _shared_default_group_body() -> dict[str, Any]:
    """commlib created torch's default group; a second commlib group shares it; the last close destroys it."""
    first = commlib.init_process_group("gloo", timeout=30)
    second = commlib.create_process_group("gloo", first.env, CommConfig(timeout=30))
    commlib.destroy_process_group()
    u = torch.ones(2)
    second.all_reduce(u)
    out: dict[str, Any] = {"shared_after_first_close": (dist.is_initialized(), u.tolist())}
    second.close()
    out["destroyed_after_last_close"] = not dist.is_initialized()
    return out


def test_groups_sharing_torchs_default_group_destroy_it_on_the_last_close() -> None:
    for out in run_ranks(_shared_default_group_body, 3, backend=None, init=False, timeout=90):
        assert out["shared_after_first_close"] == (True, [3.0, 3.0])
        assert out["destroyed_after_last_close"] is True


# ------------------------------------------------------------------- faults
@pytest.mark.parametrize("debug", ["off", "default"])
def test_dead_peer_raises_peer_failure_fast(debug: str) -> None:
    """Gloo's connection tells with the check off; on the defaults the check's board sees the process gone."""
    env = {"COMMLIB_TIMEOUT": "30"} | ({"COMMLIB_DEBUG": "OFF"} if debug == "off" else {})
    outcomes = run_ranks_outcomes(mpi_bodies.die_after_first, 2, backend="gloo", timeout=60, env=env)
    survivor = outcomes[0]
    assert survivor.ok, survivor
    value = survivor.value
    assert value["error_type"] == "PeerFailureError", value
    prefix = "[rank 0/2] gloo.all_reduce #2 (float32, 100 elements): "
    if debug == "off":
        assert value["error"].startswith(f"{prefix}a peer process closed"), value
        assert "(peer [127.0.0.1]:" in value["error"]
    else:
        assert value["error"].startswith(f"{prefix}rank 1 (pid "), value
        assert "exited while this rank waited" in value["error"], value
    assert value["after_s"] < 5, value  # measured: ~0.02 s
    assert value["next"].startswith(
        "GroupClosedError: [rank 0/2] gloo.all_reduce: the process group is unusable"
    )
    assert outcomes[1].exitcode == 3


@pytest.mark.waits
@pytest.mark.parametrize("debug", ["off", "default"])
def test_missing_rank_times_out(debug: str) -> None:
    """Gloo's timeout with the check off; on the defaults the check names the rank that did not come."""
    env = {"COMMLIB_TIMEOUT": "2"} | ({"COMMLIB_DEBUG": "OFF"} if debug == "off" else {})
    outcomes = run_ranks_outcomes(
        mpi_bodies.skip_collective, 2, backend="gloo", args=(3.5, True), timeout=60, env=env
    )
    value = outcomes[0].value
    assert outcomes[0].ok and value["error_type"] == "CommTimeoutError", outcomes[0]
    prefix = "[rank 0/2] gloo.all_reduce #2 (float32, 100 elements): "
    check = "timed out after 2 s in the fingerprint check"
    expected = "did not finish within 2 s" if debug == "off" else check
    assert value["error"].startswith(prefix + expected), value
    if debug == "default":
        assert "waiting for rank 1 to reach this collective" in value["error"], value
    assert 1.5 < value["after_s"] < 6, value
    assert value["next"].startswith("GroupClosedError")


def _rendezvous_alone(timeout: float) -> dict[str, Any]:
    if int(os.environ["RANK"]) != 0:
        time.sleep(timeout + 1.5)
        return {}
    start = time.perf_counter()
    try:
        commlib.init_process_group("gloo", timeout=timeout)
    except commlib.RendezvousError as e:
        return {"type": type(e).__name__, "error": str(e), "after_s": time.perf_counter() - start}
    return {"type": None}


@pytest.mark.waits
def test_rank_missing_at_rendezvous_times_out() -> None:
    outcomes = run_ranks_outcomes(_rendezvous_alone, 2, backend=None, init=False, args=(2.0,), timeout=60)
    value = outcomes[0].value
    assert value["type"] == "RendezvousTimeoutError", outcomes[0]
    assert value["error"].startswith("[rank 0/2] gloo.rendezvous: timed out after 2.0 s at 127.0.0.1:")
    assert "1/2 ranks arrived; ranks [1] never did" in value["error"]
    assert value["after_s"] < 10, value


def test_torch_distributed_unavailable_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from backends.torch import factories

    monkeypatch.setattr(factories.dist, "is_available", lambda: False)
    with pytest.raises(
        commlib.BackendUnavailableError, match=r"\[rank 0/1\] gloo.init: this torch build has no"
    ):
        factories.create_gloo_group(DistEnv(rank=0, world_size=1), CommConfig())


# --------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason="no CUDA device (torch.cuda.is_available() is False)"
    if not torch.cuda.is_available()
    else "NCCL needs one GPU per rank: fewer than 2 CUDA devices",
)
def test_nccl_on_cuda_tensors() -> None:
    values = run_ranks(mpi_bodies.cuda_collectives, 2, backend="nccl", timeout=120)
    for value in values:
        assert value["failures"] == []


# ------------------------------------------------- in-process unit tests
def test_error_translation_and_parsing() -> None:
    from backends.torch.devices import parse_backend_spec
    from backends.torch.dtypes import parse_upcast
    from backends.torch.errors import translate

    closed = RuntimeError(
        "[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:18838. "
        "This is typically caused"
    )
    error = translate("[rank 0/2] gloo.all_reduce #3", closed, 30)
    assert isinstance(error, PeerFailureError) and "(peer [127.0.0.1]:18838)" in str(error)
    timeout = RuntimeError(
        "[../unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation to complete"
    )
    error = translate("[rank 1/2] gloo.broadcast #1", timeout, 3)
    assert isinstance(error, CommTimeoutError) and "did not finish within 3 s" in str(error)
    assert type(translate("x", RuntimeError("boom"), 1)) is commlib.CommError
    # NCCL 2.28.9's words for two ranks on one GPU (seen with torch 2.11 on an H200).
    shared = RuntimeError(
        "NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.cpp:93, invalid usage (run with "
        "NCCL_DEBUG=WARN for details), NCCL version 2.28.9\nncclInvalidUsage: This usually reflects "
        "invalid usage of NCCL library.\nLast error:\n"
        "Duplicate GPU detected : rank 0 and rank 1 both on CUDA device 60"
    )
    message = str(translate("[rank 0/2] nccl.broadcast #0", shared, 30))
    assert message.startswith(
        "[rank 0/2] nccl.broadcast #0: NCCL refuses two ranks on one GPU (Duplicate GPU detected : rank 0 "
        "and rank 1 both on CUDA device 60). Give each rank a GPU of its own"
    ), message
    assert "ring, gloo or mpi backend" in message and "NCCL error in:" in message
    assert parse_backend_spec("cpu:gloo,cuda:nccl") == {"cpu": "gloo", "cuda": "nccl"}
    assert parse_backend_spec("gloo") == {"cpu": "gloo"}
    assert parse_backend_spec("NCCL") == {"cuda": "nccl"}
    assert parse_upcast("bf16, float16") == {torch.bfloat16, torch.float16}
    with pytest.raises(ValueError, match="'int8' is not float16 or bfloat16"):
        parse_upcast("int8")


def test_reference_checker_catches_wrong_answers() -> None:
    """The tolerance of the matrix is tight enough to see a wrong reduction."""
    from tests.distributed.mpi_bodies import check_close, reference, seeded_input

    inputs = [seeded_input(1, r, 1000, torch.bfloat16, ReduceOp.SUM, False) for r in range(3)]
    ref = reference(ReduceOp.SUM, inputs)
    right = (inputs[0].float() + inputs[1].float() + inputs[2].float()).bfloat16()
    assert check_close("ok", right, ref, inputs, ReduceOp.SUM, exact=False) is None
    wrong = right.clone()
    wrong[5] += 0.25
    assert "1/1000 elements off" in check_close("bad", wrong, ref, inputs, ReduceOp.SUM, exact=False)
    two_of_three = (inputs[0].float() + inputs[1].float()).bfloat16()
    assert check_close("bad", two_of_three, ref, inputs, ReduceOp.SUM, exact=False) is not None
    ints = [seeded_input(1, r, 10, torch.float16, ReduceOp.SUM, True) for r in range(2)]
    off_by_one = ints[0] + ints[1] + 1
    assert check_close("bad", off_by_one, reference(ReduceOp.SUM, ints), ints, ReduceOp.SUM, exact=True)


def _gloo_threads() -> int:
    """This process's native threads that belong to a Gloo process group (its workers and TCP loop)."""
    count = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                count += f.read().strip() in ("pt_gloo_runloop", "gloo_tcp_loop")
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    return count


def _threads_after_close_body(group: commlib.IProcessGroup) -> dict[str, int]:
    """A gloo group with its fingerprint check (its own Gloo group) and a subgroup, used, then closed.

    The collector is off, as it may happen to be at the last close before exit: what close leaves
    to it would be destroyed by the collection at interpreter exit.
    """
    gc.disable()
    pair = group.new_group([0, 1])
    assert pair is not None
    for g in (group, pair):
        g.all_reduce(torch.ones(4))
        g.all_gather(torch.empty(2 * g.world_size), torch.ones(2))
        peer = 1 - g.rank
        works = [g.isend(torch.full((3,), float(g.rank)), peer), g.irecv(torch.empty(3), peer)]
        for work in works:
            work.wait()
    p2p_bodies.body_size_mismatch(group)  # errors raised and caught, as a training script might
    while_open = _gloo_threads()
    pair.close()
    commlib.destroy_process_group()
    closed = _gloo_threads()
    gc.enable()
    return {"open": while_open, "closed": closed}


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs /proc/self/task to count threads")
def test_close_ends_every_gloo_thread_the_group_started() -> None:
    # A Gloo group still alive at interpreter exit can abort the process after a clean run: a worker
    # finishing its last work drops tensors when Python can no longer take them back.
    for value in run_ranks(_threads_after_close_body, 2, backend="gloo", timeout=90):
        assert value["open"] >= 6, value  # the group, its fingerprint group and the subgroup's: 2+1 each
        assert value["closed"] == 0, value


def _undefined_backend_body() -> dict[str, Any]:
    """torch's init_process_group() without a backend names its group "undefined"; we read what it runs."""
    from backends.torch import from_torch_group

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}", rank=rank, world_size=world
    )
    try:
        wrapped = from_torch_group(config=CommConfig(timeout=30))
        t = torch.ones(3)
        wrapped.all_reduce(t, ReduceOp.AVG)
        return dict(
            torch_name=str(dist.get_backend()),
            name=wrapped.backend,
            devices=sorted(wrapped.devices),
            preferred=str(wrapped.preferred_device()),
            mean=t.tolist(),
        )
    finally:
        dist.destroy_process_group()


def test_wraps_a_group_created_without_a_backend() -> None:
    # torch's default without a backend is "cpu:gloo,cuda:nccl" where a GPU is visible: hide it.
    hidden = {"CUDA_VISIBLE_DEVICES": ""}
    for value in run_ranks(_undefined_backend_body, 2, backend=None, init=False, timeout=90, env=hidden):
        assert value == dict(
            torch_name="undefined", name="gloo", devices=["cpu"], preferred="cpu", mean=[1.0, 1.0, 1.0]
        )


def _stale_master_port_body() -> dict[str, Any]:
    """torch set up over tcp:// (its store's port), with a stale MASTER_PORT in the environment."""
    from backends.torch import from_torch_group

    rank, world, port = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["MASTER_PORT"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    os.environ["MASTER_PORT"] = "abc"  # left over; the torch group never reads it
    try:
        wrapped = from_torch_group(config=CommConfig(timeout=30))
        t = torch.full((2,), float(rank + 1))
        wrapped.all_reduce(t)
        return {"sum": t.tolist(), "port_is_the_stores": wrapped.env.master_port == port}
    finally:
        dist.destroy_process_group()


def _ring_after_torch_body() -> str:
    """torch.distributed set up from the environment, then a commlib ring group on the same MASTER_PORT."""
    import commlib
    from commlib.errors import CommError

    dist.init_process_group("gloo")
    try:
        commlib.init_process_group("ring", timeout=10)
    except CommError as e:
        return str(e)
    finally:
        dist.destroy_process_group()
    commlib.destroy_process_group()
    return "formed"


def test_a_ring_group_on_the_port_of_torchs_own_store_says_so() -> None:
    """Rank 0 used to blame "another job"; the holder is torch's store in its own process."""
    rank0, _rank1 = run_ranks(_ring_after_torch_body, 2, backend=None, init=False, timeout=90)
    assert "torch.distributed, set up in this process, serves its store on this port" in rank0, rank0
    assert "backends.torch.from_torch_group()" in rank0


def test_wrapping_a_torch_group_takes_its_stores_address_not_a_stale_master_port() -> None:
    for value in run_ranks(_stale_master_port_body, 2, backend=None, init=False, timeout=90):
        assert value == {"sum": [3.0, 3.0], "port_is_the_stores": True}


@pytest.mark.parametrize(
    ("config", "name", "expected"),
    [
        ("cuda:nccl", "nccl", {}),
        ("cpu:gloo", "gloo", {"cpu": "gloo"}),
        ("cpu:gloo,cuda:nccl", "undefined", {"cpu": "gloo"}),  # no CUDA device here: CUDA is dropped
        (None, "nccl", {}),
        (None, "undefined", {"cpu": "gloo"}),  # torch's default without CUDA (this machine's case)
    ],
)
def test_device_map_of_every_kind_of_torch_group(monkeypatch, config, name, expected) -> None:
    """What each kind of torch group serves, on a machine without CUDA (this one)."""
    import backends.torch.devices as devices

    if config is None:
        monkeypatch.delattr(devices.dist, "get_backend_config", raising=False)
    else:
        monkeypatch.setattr(devices.dist, "get_backend_config", lambda pg: config)
    monkeypatch.setattr(devices.dist, "get_backend", lambda pg: name)
    monkeypatch.setattr(devices.torch.cuda, "is_available", lambda: False)
    assert devices.device_map(object()) == expected


@pytest.mark.parametrize(
    ("config", "name", "expected"),
    [
        ("cuda:nccl", "nccl", {"cuda": "nccl"}),
        ("cpu:gloo,cuda:gloo", "gloo", {"cpu": "gloo", "cuda": "gloo"}),
        ("cpu:gloo,cuda:nccl", "undefined", {"cpu": "gloo", "cuda": "nccl"}),
        (None, "undefined", {"cpu": "gloo", "cuda": "nccl"}),
        (None, "nccl", {"cuda": "nccl"}),
    ],
)
def test_device_map_with_cuda(monkeypatch, config, name, expected) -> None:
    """The same groups where CUDA is available (faked): an NCCL-only group takes CUDA tensors only."""
    import backends.torch.devices as devices

    if config is None:
        monkeypatch.delattr(devices.dist, "get_backend_config", raising=False)
    else:
        monkeypatch.setattr(devices.dist, "get_backend_config", lambda pg: config)
    monkeypatch.setattr(devices.dist, "get_backend", lambda pg: name)
    monkeypatch.setattr(devices.torch.cuda, "is_available", lambda: True)
    assert devices.device_map(object()) == expected
