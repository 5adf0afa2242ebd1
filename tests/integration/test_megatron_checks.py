"""``megatron_source`` refusals on real GPTModels, its ``pg_collection`` path, and a forward check.

One launch of 4 gloo processes (megatron-core and Megatron-Bridge imported
once) builds three real models through Bridge and runs every case on them:

* Bad input seen by ONE rank only (a chunk list short of ``vpp`` on rank 1,
  a parameter no table maps on rank 2, a model config whose tp disagrees
  with the process group on rank 3, a ``rank=`` that is not the process's on
  rank 0), and one seen by every rank (a ``pg_collection`` whose ep group has
  4 ranks for ``ep=2``): every rank must raise ``MegatronSourceError`` with
  the same text, naming the rank(s) that found it and the root cause, and
  the ranks must still be in step afterwards (a barrier per case; a rank left
  waiting would hang the launch past its deadline).
* ``pg_collection``: ``ProcessGroupCollection.use_mpu_process_groups()`` on a
  MoE model (tp 2, ep 2: ``expt_tp``/``expt_dp`` differ from ``tp``/``dp``)
  gives the same manifest as ``parallel_state``; one without ``expt_dp``
  is refused naming the attribute.
* Logits: a tp=2 Megatron model (PP=1) loaded by Bridge, forwarded with an
  explicit causal mask (megatron-core builds its default one on CUDA), equals
  the transformers model of the same checkpoint within bf16 rounding; the
  same bound fails for an HF model with layer 0's q and k heads rolled by one
  KV group (a load wrong in that way would be caught).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

from tests.integration._megatron import Layout, build_model, init_megatron, launch

pytestmark = pytest.mark.integration

WORLD = 4
TOKENS, SEQ = 2, 16


def _attempt(fn):
    """``("ok", result)`` or ``("error", type name, message)``; then a barrier (ranks in step)."""
    import torch.distributed as dist

    try:
        out = ("ok", fn())
    except Exception as e:  # noqa: BLE001 - the test compares what each rank raised
        out = ("error", type(e).__name__, str(e))
    dist.barrier()
    return out


def _manifest(src):
    import torch.distributed as dist

    from m2nkit.manifest import manifest_to_json

    return manifest_to_json(src.metadata, dist.get_world_size())


def work(ckpts: dict, rank: int, out: Path) -> None:
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection

    from m2nkit.adapters import megatron_source

    res: dict = {}

    # --- dense pp2 vpp2 (dp 2): bad input on one rank each
    c = Layout("pp2vpp2", ckpts["dense4"], pp=2, vpp=2)
    init_megatron(c)
    bridge, model = build_model(c)
    hf = bridge.hf_pretrained.config
    res["good"] = _attempt(lambda: _manifest(megatron_source(model, config=hf)))
    chunks = model[:1] if rank == 1 else model
    res["vpp"] = _attempt(lambda: megatron_source(chunks, config=hf))
    gpt = model[0]
    while isinstance(getattr(gpt, "module", None), torch.nn.Module):  # Float16Module
        gpt = gpt.module
    layer = gpt.decoder.layers[0]
    if rank == 2:
        layer.mystery = torch.nn.Parameter(torch.zeros(3))
    res["unmapped"] = _attempt(lambda: megatron_source(model, config=hf))
    if rank == 2:
        del layer.mystery
    mcfg = gpt.config
    if rank == 3:
        mcfg.tensor_model_parallel_size = 2
    res["tp_size"] = _attempt(lambda: megatron_source(model, config=hf))
    if rank == 3:
        mcfg.tensor_model_parallel_size = 1
    res["rank_arg"] = _attempt(lambda: megatron_source(model, config=hf,
                                                       rank=1 if rank == 0 else rank))
    res["after"] = _attempt(lambda: _manifest(megatron_source(model, config=hf)))

    # --- MoE tp2 ep2 (dp 2, edp 1): the pg_collection path
    c = Layout("tp2ep2", ckpts["moe"], tp=2, ep=2)
    init_megatron(c)
    bridge, model = build_model(c)
    hf = bridge.hf_pretrained.config
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    res["pg_sizes"] = ("ok", {a: dist.get_world_size(getattr(pgs, a))
                              for a in ("tp", "pp", "dp", "ep", "expt_tp", "expt_dp")})
    res["moe_default"] = _attempt(lambda: _manifest(megatron_source(model, config=hf)))
    res["moe_pgs"] = _attempt(lambda: _manifest(megatron_source(model, config=hf,
                                                                pg_collection=pgs)))
    everyone = dist.new_group(list(range(WORLD)))
    bad = ProcessGroupCollection.use_mpu_process_groups()
    bad.ep = everyone
    res["pg_ep"] = _attempt(lambda: megatron_source(model, config=hf, pg_collection=bad))
    partial = ProcessGroupCollection.use_mpu_process_groups()
    del partial.expt_dp
    res["pg_missing"] = _attempt(lambda: megatron_source(model, config=hf, pg_collection=partial))

    # --- dense tp2 (dp 2), PP=1: logits
    c = Layout("tp2", ckpts["dense2"], tp=2)
    init_megatron(c)
    _, model = build_model(c)
    res["logits"] = ("ok", None)
    logits = _forward(model[0])
    if rank == 0:
        torch.save(logits, out / "logits.pt")
    dist.barrier()
    (out / f"r{rank}.json").write_text(json.dumps(res))


def _forward(model) -> torch.Tensor:
    """Full-vocabulary logits ``[b, s, Vp]`` of a tp-split GPTModel (fp32), explicit causal mask."""
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 200, (TOKENS, SEQ), generator=g)
    pos = torch.arange(SEQ).expand(TOKENS, -1)
    mask = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)[None, None]  # True = masked
    model.eval()
    with torch.no_grad():
        out = model(input_ids=tokens, position_ids=pos, attention_mask=mask)
        return gather_from_tensor_model_parallel_region(out).float()


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    from m2nkit.adapters.tiny import save_tiny_checkpoint, tiny_config

    root = tmp_path_factory.mktemp("megatron-checks")
    ckpts = {}
    for key, name, layers in (("dense4", "tiny-qwen3", 4), ("moe", "tiny-qwen3-moe", 2),
                              ("dense2", "tiny-llama", 2)):
        ckpts[key] = str(save_tiny_checkpoint(tiny_config(name, num_hidden_layers=layers),
                                              root / key, seed=3))
    _sharpen(Path(ckpts["dense2"]))
    out = root / "out"
    out.mkdir()
    wall = launch(WORLD, functools.partial(work, ckpts), out, timeout_s=300)
    print(f"one launch of {WORLD} Megatron ranks, 3 models: {wall:.1f} s")
    res = [json.loads((out / f"r{r}.json").read_text()) for r in range(WORLD)]
    return res, ckpts, out


def _sharpen(ckpt: Path) -> None:
    """Larger q, k and gate weights: peaked attention and a non-linear SiLU, so that a q/k or
    gate/up mix-up moves the logits far beyond bf16 rounding (at init scale it barely would)."""
    from safetensors.torch import load_file, save_file

    for f in ckpt.glob("*.safetensors"):
        sd = load_file(f)
        for k, v in sd.items():
            if k.endswith(("q_proj.weight", "k_proj.weight")):
                sd[k] = (v.float() * 6).to(v.dtype)
            elif k.endswith("gate_proj.weight"):
                sd[k] = (v.float() * 30).to(v.dtype)
        save_file(sd, f, metadata={"format": "pt"})


def _same_error(res, case):
    got = [r[case] for r in res]
    assert all(g[0] == "error" and g[1] == "MegatronSourceError" for g in got), (case, got)
    assert len({g[2] for g in got}) == 1, f"{case}: ranks raised different messages: {got}"
    return got[0][2]


@pytest.mark.parametrize("case, ranks, cause", [
    ("vpp", "rank 1 of 4", "1 model chunks given, but the model config has "
                           "virtual_pipeline_model_parallel_size=2"),
    ("unmapped", "rank 2 of 4", "parameter 'decoder.layers.0.mystery' (rank 2, chunk 0) has no "
                                "mapping in Megatron-Bridge Qwen3Bridge.mapping_registry()"),
    ("tp_size", "rank 3 of 4", "the tp process group has 1 ranks ([3]), but the model config "
                               "says tp=2"),
    ("rank_arg", "rank 0 of 4", "rank=1 was given, but this process is rank 0"),
    ("pg_ep", "ranks 0, 1, 2, 3 of 4", "the ep process group has 4 ranks ([0, 1, 2, 3]), but "
                                      "the model config says ep=2"),
    ("pg_missing", "ranks 0, 1, 2, 3 of 4", "pg_collection has no 'expt_dp' process group"),
])
def test_every_rank_raises_the_same_error_naming_the_rank(ran, case, ranks, cause):
    res, _, _ = ran
    msg = _same_error(res, case)
    assert msg.startswith(f"megatron_source: refused by {ranks} (every rank raises this"), msg
    assert cause in msg, msg
    assert "\n" not in msg


def test_ranks_stay_in_step_after_a_refusal(ran):
    res, _, _ = ran
    for case in ("good", "after"):
        assert all(r[case][0] == "ok" for r in res), [r[case] for r in res]
    docs = [r["after"][1] for r in res]
    assert all(d == docs[0] for d in docs) and docs[0] == res[0]["good"][1]


def test_pg_collection_gives_the_parallel_state_manifest(ran):
    res, _, _ = ran
    # tp 2, ep 2, dp 2 over 4 ranks: etp = tp = 2, edp = tp*dp/(etp*ep) = 1
    assert res[0]["pg_sizes"][1] == {"tp": 2, "pp": 1, "dp": 2, "ep": 2, "expt_tp": 2,
                                     "expt_dp": 1}
    for r in res:
        assert r["moe_pgs"][0] == "ok", r["moe_pgs"]
        assert r["moe_pgs"][1] == r["moe_default"][1] == res[0]["moe_default"][1]
    experts = [m for m in res[0]["moe_pgs"][1]["params"] if "experts.gate_up_proj" in m["name"]]
    assert experts, "the MoE manifest has no stacked experts"


def test_megatron_logits_match_the_hf_model(ran):
    from transformers import AutoModelForCausalLM

    _, ckpts, out = ran
    got = torch.load(out / "logits.pt")[..., :200]
    hf = AutoModelForCausalLM.from_pretrained(ckpts["dense2"], dtype=torch.bfloat16).eval()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 200, (TOKENS, SEQ), generator=g)
    with torch.no_grad():
        ref = hf(input_ids=tokens).logits.float()
        # bf16 keeps 8 significant bits and the two stacks round in different places; on
        # this model HF's own bf16 and fp32 logits differ by ~2% of the logit scale
        tol = 0.05 * ref.abs().max().item()
        diff = (got - ref).abs().max().item()
        assert diff <= tol, (diff, tol)
        assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9
        # the same bound catches what a wrong fused-QKV or [gate; up] split would do
        layer0 = hf.model.layers[0]
        hd = hf.config.head_dim
        q = layer0.self_attn.q_proj.weight
        saved = q.clone()
        q.copy_(q.roll(hd, 0))  # q heads shifted by one head
        wrong_q = (got - hf(input_ids=tokens).logits.float()).abs().max().item()
        q.copy_(saved)
        mlp = layer0.mlp
        gate = mlp.gate_proj.weight.clone()
        mlp.gate_proj.weight.copy_(mlp.up_proj.weight)  # gate and up swapped
        mlp.up_proj.weight.copy_(gate)
        wrong_fc1 = (got - hf(input_ids=tokens).logits.float()).abs().max().item()
        assert min(wrong_q, wrong_fc1) > 3 * tol, (diff, tol, wrong_q, wrong_fc1)
