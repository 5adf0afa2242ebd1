"""The dependency direction: manifest <- adapters <- engine runtime <- tools, no back-edges.

Read from the source with ``ast`` (every ``import``, at module level or inside
a function, relative ones resolved, and ``importlib.import_module("...")``
with a literal name), so a lazy import cannot hide a back-edge. The runtime
is every module of ``engine/`` but the tools: it takes the destination
layout from its caller and must not know the vLLM tables (or any adapter),
nor sit on top of the tools that use it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"manifest": "m2nkit.manifest", "adapters": "m2nkit.adapters", "engine": "m2nkit.engine"}
TOOLS = {"m2nkit.engine.tools"}  # cli, demo, server, baseline


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
    return _imports_in(path.read_text(), package, str(path))


def _imports_in(source: str, package: str, where: str = "<probe>") -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(source, where)):
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


#: The vLLM plugin: vLLM's WeightTransferEngine around the runtime's receiver, so it
#: sits above the runtime (like the tools) although it lives with the vLLM adapter.
PLUGIN = ROOT / "adapters" / "vllm" / "plugin.py"


def test_adapters_import_nothing_from_the_engine():
    assert _modules("adapters")
    others = [p for p in _modules("adapters") if p != PLUGIN]
    assert not _violations(others, ["m2nkit.engine"])
    # The plugin may use the runtime, never the tools.
    assert not _violations([PLUGIN], list(TOOLS))


def test_only_the_plugin_imports_vllm():
    """vLLM is imported by adapters/vllm/plugin.py alone; only the tools import the plugin."""
    package = _modules("manifest") + _modules("adapters") + _modules("engine")
    assert not _violations([p for p in package if p != PLUGIN], ["vllm"])
    assert "vllm.distributed.weight_transfer.factory" in _imports(PLUGIN)
    users = _violations(package, ["m2nkit.adapters.vllm.plugin"])
    assert set(users) <= {str((ROOT / "engine" / "tools" / "demo_vllm.py").relative_to(ROOT))}


def test_runtime_imports_no_adapter_and_no_tool():
    runtime = [p for p in _modules("engine")
               if not any(_under(_module_name(p), t) for t in TOOLS)]
    names = {_module_name(p) for p in runtime}
    # The runtime as the design names it is in the scan.
    assert {"m2nkit.engine.trainer", "m2nkit.engine.receiver", "m2nkit.engine.session",
            "m2nkit.engine.clients", "m2nkit.engine.transports.torch_p2p"} <= names
    assert not _violations(runtime, ["m2nkit.adapters", *TOOLS])


def test_the_scan_sees_lazy_and_relative_imports():
    # The tools may use adapters, and do so inside functions: the scan must see it,
    # or the tests above would pass on a blind scanner.
    server = _imports(ROOT / "engine" / "tools" / "server.py")
    assert "m2nkit.adapters.vllm" in server
    trainer = _imports(ROOT / "engine" / "trainer.py")
    assert "m2nkit.engine.session" in trainer            # `from .session import ...`


@pytest.mark.parametrize("source,expected", [
    # as written in a module of m2nkit.engine.transports
    ("from ...adapters import vllm", {"m2nkit.adapters", "m2nkit.adapters.vllm"}),
    ("from ..tools import demo", {"m2nkit.engine.tools", "m2nkit.engine.tools.demo"}),
    ("def f():\n    import m2nkit.adapters.vllm", {"m2nkit.adapters.vllm"}),
    ("importlib.import_module('m2nkit.engine.tools.cli')", {"m2nkit.engine.tools.cli"}),
])
def test_the_scan_resolves_each_import_form(source, expected):
    found = _imports_in(source, "m2nkit.engine.transports")
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
