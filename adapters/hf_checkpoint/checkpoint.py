"""``read_checkpoint``: a checkpoint's wire tensors, metadata up front, data by box on demand.

Reading plans from headers only (:mod:`.files`), checked against what the
config expects (:mod:`.config`, or for a bare ``config.json`` the family
table: ``m2nkit.adapters.config_wires``), matched name by name
(:mod:`.match`). :class:`Checkpoint` then reads one box at a time,
``get_slice(name)[slices]``, so a trainer rank reads only the rows it holds.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from m2nkit.manifest.layout import Box
from m2nkit.manifest.meta import ParamMeta

from ..experts import StackedExperts
from ..families import architecture_name, family, has_table
from ..families.quant import QuantizedWires, compressed_tensors_refusal
from .config import Expected, config_architecture, expected_params, load_config, peek_config
from .errors import CheckpointError
from .files import (SINGLE_FILE, Header, Permuted, open_safetensors, read_headers, resolve_path,
                    sharded_headers)
from .match import add_scales, match_expected, permuted_wire

__all__ = ["Checkpoint", "read_checkpoint", "full_checkpoint_tensors"]


class Checkpoint:
    """A checkpoint's wire tensors: metadata up front, data by box on demand.

    Built by :func:`read_checkpoint`; holds no tensor data (except for an
    architecture without a table, whose tensors transformers loaded). safetensors
    files are opened once (memory-mapped, headers parsed) and the handles
    are kept for later reads; :meth:`close` drops them.

    Attributes:
        path: the path given to ``read_checkpoint``.
        root: the checkpoint directory.
        config: the transformers config.
        architecture: ``config.architectures[0]``: one with a family table
            (``m2nkit.adapters.families.supported_architectures()``), or a
            transformers model class without one (``families.tableless``).
        dtype: the dtype holding most wire elements (bf16 for a bf16
            checkpoint with an fp32 router).
        params: wire tensors as ``ParamMeta`` (no layout), in wire order.
        files: safetensors files, sorted; empty for a config-only checkpoint.
        has_data: False for a config-only checkpoint (metadata only).
    """

    def __init__(self, *, path: Path, root: Path, config: Any, architecture: str,
                 params: Sequence[ParamMeta],
                 sources: Mapping[str, str | StackedExperts | Permuted],
                 headers: Mapping[str, Header], handles: dict[Path, Any],
                 has_data: bool | None = None) -> None:
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
        self.has_data = bool(self.files) if has_data is None else has_data
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
        if isinstance(src, torch.Tensor):     # transformers' in-memory tensor: no on-disk name
            return ()
        if isinstance(src, Permuted):
            return (src.disk,)
        return src.source_names() if isinstance(src, StackedExperts) else (src,)

    def file_of(self, disk_name: str) -> Path:
        """The safetensors file holding on-disk tensor ``disk_name``."""
        return self._headers[disk_name].file

    # ---- data

    def _handle(self, file: Path):
        h = self._handles.get(file)
        if h is None:
            h = self._handles[file] = open_safetensors(file)
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
        if isinstance(src, torch.Tensor):     # held in memory (an architecture without a table)
            return src[tuple(slice(a, b) for a, b in box)].clone(
                memory_format=torch.contiguous_format)
        if isinstance(src, StackedExperts):
            return src.read_box(box, self._read_slice)
        if isinstance(src, Permuted):
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
        kind = ("config-only" if not self.has_data else f"{len(self.files)} file(s)"
                if self.files else "loaded by transformers")
        return (f"Checkpoint({str(self.root)!r}, {self.architecture}, {kind}, "
                f"{len(self.params)} wire tensors, {self.dtype})")


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
            named with the family's reason; a compressed-tensors
            ``quantization_config`` (or ``text_config.quantization_config``:
            Kimi-K2.5's int4), which no layout describes
            (``families.quant.compressed_tensors_refusal``: method, bits,
            group size, and the unquantized form as what is supported). Names
            carrying a wrapper prefix (``_orig_mod.`` of ``torch.compile``,
            ``module.`` of DDP, ...; ``m2nkit.adapters.module_names``) are
            refused with a message that names the prefix.
    """
    path = Path(path)
    root, config_path, kind = resolve_path(path)
    data = peek_config(config_path)
    why = compressed_tensors_refusal(data, architecture_name(data) or "this model")
    if why:     # before any reader: neither the tables nor transformers' model describe it
        raise CheckpointError(f"{config_path}: {why}")
    if kind == "config" and not via_transformers:
        fast = _config_only_from_table(path, root, config_path)
        if fast is not None:
            return fast
    table_only = _table_only_family(data)
    if table_only is not None:
        config, expected = _table_expected(table_only, data, config_path)
        arch = table_only.architecture
    else:
        config = load_config(config_path)
        arch = config_architecture(config, config_path)
        if not has_table(arch):
            return _tableless(path, root, config_path, config, arch, kind)
        expected = expected_params(config, arch, config_path)
    hf = family(arch).hf

    handles: dict[Path, Any] = {}
    if kind == "single":
        headers = read_headers(root / SINGLE_FILE, handles)
    elif kind == "sharded":
        headers = sharded_headers(root, handles)
    else:
        headers = {}
    fam = family(arch)
    quant = QuantizedWires(fam, config)
    params, sources = match_expected(expected, hf, headers, kind == "config", root, arch,
                             quant=quant,
                             skip=(lambda n: fam.skip(config, n)) if fam.skip else None)
    if kind == "config":
        params += _skipped_layers(fam, config, quant, sources)
    return Checkpoint(path=path, root=root, config=config, architecture=arch,
                      params=params, sources=sources, headers=headers, handles=handles)


def _table_only_family(data: Mapping[str, Any]):
    """The family of a table architecture that transformers has no model class of.

    Kimi-K2.5 (``KimiK25ForConditionalGeneration``) is one: transformers
    5.12.1 has neither its config class nor its model (5.24 adds
    ``Kimi_K25ForConditionalGeneration``, another class with other in-memory
    names), so the table is the only description of its tensors; the family
    declares its ``model_type`` (``HFNaming.model_types``) and the defaults
    its config is read with. ``None`` for every other config: transformers
    reads it and builds the reference model.
    """
    import transformers

    archs = data.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    if not has_table(arch) or data.get("model_type") not in family(arch).hf.model_types:
        return None
    cls = getattr(transformers, arch, None)
    if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
        return None
    return family(arch)


def _table_expected(fam, data: Mapping[str, Any], config_path: Path):
    """``(config, expected tensors)`` of a table-only architecture, from its table.

    The config is ``config.json`` read with the family's declared defaults
    (``config_wires.read_config_json``), the expected tensors are the
    table's wire tensors in wire order (``config_wires.table_wires``) under
    their in-memory names (stacked experts ``<block>.experts.gate_up_proj``),
    as :func:`~.config.expected_params` gives them for a transformers model.

    Raises:
        CheckpointError: the family's ``sizes`` refuses the config (its message).
    """
    from ..config_wires import read_config_json, table_wires

    config = read_config_json(data, fam)
    try:
        wires = table_wires(fam, config)
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{config_path}: {e}") from None
    in_memory = {wire_leaf: leaf for leaf, (wire_leaf, _) in fam.hf.fused_experts.items()}
    expected = []
    for w in wires:
        name = w.name
        for wire_leaf, leaf in in_memory.items():
            if w.stacked and name.endswith("." + wire_leaf):
                name = name[: -len(wire_leaf)] + leaf
        expected.append(Expected(name, w.shape, w.dtype, False))
    return config, expected


def _tableless(path: Path, root: Path, config_path: Path, config: Any, arch: str,
               kind: str) -> Checkpoint:
    """A checkpoint of an architecture without a table, as transformers holds it in memory.

    The wire tensors are transformers' own: the model class's
    ``named_parameters()`` and persistent buffers, under their in-memory
    names, tied duplicates once (``m2nkit.adapters.families.tableless``), but
    a tensor the tableless family carries in another dim order
    (``HFNaming.permuted``, see families.tableless), which is the in-memory tensor
    permuted (a view, read box by box). Config-only: built on the meta device (no data). With files: loaded by
    ``from_pretrained`` (transformers' own on-disk conversion: experts
    stacked, prefixes renamed, dtypes as the checkpoint stores them), and
    kept in memory; boxes are read from those tensors. That holds the whole
    model in host memory, which the family tables avoid by reading boxes
    from disk; it is the price of not restating transformers' on-disk
    naming for an architecture m2nkit has no table for.

    Raises:
        CheckpointError: transformers cannot build or load the model (its
            message, on one line).
    """
    from ..families.tableless import meta_model, transformers_class

    if kind == "config":
        try:
            model = meta_model(config)
        except ValueError as e:
            raise CheckpointError(f"{config_path}: {e}") from None
    else:
        from transformers.utils import logging as hf_logging

        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()     # m2nkit's own lines only
        try:
            model = transformers_class(arch).from_pretrained(
                str(root), config=config, dtype="auto", local_files_only=True)
        except Exception as e:   # transformers' refusals come as several exception types
            first = " ".join(str(e).split())[:300] or type(e).__name__
            raise CheckpointError(f"transformers cannot load {arch} from {root}: {first}") from e
        finally:
            if bars:
                hf_logging.enable_progress_bar()
    from ..families.tableless import tableless_family

    hf = tableless_family(config).hf
    seen: set[int] = set()
    params: list[ParamMeta] = []
    tensors: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:      # a tied duplicate (lm_head.weight of tied embeddings)
            continue
        seen.add(id(t))
        leaf = hf.permuted_leaf(name)
        if leaf is not None:   # carried in another dim order: a view
            wire_leaf, order = hf.permuted[leaf]
            name, t = name[: -len(leaf)] + wire_leaf, t.permute(tuple(order))
        params.append(ParamMeta(name, t.dtype, tuple(t.shape)))
        if kind != "config":
            tensors[name] = t.detach()
    return Checkpoint(path=path, root=root, config=config, architecture=arch, params=params,
                      sources=tensors, headers={}, handles={}, has_data=kind != "config")


def _config_only_from_table(path: Path, root: Path, config_path: Path) -> Checkpoint | None:
    """A config-only checkpoint from the family table, without transformers, or ``None``.

    ``m2nkit.adapters.config_wires`` reads ``config.json`` as the family's
    transformers config class would and lists the wire tensors the meta model
    would give, in the same order (``tests/adapters/test_config_wires.py``). Dtypes
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
    from ..config_wires import read_config_json, table_wires

    data = peek_config(config_path)
    archs = data.get("architectures")
    if not (isinstance(archs, list) and archs and isinstance(archs[0], str)
            and has_table(archs[0])):
        return None
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
    sources: dict[str, str | StackedExperts | Permuted] = {}
    for w in wires:
        params.append(ParamMeta(w.name, w.dtype, w.shape))
        stored = _stacked_order_source(hf, w.name) if w.stacked else None
        if stored is not None:   # published checkpoints hold these stacked, permuted
            sources[w.name] = stored
        elif w.stacked:
            prefix = w.name[: w.name.rindex(".experts.")]
            E, rows, cols = w.shape
            # expert_name(pattern, prefix, e) for every e, with the prefix filled once
            split = [hf.experts_on_disk[part].replace("{prefix}", prefix).split("{e}")
                     for part in w.stacked]
            sources[w.name] = StackedExperts(w.name, w.dtype, tuple(
                tuple(str(e).join(parts) for parts in split) for e in range(E)
            ), (rows // len(split), cols))
        else:
            permuted = permuted_wire(hf, w.name)
            sources[w.name] = Permuted(*permuted) if permuted else w.name
    arch = fam.architecture
    quant = QuantizedWires(fam, config)
    if quant:
        params = add_scales(params, sources, quant, {}, True, set(), [], arch)
    params += _skipped_layers(fam, config, quant, sources)
    return Checkpoint(path=path, root=root, config=config, architecture=arch,
                      params=params, sources=sources, headers={}, handles={})


def _stacked_order_source(hf, wire: str) -> Permuted | None:
    """The on-disk source of stacked experts a family's checkpoints store stacked in
    another dim order (``HFNaming.stacked_order``), or ``None``."""
    if not hf.stacked_order:
        return None
    for leaf, (wire_leaf, _) in hf.fused_experts.items():
        if wire.endswith("." + wire_leaf):
            return Permuted(wire[: -len(wire_leaf)] + leaf, tuple(hf.stacked_order))
    return None


def _skipped_layers(fam, config, quant, sources: dict) -> list[ParamMeta]:
    """The tensors of layers vLLM skips (multi-token-prediction layers) that a published
    checkpoint of ``config`` holds, for a config-only plan to list as skipped
    (``Family.skipped_layers``; a checkpoint with data lists the ones it holds)."""
    from ..config_wires import skipped_layer_wires

    out = []
    for w in skipped_layer_wires(fam, config, quant=quant):
        out.append(ParamMeta(w.name, w.dtype, w.shape))
        sources[w.name] = w.name
    return out


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
