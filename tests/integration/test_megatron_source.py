"""``megatron_source`` on real Megatron-Core GPTModels (CPU, gloo), loaded through Megatron-Bridge.

One launch of 4 gloo processes builds every layout below in turn (Bridge's
``AutoBridge.from_hf_pretrained`` + ``load_hf_weights``, the independent
HF -> Megatron loader), and each rank writes the manifest and local tensors
``megatron_source`` gives. The parent then checks, per layout:

* every rank declared the same manifest, whose wire tensors are the HF
  checkpoint's, in its order;
* every piece a rank declares equals the HF checkpoint's slice, bit for bit
  (the local tensors are the live Megatron parameters: fused QKV, [gate; up],
  padded vocabulary, stacked local experts);
* the plan into each vLLM layout moves exactly the minimum, and executing it
  fills vLLM-layout storage equal to ``reference_load`` (vLLM's loaders,
  pinned to real vLLM 0.33.0 dumps in tests/data/oracle).

Layouts (world 4; dp fills the rest): tp2pp2 (tied Qwen3: the last stage's
output-layer replica is not sent), tp2ep2 (Qwen3-MoE, dp2), tp2 ep2 etp1
(whole experts), tp4 with 2 KV heads (query groups < tp: ranks hold
arbitrary qkv row ranges), pp2vpp2 (4 layers in 4 chunks, layer numbers
interleaved), pp2 with uneven stages (1 + 3 layers). (Megatron-Bridge 0.6.2 has
no Mixtral bridge, so Mixtral's table is checked by the dry-run tests only.)
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from tests.integration._megatron import (Layout, check_names_equal_table,
                                         check_pieces_and_rounds, launch, run_layouts)

pytestmark = pytest.mark.integration

WORLD = 4

# (label, tiny model, layers, layout kwargs, vLLM specs)
CASES = [
    ("tp2pp2", "tiny-qwen3-tied", 4, dict(tp=2, pp=2), ("vllm:tp=1", "vllm:tp=2", "vllm:tp=4")),
    ("tp2ep2", "tiny-qwen3-moe", 2, dict(tp=2, ep=2),
     ("vllm:tp=1", "vllm:tp=2", "vllm:tp=2,ep", "vllm:tp=4,ep")),
    ("tp2ep2etp1", "tiny-qwen3-moe", 2, dict(tp=2, ep=2, etp=1), ("vllm:tp=2", "vllm:tp=4,ep")),
    ("tp4", "tiny-llama", 2, dict(tp=4), ("vllm:tp=1", "vllm:tp=2", "vllm:tp=4")),
    ("pp2vpp2", "tiny-qwen3", 4, dict(pp=2, vpp=2), ("vllm:tp=2",)),
    ("pp2uneven", "tiny-llama", 4, dict(pp=2, first=1, last=3), ("vllm:tp=2",)),
    # Qwen2: the fused QKV bias, interleaved per query group like the weight
    ("tp2qwen2", "tiny-qwen2", 2, dict(tp=2), ("vllm:tp=1", "vllm:tp=4")),
]


@pytest.fixture(scope="module")
def dumped(tmp_path_factory):
    from m2nkit.adapters.tiny import save_tiny_checkpoint, tiny_config

    root = tmp_path_factory.mktemp("megatron")
    layouts, meta = [], {}
    for label, name, layers, kw, specs in CASES:
        ckpt = root / f"{name}-{layers}"
        if not ckpt.exists():
            cfg = tiny_config(name, num_hidden_layers=layers)
            save_tiny_checkpoint(cfg, ckpt, seed=7)
            _nontrivial_norms(ckpt)
        layouts.append(Layout(label, str(ckpt), **kw))
        meta[label] = (ckpt, specs)
    out = root / "out"
    out.mkdir()
    launch(WORLD, functools.partial(run_layouts, layouts), out, timeout_s=600)
    return out, meta


def _nontrivial_norms(ckpt: Path) -> None:
    """Norm weights away from 1 (a wrong norm mapping or a +1 would show)."""
    from safetensors.torch import load_file, save_file

    for f in ckpt.glob("*.safetensors"):
        sd = load_file(f)
        g = torch.Generator().manual_seed(1)
        for k, v in sd.items():
            if "norm" in k:
                sd[k] = (1 + 0.1 * torch.randn(v.shape, generator=g)).to(v.dtype)
        save_file(sd, f, metadata={"format": "pt"})


@pytest.mark.parametrize("label", [c[0] for c in CASES])
def test_pieces_equal_the_checkpoint_and_land_like_vllm(dumped, label):
    out, meta = dumped
    ckpt_dir, specs = meta[label]
    check_pieces_and_rounds(out, label, ckpt_dir, specs, WORLD)


def test_layouts_have_the_shapes_they_claim(dumped):
    """The cases exercise what they are named for (a guard against a silently trivial layout)."""
    from m2nkit.manifest import manifest_from_json

    out, _ = dumped

    def metas(label):
        return {m.name: m for m in manifest_from_json(torch.load(out / f"{label}.r0.pt")
                                                      ["manifest"])[0]}

    # tp4 with 2 KV heads: rank 1 holds the last 16 q rows of group 0, then k_0 and v_0
    q = metas("tp4")["model.layers.0.self_attn.q_proj.weight"]
    rank1 = sorted(p.box[0] for p in q.pieces if p.rank == 1)
    assert rank1 == [(48, 64)], rank1
    # tied embeddings with pp2: sent by the first stage only (ranks 0, 1 = tp ranks of stage 0)
    emb = metas("tp2pp2")["model.embed_tokens.weight"]
    assert {p.rank for p in emb.pieces} == {0, 1}
    assert "lm_head.weight" not in metas("tp2pp2")
    # pp2vpp2: layers 0 and 2 on stage 0, 1 and 3 on stage 1 (dp 2: ranks 0,1 / 2,3)
    m = metas("pp2vpp2")
    assert {p.rank for p in m["model.layers.2.self_attn.q_proj.weight"].pieces} == {0, 1}
    assert {p.rank for p in m["model.layers.1.self_attn.q_proj.weight"].pieces} == {2, 3}
    # Qwen2 tp2 (dp 2): each tp rank holds one query group's k bias, replicated over dp
    kb = metas("tp2qwen2")["model.layers.0.self_attn.k_proj.bias"]
    half = kb.shape[0] // 2
    assert sorted((p.box[0], p.rank) for p in kb.pieces) == [
        ((0, half), 0), ((0, half), 2), ((half, 2 * half), 1), ((half, 2 * half), 3)]
    # uneven: layer 0 alone on stage 0, layers 1..3 on stage 1
    m = metas("pp2uneven")
    assert {p.rank for p in m["model.layers.1.mlp.down_proj.weight"].pieces} == {2, 3}


@pytest.mark.parametrize("label", [c[0] for c in CASES])
def test_live_names_come_from_bridge_and_equal_the_hand_table(dumped, label):
    """The live source reads its names and kinds from Bridge's registry (AutoMapping's kind
    from the built modules); the hand-written table of ``names.py`` (the dry run's) must say
    the same for every Megatron spelling the registry gives, and cover the same wire tensors."""
    out, meta = dumped
    check_names_equal_table(out, label, meta[label][0])
