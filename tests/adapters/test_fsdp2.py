"""``fsdp2_source`` on real ``fully_shard`` models, in real multi-process gloo runs.

Every model is built here (transformers ``from_config``, tiny sizes, seeded),
saved with ``save_pretrained`` *before* sharding, and handed to forked rank
processes that shard it (FSDP2 ``fully_shard``, HSDP, TP via
``parallelize_module``, experts on dim 1 via ``shard_placement_fn``) and
write what ``fsdp2_source`` declares and yields. Expected values come only
from that saved checkpoint (``read_checkpoint(...).read_full``, i.e. slices
of the full tensors made before sharding) and from ``reference_load`` of it
(the stand-in for vLLM's loaders, itself pinned to real vLLM dumps); never
from the code under test:

* metadata is identical on every rank;
* every piece of every rank's local tensor (the real ``to_local()`` data,
  cast) equals the slice of the full wire tensor its box names;
* the planner plus the in-process executor, fed with the ranks' streams,
  fill every vLLM layout of the list bit-exact against ``reference_load``.

One process group per mesh kind checks all its models; processes are forked
(the models are built once in the parent), bound to 127.0.0.1, joined with a
deadline and killed if they outlive it.
"""

from __future__ import annotations

import copy
import json
import os
import re
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st

from m2nkit.adapters.fsdp2 import FSDP2SourceError, dtensor_box, fsdp2_source
from m2nkit.adapters.hf_checkpoint import CheckpointError, full_checkpoint_tensors, read_checkpoint
from m2nkit.adapters.module_names import strip_wrappers, wrapper_hint
from m2nkit.adapters.tiny import tiny_config
from m2nkit.adapters.vllm import destination_layout, reference_load
from m2nkit.engine.in_process import allocate_storage, bitwise_equal, execute_plan
from m2nkit.engine.plan import build_plan
from m2nkit.engine.tools.procs import free_port
from _procs import join_ranks
from m2nkit.manifest import Replicate, Shard, box_slices, manifest_from_json, manifest_to_json

TIMEOUT_S = 150
DENSE = ("tiny-llama", "tiny-qwen2", "tiny-qwen3")
MOE = ("tiny-qwen3-moe", "tiny-mixtral")
DENSE_SPECS = ("vllm:tp=1", "vllm:tp=2,dp=2", "vllm:tp=8")
MOE_SPECS = ("vllm:tp=2", "vllm:tp=2,dp=2,ep", "vllm:tp=4")
OTHER_SPECS = ("vllm:tp=1", "vllm:tp=2")


def _other_families() -> tuple[tuple[str, bool], ...]:
    """The first tiny model of every other registered family, and whether its experts are
    stacked in memory (the registry grows: each new family is checked here too)."""
    from m2nkit.adapters.families import ARCHITECTURES, family

    out = []
    for arch in ARCHITECTURES:
        fam = family(arch)
        names = [n for n in fam.tiny if "fp8" not in n]
        if names and not set(fam.tiny) & {*DENSE, *MOE}:
            out.append((names[0], bool(fam.hf.fused_experts or getattr(fam.hf, "permuted", {}))))
    return tuple(out)


OTHERS = _other_families()

class _KeptFP32(dict):
    """tiny model -> regex of the wire names transformers keeps in fp32 whatever the model
    dtype: the model class's own ``_keep_in_fp32_modules_strict`` (DeepSeek-V3: its
    ``e_score_correction_bias``, and from transformers 5.2x on its router ``gate.weight``
    too, ``modeling_deepseek_v3.py``); ``""`` when it declares none."""

    def __missing__(self, name: str) -> str:
        from m2nkit.adapters.tiny import build_model

        with torch.device("meta"):
            cls = type(build_model(tiny_config(name)))
        keep = sorted(getattr(cls, "_keep_in_fp32_modules_strict", None) or ())
        self[name] = "|".join(r"(^|\.)" + re.escape(k) + "$" for k in keep)
        return self[name]

    def get(self, name, default=None):
        return self[name]


_KEPT_FP32 = _KeptFP32()


# --------------------------------------------------------------------------
# names


@pytest.mark.parametrize("name,clean", [
    ("_orig_mod.model.norm.weight", "model.norm.weight"),
    ("model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight",
     "model.layers.0.mlp.up_proj.weight"),
    ("_fsdp_wrapped_module.model.layers.1._fsdp_wrapped_module.input_layernorm.weight",
     "model.layers.1.input_layernorm.weight"),
    ("module.model.embed_tokens.weight", "model.embed_tokens.weight"),
    ("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight",
     "model.layers.0.self_attn.q_proj.weight"),
    ("module._orig_mod.base_model.model.lm_head.weight", "lm_head.weight"),
    ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.gate_up_proj"),
])
def test_wrapper_prefixes_are_stripped(name, clean):
    assert strip_wrappers(name) == clean


def test_peft_shaped_wrappers_reach_the_family_names():
    # PEFT's module structure (PeftModel.base_model -> LoraModel.model -> the HF model;
    # LoRA layers keep the original as .base_layer) rebuilt with plain modules; the names
    # are what peft produces (tests/adapters/test_fsdp2_lora.py runs real peft).
    from transformers import AutoModelForCausalLM

    cfg = tiny_config("tiny-llama")
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg)
    attn = hf.model.layers[0].self_attn
    lora = torch.nn.Module()
    lora.base_layer = attn.q_proj
    attn.q_proj = lora
    outer = torch.nn.Module()
    outer.base_model = torch.nn.Module()
    outer.base_model.model = hf
    src = fsdp2_source(outer, rank=0)
    names = [m.name for m in src.metadata]
    assert names == [n for n, _ in AutoModelForCausalLM.from_config(cfg).named_parameters()]
    assert "model.layers.0.self_attn.q_proj.weight" in names
    got = dict(src.iter_local())
    assert torch.equal(got["model.layers.0.self_attn.q_proj.weight"], lora.base_layer.weight)
    # a LoRA-named weight outside a layer shaped like peft's LoraLayer is refused, naming it
    lora.lora_A = torch.nn.ModuleDict({"default": torch.nn.Linear(128, 4, bias=False)})
    with pytest.raises(FSDP2SourceError, match="lora_A.default.weight.*LoRA adapter"):
        fsdp2_source(outer, rank=0)


def test_unknown_name_names_the_closest_known_one():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tiny_config("tiny-qwen3"))
    model.model.layers[1].self_attn.register_parameter(
        "q_scale", torch.nn.Parameter(torch.ones(16)))
    with pytest.raises(FSDP2SourceError) as info:
        fsdp2_source(model, rank=0)
    msg = str(info.value)
    assert "'model.layers.1.self_attn.q_scale'" in msg
    assert "closest known name is 'model.layers.1.self_attn.q_proj.weight'" in msg


def test_checkpoint_saved_from_a_compiled_model_points_at_the_prefix(tiny_checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    src = tiny_checkpoints("tiny-qwen3")
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    save_file({f"_orig_mod.{k}": v for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError) as info:
        read_checkpoint(tmp_path)
    msg = str(info.value)
    assert "'_orig_mod.' (torch.compile)" in msg
    m = re.search(r"e\.g\. '_orig_mod\.([\w.]+)' is '([\w.]+)'", msg)
    assert m and m.group(1) == m.group(2), msg
    assert wrapper_hint(["model.norm.weight"]) == ""


def test_wire_dtype_rule_and_override_on_a_plain_model():
    from transformers import AutoModelForCausalLM

    from m2nkit.adapters.fsdp2 import wire_dtype_rule

    bf, f32 = torch.bfloat16, torch.float32
    assert wire_dtype_rule("x", f32, policy_dtype=bf, dtype=None, keep_fp32=False) == bf
    assert wire_dtype_rule("x", f32, policy_dtype=bf, dtype=torch.float16, keep_fp32=False) \
        == torch.float16
    assert wire_dtype_rule("x", bf, policy_dtype=bf, dtype=None, keep_fp32=True) == f32
    assert wire_dtype_rule("x", torch.int64, policy_dtype=bf, dtype=bf, keep_fp32=False) \
        == torch.int64
    assert wire_dtype_rule("x", f32, policy_dtype=None, dtype=None, keep_fp32=False) == f32
    # an unsharded model: every parameter replicated over the T ranks, cast in the provider
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("tiny-qwen3"), dtype=f32)
    src = fsdp2_source(model, dtype=bf, num_trainer_ranks=2, rank=1)
    assert {(m.dtype, m.owners) for m in src.metadata} == {(bf, None)}
    params = dict(model.named_parameters())
    for name, t in src.iter_local():
        assert bitwise_equal(t, params[name].detach().to(bf)), name


# --------------------------------------------------------------------------
# transformers' in-memory experts are the wire layout


@pytest.mark.parametrize("name", MOE)
def test_transformers_keeps_experts_fused_in_the_wire_layout(name, tmp_path):
    """In memory ``experts.gate_up_proj [E, 2*Im, H]`` and ``down_proj [E, H, Im]``;
    ``save_pretrained`` writes per-expert tensors with ``gate_up_proj[e] = cat(gate_e,
    up_e)`` and ``down_proj[e] = down_e`` (checked with the installed transformers)."""
    import transformers
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from m2nkit.adapters.families import family_for

    cfg = tiny_config(name)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path)
    disk = load_file(str(tmp_path / "model.safetensors"))
    hf = family_for(cfg).hf
    E, Im, H = cfg.num_experts if name == "tiny-qwen3-moe" else cfg.num_local_experts, \
        cfg.moe_intermediate_size if name == "tiny-qwen3-moe" else cfg.intermediate_size, \
        cfg.hidden_size
    experts = model.model.layers[0].mlp.experts
    assert tuple(experts.gate_up_proj.shape) == (E, 2 * Im, H), transformers.__version__
    assert tuple(experts.down_proj.shape) == (E, H, Im), transformers.__version__
    prefix = hf.disk_name("model.layers.0.mlp.experts.x")[: -len(".experts.x")]
    for e in range(E):
        gate, up, down = (disk[hf.experts_on_disk[p].format(prefix=prefix, e=e)]
                          for p in ("gate", "up", "down"))
        assert torch.equal(experts.gate_up_proj[e], torch.cat([gate, up]))
        assert torch.equal(experts.down_proj[e], down)


# --------------------------------------------------------------------------
# the box rule, against a simulation of FSDP2 over TP with torch.chunk


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 40), tp=st.integers(1, 4), dp=st.integers(1, 5))
def test_strided_rule_is_fsdp2_chunking_the_tp_shard(n, tp, dp):
    """FSDP2 + TP: TP ``Shard(0)`` chunks the rows (``torch.chunk``), FSDP2 chunks each
    TP rank's rows again (``_fsdp_param.py``), placements ``(_StridedShard(0, sf=tp),
    Shard(0))`` on the ``(dp, tp)`` mesh. Simulated on ``arange`` rows."""
    from torch.distributed.tensor import Shard as TShard
    from torch.distributed.tensor.placement_types import _StridedShard

    rows = torch.arange(n)
    placements = (_StridedShard(0, split_factor=tp), TShard(0))
    for j in range(tp):
        tp_rows = list(torch.chunk(rows, tp)) + [rows[:0]] * tp
        for i in range(dp):
            dp_rows = list(torch.chunk(tp_rows[j], dp)) + [rows[:0]] * dp
            held = dp_rows[i].tolist()
            (a, b), = dtensor_box((n,), (dp, tp), placements, (i, j))
            assert list(range(a, b)) == held, (n, tp, dp, i, j)


# --------------------------------------------------------------------------
# the multi-process harness


@dataclass
class Case:
    """One model a mesh kind shards: built and saved here, sharded in every rank."""

    label: str
    model: torch.nn.Module
    ref_dir: Path
    config: object               # for destination_layout / reference_load (vLLM dtype bf16)
    specs: tuple[str, ...]
    wrap: str = ""               # "compile+ac": activation checkpointing + torch.compile
    fp32: str = ""               # regex of wire names expected in fp32 (the rest: bf16)


class _Expert(torch.nn.Module):
    def __init__(self, gate, up, down):
        super().__init__()
        kw = {"bias": False, "dtype": gate.dtype}
        self.gate_proj = torch.nn.Linear(gate.shape[1], gate.shape[0], **kw)
        self.up_proj = torch.nn.Linear(up.shape[1], up.shape[0], **kw)
        self.down_proj = torch.nn.Linear(down.shape[1], down.shape[0], **kw)
        with torch.no_grad():
            self.gate_proj.weight.copy_(gate)
            self.up_proj.weight.copy_(up)
            self.down_proj.weight.copy_(down)


def _per_expert_modules(model):
    """The model with each fused ``mlp.experts`` replaced by per-expert modules (old layout)."""
    model = copy.deepcopy(model)
    for layer in model.model.layers:
        fused = layer.mlp.experts
        half = fused.gate_up_proj.shape[1] // 2
        layer.mlp.experts = torch.nn.ModuleList(
            _Expert(fused.gate_up_proj[e, :half].detach(), fused.gate_up_proj[e, half:].detach(),
                    fused.down_proj[e].detach()) for e in range(fused.gate_up_proj.shape[0]))
    return model


_BUILT: dict = {}


def _build(name: str, dtype: torch.dtype, tmp: Path):
    """(model, checkpoint dir, config for vLLM) of a tiny model, saved before any sharding."""
    from m2nkit.adapters.tiny import build_model, save_model

    key = (name, dtype)
    if key not in _BUILT:
        cfg = tiny_config(name)
        torch.manual_seed(1)
        model = build_model(copy.deepcopy(cfg), dtype=dtype)
        with torch.no_grad():  # norms start at 1.0: randomise them, as tiny checkpoints do
            for p in model.parameters():
                if p.dim() == 1:
                    p.copy_(torch.randn_like(p))
        out = tmp / f"{name}-{str(dtype).removeprefix('torch.')}"
        save_model(model, out)   # stacked experts in the published order (Qwen3-VL-MoE)
        cfg.dtype = torch.bfloat16  # vLLM's parameters: bf16 either way
        _BUILT[key] = (model, out, cfg)
    return _BUILT[key]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp2_models")
    return lambda name, dtype=torch.bfloat16: _build(name, dtype, tmp)


def _run_ranks(world: int, kind: str, cases: list[Case], out: Path) -> float:
    # import once here, not once per forked rank
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor.parallel  # noqa: F401
    if any(c.wrap for c in cases):
        import torch.distributed.algorithms._checkpoint.checkpoint_wrapper  # noqa: F401

        torch.compile(torch.nn.Linear(1, 1), backend="eager")  # its lazy imports, once
    ctx = mp.start_processes(_rank_main, args=(world, free_port(), kind, cases, str(out)),
                             nprocs=world, join=False, start_method="fork")
    return join_ranks(ctx, TIMEOUT_S, kind)


def _rank_main(rank, world, port, kind, cases, out):
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=TIMEOUT_S // 2))
    try:
        mesh = _mesh(kind, world)
        out = Path(out)
        llama = [c.model for c in cases if c.label == "tiny-llama"][:1] if kind == "fsdp" else []
        spare = [copy.deepcopy(m) for m in llama * 2]  # unsharded copies for the bad inputs
        for case in cases:
            model = _shard(kind, case, mesh)
            src = fsdp2_source(model)
            assert src.rank == rank and src.num_trainer_ranks == world
            torch.save({"manifest": manifest_to_json(src.metadata, world),
                        "locals": [(n, t.clone()) for n, t in src.iter_local()]},
                       out / f"{case.label}.r{rank}.pt")
        if kind == "fsdp":
            extra = {**_bad_inputs(cases, spare, mesh, world), **_uneven_fsdp(mesh)}
        elif kind == "tp":
            extra = _uneven_strided(mesh)
        else:
            extra = None
        if extra is not None:
            (out / f"extra.r{rank}.json").write_text(json.dumps(extra))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _mesh(kind: str, world: int):
    from torch.distributed.device_mesh import init_device_mesh

    if kind == "hsdp":
        return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    if kind == "tp":
        return init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp_shard", "tp"))
    return init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))


def _shard(kind: str, case: Case, mesh):
    """This rank's copy of ``case.model``, sharded the way the mesh kind says."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = case.model  # forked: this process's own copy
    kw = {}
    if model.dtype == torch.float32:  # fp32 masters, bf16 compute
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    if kind == "experts":
        from torch.distributed.tensor import Shard

        # stacked experts [E, out, in]; not a Gated DeltaNet conv1d [C, 1, K]
        kw["shard_placement_fn"] = lambda p: (Shard(1) if p.dim() == 3 and p.shape[1] > 1
                                              else None)
    if kind == "tp":
        _tensor_parallel(model, mesh["tp"])
        mesh = mesh["dp_shard"]
    # a multimodal wrapper's decoder layers are its language model's (Llama-4's wrapper
    # holds a whole Llama4ForCausalLM as language_model)
    base = model.model if hasattr(model, "model") else model.language_model.model
    layers = base.layers if hasattr(base, "layers") else base.language_model.layers
    if case.wrap:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i in range(len(layers)):
            layers[i] = checkpoint_wrapper(layers[i])
    for layer in layers:
        fully_shard(layer, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return torch.compile(model, backend="eager") if case.wrap else model  # same wrapper, no inductor


def _tensor_parallel(model, tp_mesh):
    """The family's TP plan (``Family.tp_plan``, the one ``m2nkit plan --trainer
    fsdp2:...,tp=T`` and the demo use): q/k/v and gate/up colwise, o/down rowwise,
    embedding rowwise and lm_head colwise (untied models); MoE experts and routers stay
    FSDP-only."""
    from m2nkit.adapters.tensor_parallel import apply_tp_plan

    apply_tp_plan(model, tp_mesh)


def _bad_inputs(cases, spare, mesh, world):
    """Every rank must refuse the same way, before any traffic."""
    from torch.distributed.fsdp import fully_shard

    out = {}
    base = next(c for c in cases if c.label == "tiny-llama").model  # sharded above
    try:
        fsdp2_source(base, num_trainer_ranks=world - 1)
    except FSDP2SourceError as e:
        out["mesh"] = str(e)
    src = fsdp2_source(base)
    base.unshard()  # the root group's parameters gathered, as inside forward
    try:
        list(src.iter_local())
    except FSDP2SourceError as e:
        out["unsharded"] = str(e)
    base.reshard()
    assert len(list(src.iter_local())) == len(src.owned_names())
    partial, extra = spare
    for layer in partial.model.layers:  # the root module left unsharded
        fully_shard(layer, mesh=mesh)
    try:
        fsdp2_source(partial)
    except FSDP2SourceError as e:
        out["plain"] = str(e)
    extra.model.layers[0].mlp.register_parameter("gate_bias", torch.nn.Parameter(torch.zeros(8)))
    fully_shard(extra, mesh=mesh)
    try:
        fsdp2_source(extra)
    except FSDP2SourceError as e:
        out["unknown"] = str(e)
    return out


def _uneven_fsdp(mesh):
    """4 rows over 3 ranks: FSDP2 pads every rank's storage to ceil(4/3) = 2 rows, but
    ``to_local()`` is the unpadded torch.chunk: 2, 2 and 0 rows."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(4)
    m = torch.nn.Linear(3, 4)
    full = m.weight.detach().clone()
    fully_shard(m, mesh=mesh)
    (fp,) = m._get_fsdp_state()._fsdp_param_groups[0].fsdp_params[:1]
    box = dtensor_box((4, 3), tuple(mesh.shape), m.weight.placements,
                      mesh.get_coordinate(), name="weight")
    assert torch.equal(m.weight.to_local(), full[box_slices(box)])
    return {"uneven": {"box": [list(iv) for iv in box],
                       "local": list(m.weight.to_local().shape),
                       "padded": list(fp.padded_sharded_param_size)}}


def _uneven_strided(mesh):
    """FSDP + TP on shapes where the split is uneven (7 rows over tp=2 then dp=3):
    ``dtensor_box`` against the real ``to_local()`` rows."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    torch.manual_seed(3)
    m = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 9))
    full = {n: p.detach().clone() for n, p in m.named_parameters()}
    parallelize_module(m, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
    fully_shard(m, mesh=mesh["dp_shard"])
    held = {}
    for n, p in m.named_parameters():
        box = dtensor_box(tuple(p.shape), tuple(p.device_mesh.shape), p.placements,
                          p.device_mesh.get_coordinate(), name=n)
        assert torch.equal(p.to_local(), full[n][box_slices(box)]), (n, box)
        held[n] = [list(iv) for iv in box]
    return held


def _verify(kind: str, world: int, cases: list[Case], out: Path) -> dict:
    """Check every rank's output against the checkpoints saved before sharding."""
    layouts = {}
    for case in cases:
        payloads = [torch.load(out / f"{case.label}.r{r}.pt") for r in range(world)]
        docs = [p["manifest"] for p in payloads]
        assert all(d == docs[0] for d in docs), f"{case.label}: metadata differs between ranks"
        metas, T = manifest_from_json(docs[0])
        assert T == world
        ckpt = read_checkpoint(case.ref_dir)
        assert [m.name for m in metas] == ckpt.names, case.label  # same wire tensors, same order
        for m in metas:
            fp32 = bool(case.fp32) and re.search(case.fp32, m.name) is not None
            assert m.dtype == (torch.float32 if fp32 else torch.bfloat16), (case.label, m.name)
        full = {m.name: ckpt.read_full(m.name).to(m.dtype) for m in metas}
        for r, p in enumerate(payloads):
            stream = dict(p["locals"])
            for m in metas:
                for piece in m.source_pieces(world):
                    if piece.rank == r:
                        assert bitwise_equal(stream[m.name][box_slices(piece.local_box)],
                                             full[m.name][box_slices(piece.box)]), \
                            (case.label, m.name, r, piece)
        layouts[case.label] = {m.name: type(m.layout).__name__ for m in metas}
        # vLLM receives the wire's values: where the wire is bf16 (fp32 masters under a
        # bf16 policy) a parameter vLLM keeps in float32 (the DSA indexer's k_norm) holds
        # them rounded, so the reference loads the checkpoint as the wire carries it
        tensors = {n: t if not t.is_floating_point() or t.dtype != torch.float32 or (
                       case.fp32 and re.search(case.fp32, n)) else t.to(torch.bfloat16)
                   for n, t in full_checkpoint_tensors(ckpt).items()}
        for spec in case.specs:
            dest = destination_layout(case.config, metas, spec)
            plan = build_plan(metas, world, dest)
            assert plan.problems == [], (case.label, spec, plan.problems[:3])
            assert plan.nbytes_moved == plan.nbytes_min
            storage = {w: allocate_storage(dest, w) for w in range(dest.num_workers)}
            execute_plan(plan, {r: iter(payloads[r]["locals"]) for r in range(world)}, storage)
            for w, params in storage.items():
                ref = reference_load(case.config, tensors, spec, w, fill=float("nan"))
                for pname, t in params.items():
                    assert bitwise_equal(t, ref[pname]), (case.label, spec, w, pname)
    return layouts


# --------------------------------------------------------------------------
# the four mesh kinds


@pytest.mark.integration  # spawns processes for seconds: see pyproject.toml
def test_fsdp_1d_uneven_with_wrappers_and_per_expert_modules(built, tmp_path):
    """world 3 (every dim 0 of these models splits unevenly), bf16 parameters; Qwen2 wrapped
    in activation checkpointing + torch.compile; Qwen3-MoE also with per-expert modules
    (re-fused rank-locally); tied embeddings sent once; bad inputs refused on every rank."""
    world = 3
    cases = []
    for name in (*DENSE, "tiny-qwen3-tied", *MOE):
        model, ref, cfg = built(name)
        cases.append(Case(name, model, ref, cfg, MOE_SPECS if name in MOE else DENSE_SPECS,
                          wrap="compile+ac" if name == "tiny-qwen2" else ""))
    model, ref, cfg = built("tiny-qwen3-moe")
    cases.append(Case("per-expert", _per_expert_modules(model), ref, cfg, MOE_SPECS[:2]))
    for name, _ in OTHERS:
        model, ref, cfg = built(name)
        cases.append(Case(name, model, ref, cfg, OTHER_SPECS, fp32=_KEPT_FP32.get(name, "")))
    seconds = _run_ranks(world, "fsdp", cases, tmp_path)
    layouts = _verify("fsdp", world, cases, tmp_path)
    tied = read_checkpoint(built("tiny-qwen3-tied")[1])
    assert "lm_head.weight" not in tied.names  # sent once, as model.embed_tokens.weight
    assert layouts["per-expert"]["model.layers.0.mlp.experts.gate_up_proj.weight"] == "PieceLayout"
    assert layouts["tiny-llama"]["model.layers.0.mlp.up_proj.weight"] == "SourceLayout"
    errors = [json.loads((tmp_path / f"extra.r{r}.json").read_text()) for r in range(world)]
    refusals = [{k: v for k, v in e.items() if k != "uneven"} for e in errors]
    assert all(e == refusals[0] for e in refusals), "ranks refused differently"
    assert "outside the trainer world of 2 ranks" in errors[0]["mesh"]
    assert "'model.embed_tokens.weight' is a plain tensor" in errors[0]["plain"]
    assert "'model.embed_tokens.weight' is not sharded right now" in errors[0]["unsharded"]
    assert "model.reshard()" in errors[0]["unsharded"]
    assert "'model.layers.0.mlp.gate_bias'" in errors[0]["unknown"]
    assert "closest known name is 'model.layers.0.mlp.gate_proj.weight'" in errors[0]["unknown"]
    assert [e["uneven"] for e in errors] == [
        {"box": [[0, 2], [0, 3]], "local": [2, 3], "padded": [2, 3]},
        {"box": [[2, 4], [0, 3]], "local": [2, 3], "padded": [2, 3]},
        {"box": [[4, 4], [0, 3]], "local": [0, 3], "padded": [2, 3]}]
    print(f"fsdp world {world}: {seconds:.1f} s in ranks")


@pytest.mark.integration  # spawns processes for seconds: see pyproject.toml
def test_hsdp_2d_mesh_fp32_masters_bf16_wire(built, tmp_path):
    """(dp_replicate=2, dp_shard=2), placements (Replicate(), Shard(0)); fp32 parameters
    under MixedPrecisionPolicy(param_dtype=bf16): bf16 on the wire, cast from the local
    shard (rounding exercised: the fp32 values are not bf16 values)."""
    world = 4
    cases = []
    for name in (*DENSE, *MOE, *(n for n, _ in OTHERS)):
        model, ref, cfg = built(name, torch.float32)
        specs = MOE_SPECS if name in MOE else DENSE_SPECS if name in DENSE else OTHER_SPECS
        cases.append(Case(name, model, ref, cfg, specs[:2], fp32=_KEPT_FP32.get(name, "")))
    seconds = _run_ranks(world, "hsdp", cases, tmp_path)
    layouts = _verify("hsdp", world, cases, tmp_path)
    assert set(layouts["tiny-llama"].values()) == {"SourceLayout"}
    metas, _ = manifest_from_json(torch.load(tmp_path / "tiny-llama.r0.pt")["manifest"])
    assert {(m.mesh_shape, m.placements) for m in metas} == {((2, 2), (Replicate(), Shard(0)))}
    print(f"hsdp world {world}: {seconds:.1f} s in ranks")


@pytest.mark.integration  # spawns processes for seconds: see pyproject.toml
def test_fsdp_plus_tp_strided_shards(built, tmp_path):
    """(dp_shard=3, tp=2) with parallelize_module's colwise/rowwise plan: _StridedShard
    layouts (uneven: vocab 200 -> 100 per tp rank -> 34/34/32), norms and MoE experts on
    the dp sub-mesh replicated over tp."""
    world = 6
    cases = []
    for name in (*DENSE, *MOE):
        model, ref, cfg = built(name)
        cases.append(Case(name, model, ref, cfg, (MOE_SPECS if name in MOE else DENSE_SPECS)[:2]))
    seconds = _run_ranks(world, "tp", cases, tmp_path)
    layouts = _verify("tp", world, cases, tmp_path)
    assert layouts["tiny-llama"]["model.layers.0.self_attn.q_proj.weight"] == "PieceLayout"
    assert layouts["tiny-llama"]["model.layers.0.input_layernorm.weight"] == "SourceLayout"
    held = [json.loads((tmp_path / f"extra.r{r}.json").read_text()) for r in range(world)]
    # 7 rows, tp=2 then dp=3: tp rank 0 holds rows 0..3, split 2/2/0; tp rank 1 rows 4..6, 1/1/1
    # (rank = dp * 2 + tp)
    assert [h["0.weight"][0] for h in held] == [[0, 2], [4, 5], [2, 4], [5, 6], [4, 4], [6, 7]]
    print(f"tp world {world}: {seconds:.1f} s in ranks")


@pytest.mark.integration  # spawns processes for seconds: see pyproject.toml
def test_experts_sharded_on_dim_1_with_fp32_router(built, tmp_path):
    """shard_placement_fn: experts Shard(1) over 4 ranks (E=8 experts: what MoE trainers do
    when E < world or to keep experts whole), the rest Shard(0); fp32 masters with a bf16
    policy; the router kept fp32 on the wire because the model says its checkpoint format
    keeps it fp32 (``_keep_in_fp32_modules_strict``, as DeepSeek-V3 declares its router)."""
    world = 4
    cases = []
    for name in MOE:
        model, ref, cfg = built(name, torch.float32)
        model = copy.deepcopy(model)
        model._keep_in_fp32_modules_strict = {"mlp.gate"}
        cases.append(Case(name, model, ref, cfg, MOE_SPECS[:2],
                          fp32=r"\.(mlp|block_sparse_moe)\.gate\.weight$"))
    for name, stacked in OTHERS:
        if stacked:
            model, ref, cfg = built(name, torch.float32)
            cases.append(Case(name, model, ref, cfg, OTHER_SPECS, fp32=_KEPT_FP32.get(name, "")))
    seconds = _run_ranks(world, "experts", cases, tmp_path)
    layouts = _verify("experts", world, cases, tmp_path)
    assert layouts["tiny-mixtral"][
        "model.layers.0.block_sparse_moe.experts.gate_up_proj.weight"] == "SourceLayout"
    payload = torch.load(tmp_path / "tiny-qwen3-moe.r1.pt")
    metas, _ = manifest_from_json(payload["manifest"])
    gate_up = next(m for m in metas if m.name.endswith("0.mlp.experts.gate_up_proj.weight"))
    assert gate_up.placements is not None and gate_up.placements[0].dim == 1
    print(f"experts world {world}: {seconds:.1f} s in ranks")
