"""The manifest vocabulary: placements, layouts, parameter metadata, sources.

Knows no model family and moves no bytes (DESIGN.md, "Folders").
"""

from .destination import Binding, DestinationLayout, DestinationParam
from .layout import (
    Box,
    M2NEncoding,
    SourceLayout,
    SourcePieces,
    box_intersect,
    box_volume,
    chunk_bounds,
    full_box,
    local_box,
    m2n_encoding,
    rank_boxes,
    region_is_contiguous,
    source_pieces,
)
from .meta import ParamMeta
from .placement import Placement, Replicate, Shard
