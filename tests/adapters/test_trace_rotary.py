"""The tracer's rotary q/k row rule, against torch's own view/transpose/reshape (no vLLM)."""

from __future__ import annotations

import pytest
import torch

from m2nkit.adapters.vllm.trace import (Feed, TracedCopy, merge_copies, rotary_heads,
                                        rotary_rows, rotary_source_row)
from m2nkit.manifest import ParamMeta


@pytest.mark.parametrize("nh,hd", [(1, 2), (4, 16), (3, 8), (40, 128)])
def test_source_rows_are_what_torch_reorders(nh, hd):
    rows = torch.arange(nh * hd).view(nh, hd // 2, 2, 1).transpose(1, 2).reshape(nh * hd)
    assert [rotary_source_row(p, hd) for p in range(nh * hd)] == rows.tolist()


def _chain(nh, hd, H):
    return (("view", (nh, hd // 2, 2, H), ()), ("transpose", (1, 2), ()),
            ("reshape", (nh * hd, H), ()), ("narrow", (0, 0, hd), ()))


def test_only_the_exact_chain_on_a_whole_2d_tensor_is_recognized():
    feed = Feed.whole(ParamMeta("q_proj.weight", torch.bfloat16, (32, 8)))
    assert rotary_heads(feed, _chain(4, 8, 8)) == (4, 8)
    near = [(("view", (4, 4, 2, 8), ()), ("transpose", (0, 1), ()), ("reshape", (32, 8), ())),
            (("view", (4, 2, 4, 8), ()), ("transpose", (1, 2), ()), ("reshape", (32, 8), ())),
            (("view", (4, 4, 2, 8), ()), ("transpose", (1, 2), ()), ("reshape", (8, 32), ())),
            (("view", (4, 8, 2, 4), ()), ("transpose", (1, 2), ()), ("reshape", (32, 8), ())),
            (("reshape", (4, 4, 2, 8), ()), ("transpose", (1, 2), ()), ("reshape", (32, 8), ()))]
    assert [rotary_heads(feed, ops) for ops in near] == [None] * len(near)
    part = Feed("q_proj.weight", feed.wire, (16, 8), (16, 0), (0, 1))   # half of the tensor
    assert rotary_heads(part, _chain(2, 8, 8)) is None


def test_rows_of_a_box_land_in_order_and_merge_only_across_heads():
    """Two heads of hd 4, rows 0..7 of the reordered tensor into region rows 10..17:
    wire rows 0, 2, 1, 3, 4, 6, 5, 7; only 3 -> 4 stays adjacent on both sides."""
    copy = TracedCopy("q", "qkv", ((0, 8), (0, 5)), ((10, 18), (0, 5)))
    rows = rotary_rows(copy, 2, 4)
    assert [(c.box[0], c.region[0]) for c in rows] == [
        ((w, w + 1), (10 + r, 11 + r)) for r, w in enumerate((0, 2, 1, 3, 4, 6, 5, 7))]
    assert all(c.box[1] == (0, 5) and c.region[1] == (0, 5) for c in rows)
    assert len(merge_copies(rows)) == 7
