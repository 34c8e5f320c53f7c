"""Mosaic GPU (Hopper, `plgpu`) forward kernels for NSA's selected and sliding-window branches.

Same entry points and layouts as tpu.py (q `[B,G,T,Hg,Dk]`, k `[B,G,T,Dk]`, v `[B,G,T,Dv]`,
doc_start `[B,T]`, lse `[B,G,T,Hg,1]`), so ops.py wraps either with the same custom_vjp.

- selected_fwd: one CTA per (batch*group, token); the Hg heads of the group are the rows of one
  wgmma (padded to a multiple of 64), and each of the n selected key blocks (l' = 64 tokens) is
  copied by TMA once per group and token (the paper's group-centric loading).
- window_fwd: flash attention per (batch*group*head, 64-query tile) over the key tiles that can
  fall inside the window.
Operands arrive in the layout wgmma consumes (K transposed to `[Dk, T]` by XLA), so the kernels
need no in-kernel transposes. Inputs are cast to bfloat16 (wgmma operands); accumulation,
softmax statistics and outputs are float32.

Backward: selected_bwd / window_bwd differentiate the blockwise XLA path (xla.py) - there are no
Mosaic GPU backward kernels yet.

Verification here (no GPU): the kernels lower to Mosaic GPU for the cuda platform, and run
under GPU interpret mode (`InterpretGPUParams`), which simulates GMEM/SMEM, TMA copies,
barriers and wgmma. jax 0.10.2's GPU interpreter has no rule for `layout_cast` or for loads with
an explicit layout, which real lowering requires; `interpret` therefore switches exactly those
two annotations off (helpers `_iota`, `_vec`), everything else is the same kernel.
"""
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from coder.pallas.nsa import xla
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


def _load_rows(ref, interpret):
    return ref[...] if interpret else plgpu.load(ref, (), layout=plgpu.Layout.WGMMA.reduce(1))


def _pv(p, p_s, v_s):
    """p [M,L] float32 @ v_s [L,Dv] (SMEM) on the tensor core -> [M,Dv] float32. p is staged in
    SMEM (p_s) rather than fed from registers: the GPU interpreter takes wgmma operands from SMEM only."""
    p_s[...] = p.astype(jnp.bfloat16)
    plgpu.commit_smem()

    def run(acc_ref):
        plgpu.wgmma(acc_ref, p_s, v_s)
        return acc_ref[...]
    return pl.run_scoped(run, plgpu.ACC((p.shape[0], v_s.shape[1]), jnp.float32))


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

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_s, k_s)
                return acc_ref[...]
            s = pl.run_scoped(qk, plgpu.ACC((rows, block), jnp.float32)) * scale
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

        acc0 = jnp.zeros((rows, dv), jnp.float32)
        if not interp:
            acc0 = plgpu.layout_cast(acc0, plgpu.Layout.WGMMA)
        init = (acc0, _vec(jnp.full((rows,), NEG_INF, jnp.float32), interp),
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
        row_ds = lax.broadcast_in_dim(_load_rows(ds_s, interp), (tile, tile), [0])
        trow = qt * tile + _iota((tile, tile), 0, interp)

        def step(j, carry):
            acc, m, l = carry
            kt_idx = jnp.maximum(qt - (nw - 1) + j, 0)
            live = qt - (nw - 1) + j >= 0
            plgpu.copy_gmem_to_smem(kt_ref.at[b, g, :, pl.ds(kt_idx * tile, tile)], k_s, bar.at[1])
            plgpu.copy_gmem_to_smem(v_ref.at[b, g, pl.ds(kt_idx * tile, tile)], v_s, bar.at[2])
            plgpu.barrier_wait(bar.at[1])

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_s, k_s)
                return acc_ref[...]
            s = pl.run_scoped(qk, plgpu.ACC((tile, tile), jnp.float32)) * scale
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

        acc0 = jnp.zeros((tile, dv), jnp.float32)
        if not interp:
            acc0 = plgpu.layout_cast(acc0, plgpu.Layout.WGMMA)
        init = (acc0, _vec(jnp.full((tile,), NEG_INF, jnp.float32), interp),
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


# ---------------------------------------------------------------- backward (XLA, see docstring)

def _model_layout(q, k, v):
    """Kernel layout -> [B,T,H,Dk], [B,T,G,Dk], [B,T,G,Dv]."""
    b_, g_, t_, hg, dk = q.shape
    return (q.transpose(0, 2, 1, 3, 4).reshape(b_, t_, g_ * hg, dk),
            k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3))


def selected_bwd(q, k, v, sel, doc_start, do, lse, delta, *, block, scale, token_tile=None, token_offset=0,
                 interpret=None):
    """-> (dq, dk, dv) in kernel layout, by differentiating xla.selected_attention."""
    del lse, delta, token_tile, interpret, token_offset  # whole rows only (selected_fwd checks)
    b_, g_, t_, hg, dk = q.shape
    qm, km, vm = _model_layout(q, k, v)
    f = lambda a, b, c: xla.selected_attention(a, b, c, sel.transpose(0, 2, 1, 3), doc_start, block, scale)
    _, vjp = jax.vjp(f, qm, km, vm)
    dom = do.transpose(0, 2, 1, 3, 4).reshape(b_, t_, g_ * hg, -1).astype(jnp.float32)
    dqm, dkm, dvm = vjp(dom)
    return (dqm.reshape(b_, t_, g_, hg, dk).transpose(0, 2, 1, 3, 4).astype(q.dtype),
            dkm.transpose(0, 2, 1, 3).astype(k.dtype), dvm.transpose(0, 2, 1, 3).astype(v.dtype))


def window_bwd(q, k, v, rows_ds, do, lse, delta, *, window, scale, tile, interpret=None):
    """-> (dq rows, dk, dv) in kernel layout, by differentiating xla.window_attention."""
    del lse, delta, tile, interpret
    b_, g_, r_, dk = q.shape
    t_ = k.shape[2]
    hg = r_ // t_
    qm, km, vm = _model_layout(q.reshape(b_, g_, t_, hg, dk), k, v)
    f = lambda a, b, c: xla.window_attention(a, b, c, rows_ds[:, ::hg, 0], window, scale)
    _, vjp = jax.vjp(f, qm, km, vm)
    dom = do.reshape(b_, g_, t_, hg, -1).transpose(0, 2, 1, 3, 4).reshape(b_, t_, g_ * hg, -1)
    dqm, dkm, dvm = vjp(dom.astype(jnp.float32))
    dq = dqm.reshape(b_, t_, g_, hg, dk).transpose(0, 2, 1, 3, 4).reshape(q.shape)
    return dq.astype(q.dtype), dkm.transpose(0, 2, 1, 3).astype(k.dtype), dvm.transpose(0, 2, 1, 3).astype(v.dtype)
