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

The command line is this module: the parser, the checks that need no
torch, and which work runs when. What it prints is ``report.py``;
``--verify`` and ``--dump`` are ``verify.py``; the supervision of the demo
driver is ``procs.py``.

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
from pathlib import Path

from m2nkit.engine.tools import report
from m2nkit.engine.tools.verify import dump_storage, verify_plan

__all__ = ["main"]

EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE = 0, 1, 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: the reader of stdout went away (`m2nkit plan ... | head`)


class UserError(Exception):
    """An error the user can fix; printed without a traceback."""


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("m2nkit")
    except PackageNotFoundError:  # running from a tree that was never installed
        return "unknown"


# --------------------------------------------------------------------------
# checks before the heavy imports

def _read_config(path: str | os.PathLike) -> dict | None:
    """``config.json`` of a checkpoint directory, or the ``.json`` file itself, read with
    ``json`` only; ``None`` when there is none or it is not a JSON object (the checkpoint
    reader then says what is wrong)."""
    p = Path(path)
    config = p / "config.json" if p.is_dir() else p
    if config.suffix != ".json" or not config.is_file():
        return None
    try:
        doc = json.loads(config.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _config_path(path: str | os.PathLike) -> Path:
    p = Path(path)
    return p / "config.json" if p.is_dir() else p


def _check_architecture(path: str | os.PathLike, what: str,
                        layout: str | None = "tables") -> str | None:
    """Refuse a checkpoint whose ``config.json`` names an architecture the layout cannot carry.

    Reads the file with ``json`` only. An architecture without a family
    table passes when ``layout`` may trace it (:func:`plan_layout`: ``traced``,
    the default with vLLM importable, or ``auto``; transformers and vLLM then say
    whether they know it).
    Anything else wrong with the file (missing, not JSON) is left to the
    checkpoint reader, which says what is wrong.

    Returns:
        The architecture, or ``None`` when there is no readable ``config.json``.

    Raises:
        UserError: ``architectures[0]`` has no model family and the layout
            is the tables (the message lists the supported ones and names
            ``--layout traced``: ``m2nkit.adapters.families``).
    """
    from m2nkit.adapters.families import architecture_name, architecture_of, has_table

    doc = _read_config(path)
    if doc is None:
        return None
    arch = architecture_name(doc)
    if arch is not None and not has_table(arch) and plan_layout(layout, arch) == "traced":
        return arch
    try:
        return architecture_of(doc)
    except ValueError as e:
        raise UserError(f"{what} {_config_path(path)}: {e}") from None


#: What real vLLM 0.33.0 cannot build on CPU, where ``--receiver vllm`` runs its model
#: objects: architecture -> why (vLLM's own words), for a refusal before any process starts.
VLLM_CPU_CANNOT_BUILD = {
    "GptOssForCausalLM": (
        "vLLM 0.33 cannot build GPT-OSS on CPU (its MoE layer: \"No Unquantized MoE backend "
        "supports the deployment configuration\"), and the demo's vLLM workers run on CPU; "
        "--receiver stand-in runs it (m2nkit's vLLM-layout storage)"),
}


def _check_megatron_sizes(args, spec, config: dict | None, loader: str) -> None:
    """Refuse sizes megatron-core would refuse inside the trainers (one line, no torch)."""
    if config is None:
        return
    from m2nkit.adapters.megatron.spec import megatron_size_problem

    why = megatron_size_problem(spec.par, config, loader=loader)
    if why:
        raise UserError(f"trainer spec '{args.trainer}': {why}")


def _precheck(args) -> None:
    """Everything a user can get wrong that needs no torch: specs, architecture, flags,
    a missing checkpoint or tiny model, sizes megatron-core refuses.

    Raises:
        UserError, ValueError: printed as one line, exit 2.
    """
    for flag in ("link_gbps", "timeout", "bucket_mib"):
        value = getattr(args, flag, 1.0)
        if not (value > 0 and math.isfinite(value)):  # also refuses NaN and inf
            raise UserError(f"--{flag.replace('_', '-')} must be a finite number > 0, got {value}")
    if args.command == "plan" and args.trainer.strip().lower().startswith("bridge:"):
        raise UserError(f"trainer spec '{args.trainer}': bridge: is a trainer of m2nkit demo "
                        "(Megatron-Bridge processes on this machine); m2nkit plan lays out a "
                        "Megatron-Core trainer with megatron:tp=T,pp=P[,vpp=V][,ep=E][,etp=X]"
                        "[,dp=D][,first=N][,last=N]")
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
    if getattr(args, "colocated", False) and args.receiver != "stand-in":
        raise UserError("--colocated runs with --receiver stand-in (m2nkit's workers sharing "
                        f"this machine's memory); got --receiver {args.receiver}")
    if _is_megatron_demo(args):  # Megatron-Core trainers (engine/tools/demo_bridge.py)
        tspec = importlib.import_module("m2nkit.engine.tools.demo_bridge") \
            .parse_megatron_demo_spec(args.trainer)
        if args.receiver != "stand-in":
            raise UserError("--trainer megatron:... runs with --receiver stand-in only")
    sglang = importlib.import_module("m2nkit.adapters.sglang.spec").is_sglang_spec(
        args.inference)
    receiver = getattr(args, "receiver", "stand-in")
    if sglang and args.command != "plan" and receiver != "sglang":
        # SGLang workers are real ones only (docs/sglang.md): m2nkit has no SGLang stand-in
        raise UserError(f"--inference {args.inference}: the demo into SGLang workers runs with "
                        "--receiver sglang (SGLang's own model classes under .venv-sglang); "
                        f"got --receiver {receiver}")
    if receiver == "sglang" and not sglang:
        raise UserError(f"--receiver sglang needs --inference sglang:tp=T[,ep]; got "
                        f"--inference {args.inference}")
    if sglang:
        ispec = importlib.import_module("m2nkit.adapters.sglang.spec").parse_sglang_spec(
            args.inference)
        if args.command == "plan":
            _check_sglang_args(args)
        elif ispec.dp != 1:
            raise UserError(f"--inference {args.inference}: the demo runs one SGLang server "
                            f"(dp=1); SGLang 0.5.23 updates a --dp-size server only per replica "
                            "server (docs/sglang.md)")
    else:
        ispec = importlib.import_module("m2nkit.adapters.vllm.spec").parse_inference_spec(
            args.inference)
        if args.command == "plan" and args.layout == "traced" and ispec.quant != "none":
            raise UserError(_QUANT_NOT_TRACED.format(inference=args.inference))
    if args.command == "plan":
        if args.dump is not None and not args.verify:
            raise UserError("--dump writes the storage that --verify fills: add --verify")
        if not Path(args.checkpoint).exists():
            raise UserError(f"checkpoint {args.checkpoint}: no such file or directory (give a "
                            "checkpoint directory or its config.json)")
        if args.verify and _config_only(Path(args.checkpoint)):
            # before the layout: a traced one (Llama-4) takes minutes to build
            raise UserError(f"--verify needs tensor data, but {args.checkpoint} has only a "
                            "config (no model.safetensors or model.safetensors.index.json)")
        _check_architecture(args.checkpoint, "checkpoint", args.layout)
        if getattr(tspec, "megatron", None) is not None:
            _check_megatron_sizes(args, tspec.megatron, _read_config(args.checkpoint), "plan")
        return
    from m2nkit.adapters.families import TINY_MODEL_ARCHITECTURES
    from m2nkit.engine.tools.demo import MAX_DEMO_PROCESSES

    if args.rounds < 1:
        raise UserError(f"--rounds must be >= 1, got {args.rounds}")
    if ispec.quant != "none":
        # its workers hold BF16 storage: a round would move BF16 and call it fp8
        raise UserError(f"--inference {args.inference}: m2nkit demo does not run fp8 rounds "
                        "(quant=); plan and check mode 2 with m2nkit plan CHECKPOINT ... "
                        "--inference ...,quant=fp8_per_block,wire=fp8 --verify, and see "
                        "docs/fp8.md for rounds into an fp8-served vLLM")
    count = tspec.num_ranks + ispec.num_workers
    if count > MAX_DEMO_PROCESSES:
        raise UserError(f"{args.trainer} -> {args.inference} needs {count} processes; the demo "
                        f"runs at most {MAX_DEMO_PROCESSES} on one machine (use m2nkit plan "
                        "for larger layouts)")
    if Path(args.model).is_dir():
        arch = _check_architecture(args.model, "--model")
        config = _read_config(args.model)
    elif args.model in TINY_MODEL_ARCHITECTURES:
        arch, config = TINY_MODEL_ARCHITECTURES[args.model], None   # sizes: checked by the demo
    else:
        raise UserError(f"--model '{args.model}' is neither a built-in tiny model "
                        f"({', '.join(sorted(TINY_MODEL_ARCHITECTURES))}) nor a checkpoint "
                        "directory")
    if args.receiver == "vllm" and arch in VLLM_CPU_CANNOT_BUILD:
        raise UserError(f"--receiver vllm --model {args.model}: {VLLM_CPU_CANNOT_BUILD[arch]}")
    if _is_bridge_demo(args) or _is_megatron_demo(args):
        _check_megatron_sizes(args, tspec, config, "bridge")


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

    from m2nkit.adapters.sglang.spec import is_sglang_spec

    tspec = parse_trainer_spec(args.trainer)
    sglang = is_sglang_spec(args.inference)
    if sglang:
        _check_sglang_args(args)
        from m2nkit.adapters.sglang.spec import parse_sglang_spec

        ispec = parse_sglang_spec(args.inference)
    else:
        ispec = parse_inference_spec(args.inference)
    t1 = time.perf_counter()
    ckpt = read_checkpoint(args.checkpoint)
    metas = checkpoint_metas(ckpt, tspec)
    t2 = time.perf_counter()
    if sglang:
        args.layout = "tables"
    else:
        args.layout_why = _layout_why(args.layout, ckpt.architecture, ispec)
        args.layout = plan_layout(args.layout, ckpt.architecture, ispec)
    if sglang:    # m2nkit's tables with SGLang's rules (m2nkit.adapters.sglang)
        from m2nkit.adapters.sglang.destination import sglang_destination_layout

        dest = sglang_destination_layout(ckpt.config, metas, ispec)
    elif args.layout == "traced":
        dest = _traced(ckpt, metas, ispec)
    else:
        dest = destination_layout(ckpt.config, metas, ispec)
    t3 = time.perf_counter()
    # The manifest digest is only shown by --json and --dump; hashing every
    # tensor's owners costs a noticeable part of a config-only plan.
    digest = manifest_digest(metas, tspec.num_ranks) if args.json or args.dump else ""
    plan = build_plan(metas, tspec.num_ranks, dest, manifest_digest=digest)
    t4 = time.perf_counter()
    timings = {"imports": t1 - t0, "read": t2 - t1,
               ("SGLang layout" if sglang else "vLLM layout"): t3 - t2, "plan": t4 - t3}
    return ckpt, tspec, ispec, metas, plan, timings


def plan_layout(layout: str | None, architecture: str | None, ispec=None) -> str:
    """``"traced"`` or ``"tables"``: where ``m2nkit plan``'s vLLM layout comes from.

    ``layout`` is ``--layout``: ``traced``, ``tables``, ``auto`` (the family table where
    ``architecture`` has one, else traced: ``adapters.vllm.builder.resolve_layout``), or
    ``None`` for the default (issue 16): traced from vLLM's own loaders where vLLM is
    importable, else the tables. A default request for online quantization (``ispec``
    with ``quant=``) takes the tables, the only layout that plans it.
    """
    from m2nkit.adapters.vllm.builder import resolve_layout, vllm_importable

    if layout is not None:
        return resolve_layout(layout, architecture)
    if ispec is not None and ispec.quant != "none":
        return "tables"
    return "traced" if vllm_importable() else "tables"


def _layout_why(layout: str | None, architecture: str | None, ispec) -> str:
    """Why the plan's vLLM layout is the one :func:`plan_layout` gives (for the report)."""
    chosen = plan_layout(layout, architecture, ispec)
    if layout == "auto":
        return ("--layout auto: " + ("this architecture has a family table" if chosen == "tables"
                                     else "no family table for this architecture"))
    if layout is not None:
        return f"--layout {layout}"
    if ispec.quant != "none":
        return "the default for quant=: --layout traced does not plan it"
    return ("the default with vLLM importable; --layout tables for m2nkit's tables"
            if chosen == "traced" else "the default without vLLM")


def _config_only(path: Path) -> bool:
    """Whether ``path`` is a config-only checkpoint (no tensor data), as
    ``adapters.hf_checkpoint.files.resolve_path`` reads it, without importing torch."""
    if path.is_file():
        return path.suffix == ".json" and path.name != "model.safetensors.index.json"
    return (path.is_dir() and not (path / "model.safetensors.index.json").is_file()
            and not (path / "model.safetensors").is_file())


def _check_sglang_args(args) -> None:
    """What ``m2nkit plan`` does not do for an ``sglang:`` destination yet (docs/sglang.md)."""
    if args.layout == "traced":
        raise UserError(f"--inference {args.inference}: --layout traced runs vLLM's loaders; "
                        "the SGLang layout is m2nkit's tables with SGLang's rules "
                        "(m2nkit.adapters.sglang), checked against SGLang's loaders by the tests")
    if args.verify:
        raise UserError(f"--inference {args.inference}: --verify loads vLLM-style workers; "
                        "for SGLang the layout is checked against SGLang's own loaders by "
                        "tests/integration/test_sglang_layout.py (docs/sglang.md)")


def _traced(ckpt, metas, ispec):
    """The layout traced from vLLM's loaders (``--layout traced``); a refusal is a user error."""
    from m2nkit.adapters.vllm.builder import vllm_importable

    if not vllm_importable():
        raise UserError("--layout traced needs vLLM installed (it runs vLLM's own weight "
                        "loaders); without vLLM use --layout tables")
    # vLLM logs its import-time notes (no vllm._C, no Triton on this platform) at
    # WARNING; the plan's own output is what the user asked for.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from m2nkit.engine.tools.demo_vllm import quiet_vllm_loggers

    quiet_vllm_loggers()    # the CPU platform's notes reach stderr otherwise (no vLLM handler)
    # vLLM logs each failed attempt at reading the config at ERROR
    # (transformers_utils/repo_utils.py ``with_retry``, config.py ``get_config``);
    # the last attempt's error is in the one-line refusal below.
    import logging

    retry_loggers = [logging.getLogger(name) for name in (
        "vllm.transformers_utils.repo_utils", "vllm.transformers_utils.config")]
    levels = [logger.level for logger in retry_loggers]
    for logger in retry_loggers:             # for the trace only: restored after it
        logger.setLevel(logging.CRITICAL)
    from m2nkit.adapters.vllm.trace import TraceError, one_line_reason, trace_destination

    path = Path(ckpt.path)
    source = path if path.is_dir() else ckpt.config   # vLLM reads dtypes from the files too
    try:
        return trace_destination(source, metas, ispec)
    except TraceError as e:
        raise UserError(f"--layout traced: {e}") from None
    except ImportError as e:    # vLLM is found but does not import (a broken install)
        raise UserError(f"--layout traced: vLLM is installed but does not import here "
                        f"({type(e).__name__}: {one_line_reason(e)}); without a working vLLM "
                        "use --layout tables") from None
    finally:
        for logger, level in zip(retry_loggers, levels):
            logger.setLevel(level)


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
    if d.exists() and not d.is_dir():
        raise UserError(f"--dump {path}: exists and is not a directory; give a directory "
                        "(created if missing)")
    created = not d.exists()
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--dump {path}: cannot create that directory ({e.strerror or e})") from None
    if not os.access(d, os.W_OK):
        raise UserError(f"--dump {path}: the directory is not writable")
    return d, created


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
        # A reader of stdout that goes away (`| head`) does not stop the files asked for.
        console = report.console_for_stdout(finish_when_closed=bool(json_file or dump_dir))
        status = _plan_and_report(args, console, json_file, dump_dir)
        written = True
        return EXIT_BROKEN_PIPE if console.reader_gone and status == EXIT_OK else status
    finally:
        if json_file is not None:
            _finish_json(json_file, written)
        if dump_dir_created and not any(dump_dir.iterdir()):
            dump_dir.rmdir()


#: The refusal of ``--layout traced`` with online quantization (before torch loads).
_QUANT_NOT_TRACED = ("--inference {inference}: quant= is planned with --layout tables (vLLM's "
                     "online fp8 rule, m2nkit.adapters.vllm.fp8)")


def _fp8_checkpoint(ckpt) -> tuple[str, dict] | None:
    """The plan's row and json of an fp8 block checkpoint (``quant.fp8_checkpoint_row``);
    ``None`` for any other config (a quantization_config the plan refuses is refused there,
    by the family's layout)."""
    from m2nkit.adapters.families.quant import fp8_block, fp8_checkpoint_row

    try:
        block = fp8_block(ckpt.config, ckpt.architecture)
    except ValueError:
        return None
    return None if block is None else fp8_checkpoint_row(block)


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
    routes = None
    if args.nodes is not None and ispec.wire == "fp8":
        raise UserError(f"--nodes with --inference {args.inference}: the ipc transport "
                        "carries the BF16 wire only (the fp8 wire runs over torch_p2p; "
                        "docs/fp8.md); drop wire=fp8 or --nodes")
    if args.nodes is not None:           # refused before anything is printed
        try:
            routes = report.ipc_routes(plan, args.nodes)
        except ValueError as e:
            raise UserError(str(e)) from None
    fp8 = None
    if ispec.quant != "none":
        if args.layout == "traced":
            raise UserError(_QUANT_NOT_TRACED.format(inference=args.inference))
        from m2nkit.engine.tools.fp8 import plan_fp8_wire

        fp8 = plan_fp8_wire(ckpt.config, plan)
    fp8_checkpoint = _fp8_checkpoint(ckpt)
    report.print_summary(console, args, ckpt, metas, plan, timings,
                         fp8=fp8 if ispec.wire == "fp8" else None,
                         fp8_checkpoint=fp8_checkpoint and fp8_checkpoint[0])
    if fp8 is not None:
        from m2nkit.engine.tools.fp8 import print_fp8

        print_fp8(console, plan, fp8, ispec.wire, args.link_gbps)
    if args.verbose:
        report.print_tensors(console, plan)
    if args.bindings:
        report.print_bindings(console, plan)
    if routes is not None:
        report.print_routes(console, routes)
    if json_file is not None:
        from m2nkit.manifest.serialize import manifest_to_json

        out = {"manifest": manifest_to_json(metas, tspec.num_ranks), "plan": plan.to_json(),
               "notes": list(plan.destination.notes)}
        if routes is not None:
            out["ipc_routes"] = routes
        if fp8 is not None:
            out["fp8"] = {"wire": ispec.wire, **fp8.to_json()}
        if fp8_checkpoint is not None:
            out["fp8_checkpoint"] = fp8_checkpoint[1]
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
        if fp8 is not None and ispec.wire == "fp8":
            from m2nkit.engine.tools.fp8 import verify_fp8

            ok, storage = verify_fp8(console, ckpt, tspec, ispec, plan, fp8)
        else:
            ok, storage = verify_plan(console, ckpt, tspec, ispec, plan, args.layout)
            if fp8 is not None:      # wire=bf16: what lands is BF16; vLLM quantizes it after
                console.print("verify: wire=bf16 checks the BF16 weights vLLM's loaders take "
                              "(checkpoint format); vLLM quantizes them after loading, which "
                              "is not run here" + (" and not in the dump" if dump_dir else "")
                              + " (wire=fp8 runs the quantization)", markup=False,
                              highlight=False)
        if dump_dir is not None:
            dump_storage(console, dump_dir, storage, plan, ckpt, ispec)
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

    from m2nkit.engine.tools.procs import follow_supervisor

    t_start = time.monotonic()
    console = report.console_for_stdout()

    def log(message: str) -> None:
        # One progress line is one line: a file or pipe (a log, CI, `| tee`) gets it
        # whole, not hard-wrapped at the console width; a terminal wraps it itself.
        console.print(f"[{time.monotonic() - t_start:6.1f} s] {message}", markup=False,
                      highlight=False, soft_wrap=True)

    if args.driver:
        # The supervisor stops us with SIGTERM (tear down, exit quietly) and
        # closes our stdin when it goes away, however it went.
        follow_supervisor()
    try:
        log(f"m2nkit demo: {args.model}, {args.trainer} -> {args.inference}, {args.rounds} round"
            f"{'s' if args.rounds > 1 else ''}"
            + ("" if args.baseline else ", no baseline") + " (Ctrl-C stops it)")
        result = _run_demo(args, log)
        report.print_demo_table(console, result)
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

    log("loading torch and transformers")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()      # save_pretrained's "Writing model shards" bar
    if getattr(args, "receiver", "stand-in") == "sglang":  # real SGLang workers (sglang_workers.py)
        from m2nkit.engine.tools.demo_vllm import run_vllm_demo
        from m2nkit.engine.tools.sglang_workers import SGLangWorkers, sglang_python

        if not sglang_python().exists():
            raise ValueError(f"--receiver sglang needs SGLang's stack at {sglang_python()} "
                             "(scripts/setup.sh builds it; or set M2NKIT_SGLANG_PYTHON to a "
                             "python with sglang 0.5.23 and m2nkit)")
        return run_vllm_demo(args.model, args.trainer, args.inference, rounds=args.rounds,
                             timeout_s=args.timeout, workdir=args.workdir, log=log,
                             sglang_workers=SGLangWorkers)
    if getattr(args, "receiver", "stand-in") == "vllm":   # real vLLM workers (demo_vllm.py)
        from m2nkit.engine.tools.demo_vllm import run_vllm_demo, vllm_available

        if not vllm_available():
            raise ValueError("--receiver vllm needs vLLM installed beside m2nkit (pip install "
                             "vllm); --receiver stand-in runs without it")
        return run_vllm_demo(args.model, args.trainer, args.inference, rounds=args.rounds,
                             timeout_s=args.timeout, workdir=args.workdir, log=log)
    if _is_megatron_demo(args):                            # Megatron-Core trainers
        from m2nkit.engine.tools.demo_bridge import run_megatron_demo

        return run_megatron_demo(args.model, args.trainer, args.inference, rounds=args.rounds,
                                 timeout_s=args.timeout,
                                 bucket_bytes=int(args.bucket_mib * (1 << 20)),
                                 workdir=args.workdir, log=log,
                                 transport="ipc" if args.colocated else "torch_p2p")
    if _is_bridge_demo(args):                              # Megatron-Bridge trainers
        from m2nkit.engine.tools.demo_bridge import run_bridge_demo

        return run_bridge_demo(args.model, args.trainer, args.inference,
                               mode=args.bridge_mode or "tasks", rounds=args.rounds,
                               timeout_s=args.timeout, bucket_bytes=int(args.bucket_mib * (1 << 20)),
                               workdir=args.workdir, log=log,
                               transport="ipc" if args.colocated else "torch_p2p")
    return run_demo(args.model, args.trainer, args.inference, rounds=args.rounds,
                    timeout_s=args.timeout, bucket_bytes=int(args.bucket_mib * (1 << 20)),
                    workdir=args.workdir, baseline=args.baseline, log=log,
                    colocated=getattr(args, "colocated", False))


#: Seconds the demo driver gets to tear its processes down after SIGTERM
#: before whatever is left of its process group is killed.
_DRIVER_GRACE_S = 20.0


def _supervise_demo(args) -> int:
    """Run the demo driver in its own session; on Ctrl-C stop it and say so in one line.

    A terminal's Ctrl-C signals every process of the foreground process
    group. The demo's trainer, worker and baseline processes (spawned by
    multiprocessing, which cannot start them in another group) would each
    die with a ``KeyboardInterrupt`` traceback. So the driver (this CLI with
    ``--driver``) runs under :func:`m2nkit.engine.tools.procs.supervise`, in
    a new session with its own process group: Ctrl-C and SIGTERM reach only
    this process, which sends the driver SIGTERM (it tears its processes
    down itself, quietly), kills whatever is left of its group after
    :data:`_DRIVER_GRACE_S`, removes the demo's work directory, prints one
    line and exits 128 + the signal. The driver's output goes straight to
    this process's stdout and stderr. If this process dies without cleaning
    up, the driver sees its stdin close and stops.
    """
    import shutil
    import signal

    from m2nkit.engine.tools.procs import supervise

    workdir = tempfile.mkdtemp(prefix="m2nkit-demo-")
    cmd = [sys.executable, "-m", "m2nkit.engine.tools.cli", "demo", "--model", args.model,
           "--trainer", args.trainer, "--inference", args.inference,
           "--rounds", str(args.rounds), "--timeout", repr(args.timeout),
           "--bucket-mib", repr(args.bucket_mib), "--driver", "--workdir", workdir,
           "--receiver", args.receiver]
    if not args.baseline:
        cmd.append("--no-baseline")
    if getattr(args, "colocated", False):
        cmd.append("--colocated")
    if args.bridge_mode:
        cmd += ["--bridge-mode", args.bridge_mode]

    def announce(signum: int) -> None:
        print(f"m2nkit: demo {'interrupted' if signum == signal.SIGINT else 'terminated'}; "
              "its processes are stopped and its files removed", file=sys.stderr)

    rc, signum = supervise(cmd, grace_s=_DRIVER_GRACE_S, announce=announce,
                           cleanup=lambda: shutil.rmtree(workdir, ignore_errors=True))
    if signum is not None:
        return 128 + signum
    if rc < 0:
        print(f"m2nkit: demo failed: its driver process died of signal {-rc}", file=sys.stderr)
        return EXIT_PROBLEMS
    return rc


# --------------------------------------------------------------------------
# arguments


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose usage errors are one line, as m2nkit's other errors are:
    argparse prints the whole usage block first; ``--help`` still shows it. Exit 2."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="m2nkit",
        description="Plan and run shard-to-shard weight transfers from RL trainers into vLLM "
                    "(or SGLang) inference workers.")
    p.add_argument("--version", action="version", version=f"m2nkit {_version()}")
    sub = p.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="dry-run: what moves where, and how long it takes")
    plan.add_argument("checkpoint", help="HF checkpoint directory (safetensors) or a config.json")
    plan.add_argument("--trainer", required=True,
                      help="how the trainer holds it: replicated:N, fsdp:N, hsdp:R,S, or FSDP2 "
                           "with torchtitan's axis names: fsdp2:dp_shard=N[,dp_replicate=R][,tp=T] "
                           "(tp: the family's TP plan), or Megatron-Core: "
                           "megatron:tp=T,pp=P[,vpp=V][,ep=E][,etp=X][,dp=D][,first=N][,last=N] "
                           "(docs/megatron.md)")
    plan.add_argument("--inference", required=True,
                      help="vllm:tp=T[,dp=D][,ep][,placement=linear|round_robin][,all2all=B]"
                           "[,dtype=auto|bfloat16|float16|float32]"
                           "[,quant=none|fp8_per_block[,wire=bf16|fp8]] (docs/fp8.md), or "
                           "sglang:tp=T[,dp=D][,ep][,dtype=X] (docs/sglang.md)")
    plan.add_argument("--json", metavar="PATH", help="write the manifest and plan as JSON")
    plan.add_argument("--verify", action="store_true",
                      help="execute in-process on the checkpoint's data and check every worker")
    plan.add_argument("--dump", metavar="DIR",
                      help="with --verify: write each worker's storage as DIR/worker{w}.safetensors "
                           "(vLLM parameter names, local shapes; metadata names the ranks)")
    plan.add_argument("--link-gbps", type=float, default=400.0,
                      help="per-rank link bandwidth for the time estimate (default 400)")
    plan.add_argument("--bindings", action="store_true",
                      help="print where each wire tensor (HF name) lands: vLLM (or SGLang) parameter, "
                           "rows/cols/experts, workers")
    plan.add_argument("--layout", choices=("tables", "traced", "auto"), default=None,
                      help="where the vLLM layout comes from: vLLM's own weight loaders, traced "
                           "on the meta device (needs vLLM; the default where vLLM is "
                           "importable), or m2nkit's family tables (no vLLM needed; the default "
                           "without vLLM, and for quant=); auto: the table where the "
                           "architecture has one, else traced")
    plan.add_argument("--nodes", type=int, default=None, metavar="N",
                      help="for the ipc transport (colocated): N nodes, each with an equal run of "
                           "trainer ranks and workers; prints the bytes copied over shared memory "
                           "on a node and the bytes sent by torch_p2p between nodes")
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
    demo.add_argument("--colocated", action="store_true",
                      help="trainers and workers share this machine's memory: the rounds use the "
                           "ipc transport (each worker copies its boxes from the trainers' own "
                           "shards in shared memory), the baseline is full tensors per parameter "
                           "over shared memory as vLLM's ipc backend moves them "
                           "(see docs/colocated.md)")
    demo.add_argument("--receiver", choices=("stand-in", "vllm", "sglang"), default="stand-in",
                      help="stand-in: m2nkit's own vLLM-layout storage (default, no vLLM needed); "
                           "vllm: real vLLM model objects on CPU, m2nkit's engine created by "
                           "vLLM's factory, checked against a fresh vLLM load (needs vLLM); "
                           "sglang: real SGLang TP workers on CPU (--inference sglang:tp=T[,ep]), "
                           "m2nkit's custom weight loader behind SGLang's "
                           "update_weights_from_tensor, checked against a fresh SGLang load "
                           "(needs .venv-sglang, docs/sglang.md)")
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
    except BrokenPipeError:
        # The reader of stdout is gone (`| head -1`): stop, as Unix tools do, without a
        # traceback; stdout goes to /dev/null so that the interpreter's last flush at
        # exit finds no closed pipe ("Exception ignored ... BrokenPipeError").
        report.stdout_to_devnull()
        return EXIT_BROKEN_PIPE
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
