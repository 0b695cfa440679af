"""``scripts/test.sh``: its two passes, the waiting tests beside pass 2, and the exit code CI sees.

Each case runs the script on a small suite written to a temporary folder, with the interpreter
running these tests, so that the script's own logic is what is tested.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

MARKERS = "multiprocess", "mpi", "launcher", "gpu", "waits"

SUITES = {
    "all pass": (
        0,
        """
        import pytest

        def test_in_one_process():
            assert 1 + 1 == 2

        @pytest.mark.multiprocess
        def test_that_spawns():
            assert sum(range(4)) == 6

        @pytest.mark.multiprocess
        @pytest.mark.waits
        def test_that_waits():
            assert max(3, 5) == 5
        """,
    ),
    "a waiting test fails": (
        1,
        """
        import pytest

        def test_in_one_process():
            assert True

        @pytest.mark.multiprocess
        @pytest.mark.waits
        def test_that_waits():
            assert 2 + 2 == 5
        """,
    ),
    "nothing collected": (5, "X = 1\n"),
}


@pytest.mark.parametrize("case", list(SUITES))
def test_the_script_exits_with_what_its_runs_found(case: str, tmp_path: Path) -> None:
    expected, source = SUITES[case]
    (tmp_path / "test_suite.py").write_text(textwrap.dedent(source))
    ini = tmp_path / "pytest.ini"
    ini.write_text("[pytest]\nmarkers =\n" + "".join(f"    {m}: -\n" for m in MARKERS))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "COMMLIB_TEST"))}
    env.update(COMMLIB_PYTHON=sys.executable, COMMLIB_TEST_WORKERS="2", TMPDIR=str(tmp_path))
    script = REPO_ROOT / "scripts" / "test.sh"
    result = subprocess.run(
        ["bash", str(script), str(tmp_path), "-c", str(ini), "-p", "no:cacheprovider"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = result.stdout + result.stderr
    assert result.returncode == expected, output
    if case == "all pass":
        assert output.count("1 passed") == 3, output  # pass 1, pass 2, and the waiting test beside it
        assert "pass 1 exit 0, pass 2 exit 0, its waiting tests exit 0" in output, output
    if case == "a waiting test fails":
        assert "its waiting tests exit 1" in output and "assert (2 + 2) == 5" in output, output
    if case == "nothing collected":
        assert "collected no tests (exit code 5)" in output, output
    assert not list(tmp_path.glob("commlib-waits.*")), "the waiting tests' log was left behind"
