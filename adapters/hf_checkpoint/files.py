"""safetensors I/O: a checkpoint directory's files, their headers, and boxes read from them.

The layout on disk (Hugging Face's): ``model.safetensors``, or
``model.safetensors.index.json`` (``{"weight_map": {tensor: shard file}}``)
and its shards, beside ``config.json``; a bare ``config.json`` is a
config-only checkpoint. Headers are read with safetensors' lazy API
(``safe_open(...).keys()``, ``get_slice(name).get_shape()``/``get_dtype()``),
never tensor data; :class:`Permuted` says which on-disk box holds a box of a
wire tensor the family stores in another dim order. Every defect (missing
file, corrupt header, index and shards disagreeing, a dtype m2nkit does not
carry) is a :class:`~.errors.CheckpointError` naming the file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from m2nkit.manifest.layout import Box

from .errors import CheckpointError

__all__ = ["SINGLE_FILE", "INDEX_FILE", "CONFIG_FILE", "SAFETENSORS_DTYPES", "Header", "Permuted",
           "open_safetensors", "read_headers", "sharded_headers", "resolve_path"]


SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"

#: safetensors dtype strings m2nkit carries, and their torch dtypes. The
#: dtypes model weights use that both transports and ``nccl.m2n`` move
#: (docs/reference.md §2). Not carried: ``F64`` and ``BOOL`` (no model weight
#: needs them), ``I16``/``U16``/``U32``/``U64`` (partial torch support,
#: not in nccl.m2n's list).
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I8": torch.int8,
    "U8": torch.uint8,
    "I32": torch.int32,
    "I64": torch.int64,
}


@dataclass(frozen=True)
class Header:
    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class Permuted:
    """A wire tensor that is on-disk tensor ``disk`` with its dims permuted.

    Wire dim ``i`` is on-disk dim ``order[i]`` (``wire = disk.permute(order)``,
    ``HFNaming.permuted``). A box of the wire tensor is read as the permuted
    box of the on-disk tensor, then permuted: only the box is read.
    """

    disk: str
    order: tuple[int, ...]

    def disk_box(self, box: Box) -> tuple[slice, ...]:
        """The slices of the on-disk tensor holding wire ``box``."""
        index: list[slice] = [slice(0, 0)] * len(self.order)
        for i, d in enumerate(self.order):
            index[d] = slice(*box[i])
        return tuple(index)


def open_safetensors(file: Path):
    """``safe_open`` with safetensors' header errors turned into ``CheckpointError``."""
    try:
        return safe_open(str(file), framework="pt")
    except Exception as e:  # safetensors raises SafetensorError / OSError
        raise CheckpointError(
            f"cannot read safetensors file {file}: {e} (truncated or not a "
            "safetensors file?)"
        ) from e


def read_headers(file: Path, handles: dict[Path, Any]) -> dict[str, Header]:
    """The headers of one safetensors file: name -> file, shape, dtype.

    The open handle is kept in ``handles`` for later reads.

    Raises:
        CheckpointError: an unreadable header or a dtype outside :data:`SAFETENSORS_DTYPES`.
    """
    h = handles[file] = open_safetensors(file)
    out = {}
    try:
        keys = list(h.keys())
        for name in keys:
            sl = h.get_slice(name)
            code = sl.get_dtype()
            dtype = SAFETENSORS_DTYPES.get(code)
            if dtype is None:
                raise CheckpointError(
                    f"tensor '{name}' in {file} has dtype {code}, which m2nkit does not "
                    f"carry; supported dtypes: {', '.join(SAFETENSORS_DTYPES)}"
                )
            out[name] = Header(file, tuple(int(n) for n in sl.get_shape()), dtype)
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"cannot read the header of {file}: {e}") from e
    return out


def _read_index(root: Path) -> dict[str, str]:
    index = root / INDEX_FILE
    try:
        data = json.loads(index.read_text())
        weight_map = data["weight_map"]
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise ValueError("weight_map must map tensor names to file names")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"cannot read {index}: {type(e).__name__}: {e} (expected JSON with "
            "'weight_map': {tensor name: shard file})"
        ) from e
    return weight_map


def sharded_headers(root: Path, handles: dict[Path, Any]) -> dict[str, Header]:
    """The headers of every shard the index names, checked against the index.

    Raises:
        CheckpointError: an unreadable index, a missing shard, or index and shards disagreeing.
    """
    weight_map = _read_index(root)
    by_file: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        by_file.setdefault(file, []).append(name)
    headers: dict[str, Header] = {}
    for file in sorted(by_file):
        path = root / file
        if not path.is_file():
            names = by_file[file]
            raise CheckpointError(
                f"{root / INDEX_FILE} names shard '{file}' (for tensor '{names[0]}'"
                f"{f' and {len(names) - 1} more' if len(names) > 1 else ''}), but "
                f"{path} does not exist (for a config-only plan pass "
                f"{root / CONFIG_FILE} instead)"
            )
        found = read_headers(path, handles)
        listed = set(by_file[file])
        for name in by_file[file]:
            if name not in found:
                raise CheckpointError(
                    f"{root / INDEX_FILE} lists tensor '{name}' in shard '{file}', but "
                    f"{path} does not contain it ({len(found)} tensors there)"
                )
        for name in found:
            if name not in listed:
                raise CheckpointError(
                    f"shard {path} holds tensor '{name}' that {INDEX_FILE} maps to "
                    f"{weight_map.get(name, 'no file')!r}; the index and the shards disagree"
                )
        headers.update(found)
    return headers


def resolve_path(path: Path) -> tuple[Path, Path, str]:
    """``(root, config path, kind)`` with kind in ``single``, ``sharded``, ``config``."""
    if not path.exists():
        raise CheckpointError(f"checkpoint path {path} does not exist")
    if path.is_file():
        if path.suffix == ".json" and path.name != INDEX_FILE:
            return path.parent, path, "config"
        raise CheckpointError(
            f"{path} is a file; pass a checkpoint directory ({SINGLE_FILE} or "
            f"{INDEX_FILE} + shards, with {CONFIG_FILE}) or a {CONFIG_FILE} file"
        )
    config = path / CONFIG_FILE
    if (path / INDEX_FILE).is_file():
        return path, config, "sharded"
    if (path / SINGLE_FILE).is_file():
        return path, config, "single"
    if config.is_file():
        return path, config, "config"
    found = sorted(p.name for p in path.iterdir())
    raise CheckpointError(
        f"{path} holds no {SINGLE_FILE}, {INDEX_FILE} or {CONFIG_FILE} "
        f"(found: {found[:10] or 'nothing'})"
    )
