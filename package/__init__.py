"""m2nkit: move an RL trainer's weights into vLLM inference workers shard to shard.

Subpackages: :mod:`m2nkit.manifest` (the vocabulary: placements, layouts,
manifests), :mod:`m2nkit.adapters` (trainers and checkpoints in, vLLM
destination layouts out) and :mod:`m2nkit.engine` (plan, transports, CLI).
"""

__version__ = "0.1.0"
