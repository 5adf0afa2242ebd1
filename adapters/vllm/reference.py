"""A deliberately simple, independent reference of vLLM 0.33.0's weight loading.

``reference_load`` builds one worker's parameters the way vLLM's modules
allocate them and pushes every on-disk checkpoint tensor through a loader
written the way vLLM's ``weight_loader`` methods work: pick the fused
parameter by ``stacked_params_mapping``/expert mapping, narrow the checkpoint
tensor to this rank's shard, narrow the parameter to the shard's slot, copy.
It shares no code with the family tables, ``table.py`` or ``layout.py`` of
this package, so agreement between the two is a real cross-check; the oracle
tests pin this module to the real vLLM dumps in ``tests/data/oracle``.

It is slow by design (full tensors, one worker per call, Python loops over
experts) and meant for tests only. Sources restated (vLLM 0.33.0,
``vllm/model_executor/``): ``layers/linear.py`` (``QKVParallelLinear``,
``MergedColumnParallelLinear``, ``RowParallelLinear`` ``weight_loader``),
``layers/vocab_parallel_embedding.py`` (``weight_loader``, ``pad_vocab_size``),
``layers/fused_moe/routed_experts.py`` (``weight_loader``, ``_load_w13``,
``_load_w2``), ``layers/fused_moe/config.py`` (``FusedMoEParallelConfig.make``),
``layers/fused_moe/expert_map_manager.py`` (linear ``determine_expert_map``),
``models/utils.py`` (``AutoWeightsLoader``: rotary caches and tied aliases
skipped), and the model files ``llama.py``, ``qwen2.py``, ``qwen3.py``,
``qwen3_moe.py``, ``mixtral.py``.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from .spec import InferenceSpec, parse_inference_spec

__all__ = ["reference_load"]


def _get(config: Any, key: str, default: Any = None) -> Any:
    value = config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)
    return default if value is None else value


def _dtype(config: Any) -> torch.dtype:
    d = _get(config, "dtype", _get(config, "torch_dtype", "float32"))
    if isinstance(d, torch.dtype):
        return d
    return getattr(torch, str(d).replace("torch.", ""))


class _Worker:
    """One vLLM worker's parameters and their weight loaders."""

    def __init__(self, config: Any, spec: InferenceSpec, worker: int, fill: float):
        self.config = config
        self.dtype = _dtype(config)
        self.fill = fill
        self.tp = spec.tp
        self.tp_rank = worker % spec.tp
        world = spec.tp * spec.dp
        # fused_moe/config.py FusedMoEParallelConfig.make: tp flattened over
        # dp; with EP the flattened group becomes the EP group, tp_moe = 1.
        self.use_ep = spec.ep and world > 1
        self.moe_tp, self.moe_rank = (1, 0) if self.use_ep else (world, worker)
        self.ep_size, self.ep_rank = (world, worker) if self.use_ep else (1, 0)
        self.params: dict[str, torch.Tensor] = {}
        self.loaders: dict[str, Callable] = {}
        self.aliases: dict[str, str] = {}

    def new(self, name: str, shape, loader: Callable) -> None:
        self.params[name] = torch.full(tuple(shape), self.fill, dtype=self.dtype)
        self.loaders[name] = loader

    # -- modules ---------------------------------------------------------

    def replicated(self, name: str, shape) -> None:
        def load(param, w, shard_id=None):
            assert param.shape == w.shape, (name, param.shape, w.shape)
            param.copy_(w)
        self.new(name, shape, load)

    def vocab_parallel(self, name: str, vocab: int, hidden: int) -> None:
        padded = (vocab + 63) // 64 * 64
        per = padded // self.tp
        assert per * self.tp == padded
        start = min(self.tp_rank * per, vocab)
        end = min((self.tp_rank + 1) * per, vocab)

        def load(param, w, shard_id=None):
            assert w.shape[0] == vocab
            piece = w.narrow(0, start, end - start)
            param[: piece.shape[0]].copy_(piece)
            param[piece.shape[0]:].fill_(0)
        self.new(name, (per, hidden), load)

    def qkv_parallel(self, prefix: str, hidden: int, head_dim: int, nh: int, nkv: int,
                     bias: bool) -> None:
        tp, rank = self.tp, self.tp_rank
        assert nh % tp == 0
        num_heads = nh // tp
        if tp >= nkv:
            assert tp % nkv == 0
            num_kv, replicas = 1, tp // nkv
        else:
            assert nkv % tp == 0
            num_kv, replicas = nkv // tp, 1
        rows = (num_heads + 2 * num_kv) * head_dim

        def load(param, w, shard_id):
            if shard_id == "q":
                offset, size, src = 0, num_heads * head_dim, rank
            elif shard_id == "k":
                offset, size, src = num_heads * head_dim, num_kv * head_dim, rank // replicas
            else:
                offset, size = (num_heads + num_kv) * head_dim, num_kv * head_dim
                src = rank // replicas
            param.narrow(0, offset, size).copy_(w.narrow(0, src * size, size))
        self.new(f"{prefix}.weight", (rows, hidden), load)
        if bias:
            self.new(f"{prefix}.bias", (rows,), load)

    def merged_column(self, prefix: str, hidden: int, sizes: list[int], bias: bool) -> None:
        tp, rank = self.tp, self.tp_rank
        assert all(n % tp == 0 for n in sizes)

        def load(param, w, shard_id):
            offset = sum(sizes[:shard_id]) // tp
            size = sizes[shard_id] // tp
            param.narrow(0, offset, size).copy_(w.narrow(0, rank * size, size))
        self.new(f"{prefix}.weight", (sum(sizes) // tp, hidden), load)
        if bias:
            self.new(f"{prefix}.bias", (sum(sizes) // tp,), load)

    def row_parallel(self, prefix: str, n_in: int, n_out: int, bias: bool) -> None:
        tp, rank = self.tp, self.tp_rank
        assert n_in % tp == 0

        def load_weight(param, w, shard_id=None):
            size = param.shape[1]
            param.copy_(w.narrow(1, rank * size, size))
        self.new(f"{prefix}.weight", (n_out, n_in // tp), load_weight)
        if bias:
            self.replicated(f"{prefix}.bias", (n_out,))

    def fused_moe(self, prefix: str, experts: int, hidden: int, inter: int) -> None:
        assert inter % self.moe_tp == 0 and experts % self.ep_size == 0
        local = experts // self.ep_size
        first = self.ep_rank * local          # linear expert placement
        inter_local = inter // self.moe_tp
        moe_tp, moe_rank = self.moe_tp, self.moe_rank

        def load(param, w, expert_id, shard_id):
            if not first <= expert_id < first + local:
                return                         # not an expert of this EP rank
            dst = param[expert_id - first]
            if shard_id in ("w1", "w3"):       # _load_w13: shard dim 0
                half = dst.shape[0] // 2
                per_rank = w.shape[0] // moe_tp
                piece = w.narrow(0, moe_rank * per_rank, per_rank)
                dst.narrow(0, 0 if shard_id == "w1" else half, half).copy_(piece)
            else:                              # _load_w2: shard dim 1
                per_rank = w.shape[1] // moe_tp
                dst.copy_(w.narrow(1, moe_rank * per_rank, per_rank))
        self.new(f"{prefix}.routed_experts.w13_weight", (local, 2 * inter_local, hidden), load)
        self.new(f"{prefix}.routed_experts.w2_weight", (local, hidden, inter_local), load)


# -- models ----------------------------------------------------------------

def _head_dim(config: Any, arch: str) -> int:
    H, nh = _get(config, "hidden_size"), _get(config, "num_attention_heads")
    if arch == "Qwen2ForCausalLM":
        return H // nh                          # Qwen2Attention ignores head_dim
    return _get(config, "head_dim") or H // nh


def _num_experts(config: Any) -> int:
    return _get(config, "num_experts", _get(config, "num_local_experts", 0))


def _qwen3_moe_sparse(config: Any, layer: int) -> bool:
    only = _get(config, "mlp_only_layers", []) or []
    step = _get(config, "decoder_sparse_step", 1)
    return layer not in only and _num_experts(config) > 0 and (layer + 1) % step == 0


def _build(config: Any, arch: str, w: _Worker) -> tuple[list, list]:
    """Allocate the model's params; return (stacked mapping, expert mapping)."""
    H = _get(config, "hidden_size")
    V = _get(config, "vocab_size")
    nh = _get(config, "num_attention_heads")
    nkv = _get(config, "num_key_value_heads", nh)
    hd = _head_dim(config, arch)
    attn_bias = bool(_get(config, "attention_bias", False))
    w.vocab_parallel("model.embed_tokens.weight", V, H)
    expert_map: list = []
    for i in range(_get(config, "num_hidden_layers")):
        p = f"model.layers.{i}"
        if arch == "LlamaForCausalLM":
            bias = attn_bias or bool(_get(config, "bias", False))
            qkv_bias, o_bias = bool(_get(config, "qkv_bias", bias)), bias
        elif arch == "Qwen2ForCausalLM":
            qkv_bias, o_bias = True, False
        elif arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
            qkv_bias, o_bias = attn_bias, False
        else:
            qkv_bias, o_bias = False, False
        w.qkv_parallel(f"{p}.self_attn.qkv_proj", H, hd, nh, nkv, qkv_bias)
        w.row_parallel(f"{p}.self_attn.o_proj", nh * hd, H, o_bias)
        if arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
            w.replicated(f"{p}.self_attn.q_norm.weight", (hd,))
            w.replicated(f"{p}.self_attn.k_norm.weight", (hd,))
        if arch == "MixtralForCausalLM":
            E, inter = _get(config, "num_local_experts"), _get(config, "intermediate_size")
            w.replicated(f"{p}.block_sparse_moe.gate.weight", (E, H))
            w.fused_moe(f"{p}.block_sparse_moe.experts", E, H, inter)
        elif arch == "Qwen3MoeForCausalLM" and _qwen3_moe_sparse(config, i):
            E = _num_experts(config)
            w.replicated(f"{p}.mlp.gate.weight", (E, H))
            w.aliases[f"{p}.mlp.experts.gate.weight"] = f"{p}.mlp.gate.weight"
            w.fused_moe(f"{p}.mlp.experts", E, H, _get(config, "moe_intermediate_size"))
        else:
            inter = _get(config, "intermediate_size")
            mlp_bias = arch == "LlamaForCausalLM" and bool(_get(config, "mlp_bias", False))
            w.merged_column(f"{p}.mlp.gate_up_proj", H, [inter, inter], mlp_bias)
            w.row_parallel(f"{p}.mlp.down_proj", inter, H, mlp_bias)
        w.replicated(f"{p}.input_layernorm.weight", (H,))
        w.replicated(f"{p}.post_attention_layernorm.weight", (H,))
    w.replicated("model.norm.weight", (H,))
    if _get(config, "tie_word_embeddings", False):
        w.aliases["lm_head.weight"] = "model.embed_tokens.weight"
    else:
        w.vocab_parallel("lm_head.weight", V, H)

    stacked = [
        (".qkv_proj.", ".q_proj.", "q"), (".qkv_proj.", ".k_proj.", "k"),
        (".qkv_proj.", ".v_proj.", "v"),
        (".gate_up_proj.", ".gate_proj.", 0), (".gate_up_proj.", ".up_proj.", 1),
    ]
    if arch == "MixtralForCausalLM":
        E, names = _get(config, "num_local_experts"), ("w1", "w3", "w2")
    elif arch == "Qwen3MoeForCausalLM":
        E, names = _num_experts(config), ("gate_proj", "up_proj", "down_proj")
    else:
        E, names = 0, ()
    for e in range(E):
        for ckpt, shard_id in zip(names, ("w1", "w3", "w2")):
            param = "routed_experts.w2_weight" if shard_id == "w2" else "routed_experts.w13_weight"
            expert_map.append((f"experts.{param}", f"experts.{e}.{ckpt}.weight", e, shard_id))
    return stacked, expert_map


_ARCHS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
          "Qwen3MoeForCausalLM", "MixtralForCausalLM")


def reference_load(
    config: Any,
    checkpoint_tensors: Mapping[str, torch.Tensor],
    spec: InferenceSpec | str,
    worker: int,
    *,
    fill: float = 0.0,
) -> dict[str, torch.Tensor]:
    """One worker's vLLM parameters after loading a full checkpoint.

    Args:
        config: HF config object or ``config.json`` dict.
        checkpoint_tensors: FULL tensors under on-disk checkpoint names
            (per-expert ``mlp.experts.{e}.gate_proj.weight``, Mixtral
            ``block_sparse_moe.experts.{e}.w1.weight``).
        spec: ``InferenceSpec`` or ``"vllm:tp=T[,dp=D][,ep]"``.
        worker: ``dp_index * tp + tp_rank``.
        fill: initial value of every parameter (``nan`` shows what no loader
            wrote, like the oracle's ``--fill nan``).

    Returns:
        ``{vLLM name: local tensor}`` in the config dtype, including aliases
        (tied ``lm_head.weight``, Qwen3-MoE ``mlp.experts.gate.weight``) as
        the same tensor object, like ``named_parameters(remove_duplicate=False)``.

    Raises:
        ValueError: an unsupported architecture, a worker out of range, or a
            checkpoint tensor no parameter takes.
    """
    spec = parse_inference_spec(spec)
    arch = (_get(config, "architectures") or [None])[0]
    if arch not in _ARCHS:
        raise ValueError(f"reference_load: architecture {arch!r} is not one of {list(_ARCHS)}")
    if not 0 <= worker < spec.tp * spec.dp:
        raise ValueError(f"reference_load: worker {worker} is not in 0..{spec.tp * spec.dp - 1}")
    w = _Worker(config, spec, worker, fill)
    stacked, expert_map = _build(config, arch, w)
    with torch.no_grad():
        for name, tensor in checkpoint_tensors.items():
            if "rotary_emb." in name or name in w.aliases:
                continue                                    # AutoWeightsLoader skips
            done = False
            if ".experts." in name:
                for param_part, ckpt_part, expert_id, shard_id in expert_map:
                    if ckpt_part in name:
                        pname = name.replace(ckpt_part, param_part)
                        w.loaders[pname](w.params[pname], tensor, expert_id, shard_id)
                        done = True
                        break
            if not done:
                for param_part, ckpt_part, shard_id in stacked:
                    if ckpt_part in name:
                        pname = name.replace(ckpt_part, param_part)
                        if pname in w.params:
                            w.loaders[pname](w.params[pname], tensor, shard_id)
                            done = True
                        break
            if not done:
                if name not in w.params:
                    raise ValueError(f"reference_load: no {arch} parameter takes '{name}'")
                w.loaders[name](w.params[name], tensor)
    out = dict(w.params)
    for alias, canonical in w.aliases.items():
        out[alias] = out[canonical]
    return out
