"""``m2nkit`` command line: see the plan before renting a GPU, or run the demo.

``m2nkit plan CHECKPOINT --trainer SPEC --inference SPEC`` reads a
checkpoint's safetensors headers (or just its ``config.json``), lays the
tensors out as the trainer holds them, lays vLLM's storage out as the
workers will, and prints what moves where, what ``nccl.m2n`` cannot carry
and why, and how long it should take. ``--bindings`` shows where each
Hugging Face tensor lands in vLLM's parameters; ``--verify`` runs the plan
in this process on the checkpoint's real bytes and checks every worker
against an independent reference of vLLM's loaders; ``--dump DIR`` then
writes every worker's storage as safetensors.

``m2nkit demo`` runs a real multi-process transfer on this machine
(``engine/tools/demo.py``) under a small supervisor, so that Ctrl-C stops it with
one line (see :func:`_supervise_demo`).

Built on argparse (standard library) and rich (tables). Specs and the
model's architecture are checked before torch or transformers is imported,
so a typo is refused in milliseconds. User errors print one line, no
traceback, and exit 2; a plan with problems, a failed verification or a
failed demo round exits 1; an interrupted demo exits 128 + the signal
(130 for Ctrl-C).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import math
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

__all__ = ["main"]

EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE = 0, 1, 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def _fmt_seconds(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.2f} s"


class UserError(Exception):
    """An error the user can fix; printed without a traceback."""


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("m2nkit")
    except PackageNotFoundError:  # running from a tree that was never installed
        return "unknown"


def _console():
    """A rich console for stdout: the terminal's width, else ``COLUMNS``, else 200.

    Piped output (logs, CI) would get rich's 80 columns; 200 keeps the tables
    on one line each, and ``COLUMNS`` overrides it as it does on a terminal.
    """
    from rich.console import Console

    if sys.stdout.isatty():
        return Console()                           # rich reads COLUMNS itself
    columns = os.environ.get("COLUMNS", "").strip()
    return Console(width=int(columns) if columns.isdigit() and int(columns) > 0 else 200)


# --------------------------------------------------------------------------
# checks before the heavy imports

def _check_architecture(path: str | os.PathLike, what: str) -> None:
    """Refuse a checkpoint whose ``config.json`` names an unsupported architecture.

    Reads the file with ``json`` only. Anything else wrong with it (missing,
    not JSON) is left to the checkpoint reader, which says what is wrong.

    Raises:
        UserError: ``architectures[0]`` has no model family (the message lists
            the supported ones: ``m2nkit.adapters.families``).
    """
    from m2nkit.adapters.families import architecture_of

    p = Path(path)
    config = p / "config.json" if p.is_dir() else p
    if config.suffix != ".json" or not config.is_file():
        return
    try:
        doc = json.loads(config.read_text())
    except (OSError, ValueError):
        return
    if not isinstance(doc, dict):
        return
    try:
        architecture_of(doc)
    except ValueError as e:
        raise UserError(f"{what} {config}: {e}") from None


def _precheck(args) -> None:
    """Everything a user can get wrong that needs no torch: specs, architecture, flags.

    Raises:
        UserError, ValueError: printed as one line, exit 2.
    """
    for flag in ("link_gbps", "timeout", "bucket_mib"):
        value = getattr(args, flag, 1.0)
        if not (value > 0 and math.isfinite(value)):  # also refuses NaN and inf
            raise UserError(f"--{flag.replace('_', '-')} must be a finite number > 0, got {value}")
    if _is_bridge_demo(args):   # Megatron-Bridge trainers (engine/tools/demo_bridge.py)
        tspec = importlib.import_module("m2nkit.engine.tools.demo_bridge").parse_bridge_spec(
            args.trainer)
    else:
        tspec = importlib.import_module("m2nkit.adapters.trainer_spec").parse_trainer_spec(
            args.trainer)
    if getattr(args, "bridge_mode", None) and not _is_bridge_demo(args):
        raise UserError(f"--bridge-mode needs a bridge: trainer (--trainer bridge:tp=2,pp=2), "
                        f"got --trainer {args.trainer}")
    if _is_bridge_demo(args) and args.receiver != "stand-in":
        raise UserError("--trainer bridge:... runs with --receiver stand-in only")
    if _is_megatron_demo(args):  # Megatron-Core trainers (engine/tools/demo_megatron.py)
        importlib.import_module("m2nkit.engine.tools.demo_megatron").parse_megatron_demo_spec(
            args.trainer)
        if args.receiver != "stand-in":
            raise UserError("--trainer megatron:... runs with --receiver stand-in only")
    ispec = importlib.import_module("m2nkit.adapters.vllm.spec").parse_inference_spec(args.inference)
    if args.command == "plan":
        if args.dump is not None and not args.verify:
            raise UserError("--dump writes the storage that --verify fills: add --verify")
        _check_architecture(args.checkpoint, "checkpoint")
        return
    from m2nkit.engine.tools.demo import MAX_DEMO_PROCESSES

    if args.rounds < 1:
        raise UserError(f"--rounds must be >= 1, got {args.rounds}")
    count = tspec.num_ranks + ispec.num_workers
    if count > MAX_DEMO_PROCESSES:
        raise UserError(f"{args.trainer} -> {args.inference} needs {count} processes; the demo "
                        f"runs at most {MAX_DEMO_PROCESSES} on one machine (use m2nkit plan "
                        "for larger layouts)")
    if Path(args.model).is_dir():
        _check_architecture(args.model, "--model")


def _is_bridge_demo(args) -> bool:
    return args.command == "demo" and args.trainer.strip().lower().startswith("bridge:")


def _is_megatron_demo(args) -> bool:
    return args.command == "demo" and args.trainer.strip().lower().startswith("megatron:")


# --------------------------------------------------------------------------
# m2nkit plan


def _build(args):
    """Read, lay out and plan; returns the pieces and ``{phase: seconds}``
    (imports, read: config/headers and the trainer layout, vLLM layout, plan)."""
    t0 = time.perf_counter()
    from m2nkit.adapters.hf_checkpoint import checkpoint_metas, read_checkpoint
    from m2nkit.adapters.trainer_spec import parse_trainer_spec
    from m2nkit.adapters.vllm import destination_layout, parse_inference_spec
    from m2nkit.engine.plan import build_plan
    from m2nkit.manifest.serialize import manifest_digest

    tspec = parse_trainer_spec(args.trainer)
    ispec = parse_inference_spec(args.inference)
    t1 = time.perf_counter()
    ckpt = read_checkpoint(args.checkpoint)
    metas = checkpoint_metas(ckpt, tspec)
    t2 = time.perf_counter()
    dest = destination_layout(ckpt.config, metas, ispec)
    t3 = time.perf_counter()
    # The manifest digest is only shown by --json and --dump; hashing every
    # tensor's owners costs a noticeable part of a config-only plan.
    digest = manifest_digest(metas, tspec.num_ranks) if args.json or args.dump else ""
    plan = build_plan(metas, tspec.num_ranks, dest, manifest_digest=digest)
    t4 = time.perf_counter()
    timings = {"imports": t1 - t0, "read": t2 - t1, "vLLM layout": t3 - t2, "plan": t4 - t3}
    return ckpt, tspec, ispec, metas, plan, timings


def _print_summary(console, args, ckpt, metas, plan, timings):
    from rich.table import Table

    t = Table(title="m2nkit plan", show_header=False, title_justify="left")
    t.add_column("what", style="bold")
    t.add_column("value")
    n_skipped = sum(1 for w in plan.wires if w.skipped)
    send, recv = plan.send_bytes, plan.recv_bytes
    mean_send = send.mean() if len(send) else 0
    m2n_ok = sum(1 for w in plan.wires if w.verdict("nccl_m2n").ok)
    t.add_row("model", f"{ckpt.architecture} ({ckpt.path})")
    t.add_row("trainer", f"{args.trainer}: {plan.num_trainer_ranks} ranks")
    t.add_row("inference", f"{args.inference}: {plan.num_workers} workers")
    t.add_row("wire tensors", f"{len(plan.wires)} ({n_skipped} skipped by vLLM), "
                              f"{_fmt_bytes(sum(m.nbytes for m in metas))}")
    t.add_row("slabs", f"{plan.num_slabs:,}")
    ratio = plan.nbytes_moved / plan.nbytes_min if plan.nbytes_min else 1.0
    t.add_row("bytes moved / minimum",
              f"{_fmt_bytes(plan.nbytes_moved)} / {_fmt_bytes(plan.nbytes_min)} (ratio {ratio:.3f})")
    t.add_row("max send per trainer rank", _fmt_bytes(send.max(initial=0)))
    t.add_row("max receive per worker", _fmt_bytes(recv.max(initial=0)))
    t.add_row("send imbalance (max/mean)", f"{send.max() / mean_send:.3f}" if mean_send else "-")
    t.add_row("fan-in / fan-out (max)", f"{plan.fan_in().max(initial=0)} / {plan.fan_out().max(initial=0)}")
    t.add_row("nccl_m2n expressible", f"{plan.carried_share('nccl_m2n'):.1%} of bytes, "
                                      f"{m2n_ok} of {len(plan.wires) - n_skipped} tensors")
    t.add_row(f"estimated time @ {args.link_gbps:g} Gbit/s per rank",
              _fmt_seconds(plan.estimated_seconds(args.link_gbps)))
    t.add_row("planning time", ", ".join(f"{k} {_fmt_seconds(v)}" for k, v in timings.items()))
    t.add_row("problems", str(len(plan.problems)) if plan.problems else "none")
    for note in plan.destination.notes:  # how vLLM's dtype and expert placement were decided
        t.add_row("note", note)
    console.print(t)

    reasons = Counter()
    example = {}
    for w in plan.wires:
        verdict = w.verdict("nccl_m2n")
        if not w.skipped and w.bindings and not verdict.ok:
            key = _reason_class(verdict.reason)
            reasons[key] += 1
            example.setdefault(key, (w.name, verdict.reason))
    if reasons:
        r = Table(title="not carried by nccl_m2n (sent by torch_p2p)", title_justify="left")
        r.add_column("tensors", justify="right")
        r.add_column("reason", overflow="fold")
        r.add_column("example", overflow="fold")
        for key, n in reasons.most_common():
            name, reason = example[key]
            r.add_row(str(n), reason, name)
        console.print(r)


def _reason_class(reason: str) -> str:
    """Group reasons that differ only in numbers."""
    return "".join("#" if c.isdigit() else c for c in reason)


def _print_tensors(console, plan):
    from rich.table import Table

    t = Table(title="wire tensors", title_justify="left")
    for col in ("name", "dtype", "shape", "bytes moved", "slabs", "nccl_m2n"):
        t.add_column(col, overflow="fold")
    for w in plan.wires:
        verdict = w.verdict("nccl_m2n")
        m2n = "skipped: " + w.skipped if w.skipped else ("yes" if verdict.ok else "no: " + verdict.reason)
        t.add_row(w.name, str(w.meta.dtype).removeprefix("torch."), str(list(w.meta.shape)),
                  _fmt_bytes(w.nbytes_moved), str(len(w.table)), m2n)
    console.print(t)


#: What each dim of a tensor is called in the bindings table, by tensor rank.
#: Stacked experts (``w13_weight``, ``w2_weight`` and the stacked wire
#: tensors) are ``[E, rows, cols]``.
_DIM_NAMES = {1: ("rows",), 2: ("rows", "cols"), 3: ("experts", "rows", "cols")}


def _describe_box(box, shape) -> str:
    """``box`` of a tensor of ``shape`` in words: ``"rows 64:80"``, ``"experts 0:4"``.

    Dims the box covers whole are left out; a box covering the whole tensor
    is ``"whole"``. Ranges are half-open, ``start:stop``.
    """
    names = _DIM_NAMES.get(len(shape), tuple(f"dim{i}" for i in range(len(shape))))
    parts = [f"{n} {a}:{b}" for n, (a, b), size in zip(names, box, shape) if (a, b) != (0, size)]
    return ", ".join(parts) or "whole"


def _describe_workers(workers) -> str:
    """``"worker 3"``, ``"workers 0–3"``, ``"workers 0–1, 4–5"`` (sorted, runs joined)."""
    ws = sorted(set(workers))
    runs: list[list[int]] = []
    for w in ws:
        if runs and w == runs[-1][1] + 1:
            runs[-1][1] = w
        else:
            runs.append([w, w])
    text = ", ".join(f"{a}" if a == b else f"{a}–{b}" for a, b in runs)
    return f"worker{'s' if len(ws) > 1 else ''} {text}"


def _binding_rows(plan) -> list[tuple[str, str, str, str, str]]:
    """One row per (wire tensor, vLLM parameter, region): where each wire tensor lands.

    Returns ``(wire tensor, vLLM parameter, region of the parameter, workers,
    part of the wire tensor they take)``, in wire order. Workers taking the
    same region of the same parameter share a row; when they take different
    parts of the wire tensor (tensor-parallel shards), the last column says
    which worker takes which. Regions and parts are in local coordinates of
    the parameter and global coordinates of the wire tensor
    (:func:`_describe_box`). Skipped wire tensors, and those no vLLM
    parameter takes, get one row saying why.
    """
    dest = plan.destination
    params = dest.param_index()
    rows = []
    for wp in plan.wires:
        name, shape = wp.name, tuple(wp.meta.shape)
        if wp.skipped:
            rows.append((name, "-", "-", "-", f"skipped: {wp.skipped}"))
            continue
        bindings = dest.bindings.get(name, ())
        if not bindings:
            why = dest.unknown.get(name, "no vLLM parameter takes it")
            rows.append((name, "-", "-", "-", f"not taken: {why}"))
            continue
        groups: dict[tuple, list] = {}
        for b in bindings:
            pshape = params[(b.worker, b.param)].shape
            groups.setdefault((b.param, b.region, tuple(pshape)), []).append(b)
        for (param, region, pshape), group in sorted(
                groups.items(), key=lambda kv: (min(b.worker for b in kv[1]), kv[0][1])):
            by_box: dict[tuple, list[int]] = {}
            for b in group:
                by_box.setdefault(b.box, []).append(b.worker)
            if len(by_box) == 1:
                takes = _describe_box(next(iter(by_box)), shape)
            else:
                takes = "; ".join(f"{_describe_box(box, shape)} ({_describe_workers(ws)})"
                                  for box, ws in sorted(by_box.items(), key=lambda kv: min(kv[1])))
            rows.append((name, param, _describe_box(region, pshape),
                         _describe_workers(b.worker for b in group), takes))
    return rows


def _print_bindings(console, plan):
    from rich.table import Table

    t = Table(title="where each wire tensor lands (HF name -> vLLM parameter)",
              title_justify="left")
    for col in ("wire tensor", "vLLM parameter", "region", "workers", "takes"):
        t.add_column(col, overflow="fold")
    for row in _binding_rows(plan):
        t.add_row(*row)
    console.print(t)
    for alias, target in sorted(plan.destination.aliases.items()):
        console.print(f"vLLM parameter {alias} is the storage of {target} (tied; filled through it)",
                      markup=False, highlight=False)


def _verify(console, ckpt, tspec, ispec, plan):
    """Execute ``plan`` in this process and compare every worker with ``reference_load``.

    Returns ``(ok, storage)``: whether every worker is bit-exact, and each
    worker's storage ``{worker: {vLLM param: tensor}}``.
    """
    from m2nkit.adapters.hf_checkpoint import checkpoint_manifest, full_checkpoint_tensors
    from m2nkit.adapters.vllm import reference_load
    from m2nkit.engine.in_process import allocate_storage, bitwise_equal, execute_plan

    workers = range(plan.num_workers)
    storage = {w: allocate_storage(plan.destination, w) for w in workers}
    sources = {r: checkpoint_manifest(ckpt, tspec, r) for r in range(tspec.num_ranks)}
    t0 = time.perf_counter()
    execute_plan(plan, {r: s.iter_local() for r, s in sources.items()}, storage)
    t1 = time.perf_counter()
    full = full_checkpoint_tensors(ckpt)
    ok = True
    aliases = plan.destination.aliases
    for w in workers:
        ref = reference_load(ckpt.config, full, ispec, w)
        got = storage[w]
        names = set(ref) - set(aliases)
        missing, extra = names - set(got), set(got) - names
        bad = sorted(n for n in names & set(got) if not bitwise_equal(got[n], ref[n]))
        for alias, target in aliases.items():
            if alias in ref and target in got and not bitwise_equal(got[target], ref[alias]):
                bad.append(alias)
        if missing or extra or bad:
            ok = False
            console.print(f"[red]worker {w}: {len(bad)} tensors differ from vLLM's loader "
                          f"semantics {bad[:5]}, missing {sorted(missing)[:5]}, "
                          f"unexpected {sorted(extra)[:5]}[/red]")
    if ok:
        console.print(f"[green]verify: all {plan.num_workers} workers hold exactly what vLLM's "
                      f"loaders would ({len(names)} parameters each; executed "
                      f"{plan.num_slabs:,} slabs in {_fmt_seconds(t1 - t0)})[/green]")
    return ok, storage


def _open_dump_dir(path: str | None) -> tuple[Path | None, bool]:
    """Create ``--dump DIR`` before any work, so a bad path fails first.

    Returns the directory (None without ``--dump``) and whether this call
    created it, so that a run that writes nothing there can remove it again.
    """
    if path is None:
        return None, False
    if not path.strip():
        raise UserError("--dump needs a directory path, got an empty string")
    d = Path(path)
    created = not d.exists()
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--dump {path}: cannot create that directory ({e.strerror or e})") from None
    if not os.access(d, os.W_OK):
        raise UserError(f"--dump {path}: the directory is not writable")
    return d, created


def _dump(console, directory: Path, storage, plan, ckpt, ispec) -> None:
    """Write each worker's storage as ``DIR/worker{w}.safetensors``.

    Tensors carry vLLM's parameter names, local shapes and dtypes, as the
    worker holds them. A parameter that shares storage with another (tied
    ``lm_head.weight``) is saved once, under the name it aliases; the
    ``aliases`` metadata lists it. Metadata (strings): ``worker``,
    ``tp_rank``, ``dp_rank``, ``ep_rank`` (``none`` without expert
    parallelism), ``inference``, ``model``, ``architecture``,
    ``plan_digest``, ``manifest_digest``, ``aliases`` (JSON ``{alias:
    parameter}``).
    """
    from safetensors.torch import save_file

    plan_digest = plan.digest()
    for w, tensors in storage.items():
        aliases = {a: t for a, t in plan.destination.aliases.items() if t in tensors}
        metadata = {
            "format": "pt",
            "worker": str(w),
            "tp_rank": str(ispec.tp_rank(w)),
            "dp_rank": str(ispec.dp_index(w)),
            "ep_rank": str(w) if ispec.ep else "none",
            "inference": str(ispec),
            "model": str(Path(ckpt.path).resolve()),
            "architecture": ckpt.architecture,
            "plan_digest": plan_digest,
            "manifest_digest": plan.manifest_digest,
            "aliases": json.dumps(aliases, sort_keys=True),
        }
        out = directory / f"worker{w}.safetensors"
        save_file({n: t.contiguous() for n, t in tensors.items() if n not in aliases}, str(out),
                  metadata=metadata)
    console.print(f"wrote {len(storage)} worker files to {directory}/ "
                  f"(worker0.safetensors .. worker{len(storage) - 1}.safetensors)")


def _open_json(path: str | None):
    """Open a temporary file beside ``--json PATH`` before any work (a bad path fails
    first); :func:`_finish_json` moves it onto PATH only when the run succeeded, so a
    failed run never touches what was at PATH."""
    if path is None:
        return None
    if not path.strip():
        raise UserError("--json needs a file path, got an empty string")
    target = Path(path)
    if target.exists() and not target.is_file():
        raise UserError(f"--json {path}: exists and is not a regular file; give a file path")
    try:
        handle = tempfile.NamedTemporaryFile("w", dir=target.parent, prefix=f".{target.name}.",
                                             suffix=".partial", delete=False)
    except OSError as e:
        raise UserError(f"--json {path}: cannot write there ({e.strerror or e})") from None
    handle.target = target
    return handle


def _finish_json(handle, ok: bool) -> None:
    handle.close()
    if not ok:
        Path(handle.name).unlink(missing_ok=True)
        return
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(handle.name, 0o666 & ~umask)
    os.replace(handle.name, handle.target)


def _quiet_transformers() -> None:
    """transformers logs errors only, without importing it (about a second) when it is
    not loaded yet: a config-only plan never needs it (``m2nkit.adapters.config_wires``);
    the checkpoint reader imports it later, and it reads this variable then."""
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    else:
        os.environ["TRANSFORMERS_VERBOSITY"] = "error"


def _cmd_plan(args) -> int:
    json_file, dump_dir, dump_dir_created = None, None, False
    written = False
    try:
        json_file = _open_json(args.json)
        dump_dir, dump_dir_created = _open_dump_dir(args.dump)
        _quiet_transformers()
        status = _plan_and_report(args, _console(), json_file, dump_dir)
        written = True
        return status
    finally:
        if json_file is not None:
            _finish_json(json_file, written)
        if dump_dir_created and not any(dump_dir.iterdir()):
            dump_dir.rmdir()


def _plan_and_report(args, console, json_file, dump_dir) -> int:
    # Importing torch and planning a model of a thousand tensors allocate
    # millions of objects and next to no reference cycles; the cyclic garbage
    # collector would walk them over and over (about 0.8 s of a 3 s Kimi-K2
    # plan). It is back on before anything else runs.
    gc.disable()
    try:
        ckpt, tspec, ispec, metas, plan, timings = _build(args)
    finally:
        gc.enable()
    if args.verify and not ckpt.has_data:
        raise UserError(f"--verify needs tensor data, but {ckpt.path} has only a config")
    _print_summary(console, args, ckpt, metas, plan, timings)
    if args.verbose:
        _print_tensors(console, plan)
    if args.bindings:
        _print_bindings(console, plan)
    if json_file is not None:
        from m2nkit.manifest.serialize import manifest_to_json

        out = {"manifest": manifest_to_json(metas, tspec.num_ranks), "plan": plan.to_json(),
               "notes": list(plan.destination.notes)}
        json.dump(out, json_file)
        json_file.flush()
        console.print(f"wrote {args.json}")
    status = EXIT_OK
    for p in plan.problems:
        console.print(f"[red]problem: {p}[/red]")
        status = EXIT_PROBLEMS
    if args.verify:
        if plan.problems:
            console.print("[red]verify skipped: the plan has problems"
                          + (" (nothing dumped)" if dump_dir else "") + "[/red]")
            return status
        ok, storage = _verify(console, ckpt, tspec, ispec, plan)
        if dump_dir is not None:
            _dump(console, dump_dir, storage, plan, ckpt, ispec)
        if not ok:
            status = EXIT_PROBLEMS
    return status


# --------------------------------------------------------------------------
# m2nkit demo


def _has_real_stdio() -> bool:
    """Whether stdout and stderr are file descriptors a child process can inherit."""
    try:
        sys.stdout.fileno()
        sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # pytest's capsys, io.StringIO
        return False
    return True


def _cmd_demo(args) -> int:
    if args.driver or not _has_real_stdio():
        return _demo_here(args)
    return _supervise_demo(args)


def _demo_here(args) -> int:
    """Run the demo in this process (the driver) and print its table."""
    import signal
    import threading

    t_start = time.monotonic()
    console = _console()

    def log(message: str) -> None:
        console.print(f"[{time.monotonic() - t_start:6.1f} s] {message}", markup=False,
                      highlight=False)

    if args.driver:
        # The supervisor stops us with SIGTERM (tear down, exit quietly) and
        # closes our stdin when it goes away, however it went.
        def stop(signum, frame):
            raise KeyboardInterrupt

        signal.signal(signal.SIGTERM, stop)

        def watch_supervisor():
            while os.read(0, 1 << 10):
                pass
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=watch_supervisor, daemon=True, name="m2nkit-supervisor-watch").start()
    try:
        log(f"m2nkit demo: {args.model}, {args.trainer} -> {args.inference}, {args.rounds} round"
            f"{'s' if args.rounds > 1 else ''}"
            + ("" if args.baseline else ", no baseline") + " (Ctrl-C stops it)")
        result = _run_demo(args, log)
        _print_demo_table(console, result)
    except KeyboardInterrupt:
        if not args.driver:
            print("m2nkit: demo interrupted; its processes are stopped", file=sys.stderr)
        return EXIT_INTERRUPTED
    except RuntimeError as e:
        # A failed transfer or check (not a usage error): say what broke, exit 1.
        print(f"m2nkit: demo failed: {str(e).splitlines()[0]}", file=sys.stderr)
        return EXIT_PROBLEMS
    finally:
        if args.driver:     # done: a late SIGTERM must not interrupt the exit itself
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return EXIT_OK


def _run_demo(args, log):
    from m2nkit.engine.tools.demo import run_demo

    if getattr(args, "receiver", "stand-in") == "vllm":   # real vLLM workers (demo_vllm.py)
        from m2nkit.engine.tools.demo_vllm import run_vllm_demo, vllm_available

        if not vllm_available():
            raise ValueError("--receiver vllm needs vLLM installed beside m2nkit (pip install "
                             "vllm); --receiver stand-in runs without it")
        return run_vllm_demo(args.model, args.trainer, args.inference, rounds=args.rounds,
                             timeout_s=args.timeout, workdir=args.workdir, log=log)
    log("loading torch and transformers")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if _is_megatron_demo(args):                            # Megatron-Core trainers
        from m2nkit.engine.tools.demo_megatron import run_megatron_demo

        return run_megatron_demo(args.model, args.trainer, args.inference, rounds=args.rounds,
                                 timeout_s=args.timeout,
                                 bucket_bytes=int(args.bucket_mib * (1 << 20)),
                                 workdir=args.workdir, log=log)
    if _is_bridge_demo(args):                              # Megatron-Bridge trainers
        from m2nkit.engine.tools.demo_bridge import run_bridge_demo

        return run_bridge_demo(args.model, args.trainer, args.inference,
                               mode=args.bridge_mode or "tasks", rounds=args.rounds,
                               timeout_s=args.timeout, bucket_bytes=int(args.bucket_mib * (1 << 20)),
                               workdir=args.workdir, log=log)
    return run_demo(args.model, args.trainer, args.inference, rounds=args.rounds,
                    timeout_s=args.timeout, bucket_bytes=int(args.bucket_mib * (1 << 20)),
                    workdir=args.workdir, baseline=args.baseline, log=log)


def _print_demo_table(console, result) -> None:
    from rich.table import Table

    t = Table(title=f"m2nkit demo: {result.model}, {result.trainer} -> {result.inference}",
              title_justify="left")
    for col in ("method", "round", "bytes sent (total)", "max per trainer rank",
                "time", "useful throughput", "check"):
        t.add_column(col)
    for r in result.rounds:
        total = sum(r.bytes_per_rank)
        t.add_row("m2nkit torch_p2p", str(r.index), _fmt_bytes(total),
                  _fmt_bytes(max(r.bytes_per_rank)), _fmt_seconds(r.seconds),
                  f"{_fmt_bytes(result.nbytes_min / r.seconds)}/s" if r.seconds else "-",
                  f"bit-exact on {r.verified_workers} workers, = minimum"
                  if total == result.nbytes_min else f"{total - result.nbytes_min} bytes over the minimum")
    b = result.baseline
    if b:
        t.add_row("gather-then-broadcast", "-", _fmt_bytes(b["bytes_total"]),
                  _fmt_bytes(b["bytes_max_rank"]), _fmt_seconds(b["seconds"]),
                  f"{_fmt_bytes(result.nbytes_min / b['seconds'])}/s" if b["seconds"] else "-",
                  "bit-exact" if b.get("verified") else "not verified")
    console.print(t)
    console.print(f"minimum bytes (what the workers hold): {_fmt_bytes(result.nbytes_min)}; "
                  "useful throughput = that / time")


#: Seconds the demo driver gets to tear its processes down after SIGTERM
#: before whatever is left of its process group is killed.
_DRIVER_GRACE_S = 20.0


def _supervise_demo(args) -> int:
    """Run the demo driver in its own session; on Ctrl-C stop it and say so in one line.

    A terminal's Ctrl-C signals every process of the foreground process
    group. The demo's trainer, worker and baseline processes (spawned by
    multiprocessing, which cannot start them in another group) would each
    die with a ``KeyboardInterrupt`` traceback. So the driver (this CLI with
    ``--driver``) runs in a new session, with its own process group: Ctrl-C
    and SIGTERM reach only this process, which sends the driver SIGTERM (it
    tears its processes down itself, quietly), kills whatever is left of its
    group after :data:`_DRIVER_GRACE_S`, removes the demo's work directory,
    prints one line and exits 128 + the signal. The driver's output goes
    straight to this process's stdout and stderr. If this process dies
    without cleaning up, the driver sees its stdin close and stops.
    """
    import shutil
    import signal
    import subprocess
    import tempfile

    received: list[int] = []

    def on_signal(signum, frame):
        received.append(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    workdir = tempfile.mkdtemp(prefix="m2nkit-demo-")
    cmd = [sys.executable, "-m", "m2nkit.engine.tools.cli", "demo", "--model", args.model,
           "--trainer", args.trainer, "--inference", args.inference,
           "--rounds", str(args.rounds), "--timeout", repr(args.timeout),
           "--bucket-mib", repr(args.bucket_mib), "--driver", "--workdir", workdir,
           "--receiver", args.receiver]
    if not args.baseline:
        cmd.append("--no-baseline")
    if args.bridge_mode:
        cmd += ["--bridge-mode", args.bridge_mode]
    proc = None
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, start_new_session=True)
        while not received:
            try:
                rc = proc.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                continue
        if received:
            signum = received[0]
            _stop_driver(proc, received)
            print(f"m2nkit: demo {'interrupted' if signum == signal.SIGINT else 'terminated'}; "
                  "its processes are stopped and its files removed", file=sys.stderr)
            return 128 + signum
        _reap_group(proc.pid, grace_s=5.0)
        if rc < 0:
            print(f"m2nkit: demo failed: its driver process died of signal {-rc}", file=sys.stderr)
            return EXIT_PROBLEMS
        return rc
    finally:
        if proc is not None and proc.poll() is None:   # an error in this function
            _stop_driver(proc, received)
        if proc is not None and proc.stdin is not None:
            proc.stdin.close()
        shutil.rmtree(workdir, ignore_errors=True)
        for s, handler in old.items():
            signal.signal(s, handler)


def _stop_driver(proc, received: list[int]) -> None:
    """SIGTERM the driver, wait for it (a second signal cuts the wait short), then kill its group."""
    import signal
    import subprocess

    n_signals = len(received)
    try:
        proc.send_signal(signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + _DRIVER_GRACE_S
    while time.monotonic() < deadline and len(received) == n_signals:
        try:
            proc.wait(timeout=0.2)
            break
        except subprocess.TimeoutExpired:
            continue
    _reap_group(proc.pid, grace_s=5.0 if proc.poll() is not None else 0.0)
    proc.wait()


def _group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``, from ``/proc``."""
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) "
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def _reap_group(pgid: int, grace_s: float) -> None:
    """Wait up to ``grace_s`` for process group ``pgid`` to be gone, then SIGKILL what is left."""
    import signal

    if not os.path.isdir("/proc"):                  # not Linux: no way to list it; just kill
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return
    deadline = time.monotonic() + grace_s
    while _group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _group_members(pgid):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


# --------------------------------------------------------------------------
# arguments


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="m2nkit",
        description="Plan and run shard-to-shard weight transfers from RL trainers into vLLM workers.")
    p.add_argument("--version", action="version", version=f"m2nkit {_version()}")
    sub = p.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="dry-run: what moves where, and how long it takes")
    plan.add_argument("checkpoint", help="HF checkpoint directory (safetensors) or a config.json")
    plan.add_argument("--trainer", required=True,
                      help="how the trainer holds it: replicated:N, fsdp:N, hsdp:R,S, or FSDP2 "
                           "with torchtitan's axis names: fsdp2:dp_shard=N[,dp_replicate=R][,tp=T] "
                           "(tp: the family's TP plan)")
    plan.add_argument("--inference", required=True,
                      help="vllm:tp=T[,dp=D][,ep][,placement=linear|round_robin][,all2all=B]"
                           "[,dtype=auto|bfloat16|float16|float32]")
    plan.add_argument("--json", metavar="PATH", help="write the manifest and plan as JSON")
    plan.add_argument("--verify", action="store_true",
                      help="execute in-process on the checkpoint's data and check every worker")
    plan.add_argument("--dump", metavar="DIR",
                      help="with --verify: write each worker's storage as DIR/worker{w}.safetensors "
                           "(vLLM parameter names, local shapes; metadata names the ranks)")
    plan.add_argument("--link-gbps", type=float, default=400.0,
                      help="per-rank link bandwidth for the time estimate (default 400)")
    plan.add_argument("--bindings", action="store_true",
                      help="print where each wire tensor (HF name) lands: vLLM parameter, "
                           "rows/cols/experts, workers")
    plan.add_argument("-v", "--verbose", action="store_true", help="print the per-tensor table")
    plan.set_defaults(func=_cmd_plan)
    demo = sub.add_parser("demo", help="real multi-process transfer on this machine, verified")
    demo.add_argument("--model", default="tiny-qwen3-moe",
                      help="built-in tiny model (tiny-llama, tiny-qwen2, tiny-qwen3, tiny-qwen3-tied, "
                           "tiny-qwen3-moe, tiny-mixtral, tiny-deepseek-v3[-fp8|-no-q-lora], "
                           "tiny-gpt-oss, tiny-gemma2, tiny-gemma3) or a checkpoint directory "
                           "(default tiny-qwen3-moe)")
    demo.add_argument("--trainer", default="fsdp:4",
                      help="replicated:N, fsdp:N, hsdp:R,S (trainers holding checkpoint shards), or "
                           "fsdp2:dp_shard=N[,dp_replicate=R][,tp=T] (real FSDP2 trainers taking an "
                           "AdamW step each round), or bridge:tp=T,pp=P[,ep=E] (Megatron-Bridge "
                           "trainers, see --bridge-mode), or megatron:tp=T,pp=P[,vpp=V][,ep=E]"
                           "[,etp=X] (Megatron-Core GPTModels loaded by Bridge, sent with "
                           "megatron_source) (default fsdp:4)")
    demo.add_argument("--inference", default="vllm:tp=2,dp=1", help="vllm:tp=T[,dp=D][,ep][,placement=P][,all2all=B][,dtype=X] "
                           "(default vllm:tp=2,dp=1)")
    demo.add_argument("--rounds", type=int, default=2, help="update rounds, weights changed each round (default 2)")
    demo.add_argument("--timeout", type=float, default=60.0, help="bound on every wait, seconds (default 60)")
    demo.add_argument("--bucket-mib", type=float, default=4.0, help="transport bucket size in MiB (default 4)")
    demo.add_argument("--no-baseline", dest="baseline", action="store_false",
                      help="skip the gather-then-broadcast comparison run after the rounds "
                           "(the slowest part)")
    demo.add_argument("--receiver", choices=("stand-in", "vllm"), default="stand-in",
                      help="stand-in: m2nkit's own vLLM-layout storage (default, no vLLM needed); "
                           "vllm: real vLLM model objects on CPU, m2nkit's engine created by "
                           "vLLM's factory, checked against a fresh vLLM load (needs vLLM)")
    demo.add_argument("--bridge-mode", choices=("tasks", "export"), default=None,
                      help="with --trainer bridge:tp=T,pp=P[,ep=E] (Megatron-Bridge trainers): "
                           "bridge_source's mode, tasks (local shards, default) or export "
                           "(Bridge's export_hf_weights)")
    # Internal: how the supervisor starts the driver (see _supervise_demo).
    demo.add_argument("--driver", action="store_true", help=argparse.SUPPRESS)
    demo.add_argument("--workdir", help=argparse.SUPPRESS)
    demo.set_defaults(func=_cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one command; ``argv`` ``None``: this process's command line (the ``m2nkit``
    script), and the process exits when this returns."""
    args = _parser().parse_args(argv)
    try:
        _precheck(args)
        return args.func(args)
    except (UserError, ValueError, OSError) as e:
        print(f"m2nkit: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:                       # Ctrl-C in plan: one process, nothing to stop
        print("m2nkit: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        if argv is None:
            # The process exits next; its final garbage collection would walk every
            # object a plan made (half a second of a Kimi-K2 plan) to free nothing the
            # exit does not free anyway.
            gc.freeze()


if __name__ == "__main__":
    sys.exit(main())
