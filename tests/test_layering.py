"""The dependency direction: manifest <- adapters <- engine runtime <- plugins <- tools, no cycles.

Read from the source with ``ast`` (every ``import``, at module level or inside
a function, relative ones resolved, ``importlib.import_module("...")`` with a
literal name, and any other string literal that names an existing m2nkit
module: ``"m2nkit.engine.trainer"`` handed to vLLM's factory, ``".builder"``
in a lazy-attribute table), so a lazy or string-loaded import cannot hide a
back-edge or a cycle. The runtime is every module of ``engine/`` but the
plugins and the tools: it takes the destination layout from its caller and
must not know the vLLM tables (or any adapter), nor sit below what uses it.
The plugins (``engine/plugins/``: vLLM's engine around the runtime's
receiver) sit above the runtime and below the tools.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from _paths import REPO
import pytest

ROOT = REPO
FOLDERS = {"manifest": "m2nkit.manifest", "adapters": "m2nkit.adapters", "engine": "m2nkit.engine"}
TOOLS = {"m2nkit.engine.tools"}  # cli, demo, server, baseline
PLUGINS = {"m2nkit.engine.plugins"}  # vllm (the "m2nkit" backend inside vLLM)

#: A string literal that may name a module: dotted, optionally ``module:attribute``.
_MODULE_TEXT = re.compile(r"(\.*)([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(?::\w+)?")


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = [FOLDERS[rel.parts[0]], *rel.parts[1:]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports (absolute names; ``from a import b`` gives ``a`` and ``a.b``)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    return _imports_in(path.read_text(), package, str(path), known=_known_modules())


def _known_modules() -> frozenset[str]:
    """Every module of the package, by import name."""
    return frozenset(_module_name(p) for f in FOLDERS for p in _modules(f))


def _string_module(text: str, package: str, known) -> str | None:
    """The module a string literal names (``"m2nkit.engine.trainer"``, ``".builder"``,
    ``"a.b:func"``), resolved against ``package`` as ``importlib.import_module``
    does; ``None`` unless it is one of ``known``."""
    m = _MODULE_TEXT.fullmatch(text)
    if m is None:
        return None
    dots, name = m.group(1), m.group(2)
    if dots:
        base = package.split(".")
        if len(dots) > len(base):
            return None
        name = ".".join(base[:len(base) - (len(dots) - 1)] + [name])
    return name if name in known else None


def _imports_in(source: str, package: str, where: str = "<probe>", *, known=frozenset()) -> set[str]:
    out: set[str] = set()
    tree = ast.parse(source, where)
    docstrings = {id(n.value) for n in ast.walk(tree)
                  if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            fn = node.func
            called = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            if called in ("import_module", "__import__"):
                out.add(node.args[0].value)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and id(node) not in docstrings:
            named = _string_module(node.value, package, known)
            if named is not None:
                out.add(named)
    return out


def _modules(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _violations(paths, forbidden) -> dict[str, list[str]]:
    bad = {}
    for path in paths:
        hits = sorted(i for i in _imports(path) if any(_under(i, f) for f in forbidden))
        if hits:
            bad[str(path.relative_to(ROOT))] = hits
    return bad


def test_manifest_imports_neither_adapters_nor_engine():
    assert _modules("manifest")
    assert not _violations(_modules("manifest"), ["m2nkit.adapters", "m2nkit.engine"])


def test_adapters_import_nothing_from_the_engine():
    assert _modules("adapters")
    assert not _violations(_modules("adapters"), ["m2nkit.engine"])


def _runtime() -> list[Path]:
    return [p for p in _modules("engine")
            if not any(_under(_module_name(p), t) for t in TOOLS | PLUGINS)]


def _plugins() -> list[Path]:
    return [p for p in _modules("engine") if any(_under(_module_name(p), t) for t in PLUGINS)]


#: The vLLM-side layout derivation: builds vLLM's model classes on the meta device and
#: traces their loaders. It may import vLLM, but only inside functions, so that the
#: tables (and ``m2nkit plan`` without vLLM) never need it.
TRACE = {"adapters/vllm/trace.py", "adapters/vllm/stand_in.py"}


def _module_level_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module)
    return out


def test_only_plugins_and_tools_import_vllm_and_only_tools_import_plugins():
    """vLLM is imported by ``engine/plugins/`` and the tools alone (and, lazily, by the
    layout tracer); the plugins by the tools alone (and by vLLM, through the entry
    point in pyproject.toml)."""
    package = _modules("manifest") + _modules("adapters") + _runtime()
    tracer = [p for p in package if str(p.relative_to(ROOT)) in TRACE]
    assert len(tracer) == len(TRACE)
    assert not _violations([p for p in package if p not in tracer], ["vllm"])
    for p in tracer:
        assert not {m for m in _module_level_imports(p) if m == "vllm" or m.startswith("vllm.")}, p
    plugin = ROOT / "engine" / "plugins" / "vllm.py"
    assert plugin in _plugins()
    assert "vllm.distributed.weight_transfer.factory" in _imports(plugin)
    assert not _violations(package, list(PLUGINS))      # nothing below imports a plugin
    assert 'm2nkit = "m2nkit.engine.plugins.vllm:register"' in (ROOT / "pyproject.toml").read_text()


def test_plugins_use_the_runtime_never_the_tools():
    assert _plugins()
    assert not _violations(_plugins(), list(TOOLS))


def test_runtime_imports_no_adapter_no_plugin_and_no_tool():
    runtime = _runtime()
    names = {_module_name(p) for p in runtime}
    # The runtime as the design names it is in the scan.
    assert {"m2nkit.engine.trainer", "m2nkit.engine.receiver", "m2nkit.engine.session",
            "m2nkit.engine.clients", "m2nkit.engine.control", "m2nkit.engine.plan",
            "m2nkit.engine.transports.registry",
            "m2nkit.engine.transports.torch_p2p"} <= names
    assert not _violations(runtime, ["m2nkit.adapters", *TOOLS, *PLUGINS])


def test_runtime_loads_no_module_of_its_own_from_a_string():
    """The runtime imports its modules by import statements only (the planner once took
    a transport's rules from a ``"module:function"`` string)."""
    bad = {}
    for path in _runtime():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                    and str(node.args[0].value).startswith(("m2nkit", ".")):
                fn = node.func
                called = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
                if called in ("import_module", "__import__"):
                    bad.setdefault(str(path.relative_to(ROOT)), []).append(node.args[0].value)
    assert bad == {}


def _graph() -> dict[str, set[str]]:
    """module -> the m2nkit modules it imports (``a.b.name`` resolved to module ``a.b``)."""
    paths = {_module_name(p): p for f in FOLDERS for p in _modules(f)}

    def resolve(name: str) -> str | None:
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    return {m: {r for i in _imports(p) if _under(i, "m2nkit")
                and (r := resolve(i)) is not None and r != m}
            for m, p in paths.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


@pytest.mark.parametrize("side", ["runtime and plugins", "tools"])
def test_no_import_cycles_in_the_engine(side):
    prefixes = list(TOOLS) if side == "tools" else ["m2nkit.engine"]
    cycles = [c for c in _cycles(_graph())
              if any(_under(m, p) for m in c for p in prefixes)
              and (side == "tools" or not all(any(_under(m, t) for t in TOOLS) for m in c))]
    assert cycles == []


def test_the_scan_skips_docstrings_and_prose():
    source = '"""m2nkit.engine.tools.cli"""\nx = "m2nkit.engine.tools.cli is the CLI"\n'
    assert _imports_in(source, "m2nkit.engine", known={"m2nkit.engine.tools.cli"}) == set()


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_scan_sees_lazy_and_relative_imports():
    # The tools may use adapters, and do so inside functions: the scan must see it,
    # or the tests above would pass on a blind scanner.
    server = _imports(ROOT / "engine" / "tools" / "server.py")
    assert "m2nkit.adapters.vllm" in server
    trainer = _imports(ROOT / "engine" / "trainer.py")
    assert "m2nkit.engine.session" in trainer            # `from .session import ...`
    # Modules named in strings: the plugin hands vLLM's factory the trainer engine's
    # module path; a package's lazy-attribute table names its submodules.
    assert "m2nkit.engine.trainer" in _imports(ROOT / "engine" / "plugins" / "vllm.py")
    assert "m2nkit.adapters.vllm.builder" in _imports(ROOT / "adapters" / "vllm" / "__init__.py")


@pytest.mark.parametrize("source,expected", [
    # as written in a module of m2nkit.engine.transports
    ("from ...adapters import vllm", {"m2nkit.adapters", "m2nkit.adapters.vllm"}),
    ("from ..tools import demo", {"m2nkit.engine.tools", "m2nkit.engine.tools.demo"}),
    ("def f():\n    import m2nkit.adapters.vllm", {"m2nkit.adapters.vllm"}),
    ("importlib.import_module('m2nkit.engine.tools.cli')", {"m2nkit.engine.tools.cli"}),
    ("RULES = {'x': 'm2nkit.engine.tools.cli:main'}", {"m2nkit.engine.tools.cli"}),
    ("LAZY = {'f': ('...adapters.vllm', 'f')}", {"m2nkit.adapters.vllm"}),
])
def test_the_scan_resolves_each_import_form(source, expected):
    known = {"m2nkit.engine.tools.cli", "m2nkit.adapters.vllm"}
    found = _imports_in(source, "m2nkit.engine.transports", known=known)
    assert found >= expected
    assert _violations_in(found, ["m2nkit.adapters", *TOOLS])


def _violations_in(found: set[str], forbidden) -> list[str]:
    return sorted(i for i in found if any(_under(i, f) for f in forbidden))


# --------------------------------------------------------------------------
# file-level rules inside adapters/

#: Trainer-side adapters: they read a trainer's weights (or a checkpoint standing in for
#: them) and must not depend on what vLLM does with them (adapters/vllm/).
TRAINER_SIDE = ("m2nkit.adapters.fsdp2", "m2nkit.adapters.hf_checkpoint",
                "m2nkit.adapters.config_wires", "m2nkit.adapters.megatron",
                "m2nkit.adapters.trainer_spec", "m2nkit.adapters.tensor_parallel")


def _adapter_modules(*prefixes: str) -> list[Path]:
    return [p for p in _modules("adapters")
            if any(_under(_module_name(p), x) for x in prefixes)]


def test_families_never_import_megatron():
    """families <- megatron: the Megatron names live with the Megatron adapter, which
    imports the families; a family module knows nothing of Megatron."""
    families = _adapter_modules("m2nkit.adapters.families")
    assert {"m2nkit.adapters.families.llama", "m2nkit.adapters.families.kinds",
            "m2nkit.adapters.families.expand"} <= {_module_name(p) for p in families}
    assert not _violations(families, ["m2nkit.adapters.megatron"])
    # the other direction is the intended one
    assert "m2nkit.adapters.families.llama" in _imports(ROOT / "adapters" / "megatron" / "names.py")


def test_the_trainer_side_imports_no_vllm_side_rule():
    """What trainer and vLLM sides share (the family tables and their expander, vLLM's
    version names for the tables, a config's dtype) lives in families/; vLLM's own rules
    (what it allocates, how it places experts) stay in adapters/vllm/."""
    trainer = _adapter_modules(*TRAINER_SIDE)
    names = {_module_name(p) for p in trainer}
    assert {"m2nkit.adapters.fsdp2.source", "m2nkit.adapters.hf_checkpoint.checkpoint",
            "m2nkit.adapters.config_wires", "m2nkit.adapters.megatron.source",
            "m2nkit.adapters.trainer_spec"} <= names
    assert not _violations(trainer, ["m2nkit.adapters.vllm"])


def _adapter_graph() -> dict[str, set[str]]:
    """adapters module -> the adapters modules it imports (``from a import b`` counts as
    ``a.b`` when that is a module, else ``a``; lazy imports included)."""
    paths = {_module_name(p): p for p in _modules("adapters")}
    graph = {}
    for name, path in paths.items():
        deps = set()
        for imported in _imports(path):
            while imported and imported not in paths:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                deps.add(imported)
        graph[name] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles_among_adapters_modules():
    graph = _adapter_graph()
    assert "m2nkit.adapters.fsdp2.lora" in graph["m2nkit.adapters.fsdp2.source"]  # sees edges
    assert _cycles(graph) == []


def test_the_cycle_check_sees_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_tools_use_only_public_names_of_the_library():
    """The CLI, demo, stand-in server, baseline and benchmarks import no private
    (``_name``) from m2nkit: what they need is public API."""
    bad = []
    paths = sorted((ROOT / "engine" / "tools").glob("*.py")) + sorted((ROOT / "benchmarks").glob("*.py"))
    assert len(paths) >= 6
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("m2nkit"):
                bad += [f"{path.name}: {node.module}.{a.name}" for a in node.names
                        if a.name.startswith("_")]
    assert bad == []
