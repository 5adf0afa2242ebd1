"""The fast suite imports only what ``pip install -e '.[dev,nccl]'`` installs.

``scripts/setup.sh --core`` (the documented test install) installs m2nkit with
its ``dev`` and ``nccl`` extras and nothing else; ``pytest -m "not
integration"`` must pass there. The full setup adds the vLLM, Megatron and
Ray stacks, and with them packages such as ``requests`` that a fast test
could import without anyone noticing. So every import statement (top level or
inside a function) of every non-integration test module, and of the
benchmark scripts the fast tests run (``benchmarks/gpu_check.py``), must name
the standard library, m2nkit, the tests' own helpers, or a distribution in the
dependency closure of ``m2nkit[dev,nccl]`` as the installed metadata declares
it. The only exception is the one place in ``gpu_check.py`` that talks to a
running ``vllm serve`` (it needs vLLM anyway).
"""

from __future__ import annotations

import ast
import re
import sys
from importlib.metadata import PackageNotFoundError, distribution, packages_distributions
from pathlib import Path

from _paths import REPO
from packaging.requirements import Requirement

TESTS = REPO / "tests"

#: Scripts the fast tests run, and the functions of each allowed to import a
#: framework stack (they run only against a live vLLM server).
SCRIPTS = {REPO / "benchmarks" / "gpu_check.py": {"_send_update": {"vllm"},
                                                   "colocated_trainer_main": {"vllm"}}}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _closure(root: str, extras: set[str]) -> set[str]:
    """Normalised names of ``root[extras]`` and everything it requires, recursively,
    with environment markers evaluated for this interpreter."""
    seen: dict[str, set[str]] = {}
    todo = [(root, extras)]
    while todo:
        name, wanted = todo.pop()
        key = _norm(name)
        if key in seen and wanted <= seen[key]:
            continue
        seen.setdefault(key, set()).update(wanted)
        try:
            requires = distribution(name).requires or []
        except PackageNotFoundError:   # an optional dependency not built for this platform
            continue
        for line in requires:
            req = Requirement(line)
            envs = [{"extra": e} for e in (wanted or {""})]
            if req.marker is None or any(req.marker.evaluate(env) for env in envs):
                todo.append((req.name, set(req.extras)))
    return set(seen)


def _importable_names() -> set[str]:
    """Top-level module names the core install provides (besides the standard library)."""
    dists = _closure("m2nkit", {"dev", "nccl"})
    names = {mod for mod, owners in packages_distributions().items()
             if any(_norm(d) in dists for d in owners)}
    helpers = {p.stem for p in TESTS.rglob("*.py")}     # _paths, _procs, conftest, test modules
    return names | helpers | {"m2nkit"} | set(sys.stdlib_module_names)


def _imports(path: Path):
    """``(line, top-level module, enclosing function or None)`` of every absolute import."""
    tree = ast.parse(path.read_text(), str(path))

    def walk(node, func):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield child.lineno, alias.name.split(".")[0], func
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                yield child.lineno, child.module.split(".")[0], func
            yield from walk(child, inner)

    yield from walk(tree, None)


def _fast_test_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py")
                  if "integration" not in p.relative_to(TESTS).parts
                  and "data" not in p.relative_to(TESTS).parts)


def test_the_closure_is_read_from_the_installed_metadata():
    dists = _closure("m2nkit", {"dev", "nccl"})
    assert {"torch", "transformers", "safetensors", "rich", "pytest", "hypothesis",
            "peft"} <= dists
    assert "vllm" not in dists and "megatron-core" not in dists
    assert "requests" not in dists       # vLLM brings it; m2nkit[dev,nccl] does not


def test_fast_tests_import_only_what_the_core_install_provides():
    ok = _importable_names()
    bad = [f"{path.relative_to(REPO)}:{line}: {mod}"
           for path in _fast_test_files() for line, mod, _ in _imports(path) if mod not in ok]
    assert not bad, ("fast tests import packages that scripts/setup.sh --core does not install "
                     f"(declare them in the dev extra, or keep the test off them): {bad}")


def test_scripts_the_fast_tests_run_import_only_what_the_core_install_provides():
    ok = _importable_names()
    bad = []
    for path, allowed in SCRIPTS.items():
        for line, mod, func in _imports(path):
            if mod not in ok and mod not in allowed.get(func, ()):
                bad.append(f"{path.relative_to(REPO)}:{line}: {mod} (in {func or 'module'})")
    assert not bad, bad
