"""The one error of the checkpoint reader: a checkpoint or config m2nkit cannot read.

Every part of :mod:`m2nkit.adapters.hf_checkpoint` (files, config, name
matching) raises it, naming the file, the tensor, the value and what was
expected, so the CLI prints it as one line.
"""

from __future__ import annotations

__all__ = ["CheckpointError"]


class CheckpointError(ValueError):
    """A checkpoint or config that m2nkit cannot turn into wire tensors."""
