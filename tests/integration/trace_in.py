"""``trace_destination`` in another interpreter: the jobs a test hands it, the layouts back.

Some vLLM 0.33.0 model classes import what only a newer transformers has
(Kimi-K2.5's ``models/kimi_k25.py``: ``Kimi_K25Config``), so a test in the
integration process (transformers 5.12.1) traces them in a process of
``.venv-tf`` (``scripts/side_transformers.sh``) with this script:

  .venv-tf/bin/python tests/integration/trace_in.py JOBS OUT

``JOBS``: a pickle of ``[(key, config_dir, wire metas, spec), ...]``; ``OUT``:
a pickle of ``{key: DestinationLayout}`` (or the ``Exception`` vLLM or the
trace refused it with, re-raised as its type and message) plus
``"transformers"``: the version that traced them. The caller asserts on the
layouts; nothing is checked here.
"""

from __future__ import annotations

import os
import pickle
import sys


def main(jobs_path: str, out_path: str) -> None:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    import transformers

    from m2nkit.adapters.vllm.trace import trace_destination

    with open(jobs_path, "rb") as f:
        jobs = pickle.load(f)
    out = {"transformers": transformers.__version__}
    for key, config_dir, metas, spec in jobs:
        try:
            out[key] = trace_destination(config_dir, metas, spec)
        except Exception as e:      # a refusal the caller may expect (a size vLLM refuses)
            out[key] = type(e)(str(e)) if isinstance(e, ValueError) else RuntimeError(
                f"{type(e).__name__}: {e}")
    with open(out_path, "wb") as f:
        pickle.dump(out, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
