"""UE8M0 scales (DeepSeek-V3.2's ``scale_fmt: ue8m0``): what m2nkit carries and refuses.

Fast: the checkpoint config's ``scale_fmt`` (``Fp8Block``), ``m2nkit plan``'s row for an
fp8 checkpoint, and why the fp8 wire cannot answer a ``per_block_cast_to_fp8`` call
(``cast_refusal``). With vLLM: ``tests/integration/test_ue8m0_requant.py`` (vLLM's own
UE8M0 requant of the fp8 wire) and the live rounds in
``tests/integration/test_vllm_plugin_fp8.py``
(``test_round_into_deep_gemm_ue8m0_workers_equals_fresh_load``).
"""

from __future__ import annotations

import json

from _paths import CONFIGS
import pytest

from m2nkit.adapters.families.quant import Fp8Block, fp8_block
from m2nkit.engine.plugins.vllm_reload import cast_refusal
from m2nkit.engine.tools.cli import main

V32 = CONFIGS / "deepseek-ai__DeepSeek-V3.2" / "config.json"
V3 = CONFIGS / "deepseek-ai__DeepSeek-V3" / "config.json"


def _config(path, **quant):
    config = json.loads(path.read_text())
    config["quantization_config"].update(quant)
    return config


def test_fp8_block_carries_scale_fmt():
    """DeepSeek-V3.2 ships ``"scale_fmt": "ue8m0"`` with ``weight_block_size [128, 128]``;
    DeepSeek-V3 no ``scale_fmt``."""
    assert fp8_block(_config(V32)) == Fp8Block(128, 128, "ue8m0")
    assert fp8_block(_config(V3)) == Fp8Block(128, 128, None)


@pytest.mark.parametrize("value", ["e5m2", "UE8M0", ""])
def test_fp8_block_refuses_other_scale_fmts_by_name(value):
    with pytest.raises(ValueError) as e:
        fp8_block(_config(V32, scale_fmt=value), "DeepseekV32ForCausalLM")
    assert str(e.value) == (
        f"DeepseekV32ForCausalLM: quantization_config scale_fmt {value!r} is not supported; "
        "valid: 'ue8m0' (power-of-two scales, as DeepSeek-V3.2 ships) or none (float32 scales)")


@pytest.fixture
def cheap_manifest(monkeypatch):
    """``--json``'s manifest of a 671B config (its digest and per-rank entries) takes seconds
    on a busy CPU and is not what these tests read: it is left empty."""
    import m2nkit.manifest.serialize as serialize

    monkeypatch.setattr(serialize, "manifest_digest", lambda metas, ranks: "")
    monkeypatch.setattr(serialize, "manifest_to_json", lambda metas, ranks: {})


@pytest.mark.parametrize("model,row,scale_fmt", [
    ("deepseek-ai__DeepSeek-V3.2", "weight_block_size [128, 128], e4m3 weights with float32 "
     "weight_scale_inv; scale_fmt ue8m0: scales are powers of two", "ue8m0"),
    ("deepseek-ai__DeepSeek-V3", "weight_block_size [128, 128], e4m3 weights with float32 "
     "weight_scale_inv", None),
])
def test_plan_shows_the_fp8_checkpoint(tmp_path, capsys, cheap_manifest, model, row, scale_fmt):
    """``m2nkit plan`` on the shipped config: an ``fp8 checkpoint`` row (block size, and for
    DeepSeek-V3.2 that its scales are powers of two), the same in ``--json``."""
    out_json = tmp_path / "plan.json"
    assert main(["plan", str(CONFIGS / model), "--trainer", "fsdp:1", "--inference",
                 "vllm:tp=1", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "fp8 checkpoint" in line]
    assert len(lines) == 1 and lines[0].split("│")[2].strip() == row, out
    assert json.loads(out_json.read_text())["fp8_checkpoint"] == {
        "weight_block_size": [128, 128], "scale_fmt": scale_fmt}


def test_plan_of_an_unquantized_model_has_no_fp8_checkpoint_row(tmp_path, capsys,
                                                                cheap_manifest):
    out_json = tmp_path / "plan.json"
    assert main(["plan", str(CONFIGS / "Qwen__Qwen3-8B"), "--trainer", "fsdp:2", "--inference",
                 "vllm:tp=2", "--json", str(out_json)]) == 0
    assert "fp8 checkpoint" not in capsys.readouterr().out
    assert "fp8_checkpoint" not in json.loads(out_json.read_text())


@pytest.mark.parametrize("args,reason", [
    (((320, 256), [128, 128], False, (320, 256), (3, 2)), None),
    (((320, 256), [128, 128], True, (320, 256), (3, 2)),
     "UE8M0 scales (powers of two); the wire carries float32 scales amax / 448, not rounded"),
    (((320, 256), [64, 64], False, (320, 256), (3, 2)),
     "blocks [64, 64]; the wire carries 128 x 128 blocks"),
    (((320, 256), None, False, (320, 256), (3, 2)),
     "blocks []; the wire carries 128 x 128 blocks"),
    (((320, 256), [128, 128], False, None, None),
     "a tensor the fp8 wire does not carry (only the layer's own weight, or one expert of it)"),
    (((320, 256), [128, 128], False, (256, 256), (2, 2)),
     "shape [320, 256]; the wire's e4m3 tensor is [256, 256]"),
    (((320, 256), [128, 128], False, (320, 256), (3, 1)),
     "a scale grid of [3, 2] blocks; the wire's scales are [3, 1]"),
])
def test_cast_refusal_names_why_the_wire_cannot_answer(args, reason):
    """What the fp8 wire carries (the e4m3 tensor and float32 ``amax / 448`` scales of the
    layer's own weight, in 128 x 128 blocks, once) against vLLM's call: 320 rows and 256
    columns make a grid of 3 x 2 blocks."""
    assert cast_refusal(*args) == reason
    assert cast_refusal(*args[:3], (320, 256), (3, 2), repeated=True) == (
        "the same tensor a second time (the wire carries one quantization of each)")
