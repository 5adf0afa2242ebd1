"""m2nkit rounds into FP8-served vLLM models through vLLM's layerwise reload (issue 18, modes 1, 2, 3).

As ``test_vllm_plugin.py``: each worker is a process holding vLLM's own model
class, built as its tp/ep rank builds it, loaded by vLLM's ``DefaultModelLoader``
from checkpoint v0 and post-processed as vLLM's loader does, so it serves
kernel-format fp8 (e4m3 ``weight``, fp32 ``weight_scale_inv``, MoE
``w13``/``w2`` and their scales); the engine is made by vLLM's
``WeightTransferEngineFactory``. Trainer processes hold v1 and send one round:
two FSDP2 ranks (or checkpoint readers for the fp8 checkpoint), or Megatron-Core
ranks built through Megatron-Bridge. Afterwards every parameter of every worker (and MLA's derived
``W_UK_T``/``W_UV``) must equal, bit for bit, what a fresh vLLM load of v1 with
the same quantization holds, in the same memory: the expected values are
vLLM's own quantization of v1 (mode 1: ``quantization="fp8_per_block"``, BF16
v1) or vLLM's load of the v1 fp8 checkpoint (mode 3), never m2nkit's.

On a CPU only vLLM's choice of kernel is replaced
(``m2nkit.engine.tools.vllm_workers.cpu_quantized_kernels``: its CPU fp8 kernels
need AMX and vLLM's compiled CPU ops), never its weight processing.

Sizes: Qwen3 with hidden 192 (not a multiple of 128) at tp=2: each worker's
``qkv_proj`` holds 192 q rows then 64 k and 64 v rows, so its second 128-row
block spans q and k (two wire tensors), and ``gate_up_proj``'s spans gate and
up (160 + 160 rows).
"""

from __future__ import annotations


import pytest

from _paths import CONFIGS as PUBLIC_CONFIGS, ORACLE

from _procs import CTX, trainer_outcomes

from .test_vllm_plugin import (ROUND_TIMEOUT_S, _mla_derived, _run_trainers,  # noqa: F401
                               _tied_storage, _traced_own_loaders, host)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

#: The trainers of the BF16 rounds: real FSDP2 (``fully_shard`` over 2 ranks, fp32 masters
#: sent as bf16 by the mixed-precision policy, through ``fsdp2_source``). The fp8 checkpoint
#: (mode 3) is sent by checkpoint-reading trainers (``fsdp:2`` boxes): transformers holds no
#: e4m3 weights with their scales to shard.
FSDP2 = "fsdp2:dp_shard=2"

#: name -> (built-in tiny model, config overrides)
CONFIGS = {
    "qwen3-h192": ("tiny-qwen3", {"hidden_size": 192, "intermediate_size": 320,
                                  "num_attention_heads": 6, "num_key_value_heads": 2,
                                  "head_dim": 64}),
    "qwen3-tied-h192": ("tiny-qwen3-tied", {"hidden_size": 192, "intermediate_size": 320,
                                            "num_attention_heads": 6, "num_key_value_heads": 2,
                                            "head_dim": 64}),
    # for DeepGEMM's kernel (K % 128 == 0, N % 64 == 0 of the worker-local weight): tp=2 gives
    # qkv_proj 256 q + 64 k + 64 v rows (the third block spans k and v), o_proj K 256,
    # gate_up_proj 192 + 192 rows (the TP split cuts gate mid-block: its second block spans
    # gate and up), down_proj K 192 (not a multiple of 128: the next kernel, as on a GPU)
    "qwen3-h256": ("tiny-qwen3", {"hidden_size": 256, "intermediate_size": 384,
                                  "num_attention_heads": 8, "num_key_value_heads": 2,
                                  "head_dim": 64}),
    "qwen3-moe-h256": ("tiny-qwen3-moe", {"hidden_size": 256, "moe_intermediate_size": 128,
                                          "num_attention_heads": 6, "num_key_value_heads": 2,
                                          "head_dim": 64}),
    # experts vLLM pads to whole 128 blocks (Fp8PerBlockOnlineMoEMethod.maybe_roundup_sizes):
    # hidden 192 -> 256; expert intermediate 160 (tp=2: 80 per worker -> 128; ep: 160 -> 256)
    "qwen3-moe-h192": ("tiny-qwen3-moe", {"hidden_size": 192, "moe_intermediate_size": 160,
                                          "num_attention_heads": 6, "num_key_value_heads": 2,
                                          "head_dim": 64}),
    # MLA (fused_qkv_a_proj: 32 q_a + 40 kv_a rows in one block; kv_b_proj, whose W_UK_T/W_UV
    # vLLM derives after loading) + MoE (hidden 64, expert intermediate 32: padded experts)
    "deepseek-v3": ("tiny-deepseek-v3", {}),
    # a DeepSeek-V3 fp8 checkpoint with DeepSeek-V3.2's scale_fmt ue8m0 (power-of-two scales,
    # save_tiny_checkpoint -> quant.quantize_fp8_blocks), 128 x 128 blocks, every tp=2 split on
    # block edges: q_b_proj 384 local rows, kv_b_proj 512, o_proj K 256, experts 128
    "deepseek-v3-ue8m0": ("tiny-deepseek-v3", {
        "hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 8,
        "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "qk_head_dim": 96, "v_head_dim": 64,
        "q_lora_rank": 128,
        "kv_lora_rank": 128, "intermediate_size": 256, "moe_intermediate_size": 256,
        "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                "fmt": "e4m3", "scale_fmt": "ue8m0",
                                "weight_block_size": [128, 128]}}),
}
CASES = [  # (checkpoint, vLLM layout, quantization, what it covers)
    ("qwen3-h192", "vllm:tp=2", "fp8_per_block",
     "mode 1, dense: hidden 192, blocks across q/k and gate/up"),
    # tied embeddings: lm_head.weight is embed_tokens.weight; vLLM's reload processes the
    # tie through one of its layers (reload/__init__.py, Limitations 2)
    ("qwen3-tied-h192", "vllm:tp=2", "fp8_per_block", "mode 1, tied embeddings"),
    ("qwen3-moe-h256", "vllm:tp=2,ep", "fp8_per_block",
     "mode 1, MoE with EP: whole experts per worker; qkv blocks across q/k"),
    ("qwen3-moe-h192", "vllm:tp=2", "fp8_per_block",
     "mode 1, experts vLLM pads: hidden 192 -> 256, local intermediate 80 -> 128"),
    ("deepseek-v3", "vllm:tp=2", "fp8_per_block",
     "mode 1, MLA + MoE: fused_qkv_a_proj, kv_b_proj and its derived W_UK_T/W_UV; padded experts"),
    # the shipped DeepSeek-V3 fp8 checkpoint (weight_block_size [32, 16]: tp=2 cuts
    # q_b_proj/kv_b_proj/o_proj/experts on block edges, as vLLM requires); quantization
    # comes from its config; after the round MLA's W_UK_T/W_UV derive from the new kv_b_proj
    ("tiny-deepseek-v3-fp8", "vllm:tp=2", None,
     "mode 3: checkpoint-format fp8 (weight + weight_scale_inv), MLA + MoE"),
]
#: Shipped fp8 checkpoints (tests/data/oracle/NAME/checkpoint): v0 as shipped, v1 the same
#: tensors refilled (:func:`_refilled`).
SHIPPED = {"tiny-deepseek-v3-fp8"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``checkpoints(name) -> (v0, v1)``: seeds 0 and 1 of ``CONFIGS[name]``, saved by
    transformers' ``save_pretrained`` (``save_tiny_checkpoint``)."""
    from m2nkit.adapters.tiny import save_tiny_checkpoint, tiny_config

    root = tmp_path_factory.mktemp("fp8")
    made = {}

    def get(name):
        if name in SHIPPED and name not in made:
            v0 = ORACLE / name / "checkpoint"
            made[name] = (v0, _refilled(v0, root / f"{name}-v1"))
        if name not in made:
            base, overrides = CONFIGS[name]
            config = tiny_config(base, **overrides)
            made[name] = tuple(save_tiny_checkpoint(config, root / f"{name}-seed{seed}", seed=seed)
                               for seed in (0, 1))
        return made[name]

    return get


def _run_fsdp2_trainers(client, checkpoint, inference, timeout_s=ROUND_TIMEOUT_S) -> dict:
    """Two FSDP2 trainer processes (``fully_shard``, ``fsdp2_source``) send ``checkpoint``
    as round v1 (``demo_vllm.fsdp2_trainer_main``); returns rank -> "done" or the error."""
    from m2nkit.engine.tools.demo_vllm import fsdp2_trainer_main
    from m2nkit.engine.tools.procs import free_port

    port, dist_port = free_port(), free_port()
    return trainer_outcomes(CTX, fsdp2_trainer_main, lambda r, results: (
        r, 2, str(checkpoint), FSDP2, inference, client if r == 0 else None, port, dist_port,
        timeout_s, results), 2, timeout_s)


def _refilled(checkpoint, out):
    """``checkpoint``'s config with every tensor refilled (seed 1), saved by safetensors.

    e4m3 weights get new e4m3 values, their fp32 ``weight_scale_inv`` new positive
    scales, every other tensor new values of its dtype: an fp8 checkpoint v1 in which
    every byte vLLM loads differs from v0.
    """
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True)
    shutil.copy(checkpoint / "config.json", out / "config.json")
    g = torch.Generator().manual_seed(1)
    tensors = {}
    for name, t in load_file(checkpoint / "model.safetensors").items():
        x = torch.randn(t.shape, generator=g)
        if t.dtype == torch.float8_e4m3fn:
            tensors[name] = (4 * x).to(t.dtype)
        elif name.endswith("weight_scale_inv"):
            tensors[name] = (x.abs() + 0.5).mul(1e-2).to(t.dtype)
        else:
            tensors[name] = (0.05 * x).to(t.dtype)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def _mla_derived_of_fresh(state, checkpoint: str, quantization: str | None,
                          fp8_kernel: str = "triton") -> dict:
    """Whether MLA's derived weights on the live model equal a fresh, post-processed vLLM
    load of ``checkpoint``'s with ``quantization`` (``build_cpu_worker`` post-processes a
    quantized model)."""
    import torch

    from m2nkit.engine.tools.vllm_workers import build_cpu_worker

    live = _mla_derived(state["model"])
    fresh, _ = build_cpu_worker(checkpoint, state["spec"], state["worker"],
                                quantization=quantization, fp8_kernel=fp8_kernel)
    ref = _mla_derived(fresh)
    return {"compared": sorted(ref),
            "differ": sorted(n for n in ref if n not in live or live[n].shape != ref[n].shape
                             or not torch.equal(live[n], ref[n]))}


def _layers_processed(state) -> dict:
    """The layers owning parameters that this worker's last round did not process while
    receiving (each as its last wire tensor landed), leaving out the attention layers,
    which vLLM's reload processes at its end (``finalize_layerwise_reload``)."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer

    reload = state["engine"]._receiver._reload
    owners, seen = {}, set()
    for n, m in state["model"].named_modules():
        own = {id(p) for p in m._parameters.values() if p is not None}
        if own - seen and not is_deferred_attention_layer(m):   # a tied lm_head owns none
            owners[n] = m
        seen |= own
    return {"layers": len(owners), "streamed": reload.streamed,
            "not_streamed": sorted(n for n, m in owners.items()
                                   if id(m) not in reload.streamed_ids)}


def _aborted_reload_leaves_the_served_weights(state) -> dict:
    """A reload begun, written into (every checkpoint tensor set to 1) and aborted: the
    served parameters keep their bytes and addresses."""
    from m2nkit.engine.in_process import bitwise_equal
    from m2nkit.engine.plugins.vllm_reload import LayerwiseReload

    model = state["model"]
    before = {n: (p.data.clone(), p.data_ptr()) for n, p in model.named_parameters()}
    reload = LayerwiseReload(model, state["vllm_config"].model_config, state["vllm_config"])
    storage = reload.begin()
    for name in storage:
        storage[name].fill_(1)
    reload.abort()
    after = dict(model.named_parameters())
    return {"names": sorted(after) == sorted(before),
            "changed": sorted(n for n, (t, ptr) in before.items()
                              if n not in after or after[n].data_ptr() != ptr
                              or not bitwise_equal(after[n].data, t))}


def _served_dtypes(state) -> dict:
    return {n: str(p.dtype).replace("torch.", "")
            for n, p in state["model"].named_parameters()}


def _assert_equals_fresh_fp8_load(reports, started) -> None:
    """Every worker's ``verify`` report: all its parameters compared with a fresh vLLM fp8
    load of v1, same names, no byte different, none left at v0 or re-allocated, at v1."""
    assert len(reports) == len(started)
    for w, r in enumerate(reports):
        assert r["compared"] == started[w]["parameters"] > 0
        assert (r["names_only_live"], r["names_only_fresh"]) == ([], []), (w, r)
        assert r["differ"] == [], f"worker {w}: differs from vLLM's fresh fp8 load of v1: {r['differ']}"
        assert r["unchanged_since_start"] == [], f"worker {w}: still v0: {r['unchanged_since_start']}"
        assert r["moved"] == [], f"worker {w}: parameters re-allocated: {r['moved']}"
        assert r["version"] == "v1"


@pytest.mark.parametrize("name,inference,quantization,covers", CASES, ids=[c[0] for c in CASES])
def test_round_into_fp8_served_vllm_equals_fresh_fp8_load(host, checkpoints, name, inference,
                                                          quantization, covers):
    v0, v1 = checkpoints(name)
    started = host.start_workers(v0, inference, "auto", quantization)
    assert {s["engine"] for s in started} == {"m2nkit.engine.plugins.vllm.M2NVLLMEngine"}
    served = host.client.collective_rpc(_served_dtypes)
    proj = ("model.layers.0.self_attn.o_proj" if "deepseek-v3" in name
            else "model.layers.0.self_attn.qkv_proj")
    for dtypes in served:       # vLLM serves kernel-format fp8 (what the round must rebuild)
        assert dtypes[f"{proj}.weight"] == "float8_e4m3fn", dtypes
        assert dtypes[f"{proj}.weight_scale_inv"] == "float32", dtypes
        assert dtypes["model.embed_tokens.weight"] == "bfloat16", dtypes

    if name in SHIPPED:
        outcome = _run_trainers(host.client, [v1], inference)
    else:
        outcome = _run_fsdp2_trainers(host.client, v1, inference)
    assert outcome == {0: "done", 1: "done"}, outcome
    # Each worker held its part of the plan against its checkpoint-format loaders (traced
    # inside vLLM's layerwise reload, then restored).
    assert host.client.collective_rpc(_traced_own_loaders) == [True] * len(started)
    # vLLM processed each layer as its last wire tensor landed (the plan's buckets follow
    # the trainer's layer order), none was left for the commit
    for w, n in enumerate(host.client.collective_rpc(_layers_processed)):
        assert n["not_streamed"] == [] and n["streamed"] == n["layers"] > 0, (w, n)
    _assert_equals_fresh_fp8_load(host.client.verify(v1), started)
    if "tied" in name:      # still one tensor under both names
        assert host.client.collective_rpc(_tied_storage) == [True] * len(started)
    for w, r in enumerate(host.client.collective_rpc(_aborted_reload_leaves_the_served_weights)):
        assert r == {"names": True, "changed": []}, (w, r)
    if "deepseek-v3" in name:
        _assert_mla_derived_equal_fresh(host, v1, quantization)


def _assert_round_equals_fresh_load(host, v1, inference, started) -> None:
    """After a round: on the fp8 wire every quantized layer took the trainers' bytes; every
    layer was processed as its last wire tensor landed; every worker equals a fresh load."""
    if "wire=fp8" in inference:
        for w, r in enumerate(host.client.collective_rpc(_quantized_layers_took_the_wire)):
            assert r["quantized"] and r["not_from_wire"] == [] and r["other"] == [], (w, r)
    for w, n in enumerate(host.client.collective_rpc(_layers_processed)):
        assert n["not_streamed"] == [] and n["streamed"] == n["layers"] > 0, (w, n)
    _assert_equals_fresh_fp8_load(host.client.verify(v1), started)


def _assert_mla_derived_equal_fresh(host, v1, quantization, fp8_kernel="triton") -> None:
    for w, r in enumerate(host.client.collective_rpc(_mla_derived_of_fresh, str(v1),
                                                     quantization, fp8_kernel)):
        assert r["compared"], f"worker {w}: no MLA layer has derived weights: {r}"
        assert r["differ"] == [], f"worker {w}: derived MLA weights differ: {r['differ']}"


@pytest.mark.parametrize("scheme", ["kimi-k2.5-int4", "fp8-per-tensor"])
def test_schemes_m2nkit_does_not_carry_are_named_with_the_supported_ones(tmp_path, checkpoints,
                                                                        scheme):
    """vLLM's own config of a served model (``VllmConfig`` from ``config.json`` and
    ``--quantization``): ``quantization_mode`` refuses what m2nkit does not carry, naming
    the scheme and listing the supported ones; the plugin's every init then refuses with
    this message on every rank (``M2NVLLMEngine._problems``, first check)."""
    import json
    import shutil

    from m2nkit.adapters.vllm import parse_inference_spec
    from m2nkit.adapters.vllm.stand_in import worker_config
    from m2nkit.engine.plugins.vllm_reload import quantization_mode

    v0, _ = checkpoints("qwen3-h192")
    quantization = None
    if scheme == "kimi-k2.5-int4":
        model = tmp_path / "int4"
        shutil.copytree(v0, model)
        config = json.loads((model / "config.json").read_text())
        # Kimi-K2.5's published quantization_config (int4 weights in groups of 32,
        # compressed-tensors pack-quantized), from its config.json as shipped
        kimi = json.loads((PUBLIC_CONFIGS / "moonshotai__Kimi-K2.5" / "config.json").read_text())
        config["quantization_config"] = kimi["text_config"]["quantization_config"]
        (model / "config.json").write_text(json.dumps(config))
        named = "'compressed-tensors'"
    else:
        model, quantization = v0, "fp8"
        named = "'fp8 online per-tensor from an unquantized checkpoint'"
    vllm_config = worker_config(str(model), parse_inference_spec("vllm:tp=1"), 0,
                                quantization=quantization)
    with pytest.raises(ValueError) as e:
        quantization_mode(vllm_config)
    assert str(e.value) == (
        f"vLLM serves this model with quantization {named}, which m2nkit does not carry; "
        "supported: fp8_per_block (mode 1: BF16 wire, quantized online by vLLM in 128 x 128 "
        "blocks); fp8 (mode 3: a block-quantized fp8 checkpoint (weight_block_size; "
        "DeepSeek-V3 weight + weight_scale_inv) on the wire as stored)")
    for supported, mode in (("fp8_per_block", "fp8_per_block"),):
        assert quantization_mode(worker_config(str(v0), parse_inference_spec("vllm:tp=1"), 0,
                                               quantization=supported)) == mode
    assert quantization_mode(worker_config(str(v0), parse_inference_spec("vllm:tp=1"), 0)) is None
    fp8_checkpoint = ORACLE / "tiny-deepseek-v3-fp8" / "checkpoint"
    assert quantization_mode(worker_config(str(fp8_checkpoint),
                                           parse_inference_spec("vllm:tp=1"), 0)) == "fp8"


def _quantized_layers_took_the_wire(state) -> dict:
    """Mode 2: the layers vLLM serves with ``Fp8PerBlockOnlineLinearMethod`` or
    ``Fp8PerBlockOnlineMoEMethod`` (read from the live model) against those the last round
    processed with the trainers' e4m3 bytes and scales in place of vLLM's
    ``per_block_cast_to_fp8`` (``LayerwiseReload._process``)."""
    from vllm.model_executor.layers.quantization.online.fp8 import (
        Fp8PerBlockOnlineLinearMethod, Fp8PerBlockOnlineMoEMethod)

    reload = state["engine"]._receiver._reload
    methods = (Fp8PerBlockOnlineLinearMethod, Fp8PerBlockOnlineMoEMethod)
    quantized = {n for n, m in state["model"].named_modules()
                 if isinstance(getattr(m, "quant_method", None), methods)}
    took = {n for n, m in state["model"].named_modules() if id(m) in reload.prequantized_ids}
    return {"quantized": sorted(quantized), "not_from_wire": sorted(quantized - took),
            "other": sorted(took - quantized)}


#: (checkpoint, the trainers' spec, the workers' vLLM layout, what it covers)
WIRE_CASES = [
    ("qwen3-h192", "vllm:tp=2,quant=fp8_per_block,wire=fp8", "vllm:tp=2",
     "mode 2, dense: hidden 192; blocks across q/k and gate/up rows (two wire tensors), "
     "o_proj/down_proj blocks across the two FSDP2 shards (the amax exchange)"),
    ("qwen3-moe-h256", "vllm:tp=2,ep,quant=fp8_per_block,wire=fp8", "vllm:tp=2,ep",
     "mode 2, MoE with EP: whole experts per worker, one grid per expert (gate and up rows "
     "of w13 from two wire tensors); the fp8 router; qkv blocks across q/k"),
    ("qwen3-moe-h192", "vllm:tp=2,quant=fp8_per_block,wire=fp8", "vllm:tp=2",
     "mode 2, experts vLLM pads, TP-split: hidden 192 -> 256, local intermediate 80 -> 128 "
     "(gate and up rows each padded on their own)"),
    ("qwen3-moe-h192", "vllm:tp=2,ep,quant=fp8_per_block,wire=fp8", "vllm:tp=2,ep",
     "mode 2, experts vLLM pads, EP: hidden 192 -> 256, intermediate 160 -> 256"),
    ("deepseek-v3", "vllm:tp=2,quant=fp8_per_block,wire=fp8", "vllm:tp=2",
     "mode 2, MLA + MoE: fused_qkv_a_proj blocks across q_a and kv_a (two wire tensors), "
     "kv_b_proj and the W_UK_T/W_UV vLLM derives from it; padded experts"),
]


@pytest.mark.parametrize("name,inference,served,covers", WIRE_CASES,
                         ids=[c[0] + ("-ep" if c[2].endswith(",ep") else "") for c in WIRE_CASES])
def test_fp8_wire_round_from_fsdp2_equals_fresh_fp8_load(host, checkpoints, name, inference,
                                                          served, covers):
    """Mode 2 live: two FSDP2 trainer ranks quantize what they send in each worker's own
    128 x 128 grid (partial maxima exchanged between them), send e4m3 bytes + float32 scales
    over torch_p2p, and the workers (vLLM, ``quantization="fp8_per_block"``) hand them to
    vLLM's online method in place of its own quantization. Every served parameter must then
    equal a fresh vLLM ``fp8_per_block`` load of v1 bit for bit, in the same memory."""
    v0, v1 = checkpoints(name)
    _fp8_wire_preconditions(v1, inference)
    started = host.start_workers(v0, served, "auto", "fp8_per_block")
    assert {s["engine"] for s in started} == {"m2nkit.engine.plugins.vllm.M2NVLLMEngine"}
    outcome = _run_fsdp2_trainers(host.client, v1, inference)
    assert outcome == {0: "done", 1: "done"}, outcome
    for w, r in enumerate(host.client.collective_rpc(_quantized_layers_took_the_wire)):
        assert r["quantized"] and r["not_from_wire"] == [] and r["other"] == [], (w, r)
    for w, n in enumerate(host.client.collective_rpc(_layers_processed)):
        assert n["not_streamed"] == [] and n["streamed"] == n["layers"] > 0, (w, n)
    _assert_equals_fresh_fp8_load(host.client.verify(v1), started)
    if "deepseek-v3" in name:
        _assert_mla_derived_equal_fresh(host, v1, "fp8_per_block")


def _fp8_wire_preconditions(checkpoint, inference, exchange: bool = True) -> None:
    """The case covers what it says: m2nkit's plan for two FSDP2 ranks (the checkpoint read
    as ``fsdp2:dp_shard=2`` shards it) has blocks fed by two wire tensors and, with
    ``exchange``, blocks fed by both trainer ranks (so the exchange runs)."""
    from m2nkit.adapters.hf_checkpoint import checkpoint_metas, read_checkpoint
    from m2nkit.adapters.trainer_spec import parse_trainer_spec
    from m2nkit.adapters.vllm import vllm_destination
    from m2nkit.engine.fp8_wire import fp8_wire_plan
    from m2nkit.engine.plan import build_plan

    ckpt = read_checkpoint(checkpoint)
    tspec = parse_trainer_spec(FSDP2)
    metas = checkpoint_metas(ckpt, tspec)
    builder = vllm_destination(ckpt.config, inference)
    plan = build_plan(metas, tspec.num_ranks, builder(metas))
    assert not plan.problems
    fp8 = fp8_wire_plan(builder, plan)
    assert fp8.multi_wire_blocks > 0 and (fp8.shared_blocks > 0 or not exchange), fp8.to_json()


def _scales_cut_short(state, on: bool) -> bool:
    """Worker side of the failed-round test: with ``on``, every scale grid the fp8 wire hands
    the reload loses its last column (``LayerwiseReload.prequantize``), as a vLLM whose
    method quantized in another grid would see it; ``on=False`` undoes it."""
    from m2nkit.engine.plugins.vllm_reload import LayerwiseReload

    original = getattr(LayerwiseReload, "_m2nkit_test_original", None)
    if on and original is None:
        original = LayerwiseReload._m2nkit_test_original = LayerwiseReload.prequantize

        def cut(self, name, weight, scale):
            return original(self, name, weight, scale[:, :-1])

        LayerwiseReload.prequantize = cut
    elif not on and original is not None:
        LayerwiseReload.prequantize = original
        del LayerwiseReload._m2nkit_test_original
    return True


def test_fp8_wire_round_that_vllm_cannot_take_fails_everywhere_and_commits_nothing(
        host, checkpoints):
    """The stand-in for ``per_block_cast_to_fp8`` refuses scales that are not in the grid
    vLLM asks for: the round fails on every trainer rank, naming the layer and the check,
    and no worker commits v1 (each keeps the version it had)."""
    v0, v1 = checkpoints("qwen3-h192")
    host.start_workers(v0, "vllm:tp=2", "auto", "fp8_per_block")
    before = host.client.weight_versions()
    assert host.client.collective_rpc(_scales_cut_short, True) == [True, True]
    try:
        outcome = _run_fsdp2_trainers(host.client, v1, "vllm:tp=2,quant=fp8_per_block,wire=fp8")
    finally:
        host.client.collective_rpc(_scales_cut_short, False)
    assert sorted(outcome) == [0, 1] and all(v != "done" for v in outcome.values()), outcome
    assert any("quantized otherwise than m2nkit's trainers did" in v for v in outcome.values()), \
        outcome
    after = host.client.weight_versions()
    assert after == before and "v1" not in after, (before, after)


def _run_megatron_trainers(client, checkpoint, trainer, inference,
                           timeout_s=4 * ROUND_TIMEOUT_S) -> dict:
    """Megatron-Core trainer processes (``trainer``'s world), each building ``checkpoint``
    through Megatron-Bridge and sending its live shards through ``megatron_source`` as round
    v1 (``demo_bridge.megatron_trainer_main``); returns rank -> "done" or the error."""
    from m2nkit.engine.tools.demo_bridge import megatron_trainer_main, parse_megatron_demo_spec
    from m2nkit.engine.tools.procs import free_port

    world = parse_megatron_demo_spec(trainer).num_ranks
    port, dist_port = free_port(), free_port()
    return trainer_outcomes(CTX, megatron_trainer_main, lambda r, results: (
        r, world, str(checkpoint), trainer, inference, client if r == 0 else None, port,
        dist_port, timeout_s, results), world, timeout_s)


#: (checkpoint, Megatron-Core layout, the trainers' spec, what it covers); the workers serve
#: vllm:tp=2 with quantization="fp8_per_block"
MEGATRON_CASES = [
    ("qwen3-h192", "megatron:tp=2", "vllm:tp=2",
     "mode 1: fused QKV and [gate; up] shards of Megatron-Core's TP into vLLM's online fp8"),
    ("qwen3-h192", "megatron:tp=2,dp=2", "vllm:tp=2,quant=fp8_per_block,wire=fp8",
     "mode 2: the trainers quantize Megatron-Core shards; blocks across q/k and gate/up "
     "(two wire tensors) and blocks fed by two replicas' ranks (the exchange runs)"),
]


@pytest.mark.parametrize("name,trainer,inference,covers", MEGATRON_CASES,
                         ids=[f"{c[0]}-{c[1].replace(':', '-').replace(',', '-')}"
                              for c in MEGATRON_CASES])
def test_round_from_megatron_core_equals_fresh_fp8_load(host, checkpoints, name, trainer,
                                                         inference, covers):
    """A Megatron-Core trainer (built and loaded through Megatron-Bridge, read by
    ``megatron_source``) into vLLM workers serving ``fp8_per_block``: every served parameter
    equals a fresh vLLM ``fp8_per_block`` load of v1 bit for bit, in the same memory; on the
    fp8 wire every quantized layer took the trainers' bytes and the plan has both kinds of
    shared block."""
    from m2nkit.adapters.hf_checkpoint import checkpoint_metas, read_checkpoint
    from m2nkit.adapters.trainer_spec import parse_trainer_spec
    from m2nkit.adapters.vllm import vllm_destination
    from m2nkit.engine.fp8_wire import fp8_wire_plan
    from m2nkit.engine.plan import build_plan

    v0, v1 = checkpoints(name)
    if "wire=fp8" in inference:
        ckpt = read_checkpoint(v1)
        tspec = parse_trainer_spec(trainer)
        metas = checkpoint_metas(ckpt, tspec)
        builder = vllm_destination(ckpt.config, inference)
        fp8 = fp8_wire_plan(builder, build_plan(metas, tspec.num_ranks, builder(metas)))
        assert fp8.shared_blocks > 0 and fp8.multi_wire_blocks > 0, fp8.to_json()
    started = host.start_workers(v0, "vllm:tp=2", "auto", "fp8_per_block")
    outcome = _run_megatron_trainers(host.client, v1, trainer, inference)
    assert set(outcome.values()) == {"done"}, outcome
    _assert_round_equals_fresh_load(host, v1, inference, started)


#: (checkpoint, the trainers' spec, the workers' vLLM layout, their quantization, what it
#: covers): workers whose block fp8 layers get vLLM's DeepGEMM kernels with E8M0
#: (``fp8_kernel="deep_gemm_e8m0"``)
UE8M0_CASES = [
    ("qwen3-h256", "vllm:tp=2,quant=fp8_per_block,wire=fp8", "vllm:tp=2", "fp8_per_block",
     "mode 2 into DeepGEMM E8M0, dense: qkv_proj/o_proj/gate_up_proj on DeepGEMM (requant to "
     "powers of two), a gate_up block across gate and up, a qkv block across k and v; "
     "down_proj (K 192) on the next kernel"),
    ("qwen3-h256", "vllm:tp=2", "vllm:tp=2", "fp8_per_block",
     "mode 1 into DeepGEMM E8M0, dense: vLLM quantizes the BF16 wire, then requants"),
    ("qwen3-moe-h256", "vllm:tp=2,ep,quant=fp8_per_block,wire=fp8", "vllm:tp=2,ep",
     "fp8_per_block",
     "mode 2 into DeepGEMM E8M0, MoE with EP: the DEEPGEMM experts backend requants w13/w2 "
     "per expert (prepare_fp8_moe_layer_for_deepgemm); the fp8 router on the next kernel"),
    ("deepseek-v3-ue8m0", "vllm:tp=2", "vllm:tp=2", None,
     "mode 3 into DeepGEMM E8M0: a scale_fmt ue8m0 checkpoint (MLA + MoE), its e4m3 weights "
     "and power-of-two weight_scale_inv as stored; the kernels requant; W_UK_T/W_UV derived"),
]


def _tripled(checkpoint, out, scales_only: bool = False):
    """``checkpoint`` with every tensor times 3 (in its dtype), saved by safetensors: each
    block's amax triples, so its UE8M0 scale (rounded up to a power of two) moves. With
    ``scales_only`` (an fp8 checkpoint) only the ``weight_scale_inv`` tensors change, times
    4: powers of two stay powers of two."""
    import shutil

    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True)
    shutil.copy(checkpoint / "config.json", out / "config.json")
    tensors = load_file(checkpoint / "model.safetensors")
    save_file({n: (t * 4 if n.endswith("weight_scale_inv") else t) if scales_only else t * 3
               for n, t in tensors.items()},
              out / "model.safetensors", metadata={"format": "pt"})
    return out


def _deep_gemm_e8m0_layers(state) -> dict:
    """Which block fp8 layers of the live model took vLLM's DeepGEMM kernels, and whether
    their scales are powers of two (what ``requant_weight_ue8m0_inplace`` leaves).

    A linear layer must be on ``DeepGemmFp8BlockScaledMMKernel`` exactly where vLLM's own
    ``should_use_deepgemm_for_fp8_linear`` takes its worker-local weight (asked with DeepGEMM
    supported); its ``weight_scale_inv`` must be powers of two, the other layers' not all
    (their kernel does not round). Experts: ``fp8_backend`` and their scales."""
    import torch
    from vllm.model_executor.kernels.linear.scaled_mm.deep_gemm import (
        DeepGemmFp8BlockScaledMMKernel)
    from vllm.utils.deep_gemm import should_use_deepgemm_for_fp8_linear

    def powers_of_two(t) -> bool:
        bits = t.float().contiguous().view(torch.int32)
        return bool((t > 0).all()) and bool(((bits & 0x7FFFFF) == 0).all())

    out = {"deep_gemm": [], "other": [], "not_powers_of_two": [], "other_powers_of_two": [],
           "against_vllm_rule": [], "experts": {}}
    for n, m in state["model"].named_modules():
        method = getattr(m, "quant_method", None)
        kernel = getattr(method, "fp8_linear", None)
        if kernel is not None and hasattr(m, "weight_scale_inv"):
            dg = isinstance(kernel, DeepGemmFp8BlockScaledMMKernel)
            out["deep_gemm" if dg else "other"].append(n)
            if dg != should_use_deepgemm_for_fp8_linear(torch.bfloat16, tuple(m.weight.shape),
                                                        supports_deep_gemm=True):
                out["against_vllm_rule"].append(n)
            if dg and not powers_of_two(m.weight_scale_inv):
                out["not_powers_of_two"].append(n)
            if not dg and powers_of_two(m.weight_scale_inv):
                out["other_powers_of_two"].append(n)
        if hasattr(m, "w13_weight_scale_inv") and getattr(method, "fp8_backend", None):
            out["experts"][n] = method.fp8_backend.value
            for s in ("w13_weight_scale_inv", "w2_weight_scale_inv"):
                if not powers_of_two(getattr(m, s)):
                    out["not_powers_of_two"].append(f"{n}.{s}")
    return out


@pytest.mark.parametrize("name,inference,served,quantization,covers", UE8M0_CASES,
                         ids=[c[0] + ("-fp8-wire" if "wire=fp8" in c[1] else
                                      "-bf16-wire" if c[3] else "")
                              for c in UE8M0_CASES])
def test_round_into_deep_gemm_ue8m0_workers_equals_fresh_load(host, checkpoints, tmp_path, name,
                                                              inference, served, quantization,
                                                              covers):
    """Workers serving ``fp8_per_block`` on vLLM's DeepGEMM kernels with E8M0 (DeepSeek-V3.2's
    ``scale_fmt: ue8m0`` setting; ``vllm_workers.cpu_quantized_kernels(fp8_kernel=
    "deep_gemm_e8m0")``: the kernels' own weight processing, ``requant_weight_ue8m0_inplace``
    included, the DeepGEMM scale packing skipped). After one round from two FSDP2 ranks (the
    fp8 wire: vLLM's online e4m3 + float32 scales, which the kernel then rounds to powers of
    two; the BF16 wire: vLLM quantizes, then rounds) every parameter of every worker equals a
    fresh vLLM load of v1 under the same kernels, bit for bit, in the same memory, at v1.
    Mode 3: a ``scale_fmt: ue8m0`` fp8 checkpoint sent as stored by checkpoint-reading
    trainers. v1 is seed 1 times 3 (mode 3: its scales times 4), so that every power-of-two
    scale differs from v0's (seeds 0 and 1 alone give the same ones)."""
    v0, v1 = checkpoints(name)
    v1 = _tripled(v1, tmp_path / "v1", scales_only=quantization is None)
    if "wire=fp8" in inference:
        _fp8_wire_preconditions(v1, inference, exchange=False)
    started = host.start_workers(v0, served, "auto", quantization, "deep_gemm_e8m0")
    assert {s["engine"] for s in started} == {"m2nkit.engine.plugins.vllm.M2NVLLMEngine"}
    for w, r in enumerate(host.client.collective_rpc(_deep_gemm_e8m0_layers)):
        assert r["deep_gemm"] and r["other"], (w, r)      # both kernels, as vLLM's rule picks
        assert r["against_vllm_rule"] == [] and r["not_powers_of_two"] == [], (w, r)
        # online fp8's other kernels keep amax / 448; a ue8m0 checkpoint's are powers of two
        assert r["other_powers_of_two"] == [] or quantization is None, (w, r)
        if "moe" in name or "deepseek" in name:
            assert r["experts"] and set(r["experts"].values()) == {"DEEPGEMM"}, (w, r)
        else:
            assert {n.rsplit(".", 1)[-1] for n in r["deep_gemm"]} == \
                {"qkv_proj", "o_proj", "gate_up_proj"}, (w, r)
            assert {n.rsplit(".", 1)[-1] for n in r["other"]} == {"down_proj"}, (w, r)
    if quantization is None:
        outcome = _run_trainers(host.client, [v1], inference)
    else:
        outcome = _run_fsdp2_trainers(host.client, v1, inference)
    assert outcome == {0: "done", 1: "done"}, outcome
    _assert_round_equals_fresh_load(host, v1, inference, started)
    for w, r in enumerate(host.client.collective_rpc(_deep_gemm_e8m0_layers)):
        assert r["not_powers_of_two"] == [], (w, r)
        assert r["other_powers_of_two"] == [] or quantization is None, (w, r)
    if "deepseek" in name:
        _assert_mla_derived_equal_fresh(host, v1, quantization, "deep_gemm_e8m0")

