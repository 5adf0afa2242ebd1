"""A live model's parameters and persistent buffers, on their way to the wire.

:class:`Weight` is one tensor as the source sees it (its names, its owner
module, whether FSDP2 shards it); :func:`named_weights` lists them in
checkpoint order and :func:`live` reads one as it is at send time (its
``to_local()`` shard on a sharded model). The names, the LoRA merge and the
source all work on these.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..module_names import strip_wrappers
from .errors import FSDP2SourceError

__all__ = ["Weight", "named_weights", "live", "cast", "is_dtensor"]


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a ``DTensor`` (torch's distributed import deferred to the call)."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


@dataclass
class Weight:
    """One parameter (or persistent buffer) on its way to the wire."""

    name: str                 # as named_parameters()/named_buffers() gives it
    clean: str                # wrappers stripped
    module: torch.nn.Module   # owner, for reading the live tensor at send time
    attr: str
    param: torch.Tensor
    buffer: bool = False      # a persistent buffer: never sharded by FSDP2
    ignored: bool = False     # left out by fully_shard(..., ignored_params=...): whole on every rank
    order: tuple[int, ...] | None = None  # HFNaming.permuted: wire = local.permute(order)

    @property
    def whole(self) -> bool:
        """Every rank holds all of it (a buffer, or a parameter FSDP2 was told to ignore)."""
        return self.buffer or self.ignored

    @property
    def wire_shape(self) -> tuple[int, ...]:
        shape = tuple(int(n) for n in self.param.shape)
        return shape if self.order is None else tuple(shape[d] for d in self.order)


def named_weights(model: torch.nn.Module) -> list[Weight]:
    """Parameters, then persistent buffers each right after its module's last parameter.

    A checkpoint holds both (``state_dict``); transformers keeps e.g. a
    router's score-correction bias as a persistent buffer. Same order as
    ``m2nkit.adapters.hf_checkpoint`` gives the checkpoint's wire tensors.
    """
    out = []
    for name, p in model.named_parameters():
        mod_name, _, attr = name.rpartition(".")
        out.append(Weight(name, strip_wrappers(name), model.get_submodule(mod_name), attr, p))
    for name, b in model.named_buffers():
        mod_name, _, attr = name.rpartition(".")
        module = model.get_submodule(mod_name)
        if attr in module._non_persistent_buffers_set:
            continue
        x = Weight(name, strip_wrappers(name), module, attr, b, buffer=True)
        prefix = mod_name + "."
        at = max((i + 1 for i, y in enumerate(out) if y.name.startswith(prefix)),
                 default=len(out))
        out.insert(at, x)
    return out

def live(module: torch.nn.Module, attr: str, name: str, sharded: bool) -> torch.Tensor:
    """The parameter as it is now, its local shard when the model is sharded."""
    p = getattr(module, attr)
    if not sharded:
        return p.detach()
    if not is_dtensor(p):
        raise FSDP2SourceError(
            f"parameter '{name}' is not sharded right now (FSDP2 holds it gathered inside "
            "forward/backward, or after forward with reshard_after_forward=False); call "
            "model.reshard() before sending")
    local = p.to_local()
    wait = getattr(local, "wait", None)  # AsyncCollectiveTensor
    return (wait() if callable(wait) else local).detach()


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype``: itself when it already is, else a cast copy."""
    return t if t.dtype == dtype else t.to(dtype)

