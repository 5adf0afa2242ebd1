"""Layout math against independent references: torch.chunk, slicing, brute force."""

from __future__ import annotations

import math
from itertools import product

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from m2nkit.engine.transports.nccl_m2n_rules import M2NEncoding, m2n_encoding, region_is_contiguous
from m2nkit.manifest import (
    ParamMeta,
    Replicate,
    Shard,
    SourceLayout,
    box_intersect,
    box_volume,
    chunk_bounds,
    full_box,
    local_box,
    piece_grid,
    rank_boxes,
)


def source_pieces(layout, shape):
    """The cell grid of a placement layout's pieces, holders as ranks."""
    grid = piece_grid(layout.pieces(shape), tuple(shape))
    return type(grid)(grid.shape, grid.pieces, grid.intervals, {
        cell: tuple(grid.pieces[k].rank for k in held) for cell, held in grid.holders.items()})

FAST = settings(max_examples=150, deadline=None)


def _slices(box):
    return tuple(slice(a, b) for a, b in box)


def _coords(mesh_shape):
    return list(product(*(range(m) for m in mesh_shape)))


# --------------------------------------------------------------------------
# chunk_bounds / local_box


@pytest.mark.parametrize("n", range(0, 20))
@pytest.mark.parametrize("k", range(1, 9))
def test_chunk_bounds_matches_torch_chunk(n, k):
    chunks = torch.arange(n).chunk(k) if n else ()
    for i in range(k):
        expected = chunks[i].tolist() if i < len(chunks) else []
        start, stop = chunk_bounds(n, k, i)
        assert 0 <= start <= stop <= n
        assert list(range(start, stop)) == expected, (n, k, i)


def test_chunk_bounds_known_values():
    # 10 over 4: chunk size ceil(10/4)=3 -> 3,3,3,1
    assert [chunk_bounds(10, 4, i) for i in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    # 5 over 4: size 2 -> 2,2,1,0 (trailing rank empty)
    assert [chunk_bounds(5, 4, i) for i in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]


def _chunk_reference(full, mesh_shape, placements, coord):
    """Apply torch.chunk axis by axis, outer axis first (the DTensor rule)."""
    t = full
    for axis, p in enumerate(placements or ()):
        if isinstance(p, Shard):
            pieces = t.chunk(mesh_shape[axis], dim=p.dim) if t.shape[p.dim] else ()
            if coord[axis] < len(pieces):
                t = pieces[coord[axis]]
            else:
                shape = list(t.shape)
                shape[p.dim] = 0
                t = t.new_empty(shape)
    return t


CASES = [
    ((10,), (4,), (Shard(0),)),
    ((7, 3), (2, 2), (Shard(0), Shard(0))),
    ((7, 5), (2, 3), (Shard(0), Shard(1))),
    ((5, 9), (3, 2), (Shard(1), Shard(1))),
    ((3, 5), (2, 3), (Shard(0), Shard(0))),
    ((6, 4, 5), (2, 2), (Replicate(), Shard(2))),
    ((6, 4, 5), (2, 3), (Shard(2), Replicate())),
    ((2, 4, 9), (2, 2, 2), (Shard(0), Shard(2), Shard(2))),
    ((4, 4), (2, 2), None),
]


@pytest.mark.parametrize("shape,mesh_shape,placements", CASES)
def test_local_box_matches_chunking(shape, mesh_shape, placements):
    full = torch.arange(math.prod(shape)).reshape(shape)
    for coord in _coords(mesh_shape):
        box = local_box(shape, mesh_shape, placements, coord)
        ref = _chunk_reference(full, mesh_shape, placements, coord)
        got = full[_slices(box)]
        assert got.shape == ref.shape, (coord, box)
        assert torch.equal(got, ref), (coord, box)


def test_local_box_two_axes_one_dim_outer_first():
    # 8 rows over mesh (2, 2) both sharding dim 0: outer axis takes halves,
    # inner axis halves each half -> coord (0,1) holds rows 2..3, not 4..5.
    assert local_box((8,), (2, 2), (Shard(0), Shard(0)), (0, 1)) == ((2, 4),)
    assert local_box((8,), (2, 2), (Shard(0), Shard(0)), (1, 0)) == ((4, 6),)


def test_rank_boxes_follow_owner_order_row_major():
    lay = SourceLayout((5, 3, 9, 1), (2, 2), (Shard(0), Shard(1)))
    boxes = rank_boxes(lay, (4, 6))
    assert [r for r, _ in boxes] == [5, 3, 9, 1]
    assert boxes[1][1] == ((0, 2), (3, 6))  # owner 3 is coord (0, 1)
    assert boxes[2][1] == ((2, 4), (0, 3))  # owner 9 is coord (1, 0)


def test_box_helpers():
    assert full_box((3, 4)) == ((0, 3), (0, 4))
    assert box_volume(((0, 3), (1, 4))) == 9
    assert box_volume(((2, 2), (0, 4))) == 0
    assert box_intersect(((0, 4), (0, 4)), ((2, 6), (3, 9))) == ((2, 4), (3, 4))
    assert box_intersect(((0, 2),), ((2, 4),)) is None


# --------------------------------------------------------------------------
# random layouts: tiling and pieces


@st.composite
def layouts(draw, max_ndim=3):
    ndim = draw(st.integers(1, max_ndim))
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=ndim, max_size=ndim)))
    mesh_shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    placements = tuple(
        draw(st.one_of(st.just(Replicate()), st.builds(Shard, st.integers(0, ndim - 1))))
        for _ in mesh_shape
    )
    n = math.prod(mesh_shape)
    offset = draw(st.integers(0, 3))
    owners = tuple(draw(st.permutations(range(offset, offset + n))))
    return shape, SourceLayout(owners, mesh_shape, placements)


def _replicas(layout):
    if layout.placements is None:
        return math.prod(layout.mesh_shape)
    return math.prod(m for m, p in zip(layout.mesh_shape, layout.placements)
                     if isinstance(p, Replicate))


@FAST
@given(layouts())
def test_owner_boxes_tile_the_tensor(case):
    shape, layout = case
    count = torch.zeros(shape, dtype=torch.int64)
    for _, box in rank_boxes(layout, shape):
        for (a, b), n in zip(box, shape):
            assert 0 <= a <= b <= n
        count[_slices(box)] += 1
    # every element is held by exactly one rank per combination of
    # replicate-axis coordinates
    assert bool((count == _replicas(layout)).all())


@FAST
@given(layouts())
def test_source_pieces_partition_once(case):
    shape, layout = case
    pieces = source_pieces(layout, shape)
    boxes = dict(rank_boxes(layout, shape))
    cover = torch.zeros(shape, dtype=torch.int64)
    for key, holders in pieces.holders.items():
        pbox = tuple(pieces.intervals[d][i] for d, i in enumerate(key))
        assert box_volume(pbox) > 0
        cover[_slices(pbox)] += 1
        # holders are exactly the owners whose box contains the piece, in owner order
        containing = tuple(r for r in layout.owners
                           if box_intersect(boxes[r], pbox) == pbox)
        assert holders == containing
        assert len(holders) == _replicas(layout)
    assert bool((cover == 1).all())


@st.composite
def layouts_and_query(draw):
    shape, layout = draw(layouts())
    box = []
    for n in shape:
        a = draw(st.integers(0, n))
        b = draw(st.integers(a, n))
        box.append((a, b))
    return shape, layout, tuple(box)


@FAST
@given(layouts_and_query())
def test_overlapping_matches_brute_force(case):
    shape, layout, query = case
    pieces = source_pieces(layout, shape)
    holders_of = {}  # element index -> owners holding it (owner order)
    boxes = rank_boxes(layout, shape)
    for idx in product(*(range(a, b) for a, b in query)):
        held = tuple(r for r, box in boxes
                     if all(a <= i < b for i, (a, b) in zip(idx, box)))
        if held:
            holders_of[idx] = held
    seen = {}
    for pbox, ranks in pieces.overlapping(query):
        assert box_volume(pbox) > 0
        assert box_intersect(pbox, query) == pbox
        for idx in product(*(range(a, b) for a, b in pbox)):
            assert idx not in seen, "pieces overlap"
            seen[idx] = tuple(ranks)
    assert seen == holders_of


def test_overlapping_empty_query_yields_nothing():
    pieces = source_pieces(SourceLayout((0, 1), placements=(Shard(0),)), (10, 4))
    assert list(pieces.overlapping(((5, 5), (0, 4)))) == []
    assert list(pieces.overlapping(((3, 7), (1, 1)))) == []


# --------------------------------------------------------------------------
# nccl_m2n encoding (the transport's own rules, engine/transports/nccl_m2n.py)


def _boxes(layout, shape):
    return rank_boxes(layout, shape)


def test_m2n_encoding_accepts():
    # fully replicated -> (n, 1) with (-1, 0)
    rep = SourceLayout((0, 1, 2, 3))
    assert m2n_encoding(_boxes(rep, (4, 6)), (4, 6)) == M2NEncoding((4, 1), 0, (-1, 0))
    # 1-D shard on dim 0, starting at rank 2
    lay = SourceLayout((2, 3, 4, 5), placements=(Shard(0),))
    assert m2n_encoding(_boxes(lay, (8, 4)), (8, 4)) == M2NEncoding((1, 4), 2, (-1, 0))
    # 2-D: replicate outer, shard inner on dim 1
    lay = SourceLayout((0, 1, 2, 3), (2, 2), (Replicate(), Shard(1)))
    assert m2n_encoding(_boxes(lay, (4, 8)), (4, 8)) == M2NEncoding((2, 2), 0, (-1, 1))
    # 2-D: shard outer on dim 0, replicate inner
    lay = SourceLayout(tuple(range(6)), (2, 3), (Shard(0), Replicate()))
    assert m2n_encoding(_boxes(lay, (4, 3)), (4, 3)) == M2NEncoding((2, 3), 0, (0, -1))
    # two axes on one dim, even: a 4-way split of dim 0
    lay = SourceLayout((0, 1, 2, 3), (2, 2), (Shard(0), Shard(0)))
    assert m2n_encoding(_boxes(lay, (8,)), (8,)) == M2NEncoding((1, 4), 0, (-1, 0))


@pytest.mark.parametrize("boxes,shape,reason", [
    ([], (4,), "no ranks"),
    ([(0, ((0, 2),)), (2, ((2, 4),))], (4,), "contiguous"),
    ([(0, ((0, 2),)), (0, ((2, 4),))], (4,), "two separate boxes"),
    (rank_boxes(SourceLayout((0, 1, 2, 3), placements=(Shard(0),)), (7,)), (7,), "evenly"),
    (rank_boxes(SourceLayout((0, 1, 2, 3), (2, 2), (Shard(0), Shard(1))), (4, 4)), (4, 4),
     "more than one dim"),
    ([(0, ((0, 2),)), (1, ((2, 4),)), (2, ((2, 4),)), (3, ((0, 2),))], (4,), "row-major"),
    ([(0, ((0, 2),)), (1, ((2, 4),)), (2, ((0, 2),))], (4,), "do not form a mesh"),
])
def test_m2n_encoding_rejects_with_reason(boxes, shape, reason):
    got = m2n_encoding(boxes, shape)
    assert isinstance(got, str)
    assert reason in got


# --------------------------------------------------------------------------
# contiguity


@st.composite
def shapes_and_boxes(draw):
    ndim = draw(st.integers(1, 4))
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=ndim, max_size=ndim)))
    box = []
    for n in shape:
        a = draw(st.integers(0, n))
        b = draw(st.integers(a, n))
        box.append((a, b))
    return shape, tuple(box)


def _one_run(shape, box):
    offsets = torch.arange(math.prod(shape)).reshape(shape)[_slices(box)].flatten()
    if offsets.numel() == 0:
        return True
    return bool(torch.equal(offsets, torch.arange(int(offsets[0]), int(offsets[0]) + offsets.numel())))


@settings(max_examples=400, deadline=None)
@given(shapes_and_boxes())
def test_region_is_contiguous_matches_flat_offsets(case):
    shape, box = case
    assert region_is_contiguous(shape, box) == _one_run(shape, box)


def test_region_is_contiguous_examples():
    assert region_is_contiguous((4, 6), ((1, 3), (0, 6)))        # whole rows
    assert not region_is_contiguous((4, 6), ((1, 3), (0, 3)))    # half rows
    assert region_is_contiguous((4, 6), ((2, 3), (1, 4)))        # part of one row
    assert region_is_contiguous((1, 4, 5), ((0, 1), (1, 2), (0, 5)))
    assert not region_is_contiguous((2, 1, 5), ((0, 2), (0, 1), (1, 3)))


# --------------------------------------------------------------------------
# SourceLayout / ParamMeta validation (docs/reference.md §1)


def test_layout_defaults_and_normalisation():
    lay = SourceLayout((3, 1, 2))
    assert lay.mesh_shape == (3,) and lay.placements is None
    lay = SourceLayout((0, 1, 2, 3), (2, 2), (Replicate(), Replicate()))
    assert lay.placements is None  # all-Replicate normalises to None
    lay = SourceLayout([0, 1], [2], [Shard(0)])
    assert lay.owners == (0, 1) and lay.mesh_shape == (2,) and lay.placements == (Shard(0),)
    assert SourceLayout().owners is None
    assert SourceLayout().resolve(3).owners == (0, 1, 2)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(mesh_shape=(2,)), ValueError, "need explicit owners"),
    (dict(placements=(Shard(0),)), ValueError, "need explicit owners"),
    (dict(owners=()), ValueError, "must not be empty"),
    (dict(owners=(0, 0)), ValueError, "distinct"),
    (dict(owners=(0, -1)), ValueError, ">= 0"),
    (dict(owners=(0, True)), ValueError, "ints"),
    (dict(owners=(0, 1.0)), TypeError, "ints"),
    (dict(owners=(0, "1")), TypeError, "ints"),
    (dict(owners=(0, 1), mesh_shape=(0, 2)), ValueError, "positive"),
    (dict(owners=(0, 1), mesh_shape=(-2, -1)), ValueError, "positive"),
    (dict(owners=(0, 1), mesh_shape=(True, 2)), ValueError, "ints"),
    (dict(owners=(0, 1, 2), mesh_shape=(2, 2)), ValueError, "does not cover"),
    (dict(owners=(0, 1), mesh_shape=(2,), placements=(Shard(0), Shard(0))), ValueError,
     "2 placements for a 1-D mesh"),
    (dict(owners=(0, 1), placements=("Shard(0)",)), TypeError, "not supported"),
    (dict(owners=(0, 1), placements=(None,)), TypeError, "not supported"),
])
def test_layout_rules(kwargs, exc, match):
    with pytest.raises(exc, match=match) as info:
        SourceLayout(**kwargs, where="parameter 'w'")
    assert "parameter 'w'" in str(info.value)
    # the same rule through ParamMeta names the parameter
    with pytest.raises(exc, match=match) as info:
        ParamMeta("w", torch.float32, (4, 4), **kwargs)
    assert "'w'" in str(info.value)


def test_layout_equality_ignores_the_message_label():
    a = SourceLayout((0, 1), placements=(Shard(0),), where="parameter 'a'")
    b = SourceLayout((0, 1), (2,), (Shard(0),))
    assert a == b and hash(a) == hash(b)
    assert a != SourceLayout((1, 0), placements=(Shard(0),))


def test_layout_rejects_torch_placement_objects():
    from torch.distributed.tensor import Shard as TShard

    with pytest.raises(TypeError, match="not supported"):
        SourceLayout((0, 1), placements=(TShard(0),))


def test_layout_resolve_rejects_owner_outside_ranks():
    with pytest.raises(ValueError, match=r"owners \[4\] are not trainer ranks"):
        SourceLayout((0, 4)).resolve(4)


def test_shard_and_replicate_values():
    assert Shard(1) == Shard(1) and Shard(1) != Shard(0)
    assert Replicate() == Replicate()
    with pytest.raises(TypeError, match="int"):
        Shard(True)
    with pytest.raises(TypeError, match="int"):
        Shard(1.0)
    with pytest.raises(ValueError, match=">= 0"):
        Shard(-1)


def test_param_meta_normalises():
    m = ParamMeta("w", torch.bfloat16, [4, 6], owners=[2, 3])
    assert m.shape == (4, 6) and m.owners == (2, 3) and m.mesh_shape == (2,)
    assert m.placements is None
    assert m.nbytes == 4 * 6 * 2
    assert m.layout == SourceLayout((2, 3), (2,), None, where="parameter 'w'")
    assert ParamMeta("s", torch.float32, ()).shape == ()


@pytest.mark.parametrize("args,kwargs,exc,match", [
    (("", torch.float32, (2,)), {}, ValueError, "non-empty"),
    ((None, torch.float32, (2,)), {}, ValueError, "non-empty"),
    (("w", "float32", (2,)), {}, TypeError, "not a torch.dtype"),
    (("w", torch.float32, (2, -1)), {}, ValueError, "non-negative"),
    (("w", torch.float32, (2, True)), {}, ValueError, "non-negative"),
    (("w", torch.float32, (2.0,)), {}, ValueError, "non-negative"),
    (("w", torch.float32, (4, 4)), dict(owners=(0, 1), placements=(Shard(2),)), ValueError,
     r"Shard\(2\) is outside its 2-D shape"),
    (("w", torch.float32, ()), dict(owners=(0, 1), placements=(Shard(0),)), ValueError,
     "outside its 0-D shape"),
])
def test_param_meta_rules(args, kwargs, exc, match):
    with pytest.raises(exc, match=match) as info:
        ParamMeta(*args, **kwargs)
    if args[0]:
        assert "'w'" in str(info.value)


def test_a_destination_layout_travels_as_json_and_comes_back_equal():
    """The init payload of a traced layout (``InitPayload.destination``): every param,
    binding, zero box, skip, alias and note survives JSON; malformed data is refused."""
    import json

    from m2nkit.manifest.destination import (Binding, DestinationLayout, DestinationParam,
                                             layout_from_json, layout_to_json)

    layout = DestinationLayout(
        "vllm:tp=2,dp=1", 2,
        (DestinationParam(0, "embed", torch.bfloat16, (5, 4), (((3, 5), (0, 4)),)),
         DestinationParam(1, "embed", torch.bfloat16, (5, 4), (((0, 5), (0, 4)),)),
         DestinationParam(0, "bias", torch.float32, (3,))),
        {"w": (Binding("w", 0, ((0, 3), (0, 4)), "embed", (0, 0)),),
         "b": (Binding("b", 0, ((0, 3),), "bias", (0,)), Binding("b", 1, ((1, 2),), "bias", (2,)))},
        skipped={"lm_head.weight": "tied"}, aliases={"head": "embed"},
        unknown={"x": "no rule"}, notes=("traced",))
    back = layout_from_json(json.loads(json.dumps(layout_to_json(layout))))
    assert back == layout
    assert back.params[2].dtype is torch.float32
    data = layout_to_json(layout)
    data["bindings"]["w"][0][1] = [[3, 0], [0, 4]]             # lo > hi
    with pytest.raises(ValueError, match=r"binding of 'w': \[\[3, 0\], \[0, 4\]\] is not a box"):
        layout_from_json(data)
    data = layout_to_json(layout)
    del data["param_names"]
    with pytest.raises(ValueError, match="destination layout data is malformed"):
        layout_from_json(data)
