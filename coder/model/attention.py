"""Multi-head Latent Attention (MLA, DeepSeek-V2/V3) with a compressed-latent KV cache.

Shapes: B batch, T query tokens, S key slots, H heads, D hidden, r = kv_lora_rank,
dn = qk_nope_head_dim, dr = qk_rope_head_dim, dv = v_head_dim, dq = dn + dr.

    q      = x W_q                        (or  W_qb RMSNorm(x W_qa)  when q_lora_rank > 0)
    [c; k_r] = x W_kva,   c = RMSNorm(c)  [B,T,r] latent, k_r [B,T,dr] one RoPE key for all heads
    [k_n; v] = c W_kvb                    [B,S,H,dn], [B,S,H,dv]
    s_hts  = scale * (q_n . k_n + RoPE(q_r) . RoPE(k_r))
    o      = softmax(s + mask) v W_o

The full forward of the dense backend expands per-head keys and values and runs
`coder.model.attention_kernels.attention` (splash attention on TPU, a flash kernel on GPU, XLA on
CPU; chosen at lowering).

Masking: a query attends to keys of its own segment (`segment_ids`) at or before its index
(full forward), or to cache slots at or before its absolute position (cached call). A full
forward given `prefix_segment` (shared-prefix rows of the GRPO learner) also attends to the keys
of the segment it names (`attention_kernels.attention_mask`): by the flash kernel on GPU, in XLA
elsewhere (splash's mask cannot say "own segment or the shared prefix").

Cached calls (decode, chunked prefill) use the *absorbed* form (DeepSeek-V2 section 2.1.3):
W_kvb's key half is folded into the query and its value half applied after the softmax, so
attention runs against the cached latent `c` [B,S,r] and `k_r` [B,S,dr] directly (an MQA over
r + dr features), never expanding per-head keys/values for the whole cache.

Backend "nsa" (coder/pallas/nsa) replaces the softmax attention by Native Sparse Attention in
the same absorbed form: keys [c; k_r], values c, one key group shared by all heads. The full
forward compresses, selects and attends over the whole sequence (`MLA._nsa`), its selected and
window branches by the kernels of the platform the program is lowered for: Pallas TPU kernels
for TPU, Mosaic GPU kernels for CUDA (`MLA._nsa_gpu`: where they cannot take the layer's shape
or the devices, the XLA path, with the reason logged), the blockwise XLA path elsewhere (CPU,
ROCm); wherever the mesh splits the sequence, a shard_map, each device its queries against
the gathered keys (`MLA._nsa_sequence_parallel`), by the same platform's choice of kernels at
the shard's offset; `force_nsa_impl` overrides the choice (tests run the kernels in interpret
mode). A
cached call writes c / k_r as above, then recomputes NSA's compressed keys/values for every
compression block whose last slot it wrote (kept per layer in the cache as `k_cmp`
[B,Sc,1,r+dr] and `v_cmp` [B,Sc,1,r], Sc = ceil(S / nsa.compress_stride)), and runs each query
through `decode.decode_step` at its position: the same output as the full forward for a row
holding one document, while reading only the compressed entries, the selected blocks and the
window. decode_step is XLA on every platform: no TPU or GPU kernel serves a cached call. NSA's
cache assumes a call's writes continue or rewrite the tail of each row (as decoding, chunked
prefill and speculative rollback do): slots past a call's last written one are stale until
written again.
"""
from __future__ import annotations

import contextlib
import logging

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from coder.model import attention_kernels, context_parallel, sharding
from coder.model.layers import RMSNorm, dtype_of, param, weight
from coder.model.rope import apply_rope, rope_frequencies, softmax_scale
from coder.model.sharding import constrain

BACKENDS = ("dense", "nsa")
NEG_INF = -1e30  # finite, so fully masked rows (never produced by valid inputs) give no NaN
NSA_QUERY_CHUNK = 16  # nsa backend, cached calls: queries per vmapped decode step
LATENT = ("batch", "seq", None)  # the q / kv low-rank projections' outputs
_NSA_FORCED = None  # (impl, kernel) inside `force_nsa_impl`
_NSA_LOGGED = set()  # the GPU fallback reasons logged so far (once per process, not per layer)
log = logging.getLogger(__name__)


@contextlib.contextmanager
def force_nsa_impl(impl: str, kernel=None):
    """Within this block, NSA's full forward (`MLA._nsa`) runs `impl` (one of
    coder.pallas.nsa.ops.IMPLS) with `kernel` (an ops.Kernel; e.g. `interpret=` runs the GPU or
    TPU kernels in Pallas's interpreter on CPU), whatever platform the program is lowered for.
    For tests. It applies while a layer is traced: a function jitted and cached outside the
    block keeps the platform's choice, and one traced inside keeps the forced one. "pallas_gpu"
    on a layer the kernels cannot take raises (`MLA._nsa_gpu_unsupported`) rather than falling back."""
    from coder.pallas.nsa.ops import IMPLS

    if impl not in IMPLS:
        raise ValueError(f"force_nsa_impl({impl!r}): choose one of {IMPLS}")
    global _NSA_FORCED
    before, _NSA_FORCED = _NSA_FORCED, (impl, kernel)
    try:
        yield
    finally:
        _NSA_FORCED = before


def _log_once(message: str):
    if message not in _NSA_LOGGED:
        _NSA_LOGGED.add(message)
        log.warning(message)


def _gather_latent(y):
    """A low-rank projection of the residual stream `[B,T,r]`, computed on the stream's own
    token split (`res_seq`) and then gathered to the head-parallel layout's (`seq`): pinning the
    first layout keeps the weight gradient x^T dy on each chip's own tokens (left free, XLA
    gathered x whole on every chip for it)."""
    return constrain(constrain(y, ("batch", "res_seq", None)), LATENT)


CACHED_ATTENTION_BLOCK = 4096  # cache slots a step of the blockwise cached attention reads


def cached_attention(q_abs, q_rope, c_all, r_all, positions, scale: float, block: int | None = None):
    """A cached call's attention in MLA's absorbed form -> o_lat `[B,T,H,r]` (before W_uv).

    q_abs `[B,T,H,r]` (q_nope W_uk), q_rope `[B,T,H,dr]`, c_all `[B,S,r]` and r_all `[B,S,dr]`
    (the cache after this call's writes), positions `[B,T]`: a query sees the slots at or
    before its position. Caches of at most `block` (CACHED_ATTENTION_BLOCK) slots, or not a
    multiple of it, take one softmax over `[B,H,T,S]` scores. Longer ones go `block` slots at a
    time with an online softmax (running max and sum, as flash attention), so the scores held
    are `[B,H,T,block]`: one 256-token prefill chunk of
    2 rows x 64 heads against a 256k cache holds 537 MB of float32 scores, not 34 GB. Every block
    is visited (a loop of S / block trips: XLA knows its cost), masked past each query's
    position, as the one-pass form masks."""
    block = int(block or CACHED_ATTENTION_BLOCK)
    b, s, r = c_all.shape
    dt = c_all.dtype
    if s <= block or s % block:
        scores = (jnp.einsum("bthr,bsr->bhts", q_abs, c_all, preferred_element_type=jnp.float32)
                  + jnp.einsum("bthd,bsd->bhts", q_rope, r_all, preferred_element_type=jnp.float32))
        mask = (jnp.arange(s)[None, None, :] <= positions[:, :, None])[:, None]  # [B,1,T,S]
        probs = jax.nn.softmax(jnp.where(mask, scores * scale, NEG_INF), axis=-1)
        return jnp.einsum("bhts,bsr->bthr", probs.astype(dt), c_all)
    t, h = q_abs.shape[1], q_abs.shape[2]

    def step(i, carry):
        m, l, acc = carry  # [B,H,T] running max and sum; acc [B,T,H,r] float32
        c = jax.lax.dynamic_slice_in_dim(c_all, i * block, block, axis=1)
        rr = jax.lax.dynamic_slice_in_dim(r_all, i * block, block, axis=1)
        sc = (jnp.einsum("bthr,bsr->bhts", q_abs, c, preferred_element_type=jnp.float32)
              + jnp.einsum("bthd,bsd->bhts", q_rope, rr, preferred_element_type=jnp.float32))
        mask = ((i * block + jnp.arange(block))[None, None, :] <= positions[:, :, None])[:, None]
        sc = jnp.where(mask, sc * scale, NEG_INF)
        m_new = jnp.maximum(m, sc.max(-1))
        p = jnp.exp(sc - m_new[..., None])
        p = jnp.where(mask, p, 0.0)  # a block wholly past a query's position adds nothing
        corr = jnp.exp(m - m_new)
        l = l * corr + p.sum(-1)
        pv = jnp.einsum("bhts,bsr->bthr", p.astype(dt), c, preferred_element_type=jnp.float32)
        acc = acc * jnp.swapaxes(corr, 1, 2)[..., None] + pv
        return m_new, l, acc

    init = (jnp.full((b, h, t), NEG_INF, jnp.float32), jnp.zeros((b, h, t), jnp.float32),
            jnp.zeros((b, t, h, r), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, s // block, step, init)
    return (acc / jnp.swapaxes(l, 1, 2)[..., None]).astype(dt)


def init_layer_cache(cfg, batch: int, max_len: int, dtype) -> dict:
    """One layer's cache, zeros: latent `[B, max_len, r]` and RoPE key `[B, max_len, dr]`; with the
    nsa backend also NSA's compressed keys `k_cmp` `[B, Sc, 1, r + dr]` and values `v_cmp`
    `[B, Sc, 1, r]`, Sc = ceil(max_len / nsa.compress_stride) (entry i summarises slots
    [i*d, i*d + l); axis 2 is NSA's single key group)."""
    cache = {
        "latent": jnp.zeros((batch, max_len, cfg.kv_lora_rank), dtype),
        "rope": jnp.zeros((batch, max_len, cfg.qk_rope_head_dim), dtype),
    }
    if cfg.attention_backend == "nsa":
        sc = -(-max_len // int(cfg.nsa.compress_stride))
        cache["k_cmp"] = jnp.zeros((batch, sc, 1, cfg.kv_lora_rank + cfg.qk_rope_head_dim), dtype)
        cache["v_cmp"] = jnp.zeros((batch, sc, 1, cfg.kv_lora_rank), dtype)
    return cache


@struct.dataclass
class CacheIndex:
    """Where a cached call's batch rows and this layer live in the cache it is given.

    rows `[B]` int32 or None: the cache slot of each batch row (None: row b is slot b, the cache
    holds exactly the batch's rows; a slot == the cache's slot count is padding: its writes are
    dropped, its reads clipped). The engine's prefill passes the pool's whole cache and the
    rows' slots, so no row's cache is gathered out of the pool and scattered back whole (at
    256k that was every prefilling row's cache copied to every chip).
    layer (a traced int32 scalar) or None: the cache's leaves are a stack of layers
    `[slots, L, C, ...]` (transformer.init_cache's "stack") and this is layer `layer`; None: one
    layer's `[slots, C, ...]`."""

    rows: jax.Array | None = None
    layer: jax.Array | None = None


def write_cache(layer_cache: dict, latent, k_rope, positions, segment_ids, at: CacheIndex = CacheIndex()) -> dict:
    """Write new tokens at their absolute `positions` of their rows' slots (`at`); padding tokens
    (segment 0) write nothing. Other entries (NSA's compressed caches) are passed through
    unchanged. The scatter goes into the given leaves in place (a stacked layer's too)."""
    b, t = positions.shape
    max_len = layer_cache["latent"].shape[1 if at.layer is None else 2]
    slot = jnp.where(segment_ids > 0, positions, max_len)  # out of range -> dropped
    rows = jnp.arange(b) if at.rows is None else at.rows
    rows = jnp.broadcast_to(rows[:, None], (b, t))
    where = (rows, slot) if at.layer is None else (rows, jnp.broadcast_to(at.layer, (b, t)), slot)
    new_latent = layer_cache["latent"].at[where].set(latent.astype(layer_cache["latent"].dtype), mode="drop")
    new_rope = layer_cache["rope"].at[where].set(k_rope.astype(layer_cache["rope"].dtype), mode="drop")
    return dict(layer_cache, latent=new_latent, rope=new_rope)


def read_cache(cache: dict, key: str, at: CacheIndex = CacheIndex()):
    """Leaf `key` of this layer for the call's rows `[B, C, ...]`: layer `at.layer` of a stack (a
    dynamic slice XLA fuses into the reads that follow), then the rows' slots (a gather of one
    layer's rows, never the stack's)."""
    x = cache[key]
    if at.layer is not None:
        x = jax.lax.dynamic_index_in_dim(x, at.layer, axis=1, keepdims=False)
    return x if at.rows is None else jnp.take(x, at.rows, axis=0, mode="clip")


def put_cache(cache: dict, key: str, value, at: CacheIndex = CacheIndex()):
    """`cache[key]` with this layer's rows set to `value` `[B, C, ...]` (NSA's compressed entries,
    which a call recomputes whole per row); padding rows dropped."""
    x, value = cache[key], value.astype(cache[key].dtype)
    if at.layer is None:
        return value if at.rows is None else x.at[at.rows].set(value, mode="drop")
    if at.rows is None:
        return jax.lax.dynamic_update_index_in_dim(x, value, at.layer, 1)
    return x.at[at.rows, at.layer].set(value, mode="drop")


class MLA(nnx.Module):
    def __init__(self, cfg, rngs: nnx.Rngs):
        if cfg.attention_backend not in BACKENDS:
            raise ValueError(
                f"model.attention_backend={cfg.attention_backend!r} is not available; "
                f"choose one of {BACKENDS}")
        self.context_parallel = context_parallel.check_mode(cfg.get("context_parallel", "gather"))
        if self.context_parallel != "gather" and cfg.attention_backend == "nsa":
            raise ValueError(f"model.context_parallel={self.context_parallel!r} is the dense backend's: NSA's "
                             "sequence-parallel attention gathers its one shared key group (r + dr features a "
                             "token) and selects blocks from the whole row; set model.context_parallel='gather'")
        d, h = cfg.hidden_size, cfg.num_attention_heads
        self.h, self.dn, self.dr, self.dv = h, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.r = cfg.kv_lora_rank
        dq = self.dn + self.dr
        self.q_lora = int(cfg.q_lora_rank or 0)
        if self.q_lora > 0:
            self.q_a_proj = param(rngs, (d, self.q_lora), ("embed", "q_lora"), cfg)
            self.q_a_layernorm = RMSNorm(self.q_lora, cfg)
            self.q_b_proj = param(rngs, (self.q_lora, h, dq), ("q_lora", "heads", "head_dim"), cfg)
        else:
            self.q_proj = param(rngs, (d, h, dq), ("embed", "heads", "head_dim"), cfg)
        self.kv_a_proj = param(rngs, (d, self.r + self.dr), ("embed", "kv_lora"), cfg)
        self.kv_a_layernorm = RMSNorm(self.r, cfg)
        self.kv_b_proj = param(rngs, (self.r, h, self.dn + self.dv), ("kv_lora", "heads", "head_dim"), cfg)
        self.o_proj = param(rngs, (h, self.dv, d), ("heads", "head_dim", "embed"), cfg)
        inv_freq, self.attention_factor = rope_frequencies(cfg)
        self.inv_freq = tuple(float(f) for f in inv_freq)  # static, not a parameter
        self.scale = softmax_scale(cfg)
        self.dtype = dtype_of(cfg.dtype)
        self.nsa = nnx.data(None)
        if cfg.attention_backend == "nsa":
            from coder.pallas.nsa.module import NSA

            self.nsa = nnx.data(NSA(cfg, rngs))  # MLA's absorbed widths: keys r + dr, values r

    def _project(self, x, positions):
        """x [B,T,D] -> q_nope [B,T,H,dn], q_rope [B,T,H,dr], latent [B,T,r], k_rope [B,T,dr]."""
        dt = self.dtype
        x = x.astype(dt)
        # the low-rank latents are what a residual stream split further than `seq` (the
        # `res_seq` rule: sequence parallelism) gathers for the head-parallel projections:
        # q_lora / r + dr wide, not D
        if self.q_lora > 0:
            qa = self.q_a_layernorm(_gather_latent(x @ weight(self.q_a_proj, dt)))
            q = jnp.einsum("btl,lhd->bthd", qa, weight(self.q_b_proj, dt))
        else:
            q = jnp.einsum("btd,dhk->bthk", x, weight(self.q_proj, dt))
        q = checkpoint_name(constrain(q, ("batch", "seq", "heads", None)), "q_proj")
        kv = checkpoint_name(_gather_latent(x @ weight(self.kv_a_proj, dt)), "kv_proj")
        latent = self.kv_a_layernorm(kv[..., : self.r])
        inv = jnp.asarray(self.inv_freq, jnp.float32)
        k_rope = apply_rope(kv[..., self.r:], positions, inv, self.attention_factor)
        q_nope = q[..., : self.dn]
        q_rope = apply_rope(q[..., self.dn:], positions, inv, self.attention_factor)
        return q_nope, q_rope, latent, k_rope

    def __call__(self, x, positions, segment_ids, cache: dict | None = None, prefix_segment=None,
                 cache_at: CacheIndex = CacheIndex()):
        """x `[B,T,D]`, positions/segment_ids `[B,T]` -> (out `[B,T,D]`, updated layer cache).

        cache_at: where the batch's rows and this layer sit in `cache` (CacheIndex: a pool's
        slots, a layer of the stacked cache); read and written in place.

        prefix_segment `[B,T]` int32 or None: shared-prefix rows (attention_kernels.attention_mask),
        full forward of the dense backend only (a cache or NSA raise: their masks have no prefix)."""
        if prefix_segment is not None and (cache is not None or self.nsa is not None):
            raise ValueError("shared-prefix attention (prefix_segment, grpo.shared_prefix) runs only in the "
                             "dense backend's full forward: model.attention_backend='nsa' and cached calls "
                             "have no prefix mask")
        dt = self.dtype
        q_nope, q_rope, latent, k_rope = self._project(x, positions)
        w_kvb = weight(self.kv_b_proj, dt)
        if cache is None and self.nsa is not None:
            o = self._nsa(x, q_nope, q_rope, latent, k_rope, w_kvb, positions, segment_ids)
            new_cache = None
        elif cache is None:
            kvb = jnp.einsum("bsr,rhd->bshd", latent, w_kvb)
            k_nope, v = kvb[..., : self.dn], kvb[..., self.dn:]
            def xla(q_nope, q_rope, k_nope, k_rope, v):
                # the RoPE half of the scores in the precision RoPE returns (as the cached path's,
                # so the engine and the learner agree), no per-head key copies
                scores = (jnp.einsum("bthd,bshd->bhts", q_nope, k_nope, preferred_element_type=jnp.float32)
                          + jnp.einsum("bthd,bsd->bhts", q_rope, k_rope, preferred_element_type=jnp.float32))
                mask = attention_kernels.attention_mask(segment_ids, prefix_segment)  # [B,1,T,S]
                probs = jax.nn.softmax(jnp.where(mask, scores * self.scale, NEG_INF), axis=-1)
                return jnp.einsum("bhts,bshd->bthd", probs.astype(dt), v)

            def kernel(q_nope, q_rope, k_nope, k_rope, v):
                # one RoPE key for all heads: broadcast, so q . k = q_n . k_n + q_r . k_r per head
                k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope[:, :, None, :].astype(dt),
                                                              (*k_rope.shape[:2], self.h, self.dr))], -1)
                q = jnp.concatenate([q_nope, q_rope.astype(dt)], -1)
                # splash attention on TPU, the Triton flash kernel on GPU (chosen at lowering)
                return attention_kernels.attention(q, k, v, segment_ids, self.scale, prefix_segment,
                                                   self.context_parallel)

            parts = (q_nope, q_rope, k_nope, k_rope, v)
            if self.context_parallel == "ring" and attention_kernels.sequence_shards() > 1:
                o = kernel(*parts)  # every platform's ring (XLA's blocks on CPU)
            elif sharding.targets_cpu():
                o = xla(*parts)
            elif prefix_segment is None:
                o = kernel(*parts)
            else:  # shared-prefix rows: the GPU kernel takes their mask, splash does not
                o = sharding.platform_dependent(*parts, cuda=kernel, default=xla)
            new_cache = None
        elif self.nsa is not None:
            new_cache = write_cache(cache, latent, k_rope, positions, segment_ids, cache_at)
            o, new_cache = self._nsa_cached(x, q_nope, q_rope, w_kvb, positions, segment_ids, new_cache, cache_at)
        else:
            new_cache = write_cache(cache, latent, k_rope, positions, segment_ids, cache_at)
            c_all = read_cache(new_cache, "latent", cache_at).astype(dt)  # [B,S,r]
            r_all = read_cache(new_cache, "rope", cache_at).astype(dt)  # [B,S,dr]
            q_abs = jnp.einsum("bthd,rhd->bthr", q_nope, w_kvb[..., : self.dn])
            o_lat = cached_attention(q_abs, q_rope, c_all, r_all, positions, self.scale)
            o = jnp.einsum("bthr,rhd->bthd", o_lat, w_kvb[..., self.dn:])
        o = constrain(o, ("batch", "seq", "heads", None))
        # summed over heads straight into the residual stream's layout (a reduce-scatter over
        # the head axes when `res_seq` splits tokens over them)
        out = constrain(jnp.einsum("bthd,hde->bte", o, weight(self.o_proj, dt)), ("batch", "res_seq", None))
        return out, new_cache

    def _nsa(self, x, q_nope, q_rope, latent, k_rope, w_kvb, positions, segment_ids):
        """Native Sparse Attention in MLA's absorbed (MQA) form -> o `[B,T,H,dv]`.

        q = [q_nope W_uk, RoPE(q_r)] `[B,T,H,r+dr]`, one key group k = [c, k_r] `[B,T,1,r+dr]`
        and v = c `[B,T,1,r]`: every head shares one block selection (DeepSeek's sparse
        attention); W_uv is applied after attention, as in the cached dense path.
        """
        q_abs = jnp.einsum("bthd,rhd->bthr", q_nope, w_kvb[..., : self.dn])
        q = jnp.concatenate([q_abs, q_rope.astype(q_abs.dtype)], axis=-1)
        k = jnp.concatenate([latent, k_rope.astype(latent.dtype)], axis=-1)[:, :, None, :]
        v = latent[:, :, None, :]
        args = (q, k, v, x, segment_ids, positions)
        call = lambda impl, kernel=None: lambda *a: self.nsa(*a, softmax_scale=self.scale, impl=impl,
                                                             kernel=kernel)
        if (parallel := self._nsa_sequence_parallel(*args)) is not None:
            o_lat = parallel
        elif _NSA_FORCED is not None:
            impl, kernel = _NSA_FORCED
            if impl == "pallas_gpu" and (why := self._nsa_gpu_unsupported(lower=False)):
                raise ValueError(f"force_nsa_impl('pallas_gpu'): {why}")
            o_lat = call(impl, kernel)(*args)
        else:
            # the program's platform's (stage `compile` lowers for TPU from a CPU host): Pallas
            # TPU kernels, Mosaic GPU kernels, the blockwise XLA path. The GPU branch is chosen
            # (its kernels checked, a fallback logged) only when that branch is traced
            o_lat = sharding.platform_dependent(*args, tpu=call("pallas_tpu"),
                                               cuda=lambda *a: self._nsa_gpu(call)(*a), default=call("xla"))
        return jnp.einsum("bthr,rhd->bthd", o_lat.astype(self.dtype), w_kvb[..., self.dn:])

    def _nsa_sequence_parallel(self, q, k, v, x, segment_ids, positions):
        """NSA with each row's queries split over the mesh's `sequence` axes, or None when the
        active mesh does not split them. Compression and gates run as XLA partitions them; the
        attention in a shard_map: each device its queries against the row's whole keys (k, v,
        k_cmp, v_cmp gathered: r + dr features a token, T/d compressed ones) at the queries'
        absolute positions, with the window's halo read from the gathered keys: by the kernels
        the platform's whole-row call would run (coder.pallas.nsa.ops.nsa_local: the shard's
        offset an operand of the selected kernels; on GPU where `_nsa_gpu` takes them), else by
        the XLA path (coder.pallas.nsa.xla.nsa_local); `force_nsa_impl` may pick any but
        "reference". Left to XLA's SPMD pass,
        the XLA path computed the same numbers but put collectives inside its per-chunk loops:
        16 million all-reduces a step at 128k on v5p-512 (docs/scale)."""
        del positions
        ctx = sharding.current()
        if ctx is None:
            return None
        mesh, rules = ctx
        b, t, h, _ = q.shape
        spec = sharding.logical_to_spec(("batch", "seq", "heads"), rules)
        keep = lambda axes, dim: axes if axes is not None and dim % attention_kernels._size(mesh, axes) == 0 else None
        bs, ss, hs = keep(spec[0], b), keep(spec[1], t), keep(spec[2], h)
        n = attention_kernels._size(mesh, ss)
        if n == 1:
            return None
        from coder.pallas.nsa import ops as nsa_ops
        from coder.pallas.nsa import xla as nsa_xla

        cfg, scale = self.nsa.cfg, self.scale

        def local(impl, kernel=None):
            def run(q, k, v, k_cmp, v_cmp, gates, seg):
                offset = jax.lax.axis_index(ss) * q.shape[1]
                if impl == "xla":
                    return nsa_xla.nsa_local(q, k, v, k_cmp, v_cmp, gates, seg, offset, cfg, scale).astype(v.dtype)
                return nsa_ops.nsa_local(q, k, v, k_cmp, v_cmp, gates, seg, offset, cfg=cfg, softmax_scale=scale,
                                         kernel=kernel or nsa_ops.Kernel(backend=impl))
            return run

        if _NSA_FORCED is not None:
            impl, kernel = _NSA_FORCED
            if impl == "reference":
                raise ValueError(f"force_nsa_impl('reference'): the queries are split over {n} sequence shards, "
                                 "which 'xla', 'pallas_tpu' and 'pallas_gpu' take (the reference attends whole rows)")
            if impl == "pallas_gpu" and (why := self._nsa_gpu_unsupported(lower=False)):
                raise ValueError(f"force_nsa_impl('pallas_gpu'): {why}")
            body = local(impl, kernel)
        else:
            _log_once(f"attention_backend=nsa: queries split over {n} sequence shards: each device's queries "
                      "against the gathered keys in a shard_map, by the platform's NSA kernels at the shard's "
                      "offset (or its XLA path)")
            heads = h // attention_kernels._size(mesh, hs)  # a device's share, what its kernels take
            body = lambda *a: sharding.platform_dependent(*a, tpu=local("pallas_tpu"), default=local("xla"),
                                                          cuda=lambda *b: self._nsa_gpu(local, heads)(*b))
        k_cmp, v_cmp = self.nsa.compress(k, v)
        gates = self.nsa.gates(x)
        split, whole = P(bs, ss, hs, None), P(bs, None, None, None)
        fn = jax.shard_map(body, mesh=mesh, in_specs=(split, whole, whole, whole, whole, split, P(bs, None)),
                           out_specs=split, check_vma=False)
        return fn(q, k, v, k_cmp, v_cmp, gates, segment_ids)

    def _nsa_gpu(self, call, heads: int | None = None):
        """The `cuda` branch of `_nsa` (and of `_nsa_sequence_parallel`, whose `call` runs a
        shard's queries): NSA with the Mosaic GPU kernels (coder/pallas/nsa/gpu.py,
        forward and backward; the window tile is their fixed 64, heads padded to 64 wgmma rows),
        or the XLA path, with the reason logged, where they cannot take this layer. In a program
        for TPU devices (stage `compile`) the branch never runs: XLA, and no GPU kernel traced."""
        device = sharding.target_device()
        if device.platform == "tpu":
            return call("xla")
        why = self._nsa_gpu_unsupported(device, heads=heads)
        if why is None:
            return call("pallas_gpu")
        _log_once(f"attention_backend=nsa: a program lowered for GPU runs NSA's XLA path, not "
                  f"its Mosaic GPU kernels: {why}")
        return call("xla")

    def _nsa_gpu_unsupported(self, device=None, lower: bool = True, heads: int | None = None) -> str | None:
        """Why the Mosaic GPU NSA kernels cannot run this layer (naming the config keys), or None.
        MLA's absorbed form is one key group for all heads, key width r + dr, value width r;
        coder.pallas.nsa.ops.gpu_unsupported checks those (lower: also that Mosaic GPU lowers the
        kernels, i.e. their shared memory fits). device: the program's; a CUDA device must be
        Hopper (compute capability 9.x), the kernels being built on wgmma. Other devices (a CPU
        host lowering for CUDA) and None (forced, interpret mode) are not checked. heads: the
        query heads one kernel call takes (a shard_map's share; default all of the layer's)."""
        from coder.pallas.nsa import ops

        cfg = self.nsa.cfg
        why = ops.gpu_unsupported(heads or self.h, self.r + self.dr, self.r, cfg.select_block, lower=lower)
        if why:
            return (f"model.num_attention_heads={self.h}, model.kv_lora_rank={self.r}, "
                    f"model.qk_rope_head_dim={self.dr} (key width {self.r + self.dr}, value width "
                    f"{self.r}), model.nsa.select_block={cfg.select_block}: {why}")
        cc = str(getattr(device, "compute_capability", ""))  # CUDA devices only ("9.0"; ROCm: "gfx...")
        if cc.split(".")[0].isdigit() and cc.split(".")[0] != "9":
            return (f"{device.device_kind} has compute capability {cc}; the kernels use wgmma "
                    f"(Hopper, 9.x, only)")
        return None

    def _nsa_cached(self, x, q_nope, q_rope, w_kvb, positions, segment_ids, cache, at: CacheIndex):
        """NSA for a cached call (decode, chunked prefill, verification), after the call's tokens
        were written -> (o `[B,T,H,dv]`, cache with current compressed entries).

        The raw keys/values are the cache itself, read in place: k = [latent, rope], v = latent.
        First every compression block whose last slot this call wrote is recomputed from the
        cache (NSA.compress_update), then each query runs coder.pallas.nsa.decode.decode_step at
        its own position, which reads the compressed entries, the query's n selected blocks and
        its window (slots <= the position only), with the gates of its layer input `x`: the
        full forward's NSA for a row holding one document.
        """
        from coder.pallas.nsa.decode import decode_step

        # decode_step is XLA on every platform: the Pallas kernels (TPU and GPU) are written for
        # the full forward, where query t is key t of one packed row (their masks compare the
        # query's index with the key's); a query at cache position p against S slots has no
        # kernel, and the step reads only ~(S/d + n l' + w) slots (docs/nsa.md)
        dt = self.dtype
        lat = read_cache(cache, "latent", at)[:, :, None]  # [B,S,1,r]
        rope = read_cache(cache, "rope", at)[:, :, None]  # [B,S,1,dr]
        k_cmp, v_cmp = self.nsa.compress_update((lat, rope), lat, read_cache(cache, "k_cmp", at),
                                                read_cache(cache, "v_cmp", at), positions, segment_ids > 0,
                                                dtype=dt)
        q_abs = jnp.einsum("bthd,rhd->bthr", q_nope, w_kvb[..., : self.dn])
        q = jnp.concatenate([q_abs, q_rope.astype(q_abs.dtype)], axis=-1)  # [B,T,H,r+dr]
        gates = self.nsa.gates(x)  # [B,T,H,3]

        def one(args):  # the batch's t-th queries
            q_t, g_t, p_t = args
            return decode_step(q_t, (lat, rope), lat, k_cmp, v_cmp, g_t, p_t, cfg=self.nsa.cfg,
                               softmax_scale=self.scale)

        # queries in vmapped groups of NSA_QUERY_CHUNK (bounds the gathered blocks' memory)
        tmajor = lambda a: jnp.swapaxes(a, 0, 1)
        o_lat = jax.lax.map(one, (tmajor(q), tmajor(gates), tmajor(positions)), batch_size=NSA_QUERY_CHUNK)
        o = jnp.einsum("bthr,rhd->bthd", tmajor(o_lat).astype(dt), w_kvb[..., self.dn:])
        # the compressed entries (1/d of the cache) written back whole for the call's rows
        return o, dict(cache, k_cmp=put_cache(cache, "k_cmp", k_cmp, at), v_cmp=put_cache(cache, "v_cmp", v_cmp, at))
