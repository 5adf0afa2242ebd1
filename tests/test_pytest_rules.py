"""The suite's own rules: the ``integration`` marker is registered, markers
are strict, and an ``integration`` test whose stack is missing fails.

Each case runs a small throw-away test file through a real pytest process,
under this repository's pyproject.toml and tests/conftest.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from _paths import REPO
import pytest

ROOT = REPO

pytestmark = pytest.mark.timeout(120)

CASES = '''
import pytest

@pytest.mark.integration
def test_stack_missing_in_test():
    pytest.importorskip("m2nkit_no_such_framework")

@pytest.mark.integration
@pytest.mark.skipif(True, reason="no such framework here")
def test_stack_missing_in_skipif():
    pass

@pytest.mark.integration
def test_stack_present():
    pass

@pytest.mark.integration
@pytest.mark.xfail(reason="a known bug", strict=True)
def test_xfail_stays_xfail():
    raise AssertionError

def test_ordinary_test_may_skip():
    pytest.skip("not an integration test")
'''


def _pytest(tmp_path: Path, source: str, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    (tmp_path / "test_cases.py").write_text(source)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"), "--rootdir",
         str(tmp_path), "-p", "no:cacheprovider", "-rA", *args, str(tmp_path / "test_cases.py")],
        cwd=tmp_path, capture_output=True, text=True, timeout=100)


def test_integration_marker_is_registered_and_documented():
    proc = subprocess.run([sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"),
                           "--rootdir", str(ROOT), "-p", "no:cacheprovider", "--markers"],
                          cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("@pytest.mark.integration:"))
    assert "fails, never skips" in line.lower() and "not integration" in line


def test_a_skipped_integration_test_fails(tmp_path):
    proc = _pytest(tmp_path, CASES)
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr
    # A skip at setup (skipif, a fixture) becomes an error, one in the test a failure.
    assert "1 failed, 1 passed, 1 skipped, 1 xfailed, 1 error" in out, out
    assert "FAILED test_cases.py::test_stack_missing_in_test" in out
    assert "ERROR test_cases.py::test_stack_missing_in_skipif" in out
    assert "was skipped (no such framework here); integration tests fail instead" in out
    assert "-m 'not integration'" in out


def test_not_integration_leaves_them_out(tmp_path):
    proc = _pytest(tmp_path, CASES, "-m", "not integration")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 skipped, 4 deselected" in proc.stdout, proc.stdout


def test_a_misspelt_marker_is_an_error(tmp_path):
    proc = _pytest(tmp_path, "import pytest\n\n@pytest.mark.integraton\ndef test_x():\n    pass\n")
    assert proc.returncode != 0
    assert "'integraton' not found in `markers` configuration option" in proc.stdout + proc.stderr
