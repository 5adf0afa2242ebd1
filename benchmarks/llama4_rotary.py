"""What vLLM's Llama-4 rotary q/k reordering costs the planner, bound one row per binding.

vLLM 0.33.0 reorders each q/k head's rows before loading them
(``permute_qk_weight_for_rotary``, ``model_executor/models/llama4.py``):
row ``h*hd + t*hd/2 + i`` of the loaded tensor is wire row ``h*hd + 2*i + t``.
As boxes of the 2-D wire tensor that is one binding per row
(:func:`m2nkit.adapters.vllm.trace.rotary_rows`, then ``merge_copies``).
This plans Llama-4-Scout's attention (48 layers, q ``[40*128, 5120]``,
k/v ``[8*128, 5120]``, bf16) from ``fsdp:<N>`` (``Shard(0)``) into
``vllm:tp=<T>`` twice: with the rows reordered as vLLM does, and with the
same bytes bound as contiguous heads (what a Llama-3 q/k would be), and
prints bindings, slabs, bytes and ``build_plan`` time for each (best of
``--repeat``). Only the attention is planned: the rest of the model binds
the same way in both.

    python benchmarks/llama4_rotary.py [--fsdp 64] [--tp 8] [--repeat 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from m2nkit.adapters.vllm.trace import TracedCopy, merge_copies, rotary_rows
from m2nkit.engine.plan import build_plan
from m2nkit.manifest import Binding, DestinationLayout, DestinationParam, ParamMeta
from m2nkit.manifest.placement import Shard

#: Llama-4-Scout-17B-16E text_config (/work/shared/models, config.json)
SCOUT = {"H": 5120, "nh": 40, "nkv": 8, "hd": 128, "layers": 48}


def layout(tp: int, rotary: bool, c=SCOUT) -> tuple[list[ParamMeta], DestinationLayout]:
    """Wire metas (fsdp placements filled by the caller) and the tp destination of q/k/v."""
    H, nh, nkv, hd = c["H"], c["nh"], c["nkv"], c["hd"]
    q, kv = nh // tp * hd, max(1, nkv // tp) * hd
    names, params, bindings = [], [], {}
    for L in range(c["layers"]):
        a = f"model.layers.{L}.self_attn"
        qkv = f"{a}.qkv_proj.weight"
        for w in range(tp):
            params.append(DestinationParam(w, qkv, torch.bfloat16, (q + 2 * kv, H)))
            kr = w * nkv // tp if tp <= nkv else w // (tp // nkv)
            for part, lo, at, n in (("q", w * q, 0, q), ("k", kr * hd, q, kv),
                                    ("v", kr * hd, q + kv, kv)):
                copy = TracedCopy(f"{a}.{part}_proj.weight", qkv, ((lo, lo + n), (0, H)),
                                  ((at, at + n), (0, H)))
                copies = rotary_rows(copy, 0, hd) if rotary and part != "v" else [copy]
                for m in merge_copies(copies):
                    bindings.setdefault(m.name, []).append(
                        Binding(m.name, w, m.box, qkv, tuple(r[0] for r in m.region)))
        names += [(f"{a}.q_proj.weight", nh * hd), (f"{a}.k_proj.weight", nkv * hd),
                  (f"{a}.v_proj.weight", nkv * hd)]
    dest = DestinationLayout(f"vllm:tp={tp}", tp, tuple(params),
                             {k: tuple(v) for k, v in bindings.items()})
    return [(n, rows) for n, rows in names], dest


def run(fsdp: int, tp: int, repeat: int) -> list[dict]:
    out = []
    for rotary in (False, True):
        names, dest = layout(tp, rotary)
        metas = [ParamMeta(n, torch.bfloat16, (rows, SCOUT["H"]), owners=tuple(range(fsdp)), mesh_shape=(fsdp,),
                           placements=(Shard(0),))
                 for n, rows in names]
        best = None
        for _ in range(repeat):
            t0 = time.perf_counter()
            plan = build_plan(metas, fsdp, dest)
            best = min(best or 1e9, time.perf_counter() - t0)
        assert not plan.problems, plan.problems[:3]
        out.append({"binding": "rotary rows" if rotary else "contiguous heads",
                    "bindings": sum(len(b) for b in dest.bindings.values()),
                    "slabs": plan.num_slabs,
                    "bytes": sum(w.nbytes_moved for w in plan.wires),
                    "plan_s": round(best, 3)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fsdp", type=int, default=64)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = run(args.fsdp, args.tp, args.repeat)
    load = os.getloadavg()[0]
    print(f"Llama-4-Scout attention (48 layers q/k/v), fsdp:{args.fsdp} -> vllm:tp={args.tp}, "
          f"load average {load:.1f}")
    print(f"{'binding':<18}{'bindings':>10}{'slabs':>10}{'bytes':>16}{'plan s':>9}")
    for r in rows:
        print(f"{r['binding']:<18}{r['bindings']:>10}{r['slabs']:>10}{r['bytes']:>16}"
              f"{r['plan_s']:>9}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"fsdp": args.fsdp, "tp": args.tp, "load": load, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
