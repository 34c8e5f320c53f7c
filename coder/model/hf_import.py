"""Hugging Face DeepSeek-V3 / Kimi-K2 safetensors <-> coder parameters, without torch.

`import_into(model, path)` fills a built (sharded) coder Transformer from a
DeepseekV3ForCausalLM checkpoint directory (`config.json` + safetensors shards, local or gs://;
DeepSeek-V3, Kimi-K2: same layout): every variable is assembled in its own sharding, device
block by device block, each process reading only the blocks its devices hold, in shard order (a
shard is closed once every tensor it holds for the model is read). The shards are read
with safetensors' numpy framework (memory-mapped) or, remotely, by byte ranges; no torch.
FP8 (`float8_e4m3fn`) weights with a `weight_scale_inv` are dequantized block-wise:
    W[i, j] = W_fp8[i, j] * scale_inv[i // 128, j // 128].
INT4 weights in compressed-tensors' `pack-quantized` format (Kimi K2.5's routed experts:
symmetric, group-wise) are dequantized on import: `{name}.weight_packed` int32 `[out, in / 8]`
holds 8 4-bit values per word (value c at bits 4 (c % 8) of word c // 8, stored as q + 8),
`{name}.weight_scale` `[out, in / group]`:
    W[i, j] = (nibble(packed, i, j) - 8) * scale[i, j // group].
Kimi K2.5's multimodal wrapper (config.json `model_type` "kimi_k25", the text model's config
under `text_config`, its tensors under `language_model.`) is read as its text model; the vision
tower and projector are skipped (said in the log).
MTP modules are stored as extra layers `model.layers.{num_hidden_layers + k}.*` (enorm, hnorm,
eh_proj, shared_head.norm, and a full decoder layer); Hugging Face's model ignores them and
transformers saves none (its config still says num_nextn_predict_layers=1): a module the
checkpoint lacks starts fresh, a missing trunk tensor is an error naming it. Embedding and
output-head rows past the checkpoint's (chat tokens the tokenizer added) start at the mean row.

`load_hf(path)` builds the model from config.json and imports it; coder.model.hf_export's
`save_hf` writes the same layout back (with the tokenizer's files), so transformers loads a
trained coder model. A stage
starts from such a directory through `config.init_from` (coder.stages.inherit_model_config takes
the architecture from config.json, coder.train.state.load_into calls `import_into`,
coder.train.checkpoint.stage_tokenizer takes `tokenizer_of` the directory).

Layout conversion (HF Linear weights are `[out, in]`; ours `[in, ...out]`):
    q_proj / q_b_proj [H*dq, in]  -> [in, H, dq]      kv_b_proj [H*(dn+dv), r] -> [r, H, dn+dv]
    o_proj [D, H*dv]              -> [H, dv, D]       mlp.gate.weight [E, D]   -> router [D, E]
    experts.{e}.gate/up [F, D]    -> wg/wu[e] [D, F]  experts.{e}.down [D, F]  -> wd[e] [F, D]
"""
from __future__ import annotations

import functools
import json
import logging
import os
import re

import jax
import jax.numpy as jnp
import ml_dtypes
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
    rs.original_max_position_embeddings = m.max_position_embeddings  # the trained context
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


# ----------------------------------------------------------------------------- checkpoints
def is_hf_checkpoint(path: str) -> bool:
    """True when `path` (local or a URL etils.epath reads, gs://...) is a Hugging Face checkpoint
    directory: a config.json beside safetensors shards (a coder checkpoint has neither)."""
    if not path:
        return False
    try:
        from etils import epath

        p = epath.Path(path)
        if not (p / "config.json").exists():
            return False
        return (p / INDEX).exists() or any(f.name.endswith(".safetensors") for f in p.iterdir())
    except (OSError, ValueError):
        return False


def read_hf_config(path: str) -> dict:
    """The config.json of a Hugging Face checkpoint directory (local or gs://...); of a
    multimodal wrapper (Kimi K2.5: `text_config`), its text model's, with the wrapper's
    quantization_config when the text config has none."""
    from etils import epath

    hf = json.loads((epath.Path(path) / "config.json").read_text())
    if isinstance(hf.get("text_config"), dict):
        text = dict(hf["text_config"])
        if "quantization_config" not in text and hf.get("quantization_config"):
            text["quantization_config"] = hf["quantization_config"]
        text["wrapper_model_type"] = hf.get("model_type", "")
        return text
    return hf


def int4_group_size(qcfg: dict) -> int:
    """The group size of a compressed-tensors INT4 `pack-quantized` config (0: not one). Raises on
    a compressed-tensors scheme coder does not read (asymmetric, other bit widths, other formats)."""
    if (qcfg or {}).get("quant_method") != "compressed-tensors":
        return 0
    sizes = set()
    for name, group in (qcfg.get("config_groups") or {}).items():
        w = group.get("weights") or {}
        if (qcfg.get("format"), w.get("num_bits"), w.get("type"), w.get("symmetric"), w.get("strategy")) != (
                "pack-quantized", 4, "int", True, "group"):
            raise ValueError(f"compressed-tensors group {name}: format {qcfg.get('format')!r}, weights {w}: coder "
                             "reads symmetric INT4 pack-quantized group-wise weights only")
        sizes.add(int(w["group_size"]))
    if len(sizes) != 1:
        raise ValueError(f"compressed-tensors config with group sizes {sorted(sizes)}: one is supported")
    return sizes.pop()


# Model keys a Hugging Face checkpoint fixes: every key that sets a parameter's shape or what the
# trained model computes. A stage starting from one takes these from its config.json
# (coder.stages.inherit_model_config); num_mtp_layers, dtypes, remat, scan_layers, the attention
# backend and the MoE capacity stay the stage's own (missing MTP modules start fresh).
ARCH_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
             "num_hidden_layers", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
             "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
             "n_shared_experts", "num_experts_per_tok", "n_group", "topk_group",
             "routed_scaling_factor", "norm_topk_prob", "first_k_dense_replace", "rms_norm_eps",
             "rope_theta", "max_position_embeddings", "rope_scaling", "tie_word_embeddings")


@functools.lru_cache(maxsize=8)
def _tokenizer_of(path: str, tokenizer_path: str, chat: tuple, pattern: str):
    from coder.data.pretrained_tokenizer import load_pretrained

    hf = read_hf_config(path)
    return load_pretrained(tokenizer_path or path, dict(chat), first_new_id=int(hf["vocab_size"]),
                           pattern=pattern, model_config=hf)


def tokenizer_of(path: str, data_cfg):
    """The tokenizer a stage starting from the Hugging Face checkpoint `path` uses: the one
    beside it (or at `data.tokenizer` when set) with the chat tokens `data.chat_tokens` (the
    ones it lacks get ids from the checkpoint's vocab_size on: the embedding grows), and
    `data.tiktoken_pattern` for a tiktoken file (coder.data.pretrained_tokenizer.load_pretrained).
    Cached: the stage table and the stage ask for it with the same arguments."""
    chat = tuple(sorted(dict(data_cfg.chat_tokens).items()))
    return _tokenizer_of(path, str(data_cfg.tokenizer or ""), chat, str(data_cfg.tiktoken_pattern or ""))


# ----------------------------------------------------------------------------- reading shards
# safetensors dtype -> numpy (ml_dtypes for bfloat16 and float8, which numpy lacks)
_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
           "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
           "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
           "BOOL": np.bool_}
INDEX = "model.safetensors.index.json"


class _Shard:
    """One safetensors file, read lazily: the header (names, dtypes, shapes, offsets) when
    opened, then only the slices asked for. Local files through safetensors' numpy framework
    (memory-mapped; float8, which numpy cannot name, by a view of the mapped bytes); remote ones
    (gs://...) by byte ranges through fsspec: the rows of the leading axis a slice covers."""

    def __init__(self, path: str):
        self.path = path
        self.remote = "://" in path and not path.startswith("file://")
        if self.remote:
            import fsspec

            self._file = fsspec.open(path, "rb").open()
        else:
            self._file = open(path, "rb")
        n = int.from_bytes(self._file.read(8), "little")
        header = json.loads(self._file.read(n))
        header.pop("__metadata__", None)
        self.entries = {k: (v["dtype"], tuple(v["shape"]), tuple(v["data_offsets"])) for k, v in header.items()}
        self.data_start = 8 + n
        self._st = None

    def keys(self):
        return self.entries.keys()

    def shape(self, name: str) -> tuple:
        return self.entries[name][1]

    def dtype(self, name: str) -> str:
        return self.entries[name][0]

    def read(self, name: str, ranges) -> np.ndarray:
        """The block `ranges` ((start, stop) per axis) of tensor `name`, in its stored dtype."""
        dtype, shape, (begin, _) = self.entries[name]
        index = tuple(slice(a, b) for a, b in ranges)
        if dtype not in _DTYPES:
            raise ValueError(f"{self.path}: tensor {name} has dtype {dtype}, which coder does not read")
        np_dtype = np.dtype(_DTYPES[dtype])
        if not shape:
            ranges, index = (), ()
        if not self.remote and not dtype.startswith("F8"):
            if self._st is None:
                from safetensors import safe_open

                self._st = safe_open(self.path, framework="numpy")
            return np.asarray(self._st.get_slice(name)[index] if shape else self._st.get_tensor(name))
        row = int(np.prod(shape[1:], dtype=np.int64)) * np_dtype.itemsize
        r0, r1 = ranges[0] if shape else (0, 1)
        if self.remote:
            self._file.seek(self.data_start + begin + r0 * row)
            block = np.frombuffer(self._file.read((r1 - r0) * row), np_dtype)
        else:  # float8: a view of the mapped bytes of the rows asked for
            mm = np.memmap(self.path, np.uint8, "r", offset=self.data_start + begin + r0 * row,
                           shape=((r1 - r0) * row,))
            block = np.array(mm).view(np_dtype)
            del mm
        block = block.reshape((r1 - r0,) + tuple(shape[1:])) if shape else block.reshape(())
        return block[(slice(None),) + index[1:]] if shape else block

    def close(self):
        self._st = None
        self._file.close()


class _Checkpoint:
    """A Hugging Face checkpoint directory: which shard holds each tensor (the index, or every
    shard's header), shards opened when first read and closed by `release`, and float32 blocks of
    tensors with FP8 block dequantization."""

    def __init__(self, path: str, block: int = FP8_BLOCK, int4_group: int = 0):
        from etils import epath

        self.path = path
        self.block, self.int4_group = block, int(int4_group)
        d = epath.Path(path)
        self._open: dict[str, _Shard] = {}
        if (d / INDEX).exists():
            self.where = dict(json.loads((d / INDEX).read_text())["weight_map"])
            self.files = sorted(set(self.where.values()))
            self._shapes = {}
        else:
            self.files = sorted(f.name for f in d.iterdir() if f.name.endswith(".safetensors"))
            self.where, self._shapes = {}, {}
            for fn in self.files:
                shard = self._shard(fn)
                for k in shard.keys():
                    self.where[k] = fn
                self.release(fn)
        if not self.files:
            raise FileNotFoundError(f"{path}: no safetensors shards")
        self.order = {fn: i for i, fn in enumerate(self.files)}
        self._raw: dict[str, str] = {}  # our name -> the tensor's name in the checkpoint
        self.skipped: list[str] = []  # a multimodal wrapper's other towers
        prefix = "language_model."
        if any(n.startswith(prefix) for n in self.where):
            where = {}
            for n, fn in self.where.items():
                if n.startswith(prefix):
                    where[n[len(prefix):]] = fn
                    self._raw[n[len(prefix):]] = n
                else:
                    self.skipped.append(n)
            self.where = where
        self.int4: dict[str, tuple] = {}  # weight -> (packed, scale, scale's shard): INT4 pack-quantized
        for n in [n for n in self.where if n.endswith(".weight_packed")]:
            if not self.int4_group:
                raise ValueError(f"{path}: {n} is pack-quantized but config.json has no compressed-tensors "
                                 "quantization_config")
            base = n[:-len("_packed")]
            if base + "_scale" not in self.where:
                raise ValueError(f"{path}: {n} has no {base}_scale")
            self.where[base] = self.where.pop(n)
            self.int4[base] = (n, base + "_scale", self.where.pop(base + "_scale"))
            self.where.pop(base + "_shape", None)

    def raw(self, name: str) -> str:
        return self._raw.get(name, name)

    def _shard(self, fn: str) -> _Shard:
        if fn not in self._open:
            self._open[fn] = _Shard(os.path.join(os.fspath(self.path), fn))
        return self._open[fn]

    def names(self):
        return self.where.keys()

    def shape(self, name: str) -> tuple:
        if name in self.int4:  # [out, in]: the scale's columns x the group size
            _, scale, scale_file = self.int4[name]
            rows, groups = self._shard(scale_file).shape(self.raw(scale))
            return (rows, groups * self.int4_group)
        return self._shard(self.where[name]).shape(self.raw(name))

    def _read_int4(self, name: str, ranges) -> np.ndarray:
        """float32 block `ranges` of the INT4 pack-quantized weight `name` (module docstring)."""
        packed, scale, scale_file = self.int4[name]
        (r0, r1), (c0, c1) = ranges
        g = self.int4_group
        shard = self._shard(self.where[name])
        w0, w1 = c0 // 8, -(-c1 // 8)
        words = shard.read(self.raw(packed), ((r0, r1), (w0, w1))).astype(np.int32).view(np.uint32)
        nibbles = (words[:, :, None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF  # [rows, words, 8]
        q = nibbles.reshape(r1 - r0, -1)[:, c0 - 8 * w0:c1 - 8 * w0].astype(np.float32) - 8.0
        s = self._shard(scale_file).read(self.raw(scale), ((r0, r1), (c0 // g, -(-c1 // g)))).astype(np.float32)
        return q * s[:, (np.arange(c0, c1) // g) - c0 // g]

    def read(self, name: str, ranges) -> np.ndarray:
        """float32 block `ranges` of tensor `name`; an FP8 tensor is dequantized with its
        `{name}_scale_inv` (one scale per block x block tile), an INT4 pack-quantized one with its
        group scales."""
        if name in self.int4:
            return self._read_int4(name, ranges)
        shard = self._shard(self.where[name])
        w = shard.read(self.raw(name), ranges)
        if shard.dtype(self.raw(name)).startswith("F8"):
            scale_name = name + "_scale_inv"
            if scale_name not in self.where:
                raise ValueError(f"{name} is FP8 but the checkpoint has no {scale_name}")
            s_shard = self._shard(self.where[scale_name])
            raw_scale = self.raw(scale_name)
            scale = s_shard.read(raw_scale, [(0, n) for n in s_shard.shape(raw_scale)]).astype(np.float32)
            (r0, r1), (c0, c1) = ranges
            rows, cols = np.arange(r0, r1) // self.block, np.arange(c0, c1) // self.block
            return w.astype(np.float32) * scale[np.ix_(rows, cols)]
        return w if w.dtype == np.float32 else w.astype(np.float32)

    def mean_rows(self, name: str, chunk: int = 8192) -> np.ndarray:
        """Mean over the rows of a 2-D tensor (float32 [cols]), read `chunk` rows at a time."""
        rows, cols = self.shape(name)
        total = np.zeros(cols, np.float64)
        for r in range(0, rows, chunk):
            total += self.read(name, [(r, min(rows, r + chunk)), (0, cols)]).sum(0, dtype=np.float64)
        return (total / max(rows, 1)).astype(np.float32)

    def release(self, fn: str):
        shard = self._open.pop(fn, None)
        if shard is not None:
            shard.close()

    def close(self):
        for fn in list(self._open):
            self.release(fn)


def dequant_fp8(w: np.ndarray, scale_inv: np.ndarray, block: int = FP8_BLOCK) -> np.ndarray:
    """Block-wise FP8 dequantization: w `[M, N]` times scale_inv `[ceil(M/b), ceil(N/b)]`."""
    m, n = w.shape
    s = np.repeat(np.repeat(scale_inv.astype(np.float32), block, axis=0), block, axis=1)[:m, :n]
    return w.astype(np.float32) * s


# ----------------------------------------------------------------------------- import
# our path below a layer -> (HF suffix, conversion): the import's lookup, hf_export's names
REV_ATTN = {v[0]: (k, v[1]) for k, v in _ATTN.items()}
REV_MTP = {v[0]: (k, v[1]) for k, v in _MTP.items()}


def _sources(p: tuple, shape: tuple, n_layers: int, n_unstacked: int):
    """The Hugging Face tensors of our variable `p` (a path tuple) of shape `shape`: a list of
    alternative layouts, each a list of (slot, hf name, conversion); slot indexes the leading
    axes the tensor fills (stacked layer, expert). None: a variable with no HF counterpart."""
    if p == ("embed",):
        return [[((), "model.embed_tokens.weight", "embed")]]
    if p == ("norm", "weight"):
        return [[((), "model.norm.weight", "id")]]
    if p == ("lm_head",):
        return [[((), "lm_head.weight", "head")]]
    if p[0] == "layers":
        prefixes, rest = [((), f"model.layers.{p[1]}.")], p[2:]
    elif p[0] == "moe_stack":
        prefixes, rest = [((j,), f"model.layers.{n_unstacked + j}.") for j in range(shape[0])], p[1:]
    elif p[0] == "mtp":
        pre = f"model.layers.{n_layers + p[1]}."
        if p[2:] in REV_MTP:
            name, conv = REV_MTP[p[2:]]
            return [[((), pre + name, conv)]]
        if p[2] != "block":
            return None
        prefixes, rest = [((), pre)], p[3:]
    else:
        return None
    if rest in REV_ATTN:
        name, conv = REV_ATTN[rest]
        return [[(s, pre + name, conv) for s, pre in prefixes]]
    if rest in (("mlp", "wg"), ("mlp", "wu"), ("mlp", "wd")):
        leaf = rest[1]
        n_experts = shape[len(prefixes[0][0])]
        kind = {"wg": "gate", "wu": "up", "wd": "down"}[leaf]
        per_expert = [(s + (e,), pre + f"mlp.experts.{e}.{kind}_proj.weight", "T")
                      for s, pre in prefixes for e in range(n_experts)]
        fused_name = "mlp.experts.down_proj" if leaf == "wd" else "mlp.experts.gate_up_proj"
        fused_conv = {"wg": "gate", "wu": "up", "wd": "down_fused"}[leaf]  # transformers>=5 layout
        fused = [(s, pre + fused_name, fused_conv) for s, pre in prefixes]
        return [per_expert, fused]
    return None


def _piece(ck: _Checkpoint, name: str, conv: str, tshape: tuple, idx) -> np.ndarray:
    """Block `idx` ((start, stop) per axis) of our `tshape` tensor, from HF tensor `name`, read
    as the block of `name` it needs. HF Linear weights are [out, in]; ours [in, ...out]."""
    if conv == "id":
        return ck.read(name, idx)
    if conv == "T":
        return ck.read(name, (idx[1], idx[0])).T
    if conv == "heads":  # [in, H, dq] <- [H*dq, in]
        (a0, a1), (h0, h1), (d0, d1) = idx
        dq = tshape[2]
        b = ck.read(name, ((h0 * dq, h1 * dq), (a0, a1)))
        return b.T.reshape(a1 - a0, h1 - h0, dq)[:, :, d0:d1]
    if conv == "o":  # [H, dv, D] <- [D, H*dv]
        (h0, h1), (d0, d1), (c0, c1) = idx
        dv = tshape[1]
        b = ck.read(name, ((c0, c1), (h0 * dv, h1 * dv)))
        return b.T.reshape(h1 - h0, dv, c1 - c0)[:, d0:d1, :]
    if conv in ("gate", "up"):  # [E, D, F] <- gate_up_proj [E, 2F, D]
        (e0, e1), (d0, d1), (f0, f1) = idx
        off = 0 if conv == "gate" else tshape[2]
        return ck.read(name, ((e0, e1), (off + f0, off + f1), (d0, d1))).transpose(0, 2, 1)
    if conv == "down_fused":  # [E, F, D] <- down_proj [E, D, F]
        (e0, e1), (f0, f1), (d0, d1) = idx
        return ck.read(name, ((e0, e1), (d0, d1), (f0, f1))).transpose(0, 2, 1)
    if conv in ("embed", "head"):  # [V, D] / [D, V] <- [V_ckpt, D]; rows past V_ckpt = the mean
        (v0, v1), (d0, d1) = idx if conv == "embed" else idx[::-1]
        v_ckpt = ck.shape(name)[0]
        if v1 <= v_ckpt:
            out = ck.read(name, ((v0, v1), (d0, d1)))
            return out if conv == "embed" else out.T
        out = np.empty((v1 - v0, d1 - d0), np.float32)
        have = max(0, min(v1, v_ckpt) - v0)
        if have:
            out[:have] = ck.read(name, ((v0, v0 + have), (d0, d1)))
        if have < v1 - v0:
            out[have:] = ck.mean_rows(name)[d0:d1]
        return out if conv == "embed" else out.T
    raise ValueError(conv)


def _expected_shape(conv: str, tshape: tuple) -> tuple:
    """The shape an HF tensor must have to fill our `tshape` block through `conv` (for the
    embedding / output head: (None, D), any row count up to the model's)."""
    if conv == "id":
        return tshape
    if conv == "T":
        return tshape[::-1]
    if conv == "heads":
        return (tshape[1] * tshape[2], tshape[0])
    if conv == "o":
        return (tshape[2], tshape[0] * tshape[1])
    if conv in ("gate", "up"):
        return (tshape[0], 2 * tshape[2], tshape[1])
    if conv == "down_fused":
        return (tshape[0], tshape[2], tshape[1])
    if conv == "embed":
        return (None, tshape[1])
    if conv == "head":
        return (None, tshape[0])
    raise ValueError(conv)


def _assemble(ck: _Checkpoint, by_slot: dict, n_slot: int, shape: tuple, dtype, target) -> jax.Array:
    """A variable of `shape` / `dtype` in sharding `target` from its HF tensors (`by_slot`: slot
    -> (name, conversion)): each of this process's devices gets its block, read, converted and
    transferred in turn, so the host holds one block (and its conversion) at a time; a block
    several devices share (replication) is read once."""
    import itertools
    from collections import Counter

    tshape = shape[n_slot:]
    index_map = target.addressable_devices_indices_map(shape)
    ranges_of = {d: tuple(s.indices(n)[:2] for s, n in zip(idx, shape)) + tuple((0, n) for n in shape[len(idx):])
                 for d, idx in index_map.items()}
    uses = Counter(ranges_of.values())
    blocks, arrays = {}, []
    for d, ranges in sorted(ranges_of.items(), key=lambda kv: kv[1]):
        if ranges not in blocks:
            slots, rest = ranges[:n_slot], ranges[n_slot:]
            if not slots:  # one HF tensor: its block, converted, contiguous, in our dtype
                n, conv = by_slot[()]
                out = np.ascontiguousarray(_piece(ck, n, conv, tshape, rest), dtype=dtype)
            else:  # one HF tensor per (layer, expert) slot
                out = np.empty([b - a for a, b in ranges], dtype)
                for slot in itertools.product(*(range(a, b) for a, b in slots)):
                    n, conv = by_slot[slot]
                    out[tuple(i - a for i, (a, _) in zip(slot, slots))] = _piece(ck, n, conv, tshape, rest)
            blocks[ranges] = out
        arrays.append(jax.device_put(blocks[ranges], d))
        uses[ranges] -= 1
        if not uses[ranges]:  # its last device: the transfer done, the host block dropped
            jax.block_until_ready(arrays[-1])
            del blocks[ranges]
    return jax.make_array_from_single_device_arrays(shape, target, arrays)


def import_into(model, path: str, *, log=None) -> dict:
    """Every variable of `model` (a coder Transformer, already built, sharded or not) from the
    Hugging Face checkpoint directory `path`, in place.

    Variables are read in shard order, one at a time (`_assemble`): each of this process's
    devices gets its block of the variable, read (only the rows / columns it holds, each block
    once), converted and transferred in turn, and the variable's old array is dropped as soon as
    the new one is placed; a shard is closed once every tensor it holds for the model is read.
    So a process holds its part of the model, the mapped pages of the shard being read and a
    few copies of one device's block in flight (bench/hf_import.py measures it), and reads
    only what its devices hold.

    - The embedding and the output head may have more rows than the checkpoint (tokens added
      for the chat template): those rows start at the mean of the checkpoint's rows.
    - An MTP module the checkpoint lacks entirely (declared in config.json or not:
      transformers saves none) keeps its initialisation: it starts fresh, logged.
    - A trunk tensor the checkpoint lacks is a ValueError naming it; variables with no Hugging
      Face counterpart (NSA's own) keep their initialisation, logged.
    Returns {"loaded", "missing" (flat names left as initialised), "unexpected" (checkpoint
    tensors nothing read), "fresh_mtp" (module indices), "vocab": (checkpoint rows, model rows)}.
    """
    log = log or logging.info
    cfg = model.cfg
    hf = read_hf_config(path)
    qcfg = hf.get("quantization_config") or {}
    block = int((qcfg.get("weight_block_size") or [FP8_BLOCK])[0])
    n_layers = int(hf["num_hidden_layers"])
    if n_layers != int(cfg.num_hidden_layers):
        raise ValueError(f"{path}: config.json has num_hidden_layers={n_layers}, the model "
                         f"{cfg.num_hidden_layers}: build the model from the checkpoint's config")
    ck = _Checkpoint(path, block, int4_group_size(qcfg))
    if ck.skipped:
        log("%s is a %s wrapper: its text model is imported; %d tensors of its other towers (vision, "
            "projector) are skipped, e.g. %s", path, hf.get("wrapper_model_type") or "multimodal",
            len(ck.skipped), ck.skipped[:3])
    if ck.int4:
        log("%d INT4 pack-quantized weights (group %d) are dequantized to %s on import", len(ck.int4),
            ck.int4_group, jnp.dtype(model.cfg.param_dtype).name)
    n_unstacked = len(model.layers) if model.moe_stack is not None else n_layers
    flat = [(p, var) for p, var in nnx.to_flat_state(nnx.state(model))]
    plan, absent, coder_only = [], {}, []
    for p, var in flat:
        shape = tuple(var.get_value().shape)
        alts = _sources(p, shape, n_layers, n_unstacked)
        if alts is None:
            coder_only.append(p)
            continue
        chosen = next((a for a in alts if all(n in ck.where for _, n, _ in a)), None)
        if chosen is None:
            absent[p] = [n for _, n, _ in alts[0] if n not in ck.where]
            continue
        plan.append((p, var, chosen))
    # MTP modules: wholly absent -> fresh; partly absent -> an error like the trunk's
    fresh_mtp = sorted({p[1] for p in absent if p[0] == "mtp"})
    for k in list(fresh_mtp):
        module = [p for p, _ in flat if p[:2] == ("mtp", k) and p not in coder_only]
        if any(p not in absent for p in module):
            fresh_mtp.remove(k)
    missing = {p: n for p, n in absent.items() if not (p[0] == "mtp" and p[1] in fresh_mtp)}
    if missing:
        names = [n for ns in missing.values() for n in ns]
        raise ValueError(
            f"the Hugging Face checkpoint {path} lacks {len(names)} tensors the model needs, e.g. "
            f"{names[:6]} (for {['.'.join(map(str, p)) for p in list(missing)[:4]]})")
    for p, var, alt in plan:  # every tensor's shape against the model's, before reading any
        shape = tuple(var.get_value().shape)
        tshape = shape[len(alt[0][0]):]
        for _, n, conv in alt:
            want, have = _expected_shape(conv, tshape), ck.shape(n)
            if len(want) != len(have) or any(w is not None and w != h for w, h in zip(want, have)):
                raise ValueError(
                    f"the Hugging Face checkpoint's {n} has shape {have}, the model's "
                    f"{'.'.join(map(str, p))} {shape} needs {want}: build the model from the "
                    f"checkpoint's config.json (coder.stages.inherit_model_config)")
    vocab = (ck.shape("model.embed_tokens.weight")[0], int(cfg.vocab_size))
    if vocab[1] < vocab[0]:
        raise ValueError(f"model.vocab_size={vocab[1]} < the checkpoint's {vocab[0]} rows ({path})")
    # read shard by shard: a variable when the first shard it needs comes up
    def needs(alt):  # the tensors a variable reads, FP8 scales included
        names = {n for _, n, _ in alt}
        return names | {n + "_scale_inv" for n in names if n + "_scale_inv" in ck.where}

    used = set().union(*(needs(alt) for _, _, alt in plan)) if plan else set()
    left: dict[str, set] = {}  # shard -> tensors still to read from it
    for n in used:
        left.setdefault(ck.where[n], set()).add(n)
    plan.sort(key=lambda e: min(ck.order[ck.where[n]] for _, n, _ in e[2]))
    loaded = []
    for p, var, alt in plan:
        value = var.get_value()
        shape, dtype, target = tuple(value.shape), value.dtype, value.sharding
        n_slot = len(alt[0][0])
        by_slot = {slot: (n, conv) for slot, n, conv in alt}
        del value
        new = _assemble(ck, by_slot, n_slot, shape, dtype, target)
        var.set_value(jax.block_until_ready(new))  # one variable in flight: its old array freed now
        del new
        loaded.append(".".join(map(str, p)))
        for n in needs(alt):
            fn = ck.where[n]
            left[fn].discard(n)
            if not left[fn]:
                ck.release(fn)  # every tensor it holds for the model is read
    ck.close()
    ignored = (".rotary_emb.inv_freq",) + tuple("." + s for s in _MTP_SHARED)
    unexpected = sorted(n for n in ck.where if n not in used and not n.endswith(ignored))
    log("init_from %s (Hugging Face checkpoint, %d shards): %d variables imported", path,
        len(ck.files), len(loaded))
    declared = int(hf.get("num_nextn_predict_layers") or 0)
    for k in fresh_mtp:
        log("MTP module %d: not in %s (config.json declares num_nextn_predict_layers=%d; "
            "transformers saves none): it starts fresh", k, path, declared)
    if vocab[1] > vocab[0]:
        log("vocabulary: the checkpoint has %d rows, the model %d: the embedding and the output "
            "head grow by %d rows (ids %d..%d), initialised to the mean of the checkpoint's rows",
            vocab[0], vocab[1], vocab[1] - vocab[0], vocab[0], vocab[1] - 1)
    if coder_only:
        log("%d variables have no Hugging Face counterpart and keep their initialisation, e.g. %s",
            len(coder_only), [".".join(map(str, p)) for p in coder_only[:4]])
    if unexpected:
        logging.warning("%d tensors of %s are not used by the model, e.g. %s", len(unexpected), path,
                        unexpected[:6])
    missing_names = [".".join(map(str, p)) for p in absent] + [".".join(map(str, p)) for p in coder_only]
    return {"loaded": loaded, "missing": sorted(missing_names), "unexpected": unexpected,
            "fresh_mtp": fresh_mtp, "vocab": vocab}


def load_hf(path: str, dtype=jnp.float32, mesh=None, rules=None, scan_layers: bool = False,
            num_mtp_layers: int | None = None, vocab_size: int | None = None, seed: int = 0):
    """Read an HF DeepSeek-V3 / Kimi-K2 checkpoint directory -> (model_cfg, Transformer).

    `dtype` is the parameter dtype (model_cfg.param_dtype). The model is built from config.json
    (num_mtp_layers / vocab_size override it: fresh MTP modules, grown vocabulary) directly in
    its sharding on `mesh` (with `rules`, default the config's), then `import_into` fills it
    shard by shard, each process reading only its own blocks. scan_layers: build the model with
    model.scan_layers (MoE layers stacked into moe_stack.*, see coder/model/config.py).
    """
    from coder.model.transformer import Transformer

    cfg = config_from_hf(read_hf_config(path))
    if num_mtp_layers is not None:
        cfg.num_mtp_layers = int(num_mtp_layers)
    if vocab_size is not None:
        cfg.vocab_size = int(vocab_size)
    if mesh is not None and rules is None:
        from coder.model.config import default_rules

        rules = default_rules()
    cfg.scan_layers = bool(scan_layers)  # HF files are per layer; stacked here when asked
    cfg.param_dtype = jnp.dtype(dtype).name
    cfg.dtype = jnp.dtype(dtype).name if jnp.dtype(dtype) == jnp.float32 else cfg.dtype

    def make():
        return Transformer(cfg, rngs=nnx.Rngs(seed))

    model = make() if mesh is None else sharding.create_sharded(make, mesh, rules)
    import_into(model, path)
    return cfg, model
