"""``trace._uncovered``: the elements of a parameter no traced copy wrote (its zero boxes).

Hand-computed cases; vLLM is not needed (the dumps tests in
tests/integration/test_vllm_trace.py hold the same rule against vLLM's own loaders).
"""

from m2nkit.adapters.vllm.trace import _uncovered


def test_a_parameter_tiled_by_disjoint_copies_has_no_zero_boxes():
    # fused q_a/kv_a rows: two wire tensors, one after the other
    assert _uncovered((6, 4), [((0, 4), (0, 4)), ((4, 6), (0, 4))]) == ()
    assert _uncovered((6, 4), [((0, 6), (0, 4))]) == ()


def test_overlapping_copies_of_the_full_size_still_leave_their_gap():
    # rows 0-2 and 1-3 add up to 4 rows of 4 but leave row 3 unwritten
    assert _uncovered((4, 2), [((0, 2), (0, 2)), ((1, 3), (0, 2))]) == (((3, 4), (0, 2)),)


def test_vocab_padding_rows_past_the_last_copy_are_zero_boxes():
    assert _uncovered((8, 3), [((0, 5), (0, 3))]) == (((5, 8), (0, 3)),)
    assert _uncovered((8, 3), []) == (((0, 8), (0, 3)),)
