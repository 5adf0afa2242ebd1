"""The manifest vocabulary: placements, pieces, layouts, parameter metadata, sources.

Knows no model family and no transport, and moves no bytes (docs/architecture.md).
"""

# Names load on first use (m2nkit._lazy): light modules of this package
# import without torch.
from m2nkit._lazy import lazy_attributes

_LAZY = {
    "Binding": (".destination", "Binding"),
    "DestinationLayout": (".destination", "DestinationLayout"),
    "DestinationParam": (".destination", "DestinationParam"),
    "layerwise_groups": (".groups", "layerwise_groups"),
    "stack_key": (".groups", "stack_key"),
    "SourceLayout": (".layout", "SourceLayout"),
    "chunk_bounds": (".layout", "chunk_bounds"),
    "local_box": (".layout", "local_box"),
    "rank_boxes": (".layout", "rank_boxes"),
    "Box": (".pieces", "Box"),
    "Piece": (".pieces", "Piece"),
    "PieceGrid": (".pieces", "PieceGrid"),
    "PieceLayout": (".pieces", "PieceLayout"),
    "box_intersect": (".pieces", "box_intersect"),
    "box_shape": (".pieces", "box_shape"),
    "box_slices": (".pieces", "box_slices"),
    "box_volume": (".pieces", "box_volume"),
    "full_box": (".pieces", "full_box"),
    "piece_grid": (".pieces", "piece_grid"),
    "REPLICATE": (".m2n_layout", "REPLICATE"),
    "REPLICATED": (".m2n_layout", "REPLICATED"),
    "M2NLayout": (".m2n_layout", "M2NLayout"),
    "M2NMesh": (".m2n_layout", "M2NMesh"),
    "layout_from_m2n": (".m2n_layout", "layout_from_m2n"),
    "ParamMeta": (".meta", "ParamMeta"),
    "Placement": (".placement", "Placement"),
    "Replicate": (".placement", "Replicate"),
    "Shard": (".placement", "Shard"),
    "TrainerInitInfo": (".protocol", "TrainerInitInfo"),
    "TrainerWeightTransferEngine": (".protocol", "TrainerWeightTransferEngine"),
    "VLLMWeightSyncClient": (".protocol", "VLLMWeightSyncClient"),
    "WeightTransferEngine": (".protocol", "WeightTransferEngine"),
    "WeightTransferInitInfo": (".protocol", "WeightTransferInitInfo"),
    "WeightTransferInitRequest": (".protocol", "WeightTransferInitRequest"),
    "WeightTransferUpdateInfo": (".protocol", "WeightTransferUpdateInfo"),
    "WeightTransferUpdatePayload": (".protocol", "WeightTransferUpdatePayload"),
    "WeightTransferUpdateRequest": (".protocol", "WeightTransferUpdateRequest"),
    "SCHEMA_VERSION": (".serialize", "SCHEMA_VERSION"),
    "canonical_json": (".serialize", "canonical_json"),
    "dtype_from_name": (".serialize", "dtype_from_name"),
    "dtype_name": (".serialize", "dtype_name"),
    "manifest_digest": (".serialize", "manifest_digest"),
    "manifest_from_json": (".serialize", "manifest_from_json"),
    "manifest_to_json": (".serialize", "manifest_to_json"),
    "DTensorModuleSource": (".source", "DTensorModuleSource"),
    "M2NManifestEntry": (".source", "M2NManifestEntry"),
    "M2NWeightSource": (".source", "M2NWeightSource"),
    "ManifestM2NWeightSource": (".source", "ManifestM2NWeightSource"),
    "ModuleSource": (".source", "ModuleSource"),
    "WeightSource": (".source", "WeightSource"),
    "layout_from_dtensor": (".source", "layout_from_dtensor"),
    "materialize_full_tensor": (".source", "materialize_full_tensor"),
    "mesh_from_tensor": (".source", "mesh_from_tensor"),
    "owner_box": (".source", "owner_box"),
    "placements_from_tensor": (".source", "placements_from_tensor"),
}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())
