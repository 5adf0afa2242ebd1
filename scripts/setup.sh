#!/usr/bin/env bash
# Create (or refresh) .venv: m2nkit, its test tools, and the framework stacks
# the integration tests run against: vLLM 0.33.0 (its model classes and
# weight-transfer clients, on CPU), megatron-core 0.19.2, megatron-bridge
# 0.6.2 and Ray. Idempotent; a second run only checks.
#   scripts/setup.sh          everything (what CI and the README use), and
#                             .venv-sglang (SGLang 0.5.23: scripts/side_sglang.sh)
#   scripts/setup.sh --core   m2nkit and its test tools only
# One venv serves all three stacks: transformers is pinned to 5.12.1, the
# newest Megatron-Bridge 0.6.2 accepts; vLLM 0.33.0 declares >=5.16.1 but
# its model classes and loaders run under 5.12.1 for every family m2nkit
# supports (tests/integration prove it against real vLLM loads). Why each
# step is needed: scripts/stacks/*.txt and scripts/patch_stacks.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt)
"${PIP[@]}" -e '.[dev,nccl]'
[ "${1:-}" = "--core" ] && exit 0
"${PIP[@]}" -r scripts/stacks/vllm-runtime.txt -r scripts/stacks/megatron-runtime.txt
"${PIP[@]}" --no-deps -r scripts/stacks/nodeps.txt
# megatron-core 0.19.2 has cp312 wheels only; its sdist builds for 3.11 (a
# pybind11 dataset helper, needs a C++ compiler). Both packages declare
# Python >= 3.12 and run on 3.11 with the shims in m2nkit.adapters.megatron.compat.
"${PIP[@]}" --no-deps --ignore-requires-python --no-binary megatron-core \
    megatron-core==0.19.2 megatron-bridge==0.6.2
.venv/bin/python scripts/patch_stacks.py
# SGLang 0.5.23 in an environment of its own on top of .venv (.venv-sglang; why: the script)
./scripts/side_sglang.sh
