"""Mosaic TPU kernels for NSA's selected and sliding-window branches, forward and backward.

Layouts (ops.py converts to and from the model's `[B,T,H,D]`; T is padded to the tile sizes):
  q `[B,G,T,Hg,Dk]` (the Hg heads of group g), k `[B,G,T,Dk]`, v `[B,G,T,Dv]`,
  doc_start `[B,T]` int32 (first token of the query's document), lse/delta `[B,G,T,Hg,1]` f32.
The window kernels view q as rows `[B,G,T*Hg,Dk]` (row r = token r // Hg) so that one matmul
serves all heads of a group.

Selected branch (the paper's group-centric kernel): the Hg heads of a group share one selection,
so every selected key block is loaded once per group and token. Grid `(B, G, T/Tt, n, Tt)`: for a
tile of Tt tokens, slot i of the (sorted) selection of every token in turn. Because selections are
sorted and neighbouring tokens select nearly the same blocks, consecutive grid steps usually ask
for the same block and the pipeline skips the copy. Block indices are scalar-prefetched, and so
is `token_offset`, the absolute index of the first query token (the causal mask's bound): a
Python int, or a traced int32 where a device holds a shard of the row's queries (ops.nsa_local).
The key/value gradient inverts the selection: (token, slot) pairs sorted by block, plus one empty
pair per block so every output block is visited (and zeroed) once, consecutively; dK and dV of a
block accumulate in VMEM while the grid walks the pairs that selected it.

Window branch: flash attention restricted to the key tiles that can fall inside the window; the
grid's last axis walks them, index maps clamp the out-of-range ones (the copy is then skipped and
the compute guarded by `pl.when`).
"""
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from coder.pallas.nsa.reference import NEG_INF

_DOT_T = (((1,), (1,)), ((), ()))  # a @ b.T
_DOT_TN = (((0,), (0,)), ((), ()))  # a.T @ b


def _dot(a, b, dims=(((1,), (0,)), ((), ()))):
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _params(*semantics):
    return pltpu.CompilerParams(dimension_semantics=semantics)


def _cost(flops, transcendentals, bytes_accessed):
    """A kernel's pl.CostEstimate: what it computes (masked entries of a computed tile
    included) and moves. XLA's scheduler sees it, and coder.train.aot.hlo_stats.kernel_costs
    counts it once for every run of the kernel (XLA counts a loop body's once)."""
    return pl.CostEstimate(flops=int(flops), transcendentals=int(transcendentals), bytes_accessed=int(bytes_accessed))


def _nbytes(*arrays_or_shapes):
    """Bytes of arrays (or (shape, dtype) pairs)."""
    total = 0
    for a in arrays_or_shapes:
        shape, dtype = (a.shape, a.dtype) if hasattr(a, "shape") else a
        total += math.prod(shape) * jnp.dtype(dtype).itemsize
    return total


def _selected_cost(q, k, v, n, block, token_tile, widths, extra_bytes):
    """Selected kernels: every (token, slot) pair is a [Hg, l'] tile of scores; `widths` the
    matmul widths per score; K/V blocks are copied once per token tile and slot (neighbouring
    tokens mostly select the same block at a slot, and the pipeline skips a repeated copy)."""
    b_, g_, t_, hg, _ = q.shape
    pairs = b_ * g_ * t_ * n
    kv = b_ * g_ * -(-t_ // token_tile) * n * block * (k.shape[-1] * k.dtype.itemsize + v.shape[-1] * v.dtype.itemsize)
    return _cost(2 * pairs * hg * block * widths, pairs * hg * block, kv + extra_bytes)


def _window_cost(q, k, v, window, tile, widths, extra_bytes):
    """Window kernels: every query tile meets `_window_tiles` key tiles, each a [tile*Hg, tile]
    tile of scores; `widths` the matmul widths per score; K/V tiles read once per meeting."""
    b_, g_, r_, _ = q.shape
    t_ = k.shape[2]
    meetings = b_ * g_ * (t_ // tile) * _window_tiles(window, tile)
    scores = meetings * (r_ // t_) * tile * tile
    kv = meetings * tile * (k.shape[-1] * k.dtype.itemsize + v.shape[-1] * v.dtype.itemsize)
    return _cost(2 * scores * widths, scores, kv + extra_bytes)


def _offset(token_offset):
    """The selected kernels' token offset as their scalar-prefetched [1] int32 operand."""
    return jnp.asarray(token_offset, jnp.int32).reshape(1)


def _vmem(shape):
    return pltpu.MemorySpace.VMEM(shape, jnp.float32)


# ---------------------------------------------------------------- selected branch, forward

def selected_fwd(q, k, v, sel, doc_start, *, block, scale, token_tile, token_offset=0, interpret=None):
    """-> (o [B,G,T,Hg,Dv] q.dtype, lse [B,G,T,Hg,1] f32). sel [B,G,T,n] canonical.

    q, sel, doc_start hold T query tokens starting at absolute index token_offset (an int or a
    traced int32 scalar); k, v the whole row."""
    b_, g_, t_, hg, dk = q.shape
    dv, n, tt_ = v.shape[-1], sel.shape[-1], token_tile

    def slot(sel_ref, b, g, t, i):
        return sel_ref[((b * g_ + g) * t_ + t) * n + i]

    def kernel(sel_ref, ds_ref, off_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, m_sc, l_sc, acc_sc):
        b, g, qt, i, tt = (pl.program_id(a) for a in range(5))
        t = qt * tt_ + tt
        blk = slot(sel_ref, b, g, t, i)
        active = (i == 0) | (blk != slot(sel_ref, b, g, t, jnp.maximum(i - 1, 0)))

        @pl.when(i == 0)
        def _init():
            m_sc[tt] = jnp.full((hg, 1), NEG_INF, jnp.float32)
            l_sc[tt] = jnp.zeros((hg, 1), jnp.float32)
            acc_sc[tt] = jnp.zeros((hg, dv), jnp.float32)

        @pl.when(active)
        def _step():
            s = _dot(q_ref[tt], k_ref[...], _DOT_T) * scale  # [Hg, l']
            pos = blk * block + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
            mask = (pos <= off_ref[0] + t) & (pos >= ds_ref[b * t_ + t])
            s = jnp.where(mask, s, NEG_INF)
            m_prev = m_sc[tt]
            m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
            alpha = jnp.exp(m_prev - m_new)
            p = jnp.exp(s - m_new) * mask
            l_sc[tt] = alpha * l_sc[tt] + p.sum(axis=1, keepdims=True)
            acc_sc[tt] = alpha * acc_sc[tt] + _dot(p.astype(v_ref.dtype), v_ref[...])
            m_sc[tt] = m_new

        @pl.when(i == n - 1)
        def _finish():
            l = l_sc[tt]
            o_ref[tt] = (acc_sc[tt] / l).astype(o_ref.dtype)
            lse_ref[tt] = m_sc[tt] + jnp.log(l)

    lse_shape = ((b_, g_, t_, hg, 1), jnp.float32)
    tile = lambda b, g, qt, i, tt, sel_ref, ds_ref, off_ref: (b, g, qt, 0, 0)
    kv = lambda b, g, qt, i, tt, sel_ref, ds_ref, off_ref: (b, g, slot(sel_ref, b, g, qt * tt_ + tt, i), 0)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(b_, g_, t_ // tt_, n, tt_),
        in_specs=[pl.BlockSpec((None, None, tt_, hg, dk), tile),
                  pl.BlockSpec((None, None, block, dk), kv),
                  pl.BlockSpec((None, None, block, dv), kv)],
        out_specs=[pl.BlockSpec((None, None, tt_, hg, dv), tile),
                   pl.BlockSpec((None, None, tt_, hg, 1), tile)],
        scratch_shapes=[_vmem((tt_, hg, 1)), _vmem((tt_, hg, 1)), _vmem((tt_, hg, dv))],
    )
    return pl.pallas_call(
        kernel, grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((b_, g_, t_, hg, dv), q.dtype),
                   jax.ShapeDtypeStruct((b_, g_, t_, hg, 1), jnp.float32)],
        compiler_params=_params("parallel", "parallel", "parallel", "arbitrary", "arbitrary"),
        interpret=interpret,
        name="nsa_selected_fwd",
        cost_estimate=_selected_cost(q, k, v, n, block, tt_, dk + dv,
                                     _nbytes(q, ((b_, g_, t_, hg, dv), q.dtype), sel, doc_start, lse_shape)),
    )(sel.reshape(-1), doc_start.reshape(-1), _offset(token_offset), q, k, v)


# ---------------------------------------------------------------- selected branch, backward

def selected_dq(q, k, v, sel, doc_start, do, lse, delta, *, block, scale, token_tile, token_offset=0,
                interpret=None):
    """-> dq [B,G,T,Hg,Dk]: the forward's grid, recomputing probabilities from lse."""
    b_, g_, t_, hg, dk = q.shape
    dv, n, tt_ = v.shape[-1], sel.shape[-1], token_tile

    def slot(sel_ref, b, g, t, i):
        return sel_ref[((b * g_ + g) * t_ + t) * n + i]

    def kernel(sel_ref, ds_ref, off_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, dl_ref, dq_ref, dq_sc):
        b, g, qt, i, tt = (pl.program_id(a) for a in range(5))
        t = qt * tt_ + tt
        blk = slot(sel_ref, b, g, t, i)
        active = (i == 0) | (blk != slot(sel_ref, b, g, t, jnp.maximum(i - 1, 0)))

        @pl.when(i == 0)
        def _init():
            dq_sc[tt] = jnp.zeros((hg, dk), jnp.float32)

        @pl.when(active)
        def _step():
            kb = k_ref[...]
            s = _dot(q_ref[tt], kb, _DOT_T) * scale
            pos = blk * block + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
            mask = (pos <= off_ref[0] + t) & (pos >= ds_ref[b * t_ + t])
            p = jnp.exp(jnp.where(mask, s, NEG_INF) - lse_ref[tt]) * mask
            dp = _dot(do_ref[tt], v_ref[...], _DOT_T)
            ds = p * (dp - dl_ref[tt])
            dq_sc[tt] = dq_sc[tt] + _dot(ds.astype(kb.dtype), kb) * scale

        @pl.when(i == n - 1)
        def _finish():
            dq_ref[tt] = dq_sc[tt].astype(dq_ref.dtype)

    tile = lambda b, g, qt, i, tt, sel_ref, ds_ref, off_ref: (b, g, qt, 0, 0)
    kv = lambda b, g, qt, i, tt, sel_ref, ds_ref, off_ref: (b, g, slot(sel_ref, b, g, qt * tt_ + tt, i), 0)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(b_, g_, t_ // tt_, n, tt_),
        in_specs=[pl.BlockSpec((None, None, tt_, hg, dk), tile),
                  pl.BlockSpec((None, None, block, dk), kv),
                  pl.BlockSpec((None, None, block, dv), kv),
                  pl.BlockSpec((None, None, tt_, hg, dv), tile),
                  pl.BlockSpec((None, None, tt_, hg, 1), tile),
                  pl.BlockSpec((None, None, tt_, hg, 1), tile)],
        out_specs=pl.BlockSpec((None, None, tt_, hg, dk), tile),
        scratch_shapes=[_vmem((tt_, hg, dk))],
    )
    return pl.pallas_call(
        kernel, grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=_params("parallel", "parallel", "parallel", "arbitrary", "arbitrary"),
        interpret=interpret,
        name="nsa_selected_dq",
        cost_estimate=_selected_cost(q, k, v, n, block, tt_, 2 * dk + dv,
                                     2 * _nbytes(q) + _nbytes(do, lse, delta, sel)),
    )(sel.reshape(-1), doc_start.reshape(-1), _offset(token_offset), q, k, v, do, lse, delta)


def selected_bwd(q, k, v, sel, doc_start, do, lse, delta, *, block, scale, token_tile, token_offset=0,
                 interpret=None):
    """-> (dq, dk, dv) from the two backward kernels."""
    dq = selected_dq(q, k, v, sel, doc_start, do, lse, delta, block=block, scale=scale,
                     token_tile=token_tile, token_offset=token_offset, interpret=interpret)
    dk, dv = selected_dkv(q, k, v, sel, doc_start, do, lse, delta, block=block, scale=scale,
                          token_offset=token_offset, interpret=interpret)
    return dq, dk, dv


def selection_pairs(sel, num_blocks):
    """Inverts a canonical selection for the dK/dV kernel.

    sel [B,G,T,n] -> (blk, tok, on), each [B,G,P] int32 with P = num_blocks + T*n: the (token, slot)
    pairs sorted by block (stable, so tokens ascend within a block), with one inactive pair per
    block first so every block of the output is visited.
    """
    b_, g_, t_, n = sel.shape
    on = jnp.concatenate([jnp.ones_like(sel[..., :1], bool), sel[..., 1:] != sel[..., :-1]], -1)
    blk = jnp.concatenate([jnp.broadcast_to(jnp.arange(num_blocks, dtype=jnp.int32), (b_, g_, num_blocks)),
                           sel.reshape(b_, g_, t_ * n)], axis=-1)
    tok = jnp.concatenate([jnp.zeros((b_, g_, num_blocks), jnp.int32),
                           jnp.broadcast_to(jnp.repeat(jnp.arange(t_, dtype=jnp.int32), n), (b_, g_, t_ * n))], -1)
    on = jnp.concatenate([jnp.zeros((b_, g_, num_blocks), jnp.int32),
                          on.reshape(b_, g_, t_ * n).astype(jnp.int32)], -1)
    order = jnp.argsort(blk, axis=-1, stable=True)
    take = lambda x: jnp.take_along_axis(x, order, axis=-1)
    return take(blk), take(tok), take(on)


_TOK_BITS = 16  # selected_dkv's packed pairs: [block | token (16 bits) | active (1 bit)] in one int32


def pack_pairs(blk, tok, on):
    """(blk, tok, on) of `selection_pairs` -> one int32 a pair, `blk << 17 | tok << 1 | on`: the
    dK/dV kernel's scalar-prefetched operand in SMEM (1 MiB on TPU v5p) at a third of three
    arrays' size. At 128k tokens a row, T = 8192 tokens a call (Kernel.max_tokens) and n = 16,
    the three took 1.56 MiB and XLA:TPU refused the kernel; packed, 520 KiB."""
    return (blk << (_TOK_BITS + 1)) | (tok << 1) | on


def selected_dkv(q, k, v, sel, doc_start, do, lse, delta, *, block, scale, token_offset=0, interpret=None):
    """-> (dk [B,G,S,Dk], dv [B,G,S,Dv]) by walking (token, slot) pairs sorted by block."""
    b_, g_, t_, hg, dk = q.shape
    dv = v.shape[-1]
    num_blocks = k.shape[2] // block
    if t_ >= 1 << _TOK_BITS or num_blocks >= 1 << (30 - _TOK_BITS):
        raise ValueError(f"NSA's TPU dK/dV kernel packs a pair's token and block in one int32: {t_} tokens a "
                         f"call (at most {(1 << _TOK_BITS) - 1}: lower Kernel.max_tokens) and {num_blocks} key "
                         f"blocks (at most {(1 << (30 - _TOK_BITS)) - 1})")
    pairs = pack_pairs(*selection_pairs(sel, num_blocks))
    p_ = pairs.shape[-1]
    blk_of = lambda pair: pair >> (_TOK_BITS + 1)
    tok_of = lambda pair: (pair >> 1) & ((1 << _TOK_BITS) - 1)

    def kernel(pair_ref, ds_ref, off_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, dl_ref,
               dk_ref, dv_ref, dk_sc, dv_sc):
        b, g, p = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        base = (b * g_ + g) * p_
        pair = pair_ref[base + p]
        cur = blk_of(pair)
        first = (p == 0) | (cur != blk_of(pair_ref[base + jnp.maximum(p - 1, 0)]))
        last = (p == p_ - 1) | (cur != blk_of(pair_ref[base + jnp.minimum(p + 1, p_ - 1)]))

        @pl.when(first)
        def _init():
            dk_sc[...] = jnp.zeros_like(dk_sc)
            dv_sc[...] = jnp.zeros_like(dv_sc)

        @pl.when((pair & 1) == 1)
        def _step():
            t = tok_of(pair)
            qv, dov = q_ref[...], do_ref[...]  # [Hg, Dk], [Hg, Dv]
            s = _dot(qv, k_ref[...], _DOT_T) * scale  # [Hg, l']
            pos = cur * block + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
            mask = (pos <= off_ref[0] + t) & (pos >= ds_ref[b * t_ + t])
            p_prob = jnp.exp(jnp.where(mask, s, NEG_INF) - lse_ref[...]) * mask
            dv_sc[...] += _dot(p_prob.astype(dov.dtype), dov, _DOT_TN)
            ds = p_prob * (_dot(dov, v_ref[...], _DOT_T) - dl_ref[...])
            dk_sc[...] += _dot(ds.astype(qv.dtype), qv, _DOT_TN) * scale

        @pl.when(last)
        def _finish():
            dk_ref[...] = dk_sc[...].astype(dk_ref.dtype)
            dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)

    def tok_map(b, g, p, pair_ref, ds_ref, off_ref):
        return (b, g, tok_of(pair_ref[(b * g_ + g) * p_ + p]), 0, 0)

    def blk_map(b, g, p, pair_ref, ds_ref, off_ref):
        return (b, g, blk_of(pair_ref[(b * g_ + g) * p_ + p]), 0)

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(b_, g_, p_),
        in_specs=[pl.BlockSpec((None, None, None, hg, dk), tok_map),
                  pl.BlockSpec((None, None, block, dk), blk_map),
                  pl.BlockSpec((None, None, block, dv), blk_map),
                  pl.BlockSpec((None, None, None, hg, dv), tok_map),
                  pl.BlockSpec((None, None, None, hg, 1), tok_map),
                  pl.BlockSpec((None, None, None, hg, 1), tok_map)],
        out_specs=[pl.BlockSpec((None, None, block, dk), blk_map),
                   pl.BlockSpec((None, None, block, dv), blk_map)],
        scratch_shapes=[_vmem((block, dk)), _vmem((block, dv))],
    )
    return pl.pallas_call(
        kernel, grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=_params("parallel", "parallel", "arbitrary"),
        interpret=interpret,
        name="nsa_selected_dkv",
        # per active pair one token's q and dO rows (and lse, delta); K, V read and dK, dV written once
        cost_estimate=_cost(2 * b_ * g_ * t_ * sel.shape[-1] * hg * block * 2 * (dk + dv),
                            b_ * g_ * t_ * sel.shape[-1] * hg * block,
                            b_ * g_ * t_ * sel.shape[-1] * hg * (dk * q.dtype.itemsize + dv * do.dtype.itemsize + 8)
                            + 2 * _nbytes(k, v) + _nbytes(pairs)),
    )(pairs.reshape(-1), doc_start.reshape(-1), _offset(token_offset), q, k, v, do, lse, delta)


# ---------------------------------------------------------------- sliding window

def _window_tiles(window, tile):
    """Key tiles a query tile can see: its own and ceil((w-1)/tile) before it."""
    return -(-(window - 1) // tile) + 1


def _window_mask(qt, kt, hg, tile, window, rows_ds, shape):
    """Mask [rows, keys] for query tile qt (rows = tokens x heads) against key tile kt."""
    t = qt * tile + jax.lax.broadcasted_iota(jnp.int32, shape, 0) // hg
    pos = kt * tile + jax.lax.broadcasted_iota(jnp.int32, shape, 1)
    return (pos <= t) & (t - pos < window) & (pos >= rows_ds)


def window_fwd(q, k, v, rows_ds, *, window, scale, tile, interpret=None):
    """q rows [B,G,T*Hg,Dk], k [B,G,T,Dk], v [B,G,T,Dv], rows_ds [B,T*Hg,1]
    -> (o [B,G,T*Hg,Dv], lse [B,G,T*Hg,1])."""
    b_, g_, r_, dk = q.shape
    t_, dv = k.shape[2], v.shape[-1]
    hg, nw = r_ // t_, _window_tiles(window, tile)
    rows = tile * hg

    def kernel(q_ref, k_ref, v_ref, ds_ref, o_ref, lse_ref, m_sc, l_sc, acc_sc):
        qt, j = pl.program_id(2), pl.program_id(3)
        kt = qt - (nw - 1) + j

        @pl.when(j == 0)
        def _init():
            m_sc[...] = jnp.full_like(m_sc, NEG_INF)
            l_sc[...] = jnp.zeros_like(l_sc)
            acc_sc[...] = jnp.zeros_like(acc_sc)

        @pl.when(kt >= 0)
        def _step():
            s = _dot(q_ref[...], k_ref[...], _DOT_T) * scale  # [rows, tile]
            mask = _window_mask(qt, kt, hg, tile, window, ds_ref[...], s.shape)
            s = jnp.where(mask, s, NEG_INF)
            m_prev = m_sc[...]
            m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
            alpha = jnp.exp(m_prev - m_new)
            p = jnp.exp(s - m_new) * mask
            l_sc[...] = alpha * l_sc[...] + p.sum(axis=1, keepdims=True)
            acc_sc[...] = alpha * acc_sc[...] + _dot(p.astype(v_ref.dtype), v_ref[...])
            m_sc[...] = m_new

        @pl.when(j == nw - 1)
        def _finish():
            o_ref[...] = (acc_sc[...] / l_sc[...]).astype(o_ref.dtype)
            lse_ref[...] = m_sc[...] + jnp.log(l_sc[...])

    qmap = lambda b, g, qt, j: (b, g, qt, 0)
    kmap = lambda b, g, qt, j: (b, g, jnp.maximum(qt - (nw - 1) + j, 0), 0)
    return pl.pallas_call(
        kernel,
        grid=(b_, g_, t_ // tile, nw),
        in_specs=[pl.BlockSpec((None, None, rows, dk), qmap),
                  pl.BlockSpec((None, None, tile, dk), kmap),
                  pl.BlockSpec((None, None, tile, dv), kmap),
                  pl.BlockSpec((None, rows, 1), lambda b, g, qt, j: (b, qt, 0))],
        out_specs=[pl.BlockSpec((None, None, rows, dv), qmap),
                   pl.BlockSpec((None, None, rows, 1), qmap)],
        scratch_shapes=[_vmem((rows, 1)), _vmem((rows, 1)), _vmem((rows, dv))],
        out_shape=[jax.ShapeDtypeStruct((b_, g_, r_, dv), q.dtype),
                   jax.ShapeDtypeStruct((b_, g_, r_, 1), jnp.float32)],
        compiler_params=_params("parallel", "parallel", "parallel", "arbitrary"),
        interpret=interpret,
        name="nsa_window_fwd",
        cost_estimate=_window_cost(q, k, v, window, tile, dk + dv,
                                   _nbytes(q, ((b_, g_, r_, dv), q.dtype)) + 4 * b_ * g_ * r_),
    )(q, k, v, rows_ds)


def window_bwd(q, k, v, rows_ds, do, lse, delta, *, window, scale, tile, interpret=None):
    """-> (dq rows, dk, dv) from the two backward kernels."""
    kw = {"window": window, "scale": scale, "tile": tile, "interpret": interpret}
    dk, dv = window_dkv(q, k, v, rows_ds, do, lse, delta, **kw)
    return window_dq(q, k, v, rows_ds, do, lse, delta, **kw), dk, dv


def window_dq(q, k, v, rows_ds, do, lse, delta, *, window, scale, tile, interpret=None):
    """-> dq rows [B,G,T*Hg,Dk]."""
    b_, g_, r_, dk = q.shape
    t_, dv = k.shape[2], v.shape[-1]
    hg, nw = r_ // t_, _window_tiles(window, tile)
    rows = tile * hg

    def kernel(q_ref, k_ref, v_ref, ds_ref, do_ref, lse_ref, dl_ref, dq_ref, dq_sc):
        qt, j = pl.program_id(2), pl.program_id(3)
        kt = qt - (nw - 1) + j

        @pl.when(j == 0)
        def _init():
            dq_sc[...] = jnp.zeros_like(dq_sc)

        @pl.when(kt >= 0)
        def _step():
            kb = k_ref[...]
            s = _dot(q_ref[...], kb, _DOT_T) * scale
            mask = _window_mask(qt, kt, hg, tile, window, ds_ref[...], s.shape)
            p = jnp.exp(jnp.where(mask, s, NEG_INF) - lse_ref[...]) * mask
            ds = p * (_dot(do_ref[...], v_ref[...], _DOT_T) - dl_ref[...])
            dq_sc[...] += _dot(ds.astype(kb.dtype), kb) * scale

        @pl.when(j == nw - 1)
        def _finish():
            dq_ref[...] = dq_sc[...].astype(dq_ref.dtype)

    qmap = lambda b, g, qt, j: (b, g, qt, 0)
    kmap = lambda b, g, qt, j: (b, g, jnp.maximum(qt - (nw - 1) + j, 0), 0)
    return pl.pallas_call(
        kernel,
        grid=(b_, g_, t_ // tile, nw),
        in_specs=[pl.BlockSpec((None, None, rows, dk), qmap),
                  pl.BlockSpec((None, None, tile, dk), kmap),
                  pl.BlockSpec((None, None, tile, dv), kmap),
                  pl.BlockSpec((None, rows, 1), lambda b, g, qt, j: (b, qt, 0)),
                  pl.BlockSpec((None, None, rows, dv), qmap),
                  pl.BlockSpec((None, None, rows, 1), qmap),
                  pl.BlockSpec((None, None, rows, 1), qmap)],
        out_specs=pl.BlockSpec((None, None, rows, dk), qmap),
        scratch_shapes=[_vmem((rows, dk))],
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=_params("parallel", "parallel", "parallel", "arbitrary"),
        interpret=interpret,
        name="nsa_window_dq",
        cost_estimate=_window_cost(q, k, v, window, tile, 2 * dk + dv, 2 * _nbytes(q) + _nbytes(do, lse, delta)),
    )(q, k, v, rows_ds, do, lse, delta)


def window_dkv(q, k, v, rows_ds, do, lse, delta, *, window, scale, tile, interpret=None):
    """-> (dk [B,G,T,Dk], dv [B,G,T,Dv]): each key tile walks the query tiles that can see it."""
    b_, g_, r_, dk = q.shape
    t_, dv = k.shape[2], v.shape[-1]
    hg, nw, nq = r_ // t_, _window_tiles(window, tile), t_ // tile
    rows = tile * hg

    def kernel(q_ref, k_ref, v_ref, ds_ref, do_ref, lse_ref, dl_ref, dk_ref, dv_ref, dk_sc, dv_sc):
        kt, j = pl.program_id(2), pl.program_id(3)
        qt = kt + j

        @pl.when(j == 0)
        def _init():
            dk_sc[...] = jnp.zeros_like(dk_sc)
            dv_sc[...] = jnp.zeros_like(dv_sc)

        @pl.when(qt < nq)
        def _step():
            qv, dov = q_ref[...], do_ref[...]
            s = _dot(qv, k_ref[...], _DOT_T) * scale  # [rows, tile]
            mask = _window_mask(qt, kt, hg, tile, window, ds_ref[...], s.shape)
            p = jnp.exp(jnp.where(mask, s, NEG_INF) - lse_ref[...]) * mask
            dv_sc[...] += _dot(p.astype(dov.dtype), dov, _DOT_TN)
            ds = p * (_dot(dov, v_ref[...], _DOT_T) - dl_ref[...])
            dk_sc[...] += _dot(ds.astype(qv.dtype), qv, _DOT_TN) * scale

        @pl.when(j == nw - 1)
        def _finish():
            dk_ref[...] = dk_sc[...].astype(dk_ref.dtype)
            dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)

    qmap = lambda b, g, kt, j: (b, g, jnp.minimum(kt + j, nq - 1), 0)
    kmap = lambda b, g, kt, j: (b, g, kt, 0)
    return pl.pallas_call(
        kernel,
        grid=(b_, g_, nq, nw),
        in_specs=[pl.BlockSpec((None, None, rows, dk), qmap),
                  pl.BlockSpec((None, None, tile, dk), kmap),
                  pl.BlockSpec((None, None, tile, dv), kmap),
                  pl.BlockSpec((None, rows, 1), lambda b, g, kt, j: (b, jnp.minimum(kt + j, nq - 1), 0)),
                  pl.BlockSpec((None, None, rows, dv), qmap),
                  pl.BlockSpec((None, None, rows, 1), qmap),
                  pl.BlockSpec((None, None, rows, 1), qmap)],
        out_specs=[pl.BlockSpec((None, None, tile, dk), kmap),
                   pl.BlockSpec((None, None, tile, dv), kmap)],
        scratch_shapes=[_vmem((tile, dk)), _vmem((tile, dv))],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=_params("parallel", "parallel", "parallel", "arbitrary"),
        interpret=interpret,
        name="nsa_window_dkv",
        # each key tile reads the q and dO rows of every query tile it meets
        cost_estimate=_window_cost(q, k, v, window, tile, 2 * (dk + dv),
                                   2 * _nbytes(k, v) + nq * nw * b_ * g_ * rows * (dk + dv) * q.dtype.itemsize),
    )(q, k, v, rows_ds, do, lse, delta)
