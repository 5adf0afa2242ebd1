"""Architectures without an m2nkit table, planned from vLLM 0.33.0's own loaders.

The trainer side is transformers' own model (``adapters/families/tableless.py``:
in-memory names, a checkpoint loaded by ``from_pretrained``); the vLLM side is
the trace (``adapters/vllm/trace.py``). Checked against things m2nkit did not
compute: vLLM's own ``DefaultModelLoader`` filling each worker's model from the
checkpoint's files (``plan --verify`` on a traced layout), and the parameters
of vLLM's model objects (every element of every worker parameter written once,
no byte moved twice) for the published configs in ``examples/configs``.
Architectures that have a table since (Qwen3-Next, Qwen3.5[-MoE] text models,
GLM, DSA, Qwen3-VL) are traced here from the table's wire names, which the trace
takes as well.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from _paths import REPO

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]

M2NKIT = [sys.executable, "-m", "m2nkit.engine.tools.cli"]

#: A tiny hybrid Gated DeltaNet MoE (one linear-attention and one full-attention layer).
TINY_QWEN3_5_MOE = dict(
    hidden_size=128, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
    moe_intermediate_size=32, shared_expert_intermediate_size=32, num_hidden_layers=2,
    vocab_size=200, num_experts=8, num_experts_per_tok=2, max_position_embeddings=256,
    layer_types=["linear_attention", "full_attention"], linear_num_key_heads=4,
    linear_num_value_heads=8, linear_key_head_dim=16, linear_value_head_dim=16)


@pytest.fixture(scope="module")
def tiny_hybrid_moe(tmp_path_factory):
    import transformers

    d = tmp_path_factory.mktemp("tiny-qwen3_5-moe")
    config = transformers.Qwen3_5MoeTextConfig(architectures=["Qwen3_5MoeForCausalLM"],
                                               **TINY_QWEN3_5_MOE)
    torch.manual_seed(0)
    transformers.Qwen3_5MoeForCausalLM(config).to(torch.bfloat16).save_pretrained(d)
    return d


def _cli(*args):
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "COLUMNS": "250"}
    return subprocess.run([*M2NKIT, "plan", *map(str, args)], capture_output=True, text=True,
                          timeout=900, env=env, cwd=REPO)


def test_plan_layout_traced_plans_a_hybrid_gated_deltanet_moe_and_vllm_agrees(tiny_hybrid_moe):
    """``--layout traced`` on an architecture that has a table (Qwen3.5-MoE,
    families/qwen3_5_moe.py): the checkpoint is read with the table's wire names
    (stacked experts ``...experts.gate_up_proj.weight``), which the trace takes."""
    r = _cli(tiny_hybrid_moe, "--trainer", "fsdp:2", "--inference", "vllm:tp=2,ep", "--verify",
             "--layout", "traced")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "traced from vLLM's own weight loaders" in r.stdout
    assert "(ratio 1.000)" in r.stdout
    # the reference is vLLM itself: each worker's model filled from the files by
    # vLLM's DefaultModelLoader, compared bit for bit with what the plan delivered
    assert "verify: all 2 workers hold exactly what vLLM's own loaders would" in r.stdout
    # the user's screen has m2nkit's lines, not vLLM's notes about this CPU platform
    assert not any(x in r.stderr for x in ("vllm._C", "Triton", "Reset SSM cache")), r.stderr


def test_plan_from_the_tables_verifies_the_same_checkpoint(tiny_hybrid_moe):
    r = _cli(tiny_hybrid_moe, "--trainer", "fsdp:2", "--inference", "vllm:tp=2,ep", "--verify",
             "--layout", "tables")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "m2nkit's family tables (no vLLM needed)" in r.stdout
    assert "(ratio 1.000)" in r.stdout


def test_plan_from_the_tables_refuses_an_architecture_without_one(tmp_path):
    """An architecture transformers has and m2nkit has no table for (Phi), config only."""
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["PhiForCausalLM"], "model_type": "phi", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 2,
        "vocab_size": 200, "dtype": "bfloat16"}))
    r = _cli(tmp_path, "--trainer", "fsdp:2", "--inference", "vllm:tp=2", "--layout", "tables")
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1, r.stderr
    assert "architecture 'PhiForCausalLM' is not supported" in r.stderr
    assert r.stderr.strip().endswith("--layout traced (needs vLLM installed)")


#: Published configs without a table, each planned config-only at tp 2 (with EP
#: for the MoE ones); realistic layouts: benchmarks/trace.py and docs/benchmarks.md.
#: (GLM-5 has a table since, families/glm_moe_dsa.py: its wire is the table's, traced.)
#: Qwen3-VL's have a table now (families/qwen3_vl.py): traced here from its wire names.
TABLELESS_CONFIGS = {
    # have a table now (families/qwen3_5_vl.py, qwen3_5_moe_vl.py): kept, traced from its
    # wire names
    "Qwen__Qwen3.5-27B": "vllm:tp=2",
    "Qwen__Qwen3.5-397B-A17B": "vllm:tp=2,ep",
    # has a table now (families/qwen3_next.py): kept, the trace taking the table's wire names
    "Qwen__Qwen3-Next-80B-A3B-Instruct": "vllm:tp=2,ep",
    "Qwen__Qwen3-VL-8B-Instruct": "vllm:tp=2",
    "Qwen__Qwen3-VL-30B-A3B-Instruct": "vllm:tp=2,ep",
    # has a table now (families/glm4_moe_lite.py): kept, the trace taking the table's wire names
    "zai-org__GLM-4.7-Flash": "vllm:tp=2,ep",
    "zai-org__GLM-5": "vllm:tp=2,ep",
    # has a table now (families/llama4.py, llama4_vl.py): kept, traced from its wire names
    # (rotary q/k rows one binding per row, experts carried [E, out, in])
    "meta-llama__Llama-4-Scout-17B-16E-Instruct": "vllm:tp=2,ep",
}


@pytest.mark.parametrize("model", sorted(TABLELESS_CONFIGS))
def test_config_only_traced_plans_write_every_element_once(model):
    from m2nkit.adapters.hf_checkpoint import checkpoint_metas, read_checkpoint
    from m2nkit.adapters.vllm.trace import trace_destination
    from m2nkit.engine.plan import build_plan

    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    config = REPO / "examples" / "configs" / model / "config.json"
    ckpt = read_checkpoint(config)
    assert ckpt.architecture == json.loads(config.read_text())["architectures"][0]
    metas = checkpoint_metas(ckpt, "fsdp:4")
    layout = trace_destination(config.parent, metas, TABLELESS_CONFIGS[model])
    plan = build_plan(metas, 4, layout)
    assert not plan.problems, plan.problems[:3]
    # Every element of every parameter of vLLM's model objects is written exactly
    # once (or is a padding element its loader leaves zero), in the wire's dtype.
    wire_bytes = {m.name: m.dtype.itemsize for m in metas}
    bound = 0
    for name, bindings in layout.bindings.items():
        for b in bindings:
            bound += math.prod(hi - lo for lo, hi in b.box) * wire_bytes[name]
    params = sum(math.prod(p.shape) * wire_bytes_of(p, layout, wire_bytes)
                 - sum(math.prod(hi - lo for lo, hi in z) for z in p.zero_boxes)
                 * wire_bytes_of(p, layout, wire_bytes)
                 for p in layout.params)
    assert bound == params
    assert plan.nbytes_moved == plan.nbytes_min == bound
    # vision towers travel too
    if "VL" in model or "3.5" in model:
        assert any(".visual." in n for n in layout.bindings), "no vision-tower tensor is bound"
    if "Llama-4" in model:
        assert any(n.startswith("vision_model.") for n in layout.bindings), \
            "no vision-tower tensor is bound"


def wire_bytes_of(param, layout, wire_bytes) -> int:
    """The wire itemsize of the tensors feeding ``param`` (one dtype per parameter)."""
    sizes = {wire_bytes[n] for n, bs in layout.bindings.items() for b in bs
             if b.param == param.name and b.worker == param.worker}
    assert len(sizes) == 1, (param.name, sizes)
    return sizes.pop()


def _tableless_fixtures():
    """The shipped tiny checkpoints (tests/data/oracle) of architectures without a table."""
    from _paths import ORACLE
    from m2nkit.adapters.families import has_table

    out = []
    for d in sorted(ORACLE.iterdir()):
        config = d / "checkpoint" / "config.json"
        if config.is_file():
            doc = json.loads(config.read_text())
            if not has_table(doc["architectures"][0]):
                moe = any(k in doc for k in ("num_experts", "n_routed_experts",
                                             "num_local_experts"))
                out.append(pytest.param(d / "checkpoint", "vllm:tp=2,ep" if moe else "vllm:tp=2",
                                        id=d.name))
    return out


#: Shipped tableless checkpoints whose vLLM loaders are no box algebra, and the refusal
#: plan prints (none since Llama-4's rotary rows and transposed experts trace:
#: tests/integration/test_traced_misc.py).
REFUSED: dict[str, str] = {}


#: Checkpoints planned in a process of their own: vLLM serves them through its generic
#: Transformers backend, whose fusers rewrite transformers' module classes in the process
#: that builds the vLLM model (``model_executor/models/transformers/fusers``), so
#: transformers' own model of the same class cannot be built there afterwards. One
#: ``m2nkit plan`` reads the checkpoint before it traces; this test process has traced
#: them already (test_traced_misc.py).
OWN_PROCESS = {"tiny-olmo3"}


@pytest.mark.parametrize("checkpoint,spec", _tableless_fixtures())
def test_plan_verify_of_every_tableless_checkpoint_equals_vllms_own_load(checkpoint, spec,
                                                                         capsys):
    """The user's path, in process: the checkpoint read by transformers, the layout
    traced, the plan executed, every worker held against vLLM's DefaultModelLoader
    (or, for a loader that is no box algebra, the one-line refusal)."""
    from m2nkit.engine.tools.cli import main

    args = ["plan", str(checkpoint), "--trainer", "fsdp:3", "--inference", spec, "--verify"]
    if checkpoint.parent.name in OWN_PROCESS:
        r = _cli(*args[1:])
        code, out, err = r.returncode, r.stdout, r.stderr
    else:
        capsys.readouterr()
        code = main(args)
        out, err = capsys.readouterr()
    if checkpoint.parent.name in REFUSED:
        assert code == 2, out[-3000:]
        assert err.startswith("m2nkit: error: --layout traced: "
                              + REFUSED[checkpoint.parent.name]), err
        assert "Traceback" not in err
        return
    assert code == 0, out[-3000:] + err[-3000:]
    assert "traced from vLLM's own weight loaders" in out
    assert "(ratio 1.000)" in out
    assert f"verify: all {int(spec[8])} workers hold exactly what vLLM's own loaders would" in out


def test_a_quantized_config_without_its_quantized_wire_is_refused_naming_both():
    """DeepSeek-V3.2 as published is fp8 (``quantization_config``): vLLM builds fp8 weights
    and block scales; transformers' model of the config is unquantized, so the two
    cannot meet. Refused with what would work, never bound as bytes of another dtype."""
    from m2nkit.adapters.families.tableless import meta_model
    from m2nkit.adapters.vllm.trace import TraceError, trace_destination
    from m2nkit.manifest import ParamMeta

    folder = REPO / "examples" / "configs" / "deepseek-ai__DeepSeek-V3.2"
    # transformers' (unquantized) model of the config as the wire: the tableless path,
    # forced (DeepSeek-V3.2 has a table, whose config-only wire is fp8 as published:
    # tests/adapters/test_dsa.py, tests/integration/test_vllm_trace.py)
    model = meta_model(json.loads((folder / "config.json").read_text()))
    metas = [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in model.state_dict().items()]
    with pytest.raises(TraceError) as e:
        trace_destination(folder, metas, "vllm:tp=2,ep")
    assert str(e.value).startswith("vLLM serves this config quantized (fp8, its "
                                   "quantization_config) while the wire tensors are unquantized")
    assert "a config without quantization_config" in str(e.value)


@pytest.mark.parametrize("model", ["tiny-deepseek-v32", "tiny-glm-moe-dsa", "tiny-glm4-moe",
                                   "tiny-glm4-moe-lite", "tiny-qwen3-next", "tiny-qwen3.5",
                                   "tiny-qwen3.5-moe", "tiny-qwen3.5-vl",
                                   "tiny-qwen3.5-moe-vl"])
def test_plan_layout_traced_verifies_a_family_with_a_table(model, capsys):
    """DeepSeek-V3.2, GLM-5, GLM-4.5, GLM-4.7-Flash, Qwen3-Next, Qwen3.5[-MoE] and the
    Qwen3.5 wrappers have
    tables now (their checkpoints are no longer in _tableless_fixtures): ``--layout
    traced`` still plans them, vLLM's loaders fed the table's wire names (stacked
    ``experts.gate_up_proj.weight`` re-split per expert), and verifies every worker
    against vLLM's own load."""
    from _paths import ORACLE
    from m2nkit.engine.tools.cli import main

    # vLLM refuses expert parallelism for a model without experts (the dense Qwen3.5)
    inference = "vllm:tp=2" if model in ("tiny-qwen3.5", "tiny-qwen3.5-vl") else "vllm:tp=2,ep"
    capsys.readouterr()
    code = main(["plan", str(ORACLE / model / "checkpoint"), "--trainer", "fsdp:3",
                 "--inference", inference, "--layout", "traced", "--verify"])
    out, err = capsys.readouterr()
    assert code == 0, out[-3000:] + err[-3000:]
    assert "traced from vLLM's own weight loaders" in out
    assert "(ratio 1.000)" in out
    assert "verify: all 2 workers hold exactly what vLLM's own loaders would" in out
