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

Decode (MLA's cached calls, coder/model/attention.py): after a call writes its tokens into the
raw K/V cache, `compress_update` recomputes from that cache every compression block whose last
slot the call wrote (a chunk may complete several; a rewritten slot's block is recomputed when
its end is written again), so the compressed cache [B, ceil(S/d), G, D] is never stale where a
query can see it; then `coder.pallas.nsa.decode.decode_step` runs each query at its position,
reading only the compressed entries, its n selected blocks and its window.
"""
import jax
import jax.numpy as jnp
from flax import nnx

from coder.pallas.nsa import ops
from coder.pallas.nsa.decode import gather_slots, parts
from coder.pallas.nsa.reference import NSAConfig, num_compressed


def _param(rngs, shape, axes, cfg, std=None, float32_compute=False):
    """nnx.Param with logical axis names (as coder.model.layers.param); std=None -> zeros."""
    pdt = jnp.dtype(cfg.param_dtype)
    value = jnp.zeros(shape, pdt) if std is None else std * jax.random.normal(rngs.params(), shape, pdt)
    meta = {"float32_compute": True} if float32_compute else {}
    return nnx.Param(value, logical_axes=tuple(axes), **meta)


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
        self.gate_w = _param(rngs, (d, h, 3), ("embed", "heads", None), model_cfg,
                             float(model_cfg.initializer_range), float32_compute=True)
        self.gate_b = _param(rngs, (h, 3), ("heads", None), model_cfg, float32_compute=True)

    def gates(self, x):
        """x [B,T,D] -> [B,T,H,3] in [0, 1], float32."""
        logits = jnp.einsum("btd,dhc->bthc", x.astype(jnp.float32), self.gate_w[...].astype(jnp.float32))
        return jax.nn.sigmoid(logits + self.gate_b[...].astype(jnp.float32))

    def compress(self, k, v):
        """k [B,T,G,Dk], v [B,T,G,Dv] -> (k_cmp [B,Nc,G,Dk], v_cmp [B,Nc,G,Dv]), Nc = ceil(T/d)."""
        kb = jnp.moveaxis(blocks(k, self.cfg), 3, 2)  # [B,Nc,G,l,D]
        vb = jnp.moveaxis(blocks(v, self.cfg), 3, 2)
        return self.compress_k(kb), self.compress_v(vb)

    def compress_update(self, k_cache, v_cache, k_cmp_cache, v_cmp_cache, pos, written=None, *, dtype=None):
        """Recompute the compression blocks completed by the slots one cached call just wrote.

        k_cache [B,S,G,Dk], v_cache [B,S,G,Dv] (or tuples of feature parts, see decode.parts),
        already holding the call's tokens; k_cmp_cache [B,Sc,G,Dk], v_cmp_cache [B,Sc,G,Dv];
        pos [B] or [B,T] int32, the slots written (consecutive within a row); written [B,T] bool,
        False where nothing was written (padding); dtype: phi's compute dtype (default the cache's).
        -> (k_cmp_cache, v_cmp_cache).

        Block i = slots [i*d, i*d + l) is recomputed from the cache whenever its last slot
        i*d + l - 1 is written, whatever its entry held before. Writes continue (or rewrite the
        tail of) a row, so that slot's write makes every slot of the block current, and a block
        holding a rewritten slot (speculative rollback) is either recomputed by the same call or
        ends past the call's last slot, where no query looks until a later call writes its end.
        A chunk of T slots completes at most (T - 1) // d + 1 blocks: only those are computed.
        """
        l, d = self.cfg.compress_block, self.cfg.compress_stride
        pos = pos[:, None] if pos.ndim == 1 else pos
        written = jnp.ones(pos.shape, bool) if written is None else written
        b, t = pos.shape
        s_len = parts(k_cache)[0].shape[1]
        start = pos + 1 - l
        ends = written & (start >= 0) & (start % d == 0)  # [B,T]: this slot completes a block
        nb = (t - 1) // d + 1
        rank = jnp.where(ends, jnp.cumsum(ends, axis=1) - 1, nb)  # k-th completed block of the row
        rows = jnp.arange(b)[:, None]
        blk = jnp.full((b, nb), -1, jnp.int32).at[rows, rank].set(start.astype(jnp.int32), mode="drop")
        slots = jnp.clip(blk[..., None] + jnp.arange(l), 0, s_len - 1).reshape(b, nb * l)

        def phi(cache, compressor):
            x = gather_slots(cache, slots)  # [B,nb*l,G,D]
            x = x.reshape(b, nb, l, x.shape[2], x.shape[3]).astype(dtype or x.dtype)
            return compressor(jnp.moveaxis(x, 2, 3))  # [B,nb,G,l,D] -> [B,nb,G,D]

        new_k, new_v = phi(k_cache, self.compress_k), phi(v_cache, self.compress_v)
        i = jnp.where(blk >= 0, blk // d, k_cmp_cache.shape[1])  # out of range -> dropped
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
