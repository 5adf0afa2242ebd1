"""m2nkit's SGLang layout equals SGLang 0.5.23's own loading, bit for bit.

The reference is SGLang itself: ``sglang_oracle.py`` runs under
``.venv-sglang`` (``scripts/setup.sh``; SGLang's stack cannot share .venv, see
``docs/sglang.md``) and builds SGLang's real model classes at tp 2 and 4 over
real gloo groups (SGLang's own parallel state), runs SGLang's own
``load_weights`` on the tiny ``save_pretrained`` checkpoints of
``tests/data/oracle`` and dumps every rank's parameters (NaN where SGLang
wrote nothing). Each worker filled through the bindings of
``sglang_destination_layout`` from the same checkpoint must equal that dump:
names, shapes, dtypes, aliases and every byte.

Covered: Qwen3 dense (8 query / 2 KV heads: KV heads < tp at tp 4, replicated
by SGLang's ``QKVParallelLinear``), the tied Qwen3 (``lm_head`` an alias of
the embedding), Qwen3-MoE with EP (tp 2 and 4) and with tensor-sharded
experts (tp 2), DeepSeek-V3 (MLA with q_lora; 8 experts in 2 groups, a shared
expert, a dense first layer) at tp 2 with and without EP, and Llama, Qwen2 and
Mixtral (EP or not) at tp 2.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from _oracle import DATA, _model, _oracle, assert_layout_equals_dumps
from _paths import REPO

pytestmark = pytest.mark.integration

PYTHON = REPO / ".venv-sglang" / "bin" / "python"
ORACLE_SCRIPT = REPO / "tests" / "integration" / "sglang_oracle.py"

#: (tp, ep) -> the tests/data/oracle models SGLang loads in that layout (one run each)
RUNS = {
    (2, False): ("tiny-qwen3", "tiny-qwen3-tied", "tiny-qwen3-moe", "tiny-deepseek-v3",
                 "tiny-llama", "tiny-qwen2", "tiny-mixtral"),
    (2, True): ("tiny-qwen3-moe", "tiny-deepseek-v3", "tiny-mixtral"),
    (4, False): ("tiny-qwen3", "tiny-qwen3-tied"),
    (4, True): ("tiny-qwen3-moe",),
}
CASES = [pytest.param(m, tp, ep, id=f"{m}-tp{tp}" + ("-ep" if ep else ""))
         for (tp, ep), models in RUNS.items() for m in models]


#: (tp, ep) -> the folder SGLang's dumps of that run went to
_DONE: dict = {}


#: Config keys SGLang 0.5.23 reads on CPU that the tiny DeepSeek-V3 config lacks (the real
#: DeepSeek-V3 config.json has both; neither changes a weight): its CPU rotary embedding
#: asserts a ``rope_scaling`` (``layers/rotary_embedding/factory.py`` ``get_rope_cpu``), and
#: ``models/deepseek_v2.py`` ``DeepseekV2DecoderLayer`` reads ``moe_layer_freq``.
DEEPSEEK_CPU_KEYS = {
    "rope_scaling": {"type": "yarn", "rope_type": "yarn", "factor": 4.0,
                     "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
                     "mscale": 1.0, "mscale_all_dim": 1.0},
    "moe_layer_freq": 1,
}


def _checkpoint(model: str, root) -> str:
    """The checkpoint SGLang loads for ``model``: tests/data/oracle's, the same weights."""
    src = DATA / model / "checkpoint"
    if model != "tiny-deepseek-v3":
        return str(src)
    out = root / "checkpoints" / model
    if not out.exists():
        out.mkdir(parents=True)
        config = json.loads((src / "config.json").read_text())
        config.update(DEEPSEEK_CPU_KEYS)
        config["rope_parameters"] = {**config.get("rope_parameters", {}),
                                     **DEEPSEEK_CPU_KEYS["rope_scaling"]}
        (out / "config.json").write_text(json.dumps(config))
        (out / "model.safetensors").symlink_to(src / "model.safetensors")
    return str(out)


@pytest.fixture(scope="module")
def dump_root(tmp_path_factory):
    if not PYTHON.exists():
        pytest.fail(f"{PYTHON} is missing: scripts/setup.sh installs SGLang's stack there "
                    "(scripts/side_sglang.sh)")
    return tmp_path_factory.mktemp("sglang_dumps")


def sglang_dumps(root, tp: int, ep: bool):
    """Run SGLang's loaders for every model of ``RUNS[(tp, ep)]`` once; the dumps' folder.

    One run is one ``sglang_oracle.py`` process and its ``tp`` spawned ranks
    (about 25 s on an idle 2-core machine, mostly importing SGLang); its
    deadline kills it, and a failure shows SGLang's stderr.
    """
    if (tp, ep) not in _DONE:
        cmd = [str(PYTHON), str(ORACLE_SCRIPT), "--tp", str(tp), *(["--ep"] if ep else []),
               "--out", str(root), *(f"{m}={_checkpoint(m, root)}" for m in RUNS[(tp, ep)])]
        r = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": ""}, capture_output=True,
                           text=True, timeout=400)
        assert r.returncode == 0, f"SGLang's loaders failed (tp={tp} ep={ep}):\n{r.stderr[-4000:]}"
        _DONE[(tp, ep)] = root
    return _DONE[(tp, ep)]


def _metas(wire):
    from m2nkit.manifest import ParamMeta

    return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in wire.items()]


@pytest.mark.timeout(480)
@pytest.mark.parametrize("model,tp,ep", CASES)
def test_layout_equals_sglang_loaders(dump_root, model, tp, ep):
    from m2nkit.adapters.sglang import SGLangSpec, sglang_destination_layout

    config, _, wire = _model(model)
    root = sglang_dumps(dump_root, tp, ep)
    _, meta = _oracle(model, tp, ep, 0, root=root)
    assert meta["sglang_version"] == "0.5.23" and int(meta["tp_size"]) == tp
    assert int(meta["ep_size"]) == (tp if ep else 1)
    layout = sglang_destination_layout(config, _metas(wire), SGLangSpec(tp, 1, ep))
    assert layout.spec == f"sglang:tp={tp},dp=1" + (",ep" if ep else "")
    assert not layout.unknown
    assert_layout_equals_dumps(layout, wire, model, tp, ep, "linear", "auto", "SGLang ",
                               root=root)


@pytest.mark.timeout(480)
def test_sglang_moe_names_differ_from_vllm(dump_root):
    """The one naming rule (``rules.NAMES``) is needed: SGLang's and vLLM's expert names differ."""
    sglang, meta = _oracle("tiny-qwen3-moe", 2, True, 0, root=sglang_dumps(dump_root, 2, True))
    vllm, _ = _oracle("tiny-qwen3-moe", 2, True, 0)
    prefix = "model.layers.0.mlp.experts."
    assert {prefix + "w13_weight", prefix + "w2_weight"} <= set(sglang)
    assert prefix + "routed_experts.w13_weight" in vllm and prefix + "gate.weight" in vllm
    assert not any(n.startswith(prefix + "routed_experts") or n == prefix + "gate.weight"
                   for n in sglang)
    assert json.loads(meta["aliases"]) == {}
