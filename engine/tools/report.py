"""What ``m2nkit plan`` and ``m2nkit demo`` print: the summary, the tables, sizes in words.

Kept apart from the command line (``cli.py``) so that what a user reads is
in one place, and from the work (``verify.py``, the demos) so that printing
never changes what was computed. Every function takes a rich ``Console``
(:func:`console_for_stdout`) and the plan or demo result, and only prints.
rich is imported inside the functions: importing this module is cheap.
Sizes are bytes (``KiB`` = 1024 bytes), times seconds.
"""

from __future__ import annotations

import os
import re
import sys
from collections import Counter

__all__ = ["fmt_bytes", "fmt_seconds", "console_for_stdout", "print_summary", "print_tensors",
           "engine_name", "binding_rows", "print_bindings", "print_demo_table"]


def fmt_bytes(n: float) -> str:
    """``n`` bytes in words: ``"512 B"``, ``"1.50 KiB"`` .. ``"TiB"`` (powers of 1024)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def fmt_seconds(s: float) -> str:
    """``s`` seconds in words: ``"12.34 ms"`` below a second, else ``"1.23 s"``."""
    return f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.2f} s"


def console_for_stdout(finish_when_closed: bool = False):
    """A rich console for stdout: the terminal's width, else ``COLUMNS``, else 200.

    Piped output (logs, CI) would get rich's 80 columns; 200 keeps the tables
    on one line each, and ``COLUMNS`` overrides it as it does on a terminal.

    When the reader of stdout goes away (``| head``), the console raises
    ``BrokenPipeError`` and :func:`m2nkit.engine.tools.cli.main` ends quietly with 141;
    with ``finish_when_closed`` (the command still has files to write: ``--json``,
    ``--dump``) it goes quiet instead, sets ``reader_gone`` and lets the command
    finish, so ``m2nkit plan ... --json F | head -2`` still writes F.
    """
    from rich.console import Console

    class _Console(Console):
        reader_gone = False

        def on_broken_pipe(self) -> None:
            # rich's own handler exits 1; a reader that went away is not a failure.
            self.quiet = True
            if not finish_when_closed:
                raise BrokenPipeError
            self.reader_gone = True
            stdout_to_devnull()       # later writes and the exit's flush go nowhere

    if sys.stdout.isatty():
        return _Console()                          # rich reads COLUMNS itself
    columns = os.environ.get("COLUMNS", "").strip()
    return _Console(width=int(columns) if columns.isdigit() and int(columns) > 0 else 200)


def stdout_to_devnull() -> None:
    """Point this process's stdout file descriptor at ``/dev/null`` (its reader is gone)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):     # not a file descriptor (capsys)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def ipc_routes(plan, count: int) -> dict:
    """``m2nkit plan --nodes N``: which slabs the ``ipc`` transport copies over shared
    memory and which go by torch_p2p, with ``count`` nodes each holding an equal run of
    trainer ranks and workers (``ipc.even_nodes``): ``{"nodes", "ipc", "p2p",
    "ipc_slabs", "p2p_slabs"}`` (bytes, slab counts)."""
    from m2nkit.engine.transports.ipc import even_nodes, route_bytes

    return {"nodes": count,
            **route_bytes(plan, even_nodes(plan.num_trainer_ranks, plan.num_workers, count))}


def print_routes(console, routes: dict) -> None:
    """One line: the ``ipc`` transport's bytes each way (:func:`ipc_routes`)."""
    console.print(f"ipc transport over {routes['nodes']} node{'s' if routes['nodes'] > 1 else ''}: "
                  f"{fmt_bytes(routes['ipc'])} in {routes['ipc_slabs']:,} slabs copied over shared "
                  f"memory on their node, {fmt_bytes(routes['p2p'])} in {routes['p2p_slabs']:,} "
                  "slabs by torch_p2p to other nodes")


def skipped_why(plan) -> str:
    """Why the inference side skips the plan's skipped wire tensors, in the summary's
    words: ``": <reason>"`` for one reason, ``": <n> <reason>; <m> <reason>"`` for
    several (most first), each cut at its first ``": "`` (``-v`` prints the whole
    reason per tensor); ``""`` when nothing is skipped."""
    from collections import Counter

    reasons = Counter(w.skipped.split(": ")[0] for w in plan.wires if w.skipped)
    if len(reasons) <= 1:
        return "".join(f": {r}" for r in reasons)
    return ": " + "; ".join(f"{n} {r}" for r, n in reasons.most_common())


def print_summary(console, args, ckpt, metas, plan, timings, fp8=None, fp8_checkpoint=None):
    """The ``m2nkit plan`` summary table, then why ``nccl_m2n`` leaves tensors to torch_p2p.

    ``args``: the parsed command line (``trainer``, ``inference``, ``link_gbps``);
    ``timings``: ``{phase: seconds}`` of the planning. ``fp8``: the
    ``Fp8Plan`` of a ``wire=fp8`` session: the bytes, per-rank figures and
    time are then the fp8 wire's (e4m3 + float32 scales, the trainers'
    amax exchange in their sends; ``engine.quant_fp8.plan_fp8``), with the
    BF16 wire's for comparison. ``fp8_checkpoint``: the row of an fp8 block
    checkpoint (``quant.fp8_checkpoint_row``: its block size, and whether its
    scales are UE8M0).
    """
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
    layout = getattr(args, "layout", "tables")
    engine = "SGLang" if plan.destination.spec.startswith("sglang:") else "vLLM"
    if engine == "SGLang":   # m2nkit.adapters.sglang
        t.add_row("SGLang layout", "m2nkit's family tables with SGLang 0.5.23's rules "
                                   "(no SGLang needed)")
    else:
        why = getattr(args, "layout_why", "")
        t.add_row("vLLM layout", ("traced from vLLM's own weight loaders" if layout == "traced"
                                  else "m2nkit's family tables (no vLLM needed)")
                  + (f" ({why})" if why else ""))
    t.add_row("wire tensors", f"{len(plan.wires)} ({n_skipped} skipped by {engine}"
                              f"{skipped_why(plan)}), {fmt_bytes(sum(m.nbytes for m in metas))}")
    if fp8_checkpoint:
        t.add_row("fp8 checkpoint", fp8_checkpoint)
    t.add_row("slabs", f"{plan.num_slabs:,}")
    ratio = plan.nbytes_moved / plan.nbytes_min if plan.nbytes_min else 1.0
    bf16 = (f"{fmt_bytes(plan.nbytes_moved)} / {fmt_bytes(plan.nbytes_min)} (ratio {ratio:.3f})")
    seconds = plan.estimated_seconds(args.link_gbps)
    if fp8 is None:
        t.add_row("bytes moved / minimum", bf16)
    else:   # what the fp8 wire carries: e4m3 for quantized slabs, scales, the exchange
        send, recv = fp8.send_bytes, fp8.recv_bytes
        mean_send = send.mean() if len(send) else 0
        t.add_row("bytes moved (fp8 wire)",
                  f"{fmt_bytes(fp8.fp8_bytes)} to the workers (e4m3 + float32 scales) + "
                  f"{fmt_bytes(fp8.exchange_bytes)} amax exchange between trainer ranks; "
                  f"the bf16 wire: {bf16}")
        seconds = fp8.estimated_seconds(args.link_gbps)
    t.add_row("max send per trainer rank", fmt_bytes(send.max(initial=0)))
    t.add_row("max receive per worker", fmt_bytes(recv.max(initial=0)))
    t.add_row("send imbalance (max/mean)", f"{send.max() / mean_send:.3f}" if mean_send else "-")
    t.add_row("fan-in / fan-out (max)", f"{plan.fan_in().max(initial=0)} / {plan.fan_out().max(initial=0)}")
    t.add_row("nccl_m2n expressible", f"{plan.carried_share('nccl_m2n'):.1%} of bytes, "
                                      f"{m2n_ok} of {len(plan.wires) - n_skipped} tensors")
    t.add_row(f"estimated time @ {args.link_gbps:g} Gbit/s per rank"
              + (" (fp8 wire)" if fp8 is not None else ""), fmt_seconds(seconds))
    t.add_row("planning time", ", ".join(f"{k} {fmt_seconds(v)}" for k, v in timings.items()))
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
    """Group reasons that differ only in numbers (``layers.0.`` and ``layers.10.`` alike)."""
    return re.sub(r"\d+", "#", reason)


def print_tensors(console, plan):
    """``-v``: one row per wire tensor (dtype, shape, bytes moved, slabs, nccl_m2n verdict)."""
    from rich.table import Table

    t = Table(title="wire tensors", title_justify="left")
    for col in ("name", "dtype", "shape", "bytes moved", "slabs", "nccl_m2n"):
        t.add_column(col, overflow="fold")
    for w in plan.wires:
        verdict = w.verdict("nccl_m2n")
        m2n = "skipped: " + w.skipped if w.skipped else ("yes" if verdict.ok else "no: " + verdict.reason)
        t.add_row(w.name, str(w.meta.dtype).removeprefix("torch."), str(list(w.meta.shape)),
                  fmt_bytes(w.nbytes_moved), str(len(w.table)), m2n)
    console.print(t)


#: What each dim of a tensor is called in the bindings table, by tensor rank.
#: Stacked experts (``w13_weight``, ``w2_weight`` and the stacked wire
#: tensors) are ``[E, rows, cols]``.
_DIM_NAMES = {1: ("rows",), 2: ("rows", "cols")}


def _describe_box(box, shape, name: str = "") -> str:
    """``box`` of a tensor of ``shape`` in words: ``"rows 64:80"``, ``"experts 0:4"``.

    Dims the box covers whole are left out; a box covering the whole tensor
    is ``"whole"``. Ranges are half-open, ``start:stop``. Dim 0 of a 3-D
    tensor is ``experts`` where ``name`` (the tensor or parameter) is stacked
    experts, else ``rows`` (a ``conv1d`` weight ``[C, 1, K]``) with the other
    dims ``dim1``, ``dim2``.
    """
    names = _DIM_NAMES.get(len(shape), tuple(f"dim{i}" for i in range(len(shape))))
    if len(shape) == 3:
        names = (("experts", "rows", "cols") if "experts" in name
                 else ("rows", "dim1", "dim2"))
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


def engine_name(plan) -> str:
    """The inference engine the plan's destination is: ``"SGLang"`` for an
    ``sglang:`` layout (``sglang_destination_layout``), else ``"vLLM"``."""
    return "SGLang" if str(plan.destination.spec).startswith("sglang:") else "vLLM"


def binding_rows(plan) -> list[tuple[str, str, str, str, str]]:
    """One row per (wire tensor, inference parameter, region): where each wire tensor lands.

    Returns ``(wire tensor, parameter of the vLLM or SGLang worker, region of the parameter, workers,
    part of the wire tensor they take)``, in wire order. Workers taking the
    same region of the same parameter share a row; when they take different
    parts of the wire tensor (tensor-parallel shards), the last column says
    which worker takes which. Regions and parts are in local coordinates of
    the parameter and global coordinates of the wire tensor
    (:func:`_describe_box`). Skipped wire tensors, and those no vLLM (or
    SGLang) parameter takes, get one row saying why.
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
            why = dest.unknown.get(name, f"no {engine_name(plan)} parameter takes it")
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
                takes = _describe_box(next(iter(by_box)), shape, name)
            else:
                takes = "; ".join(f"{_describe_box(box, shape, name)} ({_describe_workers(ws)})"
                                  for box, ws in sorted(by_box.items(), key=lambda kv: min(kv[1])))
            rows.append((name, param, _describe_box(region, pshape, param),
                         _describe_workers(b.worker for b in group), takes))
    return rows


def print_bindings(console, plan):
    """``--bindings``: the rows of :func:`binding_rows`, then the tied parameters."""
    from rich.table import Table

    engine = engine_name(plan)
    t = Table(title=f"where each wire tensor lands (HF name -> {engine} parameter)",
              title_justify="left")
    for col in ("wire tensor", f"{engine} parameter", "region", "workers", "takes"):
        t.add_column(col, overflow="fold")
    for row in binding_rows(plan):
        t.add_row(*row)
    console.print(t)
    for alias, target in sorted(plan.destination.aliases.items()):
        console.print(f"{engine} parameter {alias} is the storage of {target} (tied; filled through it)",
                      markup=False, highlight=False)


def print_demo_table(console, result) -> None:
    """The ``m2nkit demo`` table of a ``DemoResult``: each round, then the baseline if it ran."""
    from rich.table import Table

    t = Table(title=f"m2nkit demo: {result.model}, {result.trainer} -> {result.inference}",
              title_justify="left")
    for col in ("method", "round", "bytes sent (total)", "max per trainer rank",
                "time", "useful throughput", "check"):
        t.add_column(col)
    for r in result.rounds:
        total = sum(r.bytes_per_rank)
        t.add_row(f"m2nkit {getattr(result, 'transport', 'torch_p2p')}", str(r.index), fmt_bytes(total),
                  fmt_bytes(max(r.bytes_per_rank)), fmt_seconds(r.seconds),
                  f"{fmt_bytes(result.nbytes_min / r.seconds)}/s" if r.seconds else "-",
                  f"bit-exact on {r.verified_workers} workers, = minimum"
                  if total == result.nbytes_min else f"{total - result.nbytes_min} bytes over the minimum")
    b = result.baseline
    if b:
        t.add_row(b.get("method", "gather-then-broadcast"), "-", fmt_bytes(b["bytes_total"]),
                  fmt_bytes(b["bytes_max_rank"]), fmt_seconds(b["seconds"]),
                  f"{fmt_bytes(result.nbytes_min / b['seconds'])}/s" if b["seconds"] else "-",
                  "bit-exact" if b.get("verified") else "not verified")
    console.print(t)
    console.print(f"minimum bytes (what the workers hold): {fmt_bytes(result.nbytes_min)}; "
                  "useful throughput = that / time")
