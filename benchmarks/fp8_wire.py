"""Mode 2 at real scale: the BF16 wire against the fp8 wire (quantized on the trainer).

For each case, the public ``config.json`` in examples/configs with its
``quantization_config`` removed (the BF16 model an RL trainer trains; the
published DeepSeek-V3 and Kimi-K2 files ship fp8 blocks, which is the
checkpoint, mode 3), planned config-only as ``m2nkit plan`` does, then the
fp8 overlay (``engine.quant_fp8.plan_fp8``: vLLM's online ``fp8_per_block``
rule, the blocks each trainer rank feeds, the amax exchange). Reports the
bytes each wire moves, the busiest rank's bytes at ``--link-gbps`` (a
lower bound, as ``Plan.estimated_seconds``: the fp8 figure includes the
scales and the exchange), the exchange (blocks fed by several trainer
ranks, float32 scalars) and the time the fp8 overlay takes to plan. The
load average goes with each case: the machine is shared.

    python benchmarks/fp8_wire.py [--case NAME ...] [--link-gbps 400] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODELS = HERE.parent / "examples" / "configs"

CASES = {
    "deepseek-v3 fsdp:256 -> tp8 dp8 ep": ("deepseek-ai__DeepSeek-V3", "fsdp:256", "vllm:tp=8,dp=8,ep"),
    "kimi-k2 fsdp:256 -> tp8 dp8 ep": ("moonshotai__Kimi-K2-Instruct", "fsdp:256", "vllm:tp=8,dp=8,ep"),
}


def run_case(name: str, link_gbps: float) -> dict:
    from m2nkit.adapters.hf_checkpoint import checkpoint_metas, read_checkpoint
    from m2nkit.adapters.trainer_spec import parse_trainer_spec
    from m2nkit.adapters.vllm import destination_layout, parse_inference_spec
    from m2nkit.engine.plan import build_plan
    from m2nkit.engine.tools.fp8 import plan_fp8_wire

    folder, trainer, inference = CASES[name]
    config = json.loads((MODELS / folder / "config.json").read_text())
    config.pop("quantization_config", None)
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        tspec = parse_trainer_spec(trainer)
        ispec = parse_inference_spec(inference + ",quant=fp8_per_block,wire=fp8")
        t0 = time.perf_counter()
        ckpt = read_checkpoint(tmp)
        metas = checkpoint_metas(ckpt, tspec)
        plan = build_plan(metas, tspec.num_ranks, destination_layout(ckpt.config, metas, ispec))
        t1 = time.perf_counter()
        fp8 = plan_fp8_wire(ckpt.config, plan)
        t2 = time.perf_counter()
    return {"case": name, "model": folder, "trainer": trainer, "inference": str(ispec),
            "bf16_bytes": fp8.bf16_bytes, "fp8_bytes": fp8.fp8_bytes,
            "bf16_busiest_s": plan.estimated_seconds(link_gbps),
            "fp8_busiest_s": fp8.estimated_seconds(link_gbps),
            "blocks": fp8.blocks, "shared_blocks": fp8.shared_blocks,
            "exchange_scalars": fp8.exchange_scalars, "exchange_bytes": fp8.exchange_bytes,
            "plan_s": t1 - t0, "fp8_plan_s": t2 - t1, "link_gbps": link_gbps,
            "load": [load0, os.getloadavg()[0]]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", action="append", choices=sorted(CASES))
    ap.add_argument("--link-gbps", type=float, default=400.0)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    rows = [run_case(c, args.link_gbps) for c in (args.case or CASES)]
    gib = 1 << 30
    head = (f"{'case':36} {'bf16 GiB':>9} {'fp8 GiB':>8} {'ratio':>6} {'bf16 ms':>8} "
            f"{'fp8 ms':>7} {'shared blocks':>14} {'exchange':>10} {'fp8 plan s':>10} {'load':>10}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['case']:36} {r['bf16_bytes'] / gib:9.2f} {r['fp8_bytes'] / gib:8.2f} "
              f"{r['fp8_bytes'] / r['bf16_bytes']:6.3f} {r['bf16_busiest_s'] * 1e3:8.1f} "
              f"{r['fp8_busiest_s'] * 1e3:7.1f} {r['shared_blocks']:14,} "
              f"{r['exchange_bytes'] / (1 << 20):7.1f} MiB {r['fp8_plan_s']:10.2f} "
              f"{r['load'][0]:4.1f}->{r['load'][1]:.1f}")
    print(f"  busiest rank's bytes over its own {args.link_gbps:g} Gbit/s link; fp8 includes "
          "the float32 scales and the amax exchange")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
