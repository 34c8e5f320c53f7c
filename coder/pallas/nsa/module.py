"""NSA's learnable parts as one nnx.Module: block compression of K and V, and the branch gates.

Interface for coder/model/attention.py (backend "nsa"):

    nsa = NSA(model_cfg, rngs)              # key/value widths default to MLA's absorbed form
    out = nsa(q, k, v, gate_input, segment_ids, positions, softmax_scale=s, impl="xla")

    q [B,T,H,Dk], k [B,T,G,Dk], v [B,T,G,Dv]   G divides H (GQA); MLA absorbed = MQA, G = 1, with
                                               k = [latent, k_rope] (Dk = r + dr) and v = latent
                                               (Dv = r), so one block selection serves all heads
    gate_input [B,T,D]                         the layer input the gates are computed from
    segment_ids, positions [B,T] int32         packed-batch layout (docs/contracts.md)
    softmax_scale                              MLA/YaRN's scale (default 1/sqrt(Dk))
    impl                                       "xla" | "reference" | "pallas_tpu" | "pallas_gpu"
    -> out [B,T,H,Dv] in v's dtype; with MLA multiply by W_kvb's value half, then o_proj, as the
       absorbed dense path does.

NSA needs only the document layout, which it reads from `segment_ids` (each id one contiguous
run, as packing produces); `positions` is accepted so the call matches the dense backend.

Learnable parts (paper section 3.3):
- compression phi (eq. 7): block i = tokens [i*d, i*d + l) of each group's keys (values), plus a
  learned intra-block position embedding, then  mean(block) + W2 silu(W1 flatten(block)).
  W2 starts at zero, so phi starts as mean pooling (a sensible key for the block) and learns the
  rest; weights are shared by the groups.
- gates (eq. 5): g = sigmoid(x W_g + b_g) -> [B,T,H,3] for (compressed, selected, window).

Decode: `compress_update` keeps the compressed cache current one token at a time, and
`coder.pallas.nsa.decode.decode_step` reads only compressed blocks, selected blocks and the window.
"""
import jax
import jax.numpy as jnp
from flax import nnx

from coder.pallas.nsa import ops
from coder.pallas.nsa.reference import NSAConfig, num_compressed


def _param(rngs, shape, axes, cfg, std=None):
    """nnx.Param with logical axis names (as coder.model.layers.param); std=None -> zeros."""
    pdt = jnp.dtype(cfg.param_dtype)
    value = jnp.zeros(shape, pdt) if std is None else std * jax.random.normal(rngs.params(), shape, pdt)
    return nnx.Param(value, logical_axes=tuple(axes))


def blocks(x, cfg: NSAConfig):
    """[B,T,G,D] -> [B,Nc,l,G,D]: compression block i holds tokens [i*d, i*d + l) (zero past T)."""
    t = x.shape[1]
    nc = num_compressed(t, cfg)
    xp = jnp.pad(x, ((0, 0), (0, nc * cfg.compress_stride + cfg.compress_block - t), (0, 0), (0, 0)))
    idx = jnp.arange(nc)[:, None] * cfg.compress_stride + jnp.arange(cfg.compress_block)[None, :]
    return xp[:, idx]


class Compressor(nnx.Module):
    """phi: a block [.., l, D] -> one key/value [.., D] (see module docstring)."""

    def __init__(self, width: int, cfg: NSAConfig, model_cfg, rngs: nnx.Rngs):
        l, std = cfg.compress_block, float(model_cfg.initializer_range)
        self.pos = _param(rngs, (l, width), (None, None), model_cfg, std)
        self.w1 = _param(rngs, (l * width, width), (None, None), model_cfg, std)
        self.w2 = _param(rngs, (width, width), (None, None), model_cfg)  # zero: starts as mean pooling

    def __call__(self, blk):
        """blk [..., l, D] -> [..., D] in blk's dtype."""
        dt = blk.dtype
        x = blk + self.pos[...].astype(dt)
        hidden = jax.nn.silu(x.reshape(x.shape[:-2] + (-1,)) @ self.w1[...].astype(dt))
        return (jnp.mean(x.astype(jnp.float32), axis=-2).astype(dt) + hidden @ self.w2[...].astype(dt))


class NSA(nnx.Module):
    def __init__(self, model_cfg, rngs: nnx.Rngs, *, key_dim: int | None = None, value_dim: int | None = None):
        """key_dim/value_dim default to MLA's absorbed widths: kv_lora_rank + qk_rope_head_dim, kv_lora_rank."""
        self.cfg = NSAConfig.from_config(model_cfg.nsa)
        dk = key_dim or model_cfg.kv_lora_rank + model_cfg.qk_rope_head_dim
        dv = value_dim or model_cfg.kv_lora_rank
        h, d = model_cfg.num_attention_heads, model_cfg.hidden_size
        self.key_dim, self.value_dim, self.num_heads = dk, dv, h
        self.compress_k = Compressor(dk, self.cfg, model_cfg, rngs)
        self.compress_v = Compressor(dv, self.cfg, model_cfg, rngs)
        self.gate_w = _param(rngs, (d, h, 3), ("embed", "heads", None), model_cfg, float(model_cfg.initializer_range))
        self.gate_b = _param(rngs, (h, 3), ("heads", None), model_cfg)

    def gates(self, x):
        """x [B,T,D] -> [B,T,H,3] in [0, 1], float32."""
        logits = jnp.einsum("btd,dhc->bthc", x.astype(jnp.float32), self.gate_w[...].astype(jnp.float32))
        return jax.nn.sigmoid(logits + self.gate_b[...].astype(jnp.float32))

    def compress(self, k, v):
        """k [B,T,G,Dk], v [B,T,G,Dv] -> (k_cmp [B,Nc,G,Dk], v_cmp [B,Nc,G,Dv]), Nc = ceil(T/d)."""
        kb = jnp.moveaxis(blocks(k, self.cfg), 3, 2)  # [B,Nc,G,l,D]
        vb = jnp.moveaxis(blocks(v, self.cfg), 3, 2)
        return self.compress_k(kb), self.compress_v(vb)

    def compress_update(self, k_cache, v_cache, k_cmp_cache, v_cmp_cache, pos):
        """After writing token `pos` [B] into k/v caches [B,S,G,D]: if it completes compression block
        i = (pos + 1 - l) / d, write phi of that block into the compressed caches [B,Sc,G,D]."""
        l, d = self.cfg.compress_block, self.cfg.compress_stride
        start = pos + 1 - l
        done = (start >= 0) & (start % d == 0)
        i = jnp.where(done, start // d, k_cmp_cache.shape[1])  # out of range -> dropped

        def one(kc, vc, s):
            kb = jax.lax.dynamic_slice_in_dim(kc, jnp.maximum(s, 0), l, axis=0)  # [l,G,D]
            vb = jax.lax.dynamic_slice_in_dim(vc, jnp.maximum(s, 0), l, axis=0)
            return self.compress_k(jnp.moveaxis(kb, 0, 1)), self.compress_v(jnp.moveaxis(vb, 0, 1))

        new_k, new_v = jax.vmap(one)(k_cache, v_cache, start)  # [B,G,D]
        rows = jnp.arange(pos.shape[0])
        k_cmp_cache = k_cmp_cache.at[rows, i].set(new_k.astype(k_cmp_cache.dtype), mode="drop")
        v_cmp_cache = v_cmp_cache.at[rows, i].set(new_v.astype(v_cmp_cache.dtype), mode="drop")
        return k_cmp_cache, v_cmp_cache

    def __call__(self, q, k, v, gate_input, segment_ids, positions, *, softmax_scale: float | None = None,
                 impl: str = "xla", kernel: ops.Kernel | None = None, chunk: int = 128, unroll: bool = False):
        """-> [B,T,H,Dv] (see module docstring). chunk/unroll: XLA-loop options (ops.nsa_attention)."""
        del positions  # document layout comes from segment_ids
        scale = float(softmax_scale) if softmax_scale is not None else q.shape[-1] ** -0.5
        k_cmp, v_cmp = self.compress(k, v)
        return ops.nsa_attention(q, k, v, k_cmp, v_cmp, self.gates(gate_input), segment_ids,
                                 cfg=self.cfg, softmax_scale=scale, impl=impl, kernel=kernel,
                                 chunk=chunk, unroll=unroll)
