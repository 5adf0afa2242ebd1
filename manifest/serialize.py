"""Manifest JSON and its digest: the one thing every rank must agree on.

Before any byte moves, every trainer rank and every receiver compares the
manifest digest; a mismatch (a different model, a different layout, a
different *order*, which is the send order) is an error on every rank rather
than a hang or silently shifted names (docs/reference.md §7). The digest is the
sha256 of a canonical JSON text, as in vLLM's nccl_m2n init payload
(``m2n_common.py``: sha256 of the canonical parameter list).

Format (``schema_version`` 2; version 1, which had no ``pieces``, is still read)::

    {"schema_version": 2,
     "num_trainer_ranks": T,
     "params": [{"name": str,
                 "dtype": "bfloat16",            # torch dtype name, no "torch."
                 "shape": [int, ...],            # global shape
                 "owners": [int, ...] | null,    # null: every trainer rank
                 "mesh_shape": [int, ...] | null,
                 "placements": [{"shard": d} | {"replicate": true}, ...] | null}
              | {"name": ..., "dtype": ..., "shape": ...,       # explicit pieces
                 "pieces": [[rank, [[start, stop], ...], [local_start, ...]], ...]},
                ...]}

``params`` is in send order. The canonical text is ``json.dumps`` with
sorted keys and no whitespace; values are normalised as ``ParamMeta`` does
(``mesh_shape`` filled in, all-``Replicate`` placements become ``null``), so
two equal manifests always have the same digest.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .meta import ParamMeta
from .pieces import Piece
from .placement import Replicate, Shard

__all__ = [
    "SCHEMA_VERSION",
    "manifest_to_json",
    "manifest_from_json",
    "manifest_digest",
    "canonical_json",
    "dtype_name",
    "dtype_from_name",
]

SCHEMA_VERSION = 2
_READABLE_VERSIONS = (1, 2)

_PARAM_KEYS = {"name", "dtype", "shape", "owners", "mesh_shape", "placements", "pieces"}
_REQUIRED_KEYS = {"name", "dtype", "shape"}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``.

    Raises:
        ValueError: ``name`` is not a torch dtype name.
    """
    dt = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype name (e.g. 'bfloat16', 'float32')")
    return dt


def _check_num_ranks(num_trainer_ranks: object) -> int:
    if isinstance(num_trainer_ranks, bool) or not isinstance(num_trainer_ranks, int):
        raise TypeError(f"num_trainer_ranks must be an int, got {num_trainer_ranks!r}")
    if num_trainer_ranks < 1:
        raise ValueError(f"num_trainer_ranks must be >= 1, got {num_trainer_ranks}")
    return num_trainer_ranks


def _check_owners_in_range(meta: ParamMeta, num_trainer_ranks: int) -> None:
    meta.source_pieces(num_trainer_ranks)


def manifest_to_json(metas: Sequence[ParamMeta], num_trainer_ranks: int) -> dict:
    """The manifest as a JSON-ready dict (format in the module docstring).

    Args:
        metas: every wire tensor, in send order.
        num_trainer_ranks: ``T``; every owner must be below it.

    Raises:
        TypeError: an item is not a ``ParamMeta``; ``num_trainer_ranks`` is
            not an int.
        ValueError: two items share a name; an owner is not below ``T``;
            ``T < 1``.
    """
    t = _check_num_ranks(num_trainer_ranks)
    params = []
    seen: set[str] = set()
    for i, m in enumerate(metas):
        if not isinstance(m, ParamMeta):
            raise TypeError(f"manifest entry {i} must be a ParamMeta, got {type(m).__name__}")
        if m.name in seen:
            raise ValueError(f"parameter '{m.name}' appears more than once in the manifest")
        seen.add(m.name)
        _check_owners_in_range(m, t)
        params.append({
            "name": m.name,
            "dtype": dtype_name(m.dtype),
            "shape": list(m.shape),
            **m.layout.to_json(),
        })
    return {"schema_version": SCHEMA_VERSION, "num_trainer_ranks": t, "params": params}


def _placement_from_json(p: Any, where: str):
    if isinstance(p, Mapping) and set(p) == {"shard"}:
        return Shard(p["shard"])
    if isinstance(p, Mapping) and set(p) == {"replicate"} and p["replicate"] is True:
        return Replicate()
    raise ValueError(f"{where}: placement {p!r} must be {{'shard': dim}} or {{'replicate': true}}")


def _int_list(value: Any, what: str, where: str) -> tuple | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise ValueError(f"{where}: {what} must be a list or null, got {value!r}")
    return tuple(value)


def _piece_from_json(p: Any, where: str) -> Piece:
    if not (isinstance(p, list) and len(p) == 3 and isinstance(p[1], list)
            and isinstance(p[2], list)):
        raise ValueError(f"{where}: piece {p!r} must be [rank, [[start, stop], ...], "
                         "[local_start, ...]]")
    return Piece(p[0], tuple(tuple(iv) if isinstance(iv, list) else iv for iv in p[1]),
                 tuple(p[2]))


def _param_from_json(i: int, entry: Any, num_trainer_ranks: int) -> ParamMeta:
    where = f"manifest entry {i}"
    if not isinstance(entry, Mapping):
        raise ValueError(f"{where} must be an object, got {type(entry).__name__}")
    if isinstance(entry.get("name"), str):
        where = f"manifest entry {i} ('{entry['name']}')"
    missing = _REQUIRED_KEYS - set(entry)
    unknown = set(entry) - _PARAM_KEYS
    if missing or unknown:
        raise ValueError(
            f"{where}: missing keys {sorted(missing)}, unknown keys {sorted(unknown)}; "
            f"expected {sorted(_PARAM_KEYS)}"
        )
    try:
        dtype = dtype_from_name(entry["dtype"])
        shape = _int_list(entry["shape"], "shape", where)
        if shape is None:
            raise ValueError(f"{where}: shape must be a list, got null")
        pieces = entry.get("pieces")
        if pieces is not None:
            if not isinstance(pieces, list) or any(k in entry for k in ("owners", "mesh_shape",
                                                                        "placements")):
                raise ValueError(f"{where}: pieces must be a list, without owners/mesh_shape/"
                                 "placements")
            meta = ParamMeta(entry["name"], dtype, shape, pieces=tuple(
                _piece_from_json(p, where) for p in pieces))
            _check_owners_in_range(meta, num_trainer_ranks)
            return meta
        placements = entry.get("placements")
        if placements is not None:
            if not isinstance(placements, list):
                raise ValueError(f"{where}: placements must be a list or null")
            placements = tuple(_placement_from_json(p, where) for p in placements)
        meta = ParamMeta(
            entry["name"], dtype, shape,
            _int_list(entry.get("owners"), "owners", where),
            _int_list(entry.get("mesh_shape"), "mesh_shape", where),
            placements,
        )
        _check_owners_in_range(meta, num_trainer_ranks)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None
    return meta


def manifest_from_json(doc: Mapping) -> tuple[list[ParamMeta], int]:
    """Parse ``manifest_to_json`` output back into ``(metas, num_trainer_ranks)``.

    Every entry is validated as ``ParamMeta`` validates, and its owners must
    be below ``num_trainer_ranks``.

    Raises:
        ValueError: not an object; ``schema_version`` other than 1; a bad
            ``num_trainer_ranks`` or ``params``; a malformed entry (naming its
            index and name); a repeated name.
    """
    if not isinstance(doc, Mapping):
        raise ValueError(f"manifest must be a JSON object, got {type(doc).__name__}")
    version = doc.get("schema_version")
    if isinstance(version, bool) or version not in _READABLE_VERSIONS:
        raise ValueError(
            f"manifest schema_version {version!r} is not supported; this m2nkit reads "
            f"schema_version {' or '.join(map(str, _READABLE_VERSIONS))}"
        )
    try:
        t = _check_num_ranks(doc.get("num_trainer_ranks"))
    except (TypeError, ValueError) as e:
        raise ValueError(f"manifest: {e}") from None
    params = doc.get("params")
    if not isinstance(params, list):
        raise ValueError(f"manifest: params must be a list, got {type(params).__name__}")
    metas = []
    seen: set[str] = set()
    for i, entry in enumerate(params):
        meta = _param_from_json(i, entry, t)
        if meta.name in seen:
            raise ValueError(
                f"manifest entry {i} ('{meta.name}'): the name appears more than once"
            )
        seen.add(meta.name)
        metas.append(meta)
    return metas, t


def canonical_json(doc: Any) -> str:
    """``json.dumps`` with sorted keys and no whitespace (the digested text)."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False)


def manifest_digest(metas: Sequence[ParamMeta], num_trainer_ranks: int) -> str:
    """sha256 hex digest (64 chars) of the canonical manifest JSON.

    Changes when any name, dtype, shape, owner, mesh, placement, the entry
    order or ``num_trainer_ranks`` changes. Errors as ``manifest_to_json``.
    """
    text = canonical_json(manifest_to_json(metas, num_trainer_ranks))
    return hashlib.sha256(text.encode("ascii")).hexdigest()
