"""SGLang 0.5.23's own weight loading on CPU, dumped per TP rank (run under .venv-sglang).

For each checkpoint directory given, build SGLang's own model class (its
registry, ``sglang/srt/model_loader/loader.py`` ``_initialize_model``) as TP
rank R of T would, pre-fill every parameter with NaN, run SGLang's own
``model.load_weights`` over ``DefaultModelLoader._get_all_weights`` (the
weights a server's default ``safetensors`` load feeds it), and write the
rank-local ``named_parameters()`` to ``OUT/<name>/tp<T>[_ep]/rank<R>.safetensors``
(the format of tests/data/oracle: NaN where SGLang wrote nothing; metadata
``sglang_version``, ``architecture``, ``tp_size``, ``tp_rank``, ``ep_size``,
``aliases`` = tied names, e.g. ``{"lm_head.weight": "model.embed_tokens.weight"}``).

The parallel state is SGLang's own over real gloo groups on 127.0.0.1:
``runtime_context.publish(ServerArgs(..., device="cpu"))``,
``parallel_state.init_distributed_environment(backend="gloo")`` and
``initialize_model_parallel(backend="gloo")``, one spawned process per rank.
``process_weights_after_loading`` is not run (the dump is what the loaders
wrote; for unquantized models SGLang's post-processing leaves the weights as
they are).

Usage (exit 0 only when every rank of every checkpoint was dumped):
  .venv-sglang/bin/python sglang_oracle.py --tp T [--ep] --out DIR NAME=CKPT_DIR [NAME=CKPT_DIR ...]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import warnings


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    os.environ.setdefault("TQDM_DISABLE", "1")


def _aliases(model) -> dict[str, str]:
    """Names that share one parameter: alias -> the name ``named_parameters()`` keeps."""
    kept = {id(p): n for n, p in model.named_parameters()}
    return {n: kept[id(p)] for n, p in model.named_parameters(remove_duplicate=False)
            if kept[id(p)] != n}


def _rank(rank: int, tp: int, ep: bool, port: int, out: str, checkpoints: list) -> None:
    _quiet()
    import torch
    from safetensors.torch import save_file

    import sglang
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.model_loader.loader import DefaultModelLoader, _initialize_model
    from sglang.srt.model_loader.utils import set_default_torch_dtype
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    first = True
    for name, ckpt in checkpoints:
        sa = ServerArgs(model_path=ckpt, tp_size=tp, ep_size=tp if ep else 1, device="cpu",
                        skip_tokenizer_init=True, disable_custom_all_reduce=True)
        publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=rank))
        if first:
            ps.init_distributed_environment(
                world_size=tp, rank=rank, local_rank=rank, backend="gloo",
                distributed_init_method=f"tcp://127.0.0.1:{port}")
            ps.initialize_model_parallel(backend="gloo")
            first = False
        mc = ModelConfig.from_server_args(sa)
        loader = DefaultModelLoader(LoadConfig(load_format="safetensors"))
        with set_default_torch_dtype(mc.dtype), torch.device("cpu"):
            model = _initialize_model(mc, loader.load_config, None)
        with torch.no_grad():
            for p in model.parameters():
                if p.dtype.is_floating_point:
                    p.fill_(float("nan"))
        model.load_weights(loader._get_all_weights(mc, model))
        aliases = _aliases(model)
        tensors = {n: p.detach().contiguous() for n, p in model.named_parameters()}
        meta = {"sglang_version": sglang.__version__,
                "architecture": mc.hf_config.architectures[0],
                "model_class": type(model).__name__, "tp_size": str(tp), "tp_rank": str(rank),
                "ep_size": str(tp if ep else 1), "dtype": str(mc.dtype).removeprefix("torch."),
                "aliases": json.dumps(aliases)}
        folder = os.path.join(out, name, f"tp{tp}" + ("_ep" if ep else ""))
        os.makedirs(folder, exist_ok=True)
        save_file(tensors, os.path.join(folder, f"rank{rank}.safetensors"), metadata=meta)
        del model
    ps.destroy_model_parallel()
    ps.destroy_distributed_environment()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--ep", action="store_true", help="ep_size = tp (SGLang's --ep-size)")
    ap.add_argument("--out", required=True)
    ap.add_argument("checkpoints", nargs="+", help="NAME=CHECKPOINT_DIR")
    args = ap.parse_args(argv)
    checkpoints = []
    for item in args.checkpoints:
        name, eq, path = item.partition("=")
        if not eq or not os.path.isfile(os.path.join(path, "config.json")):
            ap.error(f"{item!r}: expected NAME=CHECKPOINT_DIR with a config.json")
        checkpoints.append((name, os.path.abspath(path)))
    _quiet()
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank, args=(args.tp, args.ep, port, args.out, checkpoints),
                       nprocs=args.tp, start_method="spawn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
