"""Hugging Face DeepSeek-V3 / Kimi-K2 safetensors <-> coder parameters.

`load_hf(path)` reads `config.json` and the safetensors shards of a DeepseekV3ForCausalLM
checkpoint (DeepSeek-V3, Kimi-K2: same layout) shard by shard, converting each tensor as it is
read; a parameter is moved to the device as soon as all its pieces (e.g. every expert of a
stacked expert weight) have arrived, so the host holds one shard plus the incomplete stacks.
FP8 (`float8_e4m3fn`) weights with a `weight_scale_inv` are dequantized block-wise:
    W[i, j] = W_fp8[i, j] * scale_inv[i // 128, j // 128].
MTP modules are stored as extra layers `model.layers.{num_hidden_layers + k}.*` (enorm, hnorm,
eh_proj, shared_head.norm, and a full decoder layer); Hugging Face's model ignores them.

Layout conversion (HF Linear weights are `[out, in]`; ours `[in, ...out]`):
    q_proj / q_b_proj [H*dq, in]  -> [in, H, dq]      kv_b_proj [H*(dn+dv), r] -> [r, H, dn+dv]
    o_proj [D, H*dv]              -> [H, dv, D]       mlp.gate.weight [E, D]   -> router [D, E]
    experts.{e}.gate/up [F, D]    -> wg/wu[e] [D, F]  experts.{e}.down [D, F]  -> wd[e] [F, D]
"""
from __future__ import annotations

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from coder.model import sharding

FP8_BLOCK = 128

# suffix -> (our path below the layer, conversion)
_ATTN = {
    "self_attn.q_proj.weight": (("self_attn", "q_proj"), "heads"),
    "self_attn.q_a_proj.weight": (("self_attn", "q_a_proj"), "T"),
    "self_attn.q_a_layernorm.weight": (("self_attn", "q_a_layernorm", "weight"), "id"),
    "self_attn.q_b_proj.weight": (("self_attn", "q_b_proj"), "heads"),
    "self_attn.kv_a_proj_with_mqa.weight": (("self_attn", "kv_a_proj"), "T"),
    "self_attn.kv_a_layernorm.weight": (("self_attn", "kv_a_layernorm", "weight"), "id"),
    "self_attn.kv_b_proj.weight": (("self_attn", "kv_b_proj"), "heads"),
    "self_attn.o_proj.weight": (("self_attn", "o_proj"), "o"),
    "input_layernorm.weight": (("input_layernorm", "weight"), "id"),
    "post_attention_layernorm.weight": (("post_attention_layernorm", "weight"), "id"),
    "mlp.gate_proj.weight": (("mlp", "gate_proj"), "T"),
    "mlp.up_proj.weight": (("mlp", "up_proj"), "T"),
    "mlp.down_proj.weight": (("mlp", "down_proj"), "T"),
    "mlp.gate.weight": (("mlp", "router"), "T"),
    "mlp.gate.e_score_correction_bias": (("mlp", "bias"), "id"),
    "mlp.shared_experts.gate_proj.weight": (("mlp", "shared", "gate_proj"), "T"),
    "mlp.shared_experts.up_proj.weight": (("mlp", "shared", "up_proj"), "T"),
    "mlp.shared_experts.down_proj.weight": (("mlp", "shared", "down_proj"), "T"),
}
_MTP = {
    "enorm.weight": (("enorm", "weight"), "id"),
    "hnorm.weight": (("hnorm", "weight"), "id"),
    "eh_proj.weight": (("eh_proj",), "T"),
    "shared_head.norm.weight": (("shared_head_norm", "weight"), "id"),
}
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_EXPERT_NAME = {"gate": "wg", "up": "wu", "down": "wd"}
# Copies of shared tensors that MTP layers carry in DeepSeek checkpoints; ours are shared.
_MTP_SHARED = ("embed_tokens.weight", "shared_head.head.weight")


# ----------------------------------------------------------------------------- config
def config_from_hf(hf: dict):
    """A coder model config (coder.model.config schema) from an HF config.json dict."""
    from coder.model.config import model_config

    m = model_config()
    for key in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                "num_hidden_layers", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
                "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "n_shared_experts",
                "num_experts_per_tok", "n_group", "topk_group", "routed_scaling_factor",
                "norm_topk_prob", "first_k_dense_replace", "rms_norm_eps",
                "max_position_embeddings", "tie_word_embeddings", "initializer_range"):
        if hf.get(key) is not None:
            m[key] = type(m[key])(hf[key])
    m.q_lora_rank = int(hf.get("q_lora_rank") or 0)
    m.n_group = int(hf.get("n_group") or 1)
    m.topk_group = int(hf.get("topk_group") or 1)
    m.num_mtp_layers = int(hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 0)) or 0)
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    m.rope_theta = float(hf.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    kind = rope.get("type") or rope.get("rope_type") or "none"
    if kind == "default":
        kind = "none"
    if kind not in ("none", "yarn"):
        raise ValueError(f"rope type {kind!r} in config.json is not supported (none | yarn)")
    rs = m.rope_scaling
    rs.type = kind
    if kind == "yarn":
        rs.factor = float(rope["factor"])
        rs.original_max_position_embeddings = int(rope["original_max_position_embeddings"])
        rs.beta_fast = float(rope.get("beta_fast") or 32)
        rs.beta_slow = float(rope.get("beta_slow") or 1)
        rs.mscale = float(rope.get("mscale") or 0)
        rs.mscale_all_dim = float(rope.get("mscale_all_dim") or 0)
    if hf.get("rope_interleave") is False:
        raise ValueError("rope_interleave=False checkpoints are not supported (DeepSeek uses True)")
    return m


def hf_config(model_cfg) -> dict:
    """HF config.json dict (DeepseekV3Config) for a coder model config."""
    m = model_cfg
    keys = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
            "num_hidden_layers", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
            "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "n_shared_experts",
            "num_experts_per_tok", "n_group", "topk_group", "routed_scaling_factor",
            "norm_topk_prob", "first_k_dense_replace", "rms_norm_eps", "rope_theta",
            "max_position_embeddings", "tie_word_embeddings", "initializer_range")
    out = {k: m[k] for k in keys}
    out.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
               q_lora_rank=m.q_lora_rank or None, num_key_value_heads=m.num_attention_heads,
               num_nextn_predict_layers=m.num_mtp_layers, hidden_act="silu",
               attention_bias=False, rope_interleave=True, torch_dtype="float32")
    rs = m.rope_scaling
    out["rope_scaling"] = None if rs.type == "none" else dict(
        type="yarn", factor=rs.factor, original_max_position_embeddings=rs.original_max_position_embeddings,
        beta_fast=rs.beta_fast, beta_slow=rs.beta_slow, mscale=rs.mscale, mscale_all_dim=rs.mscale_all_dim)
    return out


# ----------------------------------------------------------------------------- tensors
def dequant_fp8(w: np.ndarray, scale_inv: np.ndarray, block: int = FP8_BLOCK) -> np.ndarray:
    """Block-wise FP8 dequantization: w `[M, N]` times scale_inv `[ceil(M/b), ceil(N/b)]`."""
    m, n = w.shape
    s = np.repeat(np.repeat(scale_inv.astype(np.float32), block, axis=0), block, axis=1)[:m, :n]
    return w.astype(np.float32) * s


def _target(name: str, n_layers: int):
    """HF tensor name -> (our path tuple, conversion, expert index) or None to skip."""
    if name == "model.embed_tokens.weight":
        return ("embed",), "id", None
    if name == "model.norm.weight":
        return ("norm", "weight"), "id", None
    if name == "lm_head.weight":
        return ("lm_head",), "T", None
    mt = re.match(r"model\.layers\.(\d+)\.(.+)$", name)
    if not mt:
        return None
    i, rest = int(mt.group(1)), mt.group(2)
    if i < n_layers:
        base = ("layers", i)
    else:
        k = i - n_layers
        if rest in _MTP_SHARED:
            return None
        if rest in _MTP:
            path, conv = _MTP[rest]
            return ("mtp", k) + path, conv, None
        base = ("mtp", k, "block")
    if rest in _ATTN:
        path, conv = _ATTN[rest]
        return base + path, conv, None
    me = _EXPERT.search(rest)
    if me:
        return base + ("mlp", _EXPERT_NAME[me.group(2)]), "T", int(me.group(1))
    if rest == "mlp.experts.gate_up_proj":  # transformers>=5 fused layout [E, 2F, D]
        return base + ("mlp",), "gate_up", None
    if rest == "mlp.experts.down_proj":  # [E, D, F]
        return base + ("mlp", "wd"), "down_fused", None
    return None


def _convert(w: np.ndarray, conv: str, shape) -> np.ndarray:
    if conv == "id":
        return w
    if conv == "T":
        return w.T
    if conv == "heads":  # [H*dq, in] -> [in, H, dq]
        return w.T.reshape(shape)
    if conv == "o":  # [D, H*dv] -> [H, dv, D]
        return w.T.reshape(shape)
    if conv == "down_fused":
        return w.transpose(0, 2, 1)
    raise ValueError(conv)


def _read(handle, name: str, scale_lookup) -> np.ndarray:
    import torch

    t = handle.get_tensor(name)
    if t.dtype in (torch.float8_e4m3fn, getattr(torch, "float8_e5m2", None)):
        scale = scale_lookup(name + "_scale_inv")
        if scale is None:
            raise ValueError(f"{name} is FP8 but has no {name}_scale_inv")
        return dequant_fp8(t.float().numpy(), scale.float().numpy())
    return t.float().numpy()


def load_hf(path: str, dtype=jnp.float32, mesh=None, rules=None, scan_layers: bool = False):
    """Read an HF DeepSeek-V3 / Kimi-K2 checkpoint directory -> (model_cfg, Transformer).

    `dtype` is the parameter dtype (model_cfg.param_dtype); streaming, shard by shard. With a
    `mesh` (and `rules`, default the config's), each parameter is placed in its final sharding
    as soon as it is complete, so no device holds the whole model. scan_layers: build the
    model with model.scan_layers (MoE layers stacked into moe_stack.*, see coder/model/config.py).
    """
    from safetensors import safe_open

    from coder.model.transformer import Transformer

    with open(os.path.join(path, "config.json")) as f:
        cfg = config_from_hf(json.load(f))
    if mesh is not None and rules is None:
        from coder.model.config import default_rules

        rules = default_rules()
    cfg.scan_layers = bool(scan_layers)  # HF files are per layer; stacked here when asked
    cfg.param_dtype = jnp.dtype(dtype).name
    cfg.dtype = jnp.dtype(dtype).name if jnp.dtype(dtype) == jnp.float32 else cfg.dtype
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    flat = dict(nnx.to_flat_state(state))
    index_file = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index_file):
        with open(index_file) as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        weight_map = {}

    def scale_lookup(name):
        fname = weight_map.get(name)
        cands = [fname] if fname else files
        for fn in cands:
            with safe_open(os.path.join(path, fn), framework="pt") as h:
                if name in h.keys():
                    return h.get_tensor(name)
        return None

    n_layers = cfg.num_hidden_layers
    # with model.scan_layers the MoE layers live stacked in moe_stack.* ([layers, ...])
    n_unstacked = len(abstract.layers) if abstract.moe_stack is not None else n_layers
    pending: dict = {}  # path -> (numpy stack, set of filled (layer, expert) slots)
    done: set = set()

    def finish(p, arr):
        var = flat[p]
        arr = np.asarray(arr, dtype=var.get_value().dtype)
        if mesh is not None:
            spec = sharding.logical_to_spec(var.get_metadata().get("logical_axes") or (), rules)
            flat[p] = var.replace(jax.device_put(arr, jax.sharding.NamedSharding(mesh, spec)))
        else:
            flat[p] = var.replace(jnp.asarray(arr))
        done.add(p)

    for fn in files:
        with safe_open(os.path.join(path, fn), framework="pt") as h:
            for name in h.keys():
                if name.endswith("_scale_inv"):
                    continue
                tgt = _target(name, n_layers)
                if tgt is None:
                    continue
                p, conv, expert = tgt
                layer = ()  # index into a stacked (scanned) layer axis
                if p[0] == "layers" and p[1] >= n_unstacked:
                    p, layer = ("moe_stack",) + p[2:], (p[1] - n_unstacked,)
                if conv == "gate_up":
                    w = _read(h, name, scale_lookup)  # [E, 2F, D]
                    f_ = w.shape[1] // 2
                    parts = {"wg": w[:, :f_].transpose(0, 2, 1), "wu": w[:, f_:].transpose(0, 2, 1)}
                else:
                    if p not in flat:
                        raise ValueError(f"checkpoint tensor {name} maps to {p}, absent in the model config")
                    shape = flat[p].get_value().shape[len(layer):]
                    w = _read(h, name, scale_lookup)
                    parts = {None: w.T if expert is not None else _convert(w, conv, shape)}
                for leaf, value in parts.items():
                    q = p + ((leaf,) if leaf else ())
                    slot = layer + ((expert,) if expert is not None else ())
                    if not slot:
                        finish(q, value)
                        continue
                    full = flat[q].get_value().shape
                    stack, filled = pending.setdefault(q, (np.zeros(full, np.float32), set()))
                    stack[slot] = value
                    filled.add(slot)
                    if len(filled) == int(np.prod(full[:len(slot)])):
                        finish(q, stack)
                        del pending[q]
    missing = [p for p in flat if p not in done and not (p[-1] == "lm_head" and cfg.tie_word_embeddings)]
    if missing:
        raise ValueError(f"checkpoint {path} lacks {len(missing)} tensors, e.g. {missing[:5]}")
    model = nnx.merge(graphdef, nnx.from_flat_state(flat))
    return cfg, model


# ----------------------------------------------------------------------------- export
def _export_tensors(model_cfg, state_flat):
    """Yield (hf_name, numpy float32) for every parameter, in HF layout."""
    rev_attn = {v[0]: (k, v[1]) for k, v in _ATTN.items()}
    rev_mtp = {v[0]: (k, v[1]) for k, v in _MTP.items()}
    n_layers = model_cfg.num_hidden_layers
    n_unstacked = min(model_cfg.first_k_dense_replace, n_layers)
    unstacked = []  # moe_stack.* [layers, ...] -> layers.{i}.* (HF has no stacked layout)
    for p, var in state_flat:
        if p[0] == "moe_stack":
            w = np.asarray(jax.device_get(var.get_value()))
            unstacked += [(("layers", n_unstacked + j) + p[1:], w[j]) for j in range(w.shape[0])]
        else:
            unstacked.append((p, var.get_value()))
    for p, value in unstacked:
        w = np.asarray(jax.device_get(value), np.float32)
        if p == ("embed",):
            yield "model.embed_tokens.weight", w
            for k in range(model_cfg.num_mtp_layers):
                yield f"model.layers.{n_layers + k}.embed_tokens.weight", w
            continue
        if p == ("norm", "weight"):
            yield "model.norm.weight", w
            continue
        if p == ("lm_head",):
            yield "lm_head.weight", w.T
            for k in range(model_cfg.num_mtp_layers):
                yield f"model.layers.{n_layers + k}.shared_head.head.weight", w.T
            continue
        if p[0] == "layers":
            prefix, rest = f"model.layers.{p[1]}.", p[2:]
        elif p[0] == "mtp":
            prefix = f"model.layers.{n_layers + p[1]}."
            if p[2:] in rev_mtp:
                name, _ = rev_mtp[p[2:]]
                yield prefix + name, w.T if p[2:] == ("eh_proj",) else w
                continue
            rest = p[3:]  # below "block"
        else:
            raise ValueError(f"no HF name for parameter {p}")
        if rest in (("mlp", "wg"), ("mlp", "wu"), ("mlp", "wd")):
            kind = {"wg": "gate", "wu": "up", "wd": "down"}[rest[1]]
            for e in range(w.shape[0]):
                yield prefix + f"mlp.experts.{e}.{kind}_proj.weight", np.ascontiguousarray(w[e].T)
            continue
        name, conv = rev_attn[rest]
        if conv == "id":
            yield prefix + name, w
        elif conv == "T":
            yield prefix + name, np.ascontiguousarray(w.T)
        elif conv == "heads":
            yield prefix + name, np.ascontiguousarray(w.reshape(w.shape[0], -1).T)
        elif conv == "o":
            yield prefix + name, np.ascontiguousarray(w.reshape(-1, w.shape[-1]).T)


def save_hf(model_cfg, model, path: str, max_shard_bytes: int = 2 << 30) -> None:
    """Write config.json + safetensors shards + index, in the DeepSeek-V3 HF layout."""
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config(model_cfg), f, indent=2)
    state = nnx.to_flat_state(nnx.state(model))
    weight_map, shard, size, n = {}, {}, 0, 0

    def flush():
        nonlocal shard, size, n
        if shard:
            fname = f"model-{n:05d}.safetensors"
            save_file(shard, os.path.join(path, fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in shard})
            shard, size, n = {}, 0, n + 1

    for name, w in _export_tensors(model_cfg, state):
        shard[name] = np.ascontiguousarray(w)  # safetensors writes the raw buffer, ignoring strides
        size += w.nbytes
        if size >= max_shard_bytes:
            flush()
    flush()
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)
