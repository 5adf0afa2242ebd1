"""Kimi-K2.5 from real ``fully_shard`` ranks into traced vLLM layouts, against vLLM's own load.

transformers' ``Kimi_K25ForConditionalGeneration`` and vLLM 0.33.0's
``kimi_k25.py`` need transformers 5.24+, so the ranks and the checks run in
``.venv-tf`` (``fsdp2_kimi_k25_in.py``, whose docstring says what it does);
this test fails when that venv is missing, when any check there fails (a
worker's parameter that differs from vLLM's own load by one bit), and on
what the run records: the wire shapes transformers' in-memory split q/k/v
and fused experts are re-fused to, rank 0's row pieces of ``wqkv`` (the
inverse of transformers' ``PermuteForRope``, worked out by hand below) and
every plan moving exactly the minimum.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from _paths import REPO
from integration.test_traced_kimi_k25 import _python_tf

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

SCRIPT = REPO / "tests" / "integration" / "fsdp2_kimi_k25_in.py"
SPECS = {"vllm:tp=2": 2, "vllm:tp=2,ep": 2, "vllm:tp=4,ep": 4}
WQKV = "vision_tower.encoder.blocks.0.wqkv.weight"


def test_kimi_k25_fsdp2_ranks_into_traced_layouts_equal_vllm_loads(tmp_path):
    r = subprocess.run([_python_tf(), str(SCRIPT), str(tmp_path)], capture_output=True,
                       text=True, timeout=840, cwd=REPO,
                       env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-4000:]
    out = json.loads((tmp_path / "result.json").read_text())
    assert set(out["compared"]) == {f"{s} worker {w}" for s, n in SPECS.items() for w in range(n)}
    for kind in ("fsdp", "hsdp"):
        got = out[kind]
        shapes = got["shapes"]
        # The tiny tower: D = 16, 2 heads of 8; q, k, v [16, 16] in memory.
        assert shapes[WQKV] == [48, 16]
        assert shapes["vision_tower.encoder.blocks.0.wqkv.bias"] == [48]
        assert not any(".attn.q_proj" in n or "position_embeddings" in n for n in shapes)
        experts = "language_model.model.layers.1.mlp.experts"
        assert shapes[f"{experts}.gate_up_proj.weight"] == [4, 64, 32]
        for spec in SPECS:
            moved, minimum = got["plans"][spec]
            assert moved == minimum > 0, (kind, spec)
    # fsdp over 4 ranks: rank 0 holds in-memory rows 0..3 of q and of k, which are
    # (head 0, first half, i = 0..3); PermuteForRope put checkpoint row 2*i there, so they
    # are wqkv rows 0, 2, 4, 6 (q) and 16 + those (k); v's rows 0..3 are rows 32..35.
    rows = [[0, 1], [2, 3], [4, 5], [6, 7], [16, 17], [18, 19], [20, 21], [22, 23], [32, 36]]
    assert sorted(out["fsdp"]["wqkv_rank0_pieces"]) == [[r, [0, 16]] for r in rows]
