"""Blockwise XLA implementation of NSA: the training path on CPU and the non-kernel parts on TPU/GPU.

Memory stays linear in T: each branch maps over chunks of queries (`lax.map` of a rematerialised
body, so the backward pass keeps only the chunk inputs) and touches only the keys it needs:
- compressed: all compressed blocks (T/d of them), and in the same pass the top-n selection;
- selected: a gather of the n selected blocks of each query (n * l' keys);
- window: a dynamic slice of the w + chunk keys before each query chunk.

Document masking uses `doc_start [B,T]` (index of the first token of the query's document),
which is exact when every segment id occupies one contiguous run of the row (packed batches).
Shapes and the canonical selection format are those of reference.py.

Sequence parallelism (`nsa_local`): a device holds the queries [offset, offset + T_l) of each row
and every key (k, v, k_cmp, v_cmp gathered whole: MLA's absorbed keys are r + dr features a
token, and the compressed ones T/d of them); each branch then runs its local queries at their
absolute positions. A query's work does not depend on its position (all compressed keys masked,
n selected blocks, one window), so contiguous shards balance without a zigzag.
"""
import functools

import jax
import jax.numpy as jnp

from coder.pallas.nsa.reference import (
    NEG_INF,
    NSAConfig,
    banded_scores,
    canonical_topk,
    num_select_blocks,
    overlap_bands,
)


def doc_starts(segment_ids):
    """[B,T] segment ids -> [B,T] int32 index of the first token of each token's document run."""
    t = jnp.arange(segment_ids.shape[1], dtype=jnp.int32)
    new = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool),
                           segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    return jax.lax.cummax(jnp.where(new, t[None], 0), axis=1)


def _round_up(x, m):
    return -(-x // m) * m


def _chunk_queries(q, doc_start, chunk):
    """Pads T to a multiple of the chunk C; q [B,T,...] -> (q [N,B,C,...], ds [N,B,C], N, C).

    Padded queries get doc_start = their own index, so they see only themselves (no NaN).
    """
    b, t = doc_start.shape
    c = min(chunk, _round_up(t, 8))
    tp = _round_up(t, c)
    q = jnp.pad(q, ((0, 0), (0, tp - t)) + ((0, 0),) * (q.ndim - 2))
    ds = jnp.concatenate([doc_start, jnp.broadcast_to(jnp.arange(t, tp, dtype=jnp.int32), (b, tp - t))], 1)
    n = tp // c
    q = jnp.moveaxis(q.reshape((b, n, c) + q.shape[2:]), 1, 0)
    ds = jnp.moveaxis(ds.reshape(b, n, c), 1, 0)
    return q, ds, n, c


def _unchunk(x, t):
    """[N,B,C,...] -> [B,T,...]."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape((x.shape[0], -1) + x.shape[3:])[:, :t]


def _map(body, xs, unroll):
    """lax.map as a scan; unroll=True lets XLA's cost analysis count every chunk (it counts a
    rolled loop's body once)."""
    return jax.lax.scan(lambda carry, x: (carry, body(x)), None, xs, unroll=unroll)[1]


def _softmax_rows(s, mask):
    """Softmax over the last axis with empty rows -> 0."""
    s = jnp.where(mask, s, NEG_INF)
    p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True)) * mask
    return p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)


SUPER_CHUNKS = 8  # compressed branch: query groups with their own causal key count


def compress_and_select(q, k_cmp, v_cmp, doc_start, cfg: NSAConfig, scale, chunk=256, unroll=False,
                        offset=None, total=None):
    """Compressed branch and block selection in one pass over query chunks.

    q [B,T,H,Dk], k_cmp [B,Nc,G,Dk], v_cmp [B,Nc,G,Dv], doc_start [B,T]
    -> (o_cmp [B,T,H,Dv] float32, sel [B,T,G,n] int32 canonical, gradient-free).
    The chunks are split into up to SUPER_CHUNKS consecutive groups; a group reads only the
    compressed blocks its last query can see, which skips most of the work above the diagonal.
    offset (traced int) / total: the queries are [offset, offset + T) of a row of `total` tokens
    (sequence parallelism, module docstring); every chunk then reads every compressed block.
    """
    b, t, h, dk = q.shape
    nc, g = k_cmp.shape[1], k_cmp.shape[2]
    total = t if total is None else total
    ns = num_select_blocks(total, cfg)
    lsel = cfg.select_block
    band_idx, band_wt = overlap_bands(total, cfg)
    base = 0 if offset is None else offset
    qc, dsc, n, c = _chunk_queries(q.reshape(b, t, g, h // g, dk), doc_start, chunk)
    kf_all, vf_all = k_cmp.astype(jnp.float32), v_cmp.astype(jnp.float32)

    def make_body(nk):
        starts = jnp.arange(nk) * cfg.compress_stride
        ends = starts + cfg.compress_block - 1
        kf, vf = kf_all[:, :nk], vf_all[:, :nk]

        @jax.checkpoint
        def body(args):
            qi, dsi, i = args  # [B,C,G,Hg,Dk], [B,C], scalar
            tq = base + i * c + jnp.arange(c)
            vis = (ends[None, None, :] <= tq[None, :, None]) & (starts[None, None, :] >= dsi[:, :, None])
            s = jnp.einsum("bcghd,bngd->bcghn", qi.astype(jnp.float32), kf) * scale
            p = _softmax_rows(s, vis[:, :, None, None, :])
            o = jnp.einsum("bcghn,bngd->bcghd", p, vf)
            imp = banded_scores(jax.lax.stop_gradient(p).sum(3), band_idx, band_wt)  # [B,C,G,Ns]
            j = jnp.arange(ns)[None, None, :]
            cur, first = (tq // lsel)[None, :, None], (dsi // lsel)[..., None]
            cand = (j * lsel <= tq[None, :, None]) & ((j + 1) * lsel - 1 >= dsi[..., None])
            forced = cand & ((j == cur) | (j == cur - 1) | (j == first))
            bg = lambda x: jnp.broadcast_to(x[:, :, None, :], imp.shape)
            cur_b = jnp.broadcast_to(cur, (b, c, 1))
            sel = canonical_topk(imp, bg(forced), bg(cand), jnp.broadcast_to(cur_b, imp.shape[:3]),
                                 cfg.select_topk)
            return o, sel
        return body

    per = -(-n // min(SUPER_CHUNKS, n)) if offset is None else n
    outs, sels = [], []
    for lo in range(0, n, per):
        hi = min(lo + per, n)
        nk = min(nc, max(1, (hi * c - cfg.compress_block) // cfg.compress_stride + 1)) if offset is None else nc
        o, sel = _map(make_body(nk), (qc[lo:hi], dsc[lo:hi], jnp.arange(lo, hi)), unroll)
        outs.append(o)
        sels.append(sel)
    o, sel = jnp.concatenate(outs, 0), jnp.concatenate(sels, 0)
    return _unchunk(o, t).reshape(b, t, h, -1), _unchunk(sel, t)


def active_slots(sel):
    """Canonical sel [..., n] -> bool [..., n]: first occurrence of each block."""
    return jnp.concatenate([jnp.ones_like(sel[..., :1], bool), sel[..., 1:] != sel[..., :-1]], -1)


def selected_attention(q, k, v, sel, doc_start, select_block, scale, chunk=128, unroll=False, offset=None):
    """Attention over the selected blocks by gathering them per query.

    q [B,T,H,Dk], k [B,S,G,Dk], v [B,S,G,Dv], sel [B,T,G,n] canonical, doc_start [B,T]
    -> [B,T,H,Dv] float32. S = T, or (offset: the queries' first position) the whole row's keys.
    """
    b, t, h, dk = q.shape
    s_len, g, dv = k.shape[1], k.shape[2], v.shape[3]
    lb = select_block
    ns = -(-s_len // lb)
    base = 0 if offset is None else offset
    pad = ((0, 0), (0, ns * lb - s_len), (0, 0), (0, 0))
    kb = jnp.pad(k, pad).reshape(b, ns, lb, g, dk).transpose(0, 3, 1, 2, 4)  # [B,G,Ns,lb,Dk]
    vb = jnp.pad(v, pad).reshape(b, ns, lb, g, dv).transpose(0, 3, 1, 2, 4)
    qc, dsc, n, c = _chunk_queries(q.reshape(b, t, g, h // g, dk), doc_start, chunk)
    selp = jnp.pad(sel, ((0, 0), (0, n * c - t), (0, 0), (0, 0)))  # padded rows: block 0, masked out
    selc = jnp.moveaxis(selp.reshape((b, n, c) + sel.shape[2:]), 1, 0)
    gather = jax.vmap(jax.vmap(lambda x, idx: x[idx]))  # over B, G: [Ns,lb,D][C,n] -> [C,n,lb,D]

    @jax.checkpoint
    def body(args):
        qi, si, dsi, i = args  # [B,C,G,Hg,Dk], [B,C,G,n], [B,C], scalar
        idx = si.transpose(0, 2, 1, 3)  # [B,G,C,n]
        kg, vg = gather(kb, idx), gather(vb, idx)  # [B,G,C,n,lb,D]
        s = jnp.einsum("bcghd,bgcnld->bcghnl", qi.astype(jnp.float32), kg.astype(jnp.float32)) * scale
        tq = (base + i * c + jnp.arange(c))[None, :, None, None, None]
        pos = si[..., None] * lb + jnp.arange(lb)  # [B,C,G,n,lb]
        mask = active_slots(si)[..., None] & (pos <= tq) & (pos >= dsi[:, :, None, None, None])
        sh = s.shape
        p = _softmax_rows(s.reshape(sh[:4] + (-1,)), mask.reshape(sh[:3] + (1, -1)))
        return jnp.einsum("bcghm,bgcmd->bcghd", p, vg.astype(jnp.float32).reshape(b, g, c, -1, dv))

    o = _map(body, (qc, selc, dsc, jnp.arange(n)), unroll)
    return _unchunk(o, t).reshape(b, t, h, dv)


def window_attention(q, k, v, doc_start, window, scale, chunk=128, offset=None):
    """Sliding-window attention, each query chunk against the window + chunk keys before it.

    q [B,T,H,Dk], k [B,T,G,Dk], v [B,T,G,Dv], doc_start [B,T] -> [B,T,H,Dv] float32.
    All chunks at once (no loop): the keys of chunk i are a stack of nw shifted views of the key
    chunks, so the memory is O(T * (w + chunk)) and the backward is a sum of shifted slices.
    offset: the queries are [offset, offset + T) and k, v the whole row's (any length): the keys
    read are the window before the first query (the halo) through the last query.
    """
    b, t, h, dk = q.shape
    g, dv = k.shape[2], v.shape[3]
    chunk = max(8, min(chunk, window // 4))  # keys read beyond the window: at most a quarter more
    c = min(chunk, _round_up(t, 8))
    n = -(-t // c)
    front = _round_up(max(window - 1, 0), c)
    nw, span = front // c + 1, front + c
    pad_q = ((0, 0), (0, n * c - t))
    qc = jnp.pad(q.reshape(b, t, g, h // g, dk), pad_q + ((0, 0),) * 3).reshape(b, n, c, g, h // g, dk)
    pad_ids = jnp.arange(t, n * c, dtype=jnp.int32) + (0 if offset is None else offset)
    ds = jnp.concatenate([doc_start, jnp.broadcast_to(pad_ids, (b, n * c - t))], 1)

    base = 0 if offset is None else offset

    def keys(x):  # [B, front + n*c, G, D]: positions [base - front, base + n*c), zeros outside the row
        if offset is None:
            return jnp.pad(x, ((0, 0), (front, n * c - t), (0, 0), (0, 0)))
        xp = jnp.pad(x, ((0, 0), (front, n * c), (0, 0), (0, 0)))
        return jax.lax.dynamic_slice_in_dim(xp, offset, front + n * c, axis=1)

    @jax.checkpoint
    def attend(qc, k, v, ds):
        kc = keys(k).astype(jnp.float32).reshape(b, n + nw - 1, c, g, dk)
        vc = keys(v).astype(jnp.float32).reshape(b, n + nw - 1, c, g, dv)
        kw = jnp.stack([kc[:, j:j + n] for j in range(nw)], axis=2).reshape(b, n, span, g, dk)
        vw = jnp.stack([vc[:, j:j + n] for j in range(nw)], axis=2).reshape(b, n, span, g, dv)
        s = jnp.einsum("bncghd,bnsgd->bncghs", qc.astype(jnp.float32), kw) * scale
        tq = base + (jnp.arange(n)[:, None] * c + jnp.arange(c))[None, :, :, None]  # [1,n,c,1]
        pos = base + (jnp.arange(n)[:, None] * c - front + jnp.arange(span))[None, :, None, :]  # [1,n,1,span]
        mask = (pos <= tq) & (tq - pos < window) & (pos >= ds.reshape(b, n, c)[..., None])
        p = _softmax_rows(s, mask[:, :, :, None, None, :])
        return jnp.einsum("bncghs,bnsgd->bncghd", p, vw)

    o = attend(qc, k, v, ds)
    return o.reshape(b, n * c, h, dv)[:, :t]


def combine(gates, o_cmp, o_slc, o_win):
    """gates [B,T,H,3] (cmp, slc, win) -> sum of gated branch outputs [B,T,H,Dv] float32."""
    g = gates.astype(jnp.float32)
    return g[..., 0:1] * o_cmp + g[..., 1:2] * o_slc + g[..., 2:3] * o_win


@functools.partial(jax.jit, static_argnames=("cfg", "scale", "chunk", "unroll"))
def nsa(q, k, v, k_cmp, v_cmp, gates, segment_ids, cfg: NSAConfig, scale, chunk=128, unroll=False):
    """Blockwise XLA NSA -> [B,T,H,Dv] float32; same arguments as reference.nsa."""
    ds = doc_starts(segment_ids)
    o_cmp, sel = compress_and_select(q, k_cmp, v_cmp, ds, cfg, scale, chunk, unroll)
    o_slc = selected_attention(q, k, v, sel, ds, cfg.select_block, scale, chunk, unroll)
    o_win = window_attention(q, k, v, ds, cfg.window, scale, chunk)
    return combine(gates, o_cmp, o_slc, o_win)


def nsa_local(q, k, v, k_cmp, v_cmp, gates, segment_ids, offset, cfg: NSAConfig, scale, chunk=128):
    """One device's part of a sequence-parallel NSA (module docstring): q [B,Tl,H,Dk] and gates
    [B,Tl,H,3] of the queries [offset, offset + Tl); k [B,T,G,Dk], v [B,T,G,Dv], k_cmp/v_cmp
    [B,Nc,G,D] and segment_ids [B,T] of the whole rows -> [B,Tl,H,Dv] float32."""
    t_local = q.shape[1]
    ds = jax.lax.dynamic_slice_in_dim(doc_starts(segment_ids), offset, t_local, axis=1)
    o_cmp, sel = compress_and_select(q, k_cmp, v_cmp, ds, cfg, scale, chunk, offset=offset, total=k.shape[1])
    o_slc = selected_attention(q, k, v, sel, ds, cfg.select_block, scale, chunk, offset=offset)
    o_win = window_attention(q, k, v, ds, cfg.window, scale, chunk, offset=offset)
    return combine(gates, o_cmp, o_slc, o_win)
