"""GPT-OSS traced from vLLM 0.33.0's own loaders (``adapters/vllm/trace.py``).

vLLM's bf16 GPT-OSS loader (``GptOssModel._load_weights_other``,
``model_executor/models/gpt_oss.py``) reads the stacked experts as the
checkpoint holds them (``gate_up_proj [E, H, 2*I]``), narrows and permutes them
itself and ``copy_``s them straight into the parameters (no ``weight_loader``),
and zeroes ``down_proj_bias`` on tp ranks other than 0 before copying it. The
tiny checkpoint's dumps and the table matrix are in test_vllm_trace.py; here:
the published gpt-oss-20b config (MXFP4 as published, traced in its bf16 form
as the table plans it), and the fake tensors' ``zero_`` rules on a stand-in
model (no vLLM model built).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from _paths import CONFIGS

from .test_vllm_trace import _canonical

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

GPT_OSS_20B = CONFIGS / "openai__gpt-oss-20b" / "config.json"


@pytest.mark.parametrize("spec", ["vllm:tp=4,ep", "vllm:tp=2"])
def test_gpt_oss_20b_table_equals_the_trace_of_its_bf16_form(spec):
    """The published config, every size as published (24 layers, 32 experts): vLLM's model
    is built without the MXFP4 quantization_config, as the table plans it, the layout says
    so with the family's note, and table and trace agree (without EP: w2_bias bound on
    worker 0, zeros on worker 1)."""
    from m2nkit.adapters.families.gpt_oss import MXFP4_NOTE
    from m2nkit.adapters.hf_checkpoint import checkpoint_metas, read_checkpoint
    from m2nkit.adapters.vllm import destination_layout, parse_inference_spec
    from m2nkit.adapters.vllm.trace import trace_destination

    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    config = json.loads(GPT_OSS_20B.read_text())
    assert config["quantization_config"]["quant_method"] == "mxfp4"
    ckpt = read_checkpoint(GPT_OSS_20B)
    metas = checkpoint_metas(ckpt, "fsdp:16")
    inference = parse_inference_spec(spec)
    traced_layout = trace_destination(config, metas, inference)
    assert traced_layout.notes == ("layout traced from vLLM's own weight loaders", MXFP4_NOTE)
    table = _canonical(destination_layout(ckpt.config, metas, inference))
    traced = _canonical(traced_layout)
    assert traced[0] == table[0], sorted(set(traced[0].items()) ^ set(table[0].items()))[:4]
    assert traced[1] == table[1], (sorted(traced[1] - table[1])[:3],
                                   sorted(table[1] - traced[1])[:3])
    assert traced[2:] == table[2:]
    if not inference.ep:
        bias = "model.layers.0.mlp.experts.routed_experts.w2_bias"
        zeros = {p.worker: p.zero_boxes for p in traced_layout.params if p.name == bias}
        assert zeros[0] == () and zeros[1] == (((0, 32), (0, 2880)),), zeros
        assert [b.worker for b in traced_layout.bindings[
            "model.layers.0.mlp.experts.down_proj_bias"]] == [0]


def test_gpt_oss_20b_plans_traced_in_one_command(capsys):
    """The CLI on the published config: exit 0, ratio 1.000, no problem, the MXFP4 note."""
    from m2nkit.engine.tools.cli import main

    capsys.readouterr()
    code = main(["plan", str(GPT_OSS_20B), "--trainer", "fsdp:16", "--inference",
                 "vllm:tp=4,ep", "--layout", "traced"])
    out, err = capsys.readouterr()
    text = " ".join(out.split())
    assert code == 0, out[-3000:] + err[-3000:]
    assert "traced from vLLM's own weight loaders (--layout traced)" in text
    assert "(ratio 1.000)" in text
    assert "problems │ none" in text
    assert "quantization_config quant_method=mxfp4: planned the bf16 form" in text


def test_only_a_table_that_plans_the_config_unquantized_traces_it_unquantized():
    """An fp8 config whose table wire is fp8 (DeepSeek-V3.2) keeps its quantization (and a
    bf16 wire for it stays refused: test_traced_plans.py); a quantized wire, or a config
    without quantization_config, is built as it is."""
    from m2nkit.adapters.families.gpt_oss import MXFP4_NOTE
    from m2nkit.adapters.vllm.trace import unquantized_form
    from m2nkit.manifest import ParamMeta

    bf16 = [ParamMeta("w", torch.bfloat16, (2, 2))]
    config = json.loads(GPT_OSS_20B.read_text())
    served, notes = unquantized_form(config, bf16)
    assert "quantization_config" not in served and notes == (MXFP4_NOTE,)
    assert {k: v for k, v in config.items() if k != "quantization_config"} == served
    assert unquantized_form(config, bf16 + [ParamMeta("s", torch.uint8, (2,))]) is None
    assert unquantized_form(served, bf16) is None
    dsa = json.loads((CONFIGS / "deepseek-ai__DeepSeek-V3.2" / "config.json").read_text())
    assert unquantized_form(dsa, bf16) is None


# --------------------------------------------------------------------------
# zero_ on the fakes, on a stand-in model (trace_worker only)
# --------------------------------------------------------------------------

class _Loader(torch.nn.Module):
    """A meta model with one parameter and a ``load_weights`` of the test's choosing."""

    def __init__(self, load):
        super().__init__()
        self.w2_bias = torch.nn.Parameter(torch.empty(4, 8, device="meta"), requires_grad=False)
        self._load = load

    def load_weights(self, weights):
        for _, weight in weights:
            self._load(self.w2_bias, weight)
        return {"w2_bias"}


def _trace_one(load):
    from m2nkit.adapters.vllm.trace import Feed, trace_worker
    from m2nkit.manifest import ParamMeta

    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    meta = ParamMeta("down_proj_bias", torch.float32, (4, 8))
    with torch.no_grad():
        return trace_worker(_Loader(load), [Feed.whole(meta)])


def test_a_tensor_zeroed_whole_then_copied_is_a_zeroed_copy_attributed_by_storage():
    """GPT-OSS's ``if tp_rank != 0: weight.zero_()`` then ``param.copy_(weight)`` (no
    weight_loader: the copy is attributed to the parameter whose storage it writes)."""
    def zeroed(param, weight):
        weight.zero_()
        param.copy_(weight)

    def plain(param, weight):
        param.copy_(weight)

    def part(param, weight):
        param.data[1:3].copy_(weight[1:3])

    copies, _, _ = _trace_one(zeroed)
    assert [(c.param, c.box, c.region, c.zero) for c in copies] == \
        [("w2_bias", ((0, 4), (0, 8)), ((0, 4), (0, 8)), True)]
    copies, _, _ = _trace_one(plain)
    assert [(c.param, c.zero) for c in copies] == [("w2_bias", False)]
    copies, _, _ = _trace_one(part)       # a view of param.data: the same storage
    assert [(c.param, c.box, c.region) for c in copies] == \
        [("w2_bias", ((1, 3), (0, 8)), ((1, 3), (0, 8)))]


@pytest.mark.parametrize("load,op", [
    (lambda param, weight: (weight[0:2].zero_(), param.copy_(weight)),
     r"zero_\(\) of a view of it \(\[slice\(0, 2, None\)\]\)"),
    (lambda param, weight: (weight[0:2], weight.zero_(), param.copy_(weight)),
     r"zero_\(\) after views of it were taken"),
])
def test_a_zero_the_fakes_cannot_express_is_refused_naming_parameter_and_op(load, op):
    from m2nkit.adapters.vllm.trace import TraceError

    with pytest.raises(TraceError, match=r"wire tensor 'down_proj_bias' into parameter "
                                         r"'w2_bias': vLLM's loader applies " + op):
        _trace_one(load)


def test_a_zeroed_copy_over_a_bound_region_is_refused():
    """Which of the two lands last is not kept: refused, naming worker, parameter and op."""
    from m2nkit.adapters.vllm.trace import TraceError, TracedCopy, _check_zeroed

    zero = TracedCopy("down_proj_bias", "w2_bias", ((0, 4), (0, 8)), ((0, 4), (0, 8)), True)
    _check_zeroed(1, {"w2_bias": [zero]}, {"w2_bias": []})
    with pytest.raises(TraceError, match=r"worker 1: vLLM's loader copies wire tensor "
                                         r"'down_proj_bias' zeroed \(zero_\(\)\) into .* of "
                                         r"parameter 'w2_bias', which another copy also writes"):
        _check_zeroed(1, {"w2_bias": [zero]}, {"w2_bias": [((2, 3), (0, 8))]})
