#!/usr/bin/env python
"""Run ``shared/tools/vllm_oracle/oracle.py`` on an fp8 block-quantized checkpoint.

vLLM 0.33.0 builds fp8 layers on CPU only on a CPU with AMX tiles: while it
creates the weights, ``Fp8LinearMethod.create_weights``
(``layers/quantization/fp8.py``) asks ``init_fp8_linear_kernel`` for a
matmul kernel, and on this machine every candidate declines
("CPUFp8BlockScaledMMKernel requires AMX tile support (Sapphire Rapids or
newer)"), which raises. The kernel only decides how the forward pass
multiplies; the parameters (``weight`` fp8, ``weight_scale_inv`` fp32,
shapes from ``create_fp8_weight_parameter``/``create_fp8_scale_parameter``)
and their ``weight_loader`` are made before it is asked. So this wrapper
replaces that one call with ``None`` and runs the oracle unchanged: every
parameter is still vLLM's, loaded by vLLM's loaders. Nothing else is patched;
the fused-MoE fp8 path (``Fp8MoEMethod``) builds as it is.

vLLM's quantization registry also imports ``compressed_tensors`` (and
``loguru``), which the oracle venv lacks; install them aside and put them on
``PYTHONPATH`` (``regenerate.py --extra-path``):

    /tmp/oracle/venv/bin/python -m pip install --no-deps --target DIR \
        compressed-tensors==0.17.0 loguru

Usage: oracle_fp8.py ORACLE_PY CKPT_DIR [oracle.py options ...]
"""

import os
import runpy
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import vllm.model_executor.layers.quantization.fp8 as fp8  # noqa: E402

fp8.init_fp8_linear_kernel = lambda **kwargs: None

oracle = sys.argv[1]
sys.argv = [oracle, *sys.argv[2:]]
runpy.run_path(oracle, run_name="__main__")
