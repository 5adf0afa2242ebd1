"""Integration tests: real Megatron-Core, Megatron-Bridge and vLLM stacks.

vLLM decides its platform once per process, on first use. This machine has no
GPU, so everything that imports vLLM in the test process (test_stacks.py,
the traced layouts) needs its CPU platform, chosen before the first import.
"""

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
