"""Integrations that sit above the runtime they drive: ``vllm`` (the ``"m2nkit"`` backend)."""
