"""Config-only wire tensors from the family tables, checked against transformers.

A config-only checkpoint (a bare ``config.json``) lists its wire tensors from
the family table (``m2nkit.adapters.config_wires``) without importing
transformers. The reference is what it replaced: transformers' model built on
the meta device (``read_checkpoint(..., via_transformers=True)``). They must
give the same names, shapes and order, and the same dtypes except where
transformers allocates a tensor in another dtype than published checkpoints
store it (:data:`TRANSFORMERS_DTYPES`), for every family's tiny models, every
real config in ``examples/configs`` and the config variants that switch
tensors on and off. The config itself is read from ``config.json`` with each
family's declared transformers defaults; those are checked key by key against
transformers' config classes.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from _paths import REPO
import pytest
import torch

from m2nkit.adapters.config_wires import ConfigJson, read_config_json, table_wires
from m2nkit.adapters.families import ARCHITECTURES, family, has_table
from m2nkit.adapters.hf_checkpoint import checkpoint_metas, read_checkpoint
from m2nkit.adapters.tiny import BUILTIN_TINY_MODELS, tiny_config
from m2nkit.adapters.vllm import destination_layout
from m2nkit.adapters.vllm.dtype import config_dtype
from m2nkit.manifest import ParamMeta

CONFIGS = REPO / "examples" / "configs"
#: The real configs of architectures with a table (the others have no table to check:
#: tests/integration/test_traced_plans.py plans them from transformers and vLLM).
REAL = sorted(p.name for p in CONFIGS.iterdir() if (p / "config.json").is_file()
              and has_table(json.loads((p / "config.json").read_text())["architectures"][0]))
#: Kimi-K2.5: transformers 5.12.1 has no class to compare with, and the published
#: config is int4 (refused); tests/adapters/test_kimi_k25.py plans its bf16 form.
REAL.remove("moonshotai__Kimi-K2.5")

#: Where transformers' in-memory dtype is not what published checkpoints store:
#: architecture -> (wire name regex, transformers' dtype). DeepSeek-V3's router
#: ``DeepseekV3TopkRouter.weight`` is allocated float32 by transformers 5; the
#: published DeepSeek-V3 / Kimi-K2 checkpoints hold it in the model dtype (their
#: reference ``inference/model.py`` ``Gate.weight`` takes the default bf16; it is
#: not a quantized linear) and vLLM allocates it in the model dtype (``GateLinear``).
#: transformers 5.12 (the version Megatron-Bridge pins, installed by
#: scripts/setup.sh) allocates it in the model dtype like the checkpoints;
#: later 5.x (5.24 checked) in float32. Either is accepted for these names.
#: The same holds the other way for ``e_score_correction_bias``: checkpoints keep it
#: float32 (the table's dtype); transformers 5.12 allocates it in the model dtype.
#: The DSA indexer's ``k_norm`` (DeepSeek-V3.2, GLM-5): float32 in vLLM (``Indexer``:
#: ``LayerNorm(..., dtype=torch.float32)``) and in DeepSeek's reference model
#: (``inference/model.py`` ``LayerNorm``), the table's wire dtype; transformers 5.12
#: allocates its ``nn.LayerNorm`` in the model dtype.
_K_NORM = (re.compile(r"\.self_attn\.indexer\.k_norm\.(weight|bias)$"), None)
TRANSFORMERS_DTYPES = {
    "DeepseekV3ForCausalLM": [(re.compile(r"\.mlp\.gate\.weight$"), torch.float32),
                              (re.compile(r"\.mlp\.gate\.e_score_correction_bias$"), None)],
    "DeepseekV32ForCausalLM": [(re.compile(r"\.mlp\.gate\.weight$"), torch.float32),
                               (re.compile(r"\.mlp\.gate\.e_score_correction_bias$"), None),
                               _K_NORM],
    "GlmMoeDsaForCausalLM": [(re.compile(r"\.mlp\.gate\.weight$"), torch.float32),
                             (re.compile(r"\.mlp\.gate\.e_score_correction_bias$"), None),
                             _K_NORM],
    # transformers 5.24's Glm4MoeTopkRouter allocates its weight float32 (5.12.1: the
    # model dtype); vLLM's is float32 too, the checkpoints' the model dtype (the wire's)
    "Glm4MoeForCausalLM": [(re.compile(r"\.mlp\.gate\.weight$"), torch.float32)],
    "Glm4MoeLiteForCausalLM": [(re.compile(r"\.mlp\.gate\.weight$"), torch.float32)],
}

#: Keys whose default exists only in some transformers 5.x: with 5.12 a
#: DeepseekV3Config without ``num_nextn_predict_layers`` has no such attribute
#: (5.24 defaults it to 1, which DeepSeek-V3's table follows); GLM-4.5's table
#: follows 5.12 (none: no MTP layer), the transformers vLLM runs under here;
#: published configs set it.
VERSION_DEFAULTS = {"num_nextn_predict_layers"}

#: Config variants that switch tensors on and off: tiny model -> keys to set.
#: Those marked ``differs`` are configs whose tensors the table does not
#: describe exactly (``HFNaming.table_differs``): read through transformers.
VARIANTS = [
    ("tiny-llama", {"attention_bias": True, "mlp_bias": True}, False),
    ("tiny-llama", {"mlp_bias": True}, False),
    ("tiny-llama", {"qkv_bias": True}, True),
    ("tiny-qwen3", {"attention_bias": True}, True),
    ("tiny-qwen3-moe", {"mlp_only_layers": [0]}, False),
    ("tiny-qwen3-moe", {"decoder_sparse_step": 2}, False),
    ("tiny-gemma2", {"attention_bias": True}, False),
    ("tiny-gemma3", {"tie_word_embeddings": False}, False),
    ("tiny-mixtral", {"tie_word_embeddings": True}, False),
    ("tiny-deepseek-v3", {"first_k_dense_replace": 0, "num_hidden_layers": 3}, False),
    ("tiny-deepseek-v3", {"n_shared_experts": 2, "num_nextn_predict_layers": 2}, False),
    ("tiny-deepseek-v3", {"topk_method": "greedy"}, True),
    ("tiny-deepseek-v3-fp8", {"num_nextn_predict_layers": 0}, False),
]
VARIANTS += [
    ("tiny-glm4-moe", {"attention_bias": False, "use_qk_norm": False}, False),
    ("tiny-glm4-moe", {"first_k_dense_replace": 0, "num_nextn_predict_layers": 1}, False),
    ("tiny-glm4-moe-lite", {"q_lora_rank": None}, False),
    ("tiny-glm4-moe-lite", {"num_hidden_layers": 3, "mlp_layer_types": None,
                            "num_nextn_predict_layers": 1}, False),
    ("tiny-glm4-moe-lite", {"mlp_layer_types": ["sparse", "sparse"]}, True),
]
# Gated DeltaNet (families/qwen3_next.py, qwen3_5.py, qwen3_5_moe.py): which layers are
# MoE, which linear attention (layer_types, else full_attention_interval), tied heads
VARIANTS += [
    ("tiny-qwen3-next", {"mlp_only_layers": []}, False),
    ("tiny-qwen3-next", {"mlp_only_layers": [], "decoder_sparse_step": 2}, False),
    ("tiny-qwen3.5", {"layer_types": ["full_attention", "linear_attention"]}, False),
    ("tiny-qwen3.5-moe", {"layer_types": None, "num_hidden_layers": 4,
                          "full_attention_interval": 2}, False),
    ("tiny-qwen3.5-moe", {"tie_word_embeddings": True}, False),
]
# Llama-4 (families/llama4.py): every layer MoE (Scout), tied; transformers' moe_layers
# against vLLM's interleave_moe_layer_step rule (layer 0 MoE for transformers, 1 for vLLM)
VARIANTS += [
    ("tiny-llama4", {"interleave_moe_layer_step": 1, "moe_layers": [0, 1]}, False),
    ("tiny-llama4", {"tie_word_embeddings": True}, False),
    ("tiny-llama4", {"moe_layers": [0]}, True),
]


def _listing(ckpt) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    return [(p.name, tuple(p.shape), p.dtype) for p in ckpt.params]


def _as_transformers_allocates(ckpt, ref) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """The listing with transformers' dtype where transformers may allocate another one
    (``TRANSFORMERS_DTYPES``) and ``ref`` (the listing through transformers) has it; not
    in layers vLLM skips, which both paths list from the table: transformers builds no
    MTP layer."""
    rules = TRANSFORMERS_DTYPES.get(ckpt.architecture, [])
    skip = family(ckpt.architecture).skip or (lambda config, name: None)
    theirs = {n: d for n, _, d in ref}

    def dtype(n, d):
        for pattern, allowed in rules:
            if pattern.search(n) and not skip(ckpt.config, n) and theirs.get(n) in (
                    allowed, config_dtype(ckpt.config)):
                return theirs[n]
        return d

    return [(n, s, dtype(n, d)) for n, s, d in _listing(ckpt)]


def _json(value):
    """``value`` as ``config.json`` holds it (a tuple default is a JSON list)."""
    return json.loads(json.dumps(value))


def _tiny_config_json(tmp_path: Path, name: str, **overrides) -> Path:
    d = tmp_path / name
    tiny_config(name).save_pretrained(d)
    if overrides:
        data = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**data, **overrides}))
    return d / "config.json"


def _check_same(config: Path, *, from_table: bool = True) -> None:
    fast = read_checkpoint(config)
    ref = read_checkpoint(config, via_transformers=True)
    assert isinstance(fast.config, ConfigJson) == from_table, type(fast.config)
    assert not isinstance(ref.config, ConfigJson)
    want = _listing(ref)
    got = _as_transformers_allocates(fast, want)
    assert [n for n, _, _ in got] == [n for n, _, _ in want]
    assert got == want


@pytest.mark.parametrize("name", sorted(BUILTIN_TINY_MODELS))
def test_table_lists_the_meta_models_tensors_for_every_tiny_model(tmp_path, name):
    _check_same(_tiny_config_json(tmp_path, name))


@pytest.mark.parametrize("name", REAL)
def test_table_lists_the_meta_models_tensors_for_every_real_config(name):
    _check_same(CONFIGS / name / "config.json")


@pytest.mark.parametrize("name,keys,differs", VARIANTS,
                         ids=[f"{n}-{'-'.join(k)}" for n, k, _ in VARIANTS])
def test_table_lists_the_meta_models_tensors_for_config_variants(tmp_path, name, keys, differs):
    _check_same(_tiny_config_json(tmp_path, name, **keys), from_table=not differs)


def test_a_config_the_table_does_not_describe_goes_through_transformers(tmp_path):
    """Qwen3 with ``attention_bias``: transformers has ``o_proj`` biases vLLM's Qwen3 lacks;
    the plan must show them (no vLLM parameter takes them), as before."""
    ckpt = read_checkpoint(_tiny_config_json(tmp_path, "tiny-qwen3", attention_bias=True))
    assert "model.layers.0.self_attn.o_proj.bias" in ckpt.names
    layout = destination_layout(ckpt.config, checkpoint_metas(ckpt, "fsdp:2"), "vllm:tp=2")
    assert "model.layers.0.self_attn.o_proj.bias" in layout.unknown


def test_a_model_type_the_family_does_not_declare_is_refused_as_before(tmp_path):
    config = _tiny_config_json(tmp_path, "tiny-llama")
    data = json.loads(config.read_text())
    config.write_text(json.dumps({**data, "model_type": "mistral"}))
    with pytest.raises(Exception, match="LlamaForCausalLM but model_type 'mistral'"):
        read_checkpoint(config)


# --------------------------------------------------------------------------
# config.json read as transformers' config classes read it


class _Recording(ConfigJson):
    """A ``ConfigJson`` that records every key read from it; a sub-config read from it
    (a wrapper's ``text_config``) records its keys as ``text_config.<key>``."""

    keys: set[str] = set()
    prefix = ""

    def _seen(self, key, value):
        if isinstance(value, ConfigJson):       # a sub-config: its own keys are compared
            sub = _Recording(value)
            sub.prefix = f"{self.prefix}{key}."
            return sub
        _Recording.keys.add(self.prefix + key)
        return value

    def get(self, key, default=None):
        return self._seen(key, super().get(key, default))

    def __getitem__(self, key):
        return self._seen(key, super().__getitem__(key))

    def __getattr__(self, key):
        return self._seen(key, super().__getattr__(key))


def _at(config, key: str):
    """Dotted ``key`` (``text_config.hidden_size``) of a config object or ``ConfigJson``."""
    for part in key.split("."):
        config = (config.get(part) if isinstance(config, dict) else getattr(config, part, None))
    return config


def _keys_read(config: ConfigJson) -> set[str]:
    """Every key planning ``config`` reads: its wire tensors, the vLLM layout, the TP plan."""
    _Recording.keys = set()
    rec = _Recording(config)
    fam = family(rec["architectures"][0])
    metas = [ParamMeta(w.name, w.dtype, w.shape) for w in table_wires(fam, rec)]
    destination_layout(rec, metas, "vllm:tp=1")
    if fam.tp_plan is not None:
        fam.tp_plan.styles(rec)
    if fam.skipped_layers is not None:
        fam.skipped_layers.layers(rec)
    return {k for k in _Recording.keys if k.rsplit(".", 1)[-1] not in {
        "architectures", "model_type", "text_config", "dtype", "torch_dtype"}}


def _model_types():
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    out = []
    for arch in ARCHITECTURES:
        hf = family(arch).hf
        out += [(arch, t) for t in hf.model_types]
        out += [(arch, alias) for alias, t in hf.config_classes.items() if t in hf.model_types]
    # kimi_k25: transformers 5.12.1 has no config class to compare with (its text_config
    # is DeepSeek-V3's, compared above; its vision defaults, transformers 5.24's, are
    # pinned to the published sizes in test_kimi_k25.py)
    return [(a, t) for a, t in out if t in CONFIG_MAPPING]


#: Keys vLLM reads that transformers' config class of the model type lacks (published
#: configs carry them; the table refuses a config without, as vLLM fails on it):
#: GLM-4.5's ``head_dim`` (``Glm4MoeDecoderLayer``), GLM-4.7-Flash's
#: ``first_k_dense_replace`` (``Glm4MoeLiteDecoderLayer``).
VLLM_REQUIRES = {"glm4_moe": {"head_dim": 128}, "glm4_moe_lite": {"first_k_dense_replace": 1}}


def _accepts(cls, key, value) -> bool:
    try:
        cls(**{key: value})
    except Exception:  # huggingface_hub's StrictDataclassFieldValidationError
        return False
    return True


@pytest.mark.parametrize("arch,model_type", _model_types(), ids=lambda x: x)
@pytest.mark.parametrize("extra", [{}, {"head_dim": None, "num_key_value_heads": None}],
                         ids=["defaults", "nulls"])
def test_config_json_reads_every_key_the_family_reads_like_transformers(arch, model_type, extra):
    """A ``config.json`` holding only ``architectures`` and ``model_type`` (plus
    explicit nulls): every key the family reads has transformers' value."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    fam = family(arch)
    cls = CONFIG_MAPPING[fam.hf.config_classes.get(model_type, model_type)]
    # transformers refuses a null for a field it types int (Qwen3's head_dim): such a
    # file is not a config, so only the nulls it accepts are compared
    extra = {k: v for k, v in extra.items() if _accepts(cls, k, v)}
    data = {"architectures": [arch], "model_type": model_type, **extra,
            **VLLM_REQUIRES.get(model_type, {})}
    light = read_config_json(data, fam)
    hf = cls(**{k: v for k, v in data.items() if k != "model_type"})
    keys = _keys_read(light)
    assert keys, arch
    for key in sorted(keys):
        if key in VERSION_DEFAULTS and (not hasattr(hf, key) or _at(light, key) is None):
            continue        # 5.12 (pinned, what vLLM runs under here) has no default for it
        assert _json(_at(light, key)) == _json(_at(hf, key)), (arch, model_type, key)
    assert config_dtype(light) == config_dtype(hf)


@pytest.mark.parametrize("name", REAL)
def test_real_configs_read_like_transformers(name):
    ckpt = read_checkpoint(CONFIGS / name / "config.json")
    ref = read_checkpoint(CONFIGS / name / "config.json", via_transformers=True)
    for key in sorted(_keys_read(ckpt.config) | {"model_type"}):
        assert _at(ckpt.config, key) == _at(ref.config, key), (name, key)
    assert config_dtype(ckpt.config) == config_dtype(ref.config)


# --------------------------------------------------------------------------
# what a config-only plan says


def test_a_config_only_plan_never_imports_transformers():
    code = ("import sys\n"
            "from m2nkit.engine.tools.cli import main\n"
            f"rc = main(['plan', {str(CONFIGS / 'Qwen__Qwen3-8B' / 'config.json')!r}, "
            "'--trainer', 'fsdp:8', '--inference', 'vllm:tp=2', '--layout', 'tables'])\n"
            "print(rc, sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "0 []", out.stdout[-500:]


def test_the_mtp_layer_is_listed_as_skipped_as_the_published_checkpoint_holds_it():
    """DeepSeek-V3 ships one MTP layer (61): its decoder layer with fp8 weights and
    scales, experts per expert, plus ``embed_tokens``, ``enorm``, ``hnorm``,
    ``eh_proj`` (unquantized, ``[H, 2H]``) and ``shared_head``; vLLM skips it all."""
    ckpt = read_checkpoint(CONFIGS / "deepseek-ai__DeepSeek-V3" / "config.json")
    mtp = {p.name: p for p in ckpt.params if p.name.startswith("model.layers.61.")}
    assert list(mtp)[:6] == [f"model.layers.61.{n}" for n in (
        "embed_tokens.weight", "enorm.weight", "hnorm.weight", "eh_proj.weight",
        "shared_head.norm.weight", "shared_head.head.weight")]
    assert mtp["model.layers.61.eh_proj.weight"].shape == (7168, 14336)
    assert mtp["model.layers.61.eh_proj.weight"].dtype == torch.bfloat16
    assert "model.layers.61.eh_proj.weight_scale_inv" not in mtp
    down = mtp["model.layers.61.mlp.experts.255.down_proj.weight"]
    assert (down.shape, down.dtype) == ((7168, 2048), torch.float8_e4m3fn)
    assert mtp["model.layers.61.mlp.experts.255.down_proj.weight_scale_inv"].shape == (56, 16)
    assert mtp["model.layers.61.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert len([n for n in mtp if ".experts." in n]) == 256 * 3 * 2
    layout = destination_layout(ckpt.config, ckpt.params, "vllm:tp=8,ep")
    assert set(mtp) <= set(layout.skipped)
    assert "multi-token-prediction layer 61" in layout.skipped["model.layers.61.enorm.weight"]
    kimi = read_checkpoint(CONFIGS / "moonshotai__Kimi-K2-Instruct" / "config.json")
    assert not any(n.startswith("model.layers.61.") for n in kimi.names)  # no MTP layer


def test_the_mtp_layer_has_the_on_disk_names_of_a_moe_layer(tiny_checkpoints, tmp_path):
    """The listed MTP decoder layer is what a checkpoint holds for a MoE layer, renumbered:
    the same per-expert names, fp8 scales and shapes as the tiny fp8 checkpoint's layer 1."""
    from safetensors import safe_open

    d = tiny_checkpoints("tiny-deepseek-v3-fp8")
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        disk = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}
    layer1 = {n.replace("model.layers.1.", "model.layers.2.", 1): s for n, s in disk.items()
              if n.startswith("model.layers.1.")}
    ckpt = read_checkpoint(d / "config.json")  # num_nextn_predict_layers 1: MTP layer 2
    listed = {p.name: tuple(p.shape) for p in ckpt.params if p.name.startswith("model.layers.2.")}
    extras = {n: s for n, s in listed.items() if n not in layer1}
    assert {n: s for n, s in listed.items() if n in layer1} == layer1
    assert sorted(n.removeprefix("model.layers.2.") for n in extras) == sorted([
        "embed_tokens.weight", "enorm.weight", "hnorm.weight", "eh_proj.weight",
        "shared_head.norm.weight", "shared_head.head.weight"])


def test_config_only_dtypes_are_what_published_checkpoints_store():
    """Kimi-K2: the router in the model dtype (so nothing is cast on arrival), its
    score-correction bias float32, quantized linears fp8 with float32 scales."""
    ckpt = read_checkpoint(CONFIGS / "moonshotai__Kimi-K2-Instruct" / "config.json")
    meta = {p.name: p for p in ckpt.params}
    assert meta["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16
    assert meta["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert meta["model.layers.1.self_attn.q_a_proj.weight"].dtype == torch.float8_e4m3fn
    assert meta["model.layers.1.self_attn.q_a_proj.weight_scale_inv"].dtype == torch.float32
    assert meta["model.embed_tokens.weight"].dtype == torch.bfloat16
    layout = destination_layout(ckpt.config, checkpoint_metas(ckpt, "fsdp:8"), "vllm:tp=8")
    params = {p.name: p.dtype for p in layout.params if p.worker == 0}
    assert params["model.layers.1.mlp.gate.weight"] == torch.bfloat16
