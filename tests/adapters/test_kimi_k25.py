"""Kimi-K2.5 (``KimiK25ForConditionalGeneration``): the int4 form refused, the bf16 form planned.

The published config (``examples/configs/moonshotai__Kimi-K2.5``) carries an
int4 compressed-tensors ``text_config.quantization_config``. m2nkit lays out
no packed int4 weights, so every path refuses it with one message naming the
quantization and what is supported (``families.quant.compressed_tensors_refusal``);
never a bf16 plan of an int4 checkpoint. ``tests/data/oracle/tiny-kimi-k25`` is the
bf16 tiny checkpoint with real vLLM 0.33.0 loader dumps (README there).
"""

from __future__ import annotations

import copy
import json
import shutil

from _paths import CONFIGS, ORACLE
import pytest

from m2nkit.adapters.families.quant import compressed_tensors_refusal
from m2nkit.adapters.hf_checkpoint import CheckpointError, read_checkpoint
from m2nkit.engine.tools.cli import main

PUBLISHED = CONFIGS / "moonshotai__Kimi-K2.5" / "config.json"
TINY = ORACLE / "tiny-kimi-k25" / "checkpoint"

#: The words every refusal of the published int4 form carries.
INT4_WORDS = ("KimiK25ForConditionalGeneration", "text_config.quantization_config",
              "compressed-tensors", "int4 weights", "group size 32", "pack-quantized",
              "supported: the unquantized (bf16) form, the same config without "
              "text_config.quantization_config")


def _published() -> dict:
    return json.loads(PUBLISHED.read_text())


def _bf16(config: dict) -> dict:
    out = copy.deepcopy(config)
    del out["text_config"]["quantization_config"]
    return out


def test_published_int4_is_named_and_bf16_is_not_refused():
    why = compressed_tensors_refusal(_published(), "KimiK25ForConditionalGeneration")
    assert why is not None and all(w in why for w in INT4_WORDS), why
    assert compressed_tensors_refusal(_bf16(_published())) is None


def test_read_checkpoint_refuses_int4_config_and_checkpoint(tmp_path):
    with pytest.raises(CheckpointError) as e:
        read_checkpoint(PUBLISHED)
    assert all(w in str(e.value) for w in INT4_WORDS), e.value
    # a checkpoint with data: the bf16 tiny tensors under an int4 config
    ckpt = tmp_path / "int4"
    shutil.copytree(TINY, ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config["text_config"]["quantization_config"] = _published()["text_config"][
        "quantization_config"]
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as e:
        read_checkpoint(ckpt)
    assert all(w in str(e.value) for w in INT4_WORDS), e.value


@pytest.mark.parametrize("layout", ["traced", "auto"])
def test_plan_refuses_int4_on_every_layout(capsys, layout):
    code = main(["plan", str(PUBLISHED), "--trainer", "fsdp:256",
                 "--inference", "vllm:tp=8,dp=8,ep", "--layout", layout])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert all(w in err for w in INT4_WORDS), err
