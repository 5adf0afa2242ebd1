"""The transformers range m2nkit declares is the range CI tests (issue 21 item 6).

``pyproject.toml`` declares a transformers range; CI must run the fast suite
at both ends it can reach: the pinned version (``constraints.txt``, what
scripts/setup.sh installs for vLLM, Megatron-Core and Megatron-Bridge) and the
newest the range admits (``scripts/side_transformers.sh`` builds ``.venv-tf``
with it; ``.ci/run`` runs the fast suite there too). So the range's lower bound
is the pinned version (nothing older is tested), and ``.ci/run`` has both runs.
"""

from __future__ import annotations

import re

from packaging.requirements import Requirement
from packaging.version import Version

from _paths import REPO


def _declared() -> Requirement:
    # the one quoted requirement in pyproject.toml (no tomllib: Python 3.10 has none)
    (text,) = re.findall(r'"(transformers\b[^"]*)"', (REPO / "pyproject.toml").read_text())
    return Requirement(text)


def _pinned() -> Version:
    (pin,) = re.findall(r"^transformers==(\S+)$", (REPO / "constraints.txt").read_text(), re.M)
    return Version(pin)


def test_the_declared_range_starts_at_the_pinned_version():
    req, pin = _declared(), _pinned()
    assert req.specifier.contains(pin), (str(req), pin)
    lower = [Version(s.version) for s in req.specifier if s.operator == ">="]
    assert lower == [pin], f"{req}: its lower bound must be the tested pin {pin}"
    assert not req.specifier.contains(Version("5.12.0")), str(req)


def test_ci_runs_the_fast_suite_under_the_pinned_and_the_newest_transformers():
    lines = [ln.strip() for ln in (REPO / ".ci" / "run").read_text().splitlines()
             if ln.strip() and not ln.lstrip().startswith("#")]
    fast = [i for i, ln in enumerate(lines) if 'pytest' in ln and '"not integration"' in ln]
    assert [lines[i].split()[0] for i in fast] == [".venv/bin/python", ".venv-tf/bin/python"]
    side = lines.index("./scripts/side_transformers.sh")
    assert fast[0] < side < fast[1]
    script = (REPO / "scripts" / "side_transformers.sh").read_text()
    # the newest version the declared range admits, read from pyproject.toml, never .venv
    assert 'tomllib.load(open("pyproject.toml"' in script
    assert "--ignore-installed" in script and '--target "$SIDE_SITE"' in script
