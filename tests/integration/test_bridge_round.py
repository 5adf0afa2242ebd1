"""Megatron-Bridge sources through m2nkit's real trainer engine and receivers, over gloo.

Four trainer ranks (tiny Qwen3-MoE loaded through ``AutoBridge`` at TP 2 x
EP 2, so Bridge's export gathers over TP and EP) send with
``M2NTrainerEngine`` (torch_p2p over a gloo group on 127.0.0.1) into two
``M2NReceiver`` workers (``vllm:tp=2,ep``) that trainer rank 0 drives
through an ``InProcessClient``. Three sessions, one per path of
``bridge_source``: ``tasks`` (local shards), ``export`` (Bridge's own
``export_hf_weights`` inside the send loop) and ``gather`` (tasks mode with
QKV and gated-MLP forced through each task's own ``megatron_to_hf``). Each
runs two rounds, the weights changed in place before each
(``perturb``); the buckets are small (8 KiB) so that Bridge's collectives
interleave with the engine's sends across many buckets.

The parent then checks, per session and round:

* every worker committed the round's version;
* every worker's storage equals, bit for bit, the vLLM reference loader
  (``reference_load``) fed with Bridge's own ``export_hf_weights`` of the
  weights as they were after that round's change (run after the round);
* round 2's bytes differ from round 1's (the change reached the workers);
* the ``tasks`` session made no ``torch.distributed`` call during
  ``send_weights``; the ``export`` and ``gather`` sessions made Bridge's
  collectives there, on every rank, over more than one bucket, and did not
  hang (every wait has a deadline, the launch one too);
* in ``export`` mode more than one rank sent (replica balancing), unlike
  Bridge's usual "rank 0 sends everything";
* ``M2NTrainerEngine.notes`` says which wire tensors went through Bridge's
  gather and why (nothing in ``tasks``, QKV/gated MLP in ``gather``, every
  wire tensor in ``export``).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

from ._bridge import GATHER, CountCalls, launch

pytestmark = pytest.mark.integration

WORLD = 4
TP, PP, EP = 2, 1, 2
SPEC = "vllm:tp=2,ep"
MODES = ("tasks", "export", "gather")
ROUNDS = 2
BUCKET_BYTES = 8 << 10
ROUND_TIMEOUT_S = 120.0
LAUNCH_TIMEOUT_S = 420.0


def _rounds(rank: int, out: Path, ckpt: str) -> None:
    """Every trainer rank: one engine per mode, two rounds each; rank 0 hosts the receivers."""
    import torch.distributed as dist
    from transformers import AutoConfig

    from m2nkit.adapters import bridge_source
    from m2nkit.adapters.vllm import vllm_destination
    from m2nkit.engine.clients import InProcessClient
    from m2nkit.engine.receiver import M2NReceiver
    from m2nkit.engine.tools.demo_bridge import (build_bridge_model, exported_tensors,
                                                 init_megatron, perturb)
    from m2nkit.engine.trainer import M2NTrainerEngine, M2NTrainerInitInfo

    from m2nkit.engine.tools.procs import free_port

    init_megatron(TP, PP, EP)
    bridge, model = build_bridge_model(ckpt, TP, PP, EP)
    dest = vllm_destination(AutoConfig.from_pretrained(ckpt), SPEC)
    receivers = [M2NReceiver(dest, w) for w in range(dest.num_workers)] if rank == 0 else []
    client = InProcessClient(receivers, timeout_s=ROUND_TIMEOUT_S) if rank == 0 else None
    said: dict = {}
    step = 0
    try:
        for mode in MODES:
            src = (bridge_source(bridge, model, gather=GATHER) if mode == "gather"
                   else bridge_source(bridge, model, mode=mode))
            port = [free_port() if rank == 0 else None]
            dist.broadcast_object_list(port, src=0)
            info = M2NTrainerInitInfo(rank=rank, num_trainer_ranks=WORLD, destination=dest,
                                      master_port=port[0], timeout_s=ROUND_TIMEOUT_S,
                                      bucket_bytes=BUCKET_BYTES)
            engine = M2NTrainerEngine.trainer_init(info, client=client, source=src)
            mine = said[mode] = {"notes": list(engine.notes), "buckets": len(engine.schedule),
                                 "gathered": sorted(src.gathered), "calls": [], "sent": [],
                                 "streams": src.collectives_while_iterating}
            try:
                for r in range(1, ROUNDS + 1):
                    step += 1
                    perturb(model, step)
                    with CountCalls() as cc:
                        stats = engine.send_weights(f"{mode}-v{r}")
                    mine["calls"].append(cc.counts)
                    mine["sent"].append(stats.bytes_sent)
                    exported = exported_tensors(bridge, model)  # the oracle, after the round
                    if rank == 0:
                        torch.save({"exported": exported,
                                    "storage": [{n: t.clone() for n, t in rec.storage.items()}
                                                for rec in receivers],
                                    "versions": client.weight_versions()},
                                   out / f"round.{mode}.{r}.pt")
            finally:
                engine.shutdown()
    finally:
        for rec in receivers:
            rec.shutdown()
    (out / f"said.r{rank}.json").write_text(json.dumps(said))


@pytest.fixture(scope="module")
def ran(tiny_checkpoints, tmp_path_factory):
    out = tmp_path_factory.mktemp("bridge_round")
    ckpt = str(tiny_checkpoints("tiny-qwen3-moe"))
    seconds = launch(WORLD, [], out, LAUNCH_TIMEOUT_S,
                     extra=functools.partial(_rounds, ckpt=ckpt))
    print(f"bridge rounds: {len(MODES)} sessions x {ROUNDS} rounds on {WORLD} ranks "
          f"in {seconds:.0f} s")
    said = [json.loads((out / f"said.r{r}.json").read_text()) for r in range(WORLD)]
    return out, ckpt, said


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 120)
@pytest.mark.parametrize("mode", MODES)
def test_workers_equal_vllm_reference_on_bridge_export_every_round(ran, mode):
    from transformers import AutoConfig

    from m2nkit.adapters.vllm import reference_load
    from m2nkit.engine.in_process import bitwise_equal

    out, ckpt, _ = ran
    config = AutoConfig.from_pretrained(ckpt)
    rounds = [torch.load(out / f"round.{mode}.{r}.pt") for r in range(1, ROUNDS + 1)]
    for r, got in enumerate(rounds, 1):
        assert got["versions"] == [f"{mode}-v{r}"] * len(got["storage"]), (mode, r)
        for w, storage in enumerate(got["storage"]):
            ref = reference_load(config, got["exported"], SPEC, w, fill=float("nan"))
            assert set(storage) == set(ref), (mode, r, w, sorted(set(storage) ^ set(ref))[:4])
            for name, t in storage.items():
                assert bitwise_equal(t, ref[name]), (mode, r, w, name)
    # the change between rounds reached every worker: no tensor kept round 1's bytes
    for w in range(len(rounds[0]["storage"])):
        for name, t in rounds[1]["storage"][w].items():
            assert not bitwise_equal(t, rounds[0]["storage"][w][name]), (mode, w, name)


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 120)
def test_bridge_collectives_interleave_with_the_sends_and_notes_say_so(ran):
    _, _, said = ran
    for rank, s in enumerate(said):
        # tasks: shard to shard, nothing gathered, no collective while sending
        assert s["tasks"]["calls"] == [{}] * ROUNDS, (rank, s["tasks"]["calls"])
        assert s["tasks"]["gathered"] == [] and s["tasks"]["streams"] is False
        assert s["export"]["streams"] is True and s["gather"]["streams"] is True
        assert any("no gather" in n for n in s["tasks"]["notes"]), s["tasks"]["notes"]
        for mode in ("export", "gather"):
            calls = s[mode]["calls"]
            assert all(sum(c.values()) > 0 for c in calls), (rank, mode, calls)
            assert s[mode]["buckets"] > 1, (mode, "one bucket: nothing interleaved")
        assert any("gather" in n and "mode='export'" in n for n in s["export"]["notes"])
        notes = " ".join(s["gather"]["notes"])
        assert "QKVMapping named in bridge_source(gather=...)" in notes, notes
        assert "GatedMLPMapping" in notes
        assert "model.layers.0.self_attn.q_proj.weight" in s["gather"]["gathered"]
        assert "model.layers.0.self_attn.o_proj.weight" not in s["gather"]["gathered"]
    # every wire tensor of the export session went through Bridge's export; all ranks agree
    assert all(s["export"]["gathered"] == said[0]["export"]["gathered"] for s in said)
    assert len(said[0]["export"]["gathered"]) > len(said[0]["gather"]["gathered"]) > 0
    # export: every rank holds every tensor, so the sends are spread over the ranks
    for r in range(ROUNDS):
        sent = [s["export"]["sent"][r] for s in said]
        assert sum(1 for b in sent if b > 0) >= 2, sent
        assert max(sent) < sum(sent), sent
