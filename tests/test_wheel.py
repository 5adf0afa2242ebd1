"""A wheel of m2nkit works on its own, with no source tree on the path.

The folders ``manifest/``, ``adapters/`` and ``engine/`` install as
``m2nkit.manifest`` and so on (``setup.py`` maps them and finds every
subpackage below). An editable install finds a new subpackage through its
parent's ``__path__`` whether or not packaging knows it; a wheel holds only
what packaging listed. So this builds a wheel from a copy of the checkout
(no ``build/`` left over from an earlier build can leak in, and nothing is
written into the checkout), installs it into a fresh venv whose only
borrowed entries are the running interpreter's site-packages (torch,
transformers, ...) through a plain ``.pth`` line — a path in a ``.pth`` is
added to ``sys.path`` without running that folder's own ``.pth`` files, so
the editable m2nkit finder of ``.venv`` stays inactive — and, from a
working directory outside the repository:

- checks that every file under the package folders is in the wheel and that
  every folder with an ``__init__.py`` imports from the fresh venv;
- runs the README's ``m2nkit plan ... --verify``.

About 15 s on a 2-core machine (the wheel build, then torch imports twice).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

from _paths import REPO
import pytest

ROOT = REPO

#: folder -> import package, as in setup.py's ROOTS.
FOLDERS = {"package": "m2nkit", "manifest": "m2nkit.manifest",
           "adapters": "m2nkit.adapters", "engine": "m2nkit.engine"}

#: not part of a checkout a user builds from; skipped when copying it.
NOT_SOURCE = {".git", ".venv", ".venv-tf", ".venv-sglang", "venv", "build", "dist", "tests", "out",
              ".pytest_cache", ".hypothesis"}

pytestmark = pytest.mark.timeout(180)


def _is_cache(path: Path) -> bool:
    return "__pycache__" in path.parts or path.suffix in (".pyc", ".pyo")


def _tree_packages() -> dict[str, Path]:
    """Import name -> folder, for each package folder and every folder below
    it that holds an ``__init__.py`` (whatever its parents hold)."""
    out = {}
    for folder, name in FOLDERS.items():
        base = ROOT / folder
        for init in sorted(base.rglob("__init__.py")):
            if _is_cache(init):
                continue
            rel = init.parent.relative_to(base)
            out[".".join((name, *rel.parts))] = init.parent
    return out


def _tree_files() -> dict[str, Path]:
    """Path inside the wheel (``m2nkit/...``) -> file, for every file under the
    package folders except bytecode caches."""
    out = {}
    for folder, name in FOLDERS.items():
        base = ROOT / folder
        prefix = Path(*name.split("."))
        for f in sorted(base.rglob("*")):
            if f.is_file() and not _is_cache(f):
                out[(prefix / f.relative_to(base)).as_posix()] = f
    return out


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONNOUSERSITE"] = "1"
    return env


def _run(cmd, cwd, timeout) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=_env(), capture_output=True,
                          text=True, timeout=timeout)


def _check(proc: subprocess.CompletedProcess, what: str) -> None:
    assert proc.returncode == 0, (f"{what} exited {proc.returncode}\n--- stdout\n{proc.stdout}"
                                  f"\n--- stderr\n{proc.stderr}")


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """``(wheel path, fresh venv's python, fresh venv's site-packages, a cwd outside the repo)``."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"

    def ignore(folder, names):
        top = Path(folder) == ROOT
        return {n for n in names if (top and n in NOT_SOURCE) or n == "__pycache__"
                or n.endswith((".egg-info", ".pyc"))}

    shutil.copytree(ROOT, src, ignore=ignore)
    dist = tmp / "dist"
    # No build isolation: the running interpreter's setuptools builds it, so
    # the test needs no package index.
    _check(_run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                 "--disable-pip-version-check", "-q", "-w", dist, src], tmp, 120), "pip wheel")
    (wheel,) = dist.glob("m2nkit-*.whl")

    venv = tmp / "venv"
    _check(_run([sys.executable, "-m", "venv", "--without-pip", venv], tmp, 60), "python -m venv")
    python = venv / "bin" / "python"
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     tmp, 30).stdout.strip())
    # Also the site-packages the running interpreter borrows itself, in its order
    # (scripts/side_transformers.sh's .venv-tf puts .venv's behind its own).
    borrowed = dict.fromkeys([*(sysconfig.get_paths()[k] for k in ("purelib", "platlib")),
                              *(p for p in sys.path if Path(p).name == "site-packages")])
    (site / "_m2nkit_test_dependencies.pth").write_text("".join(f"{p}\n" for p in borrowed))
    _check(_run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps",
                 "--no-index", "--disable-pip-version-check", "-q", wheel], tmp, 120),
           "pip install")
    cwd = tmp / "elsewhere"
    cwd.mkdir()
    return wheel, python, site, cwd


@pytest.mark.integration  # spawns processes for seconds: see pyproject.toml
def test_wheel_holds_every_file_of_the_package_folders(installed):
    wheel = installed[0]
    with zipfile.ZipFile(wheel) as z:
        held = set(z.namelist())
    missing = sorted(name for name in _tree_files() if name not in held)
    assert not missing, (
        f"the wheel lacks {missing}: a folder of Python modules needs an __init__.py (setup.py "
        "finds packages by it), and a data file a pattern in setup.py's DATA_PATTERNS")


@pytest.mark.integration  # spawns processes for seconds: see pyproject.toml
def test_every_package_folder_imports_from_the_fresh_venv(installed):
    _, python, site, cwd = installed
    names = sorted(_tree_packages())
    assert "m2nkit.adapters.vllm" in names and "m2nkit.engine.transports" in names
    script = ("import importlib, json, sys\n"
              "print(json.dumps({n: importlib.import_module(n).__file__ for n in sys.argv[1:]}))")
    proc = _run([python, "-c", script, *names], cwd, 120)
    _check(proc, "importing every package")
    files = json.loads(proc.stdout.strip().splitlines()[-1])
    site = site.resolve()
    outside = {n: f for n, f in files.items() if not Path(f).resolve().is_relative_to(site)}
    assert not outside, f"imported from outside the fresh venv's site-packages {site}: {outside}"


@pytest.mark.integration  # spawns processes for seconds: see pyproject.toml
def test_plan_verify_runs_from_the_wheel(installed):
    _, python, _, cwd = installed
    m2nkit = python.parent / "m2nkit"
    proc = _run([m2nkit, "plan", ROOT / "examples" / "tiny-qwen3-moe", "--trainer", "fsdp:3",
                 "--inference", "vllm:tp=2,ep", "--verify"], cwd, 120)
    _check(proc, "m2nkit plan --verify from the wheel")
    out = " ".join(proc.stdout.split())          # rich wraps long lines when piped
    # vLLM is importable here (the venv borrows this one's site-packages): the default
    # layout is traced from vLLM's loaders, and the reference is vLLM's own load
    assert "traced from vLLM's own weight loaders (the default" in out, proc.stdout
    assert "verify: all 2 workers hold exactly what vLLM's own loaders would" in out, proc.stdout
