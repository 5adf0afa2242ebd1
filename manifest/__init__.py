"""The manifest vocabulary: placements, pieces, layouts, parameter metadata, sources.

Knows no model family and no transport, and moves no bytes (DESIGN.md, "Folders").
"""

from .destination import Binding, DestinationLayout, DestinationParam
from .groups import layerwise_groups, stack_key
from .layout import SourceLayout, chunk_bounds, local_box, rank_boxes
from .pieces import (
    Box,
    Piece,
    PieceGrid,
    PieceLayout,
    box_intersect,
    box_shape,
    box_slices,
    box_volume,
    full_box,
    piece_grid,
)
from .meta import ParamMeta
from .placement import Placement, Replicate, Shard
from .protocol import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferInitRequest,
    WeightTransferUpdateInfo,
    WeightTransferUpdatePayload,
    WeightTransferUpdateRequest,
)
from .serialize import (
    SCHEMA_VERSION,
    canonical_json,
    dtype_from_name,
    dtype_name,
    manifest_digest,
    manifest_from_json,
    manifest_to_json,
)
from .source import (
    DTensorModuleSource,
    M2NManifestEntry,
    M2NWeightSource,
    ManifestM2NWeightSource,
    ModuleSource,
    WeightSource,
    layout_from_dtensor,
    materialize_full_tensor,
    mesh_from_tensor,
    owner_box,
    placements_from_tensor,
)
