#!/usr/bin/env bash
# Create (or refresh) .venv-sglang: .venv with SGLang 0.5.23 in front of it,
# for the tests that compare m2nkit's SGLang layout with SGLang's own loaders
# (tests/integration/test_sglang_layout.py runs .venv-sglang/bin/python on
# tests/integration/sglang_oracle.py). Needs scripts/setup.sh first (.venv).
#
# SGLang cannot go into .venv: installed with its dependencies it pulls a CUDA
# torch and transformers 5.19.0 (Megatron-Bridge 0.6.2 needs <= 5.12.1); and
# its packages would sit in the import path of everything .venv runs. As for
# .venv-tf (scripts/side_transformers.sh), .venv-sglang holds only the
# packages of scripts/stacks/sglang.txt, installed --no-deps into its own
# site-packages, and a .pth file adds .venv's site-packages behind them, so
# torch 2.13.0 CPU, transformers, torchvision and vLLM (whose
# vllm._custom_ops SGLang imports) are .venv's. About 1.2 GB (triton is 1 GB),
# under a minute once the wheels are cached.
set -euo pipefail
cd "$(dirname "$0")/.."
MAIN=.venv/bin/python
SIDE=.venv-sglang
[ -x "$MAIN" ] || { echo "side_sglang: run scripts/setup.sh first (no $MAIN)" >&2; exit 1; }
MAIN_SITE=$("$MAIN" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
PYBIN=$("$MAIN" -c 'import sys; print(sys._base_executable)')
[ -x "$SIDE/bin/python" ] || "$PYBIN" -m venv --without-pip "$SIDE"
SIDE_SITE=$("$SIDE/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
printf 'import site; site.addsitedir(%s)\n' "'$(realpath "$MAIN_SITE")'" > "$SIDE_SITE/m2nkit-main-venv.pth"
if ! "$SIDE/bin/python" -c 'from importlib.metadata import version as v; assert v("sglang") == "0.5.23"' 2>/dev/null; then
    "$MAIN" -m pip install -q --disable-pip-version-check --no-deps --ignore-installed \
        --target "$SIDE_SITE" --upgrade --no-compile -c constraints.txt -r scripts/stacks/sglang.txt
fi
"$SIDE/bin/python" - <<'PY'
import warnings, logging
warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)
import torch, transformers, sglang
from sglang.srt.models import qwen3, qwen3_moe  # noqa: F401 - SGLang's model classes import
from sglang.srt.model_loader import loader  # noqa: F401
assert "+cpu" in torch.__version__, f"torch {torch.__version__} is not the CPU build"
print(f"side_sglang: .venv-sglang has sglang {sglang.__version__} (torch {torch.__version__}, "
      f"transformers {transformers.__version__} from .venv)")
PY
