"""vLLM's own UE8M0 requant of the fp8 wire (needs vLLM: integration).

``requant_weight_ue8m0_inplace`` is what vLLM 0.33.0's DeepGEMM kernels run after loading
when E8M0 is in use; the fast UE8M0 checks are ``tests/engine/test_ue8m0.py``.
"""

from __future__ import annotations

import pytest
import torch


def _fp8_wire_of(x: torch.Tensor, cut: int) -> tuple[torch.Tensor, torch.Tensor]:
    """m2nkit's trainer-side quantization of ``x`` held by two ranks (rows ``[0, cut)`` and
    ``[cut, rows)``), their partial maxima merged as the exchange does."""
    from m2nkit.engine.quant_fp8 import block_partial_amax, quantize_region, scale_of_amax

    block = (128, 128)
    rows, cols = x.shape
    pieces = [((0, cut), (0, cols)), ((cut, rows), (0, cols))]
    amax = torch.zeros(-(-rows // 128), -(-cols // 128))
    for region in pieces:
        blocks, part = block_partial_amax(x[region[0][0]:region[0][1]], region, block)
        amax[blocks] = torch.maximum(amax[blocks], part)
    scale = scale_of_amax(amax)
    q = torch.cat([quantize_region(x[r[0][0]:r[0][1]], r, scale, block) for r in pieces])
    return q, scale


@pytest.mark.integration
def test_vllm_requant_of_the_fp8_wire_equals_its_requant_of_its_own_quantization():
    """vLLM 0.33.0's ``requant_weight_ue8m0_inplace`` (what ``DeepGemmFp8BlockScaledMMKernel``
    and ``prepare_fp8_moe_layer_for_deepgemm`` run with E8M0) of m2nkit's fp8 wire (two
    ranks meeting in block row 1) equals its requant of vLLM's own online quantization
    (``per_block_cast_to_fp8(..., use_ue8m0=False)``): bytes and scales; the scales are then
    powers of two and differ from the wire's."""
    from vllm.model_executor.layers.quantization.utils.fp8_utils import (
        requant_weight_ue8m0_inplace)
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(320, 200, generator=g) * 0.05).to(torch.bfloat16)
    q, scale = _fp8_wire_of(x, cut=150)
    vq, vscale = per_block_cast_to_fp8(x, [128, 128], use_ue8m0=False)
    assert torch.equal(q.view(torch.uint8), vq.view(torch.uint8)) and torch.equal(scale, vscale)
    wire = (q.clone(), scale.clone())
    requant_weight_ue8m0_inplace(*wire, block_size=[128, 128])
    requant_weight_ue8m0_inplace(vq, vscale, block_size=[128, 128])
    assert torch.equal(wire[0].view(torch.uint8), vq.view(torch.uint8))
    assert torch.equal(wire[1], vscale)
    assert torch.equal(vscale, torch.exp2(torch.log2(vscale).round()))
    assert not torch.equal(vscale, scale)
