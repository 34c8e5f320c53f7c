"""coder parameters -> a Hugging Face DeepSeek-V3 checkpoint directory, without torch: the
inverse of coder.model.hf_import (same tensor names and layouts, its tables), so transformers'
DeepseekV3ForCausalLM loads a trained coder model.

    save_hf(config.model, model, DIR, tokenizer=tok)

writes config.json, safetensors shards of at most `max_shard_bytes`, their index
(model.safetensors.index.json) and the tokenizer's files. Routed experts are written per expert
(`mlp.experts.{e}.{gate,up,down}_proj.weight`), stacked MoE layers unstacked, the MTP modules as
layers `num_hidden_layers + k`.
"""
from __future__ import annotations

import json

import fsspec
import jax
import numpy as np
from flax import nnx
from safetensors.numpy import save

from coder.model.hf_import import INDEX, REV_ATTN, REV_MTP, hf_config


def _export_tensors(model_cfg, state_flat):
    """Yield (hf_name, numpy float32) for every parameter, in HF layout."""
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
            if p[2:] in REV_MTP:
                name, _ = REV_MTP[p[2:]]
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
        name, conv = REV_ATTN[rest]
        if conv == "id":
            yield prefix + name, w
        elif conv == "T":
            yield prefix + name, np.ascontiguousarray(w.T)
        elif conv == "heads":
            yield prefix + name, np.ascontiguousarray(w.reshape(w.shape[0], -1).T)
        elif conv == "o":
            yield prefix + name, np.ascontiguousarray(w.reshape(-1, w.shape[-1]).T)


def save_hf(model_cfg, model, path: str, max_shard_bytes: int = 2 << 30, tokenizer=None) -> None:
    """Write config.json + safetensors shards + index, in the DeepSeek-V3 HF layout, so
    transformers' DeepseekV3ForCausalLM loads it; the MTP modules are layers
    `num_hidden_layers + k` (DeepSeek-V3's names; transformers ignores them). `tokenizer`: the
    checkpoint's tokenizer (coder.data.tokenizer); a pretrained kind writes files transformers'
    AutoTokenizer loads (`export_hf`: tokenizer.json with the added chat tokens, a chat template),
    coder's own sentencepiece kind its tokenizer.model; bos / eos ids go into config.json. `path`:
    a local directory or an fsspec URL (gs://...); each shard is serialised in memory, then written."""
    fs, root = fsspec.core.url_to_fs(path)
    fs.makedirs(root, exist_ok=True)

    def join(name):
        return f"{root.rstrip('/')}/{name}"

    config = hf_config(model_cfg)
    if tokenizer is not None:
        config.update(bos_token_id=int(tokenizer.bos_id), eos_token_id=int(tokenizer.eos_id))
        if hasattr(tokenizer, "export_hf"):
            tokenizer.export_hf(path)
        else:
            for name, data in tokenizer.files().items():
                with fs.open(join(name), "wb") as f:
                    f.write(data)
    with fs.open(join("config.json"), "w") as f:
        json.dump(config, f, indent=2)
    state = nnx.to_flat_state(nnx.state(model))
    weight_map, shard, size, n = {}, {}, 0, 0

    def flush():
        nonlocal shard, size, n
        if shard:
            fname = f"model-{n:05d}.safetensors"
            with fs.open(join(fname), "wb") as f:
                f.write(save(shard, metadata={"format": "pt"}))
            weight_map.update({k: fname for k in shard})
            shard, size, n = {}, 0, n + 1

    for name, w in _export_tensors(model_cfg, state):
        shard[name] = np.ascontiguousarray(w)  # safetensors writes the raw buffer, ignoring strides
        size += w.nbytes
        if size >= max_shard_bytes:
            flush()
    flush()
    with fs.open(join(INDEX), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)
