"""``commlib.detect()``: explicit arguments, each launcher's variables, precedence and error wording."""

from __future__ import annotations

import logging
import os
import sys
import warnings

import pytest

from commlib.env import (
    DEFAULT_MASTER_ADDR,
    DEFAULT_MASTER_PORT,
    DistEnv,
    detect,
    get_env_or_raise,
    launch_key,
    launcher_pid,
    read_env_var,
)
from commlib.ports import ephemeral_port_range, port_from_key
from commlib.procfs import read_process
from tests.conftest import REPO_ROOT, mpiexec_command, requires_mpi, run_job, scrubbed_env

TORCHRUN = {
    "RANK": "3",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "10.1.2.3",
    "MASTER_PORT": "23456",
}
OPENMPI = {
    "OMPI_COMM_WORLD_RANK": "5",
    "OMPI_COMM_WORLD_SIZE": "8",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
}
PMIX = {"PMIX_RANK": "2", "PMIX_SIZE": "6", "PMIX_LOCAL_RANK": "0", "PMIX_LOCAL_SIZE": "3"}
MPICH = {"PMI_RANK": "1", "PMI_SIZE": "3", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "3"}
SLURM = {
    "SLURM_PROCID": "6",
    "SLURM_NTASKS": "8",
    "SLURM_LOCALID": "2",
    "SLURM_NTASKS_PER_NODE": "4",
    "SLURM_STEP_ID": "0",
}
SLURM_BATCH = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0"}
"""What a batch script's own process sees (``sbatch --ntasks 4``): no step of ``srun``."""


def fields(env: DistEnv) -> tuple[object, ...]:
    return (env.launcher, env.rank, env.world_size, env.local_rank, env.local_world_size)


# ------------------------------------------------------------ explicit / single
def test_single_process_without_any_variable() -> None:
    env = detect(environ={})
    assert fields(env) == ("single", 0, 1, 0, 1)
    assert (
        (env.master_addr, env.master_port)
        == (DEFAULT_MASTER_ADDR, DEFAULT_MASTER_PORT)
        == ("127.0.0.1", 29500)
    )


def test_explicit_arguments() -> None:
    env = detect(rank=1, world_size=4, master_addr="10.0.0.7", master_port=1234, environ={})
    assert fields(env) == ("explicit", 1, 4, 1, 4)
    assert (env.master_addr, env.master_port) == ("10.0.0.7", 1234)


def test_explicit_arguments_win_over_launcher_variables() -> None:
    env = detect(rank=0, world_size=2, environ={**TORCHRUN, **OPENMPI})
    assert fields(env) == ("explicit", 0, 2, 0, 2)
    # The rendezvous address still comes from the environment when not passed.
    assert (env.master_addr, env.master_port) == ("10.1.2.3", 23456)


def test_explicit_arguments_that_differ_from_the_launchers_are_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="commlib")
    detect(rank=3, world_size=4, environ=TORCHRUN)  # the same as torchrun's: nothing to say
    assert not caplog.records
    env = detect(rank=1, world_size=2, environ=TORCHRUN)
    assert fields(env)[:3] == ("explicit", 1, 2)
    (record,) = caplog.records
    assert record.getMessage().startswith(
        "init_process_group: rank=1, world_size=2 were passed, but torchrun started this process as "
        "rank 3 of 4. The arguments win"
    )


def test_explicit_arguments_equal_to_the_launchers_keep_its_local_rank_and_size() -> None:
    """A script passing ``rank=int(os.environ["RANK"])`` on a two-node torchrun keeps its host's share."""
    env = detect(rank=3, world_size=4, environ=TORCHRUN)
    assert fields(env) == ("explicit", 3, 4, 1, 2)
    assert fields(detect(rank=1, world_size=4, environ=TORCHRUN)) == ("explicit", 1, 4, 1, 4)  # differs


@pytest.mark.parametrize(
    "kwargs",
    [{"world_size": 4}, {"rank": 3}, {"rank": -1, "world_size": -1}, {"rank": -1, "world_size": 4}],
    ids=["world_size-only", "rank-only", "torch-defaults", "rank-from-env"],
)
def test_a_rank_or_world_size_left_out_comes_from_the_launcher_as_in_torch(
    kwargs: dict[str, int], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="commlib")
    env = detect(environ=TORCHRUN, **kwargs)
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (3, 4, 1, 2)
    assert not caplog.records


def test_a_world_size_alone_that_differs_from_the_launchers_is_warned_about_and_wins(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="commlib")
    env = detect(world_size=8, environ=TORCHRUN)
    assert fields(env) == ("explicit", 3, 8, 3, 8)
    (record,) = caplog.records
    assert (
        "rank=3, world_size=8 were passed, but torchrun started this process as rank 3 of 4"
        in record.getMessage()
    )


@pytest.mark.parametrize(
    "environ",
    [
        {"RANK": "", "WORLD_SIZE": ""},
        {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "x"},
        {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2(x1)"},
    ],
    ids=["empty-torchrun", "bad-local-size", "slurm-repeat-count"],
)
def test_explicit_arguments_work_whatever_the_launchers_variables_hold(environ: dict[str, str]) -> None:
    env = detect(rank=0, world_size=2, environ=environ)
    assert (env.rank, env.world_size, env.master_port) == (0, 2, DEFAULT_MASTER_PORT)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"rank": 0.0, "world_size": 1}, r"rank must be an int, got float 0\.0"),
        ({"rank": False, "world_size": True}, r"rank must be an int, got bool False"),
        ({"rank": "0", "world_size": "1"}, r"rank must be an int, got str '0'; pass rank=int\(\.\.\.\)"),
        ({"rank": 0, "world_size": 1.5}, r"world_size must be an int, got float 1\.5"),
        ({"master_port": "abc"}, r"master_port must be an int, got str 'abc'"),
        ({"master_port": 29500.7}, r"master_port must be an int, got float 29500\.7"),
    ],
)
def test_arguments_that_are_not_ints_are_refused_naming_them(kwargs: dict[str, object], pattern: str) -> None:
    with pytest.raises(TypeError, match=f"^init_process_group: {pattern}"):
        detect(environ={}, **kwargs)  # type: ignore[arg-type]


def test_dist_env_refuses_fields_that_are_not_ints() -> None:
    with pytest.raises(TypeError, match=r"DistEnv: rank must be an int, got float 0\.0"):
        DistEnv(rank=0.0, world_size=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"DistEnv: master_port must be an int, got bool True"):
        DistEnv(rank=0, world_size=1, master_port=True)


@pytest.mark.parametrize(
    "step", [None, "4294967294", "4294967295", "batch"], ids=["no-step", "batch-step", "extern-step", "word"]
)
def test_a_slurm_batch_scripts_own_process_is_a_single_process(step: str | None) -> None:
    """``python train.py`` in an sbatch script: rank 0 of 1 (torch reads no Slurm variable), not of 4."""
    environ = SLURM_BATCH if step is None else {**SLURM_BATCH, "SLURM_STEP_ID": step}
    assert fields(detect(environ=environ)) == ("single", 0, 1, 0, 1)
    assert fields(detect(environ={"SLURM_PROCID": "0", "SLURM_JOB_ID": "7"})) == ("single", 0, 1, 0, 1)


def test_explicit_master_address_wins_over_environment() -> None:
    env = detect(master_addr="host-a", master_port=4321, environ=TORCHRUN)
    assert (env.launcher, env.master_addr, env.master_port) == ("torchrun", "host-a", 4321)


def test_world_size_one_alone_means_rank_zero() -> None:
    assert fields(detect(world_size=1, environ={})) == ("explicit", 0, 1, 0, 1)


@pytest.mark.parametrize("kwargs", [{"rank": 0}, {"world_size": 2}, {"rank": 1, "world_size": None}])
def test_rank_without_world_size_is_refused(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError, match=r"pass both rank and world_size") as info:
        detect(environ={}, **kwargs)
    assert f"rank={kwargs.get('rank')}" in str(info.value)
    assert f"world_size={kwargs.get('world_size')}" in str(info.value)


# ------------------------------------------------------------------ launchers
@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        pytest.param(TORCHRUN, ("torchrun", 3, 4, 1, 2), id="torchrun"),
        pytest.param(OPENMPI, ("openmpi", 5, 8, 1, 4), id="openmpi"),
        pytest.param(PMIX, ("pmix", 2, 6, 0, 3), id="pmix"),
        pytest.param(MPICH, ("mpich", 1, 3, 1, 3), id="mpich-hydra"),
        pytest.param(
            {"PMI_RANK": "2", "PMI_SIZE": "4", "PMI_LOCAL_RANK": "0", "PMI_LOCAL_SIZE": "2"},
            ("mpich", 2, 4, 0, 2),
            id="pmi-local-vars",
        ),
        pytest.param(SLURM, ("slurm", 6, 8, 2, 4), id="slurm"),
    ],
)
def test_launcher_variables(environ: dict[str, str], expected: tuple[object, ...]) -> None:
    assert fields(detect(environ=environ)) == expected


def test_torchrun_reads_master_address_and_port() -> None:
    env = detect(environ=TORCHRUN)
    assert (env.master_addr, env.master_port) == ("10.1.2.3", 23456)


def test_missing_local_variables_default_to_one_host() -> None:
    env = detect(environ={"RANK": "1", "WORLD_SIZE": "2"})
    assert fields(env) == ("torchrun", 1, 2, 1, 2)


def test_mpich_prefers_mpi_localrankid_over_pmi_local_rank() -> None:
    env = detect(environ={**MPICH, "PMI_LOCAL_RANK": "0", "PMI_LOCAL_SIZE": "1"})
    assert (env.local_rank, env.local_world_size) == (1, 3)


@pytest.mark.parametrize(
    ("environ", "launcher"),
    [
        pytest.param({**TORCHRUN, **OPENMPI, **SLURM}, "torchrun", id="torchrun-over-mpi-and-slurm"),
        pytest.param({**OPENMPI, **PMIX}, "openmpi", id="openmpi-over-pmix"),
        pytest.param({**PMIX, **MPICH}, "pmix", id="pmix-over-pmi"),
        pytest.param({**MPICH, **SLURM}, "mpich", id="mpich-over-slurm"),
        pytest.param({**OPENMPI, **SLURM}, "openmpi", id="openmpi-over-slurm"),
    ],
)
def test_launcher_precedence(environ: dict[str, str], launcher: str) -> None:
    assert detect(environ=environ).launcher == launcher


def test_a_launcher_needs_both_rank_and_size() -> None:
    # RANK alone is not torchrun; the next complete launcher (Open MPI) is used.
    env = detect(environ={"RANK": "1", **OPENMPI})
    assert fields(env) == ("openmpi", 5, 8, 1, 4)


@pytest.mark.parametrize(
    ("environ", "missing"),
    [
        ({"RANK": "1"}, "WORLD_SIZE"),
        ({"PMI_SIZE": "4"}, "PMI_RANK"),
        ({"SLURM_PROCID": "2", "SLURM_STEP_ID": "0"}, "SLURM_NTASKS"),
    ],
)
def test_a_half_set_launcher_is_an_error_not_a_single_process(environ: dict[str, str], missing: str) -> None:
    with pytest.raises(ValueError, match=rf"environment variable {missing} expected, but not set"):
        detect(environ=environ)


def test_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch, clean_launcher_env: None) -> None:
    for name, value in TORCHRUN.items():
        monkeypatch.setenv(name, value)
    assert fields(detect()) == ("torchrun", 3, 4, 1, 2)


# ------------------------------------------------------------------ bad values
@pytest.mark.parametrize(
    ("environ", "pattern"),
    [
        ({"RANK": "one", "WORLD_SIZE": "2"}, r"environment variable RANK: expected an integer, got 'one'"),
        (
            {"RANK": "0", "WORLD_SIZE": "2.5"},
            r"environment variable WORLD_SIZE: expected an integer, got '2\.5'",
        ),
        (
            {**OPENMPI, "OMPI_COMM_WORLD_LOCAL_RANK": "x"},
            r"OMPI_COMM_WORLD_LOCAL_RANK: expected an integer, got 'x'",
        ),
        (
            {**TORCHRUN, "MASTER_PORT": "http"},
            r"environment variable MASTER_PORT: expected an integer, got 'http'",
        ),
        ({"RANK": "2", "WORLD_SIZE": "2"}, r"rank must be in \[0, 2\), got 2 \(launcher: torchrun\)"),
        ({"PMI_RANK": "-1", "PMI_SIZE": "2"}, r"rank must be in \[0, 2\), got -1 \(launcher: mpich\)"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, r"world_size must be >= 1, got 0"),
        ({**MPICH, "MPI_LOCALRANKID": "3"}, r"local_rank must be in \[0, 3\), got 3"),
        ({**TORCHRUN, "MASTER_PORT": "70000"}, r"master_port must be in 1\.\.65535, got 70000"),
        ({**TORCHRUN, "MASTER_PORT": "0"}, r"master_port must be in 1\.\.65535, got 0"),
    ],
)
def test_bad_values_name_the_variable_and_value(environ: dict[str, str], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        detect(environ=environ)


def test_bad_explicit_values() -> None:
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 5 \(launcher: explicit\)"):
        detect(rank=5, world_size=2, environ={})
    with pytest.raises(ValueError, match=r"master_port must be in 1\.\.65535, got 65536"):
        detect(master_port=65536, environ={})


def test_empty_master_variables_fall_back_to_defaults() -> None:
    env = detect(environ={"MASTER_ADDR": "", "MASTER_PORT": ""})
    assert (env.master_addr, env.master_port) == ("127.0.0.1", 29500)


def test_dist_env_is_frozen_and_validated() -> None:
    env = DistEnv(rank=0, world_size=1)
    with pytest.raises(AttributeError):
        env.rank = 1  # type: ignore[misc]
    with pytest.raises(ValueError, match="master_addr must not be empty"):
        DistEnv(rank=0, world_size=1, master_addr="")


def test_get_env_or_raise_uses_torch_wording() -> None:
    assert get_env_or_raise("RANK", {"RANK": "0"}) == "0"
    with pytest.raises(ValueError) as info:
        get_env_or_raise("MASTER_ADDR", {})
    # torch.distributed: "environment variable MASTER_ADDR expected, but not set"
    assert str(info.value) == "environment variable MASTER_ADDR expected, but not set"


# ---------------------------------------------------------- COMMLIB_* helper
def test_read_env_var_parses_good_values_without_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert read_env_var("COMMLIB_X", int, 7, {"COMMLIB_X": " 42 "}) == 42
        assert read_env_var("COMMLIB_X", int, 7, {}) == 7
        assert read_env_var("COMMLIB_X", int, 7, {"COMMLIB_X": "   "}) == 7


def test_read_env_var_warns_on_bad_value_and_uses_default() -> None:
    with pytest.warns(RuntimeWarning) as record:
        value = read_env_var("COMMLIB_X", int, 7, {"COMMLIB_X": "seven"})
    assert value == 7
    message = str(record[0].message)
    assert "environment variable COMMLIB_X: unexpected value 'seven'" in message
    assert "using 7" in message


# ------------------------------------------------------- default port (MPI)
def expected_mpi_port() -> int:
    pid = launcher_pid()
    if pid is None:
        return 29500
    start = read_process(pid).start  # type: ignore[union-attr]
    return port_from_key(launch_key(pid, start, os.readlink("/proc/self/ns/pid")))


def test_the_launch_key_tells_apart_launches_that_share_a_pid() -> None:
    """Containers on the host's network number their processes alike: start time and namespace differ."""
    pids = range(1, 400)
    here = [launch_key(pid, 1000, "pid:[4026531836]") for pid in pids]
    assert here == [launch_key(pid, 1000, "pid:[4026531836]") for pid in pids]
    elsewhere = [launch_key(pid, 1000, "pid:[4026532417]") for pid in pids]
    later = [launch_key(pid, 1001, "pid:[4026531836]") for pid in pids]
    assert len(set(here) | set(elsewhere) | set(later)) == 3 * len(pids)


@pytest.mark.parametrize(
    "environ",
    [
        pytest.param(MPICH, id="mpich"),
        pytest.param({**OPENMPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "8"}, id="openmpi"),
        pytest.param({**PMIX, "PMIX_LOCAL_SIZE": "6"}, id="pmix"),
        pytest.param({**SLURM, "SLURM_NTASKS_PER_NODE": "8"}, id="slurm"),
        pytest.param({"PMI_RANK": "0", "PMI_SIZE": "2"}, id="mpich-no-local-vars"),
    ],
)
def test_mpi_launcher_on_one_host_derives_port_from_the_launcher_process(environ: dict[str, str]) -> None:
    port = detect(environ=environ).master_port
    assert port == expected_mpi_port()
    low, high = ephemeral_port_range()
    assert (20000 <= port < 65536 and not low <= port <= high) or port == 29500


@pytest.mark.parametrize(
    ("environ", "port"),
    [
        pytest.param({**MPICH, "MASTER_PORT": "31000"}, 31000, id="master-port-wins"),
        pytest.param({**MPICH, "MASTER_ADDR": "10.0.0.1"}, 29500, id="master-addr-means-multi-host"),
        pytest.param(
            {**MPICH, "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "1"}, 29500, id="ranks-on-several-hosts"
        ),
        pytest.param(OPENMPI, 29500, id="openmpi-4-of-8-local"),
        pytest.param({"RANK": "0", "WORLD_SIZE": "2"}, 29500, id="torchrun-no-derivation"),
        pytest.param({}, 29500, id="single-process"),
    ],
)
def test_default_port_without_derivation(environ: dict[str, str], port: int) -> None:
    assert detect(environ=environ).master_port == port


def test_explicit_arguments_under_a_launcher_take_its_port() -> None:
    """The port follows the launcher, not the argument style: both derive it, or neither."""
    for environ in (MPICH, {**MPICH, "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "1"}, OPENMPI):
        explicit = detect(rank=1, world_size=2, environ=environ)
        assert explicit.master_port == detect(environ=environ).master_port
    assert detect(rank=0, world_size=2, environ={}).master_port == 29500
    assert detect(master_port=2222, environ=MPICH).master_port == 2222


# One write of a whole line per rank: mpiexec forwards each rank's output as it reads it, so a line
# written in pieces can interleave with the other rank's.
_PRINT_ENV = (
    "import commlib, os; e = commlib.detect(); fields = ('DETECT', e.launcher, e.rank, e.world_size, "
    "e.local_rank, e.local_world_size, e.master_port, "
    "commlib.detect(rank=e.rank, world_size=e.world_size).master_port); "
    "os.write(1, (' '.join(map(str, fields)) + chr(10)).encode())"
)


@requires_mpi
@pytest.mark.mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("wrapped", [False, True], ids=["direct", "under-a-wrapper-script"])
def test_real_mpiexec_ranks_agree_on_the_derived_port(wrapped: bool) -> None:
    command = [sys.executable, "-c", _PRINT_ENV]
    if wrapped:  # each rank gets a parent of its own; the launcher's proxy is the shared ancestor
        command = ["bash", "-c", f'{sys.executable} -c "{_PRINT_ENV}"; true']
    proc = run_job([*mpiexec_command(2), *command], timeout=100, env=scrubbed_env(PYTHONPATH=str(REPO_ROOT)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = sorted(line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("DETECT"))
    assert len(lines) == 2, proc.stdout
    (launcher0, *rank0), (launcher1, *rank1) = lines
    assert launcher0 == launcher1 != "single"
    assert [rank0[:4], rank1[:4]] == [["0", "2", "0", "2"], ["1", "2", "1", "2"]]
    assert rank0[4] == rank1[4], f"ranks derived different ports: {lines}"
    assert rank0[5] == rank0[4] and rank1[5] == rank1[4], f"explicit rank= and world_size= differ: {lines}"
    low, high = ephemeral_port_range()
    assert 20000 <= int(rank0[4]) < 65536 and not low <= int(rank0[4]) <= high
