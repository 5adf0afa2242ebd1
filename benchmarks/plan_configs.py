"""Does ``m2nkit plan`` succeed on every published config shipped here, traced and from tables?

Question (issue 16): for every ``config.json`` in ``examples/configs`` (the
configs of ``../shared/models``, byte for byte), at a layout RL users run it
at, does the real command plan it both from vLLM's own loaders (``--layout
traced``) and from m2nkit's family tables (``--layout tables``), moving exactly
the minimum, and how long does the whole command take? Each run is its own
process, interpreter start to exit (``plan_scale.run_once``: wall, CPU, peak
RSS, the command's own "planning time" breakdown, load average before and
after).

Kimi-K2.5 as published carries an int4 ``compressed-tensors``
``quantization_config`` in its ``text_config``: that run must be refused
(exit 2, naming what is supported), and its bf16 form (the same config without
it, written to a temporary folder) is planned instead. Its traced run needs
transformers 5.24+ (``Kimi_K25Config``), which ``.venv`` does not have
(Megatron-Bridge pins 5.12.1): it runs under ``--tf-python`` (default
``.venv-tf/bin/python``, ``scripts/side_transformers.sh``), or is reported as
not run.

    .venv/bin/python benchmarks/plan_configs.py [--layout traced|tables ...]
        [--match TEXT] [--tf-python PATH] [--json PATH]

Prints one row per (config, layout) and exits 1 if any plan fails, has
problems, or moves more than the minimum. Needs vLLM for ``traced``
(``scripts/setup.sh``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from plan_scale import run_once  # noqa: E402  (a sibling script, not a package)

REPO = HERE.parent
CONFIGS = REPO / "examples" / "configs"

#: config folder -> (trainer, inference): a layout each model is served at (tp within its
#: head counts, EP for the MoE models, dp replicas for the largest;
#: ``examples/configs/layouts.json``, which the tests plan too)
CASES = {name: tuple(pair) for name, pair in
         json.loads((CONFIGS / "layouts.json").read_text())["layouts"].items()}

#: The published config that must be refused, and the form planned instead.
INT4 = "moonshotai__Kimi-K2.5"
#: transformers 5.24+ only (Kimi_K25Config): traced under --tf-python
NEEDS_NEWER_TRANSFORMERS = {INT4}


def bf16_form(config: Path, out_dir: Path) -> Path:
    """``config`` without ``text_config.quantization_config``, as ``out_dir/config.json``."""
    doc = json.loads(config.read_text())
    doc["text_config"].pop("quantization_config")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(doc, indent=2))
    return out_dir / "config.json"


def command(python: str, config: Path, trainer: str, inference: str, layout: str) -> list[str]:
    """``m2nkit plan CONFIG --trainer T --inference I --layout L`` run by ``python``."""
    return [python, "-m", "m2nkit.engine.tools.cli", "plan", str(config), "--trainer", trainer,
            "--inference", inference, "--layout", layout]


def refusal(cmd: list[str]) -> str:
    """The one-line error of a command that must exit 2."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    if proc.returncode != 2:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}, not 2:\n"
                           f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return proc.stderr.strip().splitlines()[-1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layout", action="append", choices=("traced", "tables"),
                    help="only this layout (repeatable; default: both)")
    ap.add_argument("--match", help="only the configs whose folder name contains this text")
    ap.add_argument("--tf-python", default=str(REPO / ".venv-tf" / "bin" / "python"),
                    help="interpreter with transformers 5.24+ for Kimi-K2.5's trace")
    ap.add_argument("--json", type=Path, help="also write every row as JSON here")
    args = ap.parse_args(argv)
    folders = sorted(p.name for p in CONFIGS.iterdir() if (p / "config.json").is_file())
    missing = sorted(set(folders) - set(CASES))
    if missing:
        sys.exit(f"plan_configs: no layout chosen for {missing}: add them to CASES")
    layouts = args.layout or ["tables", "traced"]
    rows, failed = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for folder in folders:
            if args.match and args.match not in folder:
                continue
            trainer, inference = CASES[folder]
            config = CONFIGS / folder / "config.json"
            for layout in layouts:
                python = sys.executable
                if layout == "traced" and folder in NEEDS_NEWER_TRANSFORMERS:
                    if not Path(args.tf_python).is_file():
                        rows.append({"config": folder, "layout": layout, "not_run":
                                     f"needs transformers 5.24+: {args.tf_python} not found "
                                     "(scripts/side_transformers.sh makes it)"})
                        print(_line(rows[-1]), flush=True)
                        continue
                    python = args.tf_python
                row = {"config": folder, "trainer": trainer, "inference": inference,
                       "layout": layout}
                planned = config
                if folder == INT4:
                    row["published_refused"] = refusal(command(python, config, trainer,
                                                               inference, layout))
                    planned = bf16_form(config, Path(tmp) / folder)
                    row["planned"] = "bf16 form (text_config.quantization_config removed)"
                try:
                    row.update(run_once(command(python, planned, trainer, inference, layout)))
                except RuntimeError as e:
                    row["error"] = str(e)[-1500:]
                ok = ("error" not in row and row["moved_over_min"] == 1.0
                      and row["problems"] == "none")
                row["ok"] = ok
                if not ok:
                    failed.append(f"{folder} ({layout})")
                rows.append(row)
                print(_line(row), flush=True)
    print("wall: the whole command, interpreter start to exit; imports, read, layout, plan:\n"
          "  its own 'planning time' row; moved/min: bytes moved over the minimum;\n"
          "  load: 1-minute load average before -> after")
    if args.json:
        args.json.write_text(json.dumps({
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                        "platform": platform.platform()}, "rows": rows}, indent=1))
        print(f"wrote {args.json}")
    if failed:
        print(f"FAILED: {failed}")
        return 1
    return 0


def _line(row: dict) -> str:
    head = f"{row['config']:44} {row['layout']:7}"
    if "not_run" in row:
        return f"{head} not run: {row['not_run']}"
    if "error" in row:
        return f"{head} {row['trainer']} -> {row['inference']}: FAILED {row['error'][-300:]}"
    ph = row["phases_s"]
    text = (f"{head} {row['trainer']:>9} -> {row['inference']:20} wall {row['wall_s']:6.1f} s  "
            f"(imports {ph['imports']:.1f}, read {ph['read']:.2f}, layout "
            f"{ph['vLLM layout']:.1f}, plan {ph['plan']:.2f})  wire {row['wire']:>5}  slabs "
            f"{row['slabs']:>9,}  moved/min {row['moved_over_min']:.3f}  problems "
            f"{row['problems']}  load {row['load_before']:.1f}->{row['load_after']:.1f}")
    if "published_refused" in row:
        text += f"\n    published int4 config refused: {row['published_refused']}"
    return text


if __name__ == "__main__":
    raise SystemExit(main())
