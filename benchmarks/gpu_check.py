"""Does the nccl_m2n transport move the right bytes on real GPUs, and how fast?

Builds a tiny checkpoint (``m2nkit.adapters.tiny``), then for each scenario
``TRAINER/INFERENCE`` (e.g. ``fsdp:2/vllm:tp=2``) runs T trainer processes
and N worker processes, one communicator over all of them: ``nccl.m2n``
reshards for the wire tensors the plan allows, ``torch_p2p`` over an
``nccl``-backend group for the rest. Every worker byte is compared with
``m2nkit.adapters.vllm.reference_load`` (vLLM's loaders on the full
checkpoint) after every round, and once more after a round that sends
everything through ``torch_p2p`` alone, for comparison. Prints a table.

    python benchmarks/gpu_check.py                 # GPU machine, < 5 minutes
    python benchmarks/gpu_check.py --vllm-serve also   # + vllm serve RL loop, < 10 minutes
    python benchmarks/gpu_check.py --vllm-serve only   # the vllm serve loop alone
    python benchmarks/gpu_check.py --colocated only    # one GPU, trainer + vLLM through
                                                   # sleep mode, < 5 minutes
    python benchmarks/gpu_check.py --dry-run [--vllm-serve also]
                                                   # any machine, no GPU: plans, an
                                                   # in-process byte check, the
                                                   # nccl.m2n descriptors if it imports,
                                                   # the serve command line

``--dry-run`` does everything that needs no GPU: it builds each scenario's
plan, prints which tensors each transport would carry (and why not
``nccl.m2n``), executes the plan in this process and compares every worker
byte with vLLM's loaders. Where ``nccl.m2n`` imports (``m2nkit[nccl]``; no
driver needed) it also builds the real descriptors and moves the m2n
tensors as they describe; where it does not, it says so and moves every
tensor slab by slab. It ends by listing what it skipped.

One rank per GPU when there are enough GPUs. With fewer (one H200, say)
``--share-gpu auto`` puts several ranks on one device: NCCL refuses two
ranks of one communicator on the same GPU of one host ("Duplicate GPU
detected"), so each rank gets its own ``NCCL_HOSTID`` (with
``NCCL_SOCKET_IFNAME=lo``, ``NCCL_IB_DISABLE=1``) and NCCL treats the ranks
as separate hosts talking over its socket transport. That is
experimental — if nccl.m2n does not run that way, the scenario fails with
NCCL's message and the table says so.

``--vllm-serve also|only`` checks m2nkit inside a real vLLM server, RL style.
It writes a small Qwen3 checkpoint v0 (head_dim 64, with a word-level
tokenizer ``t0 .. t511``: the machine has no network) and v1 (another seed:
every tensor differs), starts ``vllm serve v0 --weight-transfer-config
'{"backend": "m2nkit"}'`` with ``VLLM_SERVER_DEV_MODE=1`` (the weight-transfer,
``/pause``, ``/weight_checker`` and ``/collective_rpc`` routes) in its own
process group, and then: generates (greedy, a fixed prompt) and takes vLLM's
per-parameter sha256 (``/weight_checker``); ``/pause``; sends v1 in one m2nkit
round from ``--serve-trainer`` processes (CPU, gloo), trainer rank 0 driving
the server with vLLM's ``HTTPVLLMWeightSyncClient``; ``/resume``; generates
again. Pass when the tokens changed, the served version is ``v1``, every
parameter's checksum changed, and after vLLM reloads v1 itself
(``/collective_rpc`` ``reload_weights``, its own loader, in place) every
checksum equals what m2nkit's round left and generation gives the same
tokens. The server is stopped (its process group, SIGTERM then SIGKILL) on
every exit path, SIGTERM to this script included; its output is in
``--serve-log``.

``--colocated also|only`` checks the colocated RL loop on one GPU shared by
a trainer process and ``vllm serve --enable-sleep-mode`` (same v0, plugin and
routes as above; :data:`COLOCATED_STEPS`): generate and take the checksums;
``/sleep?level=2`` (vLLM frees its weights and KV cache); the trainer process
loads v0 with transformers on the same GPU, takes one AdamW step and saves
its weights; ``/wake_up?tags=weights`` (fresh memory, undefined bytes); one
m2nkit round ``replicated:1 -> vllm:tp=1`` over the ``ipc`` transport (the
trainer's own CUDA tensors as CUDA IPC handles, copied into the live
weights); ``/wake_up?tags=kv_cache``; generate. Pass when the tokens
changed, the served version is ``v1``, every checksum changed, and after
vLLM reloads the trainer's saved weights itself every checksum equals what
the round left and generation gives the same tokens. Its server's output is
in ``--colocated-log``. Not yet run on a GPU (written by reading vLLM 0.33).

Time: ``--total-timeout`` (570 s) bounds the whole GPU run; with
``--vllm-serve also`` the scenarios leave the last 300 s to the serve check
(and 270 s more to ``--colocated also``: raise ``--total-timeout`` for all three),
and a watchdog 30 s after the bound stops the server and every child and
exits 1. Exit status: 0 all verified, 1 a failure, 2 bad arguments or
nothing could run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

from m2nkit.engine.tools.procs import free_port, start_ranks, stop_processes

DEFAULT_SCENARIOS = (
    "replicated:1/vllm:tp=1",
    "fsdp:2/vllm:tp=2",
    "fsdp:2/vllm:tp=2,dp=2,ep",
    "hsdp:2,2/vllm:tp=2,dp=2",
)

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _fmt_s(s: float | None) -> str:
    return "-" if s is None else (f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s")


def _parse_scenario(text: str):
    from m2nkit.adapters.trainer_spec import parse_trainer_spec
    from m2nkit.adapters.vllm import parse_inference_spec

    trainer, sep, inference = text.partition("/")
    if not sep or not trainer.strip() or not inference.strip():
        raise ValueError(f"scenario {text!r} must be TRAINER/INFERENCE, e.g. 'fsdp:2/vllm:tp=2'")
    return parse_trainer_spec(trainer.strip()), parse_inference_spec(inference.strip())


def _build(ckpt_dir: str, tspec, ispec):
    from m2nkit.adapters.hf_checkpoint import checkpoint_metas, read_checkpoint
    from m2nkit.adapters.vllm import destination_layout
    from m2nkit.engine.plan import build_plan
    from m2nkit.manifest.serialize import manifest_digest

    ck = read_checkpoint(ckpt_dir)
    metas = checkpoint_metas(ck, tspec)
    dest = destination_layout(ck.config, metas, ispec)
    return ck, build_plan(metas, tspec.num_ranks, dest,
                          manifest_digest=manifest_digest(metas, tspec.num_ranks))


def _compare(ck, ispec, plan, worker: int, storage) -> list[str]:
    """Names of this worker's parameters that differ from vLLM's loaders."""
    from m2nkit.adapters.hf_checkpoint import full_checkpoint_tensors
    from m2nkit.adapters.vllm import reference_load
    from m2nkit.engine.in_process import bitwise_equal

    ref = reference_load(ck.config, full_checkpoint_tensors(ck), ispec, worker)
    got = {k: v.cpu() for k, v in storage.items()}
    aliases = plan.destination.aliases
    return sorted(n for n, t in ref.items()
                  if n not in aliases and (n not in got or not bitwise_equal(got[n], t)))


# --------------------------------------------------------------------------
# dry run: plans, an in-process byte check, and descriptors where nccl.m2n imports (CPU)


def _simulate(ck, tspec, ispec, plan, calls) -> list[str]:
    """Move every m2n wire as its descriptors say and the rest by slabs, in one
    process; return the (worker, param) pairs that differ from vLLM's loaders."""
    from m2nkit.adapters.hf_checkpoint import checkpoint_manifest
    from m2nkit.engine.in_process import allocate_storage, execute_plan
    from m2nkit.engine.transports.nccl_m2n_rules import sub_plan
    from m2nkit.engine.transports.nccl_m2n_runtime import destination_view

    T, N = plan.num_trainer_ranks, plan.num_workers
    storage = {w: allocate_storage(plan.destination, w) for w in range(N)}
    rest = [i for i in range(len(plan.wires)) if i not in calls]
    names = {plan.wires[i].name for i in rest}
    streams = {r: ((n, t) for n, t in checkpoint_manifest(ck, tspec, r).iter_local() if n in names)
               for r in range(T)}
    execute_plan(sub_plan(plan, rest), streams, storage)
    for wi, c in calls.items():
        full = ck.read_full(c.name)
        for rank in c.dst_ranks:
            view = destination_view(plan, wi, rank - T, storage[rank - T])
            view.copy_(full[tuple(slice(a, b) for a, b in c.dst_box(rank))])
    return [f"worker {w}: {n}" for w in range(N) for n in _compare(ck, ispec, plan, w, storage[w])]


def dry_run(ckpt_dir: str, scenarios, m2n=None, bucket_bytes: int = 1 << 20) -> bool:
    """Plan, route and byte-check every scenario in this process; True when all verify.

    ``m2n`` is the imported ``nccl.m2n`` module, or ``None`` where it does
    not import: then no descriptor is built and every tensor, the m2n ones
    included, is moved slab by slab for the byte check. The table also gives
    the messages a ``torch_p2p``-only round of the plan posts at
    ``bucket_bytes`` (``torch_p2p.message_count``), the figure the GPU run
    sets beside that round's time.
    """
    from m2nkit.engine.transports import torch_p2p
    from m2nkit.engine.transports.nccl_m2n_rules import (
        CARRIER_M2N,
        CARRIER_P2P,
        plan_segments,
        wire_carrier,
    )
    from m2nkit.engine.transports.nccl_m2n_runtime import m2n_descriptors

    ok = True
    rows = []
    for text, tspec, ispec in scenarios:
        ck, plan = _build(ckpt_dir, tspec, ispec)
        if plan.problems:
            print(f"{text}: plan problems: {plan.problems[:3]}")
            ok = False
            continue
        m2n_wires = [i for i, w in enumerate(plan.wires) if wire_carrier(w) == CARRIER_M2N]
        calls = {} if m2n is None else {i: m2n_descriptors(plan, i, m2n=m2n) for i in m2n_wires}
        p2p = [w for w in plan.wires if wire_carrier(w) == CARRIER_P2P]
        bad = _simulate(ck, tspec, ispec, plan, calls)
        ok &= not bad
        label = text.replace("/", " -> ")
        rows.append((label, plan.num_trainer_ranks + plan.num_workers, len(m2n_wires),
                     _fmt_bytes(sum(plan.wires[i].nbytes_moved for i in m2n_wires)),
                     f"{len(calls)} checked" if m2n is not None else "skipped", len(p2p),
                     _fmt_bytes(sum(w.nbytes_moved for w in p2p)), len(plan_segments(plan)),
                     torch_p2p.message_count(plan, torch_p2p.BucketSchedule.build(plan,
                                                                                  bucket_bytes)),
                     "ok" if not bad else f"{len(bad)} differ: {bad[:2]}"))
        reasons = sorted({w.verdict("nccl_m2n").reason for w in p2p})
        for r in reasons:
            print(f"  {label}: torch_p2p because {r}")
    head = ("scenario", "ranks", "nccl_m2n tensors", "nccl_m2n bytes", "descriptors",
            "torch_p2p tensors", "torch_p2p bytes", "segments", "torch_p2p-only messages",
            "in-process byte check")
    how = ("m2n tensors moved as their nccl.m2n descriptors say, the rest slab by slab"
           if m2n is not None else "every tensor moved slab by slab (no nccl.m2n descriptors)")
    _table(f"dry run (no GPU work): {how}; every worker byte vs vLLM's loaders", head, rows)
    return ok


# --------------------------------------------------------------------------
# GPU run: one process per rank


def _rank_main(cfg: dict) -> None:
    """One trainer or worker rank; writes ``{rank}.json`` into ``cfg['out']``."""
    os.environ.update(cfg["env"])          # before NCCL initialises in this process
    rank, world = cfg["rank"], cfg["world"]
    result: dict = {"rank": rank}
    try:
        import torch

        from m2nkit.adapters.hf_checkpoint import checkpoint_manifest
        from m2nkit.engine.control import create_group
        from m2nkit.engine.in_process import allocate_storage
        from m2nkit.engine.transports import torch_p2p
        from m2nkit.engine.transports.nccl_m2n import NcclM2NTransport

        tspec, ispec = _parse_scenario(cfg["scenario"])
        dev = torch.device("cuda", cfg["device"])
        torch.cuda.set_device(dev)
        store, group = create_group("127.0.0.1", cfg["port"], rank, world,
                                    timeout_s=cfg["timeout"], backend="nccl")
        ck, plan = _build(cfg["ckpt"], tspec, ispec)
        T = plan.num_trainer_ranks
        transport = NcclM2NTransport.connect(store, group, rank, world, device=dev,
                                             timeout_s=cfg["timeout"],
                                             bucket_bytes=cfg["bucket_bytes"])
        result["role"] = "trainer" if rank < T else "worker"

        def storage_on_gpu(w):
            return {k: v.to(dev) for k, v in allocate_storage(plan.destination, w).items()}

        rounds = []
        for _ in range(cfg["rounds"]):
            if rank < T:
                rep = transport.send_round(plan, rank, checkpoint_manifest(ck, tspec, rank).iter_local())
                rounds.append({**rep.__dict__, "bad": []})
            else:
                storage = storage_on_gpu(rank - T)
                _, rep = transport.recv_round(plan, rank - T, storage)
                rounds.append({**rep.__dict__, "bad": _compare(ck, ispec, plan, rank - T, storage)})
        result["rounds"] = rounds

        # The same plan through torch_p2p alone, for comparison: its time and its
        # message count (the pattern issue 20 changed must suit NCCL p2p too).
        schedule = torch_p2p.BucketSchedule.build(plan, cfg["bucket_bytes"])
        messages = torch_p2p.message_count(plan, schedule)
        t0 = time.perf_counter()
        if rank < T:
            n = torch_p2p.send_round(group, plan, schedule, rank,
                                     checkpoint_manifest(ck, tspec, rank).iter_local(),
                                     timeout_s=cfg["timeout"], device=dev)
            torch.cuda.synchronize(dev)
            result["p2p_only"] = {"seconds": time.perf_counter() - t0, "bytes": n, "bad": [],
                                  "messages": messages}
        else:
            storage = storage_on_gpu(rank - T)
            t0 = time.perf_counter()
            _, n = torch_p2p.recv_round(group, plan, schedule, rank - T, storage,
                                        timeout_s=cfg["timeout"], device=dev)
            torch.cuda.synchronize(dev)
            result["p2p_only"] = {"seconds": time.perf_counter() - t0, "bytes": n,
                                  "bad": _compare(ck, ispec, plan, rank - T, storage),
                                  "messages": messages}
        transport.close()
        shutdown = getattr(group, "shutdown", None)
        if callable(shutdown):
            shutdown()
    except BaseException as e:
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()
    finally:
        Path(cfg["out"], f"{rank}.json").write_text(json.dumps(result))


def _run_scenario(text, tspec, ispec, ckpt_dir, devices, env_per_rank, args, out_dir) -> list[dict]:
    world = tspec.num_ranks + ispec.num_workers
    port = free_port()
    procs = start_ranks(_rank_main, lambda r: ({
        "rank": r, "world": world, "scenario": text, "ckpt": ckpt_dir, "port": port,
        "device": devices[r], "env": env_per_rank[r], "timeout": args.timeout,
        "rounds": args.rounds, "bucket_bytes": args.bucket_bytes, "out": str(out_dir)},), world)
    # processes this script started; only they are stopped
    stopped = stop_processes(procs, until=time.monotonic() + args.scenario_timeout)
    results = []
    for r, p in enumerate(procs):
        killed = p in stopped
        f = Path(out_dir, f"{r}.json")
        if f.exists():
            results.append(json.loads(f.read_text()))
        elif killed:
            results.append({"rank": r, "error": f"still running after --scenario-timeout "
                                                f"{args.scenario_timeout:g} s; killed"})
        else:
            results.append({"rank": r, "error": f"exited with code {p.exitcode} and no result"})
    return results


def _row(text, world, placement, results, T):
    errors = [f"rank {x['rank']}: {x['error']}" for x in results if "error" in x]
    if errors:
        return (text, world, placement, "-", "-", "-", "-", "-", "-", "-", f"FAILED {errors[0][:160]}"), errors
    workers = results[T:]
    first = [x["rounds"][0] for x in workers]
    rounds = len(results[0]["rounds"])
    secs = [max(x["rounds"][k]["seconds"] for x in results) for k in range(rounds)]
    bad = [(x["rank"], k, b) for x in workers for k, rd in enumerate(x["rounds"]) for b in rd["bad"]]
    bad += [(x["rank"], "p2p-only", b) for x in workers for b in x["p2p_only"]["bad"]]
    verified = f"{len(workers)}/{len(workers)} workers ok" if not bad else f"MISMATCH {bad[:3]}"
    return (text, world, placement, first[0]["m2n_tensors"], _fmt_bytes(sum(f["m2n_bytes"] for f in first)),
            first[0]["p2p_tensors"], _fmt_bytes(sum(f["p2p_bytes"] for f in first)),
            _fmt_s(secs[0]), _fmt_s(secs[-1]) if rounds > 1 else "-",
            f"{_fmt_s(max(x['p2p_only']['seconds'] for x in results))} "
            f"({results[0]['p2p_only']['messages']} msgs)", verified), \
        [f"rank {r} round {k}: {b}" for r, k, b in bad]


def gpu_run(ckpt_dir: str, scenarios, args, end: float | None = None) -> bool:
    """The nccl_m2n scenarios on the GPU(s); none runs past ``end`` (``time.monotonic``)."""
    import copy

    import torch

    from m2nkit.engine.transports.nccl_m2n_runtime import import_nccl_m2n

    gpus = torch.cuda.device_count()
    m2n, core = import_nccl_m2n()
    try:                     # the libraries load and a handle can be made on this driver
        handle = m2n.init()
        handle.destroy()
        print(f"nccl.m2n handle ok; NCCL {core.get_version()}; {gpus} GPU(s): "
              f"{torch.cuda.get_device_name(0)}")
    except Exception as e:
        print(f"nccl.m2n cannot initialise here: {type(e).__name__}: {e}")
        return False
    ok = True
    rows, notes = [], []
    for text, tspec, ispec in scenarios:
        world = tspec.num_ranks + ispec.num_workers
        if world <= gpus:
            devices, envs, placement = list(range(world)), [{} for _ in range(world)], "1 rank/GPU"
        elif args.share_gpu == "no":
            rows.append((text, world, f"needs {world} GPUs", *["-"] * 7, "SKIPPED (--share-gpu no)"))
            continue
        else:
            devices = [r % gpus for r in range(world)]
            # Each rank its own "host": NCCL then talks over sockets on loopback.
            envs = [{"NCCL_HOSTID": f"m2nkit-gpu-check-rank{r}", "NCCL_SOCKET_IFNAME": "lo",
                     "NCCL_IB_DISABLE": "1"} for r in range(world)]
            placement = f"{world} ranks on {gpus} GPU(s), NCCL_HOSTID per rank"
        left = args.scenario_timeout if end is None else end - time.monotonic()
        if left < 30:
            rows.append((text, world, placement, *["-"] * 7, "SKIPPED (--total-timeout)"))
            continue
        bounded = copy.copy(args)
        bounded.scenario_timeout = min(args.scenario_timeout, left)
        with tempfile.TemporaryDirectory() as out:
            t0 = time.perf_counter()
            results = _run_scenario(text, tspec, ispec, ckpt_dir, devices, envs, bounded, out)
            row, problems = _row(text, world, placement, results, tspec.num_ranks)
            print(f"{text}: {time.perf_counter() - t0:.1f} s")
        rows.append(row)
        if problems:
            ok = False
            notes += [f"{text}: {p}" for p in problems[:5]]
            for x in results:
                if "traceback" in x:
                    notes.append(f"{text} rank {x['rank']} traceback:\n{x['traceback']}")
                    break
    head = ("scenario", "ranks", "placement", "nccl_m2n tensors", "nccl_m2n bytes (workers)",
            "torch_p2p tensors", "torch_p2p bytes (workers)", "round 1", "last round",
            "torch_p2p only (messages)", "verified")
    _table("GPU run: nccl_m2n + torch_p2p(nccl), every worker byte vs vLLM's loaders", head, rows)
    for n in notes:
        print(n)
    ran = [r for r in rows if not str(r[-1]).startswith("SKIPPED")]
    if any(str(r[-1]) == "SKIPPED (--total-timeout)" for r in rows):
        print("some scenarios did not run: --total-timeout would have passed")
        ok = False
    if not ran:
        print("nothing ran: every scenario needs more GPUs (try --share-gpu auto)")
        return False
    if ok and all(str(r[-1]).endswith("workers ok") for r in ran):
        print("every worker byte matches vLLM's loaders")
        return True
    return False


# --------------------------------------------------------------------------
# vllm serve with the m2nkit plugin: an RL-style loop (generate, update, generate)

#: Name the server registers the model under (``--served-model-name``).
SERVE_MODEL_NAME = "m2nkit-gpu-check"
#: The served model: tiny Qwen3 with sizes every attention backend takes (head_dim 64).
SERVE_BASE_MODEL = "tiny-qwen3"
SERVE_SIZES = {"hidden_size": 256, "head_dim": 64, "num_attention_heads": 4,
               "num_key_value_heads": 2, "intermediate_size": 512, "vocab_size": 512,
               "num_hidden_layers": 2, "max_position_embeddings": 1024}
#: Greedy, fixed prompt: the same weights give the same tokens.
SERVE_PROMPT = "t17 t3 t101 t42 t7 t250 t9 t64"
SERVE_MAX_TOKENS = 16
#: vLLM's flag value selecting the plugin's backend (``vllm/config/weight_transfer.py``).
WEIGHT_TRANSFER_CONFIG = '{"backend": "m2nkit"}'
PLUGIN_ENTRY_POINT = ("m2nkit", "m2nkit.engine.plugins.vllm:register")


def write_word_tokenizer(out_dir: Path, vocab_size: int):
    """A word-level tokenizer over ``t0 .. t{vocab_size-1}`` saved beside the model.

    ``vllm serve`` loads the checkpoint's tokenizer (``AutoTokenizer``); a
    tiny random checkpoint has none, and the GPU machine has no network. One
    token per vocabulary id, whitespace-split, so a prompt of ``tN`` words
    maps to ids ``N`` and the generated ids decode back to ``tN`` words.
    Returns the tokenizer as transformers reloads it from ``out_dir``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")      # joins words with spaces
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(out_dir)
    return AutoTokenizer.from_pretrained(out_dir)


def serve_checkpoints(workdir: Path) -> tuple[Path, Path]:
    """``(v0, v1)``: the served model (seed 0) and the trainer's update (seed 1), both with the tokenizer.

    Raises:
        RuntimeError: the tokenizer does not round-trip the prompt, or a
            tensor of v1 equals v0 (the update would not show).
    """
    from safetensors.torch import load_file

    from m2nkit.adapters.tiny import save_tiny_checkpoint, tiny_config

    config = tiny_config(SERVE_BASE_MODEL, **SERVE_SIZES)
    v0 = save_tiny_checkpoint(config, workdir / "serve-v0", seed=0)
    v1 = save_tiny_checkpoint(config, workdir / "serve-v1", seed=1)
    for d in (v0, v1):
        tok = write_word_tokenizer(d, config.vocab_size)
    ids = tok(SERVE_PROMPT)["input_ids"]
    if [f"t{i}" for i in ids] != SERVE_PROMPT.split() or tok.decode(ids) != SERVE_PROMPT:
        raise RuntimeError(f"the word tokenizer does not round-trip {SERVE_PROMPT!r}: ids {ids}, "
                           f"decoded {tok.decode(ids)!r}")
    a, b = load_file(str(v0 / "model.safetensors")), load_file(str(v1 / "model.safetensors"))
    same = sorted(n for n in a if a[n].equal(b[n]))
    if same or set(a) != set(b):
        raise RuntimeError(f"v1 must differ from v0 in every tensor; equal: {same[:5]}")
    return v0, v1


def serve_command(model_dir: Path, port: int, tp: int, extra: list[str]) -> list[str]:
    """The ``vllm serve`` command line: the plugin's backend, small memory, greedy-friendly.

    ``vllm`` next to this Python when it exists (the console script), else
    ``python -m vllm.entrypoints.cli.main``. ``extra`` (``--serve-arg``)
    comes last, so it can override any default here.
    """
    exe = Path(sys.executable).with_name("vllm")
    head = [str(exe)] if exe.exists() else [sys.executable, "-m", "vllm.entrypoints.cli.main"]
    return head + ["serve", str(model_dir), "--served-model-name", SERVE_MODEL_NAME,
                   "--host", "127.0.0.1", "--port", str(port),
                   "--tensor-parallel-size", str(tp),
                   "--weight-transfer-config", WEIGHT_TRANSFER_CONFIG,
                   "--max-model-len", "512", "--max-num-seqs", "4",
                   "--gpu-memory-utilization", "0.25", "--seed", "0"] + list(extra)


def serve_env(base: dict | None = None) -> dict[str, str]:
    """The server's environment: the weight-transfer routes on, receive mode ``in_place``.

    ``VLLM_SERVER_DEV_MODE=1`` mounts ``/init_weight_transfer_engine`` ...
    ``/finish_weight_update``, ``/pause``, ``/resume``, ``/weight_checker``
    and ``/collective_rpc`` (``vllm/entrypoints/launchers/api_server/routers.py``);
    ``M2NKIT_RECEIVE_MODE=in_place`` (the plugin's default, made explicit:
    the loop pauses generation around the update); offline, as the GPU
    machine has no network.
    """
    env = dict(os.environ if base is None else base)
    env.update({"VLLM_SERVER_DEV_MODE": "1", "M2NKIT_RECEIVE_MODE": "in_place",
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1", "TOKENIZERS_PARALLELISM": "false"})
    return env


def plugin_status() -> tuple[bool, str]:
    """Whether vLLM and the ``vllm.general_plugins`` entry point ``m2nkit`` are installed (no import)."""
    import importlib.util
    from importlib.metadata import entry_points

    found = [(e.name, e.value) for e in entry_points(group="vllm.general_plugins")
             if e.name == PLUGIN_ENTRY_POINT[0]]
    has_vllm = importlib.util.find_spec("vllm") is not None
    if found != [PLUGIN_ENTRY_POINT]:
        return False, (f"the m2nkit vLLM plugin entry point is not installed (found {found}); "
                       "run `pip install --no-deps -e .` in vLLM's environment")
    if not has_vllm:
        return False, "vLLM is not installed in this environment"
    return True, f"vLLM installed; plugin entry point {PLUGIN_ENTRY_POINT[1]}"


class ServeFailed(RuntimeError):
    """A step of the serve loop failed; the message names the step."""


class _Server:
    """``vllm serve`` in its own session (process group); ``stop()`` ends that group only."""

    def __init__(self, command: list[str], env: dict, log_path: Path, port: int) -> None:
        import subprocess

        self.base = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(command, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def wait_ready(self, timeout_s: float) -> float:
        import http.client

        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise ServeFailed(f"vllm serve exited with code {self.proc.returncode} before it "
                                  f"was ready; its log ends:\n{self.log_tail()}")
            try:
                if _http("GET", f"{self.base}/health", timeout=5)[0] == 200:
                    return time.monotonic() - t0
            except (OSError, http.client.HTTPException):   # refused, reset, timed out: not up yet
                pass
            time.sleep(1.0)
        raise ServeFailed(f"vllm serve was not ready within {timeout_s:.0f} s; its log ends:\n"
                          f"{self.log_tail()}")

    def stop(self) -> None:
        import signal
        import subprocess

        if self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
                try:
                    os.killpg(self.proc.pid, sig)      # the session this script started
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        self._log.close()


def _http(method: str, url: str, body: dict | None = None, timeout: float = 60.0,
          params: dict | None = None) -> tuple[int, str]:
    """``(status, body text)`` of one HTTP request, JSON body if any.

    The standard library only (as ``m2nkit.engine.clients.HTTPClient``): the
    fast tests run this file's server helpers in an environment with
    m2nkit's own dependencies, where ``requests`` (a vLLM dependency) may be
    missing. An HTTP error status is returned, not raised; a connection
    that fails raises ``OSError`` (``urllib.error.URLError`` is one).
    """
    import urllib.error
    import urllib.parse
    import urllib.request

    if params:
        url = f"{url}?{urllib.parse.urlencode(params)}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={} if data is None else {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.read().decode(errors="replace")


def _post(base: str, path: str, body: dict | None = None, timeout: float = 60.0,
          params: dict | None = None) -> dict:
    status, text = _http("POST", f"{base}/{path}", body, timeout, params)
    if status != 200:
        raise ServeFailed(f"POST /{path}: HTTP {status}: {text[:500]}")
    return json.loads(text) if text else {}


def _generate(base: str, timeout: float) -> dict:
    """Greedy completion of :data:`SERVE_PROMPT`: ``{"text", "token_ids", "weight_versions"}``."""
    out = _post(base, "v1/completions", {
        "model": SERVE_MODEL_NAME, "prompt": SERVE_PROMPT, "max_tokens": SERVE_MAX_TOKENS,
        "temperature": 0.0, "ignore_eos": True, "return_token_ids": True,
        "return_weight_versions": True}, timeout)
    choice = out["choices"][0]
    return {"text": choice.get("text"), "token_ids": choice.get("token_ids"),
            "weight_versions": choice.get("weight_versions")}


def _checksums(base: str, timeout: float) -> dict[str, str]:
    """vLLM's own sha256 of every live parameter, keyed ``dpD:ppP:pcpC:tpT:name`` (``/weight_checker``)."""
    return _post(base, "weight_checker", {"action": "checksum"}, timeout)["checksums"]


def _send_update(base: str, v1: Path, trainer: str, inference: str, timeout_s: float,
                 end: float) -> list[str]:
    """Trainer processes send ``v1`` in one m2nkit round, rank 0 driving the server with vLLM's
    ``HTTPVLLMWeightSyncClient``; returns one line per rank.

    ``timeout_s`` is the trainers' own deadline (``M2NTrainerInitInfo.timeout_s``,
    per init and per round); the processes are killed at ``end``
    (``time.monotonic``) at the latest.

    Raises:
        ServeFailed: a trainer failed (its rank and error) or hung.
    """
    import multiprocessing as mp
    import queue

    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    from m2nkit.adapters.trainer_spec import parse_trainer_spec
    from m2nkit.engine.tools.demo_vllm import trainer_main

    T = parse_trainer_spec(trainer).num_ranks
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    client = HTTPVLLMWeightSyncClient(base, timeout=timeout_s)
    procs = [ctx.Process(target=trainer_main, daemon=True, name=f"gpu-check-trainer-{r}",
                         args=(r, T, [str(v1)], trainer, inference, client if r == 0 else None,
                               port, timeout_s, results))
             for r in range(T)]
    for p in procs:
        p.start()
    lines, done = [], 0
    # Spawning imports torch (tens of seconds), then the init and the round.
    wait_s = min(2 * timeout_s + 60, end - time.monotonic())
    deadline = time.monotonic() + wait_s
    try:
        while done < T:
            try:
                kind, rank, a, b = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise ServeFailed(f"the trainers did not finish within {wait_s:.0f} s "
                                  f"({len(lines)} rounds reported)") from None
            if kind == "error":
                raise ServeFailed(f"trainer rank {rank} failed: {a}\n{b}")
            if kind == "round":
                lines.append(f"trainer rank {rank}: {_fmt_bytes(b[0])} in {_fmt_s(b[1])}")
            if kind == "done":
                done += 1
    finally:
        for p in procs:          # processes this script started; stop only them
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
    return lines


def _deadline(end: float, timeout_s: float, during: str):
    """A function giving the seconds the next HTTP call may wait: ``timeout_s``, or what
    is left before ``end`` (``time.monotonic``) when less.

    Raises:
        ServeFailed: (from the function) under 2 s are left; names ``during``.
    """
    def t() -> float:
        left = end - time.monotonic()
        if left < 2:
            raise ServeFailed(f"--total-timeout passed during {during}")
        return min(timeout_s, left)
    return t


def _check_updated(base: str, before: dict, sums0: dict[str, str], t, bad: list[str], log,
                   update: str) -> tuple[dict, dict[str, str]]:
    """After a round (``update`` says what came since ``before``): generate, and the
    generation must differ from ``before``, the served version be ``v1``, every
    parameter of ``sums0`` (vLLM's checksums of v0) be there and have changed. Appends
    what failed to ``bad``; returns the generation and the checksums (``t``: the
    :func:`_deadline` of each call)."""
    after = _generate(base, t())
    log(f"  v1: greedy tokens {after['token_ids']}; weight_versions {after['weight_versions']}")
    if (after["token_ids"], after["text"]) == (before["token_ids"], before["text"]):
        bad.append(f"generation did not change after {update}")
    served = _get_json(f"{base}/weight_info", t()).get("weight_version")
    if served != "v1":
        bad.append(f"the served weight_version is {served!r}, expected 'v1'")
    sums1 = _checksums(base, t())
    if set(sums1) != set(sums0):
        bad.append(f"the parameter set changed: {sorted(set(sums1) ^ set(sums0))[:5]}")
    unchanged = sorted(n for n in sums1 if sums0.get(n) == sums1[n])
    if unchanged:
        bad.append(f"{len(unchanged)} parameters kept their v0 bytes: {unchanged[:5]}")
    return after, sums1


def _check_own_load(base: str, weights, load: str, after: dict, sums1: dict[str, str], t,
                    bad: list[str], log) -> None:
    """vLLM reloads ``weights`` (a checkpoint folder; ``load`` names it in messages)
    itself (``/pause``, ``/collective_rpc`` ``reload_weights`` with ``weights_path``:
    its own loader, in place, ``model_loader/reload/inplace.py``; ``/resume``): every
    checksum must equal ``sums1`` (those m2nkit's round left) and generation give
    ``after``'s tokens. Appends what failed to ``bad``."""
    _post(base, "pause", params={"mode": "wait"}, timeout=t())
    budget = t()
    _post(base, "collective_rpc", {"method": "reload_weights",
                                   "kwargs": {"weights_path": str(weights)},
                                   "timeout": budget}, timeout=budget + 5)
    _post(base, "resume", timeout=t())
    sums2 = _checksums(base, t())
    differ = sorted(n for n in set(sums1) | set(sums2) if sums1.get(n) != sums2.get(n))
    if differ:
        bad.append(f"{len(differ)} parameters differ from vLLM's own load of {load}: "
                   f"{differ[:5]}")
    else:
        log(f"  all {len(sums2)} parameters equal vLLM's own load of {load} "
            "(sha256 per parameter)")
    again = _generate(base, t())
    if (again["token_ids"], again["text"]) != (after["token_ids"], after["text"]):
        bad.append(f"generation after vLLM's own load of {load} ({again['token_ids']}) "
                   f"differs from after m2nkit's update ({after['token_ids']})")


def serve_loop(base: str, v1: Path, trainer: str, inference: str, timeout_s: float,
               end: float, log=print) -> list[str]:
    """The RL-style loop against a ready server at ``base``; returns what failed (empty: passed).

    1. generate (greedy, fixed prompt) and take vLLM's checksums of v0;
    2. ``/pause``, one m2nkit round sending v1 from trainer processes through
       vLLM's ``HTTPVLLMWeightSyncClient``, ``/resume``;
    3. generate again: the tokens must change, the served version be ``v1``;
    4. checksums: every parameter must have changed;
    5. vLLM reloads v1 itself (``/collective_rpc`` ``reload_weights`` with
       ``weights_path``: its own loader, in place, ``model_loader/reload/inplace.py``):
       every checksum must equal the ones m2nkit's round left, and generation
       gives the same tokens.

    Every call waits at most ``timeout_s`` and nothing runs past ``end``
    (``time.monotonic``).

    Raises:
        ServeFailed: an HTTP call failed (route, status, body) or ``end`` passed.
    """
    t = _deadline(end, timeout_s, "the vllm serve loop")
    bad: list[str] = []
    before = _generate(base, t())
    sums0 = _checksums(base, t())
    log(f"  v0: {len(sums0)} parameters; greedy tokens {before['token_ids']}")
    _post(base, "pause", params={"mode": "wait"}, timeout=t())
    t0 = time.perf_counter()
    for line in _send_update(base, v1, trainer, inference, t(), end):
        log(f"  {line}")
    log(f"  m2nkit round v0 -> v1 from {trainer} in {time.perf_counter() - t0:.1f} s "
        "(trainer start included)")
    _post(base, "resume", timeout=t())
    after, sums1 = _check_updated(base, before, sums0, t, bad, log, "the update")
    _check_own_load(base, v1, "v1", after, sums1, t, bad, log)
    return bad


def _get_json(url: str, timeout: float) -> dict:
    status, text = _http("GET", url, timeout=timeout)
    if status != 200:
        raise ServeFailed(f"GET {url}: HTTP {status}: {text[:300]}")
    return json.loads(text)


def prepare_serve(workdir: Path, args, log=print) -> dict:
    """Everything of the serve check that needs no GPU; returns its plan.

    Writes v0 and v1 (with the tokenizer), checks the plugin is installed,
    plans the round ``--serve-trainer`` -> ``vllm:tp=--serve-tp`` and byte-checks
    it in-process (:func:`dry_run` on v1), and builds the server's command
    line and environment. Keys: ``v0, v1, trainer, inference, port, command,
    env_changes`` (the variables set on top of this environment), ``ok`` (the
    byte check passed), ``plugin_ok``, ``plugin`` (what :func:`plugin_status` said).
    """
    from m2nkit.adapters.trainer_spec import parse_trainer_spec
    from m2nkit.adapters.vllm import parse_inference_spec

    v0, v1 = serve_checkpoints(workdir)
    inference = f"vllm:tp={args.serve_tp}"
    tspec, ispec = parse_trainer_spec(args.serve_trainer), parse_inference_spec(inference)
    plugin_ok, plugin = plugin_status()
    log(f"vllm serve check: {SERVE_BASE_MODEL} at head_dim 64 ({v0.name}, {v1.name}: every "
        f"tensor differs), trainers {tspec} -> {ispec}; {plugin}")
    # The round goes over torch_p2p on a gloo group (trainers on CPU): slab by slab, no m2n.
    ok = dry_run(str(v1), [(f"{tspec}/{ispec}", tspec, ispec)], None)
    port = free_port()
    env = serve_env({})
    return {"v0": v0, "v1": v1, "trainer": str(tspec), "inference": str(ispec), "port": port,
            "command": serve_command(v0, port, args.serve_tp, args.serve_arg or []),
            "env_changes": env, "ok": ok, "plugin_ok": plugin_ok, "plugin": plugin}


#: The server being checked, so the watchdog can stop it (see :func:`main`).
_ACTIVE_SERVER: list = []


def run_serve(plan: dict, args, end: float, log=print) -> bool:
    """Start ``vllm serve`` (``plan``), run :func:`serve_loop`, always stop the server.

    Nothing runs past ``end`` (``time.monotonic``). The server's output goes
    to ``--serve-log``; its last lines are printed when the check fails.
    Returns True when every check passed.
    """
    return _with_server("vllm serve check", plan, args, end, Path(args.serve_log),
                        lambda base: serve_loop(base, plan["v1"], plan["trainer"],
                                                plan["inference"], args.timeout, end, log),
                        "generation changed after the update and every live parameter equals "
                        "vLLM's own load of v1", log)


def _with_server(label: str, plan: dict, args, end: float, log_path: Path, loop, passed: str,
                 log=print) -> bool:
    """Start the server of ``plan`` (``command``, ``port``), run ``loop(base)`` (what failed,
    a list), always stop the server; True when the list is empty. Nothing runs past ``end``."""
    import shlex

    if not plan["plugin_ok"]:
        log(f"{label}: FAILED before starting: {plan['plugin']}")
        return False
    started = time.monotonic()
    log(f"{label}: " + " ".join(f"{k}={v}" for k, v in plan["env_changes"].items()) + " "
        + shlex.join(plan["command"]))
    server = _Server(plan["command"], serve_env(), log_path, plan["port"])
    _ACTIVE_SERVER.append(server)
    try:
        ready = server.wait_ready(min(args.serve_start_timeout, max(end - time.monotonic() - 60, 5)))
        log(f"  server ready in {ready:.0f} s (log: {log_path})")
        bad = loop(server.base)
    except ServeFailed as e:
        bad = [str(e)]
    except Exception as e:  # noqa: BLE001 - reported, then the server is stopped
        bad = [f"{type(e).__name__}: {e}\n{traceback.format_exc()}"]
    finally:
        server.stop()
        _ACTIVE_SERVER.remove(server)
    took = time.monotonic() - started
    if bad:
        log(f"{label}: FAILED after {took:.0f} s")
        for b in bad:
            log(f"  {b}")
        log(f"  server log {log_path}, last lines:\n{server.log_tail(25)}")
        return False
    log(f"{label}: ok in {took:.0f} s: {passed}")
    return True


# --------------------------------------------------------------------------
# colocated: one GPU shared by a trainer process and vllm serve, through sleep mode


#: The colocated loop, in order (``--colocated``): what verl's hybrid engine, NeMo-RL's
#: colocated mode and TRL's colocate mode do between two rollouts, with m2nkit's ``ipc``
#: transport for the update (docs/colocated.md).
COLOCATED_STEPS = (
    ("generate", "greedy completion of the fixed prompt (v0); vLLM's checksums"),
    ("sleep", "POST /sleep?level=2: vLLM frees its weights and KV cache (nothing offloaded)"),
    ("train", "the trainer process loads v0 on the same GPU, takes one AdamW step, saves "
              "its weights (the reference)"),
    ("wake weights", "POST /wake_up?tags=weights: fresh memory for the weights, bytes undefined"),
    ("update", "one m2nkit round replicated:1 -> vllm:tp=1 over the ipc transport: the "
               "trainer's own CUDA tensors as CUDA IPC handles, copied into the live weights"),
    ("wake kv_cache", "POST /wake_up?tags=kv_cache: fully awake, scheduling resumes"),
    ("generate", "the tokens must change; the served version is v1; every checksum changed"),
    ("fresh load", "vLLM reloads the trainer's saved weights itself (reload_weights): every "
                   "checksum must equal what the round left, and generation the same tokens"),
)
#: The trainer: ``replicated:1`` (its whole model on the shared GPU), one worker.
COLOCATED_TRAINER, COLOCATED_INFERENCE = "replicated:1", "vllm:tp=1"
#: vllm serve options of the colocated case on top of :func:`serve_command`'s.
COLOCATED_SERVE_ARGS = ("--enable-sleep-mode",)
#: One AdamW step at this learning rate moves every weight of the tiny random model by
#: about half its scale (Adam's first step is lr * sign(grad)): greedy tokens change.
COLOCATED_LR = 1e-2


def colocated_train_step(model, seed: int = 0) -> float:
    """One AdamW step of ``model`` (a transformers causal LM) on a fixed random batch; the loss.

    Next-token cross-entropy on 4 sequences of 32 ids from the model's own
    vocabulary, on the model's device; ``weight_decay=0.01`` also moves the
    parameters without a gradient. Deterministic for a ``seed``.
    """
    import torch

    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (4, 32), generator=g).to(device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=COLOCATED_LR, weight_decay=0.01)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    model.eval()
    return float(loss.detach())


def colocated_source(model, checkpoint_dir: str | os.PathLike, trainer: str = COLOCATED_TRAINER):
    """This trainer's m2nkit source over ``model``'s **own** tensors (rank 0 of ``trainer``).

    The manifest is read from ``checkpoint_dir`` (what ``model`` saved: the
    wire names are its ``state_dict`` names); each entry's provider returns
    the live tensor from ``model.state_dict()`` (same storage as the
    parameter), so the ``ipc`` transport exposes the trainer's own CUDA
    memory and nothing is copied on the trainer's side.

    Raises:
        ValueError: a wire tensor of the checkpoint that ``model`` does not hold
            with that shape and dtype (names it).
    """
    from m2nkit.adapters.hf_checkpoint import checkpoint_manifest, read_checkpoint
    from m2nkit.manifest import M2NManifestEntry, ManifestM2NWeightSource

    live = {n: t.detach() for n, t in model.state_dict().items()}
    manifest = checkpoint_manifest(read_checkpoint(checkpoint_dir), trainer, 0)
    for e in manifest.entries:
        t = live.get(e.name)
        if t is None or tuple(t.shape) != tuple(e.global_shape) or t.dtype != e.dtype:
            got = "missing" if t is None else f"{list(t.shape)} {t.dtype}"
            raise ValueError(f"wire tensor '{e.name}' {list(e.global_shape)} {e.dtype} of "
                             f"{checkpoint_dir}: the trainer's model holds {got}")
    entries = [M2NManifestEntry(e.name, e.dtype, e.global_shape, e.source_layout,
                                lambda n=e.name: live[n]) for e in manifest.entries]
    return ManifestM2NWeightSource(entries, rank=0)


def colocated_trainer_main(v0: str, saved: str, base: str, port: int, timeout_s: float,
                           results, woken) -> None:
    """The colocated trainer process: train on the GPU vLLM shares, then send over ``ipc``.

    Loads ``v0`` with transformers onto ``cuda:0`` (bf16), takes one
    :func:`colocated_train_step`, saves its weights to ``saved`` (the
    reference vLLM reloads later) and puts ``("trained", 0, loss, None)``;
    waits for ``woken`` (the driver woke vLLM's weights), then
    ``trainer_init`` over the ``ipc`` transport with vLLM's
    ``HTTPVLLMWeightSyncClient`` on ``base`` and ``send_weights("v1")`` from
    :func:`colocated_source`: ``("round", 0, 1, (bytes, seconds))``, then
    ``("done", 0, None, None)``; any failure ``("error", 0, text, traceback)``.
    """
    from m2nkit.engine.tools.server import exit_with_parent

    exit_with_parent()
    try:
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

        from m2nkit.adapters.hf_checkpoint import read_checkpoint
        from m2nkit.adapters.vllm import vllm_destination
        from m2nkit.engine.trainer import M2NTrainerEngine, M2NTrainerInitInfo

        hf_logging.set_verbosity_error()
        model = AutoModelForCausalLM.from_pretrained(v0, dtype=torch.bfloat16).to("cuda:0")
        loss = colocated_train_step(model)
        model.save_pretrained(saved)
        torch.cuda.synchronize()
        results.put(("trained", 0, loss, None))
        if not woken.wait(timeout_s):
            raise TimeoutError(f"the driver did not wake vLLM's weights within {timeout_s:.0f} s")
        source = colocated_source(model, saved)
        info = M2NTrainerInitInfo(rank=0, num_trainer_ranks=1,
                                  destination=vllm_destination(read_checkpoint(v0).config,
                                                               COLOCATED_INFERENCE),
                                  master_port=port, timeout_s=timeout_s, transport="ipc")
        engine = M2NTrainerEngine.trainer_init(
            info, client=HTTPVLLMWeightSyncClient(base, timeout=timeout_s), source=source)
        stats = engine.send_weights("v1")
        results.put(("round", 0, 1, (stats.bytes_sent, stats.seconds)))
        engine.shutdown()
        results.put(("done", 0, None, None))
    except BaseException as e:  # noqa: BLE001 - reported to the driver
        results.put(("error", 0, f"{type(e).__name__}: {e}", traceback.format_exc()))


def _wait_for(results, kinds: tuple[str, ...], end: float, what: str):
    """The next report of a kind in ``kinds`` from the trainer process; an error is raised."""
    import queue

    while True:
        try:
            kind, _, a, b = results.get(timeout=max(0.1, end - time.monotonic()))
        except queue.Empty:
            raise ServeFailed(f"the colocated trainer did not {what} in time") from None
        if kind == "error":
            raise ServeFailed(f"the colocated trainer failed: {a}\n{b}")
        if kind in kinds:
            return kind, a, b


def colocated_loop(base: str, plan: dict, timeout_s: float, end: float, log=print, *,
                   trainer_main=None, ctx=None) -> list[str]:
    """:data:`COLOCATED_STEPS` against a ready server at ``base`` started with sleep mode;
    returns what failed (empty: passed).

    The trainer process (``trainer_main``, default :func:`colocated_trainer_main`,
    in a process of ``ctx``, default ``spawn``: it initializes CUDA) is started
    once vLLM sleeps and stopped on every exit.
    Every call waits at most ``timeout_s``; nothing runs past ``end``.

    Raises:
        ServeFailed: an HTTP call or the trainer failed (names the step).
    """
    import multiprocessing as mp

    t = _deadline(end, timeout_s, "the colocated loop")
    bad: list[str] = []
    before = _generate(base, t())
    sums0 = _checksums(base, t())
    log(f"  v0: {len(sums0)} parameters; greedy tokens {before['token_ids']}")
    _post(base, "sleep", params={"level": 2}, timeout=t())
    if not _get_json(f"{base}/is_sleeping", t()).get("is_sleeping"):
        bad.append("vLLM does not say it sleeps after POST /sleep?level=2")
    ctx = ctx or mp.get_context("spawn")
    results, woken = ctx.Queue(), ctx.Event()
    trainer = ctx.Process(target=trainer_main or colocated_trainer_main, daemon=True,
                          name="gpu-check-colocated-trainer",
                          args=(str(plan["v0"]), str(plan["saved"]), base, free_port(),
                                timeout_s, results, woken))
    trainer.start()
    try:
        # spawning imports torch and transformers (tens of seconds), then one step
        _, loss, _ = _wait_for(results, ("trained",), min(time.monotonic() + 2 * timeout_s + 60,
                                                          end), "train")
        log(f"  vLLM asleep (level 2); the trainer took one AdamW step on the same GPU "
            f"(loss {loss:.3f}) and saved its weights")
        _post(base, "wake_up", params={"tags": "weights"}, timeout=t())
        woken.set()
        _, _, (nbytes, seconds) = _wait_for(results, ("round",), time.monotonic() + t(),
                                            "send the round")
        log(f"  weights woken; m2nkit ipc round {COLOCATED_TRAINER} -> {COLOCATED_INFERENCE}: "
            f"{_fmt_bytes(nbytes)} in {_fmt_s(seconds)}")
        _wait_for(results, ("done",), time.monotonic() + t(), "shut down")
    finally:
        trainer.join(10)
        if trainer.is_alive():          # the process this function started; stop only it
            trainer.kill()
            trainer.join(5)
    woke = _post(base, "wake_up", params={"tags": "kv_cache"}, timeout=t())
    if woke.get("status") != "awake":
        bad.append(f"POST /wake_up?tags=kv_cache left vLLM {woke.get('status')!r}, not awake")
    after, sums1 = _check_updated(base, before, sums0, t, bad, log,
                                  "the train step and the update")
    _check_own_load(base, plan["saved"], "the trainer's weights", after, sums1, t, bad, log)
    return bad


def prepare_colocated(workdir: Path, args, log=print) -> dict:
    """Everything of the colocated case that needs no GPU; returns its plan.

    Writes v0 (with the word tokenizer), checks the plugin is installed,
    plans and byte-checks the round ``replicated:1 -> vllm:tp=1`` in this
    process (:func:`dry_run` on v0), and builds the server's command line
    (:func:`serve_command` with ``--enable-sleep-mode``) and environment.
    Keys: ``v0``, ``saved`` (where the trainer saves its trained weights),
    ``port``, ``command``, ``env_changes``, ``steps``
    (:data:`COLOCATED_STEPS`), ``ok``, ``plugin_ok``, ``plugin``.
    """
    from m2nkit.adapters.trainer_spec import parse_trainer_spec
    from m2nkit.adapters.vllm import parse_inference_spec

    root = workdir / "colocated"
    root.mkdir(parents=True, exist_ok=True)
    v0, _ = serve_checkpoints(root)
    tspec, ispec = parse_trainer_spec(COLOCATED_TRAINER), parse_inference_spec(COLOCATED_INFERENCE)
    plugin_ok, plugin = plugin_status()
    log(f"colocated check: {SERVE_BASE_MODEL} at head_dim 64 ({v0.name}), trainer {tspec} and "
        f"{ispec} on one GPU through sleep mode; {plugin}")
    ok = dry_run(str(v0), [(f"{tspec}/{ispec}", tspec, ispec)], None)
    port = free_port()
    return {"v0": v0, "saved": root / "trained", "port": port,
            "command": serve_command(v0, port, 1, [*COLOCATED_SERVE_ARGS, *(args.serve_arg or [])]),
            "env_changes": serve_env({}), "steps": COLOCATED_STEPS, "ok": ok,
            "plugin_ok": plugin_ok, "plugin": plugin}


def run_colocated(plan: dict, args, end: float, log=print) -> bool:
    """Start ``vllm serve --enable-sleep-mode`` (``plan``), run :func:`colocated_loop`, always
    stop the server and the trainer. Returns True when every check passed."""
    return _with_server("colocated check", plan, args, end, Path(args.colocated_log),
                        lambda base: colocated_loop(base, plan, args.timeout, end, log),
                        "through sleep, a train step and wake, generation changed and every "
                        "live parameter equals vLLM's own load of the trained weights", log)


def _table(title, head, rows) -> None:
    cells = [tuple(str(c) for c in head)] + [tuple(str(c) for c in r) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(head))]
    print(title)
    for k, r in enumerate(cells):
        print("  " + " | ".join(c.ljust(w) for c, w in zip(r, widths)))
        if k == 0:
            print("  " + "-+-".join("-" * w for w in widths))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true",
                   help="no GPU work, any machine: plans, an in-process byte check, and the "
                        "nccl.m2n descriptors where nccl.m2n imports")
    p.add_argument("--scenario", action="append", metavar="TRAINER/INFERENCE",
                   help=f"repeatable; default: {', '.join(DEFAULT_SCENARIOS)}")
    p.add_argument("--model", default="tiny-qwen3-moe", help="built-in tiny model (m2nkit.adapters.tiny)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds any single wait may take")
    p.add_argument("--scenario-timeout", type=float, default=150.0,
                   help="seconds one scenario's processes may run in all")
    p.add_argument("--rounds", type=int, default=2, help="rounds per scenario (the first warms up)")
    p.add_argument("--bucket-bytes", type=int, default=1 << 20, help="torch_p2p bucket size")
    p.add_argument("--share-gpu", choices=("auto", "no"), default="auto",
                   help="auto: put several ranks on one GPU when there are too few (experimental)")
    g = p.add_argument_group("vllm serve with the m2nkit plugin (RL loop: generate, update, generate)")
    g.add_argument("--vllm-serve", choices=("no", "also", "only"), default="no",
                   help="also: after the scenarios; only: instead of them (no nccl.m2n needed)")
    g.add_argument("--serve-trainer", default="fsdp:2",
                   help="checkpoint trainer spec of the processes that send the update")
    g.add_argument("--serve-tp", type=int, default=1, help="vllm serve --tensor-parallel-size")
    g.add_argument("--serve-arg", action="append", metavar="ARG",
                   help="extra vllm serve argument, repeatable, last wins "
                        "(e.g. --serve-arg=--enforce-eager)")
    g.add_argument("--serve-start-timeout", type=float, default=300.0,
                   help="seconds the server may take to answer /health")
    g.add_argument("--serve-log", default=str(Path(tempfile.gettempdir())
                                              / "m2nkit-gpu-check-vllm-serve.log"),
                   help="where the server's output goes")
    c = p.add_argument_group("colocated: one GPU shared by a trainer process and vllm serve "
                             "(generate, sleep, train step, wake, update over ipc, generate)")
    c.add_argument("--colocated", choices=("no", "also", "only"), default="no",
                   help="also: after the other checks; only: instead of the scenarios "
                        "(< 5 minutes alone)")
    c.add_argument("--colocated-log", default=str(Path(tempfile.gettempdir())
                                                  / "m2nkit-gpu-check-colocated.log"),
                   help="where the colocated case's server output goes")
    p.add_argument("--total-timeout", type=float, default=570.0,
                   help="hard bound on the whole GPU run in seconds: nothing starts after it, and "
                        "30 s later a watchdog stops the server and every child and exits 1")
    return p


#: Seconds of --total-timeout kept for the serve check when the scenarios run first.
SERVE_RESERVE_S = 300.0
#: Seconds of --total-timeout kept for the colocated case when other checks run first
#: (raise --total-timeout to run everything: the reserves add up).
COLOCATED_RESERVE_S = 270.0


def _watchdog(total_s: float) -> None:
    """After ``total_s``: stop the server and this script's children, exit 1 (a hard bound)."""
    import multiprocessing as mp
    import threading

    def fire() -> None:
        print(f"gpu_check: --total-timeout {total_s - 30:g} s passed 30 s ago; stopping the "
              "server and this script's processes", file=sys.stderr, flush=True)
        for server in list(_ACTIVE_SERVER):
            server.stop()
        for child in mp.active_children():   # only processes this script started
            child.kill()
        os._exit(EXIT_FAILED)

    timer = threading.Timer(total_s, fire)
    timer.daemon = True
    timer.start()


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    p = _parser()
    args = p.parse_args(argv)
    for name in ("timeout", "scenario_timeout", "rounds", "bucket_bytes", "serve_tp",
                 "serve_start_timeout", "total_timeout"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    try:
        scenarios = [(t, *_parse_scenario(t)) for t in (args.scenario or DEFAULT_SCENARIOS)]
        if args.vllm_serve != "no":
            _parse_scenario(f"{args.serve_trainer}/vllm:tp={args.serve_tp}")
    except ValueError as e:
        p.error(str(e))
    from m2nkit.adapters.tiny import BUILTIN_TINY_MODELS, save_tiny_checkpoint
    from m2nkit.engine.transports.nccl_m2n_runtime import NcclM2NUnavailableError, import_nccl_m2n

    if args.model not in BUILTIN_TINY_MODELS:
        p.error(f"--model {args.model!r} is not a built-in tiny model; choose from "
                f"{sorted(BUILTIN_TINY_MODELS)}")
    run_scenarios = "only" not in (args.vllm_serve, args.colocated)
    try:
        m2n, _ = import_nccl_m2n()
        no_m2n = None
    except NcclM2NUnavailableError as e:
        if not args.dry_run and run_scenarios:   # the GPU run needs it; say so before any work
            print(f"gpu_check: {e}", file=sys.stderr)
            return EXIT_USAGE
        m2n, no_m2n = None, str(e)
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():   # say so before building and checking anything
            print("no CUDA device here: only --dry-run can run", file=sys.stderr)
            return EXIT_USAGE
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as tmp:
        ok, ckpt, serve, coloc = True, None, None, None
        if run_scenarios:
            ckpt = str(save_tiny_checkpoint(args.model, Path(tmp) / args.model, seed=0))
            ok = dry_run(ckpt, scenarios, m2n, args.bucket_bytes)
        if args.vllm_serve != "no":
            serve = prepare_serve(Path(tmp), args)
            ok &= serve["ok"]
        if args.colocated != "no":
            coloc = prepare_colocated(Path(tmp), args)
            ok &= coloc["ok"]
        if args.dry_run:
            if run_scenarios:
                print("skipped (--dry-run): the GPU run (one process per rank, nccl.m2n reshards "
                      "and torch_p2p over NCCL); run without --dry-run on a GPU machine")
            if serve is not None:
                import shlex

                print("vllm serve plan: " + " ".join(f"{k}={v}" for k, v in
                                                     serve["env_changes"].items())
                      + " " + shlex.join(serve["command"]))
                print("skipped (--dry-run): vllm serve (start it, generate, pause, m2nkit round "
                      f"{serve['trainer']} -> {serve['inference']} through HTTPVLLMWeightSyncClient, "
                      "resume, generate, compare with vLLM's own load of v1); run with "
                      f"--vllm-serve {args.vllm_serve} on a GPU machine")
                if not serve["plugin_ok"]:
                    print(f"note: the serve check would fail here: {serve['plugin']}")
            if coloc is not None:
                import shlex

                print("colocated plan: " + " ".join(f"{k}={v}" for k, v in
                                                    coloc["env_changes"].items())
                      + " " + shlex.join(coloc["command"]))
                for k, (step, what) in enumerate(coloc["steps"], 1):
                    print(f"  colocated step {k}: {step}: {what}")
                print("skipped (--dry-run): colocated (one GPU shared by the trainer process "
                      f"and vllm serve: {' -> '.join(step for step, _ in coloc['steps'])}); run "
                      f"with --colocated {args.colocated} on a GPU machine")
                if not coloc["plugin_ok"]:
                    print(f"note: the colocated check would fail here: {coloc['plugin']}")
            if no_m2n:
                print(f"skipped: the nccl.m2n descriptors, because {no_m2n}")
            print("dry run: every worker byte matches vLLM's loaders" if ok else
                  "dry run: FAILED (see the table)")
            return EXIT_OK if ok else EXIT_FAILED
        end = started + args.total_timeout
        _watchdog(args.total_timeout + 30 - (time.monotonic() - started))
        if serve is not None or coloc is not None:   # SIGTERM: unwind, so the server is stopped
            import signal

            signal.signal(signal.SIGTERM, lambda *_: sys.exit(EXIT_FAILED))
        coloc_reserve = COLOCATED_RESERVE_S if coloc is not None else 0.0
        if run_scenarios:
            reserve = (SERVE_RESERVE_S if serve is not None else 0.0) + coloc_reserve
            ok &= gpu_run(ckpt, scenarios, args, end - reserve)
        if serve is not None:
            ok &= run_serve(serve, args, end - coloc_reserve)
        if coloc is not None:
            ok &= run_colocated(coloc, args, end)
        return EXIT_OK if ok else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
