"""Model families: the registry, the shard kinds, and one home per family.

* Registry: every supported architecture resolves to a module holding every
  piece of a family; an unsupported one gets the one message everywhere;
  importing the registry pulls in neither torch nor transformers.
* Shard kinds: for each kind, on small synthetic shapes and several
  tp/dp/ep, the boxes the planner binds and the vLLM-style reference load
  both equal what slicing the full tensor by hand gives (the expected values
  are written out here from docs/reference.md §3, not taken from the code under
  test); the real vLLM 0.33.0 dumps pin both again in test_vllm_oracle.py.
* A family's names live only in its module: the checkpoint reader, the
  tiny-model builder and the vLLM drivers mention none.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

from _paths import REPO
import pytest
import torch

from m2nkit.adapters.families import (
    ARCHITECTURES,
    TRACED_HINT,
    UnsupportedArchitecture,
    check_architecture,
    family,
    family_for,
    supported_architectures,
    unsupported_architecture,
)
from m2nkit.adapters.families.kinds import (
    COLUMN,
    EXPERT_BIAS_ONCE,
    EXPERT_ROWS,
    FUSED_QKV,
    KINDS,
    MERGED,
    QKV,
    REPLICATED,
    REPLICATED_MERGED,
    ROW,
    VOCAB,
    W2,
    W13,
    Geometry,
    Kind,
)
from m2nkit.adapters.families.sizes import Sizes
from m2nkit.adapters.families.table import Family, HFNaming, Param, TinyModel

#: Families whose vLLM model has no tied lm_head parameter (see their modules).
NEVER_TIED = ("GptOssForCausalLM", "Gemma2ForCausalLM", "Qwen3NextForCausalLM")
SUPPORTED = ["DeepseekV3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
             "GptOssForCausalLM", "LlamaForCausalLM", "MixtralForCausalLM", "Qwen2ForCausalLM",
             "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"]
SUPPORTED += ["Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration"]
SUPPORTED += ["KimiK25ForConditionalGeneration"]
SUPPORTED += ["DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM"]
SUPPORTED += ["Glm4MoeForCausalLM", "Glm4MoeLiteForCausalLM"]
SUPPORTED += ["Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"]
SUPPORTED += ["Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"]
SUPPORTED += ["Llama4ForCausalLM", "Llama4ForConditionalGeneration"]
SUPPORTED.sort()
#: Families without a tiny model m2nkit builds: transformers 5.12.1 has no class for
#: them (their tiny checkpoints are written by tests/data/oracle/regenerate.py).
NO_TINY = ("KimiK25ForConditionalGeneration",)
#: Families with Megatron-Core names (adapters/megatron/names.py).
WITH_MEGATRON_NAMES = ("LlamaForCausalLM", "MixtralForCausalLM", "Qwen2ForCausalLM",
                       "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM",
                       "Glm4MoeForCausalLM", "Glm4MoeLiteForCausalLM",
                       "Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration")
ONE_MESSAGE = ("architecture 'PhiForCausalLM' is not supported; supported: "
               f"{', '.join(SUPPORTED)}; an architecture without an m2nkit table is planned from "
               "vLLM's own weight loaders: --layout traced (needs vLLM installed)")


# --------------------------------------------------------------------------
# registry
# --------------------------------------------------------------------------

def test_supported_architectures():
    assert supported_architectures() == SUPPORTED
    assert sorted(ARCHITECTURES) == SUPPORTED


@pytest.mark.parametrize("arch", SUPPORTED)
def test_every_architecture_resolves_to_a_module_with_every_piece(arch):
    module = importlib.import_module(f"m2nkit.adapters.families.{ARCHITECTURES[arch]}")
    assert module.__doc__ and module.__doc__.strip()
    fam = family(arch)
    assert isinstance(fam, Family) and fam is module.FAMILY
    assert fam is family_for({"architectures": [arch]})
    assert module.ARCHITECTURE == fam.architecture == arch
    # on-disk and in-memory names, expert fusing
    assert isinstance(module.HF_NAMES, HFNaming) and fam.hf is module.HF_NAMES
    moe = any(p.kind in (W13, W2, EXPERT_ROWS, EXPERT_BIAS_ONCE) for p in fam.params)
    assert bool(fam.hf.fused_experts) == bool(fam.hf.experts_on_disk)
    # experts re-fused from per-expert tensors, or stored stacked in another dim order (GPT-OSS)
    assert moe == bool(fam.hf.fused_experts or fam.hf.permuted)
    # the vLLM table: shard kinds from kinds.py, conditions it names exist
    assert fam.params is module.VLLM_PARAMS and fam.params
    assert all(isinstance(p, Param) and p.kind in KINDS.values() for p in fam.params)
    assert fam.conditions is module.CONDITIONS
    assert {p.when for p in fam.params if p.when} <= set(fam.conditions)
    # tied embeddings are a condition of every family, except where vLLM never ties
    # (GPT-OSS, Qwen3-Next) or has no lm_head at all (Gemma 2: logits from embed_tokens)
    assert any(p.tied_to for p in fam.params) == (arch not in NEVER_TIED)
    # DeepSeek-V3 lives in vLLM's deepseek_v2.py (DeepseekV3ForCausalLM subclasses V2's)
    vllm_file = {"deepseek_v3": "deepseek_v2", "deepseek_v32": "deepseek_v2",
                 "glm_moe_dsa": "deepseek_v2",
                 "qwen3_5_moe": "qwen3_5", "qwen3_5_vl": "qwen3_5",
                 "qwen3_5_moe_vl": "qwen3_5", "llama4_vl": "mllama4"}.get(ARCHITECTURES[arch], ARCHITECTURES[arch])
    assert fam.vllm_source == f"vllm/model_executor/models/{vllm_file}.py"
    # tiny test models
    assert fam.tiny == module.TINY_MODELS and (bool(fam.tiny) != (arch in NO_TINY))
    assert all(name.startswith("tiny-") and isinstance(t, TinyModel)
               for name, t in fam.tiny.items())
    # trainer-side (Megatron-Core) names are the Megatron adapter's, one table per family
    # (m2nkit.adapters.megatron.names), filled for the families Megatron-Bridge builds
    # (tests/adapters/test_megatron_layout.py checks them); the family module holds none
    from m2nkit.adapters.megatron.names import megatron_names

    assert not hasattr(module, "MEGATRON_NAMES") and not hasattr(fam, "megatron_names")
    assert isinstance(megatron_names(fam), tuple)
    assert bool(megatron_names(fam)) == (arch in WITH_MEGATRON_NAMES)


def test_tiny_models_come_from_the_families():
    from m2nkit.adapters.tiny import BUILTIN_TINY_MODELS

    expected = {}
    for arch in ARCHITECTURES:
        for name, tiny in family(arch).tiny.items():
            expected[name] = (tiny.model_type, {"architectures": [arch], **tiny.config})
    assert BUILTIN_TINY_MODELS == expected
    assert list(BUILTIN_TINY_MODELS) == ["tiny-llama", "tiny-qwen2", "tiny-qwen3",
                                         "tiny-qwen3-tied", "tiny-qwen3-moe", "tiny-mixtral",
                                         "tiny-gpt-oss", "tiny-gemma2", "tiny-gemma3",
                                         "tiny-deepseek-v3", "tiny-deepseek-v3-fp8",
                                         "tiny-deepseek-v3-no-q-lora", "tiny-deepseek-v32",
                                         "tiny-glm-moe-dsa", "tiny-qwen3-vl",
                                         "tiny-qwen3-vl-moe", "tiny-glm4-moe",
                                         "tiny-glm4-moe-lite",
                                         "tiny-qwen3-next", "tiny-qwen3.5", "tiny-qwen3.5-moe",
                                         "tiny-qwen3.5-vl", "tiny-qwen3.5-moe-vl",
                                         "tiny-llama4", "tiny-llama4-vision"]


def test_unsupported_architecture_one_message_everywhere():
    from m2nkit.adapters.vllm import destination_layout, reference_load

    assert unsupported_architecture("PhiForCausalLM") == ONE_MESSAGE
    config = {"architectures": ["PhiForCausalLM"], "hidden_size": 8}
    for call in (lambda: check_architecture("PhiForCausalLM"),
                 lambda: family("PhiForCausalLM"),
                 lambda: family_for(config),
                 lambda: destination_layout(config, [], "vllm:tp=1"),
                 lambda: reference_load(config, {}, "vllm:tp=1", 0)):
        with pytest.raises(UnsupportedArchitecture) as e:
            call()
        assert str(e.value) == ONE_MESSAGE
    assert issubclass(UnsupportedArchitecture, ValueError)
    with pytest.raises(UnsupportedArchitecture, match="no 'architectures'.*LlamaForCausalLM, "):
        family_for({"hidden_size": 8})


def test_registry_imports_without_torch_or_transformers():
    code = (
        "import sys\n"
        "from m2nkit.adapters.families import check_architecture, supported_architectures\n"
        "from m2nkit.adapters.families.registry import unsupported_architecture\n"
        "assert check_architecture('Qwen3ForCausalLM') == 'Qwen3ForCausalLM'\n"
        "print(unsupported_architecture('X'))\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'numpy', 'safetensors') "
        "if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("architecture 'X' is not supported; supported: ")
    assert r.stdout.strip().endswith(", ".join(SUPPORTED) + "; " + TRACED_HINT)


# --------------------------------------------------------------------------
# shard kinds: bindings and reference load vs slicing by hand
# --------------------------------------------------------------------------

#: A small model: 4 query heads of 2 over 2 KV heads, vocab 70 (padded to
#: 128), 4 experts with Im = 4, H = 8, I = 8.
S = Sizes(H=8, V=70, nh=4, nkv=2, hd=2, I=8, Im=4, E=4, layers=1, tied=False,
          dtype=torch.float32,
          keys={"H": "hidden_size", "V": "vocab_size", "nh": "num_attention_heads",
                "nkv": "num_key_value_heads", "hd": "head_dim", "I": "intermediate_size",
                "Im": "moe_intermediate_size", "E": "num_experts"})
LAYOUTS = [(1, 1, False), (2, 1, False), (4, 1, False), (1, 2, False), (2, 2, False),
           (2, 1, True), (2, 2, True), (1, 4, True)]


def _wire(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(int(torch.tensor(shape).prod()), generator=g).float().reshape(shape)


def _expected(kind: Kind, wires: dict, tp: int, dp: int, ep: bool, worker: int) -> torch.Tensor:
    """What ``worker`` holds, by slicing the full tensors per docs/reference.md §3."""
    r, W = worker % tp, tp * dp
    if kind is REPLICATED:
        return wires[None]
    if kind is REPLICATED_MERGED:            # part 0 rows, then part 1 rows, not split
        return torch.cat(list(wires.values()))
    if kind is COLUMN:
        n = wires[None].shape[0] // tp
        return wires[None][r * n:(r + 1) * n]
    if kind is ROW:
        n = wires[None].shape[1] // tp
        return wires[None][:, r * n:(r + 1) * n]
    if kind is MERGED:
        n = wires[0].shape[0] // tp
        return torch.cat([wires[0][r * n:(r + 1) * n], wires[1][r * n:(r + 1) * n]])
    if kind is QKV:
        hd, nh, nkv = S.hd, S.nh, S.nkv
        q = wires["q"][r * (nh // tp) * hd:(r + 1) * (nh // tp) * hd]
        if tp >= nkv:
            head = r // (tp // nkv)
            k, v = (wires[p][head * hd:(head + 1) * hd] for p in "kv")
        else:
            per = nkv // tp
            k, v = (wires[p][r * per * hd:(r + 1) * per * hd] for p in "kv")
        return torch.cat([q, k, v])
    if kind is FUSED_QKV:                    # one [3*nh*hd, ...] tensor: rank r's heads of each third
        third = wires[None].shape[0] // 3
        n = third // tp
        return torch.cat([wires[None][j * third + r * n:j * third + (r + 1) * n] for j in range(3)])
    if kind is VOCAB:
        per = 128 // tp                      # 70 padded to 128
        lo, hi = min(r * per, 70), min((r + 1) * per, 70)
        return torch.cat([wires[None][lo:hi], torch.zeros(per - (hi - lo), S.H)])
    w = wires[None]
    if ep and W > 1:                         # whole experts, contiguous per worker
        e = S.E // W
        return w[worker * e:(worker + 1) * e]
    n = S.Im // W                            # every expert, moe rank = worker
    if kind is EXPERT_ROWS:                  # gate/up rows interleaved: one run per moe rank
        return w[:, 2 * worker * n:2 * (worker + 1) * n]
    if kind is EXPERT_BIAS_ONCE:             # added once: worker 0 holds it, the others zeros
        return w if worker == 0 else torch.zeros_like(w)
    if kind is W13:
        return torch.cat([w[:, worker * n:(worker + 1) * n],
                          w[:, S.Im + worker * n:S.Im + (worker + 1) * n]], dim=1)
    return w[:, :, worker * n:(worker + 1) * n]


CASES = {
    "replicated": (REPLICATED, ("H",), {None: (8,)}),
    "column": (COLUMN, ("I", "H"), {None: (8, 8)}),
    "row": (ROW, ("H", "I"), {None: (8, 8)}),
    "merged": (MERGED, ("I", "H"), {0: (8, 8), 1: (8, 8)}),
    "qkv": (QKV, ("H",), {"q": (8, 8), "k": (4, 8), "v": (4, 8)}),
    "qkv_bias": (QKV, (), {"q": (8,), "k": (4,), "v": (4,)}),
    "vocab": (VOCAB, ("V", "H"), {None: (70, 8)}),
    "w13": (W13, ("E", "2*Im", "H"), {None: (4, 8, 8)}),
    "w2": (W2, ("E", "H", "Im"), {None: (4, 8, 4)}),
    # parts of 4 and 8 rows (symbols Im, I) over 12 = 3*Im rows, whole on every worker
    "replicated_merged": (REPLICATED_MERGED, ("3*Im", "H"), {("Im",): (4, 8), ("Im", "I"): (8, 8)}),
    "expert_rows": (EXPERT_ROWS, ("E", "2*Im", "H"), {None: (4, 8, 8)}),
    "expert_rows_bias": (EXPERT_ROWS, ("E", "2*Im"), {None: (4, 8)}),
    "expert_bias_once": (EXPERT_BIAS_ONCE, ("E", "H"), {None: (4, 8)}),
}
#: A vision tower's fused attn.qkv (4 heads of 2, as many KV heads): weight and bias.
CASES["fused_qkv"] = (FUSED_QKV, ("nh", "hd", "H"), {None: (24, 8)})
CASES["fused_qkv_bias"] = (FUSED_QKV, ("nh", "hd"), {None: (24,)})


@pytest.mark.parametrize("tp,dp,ep", LAYOUTS)
@pytest.mark.parametrize("case", list(CASES))
def test_kind_bindings_and_load_equal_slicing_by_hand(case, tp, dp, ep):
    kind, syms, parts = CASES[case]
    if kind in (QKV, FUSED_QKV) and tp > S.nh:
        pytest.skip("more ranks than heads")
    assert kind.violation("p", syms, S, tp, dp, ep) is None
    wires = {part: _wire(*shape, seed=i) for i, (part, shape) in enumerate(parts.items())}
    for part, t in wires.items():
        assert kind.wire_shape(S.resolve(syms), part, S) == tuple(t.shape)
    for worker in range(tp * dp):
        g = Geometry.of(S, tp, dp, ep, worker)
        shape = kind.local_shape(S.resolve(syms), len(parts), g)
        expected = _expected(kind, wires, tp, dp, ep, worker)
        assert shape == tuple(expected.shape), (case, worker)
        # bindings: every local element written exactly once, from the right box
        bound = torch.full(shape, float("nan"))
        count = torch.zeros(shape, dtype=torch.int32)
        for part, t in wires.items():
            for box, offset in kind.boxes(tuple(t.shape), part, g):
                dst = tuple(slice(o, o + b - a) for o, (a, b) in zip(offset, box))
                bound[dst] = t[tuple(slice(a, b) for a, b in box)]
                count[dst] += 1
        for box in kind.zero_boxes(shape, g):
            dst = tuple(slice(a, b) for a, b in box)
            bound[dst] = 0
            count[dst] += 1
        assert (count == 1).all(), (case, worker, count)
        assert torch.equal(bound, expected), (case, worker)
        # reference load, vLLM style
        loaded = torch.full(shape, float("nan"))
        for part, t in wires.items():
            kind.load(loaded, t, part, g)
        assert torch.equal(loaded, expected), (case, worker)


@pytest.mark.parametrize("kind,syms,sizes,tp,dp,ep,message", [
    (COLUMN, ("I", "H"), {}, 3, 1, False, "p: intermediate_size=8 is not divisible by tp=3"),
    (MERGED, ("I", "H"), {}, 16, 1, False, "p: intermediate_size=8 is not divisible by tp=16"),
    (ROW, ("H", "nh*hd"), {"nh": 3, "hd": 2}, 4, 1, False,
     "p: num_attention_heads*head_dim=6 is not divisible by tp=4"),
    (QKV, ("H",), {}, 3, 1, False, "p: num_attention_heads=4 is not divisible by tp=3"),
    (FUSED_QKV, ("nh", "hd", "H"), {}, 8, 1, False,
     "p: num_attention_heads=4 heads are not divisible by tp=8"),
    (QKV, ("H",), {"nh": 6, "nkv": 4}, 6, 1, False,
     "p: tp=6 >= num_key_value_heads=4 must be a multiple of it (each rank holds one "
     "replicated KV head)"),
    (QKV, ("H",), {"nh": 8, "nkv": 6}, 4, 1, False,
     "p: num_key_value_heads=6 is not divisible by tp=4"),
    (VOCAB, ("V", "H"), {}, 3, 1, False,
     "p: vocab_size=70 padded to 128 (a multiple of 64) is not divisible by tp=3"),
    (W13, ("E", "2*Im", "H"), {}, 1, 8, False,
     "p: moe_intermediate_size=4 is not divisible by the MoE tensor-parallel size dp*tp=8"),
    # vLLM accepts any expert count with EP (the remainder goes to the first ranks)
    (W2, ("E", "H", "Im"), {}, 3, 1, True, None),
    (W13, ("E", "2*Im", "H"), {"E": 3}, 2, 4, True, None),
])
def test_kind_divisibility_messages(kind, syms, sizes, tp, dp, ep, message):
    from dataclasses import replace

    assert kind.violation("p", syms, replace(S, **sizes), tp, dp, ep) == message
    assert REPLICATED.violation("p", ("H",), S, 7, 3, True) is None


#: (E, ep, placement) -> the experts of each EP rank, written out by hand from
#: vLLM 0.33.0 ``determine_expert_map`` (E // ep each, one more on the first
#: E % ep ranks; linear runs, or rank r, r+ep, ...). The oracle dumps pin the
#: same lists again (test_vllm_oracle.py).
EXPERTS_BY_RANK = {
    (10, 4, "linear"): [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]],
    (10, 4, "round_robin"): [[0, 4, 8], [1, 5, 9], [2, 6], [3, 7]],
    (6, 8, "linear"): [[0], [1], [2], [3], [4], [5], [], []],
    (6, 8, "round_robin"): [[0], [1], [2], [3], [4], [5], [], []],
    (8, 2, "round_robin"): [[0, 2, 4, 6], [1, 3, 5, 7]],
    (4, 2, "linear"): [[0, 1], [2, 3]],
}


@pytest.mark.parametrize("E,ep,placement", list(EXPERTS_BY_RANK))
@pytest.mark.parametrize("kind", [W13, W2], ids=["w13", "w2"])
def test_expert_parallel_bindings_uneven_and_round_robin(kind, E, ep, placement):
    from dataclasses import replace

    s = replace(S, E=E)
    syms = ("E", "2*Im", "H") if kind is W13 else ("E", "H", "Im")
    wire = _wire(*s.resolve(syms))
    assert kind.violation("p", syms, s, ep, 1, True) is None
    for worker, ids in enumerate(EXPERTS_BY_RANK[E, ep, placement]):
        g = Geometry.of(s, ep, 1, True, worker, placement)
        assert list(g.experts) == ids
        expected = wire[ids]                          # whole experts, in local order
        shape = kind.local_shape(s.resolve(syms), 1, g)
        assert shape == tuple(expected.shape)
        bound = torch.full(shape, float("nan"))
        count = torch.zeros(shape, dtype=torch.int32)
        for box, offset in kind.boxes(tuple(wire.shape), None, g):
            dst = tuple(slice(o, o + b - a) for o, (a, b) in zip(offset, box))
            bound[dst] = wire[tuple(slice(a, b) for a, b in box)]
            count[dst] += 1
        assert (count == 1).all() and torch.equal(bound, expected), (worker, ids)
        loaded = torch.full(shape, float("nan"))
        kind.load(loaded, wire, None, g)
        assert torch.equal(loaded, expected), (worker, ids)
        # one box per run of consecutive experts: 1 for linear, 1 per expert for round robin
        runs = 0 if not ids else (1 if placement == "linear" or len(ids) == 1 else len(ids))
        assert len(kind.boxes(tuple(wire.shape), None, g)) == runs


def test_geometry_e_first_refuses_round_robin():
    from dataclasses import replace

    g = Geometry.of(replace(S, E=8), 2, 1, True, 1, "round_robin")
    assert g.e_local == 4 and g.expert_runs == ((1, 2, 0), (3, 4, 1), (5, 6, 2), (7, 8, 3))
    with pytest.raises(ValueError, match=r"worker 1 holds experts \[1, 3, 5, 7\] \(round-robin"):
        g.e_first
    assert Geometry.of(replace(S, E=10), 4, 1, True, 2).e_first == 6


def test_kinds_cite_their_vllm_source():
    for kind in KINDS.values():
        assert kind.source.startswith("vllm "), kind
        assert "vLLM" in type(kind).__doc__ or "vllm" in type(kind).__doc__, kind
    assert W13.rule_key(("E", "2*Im", "H")) == W2.rule_key(("E", "H", "Im"))


def test_param_rejects_a_kind_that_is_not_a_shard_kind():
    with pytest.raises(ValueError, match=r"kind 'column' is not a shard kind; valid kinds: "
                                         r"replicated, column, row"):
        Param("x.weight", "column", ("H",))


def test_family_rejects_an_unknown_condition():
    p = Param("x.weight", REPLICATED, ("H",), when="nope")
    with pytest.raises(ValueError, match=r"uses condition 'nope', which is not one of \[\]"):
        Family("XForCausalLM", HFNaming(), (p,), lambda c: S)


def test_hf_naming_needs_a_disk_pattern_per_fused_part():
    with pytest.raises(ValueError, match=r"parts \['down', 'gate', 'up'\] have no on-disk"):
        HFNaming(fused_experts={"experts.gate_up_proj": ("experts.gate_up_proj.weight",
                                                         ("gate", "up")),
                                "experts.down_proj": ("experts.down_proj.weight", ("down",))})


# --------------------------------------------------------------------------
# one home per family
# --------------------------------------------------------------------------

#: Names that belong to one family or a few: architecture classes, family
#: names (all nine: Llama, Qwen2, Qwen3, Qwen3-MoE, Mixtral, GPT-OSS, Gemma 2,
#: Gemma 3, DeepSeek-V3), on-disk/vLLM tensor name pieces, family-specific
#: config keys.
FAMILY_NAMES = re.compile(  # (transformers' AutoModelForCausalLM is generic)
    r"(?<!AutoModel)ForCausalLM|llama|qwen|mixtral|deepseek|gemma|gpt[_-]?oss|"
    r"block_sparse_moe|q_norm|k_norm|self_attn|"
    r"gate_proj|qkv_proj|o_proj|embed_tokens|layernorm|\.w[123]\.|mlp_only_layers|"
    r"decoder_sparse_step|num_local_experts|shared_expert",
    re.IGNORECASE,
)
#: The one line allowed a family's name: vLLM's own list of model types it refuses
#: float16 for (vllm/config/model.py ``_FLOAT16_NOT_SUPPORTED_MODELS``), a vLLM rule
#: keyed by model_type that names types m2nkit has no family for (glm4).
FAMILY_NAMES_ALLOWED = {("dtype.py", "FLOAT16_NOT_SUPPORTED = frozenset(")}


def _family_free_files():
    """The modules that take every family from its module: checkpoint reader, config-only
    wires, FSDP2 source, wrapper names, the table expander, vLLM's name table, the vLLM side."""
    adapters = REPO / "adapters"
    return [*sorted((adapters / "hf_checkpoint").glob("*.py")), adapters / "config_wires.py",
            *sorted((adapters / "fsdp2").glob("*.py")), adapters / "module_names.py",
            adapters / "families" / "expand.py", adapters / "families" / "vllm_names.py",
            *sorted((adapters / "vllm").glob("*.py"))]


@pytest.mark.parametrize("path", _family_free_files(),
                         ids=lambda p: str(p.relative_to(REPO / "adapters")))
def test_no_family_names_outside_the_family_modules(path):
    hits = [f"{path.name}:{i}: {line.strip()}"
            for i, line in enumerate(path.read_text().splitlines(), 1)
            if FAMILY_NAMES.search(line)
            and not any(path.name == f and line.startswith(s) for f, s in FAMILY_NAMES_ALLOWED)]
    assert not hits, "family-specific names belong in adapters/families/<family>.py:\n" + \
        "\n".join(hits)


def test_tiny_builder_holds_no_family_table():
    text = (REPO / "adapters" / "tiny.py").read_text()
    # shared size keys (num_local_experts, ...) are config keys, not a family table
    hits = re.findall(r"(?<!AutoModel)ForCausalLM|\"(?:llama|qwen\w*|mixtral|gpt_oss|gemma\w*|"
                      r"deepseek\w*)\"|tiny-\w+", text, re.IGNORECASE)
    assert not hits, hits


def test_the_family_name_clash_is_gone():
    import m2nkit.adapters.hf_checkpoint as hf
    import m2nkit.adapters.vllm as vllm

    for module in (hf, vllm):
        assert not hasattr(module, "FAMILIES"), module
        assert not hasattr(module, "FamilyNaming"), module
    assert not hasattr(hf, "FUSED_EXPERTS")


def test_tiny_model_names_without_torch_match_the_families():
    """The command line checks --model against TINY_MODEL_ARCHITECTURES (plain strings,
    no torch); it must list exactly the families' tiny models."""
    from m2nkit.adapters.families import TINY_MODEL_ARCHITECTURES
    from m2nkit.adapters.tiny import BUILTIN_TINY_MODELS

    assert TINY_MODEL_ARCHITECTURES == {
        name: extra["architectures"][0] for name, (_, extra) in BUILTIN_TINY_MODELS.items()}
