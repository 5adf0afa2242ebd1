"""Integration tests: real Megatron-Core, Megatron-Bridge and vLLM stacks.

vLLM decides its platform once per process, on first use. This machine has no
GPU, so everything that imports vLLM in the test process (test_stacks.py,
the traced layouts) needs its CPU platform, chosen before the first import.
"""

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

# Ray reads its cluster setting once, when it is first imported, and vLLM's model
# modules may import it before test_vllm_ray.py does: Ray on loopback only, from
# the start (the values test_vllm_ray.RAY_LOOPBACK_ENV checks).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
