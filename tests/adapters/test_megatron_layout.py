"""Megatron-Core layout rules and the ``megatron:`` dry-run spec (fast; no megatron import).

The rules are checked against tensors built independently the way
megatron-core lays them out (fused QKV interleaved per query group, then
``torch.chunk`` over tp, as ``ColumnParallelLinear`` splits rows; ``[gate_r;
up_r]``), not against the code under test. The spec plans the real configs
of examples/configs at bytes moved == minimum.
"""

from __future__ import annotations

import time

import pytest
import torch

from _layouts import megatron_fused_qkv as _fused_qkv

from m2nkit.adapters.megatron.layout import (MegatronLayoutError, MegatronParallel,
                                             fc1_row_runs, local_expert_range, padded_vocab_size,
                                             qkv_row_runs, stage_layers, vocab_rows)

EXAMPLES = "examples/configs"


@pytest.mark.parametrize("nh,ng,hd,tp,gate", [(8, 2, 4, 2, False), (8, 2, 4, 4, False),
                                              (8, 2, 4, 8, False), (8, 8, 2, 4, False),
                                              (4, 1, 4, 4, False), (8, 2, 4, 4, True),
                                              (6, 3, 2, 4, False)])
def test_qkv_runs_pick_the_rows_megatron_holds(nh, ng, hd, tp, gate):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(nh * hd, 3, generator=g)
    k = torch.randn(ng * hd, 3, generator=g)
    v = torch.randn(ng * hd, 3, generator=g)
    gt = torch.randn(nh * hd, 3, generator=g) if gate else None
    fused = _fused_qkv(q, k, v, ng, gt)
    if fused.shape[0] % tp:
        with pytest.raises(MegatronLayoutError, match="not divisible by"):
            qkv_row_runs(nh, ng, hd, tp, 0, gate=gate)
        return
    whole = {"q": q, "k": k, "v": v, "gate": gt}
    covered = {p: torch.zeros(t.shape[0], dtype=torch.int) for p, t in whole.items()
               if t is not None}
    for r, local in enumerate(fused.chunk(tp)):
        at = 0
        for run in qkv_row_runs(nh, ng, hd, tp, r, gate=gate):
            n = run.stop - run.start
            assert run.local == at  # runs tile the local tensor in order
            assert torch.equal(local[run.local:run.local + n], whole[run.part][run.start:run.stop])
            covered[run.part][run.start:run.stop] += 1
            at += n
        assert at == local.shape[0]
    assert all(bool((c == 1).all()) for c in covered.values())


def test_fc1_runs_are_gate_then_up_of_the_rank():
    gate, up = torch.randn(12, 2), torch.randn(12, 2)
    for tp in (1, 2, 3, 4):
        for r in range(tp):
            local = torch.cat([gate.chunk(tp)[r], up.chunk(tp)[r]])  # GatedMLPMapping's layout
            for run in fc1_row_runs(12, tp, r):
                src = gate if run.part == "gate" else up
                n = run.stop - run.start
                assert torch.equal(local[run.local:run.local + n], src[run.start:run.stop])
    with pytest.raises(MegatronLayoutError, match="ffn_hidden_size / tp: 12 is not divisible by 5"):
        fc1_row_runs(12, 5, 0)


def test_vocab_padding_and_experts():
    assert padded_vocab_size(128256, 128, 8) == 129024  # Llama-3: ceil(V/1024)*1024
    assert padded_vocab_size(200, 1, 4) == 200
    Vp = padded_vocab_size(200, 128, 2)                 # 256: rank 1 holds 72 real rows
    assert [vocab_rows(200, Vp, 2, r) for r in range(2)] == [(0, 128), (128, 200)]
    assert vocab_rows(10, 16, 4, 3) == (10, 10)         # only padding: no piece
    assert list(local_expert_range(128, 8, 3)) == list(range(48, 64))


def test_stage_layers_follow_get_transformer_layer_offset():
    assert stage_layers(8, 2) == (((0, 1, 2, 3),), ((4, 5, 6, 7),))
    # vpp: chunk v of stage p starts at v*L/vpp + p*L/(pp*vpp)
    assert stage_layers(8, 2, 2) == (((0, 1), (4, 5)), ((2, 3), (6, 7)))
    assert stage_layers(6, 3, first=1, last=1) == (((0,),), ((1, 2, 3, 4),), ((5,),))
    with pytest.raises(MegatronLayoutError, match="middle stages need an equal share"):
        stage_layers(7, 3)


def test_grid_is_megatron_default_order():
    par = MegatronParallel(tp=2, pp=2, ep=2)  # etp = tp = 2, so dp = 2
    assert (par.etp, par.dp, par.edp, par.world) == (2, 2, 1, 8)
    assert par.dense_holders(1, 1) == (5, 7)       # tp_r + tp*(dp_r + dp*pp_r)
    assert par.expert_holders(0, 1, 0) == (2,)     # etp_r + etp*(ep_r + ep*(edp_r + edp*pp_r))
    with pytest.raises(MegatronLayoutError, match="not divisible by etp\\*ep"):
        MegatronParallel(tp=2, ep=4, dp=1)


def _plan(config, trainer, inference):
    from m2nkit.adapters.hf_checkpoint import checkpoint_metas, read_checkpoint
    from m2nkit.adapters.trainer_spec import parse_trainer_spec
    from m2nkit.adapters.vllm import destination_layout
    from m2nkit.engine.plan import build_plan

    ckpt = read_checkpoint(f"{EXAMPLES}/{config}/config.json")
    tspec = parse_trainer_spec(trainer)
    metas = checkpoint_metas(ckpt, tspec)
    return tspec, metas, build_plan(metas, tspec.num_ranks, destination_layout(
        ckpt.config, metas, inference))


@pytest.mark.parametrize("config,trainer,inference,ranks", [
    ("meta-llama__Llama-3.1-70B", "megatron:tp=8,pp=4", "vllm:tp=8", 32),
    ("Qwen__Qwen3-235B-A22B", "megatron:tp=4,pp=8,ep=8", "vllm:tp=8,ep", 256),
    ("mistralai__Mixtral-8x7B-v0.1", "megatron:tp=2,pp=2,vpp=2,ep=4,etp=1", "vllm:tp=4", 8),
])
def test_dry_run_plans_real_configs_at_the_minimum(config, trainer, inference, ranks):
    t0 = time.perf_counter()
    tspec, metas, plan = _plan(config, trainer, inference)
    assert time.perf_counter() - t0 < 60  # seconds on a loaded machine (about 1 s idle)
    assert tspec.num_ranks == ranks
    assert plan.problems == []
    assert plan.nbytes_moved == plan.nbytes_min
    by = {m.name: m for m in metas}
    if "Llama" in config:  # layer 79 on the last stage: ranks 24..31
        assert {p.rank for p in by["model.layers.79.mlp.down_proj.weight"].pieces} == set(
            range(24, 32))
        assert {p.rank for p in by["model.embed_tokens.weight"].pieces} == set(range(8))
    if "235B" in config:  # 94 layers over 8 stages: 11, 12 x 6, 11
        assert min(p.rank for p in by["model.layers.10.mlp.gate.weight"].pieces) < 32
        assert min(p.rank for p in by["model.layers.11.mlp.gate.weight"].pieces) >= 32


@pytest.mark.parametrize("spec,match", [
    ("megatron:tp=2,vpp=2", "vpp > 1 needs pp > 1"),
    ("megatron:tp=2,cp=2", "size 'cp' is not supported"),
    ("megatron:tp=x", "is not a positive integer"),
    ("megatron:tp=2,ep=4,dp=1", "not divisible by etp\\*ep"),
])
def test_bad_specs_are_refused_with_the_rule(spec, match):
    from m2nkit.adapters.trainer_spec import parse_trainer_spec

    with pytest.raises(ValueError, match=match):
        parse_trainer_spec(spec)


def test_split_the_model_cannot_take_names_the_value():
    # megatron-core's own rule (TransformerConfig), before any layout is computed
    with pytest.raises(ValueError, match=r"num_attention_heads \(64\) must be a multiple of tp \(3\)"):
        _plan("meta-llama__Llama-3.1-70B", "megatron:tp=3,pp=4", "vllm:tp=8")
    with pytest.raises(ValueError, match="has no Megatron-Core names"):
        _plan("google__gemma-2-2b-it", "megatron:tp=2", "vllm:tp=2")


@pytest.mark.parametrize("extra, match", [
    (["--trainer", "megatron:tp=2,pp=2,first=1"], "the demo builds even pipeline stages; first="),
    (["--trainer", "megatron:tp=2,pp=2", "--receiver", "vllm"],
     "--trainer megatron:... runs with --receiver stand-in only"),
    (["--trainer", "megatron:tp=2,vpp=2"], "vpp > 1 needs pp > 1"),
    (["--trainer", "megatron:tp=2", "--model", "tiny-qwen3-vl"],
     "Qwen3-VL: Megatron-Bridge 0.6.2 builds its vision tower with TransformerEngine only"),
    (["--trainer", "bridge:tp=2,ep=2", "--model", "tiny-qwen3-vl-moe"],
     "Qwen3-VL: Megatron-Bridge 0.6.2 builds its vision tower with TransformerEngine only"),
])
def test_megatron_demo_refuses_in_one_line(capsys, extra, match):
    """``m2nkit demo --trainer megatron:...`` refuses before starting anything: exit 2, one line."""
    from m2nkit.engine.tools.cli import main

    model = [] if "--model" in extra else ["--model", "tiny-qwen3"]
    code = main(["demo", *model, "--inference", "vllm:tp=2", *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert match in err and len(err.splitlines()) == 1, err


def test_an_empty_pipeline_stage_is_refused():
    """megatron-core refuses a stage without layers (``num_layers_in_first_pipeline_stage``
    "must be larger than 0"); so does the dry run, instead of planning one."""
    with pytest.raises(MegatronLayoutError, match="pipeline stage 0 would hold no layers"):
        stage_layers(4, 2, first=0)
    with pytest.raises(MegatronLayoutError, match="pipeline stage 0 would hold no layers"):
        stage_layers(2, 3, first=0, last=1)


@pytest.mark.parametrize("trainer, inference, match, how", [
    # megatron-core's own rules (m2nkit.adapters.megatron.spec.megatron_size_problem)
    # the real command spawns its driver for seconds: see pyproject.toml on integration
    pytest.param("megatron:pp=3", "vllm:tp=2", "2 layers do not split over pp*vpp=3", "cli",
                 marks=pytest.mark.integration),
    ("bridge:tp=3", "vllm:tp=2", "num_attention_heads (8) must be a multiple of tp (3)",
     "in-process"),
    # the workers' side: a tp the family's vLLM layout refuses (was found only inside
    # every trainer, once all were started: a fresh-user trial)
    ("megatron:tp=2", "vllm:tp=3", "cannot be laid out as vllm:tp=3", "in-process"),
    # expert parallelism on a dense model (was: every trainer failed after ~50 s, exit 1)
    ("megatron:ep=2", "vllm:tp=2", "ep=2 needs experts, and this model has none", "in-process"),
])
def test_megatron_demo_checks_the_model_before_starting_trainers(capsys, trainer, inference,
                                                                  match, how):
    """Sizes the tiny model (2 layers, 8 heads, hidden 128) cannot take fail with exit 2
    and one error line before any trainer process starts, as ``m2nkit plan`` refuses
    them, not later inside megatron-core with exit 1. Both trainer kinds reach the same
    check in the demo's driver (``run_bridge_demo``, after it built the tiny checkpoint):
    ``cli`` runs the real command (its supervisor starts the driver as a process, whose
    exit code it passes on); ``in-process`` calls the same ``main`` here, where stdout is
    pytest's capture and no file descriptor, so ``main`` does the driver's work in this
    process, which has torch loaded already."""
    import subprocess
    import sys

    args = ["demo", "--model", "tiny-qwen3", "--trainer", trainer, "--inference", inference,
            "--no-baseline"]
    if how == "cli":
        code = f"import sys; from m2nkit.engine.tools.cli import main; sys.exit(main({args!r}))"
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=240)
        rc, out = proc.returncode, proc.stdout + proc.stderr
    else:
        from transformers.utils import logging as hf_logging

        from m2nkit.engine.tools.cli import main

        verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
        try:
            rc = main(args)
        finally:            # the driver quiets transformers' logging in its process
            hf_logging.set_verbosity(verbosity)
            (hf_logging.enable_progress_bar if bars else hf_logging.disable_progress_bar)()
        captured = capsys.readouterr()
        out = captured.out + captured.err
    assert rc == 2, out
    errors = [line for line in out.splitlines() if line.startswith("m2nkit: error:")]
    assert len(errors) == 1 and match in errors[0], out
    assert "trainer processes" not in out and "Traceback" not in out, out


# --------------------------------------------------------------------------
# megatron_size_problem: what megatron-core 0.19.2 refuses, known before torch (issue 21)

_LLAMA = {"architectures": ["LlamaForCausalLM"], "num_attention_heads": 8,
          "num_key_value_heads": 2, "intermediate_size": 96, "num_hidden_layers": 4,
          "vocab_size": 200, "hidden_size": 128}
_MOE = {**_LLAMA, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 8,
        "moe_intermediate_size": 32, "intermediate_size": 90}


@pytest.mark.parametrize("config,sizes,loader,says", [
    ({**_LLAMA, "num_attention_heads": 6}, {"tp": 4}, "plan",
     "num_attention_heads (6) must be a multiple of tp (4)"),
    ({**_LLAMA, "num_key_value_heads": 3, "num_attention_heads": 12}, {"tp": 4}, "plan",
     "num_key_value_heads (3, megatron-core's num_query_groups) must be a multiple or a divisor"),
    ({**_LLAMA, "intermediate_size": 90}, {"tp": 4}, "plan",
     "intermediate_size (90, megatron-core's ffn_hidden_size) must be divisible by tp (4)"),
    (_MOE, {"tp": 1, "ep": 3, "dp": 3}, "plan",
     "the number of experts (8) must be divisible by ep (3)"),
    ({**_MOE, "moe_intermediate_size": 30}, {"tp": 4, "ep": 2}, "plan",
     "moe_intermediate_size (30, megatron-core's moe_ffn_hidden_size) must be divisible by etp (4)"),
    ({**_LLAMA, "vocab_size": 202}, {"tp": 4}, "bridge",
     "vocab_size (202) must be divisible by tp (4)"),
    (_LLAMA, {"tp": 1, "pp": 3}, "bridge", "4 layers do not split over pp*vpp=3"),
    # megatron-core: "num_moe_experts must be non None to use expert-parallel." (a trial:
    # plan accepted it and the demo failed inside every trainer after ~50 s, exit 1)
    (_LLAMA, {"tp": 2, "ep": 2}, "plan", "ep=2 needs experts, and this model has none"),
    # a multimodal config: the language model's sizes are under text_config
    ({"architectures": ["Qwen3VLForConditionalGeneration"], "text_config": _LLAMA,
      "vision_config": {"num_heads": 16}}, {"tp": 1, "ep": 2}, "plan",
     "ep=2 needs experts"),
    ({"architectures": ["Qwen3VLMoeForConditionalGeneration"],
      "text_config": {**_MOE, "num_attention_heads": 6}, "vision_config": {"num_heads": 16}},
     {"tp": 4}, "plan", "num_attention_heads (6) must be a multiple of tp (4)"),
])
def test_megatron_size_rules_name_the_value(config, sizes, loader, says):
    from m2nkit.adapters.megatron.spec import megatron_size_problem

    par = MegatronParallel(**sizes)
    why = megatron_size_problem(par, config, loader=loader)
    assert why is not None and says in why, why


@pytest.mark.parametrize("config,fits", [
    ({**_LLAMA, "num_attention_heads": 6}, "1, 2, 6"),            # 3: 2 KV heads vs 3
    ({**_LLAMA, "num_key_value_heads": 3, "num_attention_heads": 12}, "1, 3, 6, 12"),
    ({**_LLAMA, "intermediate_size": 90}, "1, 2"),                # 90 % 4, 90 % 8
])
def test_a_tp_refusal_lists_the_tp_that_fit(config, fits):
    """Worked out here from the heads, KV heads and FFN width: the tp of 1..heads that
    megatron-core's head and FFN rules take."""
    from m2nkit.adapters.megatron.spec import megatron_size_problem

    why = megatron_size_problem(MegatronParallel(tp=4), config, loader="plan")
    assert why.endswith(f"; tp that fits these rules: {fits}"), why


@pytest.mark.parametrize("config,sizes", [
    (_LLAMA, {"tp": 4}),                         # 2 KV heads: a divisor of tp=4 (replicated)
    (_LLAMA, {"tp": 2, "pp": 2}),
    (_MOE, {"tp": 2, "ep": 2}),                  # all layers MoE: the dense FFN (90) is never built
    ({**_LLAMA, "vocab_size": 202}, {"tp": 4}),  # plan: Megatron-LM pads the vocabulary
    # a multimodal MoE: its experts are under text_config (not "no experts")
    ({"architectures": ["Qwen3VLMoeForConditionalGeneration"], "text_config": _MOE,
      "vision_config": {"num_heads": 16}}, {"tp": 2, "ep": 2}),
])
def test_megatron_size_rules_accept_what_megatron_core_builds(config, sizes):
    from m2nkit.adapters.megatron.spec import megatron_size_problem

    loader = "plan" if config.get("vocab_size") == 202 else "bridge"
    assert megatron_size_problem(MegatronParallel(**sizes), config, loader=loader) is None


def test_plan_layout_refuses_what_megatron_core_refuses():
    from m2nkit.adapters.trainer_spec import parse_trainer_spec

    spec = parse_trainer_spec("megatron:tp=4")
    with pytest.raises(ValueError, match=r"num_attention_heads \(6\) must be a multiple of tp \(4\)"):
        spec.tp_dims({**_LLAMA, "num_attention_heads": 6, "hidden_size": 96, "head_dim": 16})


@pytest.mark.parametrize("name", ["tiny-deepseek-v3", "tiny-deepseek-v3-no-q-lora"])
def test_dry_run_lays_out_deepseek_v3_mla(name):
    """DeepSeek-V3's table (names.DEEPSEEK_V3, the live source reads Bridge's registry):
    MLA projections column-parallel as megatron-core's local spec builds them, the dense
    first layer on stage 0, the fp32 expert bias whole on the MoE layer's stage."""
    import torch

    from m2nkit.adapters.hf_checkpoint import checkpoint_metas, read_checkpoint
    from m2nkit.adapters.trainer_spec import parse_trainer_spec
    from m2nkit.adapters.vllm import destination_layout
    from m2nkit.engine.plan import build_plan

    ckpt = read_checkpoint(f"tests/data/oracle/{name}/checkpoint")
    tspec = parse_trainer_spec("megatron:tp=2,pp=2,ep=2")  # dp 2: ranks 0-3 stage 0, 4-7 stage 1
    metas = checkpoint_metas(ckpt, tspec)
    plan = build_plan(metas, tspec.num_ranks, destination_layout(ckpt.config, metas, "vllm:tp=2,ep"))
    assert plan.problems == [] and plan.nbytes_moved == plan.nbytes_min
    by = {m.name: m for m in metas}
    q = by["model.layers.0.self_attn." + ("q_proj" if "no-q" in name else "q_a_proj") + ".weight"]
    half = q.shape[0] // 2
    assert sorted({(p.rank, p.box[0]) for p in q.pieces}) == [
        (0, (0, half)), (1, (half, 2 * half)), (2, (0, half)), (3, (half, 2 * half))]
    kva = by["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"]  # [kv_lora + rope, H] = 40 rows
    assert sorted({(p.rank, p.box[0]) for p in kva.pieces}) == [
        (4, (0, 20)), (5, (20, 40)), (6, (0, 20)), (7, (20, 40))]
    bias = by["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32
    assert {p.rank for p in bias.pieces} == {4, 5, 6, 7}
    assert all(p.box == ((0, 8),) for p in bias.pieces)
    assert "model.layers.0.mlp.gate.weight" not in by  # layer 0 is dense
    assert {p.rank for p in by["model.layers.0.mlp.down_proj.weight"].pieces} == {0, 1, 2, 3}
    assert ("model.layers.0.self_attn.q_a_layernorm.weight" in by) == ("no-q" not in name)


def test_dry_run_lays_out_glm47_flash_with_deepseek_v3_names():
    """GLM-4.7-Flash (``Glm4MoeLiteForCausalLM``): Bridge's GLM47FlashBridge registry is
    DeepSeek-V3's (``deepseek/common.py``), so names.GLM4_MOE_LITE is names.DEEPSEEK_V3;
    MLA projections split over tp, layer 0 dense, the fp32 expert bias whole (4 experts)."""
    import torch

    from m2nkit.adapters.hf_checkpoint import checkpoint_metas, read_checkpoint
    from m2nkit.adapters.megatron import names
    from m2nkit.adapters.trainer_spec import parse_trainer_spec
    from m2nkit.adapters.vllm import destination_layout
    from m2nkit.engine.plan import build_plan

    assert names.megatron_names("Glm4MoeLiteForCausalLM") is names.DEEPSEEK_V3
    ckpt = read_checkpoint("tests/data/oracle/tiny-glm4-moe-lite/checkpoint")
    tspec = parse_trainer_spec("megatron:tp=2,pp=2,ep=2")  # dp 2: ranks 0-3 stage 0, 4-7 stage 1
    metas = checkpoint_metas(ckpt, tspec)
    plan = build_plan(metas, tspec.num_ranks, destination_layout(ckpt.config, metas, "vllm:tp=2,ep"))
    assert plan.problems == [] and plan.nbytes_moved == plan.nbytes_min
    by = {m.name: m for m in metas}
    qb = by["model.layers.0.self_attn.q_b_proj.weight"]  # [4 heads * 24, q_lora 16]
    assert sorted({(p.rank, p.box[0]) for p in qb.pieces}) == [
        (0, (0, 48)), (1, (48, 96)), (2, (0, 48)), (3, (48, 96))]
    kva = by["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"]  # [kv_lora 16 + rope 8, H]
    assert sorted({(p.rank, p.box[0]) for p in kva.pieces}) == [
        (4, (0, 12)), (5, (12, 24)), (6, (0, 12)), (7, (12, 24))]
    bias = by["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and {p.rank for p in bias.pieces} == {4, 5, 6, 7}
    assert all(p.box == ((0, 4),) for p in bias.pieces)
    assert "model.layers.0.mlp.gate.weight" not in by  # first_k_dense_replace: 1


def test_dry_run_of_glm5_is_refused_naming_the_family():
    """GLM-5 (DSA indexer) has no Megatron-Core table: megatron-core 0.19.2 builds DSA only
    with TransformerEngine (docs/megatron.md, Limits), so nothing here could check one."""
    from m2nkit.adapters.hf_checkpoint import checkpoint_metas, read_checkpoint
    from m2nkit.adapters.trainer_spec import parse_trainer_spec

    ckpt = read_checkpoint("tests/data/oracle/tiny-glm-moe-dsa/checkpoint")
    with pytest.raises(ValueError, match=r"GlmMoeDsaForCausalLM has no Megatron-Core names"):
        checkpoint_metas(ckpt, parse_trainer_spec("megatron:tp=2,pp=2"))


def test_dry_run_of_an_fp8_checkpoint_names_the_scale_tensor():
    # Megatron-Core trains bf16 weights: an fp8 checkpoint's block scales have no Megatron tensor
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.q_a_proj\.weight_scale_inv'"
                                         r" has no Megatron-Core name"):
        _plan("deepseek-ai__DeepSeek-V3", "megatron:tp=8,pp=8,ep=8", "vllm:tp=8,ep")


def test_dry_run_lays_out_glm4_moe():
    """GLM-4.5's table (dry run only: Bridge cannot load it with megatron-core's local spec):
    QKV with its bias interleaved per query group, q/k norms, the dense first layer, shared
    experts over tp, the fp32 expert bias whole."""
    import torch

    from m2nkit.adapters.hf_checkpoint import checkpoint_metas, read_checkpoint
    from m2nkit.adapters.trainer_spec import parse_trainer_spec
    from m2nkit.adapters.vllm import destination_layout
    from m2nkit.engine.plan import build_plan

    ckpt = read_checkpoint("tests/data/oracle/tiny-glm4-moe/checkpoint")
    tspec = parse_trainer_spec("megatron:tp=2,pp=2,ep=2")  # dp 2: ranks 0-3 stage 0, 4-7 stage 1
    metas = checkpoint_metas(ckpt, tspec)
    plan = build_plan(metas, tspec.num_ranks, destination_layout(ckpt.config, metas, "vllm:tp=2,ep"))
    assert plan.problems == [] and plan.nbytes_moved == plan.nbytes_min
    by = {m.name: m for m in metas}
    kb = by["model.layers.0.self_attn.k_proj.bias"]  # 2 KV heads over tp 2: one each
    half = kb.shape[0] // 2
    assert sorted({(p.rank, p.box[0]) for p in kb.pieces}) == [
        (0, (0, half)), (1, (half, 2 * half)), (2, (0, half)), (3, (half, 2 * half))]
    sh = by["model.layers.1.mlp.shared_experts.gate_proj.weight"]
    assert {p.rank for p in sh.pieces} == {4, 5, 6, 7}
    bias = by["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and {p.rank for p in bias.pieces} == {4, 5, 6, 7}
    assert "model.layers.0.mlp.gate.weight" not in by


def test_registry_rows_become_name_rows_by_bridge_kind():
    """adapters/megatron/registry.py's conversion of Bridge registry rows (no megatron needed):
    the kind of each mapping class, AutoMapping's kind from what the built module resolved,
    vocabulary tensors, routed experts, spellings of one tensor merged, rows m2nkit has no
    layout for left out."""
    from m2nkit.adapters.megatron.registry import RegistryRow, RegistryTable, registry_names

    d = "decoder.layers.{L}"
    wq = (("q", "q.{L}"), ("k", "k.{L}"), ("v", "v.{L}"))
    rows = (
        RegistryRow("embedding.word_embeddings.weight", "AutoMapping", "auto", "emb", False, None),
        RegistryRow(f"{d}.input_layernorm.weight", "AutoMapping", "auto", "ln.{L}", False, None),
        RegistryRow(f"{d}.self_attention.linear_qkv.layer_norm_weight", "AutoMapping", "auto",
                    "ln.{L}", False, None),
        RegistryRow(f"{d}.self_attention.linear_qkv.weight", "QKVMapping", "qkv", wq, False, None),
        RegistryRow(f"{d}.self_attention.linear_q_down_proj.weight", "AutoMapping", "auto",
                    "qa.{L}", False, None),
        RegistryRow(f"{d}.mlp.experts.local_experts.{{i}}.linear_fc1.weight", "GatedMLPMapping",
                    "gated", "gu.{L}", True, None),
        RegistryRow(f"{d}.mlp.experts.local_experts.{{i}}.linear_fc2.weight", "AutoMapping",
                    "auto", "dn.{L}", True, None),
        RegistryRow(f"{d}.mlp.router.expert_bias", "AutoMapping", "auto", "eb.{L}", False, None),
        RegistryRow(f"{d}.self_attention.conv1d.weight", "GDNConv1dMapping", None, "c.{L}",
                    False, None),
        RegistryRow(f"{d}.self_attention.linear_q_proj.weight", "AutoMapping", "auto", "q.{L}",
                    False, None),  # not in this model: no resolved kind
    )
    table = RegistryTable("TestBridge", rows)
    kinds = {rows[0].megatron: "column", rows[1].megatron: "replicated",
             rows[2].megatron: "replicated", rows[4].megatron: "column",
             rows[6].megatron: "row", rows[7].megatron: "replicated"}
    got = {e.megatron: (e.rule.name, e.wires, e.norm, e.buffer)
           for e in registry_names(table, kinds, buffers=frozenset({rows[7].megatron}))}
    assert got == {
        ("embedding.word_embeddings.weight",): ("vocab", {None: "emb"}, False, False),
        (rows[1].megatron, rows[2].megatron): ("replicated", {None: "ln.{L}"}, True, False),
        (rows[3].megatron,): ("qkv", dict(wq), False, False),
        (rows[4].megatron,): ("column", {None: "qa.{L}"}, False, False),
        (rows[5].megatron,): ("expert_fc1", {None: "gu.{L}"}, False, False),
        (rows[6].megatron,): ("expert_fc2", {None: "dn.{L}"}, False, False),
        (rows[7].megatron,): ("replicated", {None: "eb.{L}"}, False, True),
    }
    assert [r.mapping for r in table.unsupported] == ["GDNConv1dMapping"]
    assert table.row_of("decoder.layers.3.self_attention.conv1d.weight") is rows[8]
    assert table.row_of("decoder.layers.3.mlp.experts.local_experts.5.linear_fc2.weight") is rows[6]
    with pytest.raises(ValueError, match=r"TestBridge: routed-expert tensor .*linear_fc2.weight' "
                                         r"is column"):
        registry_names(table, {**kinds, rows[6].megatron: "column"})
