"""Where the tests find the repository's files, wherever in tests/ a test module lives."""

from pathlib import Path

#: The repository root.
REPO = Path(__file__).resolve().parent.parent
#: The shipped tiny checkpoint (the README's default input).
EXAMPLE = REPO / "examples" / "tiny-qwen3-moe"
#: Real public configs for config-only plans.
CONFIGS = REPO / "examples" / "configs"
#: Real vLLM 0.33.0 loader dumps and their checkpoints (tests/data/oracle/README.md).
ORACLE = REPO / "tests" / "data" / "oracle"
