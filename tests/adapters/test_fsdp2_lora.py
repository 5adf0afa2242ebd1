"""``fsdp2_source(model, merge_lora=True)`` against peft's own ``merge_and_unload()``.

peft LoRA models (tiny transformers models, seeded, random ``A`` and ``B`` so
the deltas are not zero) are sharded with real FSDP2 ``fully_shard`` in a
real multi-process gloo run over 3 ranks (every dim 0 splits unevenly);
each rank writes what ``fsdp2_source`` declares and yields. The expected
values come from peft alone: ``merge_and_unload()`` of a copy of the same
model, made before sharding. Every piece of every rank's merged local tensor
must equal the slice of peft's merged tensor its box names: bit for bit for
the fp32 model (two adapters, merged in order), within 1 ulp for the bf16
one (with ``lora_bias``). A LoRA adapter on a module the family does not
know is refused on every rank, alike, before any traffic.
"""

from __future__ import annotations

import copy
import json
import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from _procs import join_ranks
from m2nkit.adapters.fsdp2 import FSDP2SourceError, fsdp2_source
from m2nkit.adapters.tiny import tiny_config
from m2nkit.engine.tools.procs import free_port
from m2nkit.manifest import box_slices, manifest_from_json, manifest_to_json

peft = pytest.importorskip("peft")  # the dev extra installs it

WORLD = 3     # FSDP: every dim 0 splits unevenly
TP_WORLD = 4  # dp_shard=2 x tp=2
TIMEOUT_S = 150
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _randomise_lora(model, seed: int) -> None:
    """peft starts B at zero (a zero delta); give every adapter weight random values."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_((torch.randn(p.shape, generator=g) * 0.05).to(p.dtype))


def _llama_two_adapters():
    """fp32 Llama, adapters 'default' (r=8) and 'second' (r=4, rsLoRA scaling) both active."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(tiny_config("tiny-llama"), dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16,
                                                      target_modules=ALL_LINEAR))
    model.add_adapter("second", peft.LoraConfig(r=4, lora_alpha=8, use_rslora=True,
                                                target_modules=["q_proj", "down_proj"]))
    model.base_model.set_adapter(["default", "second"])
    _randomise_lora(model, 1)
    return model


def _qwen2_bf16_lora_bias():
    """bf16 Qwen2 (q/k/v biases), LoRA with ``lora_bias`` on q/k/v."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(tiny_config("tiny-qwen2"), dtype=torch.bfloat16)
    model = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=32, lora_bias=True,
                                                      target_modules=["q_proj", "k_proj", "v_proj"]))
    _randomise_lora(model, 2)
    return model


def _unknown_target():
    """A LoRA adapter on a module the Llama family does not know."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(tiny_config("tiny-llama"), dtype=torch.float32)
    base.model.layers[1].mlp.scorer = torch.nn.Linear(128, 16, bias=False)
    return peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "scorer"]))


def _expected(model) -> dict[str, torch.Tensor]:
    """peft's ``merge_and_unload()`` of a copy: the full merged weights by HF name."""
    merged = copy.deepcopy(model).merge_and_unload()
    return {n: p.detach().clone() for n, p in merged.named_parameters()}


def _tp_base_layers(model, tp_mesh):
    """TP on the LoRA layers' base linears (colwise q/k/v, gate/up; rowwise o, down); the
    adapters stay whole on every TP rank, so a colwise W's rows are not B's rows."""
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    for layer in model.base_model.model.model.layers:
        plan = {f"self_attn.{p}_proj.base_layer": ColwiseParallel() for p in "qkv"}
        plan.update({"mlp.gate_proj.base_layer": ColwiseParallel(),
                     "mlp.up_proj.base_layer": ColwiseParallel(),
                     "self_attn.o_proj.base_layer": RowwiseParallel(),
                     "mlp.down_proj.base_layer": RowwiseParallel()})
        parallelize_module(layer, tp_mesh, plan)


def _rank_main(rank, world, port, cases, refused, out):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=TIMEOUT_S // 2))
    try:
        if world == TP_WORLD:
            root = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp_shard", "tp"))
            mesh = root["dp_shard"]
        else:
            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
        for label, model in cases.items():  # forked: this process's own copies
            if world == TP_WORLD:
                _tp_base_layers(model, root["tp"])
            for layer in model.base_model.model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            src = fsdp2_source(model, merge_lora=True)
            for _ in range(2):  # a second round gathers again, same result
                stream = [(n, t.clone()) for n, t in src.iter_local()]
            b_gathers = sum(flag for t in src._lora._targets  # which path the merge took
                            for (_, part), flag in t.gather.items() if part == "B")
            torch.save({"manifest": manifest_to_json(src.metadata, world), "locals": stream,
                        "b_gathers": b_gathers}, Path(out) / f"{label}.r{rank}.pt")
        if refused is None:
            dist.barrier()
            return
        fully_shard(refused, mesh=mesh)
        try:
            fsdp2_source(refused, merge_lora=True)
            message = None
        except FSDP2SourceError as e:
            message = str(e)
        (Path(out) / f"refused.r{rank}.json").write_text(json.dumps(message))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in units in the last place between two bf16 tensors."""
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    ia = torch.where(ia < 0, -32768 - ia, ia)  # sign-magnitude to a monotone integer line
    ib = torch.where(ib < 0, -32768 - ib, ib)
    return int((ia - ib).abs().max()) if a.numel() else 0


def _run(world: int, cases: dict, refused, out: Path) -> None:
    import torch.distributed.fsdp  # noqa: F401  (once here, not once per forked rank)
    import torch.distributed.tensor.parallel  # noqa: F401

    join_ranks(mp.start_processes(_rank_main, args=(world, free_port(), cases, refused, str(out)),
                                  nprocs=world, join=False, start_method="fork"), TIMEOUT_S)


def _check(world: int, expected: dict, out: Path, fp32_ulps: int = 0) -> None:
    """Every piece of every rank's merged local tensor against peft's merged tensor."""
    for label, want in expected.items():
        payloads = [torch.load(out / f"{label}.r{r}.pt") for r in range(world)]
        docs = [p["manifest"] for p in payloads]
        assert all(d == docs[0] for d in docs), f"{label}: metadata differs between ranks"
        metas, _ = manifest_from_json(docs[0])
        assert [m.name for m in metas] == list(want), label  # the base model's names, in order
        for r, payload in enumerate(payloads):
            stream = dict(payload["locals"])
            for m in metas:
                for piece in m.source_pieces(world):
                    if piece.rank != r:
                        continue
                    got = stream[m.name][box_slices(piece.local_box)]
                    ref = want[m.name][box_slices(piece.box)].to(m.dtype)
                    if m.dtype == torch.float32 and not fp32_ulps:
                        assert torch.equal(got, ref), (label, m.name, r)
                    elif m.dtype == torch.float32:
                        assert _ulps32(got, ref) <= fp32_ulps, (label, m.name, r, _ulps32(got, ref))
                    else:
                        assert _ulps(got, ref) <= 1, (label, m.name, r, _ulps(got, ref))


def _ulps32(a: torch.Tensor, b: torch.Tensor) -> int:
    ia, ib = a.view(torch.int32).long(), b.view(torch.int32).long()
    ia = torch.where(ia < 0, -(2**31) - ia, ia)
    ib = torch.where(ib < 0, -(2**31) - ib, ib)
    return int((ia - ib).abs().max()) if a.numel() else 0


def test_merge_lora_matches_peft_merge_and_unload_on_every_shard(tmp_path):
    cases = {"llama-fp32": _llama_two_adapters(), "qwen2-bf16": _qwen2_bf16_lora_bias()}
    expected = {label: _expected(m) for label, m in cases.items()}
    _run(WORLD, cases, _unknown_target(), tmp_path)
    _check(WORLD, expected, tmp_path)
    assert torch.load(tmp_path / "llama-fp32.r0.pt")["b_gathers"] == 0  # B's rows are W's
    # the merge really changed the weights that carry adapters
    base = cases["llama-fp32"].get_base_model().model.layers[0].self_attn.q_proj.base_layer
    assert not torch.equal(expected["llama-fp32"]["model.layers.0.self_attn.q_proj.weight"],
                           base.weight.detach())

    messages = [json.loads((tmp_path / f"refused.r{r}.json").read_text()) for r in range(WORLD)]
    assert messages[0] is not None and all(m == messages[0] for m in messages)
    assert "LoRA layer 'base_model.model.model.layers.1.mlp.scorer'" in messages[0]
    assert "maps to no LlamaForCausalLM tensor vLLM takes" in messages[0]
    assert "closest known name is 'model.layers.1.mlp." in messages[0]


def test_lora_weights_without_merge_lora_point_at_it():
    model = _qwen2_bf16_lora_bias()
    with pytest.raises(FSDP2SourceError, match=r"lora_A\.default\.weight.*pass merge_lora=True"):
        fsdp2_source(model, rank=0)
    # an unsharded model merges too (every rank holds the whole tensor)
    want = _expected(model)
    got = dict(fsdp2_source(model, rank=0, merge_lora=True).iter_local())
    assert list(got) == list(want)
    for name, t in got.items():
        assert _ulps(t, want[name]) <= 1, name


def test_dora_is_refused():
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_config(tiny_config("tiny-llama"), dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, use_dora=True, target_modules=["q_proj"]))
    with pytest.raises(FSDP2SourceError, match="adapter 'default' is a LoRA variant"):
        fsdp2_source(model, rank=0, merge_lora=True)


def test_merge_lora_under_fsdp_plus_tp(tmp_path):
    """FSDP ``dp_shard=2`` x TP ``tp=2`` on the base linears, the adapters whole over TP:
    a colwise ``W``'s rows are TP then FSDP chunks, ``B``'s only FSDP chunks, so ``B`` is
    gathered (the path plain FSDP never takes); a rowwise ``W`` takes a column block of
    ``A``. The row and column blocks of ``B @ A`` come from another BLAS call than peft's
    whole product, so fp32 is held to 1 ulp here (bit for bit on the development
    machine) rather than bit for bit."""
    model = _llama_two_adapters()
    expected = {"llama-tp": _expected(model)}
    _run(TP_WORLD, {"llama-tp": model}, None, tmp_path)
    _check(TP_WORLD, expected, tmp_path, fp32_ulps=1)
    assert torch.load(tmp_path / "llama-tp.r0.pt")["b_gathers"] > 0
