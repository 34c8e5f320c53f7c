"""Mosaic GPU (Hopper, `plgpu`) kernels for NSA's selected and sliding-window branches, forward and backward.

Same entry points and layouts as tpu.py (q `[B,G,T,Hg,Dk]`, k `[B,G,T,Dk]`, v `[B,G,T,Dv]`,
doc_start `[B,T]`, lse/delta `[B,G,T,Hg,1]`), so ops.py wraps either with the same custom_vjp.

Forward:
- selected_fwd: one CTA per (batch*group, token); the Hg heads of the group are the rows of one
  wgmma (padded to a multiple of 64), and each of the n selected key blocks (l' = 64 tokens) is
  copied by TMA once per group and token (the paper's group-centric loading).
- window_fwd: flash attention per (batch*group*head, 64-query tile) over the key tiles that can
  fall inside the window.
Backward (flash-attention-2: P recomputed from the forward's lse, delta = rowsum(dO * O)), two
kernels per branch, each output tile written by exactly one CTA (no atomics, deterministic):
- selected: dQ per (batch*group, token) over its n blocks; dK/dV per (batch*group, key block)
  over the tokens that selected the block, an inverted index (CSR) that XLA builds by sorting the
  (block, token) pairs (`selection_csr`; cost and load balance in `selected_bwd`).
- window: dQ per (batch*group*head, query tile) over the key tiles in its window; dK/dV per
  (batch*group, key tile) over the group's heads and the query tiles whose window reaches it.
Operands arrive in the layout wgmma consumes (K^T `[Dk, T]`, and for the backward V^T, Q^T, dO^T,
transposed by XLA), so every product is SMEM `[M,K]` @ SMEM `[K,N]` with no in-kernel transpose.
Inputs are cast to bfloat16 (wgmma operands, and P / dS before their matmuls); accumulation,
softmax statistics, outputs and gradients are float32 (gradients are cast to the inputs' dtypes).
The kernels are simple rather than fast: one warpgroup per CTA, and each step's TMA copies are
awaited before its matmuls (no multi-buffering, no warp specialisation).

Verification here (no GPU): the kernels lower to Mosaic GPU for the cuda platform, and run
under GPU interpret mode (`InterpretGPUParams`), which simulates GMEM/SMEM, TMA copies,
barriers and wgmma. jax 0.10.2's GPU interpreter has no rule for `layout_cast` or for loads with
an explicit layout, which real lowering requires; `interpret` therefore switches exactly those
two annotations off (helpers `_iota`, `_vec`, `_zeros`, `_load_vec`), everything else is the same
kernel. The interpreter also shapes three choices: wgmma operands are staged in SMEM (it reads
them from SMEM only), transposes are done by XLA (its wgmma applies only indexing transforms, no
`transpose_ref`), and accumulators are summed in registers after each wgmma (it has no rule for
`pl.run_state`, which would keep them in the accumulator).
"""
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from coder.pallas.nsa.reference import NEG_INF

ROWS = 64  # wgmma M granularity
_TRANSFORMS = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))  # bf16, 128-byte swizzle


def _smem(shape, dtype=jnp.bfloat16):
    return plgpu.SMEM(shape, dtype, transforms=_TRANSFORMS)


def _iota(shape, dim, interpret):
    if interpret:
        return lax.broadcasted_iota(jnp.int32, shape, dim)
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


def _vec(x, interpret):
    """A per-row vector [M] in the layout that broadcasts against wgmma results."""
    return x if interpret else plgpu.layout_cast(x, plgpu.Layout.WGMMA.reduce(1))


def _zeros(shape, interpret):
    """A float32 accumulator [M,N] in registers, in the wgmma result layout."""
    x = jnp.zeros(shape, jnp.float32)
    return x if interpret else plgpu.layout_cast(x, plgpu.Layout.WGMMA)


def _load_vec(ref, axis, interpret):
    """SMEM vector -> registers, laid out to broadcast along `axis` of a wgmma result:
    axis 1 = one value per row, axis 0 = one value per column."""
    return ref[...] if interpret else plgpu.load(ref, (), layout=plgpu.Layout.WGMMA.reduce(axis))


def _fetch(bar, first, *copies):
    """TMA-copies each (GMEM ref, SMEM ref) pair on its own barrier bar[first + i]; waits for all."""
    for i, (src, dst) in enumerate(copies):
        plgpu.copy_gmem_to_smem(src, dst, bar.at[first + i])
    for i in range(len(copies)):
        plgpu.barrier_wait(bar.at[first + i])


def _mm(a_s, b_s):
    """a_s [M,K] @ b_s [K,N], both bf16 in SMEM, on the tensor core -> [M,N] float32."""
    def run(acc_ref):
        plgpu.wgmma(acc_ref, a_s, b_s)
        return acc_ref[...]
    return pl.run_scoped(run, plgpu.ACC((a_s.shape[0], b_s.shape[1]), jnp.float32))


def _pv(p, p_s, v_s):
    """p [M,L] float32 @ v_s [L,N] (SMEM) on the tensor core -> [M,N] float32. p is staged in
    SMEM (p_s) rather than fed from registers: the GPU interpreter takes wgmma operands from SMEM only."""
    p_s[...] = p.astype(jnp.bfloat16)
    plgpu.commit_smem()
    return _mm(p_s, v_s)


def _pad_rows(x, axis, multiple):
    pad = -x.shape[axis] % multiple
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def _check(block_or_tile, dk, dv):
    if block_or_tile != 64 or dk % 64 or dv % 64:
        raise ValueError(f"Mosaic GPU NSA kernels need 64-token blocks and head dims that are multiples of 64; "
                         f"got block {block_or_tile}, dk {dk}, dv {dv}")


def selected_fwd(q, k, v, sel, doc_start, *, block, scale, token_tile=None, token_offset=0, interpret=None):
    """-> (o [B,G,T,Hg,Dv] float32, lse [B,G,T,Hg,1] float32). sel [B,G,T,n] canonical."""
    del token_tile  # one token per CTA
    if token_offset:
        raise ValueError("the GPU selected kernel takes the whole row (token_offset 0)")
    b_, g_, t_, hg, dk = q.shape
    dv, n = v.shape[-1], sel.shape[-1]
    _check(block, dk, dv)
    rows = -(-hg // ROWS) * ROWS
    qp = _pad_rows(q, 3, ROWS).astype(jnp.bfloat16)
    kt = jnp.swapaxes(k, 2, 3).astype(jnp.bfloat16)  # [B,G,Dk,T]
    vb = v.astype(jnp.bfloat16)
    interp = interpret is not None

    def body(sel_ref, ds_ref, q_ref, kt_ref, v_ref, o_ref, lse_ref, q_s, k_s, v_s, p_s, o_s, lse_s, bar):
        bg, t = lax.axis_index("bg"), lax.axis_index("t")
        b, g = bg // g_, bg % g_
        plgpu.copy_gmem_to_smem(q_ref.at[b, g, t], q_s, bar.at[0])
        plgpu.barrier_wait(bar.at[0])
        ds = ds_ref[b, t]

        def step(i, carry):
            acc, m, l = carry
            blk = sel_ref[b, g, t, i]
            active = (i == 0) | (blk != sel_ref[b, g, t, jnp.maximum(i - 1, 0)])
            plgpu.copy_gmem_to_smem(kt_ref.at[b, g, :, pl.ds(blk * block, block)], k_s, bar.at[1])
            plgpu.copy_gmem_to_smem(v_ref.at[b, g, pl.ds(blk * block, block)], v_s, bar.at[2])
            plgpu.barrier_wait(bar.at[1])
            s = _mm(q_s, k_s) * scale
            pos = blk * block + _iota((rows, block), 1, interp)
            mask = (pos <= t) & (pos >= ds) & active
            s = jnp.where(mask, s, NEG_INF)
            m_new = jnp.maximum(m, s.max(axis=1))
            alpha = jnp.exp(m - m_new)
            p = jnp.where(mask, jnp.exp(s - lax.broadcast_in_dim(m_new, s.shape, [0])), 0.0)
            l = l * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            plgpu.barrier_wait(bar.at[2])
            return acc + _pv(p, p_s, v_s), m_new, l

        init = (_zeros((rows, dv), interp), _vec(jnp.full((rows,), NEG_INF, jnp.float32), interp),
                _vec(jnp.zeros((rows,), jnp.float32), interp))
        acc, m, l = lax.fori_loop(0, n, step, init)
        o_s[...] = acc / lax.broadcast_in_dim(l, acc.shape, [0])
        lse_s[...] = m + jnp.log(l)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_s, o_ref.at[b, g, t])
        plgpu.copy_smem_to_gmem(lse_s, lse_ref.at[b, g, t])
        plgpu.wait_smem_to_gmem(0)

    o, lse = plgpu.kernel(
        body,
        out_type=[jax.ShapeDtypeStruct((b_, g_, t_, rows, dv), jnp.float32),
                  jax.ShapeDtypeStruct((b_, g_, t_, rows), jnp.float32)],
        scratch_types=[_smem((rows, dk)), _smem((dk, block)), _smem((block, dv)), _smem((rows, block)),
                       plgpu.SMEM((rows, dv), jnp.float32), plgpu.SMEM((rows,), jnp.float32),
                       plgpu.Barrier(num_barriers=3)],
        grid=(b_ * g_, t_), grid_names=("bg", "t"), interpret=interpret,
    )(sel.astype(jnp.int32), doc_start.astype(jnp.int32), qp, kt, vb)
    return o[:, :, :, :hg], lse[:, :, :, :hg, None]


def window_fwd(q, k, v, rows_ds, *, window, scale, tile, interpret=None):
    """q rows [B,G,T*Hg,Dk] (row = token * Hg + head), k [B,G,T,Dk], v [B,G,T,Dv], rows_ds [B,T*Hg,1]
    -> (o [B,G,T*Hg,Dv] float32, lse [B,G,T*Hg,1] float32)."""
    b_, g_, r_, dk = q.shape
    t_, dv = k.shape[2], v.shape[-1]
    hg = r_ // t_
    _check(tile, dk, dv)
    nw = -(-(window - 1) // tile) + 1
    # per-head query rows: [B,G,Hg,T,Dk]; doc starts per token [B,T]
    qh = jnp.moveaxis(q.reshape(b_, g_, t_, hg, dk), 3, 2).astype(jnp.bfloat16)
    ds = rows_ds[:, ::hg, 0]
    kt = jnp.swapaxes(k, 2, 3).astype(jnp.bfloat16)
    vb = v.astype(jnp.bfloat16)
    interp = interpret is not None

    def body(ds_ref, q_ref, kt_ref, v_ref, o_ref, lse_ref, q_s, k_s, v_s, p_s, ds_s, o_s, lse_s, bar):
        bgh, qt = lax.axis_index("bgh"), lax.axis_index("qt")
        b, g, h = bgh // (g_ * hg), (bgh // hg) % g_, bgh % hg
        plgpu.copy_gmem_to_smem(q_ref.at[b, g, h, pl.ds(qt * tile, tile)], q_s, bar.at[0])
        plgpu.copy_gmem_to_smem(ds_ref.at[b, pl.ds(qt * tile, tile)], ds_s, bar.at[3])
        plgpu.barrier_wait(bar.at[0])
        plgpu.barrier_wait(bar.at[3])
        row_ds = lax.broadcast_in_dim(_load_vec(ds_s, 1, interp), (tile, tile), [0])
        trow = qt * tile + _iota((tile, tile), 0, interp)

        def step(j, carry):
            acc, m, l = carry
            kt_idx = jnp.maximum(qt - (nw - 1) + j, 0)
            live = qt - (nw - 1) + j >= 0
            plgpu.copy_gmem_to_smem(kt_ref.at[b, g, :, pl.ds(kt_idx * tile, tile)], k_s, bar.at[1])
            plgpu.copy_gmem_to_smem(v_ref.at[b, g, pl.ds(kt_idx * tile, tile)], v_s, bar.at[2])
            plgpu.barrier_wait(bar.at[1])
            s = _mm(q_s, k_s) * scale
            pos = kt_idx * tile + _iota((tile, tile), 1, interp)
            mask = (pos <= trow) & (trow - pos < window) & (pos >= row_ds) & live
            s = jnp.where(mask, s, NEG_INF)
            m_new = jnp.maximum(m, s.max(axis=1))
            alpha = jnp.exp(m - m_new)
            p = jnp.where(mask, jnp.exp(s - lax.broadcast_in_dim(m_new, s.shape, [0])), 0.0)
            l = l * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            plgpu.barrier_wait(bar.at[2])
            return acc + _pv(p, p_s, v_s), m_new, l

        init = (_zeros((tile, dv), interp), _vec(jnp.full((tile,), NEG_INF, jnp.float32), interp),
                _vec(jnp.zeros((tile,), jnp.float32), interp))
        acc, m, l = lax.fori_loop(0, nw, step, init)
        o_s[...] = acc / lax.broadcast_in_dim(l, acc.shape, [0])
        lse_s[...] = m + jnp.log(l)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_s, o_ref.at[b, g, h, pl.ds(qt * tile, tile)])
        plgpu.copy_smem_to_gmem(lse_s, lse_ref.at[b, g, h, pl.ds(qt * tile, tile)])
        plgpu.wait_smem_to_gmem(0)

    o, lse = plgpu.kernel(
        body,
        out_type=[jax.ShapeDtypeStruct((b_, g_, hg, t_, dv), jnp.float32),
                  jax.ShapeDtypeStruct((b_, g_, hg, t_), jnp.float32)],
        scratch_types=[_smem((tile, dk)), _smem((dk, tile)), _smem((tile, dv)), _smem((tile, tile)),
                       plgpu.SMEM((tile,), jnp.int32), plgpu.SMEM((tile, dv), jnp.float32),
                       plgpu.SMEM((tile,), jnp.float32), plgpu.Barrier(num_barriers=4)],
        grid=(b_ * g_ * hg, t_ // tile), grid_names=("bgh", "qt"), interpret=interpret,
    )(ds.astype(jnp.int32), qh, kt, vb)
    o = jnp.moveaxis(o, 2, 3).reshape(b_, g_, r_, dv)
    lse = jnp.moveaxis(lse, 2, 3).reshape(b_, g_, r_, 1)
    return o, lse


# ---------------------------------------------------------------- backward, shared steps
# Flash-attention-2 backward: P = exp(S - lse) is recomputed from the forward's lse, and with
# delta = rowsum(dO * O): dV = P^T dO, dS = P * (dO V^T - delta), dQ = scale dS K, dK = scale dS^T Q.
# The dK/dV kernels work in the transposed frame (rows = keys, columns = queries), so every
# product is `SMEM [M,K] @ SMEM [K,N]`; the transposed operands (K^T, V^T, Q^T, dO^T) come from XLA.

def _dq_step(q_s, do_s, kt_s, k_s, vt_s, p_s, lse, delta, mask, scale):
    """One key block for a tile of query rows -> dS @ K [rows, Dk] (without the softmax scale).
    lse/delta: per-row vectors; mask [rows, keys]."""
    s = _mm(q_s, kt_s) * scale
    p = jnp.exp(jnp.where(mask, s, NEG_INF) - lax.broadcast_in_dim(lse, s.shape, [0]))
    ds = p * (_mm(do_s, vt_s) - lax.broadcast_in_dim(delta, s.shape, [0]))
    return _pv(ds, p_s, k_s)


def _dkv_step(k_s, v_s, qt_s, q_s, dot_s, do_s, p_s, lse, delta, mask, scale):
    """One tile of queries for a block of keys -> (dS^T @ Q [keys, Dk] without the softmax scale,
    P^T @ dO [keys, Dv]). lse/delta: per-column (query) vectors; mask [keys, queries]."""
    st = _mm(k_s, qt_s) * scale
    pt = jnp.exp(jnp.where(mask, st, NEG_INF) - lax.broadcast_in_dim(lse, st.shape, [1]))
    dv = _pv(pt, p_s, do_s)
    dst = pt * (_mm(v_s, dot_s) - lax.broadcast_in_dim(delta, st.shape, [1]))
    return _pv(dst, p_s, q_s), dv


def _store(pairs):
    """Writes (register value, f32 SMEM staging ref, GMEM destination) triples out by TMA."""
    for x, x_s, _ in pairs:
        x_s[...] = x
    plgpu.commit_smem()
    for _, x_s, dst in pairs:
        plgpu.copy_smem_to_gmem(x_s, dst)
    plgpu.wait_smem_to_gmem(0)


def _f32_smem(shape):
    return plgpu.SMEM(shape, jnp.float32)


# ---------------------------------------------------------------- selected branch, backward

def selection_csr(sel, num_blocks):
    """Inverts a canonical selection for the dK/dV kernel, in CSR form.

    sel [B,G,T,n] -> (offsets [B,G,num_blocks+1], tokens [B,G,T*n]) int32: tokens[offsets[j]:
    offsets[j+1]] are the tokens whose selection holds block j, ascending, each once (the repeats
    that pad a canonical selection are inactive and sort past offsets[num_blocks]).
    """
    b_, g_, t_, n = sel.shape
    active = jnp.concatenate([jnp.ones_like(sel[..., :1], bool), sel[..., 1:] != sel[..., :-1]], -1)
    key = jnp.where(active, sel, num_blocks).reshape(b_ * g_, t_ * n).astype(jnp.int32)
    order = jnp.argsort(key, axis=-1, stable=True)  # stable: tokens ascend within a block
    sorted_key = jnp.take_along_axis(key, order, axis=-1)
    bounds = jnp.arange(num_blocks + 1, dtype=jnp.int32)
    offsets = jax.vmap(lambda k_: jnp.searchsorted(k_, bounds, side="left"))(sorted_key)
    return (offsets.reshape(b_, g_, num_blocks + 1).astype(jnp.int32),
            (order // n).reshape(b_, g_, t_ * n).astype(jnp.int32))


def _selected_dq(sel, ds, qp, dop, lse, dl, kt, kb, vt, *, block, scale, interpret):
    """-> dq [B,G,T,rows,Dk] float32: one CTA per (batch*group, token), looping over its n blocks."""
    b_, g_, t_, rows, dk = qp.shape
    dv, n = dop.shape[-1], sel.shape[-1]
    interp = interpret is not None

    def body(sel_ref, ds_ref, q_ref, do_ref, lse_ref, dl_ref, kt_ref, k_ref, vt_ref, dq_ref,
             q_s, do_s, lse_s, dl_s, kt_s, k_s, vt_s, p_s, dq_s, bar):
        bg, t = lax.axis_index("bg"), lax.axis_index("t")
        b, g = bg // g_, bg % g_
        _fetch(bar, 0, (q_ref.at[b, g, t], q_s), (do_ref.at[b, g, t], do_s), (lse_ref.at[b, g, t], lse_s),
               (dl_ref.at[b, g, t], dl_s))
        lse, delta = _load_vec(lse_s, 1, interp), _load_vec(dl_s, 1, interp)
        start = ds_ref[b, t]

        def step(i, dq):
            blk = sel_ref[b, g, t, i]
            active = (i == 0) | (blk != sel_ref[b, g, t, jnp.maximum(i - 1, 0)])
            keys = pl.ds(blk * block, block)
            _fetch(bar, 4, (kt_ref.at[b, g, :, keys], kt_s), (k_ref.at[b, g, keys], k_s),
                   (vt_ref.at[b, g, :, keys], vt_s))
            pos = blk * block + _iota((rows, block), 1, interp)
            mask = (pos <= t) & (pos >= start) & active
            return dq + _dq_step(q_s, do_s, kt_s, k_s, vt_s, p_s, lse, delta, mask, scale)

        dq = lax.fori_loop(0, n, step, _zeros((rows, dk), interp))
        _store([(dq * scale, dq_s, dq_ref.at[b, g, t])])

    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((b_, g_, t_, rows, dk), jnp.float32),
        scratch_types=[_smem((rows, dk)), _smem((rows, dv)), _f32_smem((rows,)), _f32_smem((rows,)),
                       _smem((dk, block)), _smem((block, dk)), _smem((dv, block)), _smem((rows, block)),
                       _f32_smem((rows, dk)), plgpu.Barrier(num_barriers=7)],
        grid=(b_ * g_, t_), grid_names=("bg", "t"), interpret=interpret,
    )(sel, ds, qp, dop, lse, dl, kt, kb, vt)


def _selected_dkv(offsets, tokens, ds, kb, vb, qtp, qp, dotp, dop, lse, dl, *, block, scale, interpret):
    """-> (dk [B,G,T,Dk], dv [B,G,T,Dv]) float32: one CTA per (batch*group, key block), looping over
    the tokens that selected the block (CSR from `selection_csr`), one token's Hg heads per step."""
    b_, g_, t_, rows, dk = qp.shape
    dv = dop.shape[-1]
    interp = interpret is not None

    def body(off_ref, tok_ref, ds_ref, k_ref, v_ref, qt_ref, q_ref, dot_ref, do_ref, lse_ref, dl_ref,
             dk_ref, dv_ref, k_s, v_s, qt_s, q_s, dot_s, do_s, lse_s, dl_s, p_s, dk_s, dv_s, bar):
        bg, j = lax.axis_index("bg"), lax.axis_index("blk")
        b, g = bg // g_, bg % g_
        keys = pl.ds(j * block, block)
        _fetch(bar, 0, (k_ref.at[b, g, keys], k_s), (v_ref.at[b, g, keys], v_s))
        pos = j * block + _iota((block, rows), 0, interp)

        def step(p, carry):
            t = tok_ref[b, g, p]
            _fetch(bar, 2, (qt_ref.at[b, g, t], qt_s), (q_ref.at[b, g, t], q_s), (dot_ref.at[b, g, t], dot_s),
                   (do_ref.at[b, g, t], do_s), (lse_ref.at[b, g, t], lse_s), (dl_ref.at[b, g, t], dl_s))
            mask = (pos <= t) & (pos >= ds_ref[b, t])
            # the zero rows padding Hg to `rows` have dO = 0 and delta = 0: they add exactly 0
            dk_t, dv_t = _dkv_step(k_s, v_s, qt_s, q_s, dot_s, do_s, p_s, _load_vec(lse_s, 0, interp),
                                   _load_vec(dl_s, 0, interp), mask, scale)
            return carry[0] + dk_t, carry[1] + dv_t

        init = (_zeros((block, dk), interp), _zeros((block, dv), interp))
        dk_acc, dv_acc = lax.fori_loop(off_ref[b, g, j], off_ref[b, g, j + 1], step, init)
        _store([(dk_acc * scale, dk_s, dk_ref.at[b, g, keys]), (dv_acc, dv_s, dv_ref.at[b, g, keys])])

    return plgpu.kernel(
        body,
        out_type=[jax.ShapeDtypeStruct((b_, g_, t_, dk), jnp.float32),
                  jax.ShapeDtypeStruct((b_, g_, t_, dv), jnp.float32)],
        scratch_types=[_smem((block, dk)), _smem((block, dv)), _smem((dk, rows)), _smem((rows, dk)),
                       _smem((dv, rows)), _smem((rows, dv)), _f32_smem((rows,)), _f32_smem((rows,)),
                       _smem((block, rows)), _f32_smem((block, dk)), _f32_smem((block, dv)),
                       plgpu.Barrier(num_barriers=8)],
        grid=(b_ * g_, t_ // block), grid_names=("bg", "blk"), interpret=interpret,
    )(offsets, tokens, ds, kb, vb, qtp, qp, dotp, dop, lse, dl)


def selected_bwd(q, k, v, sel, doc_start, do, lse, delta, *, block, scale, token_tile=None, token_offset=0,
                 interpret=None):
    """-> (dq, dk, dv) in kernel layout (q, k, v's shapes and dtypes), from two kernels:

    - dQ (`_selected_dq`): the forward's grid, one CTA per token, recomputing P from lse.
    - dK/dV (`_selected_dkv`): one CTA per (batch*group, key block) walks the tokens that selected
      its block, listed by `selection_csr` (an XLA sort of the T*n (block, token) pairs), and
      accumulates the block's dK and dV in registers; each output block is written by exactly one
      CTA, so there are no atomics and no races, and the sum order is fixed (deterministic).
    Cost: the sort is O(T n log(T n)) per (batch, group); the first block of a long document is
    selected by all its tokens, so its CTA walks up to T tokens (load imbalance, as in other
    NSA/FSA GPU backwards); each step copies one token's Q, Q^T, dO, dO^T (Hg heads padded to 64
    rows) without double buffering, so the kernel is latency-bound; XLA writes Q^T and dO^T.
    """
    del token_tile  # one token per CTA
    if token_offset:
        raise ValueError("the GPU selected kernels take the whole row (token_offset 0)")
    t_, hg, dk = q.shape[2:]
    dv = v.shape[-1]
    _check(block, dk, dv)
    if t_ % block:
        raise ValueError(f"the GPU selected backward needs T padded to a multiple of {block} (ops.py does); got {t_}")
    bf = lambda x: x.astype(jnp.bfloat16)
    qp, dop = bf(_pad_rows(q, 3, ROWS)), bf(_pad_rows(do, 3, ROWS))  # [B,G,T,rows,D]
    lse_p = _pad_rows(lse[..., 0].astype(jnp.float32), 3, ROWS)  # [B,G,T,rows]
    dl_p = _pad_rows(delta[..., 0].astype(jnp.float32), 3, ROWS)
    kb, vb = bf(k), bf(v)
    sel, ds = sel.astype(jnp.int32), doc_start.astype(jnp.int32)
    kw = {"block": block, "scale": scale, "interpret": interpret}
    dq = _selected_dq(sel, ds, qp, dop, lse_p, dl_p, jnp.swapaxes(kb, 2, 3), kb, jnp.swapaxes(vb, 2, 3), **kw)
    offsets, tokens = selection_csr(sel, t_ // block)
    dk_, dv_ = _selected_dkv(offsets, tokens, ds, kb, vb, jnp.swapaxes(qp, 3, 4), qp, jnp.swapaxes(dop, 3, 4),
                             dop, lse_p, dl_p, **kw)
    return dq[:, :, :, :hg].astype(q.dtype), dk_.astype(k.dtype), dv_.astype(v.dtype)


# ---------------------------------------------------------------- sliding window, backward

def _window_dq(ds, qh, doh, lse, dl, kt, kb, vt, *, window, scale, tile, interpret):
    """-> dq [B,G,Hg,T,Dk] float32: one CTA per (batch*group*head, query tile), looping over the key
    tiles that can fall inside the window."""
    b_, g_, hg, t_, dk = qh.shape
    dv = doh.shape[-1]
    nw = -(-(window - 1) // tile) + 1
    interp = interpret is not None

    def body(ds_ref, q_ref, do_ref, lse_ref, dl_ref, kt_ref, k_ref, vt_ref, dq_ref,
             q_s, do_s, lse_s, dl_s, ds_s, kt_s, k_s, vt_s, p_s, dq_s, bar):
        bgh, qt = lax.axis_index("bgh"), lax.axis_index("qt")
        b, g, h = bgh // (g_ * hg), (bgh // hg) % g_, bgh % hg
        qs = pl.ds(qt * tile, tile)
        _fetch(bar, 0, (q_ref.at[b, g, h, qs], q_s), (do_ref.at[b, g, h, qs], do_s),
               (lse_ref.at[b, g, h, qs], lse_s), (dl_ref.at[b, g, h, qs], dl_s), (ds_ref.at[b, qs], ds_s))
        lse, delta = _load_vec(lse_s, 1, interp), _load_vec(dl_s, 1, interp)
        row_ds = lax.broadcast_in_dim(_load_vec(ds_s, 1, interp), (tile, tile), [0])
        trow = qt * tile + _iota((tile, tile), 0, interp)

        def step(kt_idx, dq):
            keys = pl.ds(kt_idx * tile, tile)
            _fetch(bar, 5, (kt_ref.at[b, g, :, keys], kt_s), (k_ref.at[b, g, keys], k_s),
                   (vt_ref.at[b, g, :, keys], vt_s))
            pos = kt_idx * tile + _iota((tile, tile), 1, interp)
            mask = (pos <= trow) & (trow - pos < window) & (pos >= row_ds)
            return dq + _dq_step(q_s, do_s, kt_s, k_s, vt_s, p_s, lse, delta, mask, scale)

        dq = lax.fori_loop(jnp.maximum(qt - (nw - 1), 0), qt + 1, step, _zeros((tile, dk), interp))
        _store([(dq * scale, dq_s, dq_ref.at[b, g, h, qs])])

    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((b_, g_, hg, t_, dk), jnp.float32),
        scratch_types=[_smem((tile, dk)), _smem((tile, dv)), _f32_smem((tile,)), _f32_smem((tile,)),
                       plgpu.SMEM((tile,), jnp.int32), _smem((dk, tile)), _smem((tile, dk)), _smem((dv, tile)),
                       _smem((tile, tile)), _f32_smem((tile, dk)), plgpu.Barrier(num_barriers=8)],
        grid=(b_ * g_ * hg, t_ // tile), grid_names=("bgh", "qt"), interpret=interpret,
    )(ds, qh, doh, lse, dl, kt, kb, vt)


def _window_dkv(ds, kb, vb, qht, qh, doht, doh, lse, dl, *, window, scale, tile, interpret):
    """-> (dk [B,G,T,Dk], dv [B,G,T,Dv]) float32: one CTA per (batch*group, key tile), looping over
    the Hg heads of the group and the query tiles whose window reaches the key tile."""
    b_, g_, hg, t_, dk = qh.shape
    dv, nq = doh.shape[-1], t_ // tile
    nw = -(-(window - 1) // tile) + 1
    interp = interpret is not None

    def body(ds_ref, k_ref, v_ref, qt_ref, q_ref, dot_ref, do_ref, lse_ref, dl_ref, dk_ref, dv_ref,
             k_s, v_s, qt_s, q_s, dot_s, do_s, lse_s, dl_s, ds_s, p_s, dk_s, dv_s, bar):
        bg, kt = lax.axis_index("bg"), lax.axis_index("kt")
        b, g = bg // g_, bg % g_
        keys = pl.ds(kt * tile, tile)
        _fetch(bar, 0, (k_ref.at[b, g, keys], k_s), (v_ref.at[b, g, keys], v_s))
        kpos = kt * tile + _iota((tile, tile), 0, interp)

        def head(h, carry):
            def step(qt, carry):
                qs = pl.ds(qt * tile, tile)
                _fetch(bar, 2, (qt_ref.at[b, g, h, :, qs], qt_s), (q_ref.at[b, g, h, qs], q_s),
                       (dot_ref.at[b, g, h, :, qs], dot_s), (do_ref.at[b, g, h, qs], do_s),
                       (lse_ref.at[b, g, h, qs], lse_s), (dl_ref.at[b, g, h, qs], dl_s), (ds_ref.at[b, qs], ds_s))
                qpos = qt * tile + _iota((tile, tile), 1, interp)
                col_ds = lax.broadcast_in_dim(_load_vec(ds_s, 0, interp), (tile, tile), [1])
                mask = (kpos <= qpos) & (qpos - kpos < window) & (kpos >= col_ds)
                dk_t, dv_t = _dkv_step(k_s, v_s, qt_s, q_s, dot_s, do_s, p_s, _load_vec(lse_s, 0, interp),
                                       _load_vec(dl_s, 0, interp), mask, scale)
                return carry[0] + dk_t, carry[1] + dv_t
            return lax.fori_loop(kt, jnp.minimum(kt + nw, nq), step, carry)

        init = (_zeros((tile, dk), interp), _zeros((tile, dv), interp))
        dk_acc, dv_acc = lax.fori_loop(0, hg, head, init)
        _store([(dk_acc * scale, dk_s, dk_ref.at[b, g, keys]), (dv_acc, dv_s, dv_ref.at[b, g, keys])])

    return plgpu.kernel(
        body,
        out_type=[jax.ShapeDtypeStruct((b_, g_, t_, dk), jnp.float32),
                  jax.ShapeDtypeStruct((b_, g_, t_, dv), jnp.float32)],
        scratch_types=[_smem((tile, dk)), _smem((tile, dv)), _smem((dk, tile)), _smem((tile, dk)),
                       _smem((dv, tile)), _smem((tile, dv)), _f32_smem((tile,)), _f32_smem((tile,)),
                       plgpu.SMEM((tile,), jnp.int32), _smem((tile, tile)), _f32_smem((tile, dk)),
                       _f32_smem((tile, dv)), plgpu.Barrier(num_barriers=9)],
        grid=(b_ * g_, nq), grid_names=("bg", "kt"), interpret=interpret,
    )(ds, kb, vb, qht, qh, doht, doh, lse, dl)


def window_bwd(q, k, v, rows_ds, do, lse, delta, *, window, scale, tile, interpret=None):
    """-> (dq rows, dk, dv) in kernel layout (q, k, v's shapes and dtypes), from two kernels:
    dQ per (head, query tile) over the key tiles in its window (`_window_dq`), and dK/dV per key
    tile over the group's heads and the query tiles whose window reaches it (`_window_dkv`), which
    owns its output tile: no atomics, no cross-CTA reduction. XLA writes Q^T and dO^T."""
    b_, g_, r_, dk = q.shape
    t_, dv = k.shape[2], v.shape[-1]
    hg = r_ // t_
    _check(tile, dk, dv)
    heads = lambda x: jnp.moveaxis(x.reshape(b_, g_, t_, hg, x.shape[-1]), 3, 2)  # rows -> [B,G,Hg,T,D]
    bf = lambda x: x.astype(jnp.bfloat16)
    qh, doh = bf(heads(q)), bf(heads(do))
    lse_h, dl_h = heads(lse.astype(jnp.float32))[..., 0], heads(delta.astype(jnp.float32))[..., 0]
    ds = rows_ds[:, ::hg, 0].astype(jnp.int32)
    kb, vb = bf(k), bf(v)
    kw = {"window": window, "scale": scale, "tile": tile, "interpret": interpret}
    dq = _window_dq(ds, qh, doh, lse_h, dl_h, jnp.swapaxes(kb, 2, 3), kb, jnp.swapaxes(vb, 2, 3), **kw)
    dk_, dv_ = _window_dkv(ds, kb, vb, jnp.swapaxes(qh, 3, 4), qh, jnp.swapaxes(doh, 3, 4), doh, lse_h, dl_h,
                           **kw)
    dq = jnp.moveaxis(dq, 2, 3).reshape(q.shape)
    return dq.astype(q.dtype), dk_.astype(k.dtype), dv_.astype(v.dtype)
