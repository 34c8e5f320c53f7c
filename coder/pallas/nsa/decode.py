"""One NSA decode step against caches indexed by absolute position.

Reads only what NSA needs for the token at `pos`: the compressed keys/values (S/d of them), the n
selected blocks of l' tokens, and the last w tokens; never the whole cache. Matches
reference.nsa at the last position (tests/pallas/test_nsa_module.py; the model's cached calls and the
engine: tests/model/test_nsa_engine.py).

Shapes: q [B,H,Dk]; k_cache [B,S,G,Dk], v_cache [B,S,G,Dv] (token at slot p = position p);
k_cmp_cache [B,Sc,G,Dk], v_cmp_cache [B,Sc,G,Dv] with Sc >= ceil(S/d) (entry i summarises slots
[i*d, i*d + l), kept current by NSA.compress_update); gates [B,H,3]; pos [B] int32, the query's
slot (already written); doc_start [B] int32, first slot of the query's document (0 when a row
holds one conversation, as the engine's cache does).

A raw cache may also be a tuple of feature parts [B,S,G,D_i] that concatenate to the keys
(values): MLA passes k = (latent, rope) and v = latent straight from its cache, so only the
gathered slots are concatenated, never the whole cache.
"""
import jax
import jax.numpy as jnp

from coder.pallas.nsa.reference import (
    NEG_INF,
    NSAConfig,
    banded_scores,
    canonical_topk,
    overlap_bands,
)


def parts(cache) -> tuple:
    """A raw cache [B,S,G,D] or a tuple of feature parts -> tuple of parts."""
    return tuple(cache) if isinstance(cache, (tuple, list)) else (cache,)


def gather_slots(cache, slots):
    """Slots `slots` [B,M] of every group -> [B,M,G,D] (parts read separately, then joined)."""
    take = jax.vmap(lambda x, i: x[i])  # over B: [S,G,D_i][M] -> [M,G,D_i]
    return jnp.concatenate([take(x, slots) for x in parts(cache)], axis=-1)


def _attend(q, k, v, mask, scale):
    """q [B,G,Hg,Dk], k [B,G,S,Dk], v [B,G,S,Dv], mask [B,G or 1,S] -> [B,G,Hg,Dv], probs."""
    s = jnp.einsum("bghd,bgsd->bghs", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
    m = mask[:, :, None, :]
    s = jnp.where(m, s, NEG_INF)
    p = jnp.exp(s - s.max(-1, keepdims=True)) * m
    p = p / jnp.maximum(p.sum(-1, keepdims=True), 1e-30)
    return jnp.einsum("bghs,bgsd->bghd", p, v.astype(jnp.float32)), p


def decode_step(q, k_cache, v_cache, k_cmp_cache, v_cmp_cache, gates, pos, doc_start=None, *,
                cfg: NSAConfig, softmax_scale: float):
    """-> out [B,H,Dv] float32 for the query at slot `pos` (see module docstring)."""
    b, h, dk = q.shape
    s_len, g = parts(k_cache)[0].shape[1], parts(k_cache)[0].shape[2]
    hg, lsel, n = h // g, cfg.select_block, cfg.select_topk
    doc_start = jnp.zeros_like(pos) if doc_start is None else doc_start
    qg = q.reshape(b, g, hg, dk)
    tr = lambda x: jnp.swapaxes(x, 1, 2)  # [B,S,G,D] -> [B,G,S,D]

    # compressed branch + importance
    nc = -(-s_len // cfg.compress_stride)
    starts = jnp.arange(nc) * cfg.compress_stride
    vis = (starts[None] + cfg.compress_block - 1 <= pos[:, None]) & (starts[None] >= doc_start[:, None])
    o_cmp, p_cmp = _attend(qg, tr(k_cmp_cache[:, :nc]), tr(v_cmp_cache[:, :nc]), vis[:, None], softmax_scale)
    imp = banded_scores(p_cmp.sum(2), *overlap_bands(s_len, cfg))  # [B,G,Ns]

    # selection (same rule as reference.select_blocks for the last query)
    ns = imp.shape[-1]
    j = jnp.arange(ns)[None]
    cur, first = (pos // lsel)[:, None], (doc_start // lsel)[:, None]
    cand = (j * lsel <= pos[:, None]) & ((j + 1) * lsel - 1 >= doc_start[:, None])
    forced = cand & ((j == cur) | (j == cur - 1) | (j == first))
    bg = lambda x: jnp.broadcast_to(x[:, None], imp.shape)
    sel = canonical_topk(jax.lax.stop_gradient(imp), bg(forced), bg(cand),
                         jnp.broadcast_to(cur, (b, g)), n)  # [B,G,n]

    # selected branch: gather n blocks of l' slots
    tok = (sel[..., None] * lsel + jnp.arange(lsel)).reshape(b, g, n * lsel)  # [B,G,n*l']
    active = jnp.concatenate([jnp.ones_like(sel[..., :1], bool), sel[..., 1:] != sel[..., :-1]], -1)
    ok = (jnp.repeat(active, lsel, axis=-1) & (tok <= pos[:, None, None]) & (tok >= doc_start[:, None, None])
          & (tok < s_len))
    tok_c = jnp.minimum(tok, s_len - 1)
    take = jax.vmap(lambda x, i: x[i, jnp.arange(g)[:, None]])  # per row: [S,G,D][G,m] -> [G,m,D]
    gather = lambda c: jnp.concatenate([take(x, tok_c) for x in parts(c)], axis=-1)
    k_sel, v_sel = gather(k_cache), gather(v_cache)  # [B,G,n*l',D]
    o_slc, _ = _attend(qg, k_sel, v_sel, ok, softmax_scale)

    # window: the last w slots up to pos
    w = min(cfg.window, s_len)
    start = jnp.clip(pos - w + 1, 0, s_len - w)
    last_w = lambda c: jnp.concatenate(
        [jax.vmap(lambda x, s0: jax.lax.dynamic_slice_in_dim(x, s0, w, axis=0))(x, start) for x in parts(c)],
        axis=-1)  # [B,w,G,D]
    win_k, win_v = last_w(k_cache), last_w(v_cache)
    slot = start[:, None] + jnp.arange(w)
    wmask = (slot <= pos[:, None]) & (pos[:, None] - slot < cfg.window) & (slot >= doc_start[:, None])
    o_win, _ = _attend(qg, tr(win_k), tr(win_v), wmask[:, None], softmax_scale)

    gf = gates.astype(jnp.float32).reshape(b, g, hg, 3)
    out = gf[..., 0:1] * o_cmp + gf[..., 1:2] * o_slc + gf[..., 2:3] * o_win
    return out.reshape(b, h, -1)


def bytes_per_token(pos: int, cfg: NSAConfig, *, key_bytes: int, value_bytes: int, cmp_bytes: int,
                    shared_kv: bool = False, cache_len: int | None = None):
    """Cache bytes decode_step reads for a query at `pos`, and a dense step's read of slots [0, pos].

    key_bytes/value_bytes: one slot's K / V (all groups); cmp_bytes: one compressed K + V entry;
    shared_kv: V is a slice of K (MLA's latent), so the value reads are the key reads of the same
    slots (one read once XLA merges the identical gathers); cache_len: the raw cache's slots S
    (default pos + 1). decode_step reads, whatever `pos`: all ceil(S/d) compressed entries (those
    not yet visible are masked, not skipped), n * l' slots for the selected blocks (inactive
    repeats too) and min(w, S) window slots. The local blocks lie in the window too, so a kernel
    reading each slot once would read up to 2 l' slots fewer.
    tests/pallas/test_nsa_module.py checks this count against decode_step's program. -> (nsa_bytes, dense_bytes)
    """
    s_len = pos + 1 if cache_len is None else cache_len
    slot_bytes = key_bytes if shared_kv else key_bytes + value_bytes
    n_cmp = -(-s_len // cfg.compress_stride)
    n_slots = cfg.select_topk * cfg.select_block + min(cfg.window, s_len)
    return n_cmp * cmp_bytes + n_slots * slot_bytes, (pos + 1) * slot_bytes
