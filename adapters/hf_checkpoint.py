"""Hugging Face safetensors checkpoints as wire tensors, read box by box.

A checkpoint (or just its ``config.json``) becomes an ordered list of wire
tensors (DESIGN.md, "Wire tensor"): the on-disk names, except that MoE
experts stored one tensor per expert are re-fused into the stacked
``<prefix>.experts.gate_up_proj.weight [E, 2*Im, H]`` and
``<prefix>.experts.down_proj.weight [E, H, Im]`` that vLLM's routed-experts
contract takes, and that a tensor a family stores in another dim order than
the wire's (``HFNaming.permuted``) travels permuted, read box by box from the
permuted box on disk.

Planning reads **headers only**: names, dtypes and shapes come from the
safetensors headers (``safe_open(...).keys()``, ``get_slice(name).get_shape()``)
and are checked against the tensors the config says the model has; no tensor
data is read. Data is read later, one box at a time
(:meth:`Checkpoint.read_box`), through ``get_slice(name)[slices]``, so a
trainer rank reads only the rows it would hold and never the whole file.

What the config expects comes from transformers itself: the model is built
on the meta device (``AutoModelForCausalLM.from_config``) and its
``named_parameters()`` are taken, in order; that order is the wire order, so
every rank builds the same manifest. transformers 5 keeps experts fused in
memory but writes them per expert on disk, and names a few blocks
differently in memory than on disk; each family's module in
``m2nkit.adapters.families`` holds that naming as data (``HF_NAMES``, an
``HFNaming``), and this module holds none. An architecture without a family
is refused with the registry's one message.

A config-only checkpoint (a bare ``config.json``, what ``m2nkit plan`` takes
for a model nobody has downloaded) skips transformers altogether: the family
table lists the same wire tensors in the same order
(``m2nkit.adapters.config_wires``), which for Kimi-K2 takes a tenth of a
second instead of several, most of them importing transformers' modeling
code. The meta model stays the reference (``via_transformers=True``), and
the fallback for a config the table does not describe exactly.

Every defect a user can hit (missing or corrupt files, wrong shapes,
unsupported dtypes, incomplete expert sets) raises :class:`CheckpointError`
naming the file, the tensor, the value and what was expected.
"""

from __future__ import annotations

import functools
import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from safetensors import safe_open

from m2nkit.manifest.layout import Box
from m2nkit.manifest.meta import ParamMeta
from m2nkit.manifest.pieces import PieceLayout

from .experts import StackedExperts, expert_name, group_expert_tensors, stack_experts
from .families import (UnsupportedArchitecture, check_architecture, family,
                       supported_architectures)
from .families.quant import FP8, QuantizedWires, scale_name
from .families.table import HFNaming
from .module_names import wrapper_hint
from .trainer_spec import TrainerSpec, parse_trainer_spec

__all__ = [
    "CheckpointError",
    "SAFETENSORS_DTYPES",
    "Checkpoint",
    "read_checkpoint",
    "checkpoint_metas",
    "checkpoint_manifest",
    "full_checkpoint_tensors",
]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"


class CheckpointError(ValueError):
    """A checkpoint or config that m2nkit cannot turn into wire tensors."""


# --------------------------------------------------------------------------
# data: dtypes

#: safetensors dtype strings m2nkit carries, and their torch dtypes. The
#: dtypes model weights use that both transports and ``nccl.m2n`` move
#: (REFERENCE.md §2). Not carried: ``F64`` and ``BOOL`` (no model weight
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


# --------------------------------------------------------------------------
# the checkpoint


@dataclass(frozen=True)
class _Header:
    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class _Permuted:
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


class Checkpoint:
    """A checkpoint's wire tensors: metadata up front, data by box on demand.

    Built by :func:`read_checkpoint`; holds no tensor data. safetensors
    files are opened once (memory-mapped, headers parsed) and the handles
    are kept for later reads; :meth:`close` drops them.

    Attributes:
        path: the path given to ``read_checkpoint``.
        root: the checkpoint directory.
        config: the transformers config.
        architecture: ``config.architectures[0]``, a supported architecture
            (``m2nkit.adapters.families.supported_architectures()``).
        dtype: the dtype holding most wire elements (bf16 for a bf16
            checkpoint with an fp32 router).
        params: wire tensors as ``ParamMeta`` (no layout), in wire order.
        files: safetensors files, sorted; empty for a config-only checkpoint.
        has_data: False for a config-only checkpoint (metadata only).
    """

    def __init__(self, *, path: Path, root: Path, config: Any, architecture: str,
                 params: Sequence[ParamMeta],
                 sources: Mapping[str, str | StackedExperts | _Permuted],
                 headers: Mapping[str, _Header], handles: dict[Path, Any]) -> None:
        self.path = path
        self.root = root
        self.config = config
        self.architecture = architecture
        self.params: tuple[ParamMeta, ...] = tuple(params)
        self._by_name = {p.name: p for p in self.params}
        self._sources = dict(sources)
        self._headers = dict(headers)
        self._handles = handles
        self.files: tuple[Path, ...] = tuple(sorted({h.file for h in self._headers.values()}))
        self.has_data = bool(self.files)
        elements: Counter = Counter()
        for p in self.params:
            elements[p.dtype] += p.nbytes // p.dtype.itemsize
        self.dtype: torch.dtype = max(elements, key=lambda d: (elements[d], str(d))) \
            if elements else torch.float32

    # ---- metadata

    @property
    def names(self) -> list[str]:
        """Wire names in wire order."""
        return [p.name for p in self.params]

    def meta(self, name: str) -> ParamMeta:
        """The ``ParamMeta`` of wire tensor ``name``.

        Raises:
            CheckpointError: no such wire tensor.
        """
        try:
            return self._by_name[name]
        except KeyError:
            raise CheckpointError(
                f"checkpoint {self.root} has no wire tensor '{name}' "
                f"({len(self.params)} wire tensors, e.g. {self.names[:3]})"
            ) from None

    def disk_names(self, name: str) -> tuple[str, ...]:
        """The on-disk tensors wire tensor ``name`` is read from.

        One name for a plain tensor (also one stored in another dim order);
        for stacked experts every per-expert tensor, expert-major, gate
        before up.
        """
        self.meta(name)
        src = self._sources[name]
        if isinstance(src, _Permuted):
            return (src.disk,)
        return src.source_names() if isinstance(src, StackedExperts) else (src,)

    def file_of(self, disk_name: str) -> Path:
        """The safetensors file holding on-disk tensor ``disk_name``."""
        return self._headers[disk_name].file

    # ---- data

    def _handle(self, file: Path):
        h = self._handles.get(file)
        if h is None:
            h = self._handles[file] = _open(file)
        return h

    def _read_slice(self, disk_name: str, index: tuple[slice, ...]) -> torch.Tensor:
        sl = self._handle(self._headers[disk_name].file).get_slice(disk_name)
        return sl[index] if index else sl[...]

    def read_box(self, name: str, box: Box) -> torch.Tensor:
        """Read ``box`` of wire tensor ``name`` from disk, and nothing else.

        Plain tensors: ``get_slice(name)[a0:b0, a1:b1, ...]``. Stacked
        experts: for each expert in the box, only the rows of gate and/or up
        (or down) inside the box, columns inside the box
        (:meth:`StackedExperts.slices`). A tensor stored in another dim
        order (``HFNaming.permuted``): the permuted box, read and permuted
        back (a copy of the box only). An empty box returns an empty tensor
        of the box's extents.

        Args:
            name: a wire name.
            box: one ``(start, stop)`` per dim, global coordinates.

        Returns:
            A new tensor of shape ``(stop - start for each dim)`` and the wire
            dtype.

        Raises:
            CheckpointError: unknown name, a box that does not fit the shape,
                or a config-only checkpoint (no data).
        """
        meta = self.meta(name)
        box = tuple((int(a), int(b)) for a, b in box)
        if len(box) != len(meta.shape) or any(
            not 0 <= a <= b <= n for (a, b), n in zip(box, meta.shape)
        ):
            raise CheckpointError(
                f"box {list(box)} does not fit wire tensor '{name}' of shape "
                f"{list(meta.shape)} (need one (start, stop) per dim, 0 <= start <= "
                "stop <= size)"
            )
        if not self.has_data:
            raise CheckpointError(
                f"checkpoint {self.path} is config-only: it has metadata but no tensor "
                f"data to read '{name}' from"
            )
        extents = tuple(b - a for a, b in box)
        if any(e == 0 for e in extents):
            return torch.empty(extents, dtype=meta.dtype)
        src = self._sources[name]
        if isinstance(src, StackedExperts):
            return src.read_box(box, self._read_slice)
        if isinstance(src, _Permuted):
            return self._read_slice(src.disk, src.disk_box(box)).permute(src.order).contiguous()
        return self._read_slice(src, tuple(slice(a, b) for a, b in box))

    def read_full(self, name: str) -> torch.Tensor:
        """The whole wire tensor ``name`` (``read_box`` of the full box)."""
        return self.read_box(name, tuple((0, n) for n in self.meta(name).shape))

    def close(self) -> None:
        """Drop the open file handles (reads reopen them)."""
        self._handles.clear()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        kind = "config-only" if not self.has_data else f"{len(self.files)} file(s)"
        return (f"Checkpoint({str(self.root)!r}, {self.architecture}, {kind}, "
                f"{len(self.params)} wire tensors, {self.dtype})")


# --------------------------------------------------------------------------
# reading


def _open(file: Path):
    """``safe_open`` with safetensors' header errors turned into ``CheckpointError``."""
    try:
        return safe_open(str(file), framework="pt")
    except Exception as e:  # safetensors raises SafetensorError / OSError
        raise CheckpointError(
            f"cannot read safetensors file {file}: {e} (truncated or not a "
            "safetensors file?)"
        ) from e


def _read_headers(file: Path, handles: dict[Path, Any]) -> dict[str, _Header]:
    h = handles[file] = _open(file)
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
            out[name] = _Header(file, tuple(int(n) for n in sl.get_shape()), dtype)
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


def _sharded_headers(root: Path, handles: dict[Path, Any]) -> dict[str, _Header]:
    weight_map = _read_index(root)
    by_file: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        by_file.setdefault(file, []).append(name)
    headers: dict[str, _Header] = {}
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
        found = _read_headers(path, handles)
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


def _load_config(config_path: Path):
    if not config_path.is_file():
        raise CheckpointError(
            f"{config_path} does not exist: m2nkit needs the model's config.json to "
            "know which tensors the checkpoint must hold"
        )
    data = _peek(config_path)
    archs = data.get("architectures")
    if archs is not None and (not isinstance(archs, list)
                              or not all(isinstance(a, str) for a in archs)):
        # before transformers, whose own refusal (5.12) does not say what would be valid
        raise CheckpointError(f"{config_path}: 'architectures' must be a list of class names "
                              f"like [\"{supported_architectures()[0]}\"], got {archs!r}")
    if isinstance(archs, list) and archs and isinstance(archs[0], str):
        _check_supported(archs[0], config_path)  # before transformers is imported
    model_type = data.get("model_type")

    # Nothing may come from the Hub: config.json is always a local file here.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    alias = _config_class(archs, model_type)
    if model_type is not None and model_type not in CONFIG_MAPPING and alias is None:
        raise CheckpointError(
            f"{config_path}: model_type {model_type!r} is not built into transformers (it would "
            f"need the model's own Python code, which m2nkit never runs); m2nkit supports "
            f"{_supported()}")
    try:
        if alias is not None:  # the family reads this model_type with a known config class
            from transformers.utils import logging as hf_logging

            level = hf_logging.get_verbosity()
            hf_logging.set_verbosity_error()  # no "model of type X used as Y" warning: intended
            try:
                return CONFIG_MAPPING[alias].from_pretrained(str(config_path),
                                                             local_files_only=True)
            finally:
                hf_logging.set_verbosity(level)
        return AutoConfig.from_pretrained(str(config_path), local_files_only=True,
                                          trust_remote_code=False)
    except Exception as e:
        # transformers' messages can span lines: make them one line.
        first = " ".join(str(e).split())[:300] or type(e).__name__
        raise CheckpointError(
            f"transformers cannot read {config_path}"
            + (f" (model_type {model_type!r})" if model_type else "")
            + f": {first}; m2nkit supports {_supported()}") from e


def _config_class(archs: Any, model_type: Any) -> str | None:
    """The transformers ``model_type`` whose config class reads ``model_type``, when the
    family of ``archs[0]`` says so (``HFNaming.config_classes``) and transformers lacks it."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if (not isinstance(archs, list) or not archs or not isinstance(archs[0], str)
            or not isinstance(model_type, str) or model_type in CONFIG_MAPPING):
        return None
    alias = family(archs[0]).hf.config_classes.get(model_type)
    return alias if alias in CONFIG_MAPPING else None


def _peek(config_path: Path) -> dict:
    """``config.json`` as a dict, or ``{}`` when it is not JSON (transformers then says why)."""
    try:
        data = json.loads(config_path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _supported() -> str:
    return ", ".join(supported_architectures())


def _check_supported(arch: str, config_path: Path) -> None:
    try:
        check_architecture(arch)
    except UnsupportedArchitecture as e:
        raise CheckpointError(f"{config_path}: {e}") from None


def _architecture(config, config_path: Path) -> str:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    archs = getattr(config, "architectures", None) or []
    if isinstance(archs, str) or not all(isinstance(a, str) for a in archs):
        raise CheckpointError(f"{config_path}: 'architectures' must be a list of class names "
                              f"like [\"{supported_architectures()[0]}\"], got {archs!r}")
    arch = archs[0] if archs else MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    if arch is None:
        raise CheckpointError(
            f"{config_path}: no 'architectures', and model_type {config.model_type!r} is not "
            f"a causal LM that transformers knows; m2nkit supports {_supported()}")
    _check_supported(arch, config_path)
    if arch not in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()):
        raise CheckpointError(
            f"{config_path}: this transformers has no causal LM class {arch!r} "
            f"(transformers too old?)")
    return arch


@dataclass(frozen=True)
class _Expected:
    name: str  # in-memory name
    shape: tuple[int, ...]
    dtype: torch.dtype
    tied: bool  # a second name of an earlier parameter (tied lm_head)


def _expected_params(config, arch: str, config_path: Path) -> list[_Expected]:
    """``named_parameters()`` of the model built on the meta device, in order."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as e:
        raise CheckpointError(
            f"transformers cannot build {arch} from {config_path}: {type(e).__name__}: {e}"
        ) from e
    if type(model).__name__ != arch:
        raise CheckpointError(
            f"{config_path}: architectures says {arch} but model_type "
            f"{config.model_type!r} builds {type(model).__name__}"
        )
    seen: set[int] = set()
    out = []
    for name, p in model.named_parameters(remove_duplicate=False):
        out.append(_Expected(name, tuple(p.shape), p.dtype, id(p) in seen))
        seen.add(id(p))
    # Persistent buffers are saved too (a MoE router's score-correction bias, say):
    # each goes right after the last parameter of its module, or at the end.
    names = {e.name for e in out}
    for name, b in model.state_dict(keep_vars=True).items():
        if name in names:
            continue
        module = name.rsplit(".", 1)[0] + "."
        at = max((i + 1 for i, e in enumerate(out) if e.name.startswith(module)), default=len(out))
        out.insert(at, _Expected(name, tuple(b.shape), b.dtype, False))
    return out


def _few(names: Sequence[str], n: int = 5) -> str:
    shown = ", ".join(f"'{x}'" for x in list(names)[:n])
    return shown + (f" and {len(names) - n} more" if len(names) > n else "")


def _resolve(path: Path) -> tuple[Path, Path, str]:
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


def read_checkpoint(path: str | os.PathLike, *, via_transformers: bool = False) -> Checkpoint:
    """Read a checkpoint's wire tensors from its config and safetensors headers.

    Args:
        path: a checkpoint directory (``model.safetensors``, or
            ``model.safetensors.index.json`` + shards, next to
            ``config.json``); or a ``config.json`` file, or a directory
            holding only ``config.json``, for a config-only (metadata-only)
            checkpoint.
        via_transformers: config-only: take the wire tensors from
            transformers' model built on the meta device even where the
            family table gives them (``m2nkit.adapters.config_wires``, the
            default: well under a second, without importing transformers).
            The same tensors in the same order; the table gives each the
            dtype published checkpoints store (a router the table keeps in
            the model dtype where transformers allocates float32).

    Returns:
        A :class:`Checkpoint`. Wire order is the meta model's
        ``named_parameters()`` order with on-disk names; per-expert tensors
        become one stacked ``...experts.gate_up_proj.weight [E, 2*Im, H]``
        (gate rows then up rows per expert) and ``...experts.down_proj.weight
        [E, H, Im]`` at the place of transformers' fused parameter; a
        tensor of the family's ``HFNaming.permuted`` becomes its wire form
        (``<prefix>.<wire leaf>``, dims permuted). Wire
        dtypes are the on-disk dtypes (config-only: the config's dtype, a
        table entry's own where it has one, fp8 weights and float32 scales
        for an fp8 block config). A tied ``lm_head.weight`` is a wire
        tensor only when the files hold it. A config-only checkpoint also
        lists the tensors of layers vLLM skips that a published checkpoint
        holds (multi-token prediction, ``Family.skipped_layers``), at the
        end. No tensor data is read.

    Raises:
        CheckpointError: path missing; nothing to read; unreadable or
            corrupt safetensors header or index; a shard named by the index
            missing; a tensor the index lists missing from its shard; an
            architecture without a family in ``m2nkit.adapters.families``
            (the registry's one message, prefixed with the config path) or
            one transformers does not know; a tensor whose shape
            contradicts the config; a tensor the config expects but the
            files lack; an extra tensor; a dtype outside
            :data:`SAFETENSORS_DTYPES`; an incomplete expert set; a tensor
            the family refuses (``HFNaming.refused``, e.g. MXFP4 experts),
            named with the family's reason. Names
            carrying a wrapper prefix (``_orig_mod.`` of ``torch.compile``,
            ``module.`` of DDP, ...; ``m2nkit.adapters.module_names``) are
            refused with a message that names the prefix.
    """
    path = Path(path)
    root, config_path, kind = _resolve(path)
    if kind == "config" and not via_transformers:
        fast = _config_only_from_table(path, root, config_path)
        if fast is not None:
            return fast
    config = _load_config(config_path)
    arch = _architecture(config, config_path)
    expected = _expected_params(config, arch, config_path)
    hf = family(arch).hf

    handles: dict[Path, Any] = {}
    if kind == "single":
        headers = _read_headers(root / SINGLE_FILE, handles)
    elif kind == "sharded":
        headers = _sharded_headers(root, handles)
    else:
        headers = {}
    fam = family(arch)
    quant = QuantizedWires(fam, config)
    params, sources = _match(expected, hf, headers, kind == "config", root, arch,
                             quant=quant,
                             skip=(lambda n: fam.skip(config, n)) if fam.skip else None)
    if kind == "config":
        params += _skipped_layers(fam, config, quant, sources)
    return Checkpoint(path=path, root=root, config=config, architecture=arch,
                      params=params, sources=sources, headers=headers, handles=handles)


def _config_only_from_table(path: Path, root: Path, config_path: Path) -> Checkpoint | None:
    """A config-only checkpoint from the family table, without transformers, or ``None``.

    ``m2nkit.adapters.config_wires`` reads ``config.json`` as the family's
    transformers config class would and lists the wire tensors the meta model
    would give, in the same order (``tests/test_config_wires.py``). Dtypes
    are those the published checkpoints store: the config's model dtype,
    a parameter's own where the table gives one (``Param.dtype``), fp8
    weights and float32 scales for an fp8 block config. ``None`` (the
    caller then builds transformers' model): no ``config.json`` object or
    architecture this can read, a
    ``model_type`` the family does not declare, a config whose tensors the
    table does not describe exactly (``HFNaming.table_differs``), or one the
    family's ``sizes`` refuses (the layout reports that later, as before).

    Raises:
        CheckpointError: an unsupported architecture (the registry's message).
    """
    from .config_wires import read_config_json, table_wires

    data = _peek(config_path)
    archs = data.get("architectures")
    if not (isinstance(archs, list) and archs and isinstance(archs[0], str)):
        return None
    _check_supported(archs[0], config_path)
    fam = family(archs[0])
    config = read_config_json(data, fam)
    if config is None or (fam.hf.table_differs is not None and fam.hf.table_differs(config)):
        return None
    try:
        s = fam.sizes(config)
        wires = table_wires(fam, config, s)
    except (ValueError, KeyError, TypeError):
        return None
    hf = fam.hf
    params: list[ParamMeta] = []
    sources: dict[str, str | StackedExperts | _Permuted] = {}
    for w in wires:
        params.append(ParamMeta(w.name, w.dtype, w.shape))
        if w.stacked:
            prefix = w.name[: w.name.rindex(".experts.")]
            E, rows, cols = w.shape
            # expert_name(pattern, prefix, e) for every e, with the prefix filled once
            split = [hf.experts_on_disk[part].replace("{prefix}", prefix).split("{e}")
                     for part in w.stacked]
            sources[w.name] = StackedExperts(w.name, w.dtype, tuple(
                tuple(str(e).join(parts) for parts in split) for e in range(E)
            ), (rows // len(split), cols))
        else:
            permuted = _permuted_wire(hf, w.name)
            sources[w.name] = _Permuted(*permuted) if permuted else w.name
    arch = fam.architecture
    quant = QuantizedWires(fam, config)
    if quant:
        params = _add_scales(params, sources, quant, {}, True, set(), [], arch)
    params += _skipped_layers(fam, config, quant, sources)
    return Checkpoint(path=path, root=root, config=config, architecture=arch,
                      params=params, sources=sources, headers={}, handles={})


def _permuted_wire(hf: HFNaming, wire: str) -> tuple[str, tuple[int, ...]] | None:
    """``(on-disk name, order)`` of a wire tensor that is a permuted on-disk tensor, or ``None``."""
    for leaf, (wire_leaf, order) in hf.permuted.items():
        if wire.endswith("." + wire_leaf):
            return wire[: -len(wire_leaf)] + leaf, tuple(order)
    return None


def _skipped_layers(fam, config, quant, sources: dict) -> list[ParamMeta]:
    """The tensors of layers vLLM skips (multi-token-prediction layers) that a published
    checkpoint of ``config`` holds, for a config-only plan to list as skipped
    (``Family.skipped_layers``; a checkpoint with data lists the ones it holds)."""
    from .config_wires import skipped_layer_wires

    out = []
    for w in skipped_layer_wires(fam, config, quant=quant):
        out.append(ParamMeta(w.name, w.dtype, w.shape))
        sources[w.name] = w.name
    return out


def _match(expected: Sequence[_Expected], hf: HFNaming, headers: Mapping[str, _Header],
           config_only: bool, root: Path, arch: str, *, quant: Any = None, skip: Any = None):
    """Pair every expected parameter with on-disk tensors; check shapes and leftovers.

    ``quant`` (``QuantizedWires``): fp8 block-quantized weights get their
    ``weight_scale_inv`` wire tensor (:func:`_add_scales`). ``skip``: on-disk
    tensors the model does not have that vLLM skips on purpose (name ->
    reason or ``None``) are kept as wire tensors at the end, for the plan to
    list as skipped.
    """
    grouped = group_expert_tensors(headers, hf.experts_on_disk) if hf.experts_on_disk else {}
    shapes = {n: h.shape for n, h in headers.items()}
    dtypes = {n: h.dtype for n, h in headers.items()}
    params: list[ParamMeta] = []
    sources: dict[str, str | StackedExperts | _Permuted] = {}
    used: set[str] = set()
    missing: list[str] = []
    stacked_hint = ""

    def where(name: str) -> str:
        return f"tensor '{name}' in {headers[name].file}"

    for name in headers:
        refusal = hf.refusal(name)
        if refusal:
            raise CheckpointError(f"{where(name)}: {refusal}")

    for exp in expected:
        permuted = hf.permuted_leaf(exp.name)
        if permuted is not None:
            disk = hf.disk_name(exp.name)
            wire_leaf, order = hf.permuted[permuted]
            wire = disk[: -len(permuted)] + wire_leaf
            shape = tuple(exp.shape[d] for d in order)
            h = headers.get(disk)
            if not config_only and h is None:
                missing.append(disk)
                continue
            if h is not None and h.shape != exp.shape:
                raise CheckpointError(f"{where(disk)} has shape {list(h.shape)}, but the config "
                                      f"({arch}) expects {list(exp.shape)}")
            params.append(ParamMeta(wire, exp.dtype if h is None else h.dtype, shape))
            sources[wire] = _Permuted(disk, tuple(order))
            used.add(disk)
            continue
        leaf = hf.fused_leaf(exp.name)
        if leaf is not None:
            wire_leaf, parts = hf.fused_experts[leaf]
            prefix = hf.disk_name(exp.name)[: -len(leaf) - 1]
            wire = f"{prefix}.{wire_leaf}"
            num_experts, rows, cols = exp.shape
            part_shape = (rows // len(parts), cols)
            pattern_of = {p: hf.experts_on_disk[p] for p in parts}

            def expected_name(e: int, part: str, _prefix=prefix, _pat=pattern_of) -> str:
                return expert_name(_pat[part], _prefix, e)

            if config_only:
                stack = StackedExperts(wire, exp.dtype, tuple(
                    tuple(expected_name(e, p) for p in parts) for e in range(num_experts)
                ), part_shape)
            else:
                found = {}
                for e, ex in grouped.get(prefix, {}).items():
                    mine = {p: n for p, n in ex.items() if p in parts}
                    if mine:
                        found[e] = mine
                stacked = [n for n in hf.stacked_on_disk(prefix, leaf) if n in headers]
                if stacked:
                    params.append(_stacked_on_disk(stacked, found, wire, exp, parts, headers,
                                                   arch))
                    sources[wire] = stacked[0]
                    used.add(stacked[0])
                    continue
                if not found:
                    missing.append(expected_name(0, parts[0]))
                    stacked_hint = stacked_hint or hf.stacked_on_disk(prefix, leaf)[0]
                    continue
                try:
                    stack = stack_experts(
                        wire, found, parts, num_experts,
                        shapes=shapes, dtypes=dtypes,
                        part_shape=part_shape, expected_name=expected_name,
                    )
                except ValueError as e:
                    raise CheckpointError(f"{root}: {e} (config: {arch})") from e
                used.update(stack.source_names())
            params.append(ParamMeta(wire, stack.dtype, stack.shape))
            sources[wire] = stack
            continue

        disk = hf.disk_name(exp.name)
        if config_only:
            if not exp.tied:
                params.append(ParamMeta(disk, exp.dtype, exp.shape))
                sources[disk] = disk
            continue
        h = headers.get(disk)
        if h is None:
            if not exp.tied:
                missing.append(disk)
            continue
        if h.shape != exp.shape:
            raise CheckpointError(
                f"{where(disk)} has shape {list(h.shape)}, but the config ({arch}) "
                f"expects {list(exp.shape)}"
            )
        params.append(ParamMeta(disk, h.dtype, h.shape))
        sources[disk] = disk
        used.add(disk)

    if quant:
        params = _add_scales(params, sources, quant, headers, config_only, used, missing, arch)
    extra = [n for n in headers if n not in used]
    if skip is not None:
        for n in [n for n in extra if skip(n)]:
            params.append(ParamMeta(n, headers[n].dtype, headers[n].shape))
            sources[n] = n
        extra = [n for n in extra if n not in sources]
    # A checkpoint saved from a wrapped model (torch.compile's '_orig_mod.', DDP's
    # 'module.') misses every name and holds them all again under the prefix: say so.
    hint = wrapper_hint(extra)
    hint = f"; {hint}" if hint else ""
    if stacked_hint:
        hint += (f"; experts may also be stored stacked per layer, e.g. '{stacked_hint}' "
                 "(the per-expert tensors above or a stacked one, per MoE block)")
    if missing:
        raise CheckpointError(
            f"checkpoint {root} lacks {len(missing)} tensor(s) the config ({arch}) "
            f"expects: {_few(missing)}{hint}"
        )
    if extra:
        raise CheckpointError(
            f"checkpoint {root} holds {len(extra)} tensor(s) the config ({arch}) does "
            f"not expect: {_few(extra)} (first in {headers[extra[0]].file}){hint}"
        )
    return params, sources


def _add_scales(params: list[ParamMeta], sources: dict, quant: Any, headers: Mapping[str, _Header],
                config_only: bool, used: set[str], missing: list[str],
                arch: str) -> list[ParamMeta]:
    """Every fp8 block-quantized weight followed by its ``weight_scale_inv`` wire tensor.

    A plain weight ``X.weight`` takes ``X.weight_scale_inv`` from the files;
    stacked experts take each expert's per-part scales, stacked the same way
    (``<block>.experts.gate_up_proj.weight_scale_inv [E, 2*ceil(Im/n), ceil(H/k)]``).
    Config-only: the weight becomes float8 e4m3 and its scale float32 of
    the block shape (``m2nkit.adapters.families.quant``). A scale the files
    lack goes to ``missing``.

    Raises:
        CheckpointError: a scale of the wrong shape.
    """
    out: list[ParamMeta] = []
    for p in params:
        if not quant.matches(p.name):
            out.append(p)
            continue
        src = sources[p.name]
        parts = len(src.sources[0]) if isinstance(src, StackedExperts) else 1
        shape = quant.scale_shape(p.shape, parts)
        wire = scale_name(p.name)
        if config_only:
            out += [ParamMeta(p.name, FP8, p.shape), ParamMeta(wire, torch.float32, shape)]
            sources[wire] = wire
            continue
        out.append(p)
        if isinstance(src, StackedExperts):
            names = tuple(tuple(scale_name(n) for n in ex) for ex in src.sources)
            lacking = [n for ex in names for n in ex if n not in headers]
            if lacking:
                missing.append(lacking[0])
                continue
            first = headers[names[0][0]]
            found = (len(names), parts * first.shape[0], first.shape[1])
            if found != shape or any(headers[n].shape != first.shape for ex in names for n in ex):
                raise CheckpointError(
                    f"fp8 scales of '{p.name}' ('{names[0][0]}' ...) stack to {list(found)}, but "
                    f"its weight {list(p.shape)} and weight_block_size {quant.block} need "
                    f"{list(shape)} (config: {arch})")
            sources[wire] = StackedExperts(wire, first.dtype, names,
                                           (first.shape[0], first.shape[1]))
            used.update(n for ex in names for n in ex)
        else:
            disk = scale_name(src)
            h = headers.get(disk)
            if h is None:
                missing.append(disk)
                continue
            if h.shape != shape:
                raise CheckpointError(
                    f"tensor '{disk}' in {h.file} has shape {list(h.shape)}, but its weight "
                    f"{list(p.shape)} and weight_block_size {quant.block} need {list(shape)} "
                    f"(config: {arch})")
            sources[wire] = disk
            used.add(disk)
            first = h
        out.append(ParamMeta(wire, first.dtype, shape))
    return out


def _stacked_on_disk(stacked: Sequence[str], per_expert: Mapping, wire: str, exp: _Expected,
                     parts: Sequence[str], headers: Mapping[str, _Header], arch: str) -> ParamMeta:
    """The wire tensor of an expert tensor stored already stacked (``stacked[0]``).

    Raises:
        CheckpointError: the block also holds per-expert tensors or a second
            stacked name, or the shape is not the config's ``[E, rows, cols]``.
    """
    name = stacked[0]
    h = headers[name]
    if len(stacked) > 1 or per_expert:
        other = stacked[1] if len(stacked) > 1 else next(iter(next(iter(per_expert.values())).values()))
        raise CheckpointError(
            f"tensor '{name}' in {h.file} holds the experts stacked, but the checkpoint also "
            f"holds '{other}' for the same experts; keep one form per MoE block")
    if h.shape != exp.shape:
        E, rows, cols = exp.shape
        raise CheckpointError(
            f"tensor '{name}' in {h.file} has shape {list(h.shape)}, but the config ({arch}) "
            f"expects stacked experts {list(exp.shape)}: [experts, rows, cols] with each "
            f"expert's {' rows then its '.join(parts)} rows (a transposed [{E}, {cols}, {rows}] "
            "layout is not read)")
    return ParamMeta(wire, h.dtype, h.shape)


# --------------------------------------------------------------------------
# layouts and manifests


def checkpoint_metas(checkpoint: Checkpoint, trainer_spec: TrainerSpec | str) -> list[ParamMeta]:
    """Every wire tensor as a ``ParamMeta`` with the trainer spec's layout.

    Identical on every rank (depends on headers, config and spec only).
    With a ``tp`` axis (``fsdp2:dp_shard=S,tp=T``) the family's TP plan
    decides each tensor's layout (``TrainerSpec.tp_dims``); FSDP2's strided
    layouts become explicit pieces. Tensors transformers holds as buffers
    are whole on every rank (``TrainerSpec.buffers``).

    Raises:
        ValueError: a malformed trainer spec; ``tp > 1`` for a family without
            a TP plan, or a ``tp`` its plan cannot split the model over.
    """
    spec = parse_trainer_spec(trainer_spec)
    tp_dim = spec.tp_dims(checkpoint.config)
    buffer = spec.buffers(checkpoint.config)  # whole on every FSDP2 rank
    out = []
    for p in checkpoint.params:
        lay = spec.layout_for(p.shape, tp_dim=tp_dim(p.name), buffer=buffer(p.name))
        if isinstance(lay, PieceLayout):
            out.append(ParamMeta(p.name, p.dtype, p.shape, pieces=lay.pieces))
        else:
            out.append(ParamMeta(p.name, p.dtype, p.shape, lay.owners, lay.mesh_shape,
                                 lay.placements))
    return out


def checkpoint_manifest(checkpoint: Checkpoint, trainer_spec: TrainerSpec | str, rank: int):
    """A ``ManifestM2NWeightSource`` for trainer ``rank`` holding its box of the checkpoint.

    One ``M2NManifestEntry`` per wire tensor, in wire order, with the
    spec's layout; its ``local_tensor`` reads exactly this rank's box
    (``local_box`` at the rank's mesh coordinate) via
    :meth:`Checkpoint.read_box`, only when called. Ranks with an empty box
    (``fsdp:N`` with N above dim 0) get an empty tensor of the right shape.

    Raises:
        ValueError: a malformed trainer spec, or ``rank`` outside it.
    """
    from m2nkit.manifest.source import M2NManifestEntry, ManifestM2NWeightSource

    spec = parse_trainer_spec(trainer_spec)
    spec.coord(rank)  # refuses a rank outside the spec before anything else
    tp_dim = spec.tp_dims(checkpoint.config)
    buffer = spec.buffers(checkpoint.config)
    entries = []
    for p in checkpoint.params:
        lay = spec.layout_for(p.shape, tp_dim=tp_dim(p.name), buffer=buffer(p.name))
        box = spec.local_box(p.shape, rank, tp_dim=tp_dim(p.name), buffer=buffer(p.name))
        entries.append(M2NManifestEntry(
            p.name, p.dtype, p.shape, lay,
            functools.partial(checkpoint.read_box, p.name, box),
        ))
    return ManifestM2NWeightSource(entries, rank=rank)


def full_checkpoint_tensors(checkpoint: Checkpoint) -> dict[str, torch.Tensor]:
    """Every on-disk tensor, whole, by on-disk name (reads all data: for tests).

    Raises:
        CheckpointError: a config-only checkpoint.
    """
    if not checkpoint.has_data:
        raise CheckpointError(f"checkpoint {checkpoint.path} is config-only: no tensor data")
    out = {}
    for name, h in checkpoint._headers.items():
        out[name] = checkpoint._handle(h.file).get_tensor(name)
    return out
