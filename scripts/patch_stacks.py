"""Setup-time edits of installed framework files, for what no runtime shim can reach.

Two are left; everything else the CPU stack needs is a runtime shim in
``m2nkit.adapters.megatron.compat`` (which also says why triton, the real
dependency behind one of them, is not installed). It is idempotent (a patched file is
recognised by its marker and left alone), refuses to guess (the original text
must occur exactly once), and ``tests/integration/test_stacks.py`` checks it.

B1  megatron-bridge 0.6.2 ``megatron/bridge/peft/lora_layers.py`` imports
    ``transformer_engine.pytorch`` at module level, and the module is imported
    by every ``AutoBridge`` (model_bridge -> peft_bridge -> canonical_lora),
    LoRA or not. TransformerEngine has no CPU build. A runtime stand-in in
    ``sys.modules`` would make every guarded ``import transformer_engine`` in
    megatron-core succeed too and switch on its TE code paths, so the guard
    has to sit in this one file. Without TE the module gets a namespace whose
    classes match no module: ``isinstance(m, (te.Linear, ...))`` is False and
    the annotations that name ``te.ops.*`` still evaluate.

B2  torchvision (the PyPI build for torch 2.13, 0.28.0) is a CUDA build: its
    native library cannot load against the CPU torch, so ``torchvision::nms``
    and ``::qnms`` are never defined, and the two
    ``@torch.library.register_fake("torchvision::...")`` decorators in
    ``torchvision/_meta_registrations.py`` raise "operator torchvision::nms does
    not exist" on import. vLLM 0.33.0's Qwen3.5, Qwen3-Next and Qwen3-VL
    modules import transformers' Qwen2-VL image processor, which imports
    ``torchvision.transforms.v2``. The guard registers the two fakes only when
    the native ops loaded (``torchvision.extension._has_ops()``), as the file
    already does for every other op (``register_meta``); the pure-Python
    transforms work either way. (``shared/tools/vllm_oracle/README.txt``.)

Usage: ``.venv/bin/python scripts/patch_stacks.py`` (prints what it did).
"""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

MARKER = "# m2nkit patch_stacks B1"

ORIGINAL = "import transformer_engine.pytorch as te\n"

GUARDED = f"""try:  {MARKER}: TransformerEngine has no CPU build
    import transformer_engine.pytorch as te
except ImportError:  {MARKER}: only the names this module uses, as inert classes
    import types as _types  {MARKER}: stdlib namespace objects

    te = _types.SimpleNamespace(  {MARKER}: isinstance(x, te.Linear) is False for every x
        **{{_n: type(_n, (), {{}}) for _n in ("Linear", "LayerNormLinear")}},  {MARKER}: module classes
        fp8_autocast=None,  {MARKER}: only called on TE modules
        get_tensor_model_parallel_group=None,  {MARKER}: only called on TE modules
        get_tensor_model_parallel_world_size=None,  {MARKER}: only called on TE modules
        ops=_types.SimpleNamespace(**{{_n: type(_n, (), {{}}) for _n in (  {MARKER}: te.ops.* in annotations
            "Sequential", "Linear", "Dropout", "LayerNorm", "RMSNorm",  {MARKER}: names used in lora_layers.py
            "AddExtraInput", "ConstantScale", "MakeExtraOutput", "Quantize")}}),  {MARKER}: names used in lora_layers.py
    )
"""

TARGET = "megatron/bridge/peft/lora_layers.py"


def target_path() -> Path:
    """The installed ``lora_layers.py`` of the running interpreter's site-packages."""
    return Path(sysconfig.get_paths()["purelib"]) / TARGET


def apply(path: Path | None = None) -> str:
    """Patch ``path`` (default: the installed file); returns ``"patched"`` or ``"already"``.

    Raises:
        SystemExit: the file is missing, or the original import does not occur
            exactly once (a different Bridge version: check the patch by hand).
    """
    path = path or target_path()
    if not path.is_file():
        raise SystemExit(f"patch_stacks: {path} not found; is megatron-bridge 0.6.2 installed?")
    text = path.read_text()
    if MARKER in text:
        return "already"
    count = text.count(ORIGINAL)
    if count != 1:
        raise SystemExit(f"patch_stacks: expected the line {ORIGINAL.strip()!r} once in {path}, "
                         f"found it {count} times; this patch is written for megatron-bridge 0.6.2")
    path.write_text(text.replace(ORIGINAL, GUARDED))
    return "patched"


TV_MARKER = "# m2nkit patch_stacks B2"
TV_TARGET = "torchvision/_meta_registrations.py"
TV_OPS = ("nms", "qnms")


def tv_original(op: str) -> str:
    return f'@torch.library.register_fake("torchvision::{op}")\n'


def tv_guarded(op: str) -> str:
    return (f'@(torch.library.register_fake("torchvision::{op}")  {TV_MARKER}: CUDA build on CPU torch\n'
            f'  if torchvision.extension._has_ops() else (lambda fn: fn))  {TV_MARKER}\n')


def apply_torchvision(path: Path | None = None) -> str:
    """Guard B2 in ``path`` (default: the installed file); ``"patched"``, ``"already"`` or ``"absent"``.

    ``"absent"``: torchvision is not installed (``--core``), nothing to do.

    Raises:
        SystemExit: a decorator does not occur exactly once (another
            torchvision version: check the patch by hand).
    """
    path = path or Path(sysconfig.get_paths()["purelib"]) / TV_TARGET
    if not path.is_file():
        return "absent"
    text = path.read_text()
    if TV_MARKER in text:
        return "already"
    for op in TV_OPS:
        if text.count(tv_original(op)) != 1:
            raise SystemExit(f"patch_stacks: expected {tv_original(op).strip()!r} once in {path}; "
                             "this patch is written for torchvision 0.28.0")
        text = text.replace(tv_original(op), tv_guarded(op))
    path.write_text(text)
    return "patched"


if __name__ == "__main__":
    print(f"patch_stacks: {TARGET}: {apply()}")
    print(f"patch_stacks: {TV_TARGET}: {apply_torchvision()}")
    sys.exit(0)
