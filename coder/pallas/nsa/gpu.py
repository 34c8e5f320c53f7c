"""Mosaic GPU (Hopper, `plgpu`) kernels for NSA's selected and sliding-window branches, forward and backward.

Same entry points and layouts as tpu.py (q `[B,G,T,Hg,Dk]`, k `[B,G,T,Dk]`, v `[B,G,T,Dv]`,
doc_start `[B,T]`, lse/delta `[B,G,T,Hg,1]`), so ops.py wraps either with the same custom_vjp.
The model's full forward runs them in programs lowered for CUDA (coder/model/attention.py,
`MLA._nsa`) when `ops.gpu_unsupported` finds nothing against the layer; its cached calls (decode) do not
(coder/pallas/nsa/decode.py is XLA on every platform).

Forward:
- selected_fwd: one CTA per (batch*group, token, Dv slice); the Hg heads of the group are the rows
  of one wgmma (padded to a multiple of 64), and each of the n selected key blocks (l' = 64 tokens)
  is copied by TMA once per group, token and Dv slice (the paper's group-centric loading).
- window_fwd: flash attention per (batch*group*head, 64-query tile, Dv slice) over the key tiles
  that can fall inside the window.
Backward (flash-attention-2: P recomputed from the forward's lse, delta = rowsum(dO * O)), two
kernels per branch, each output tile written by exactly one CTA (no atomics, deterministic):
- selected: dQ per (batch*group, token, Dk slice) over its n blocks; dK/dV per (batch*group, key
  block, output slice) over the tokens that selected the block, an inverted index (CSR) that XLA
  builds by sorting the (block, token) pairs (`selection_csr`; cost and load balance in `selected_bwd`).
- window: dQ per (batch*group*head, query tile, Dk slice) over the key tiles in its window; dK/dV
  per (batch*group, key tile, output slice) over the group's heads and the query tiles whose window
  reaches it.
Operands arrive in the layout wgmma consumes (K^T `[Dk, T]`, and for the backward V^T, Q^T, dO^T,
transposed by XLA), so every product is SMEM `[M,K]` @ SMEM `[K,N]` with no in-kernel transpose.
Inputs are cast to bfloat16 (wgmma operands, and P / dS before their matmuls); accumulation,
softmax statistics, outputs and gradients are float32 (gradients are cast to the inputs' dtypes).
The kernels are simple rather than fast: one warpgroup per CTA, and each step's TMA copies are
awaited before its matmuls (no multi-buffering, no warp specialisation).

Widths (`_split`, FlashMLA-style): a head dimension is kept whole when its float32 output tile
([rows, width], rows = 64 or the padded heads) fits the warpgroup's register budget and
`head_tile`; otherwise (MLA's absorbed Dk = 576, Dv = 512) it is split two ways:
- outputs: each CTA computes one slice of the output width (O and dV by Dv slice, dQ and dK by Dk
  slice; at 64 rows Dv = 512 -> 2 x 256, Dk = 576 -> 3 x 192) and recomputes the scores it needs;
- contractions: Q K^T (over Dk) and dO V^T (over Dv) are summed over 64-wide chunks that TMA
  streams through shared memory, so no full-width operand is ever resident.
A dK/dV kernel then has one program per dK slice and one per dV slice (a dV program needs only P,
a dK program also dP); with both widths whole, one program computes both, as before the split.
Cost of the split: the scores are recomputed once per output slice, and Q, dO (and, in the dK/dV
kernels, K, V) chunks are re-read every step rather than held in shared memory.

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

import inspect

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from coder.pallas.nsa.reference import NEG_INF

ROWS = 64  # wgmma M granularity
CHUNK = 64  # width of the contraction chunks streamed through SMEM when a head dim is split
HEAD_TILE = 256  # widest output slice of a head dim one CTA computes
_ACC_ELEMS = 64 * 256  # float32 output-tile elements one warpgroup holds (128 registers a thread)
_TRANSFORMS = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))  # bf16, 128-byte swizzle


def _smem(shape, dtype=jnp.bfloat16):
    return plgpu.SMEM(shape, dtype, transforms=_TRANSFORMS)


def _f32_smem(shape):
    return plgpu.SMEM(shape, jnp.float32)


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


# jax 0.12 dropped plgpu.load's index argument (the whole ref is loaded); 0.10 / 0.11 take one
_LOAD_TAKES_INDEX = "idx" in inspect.signature(plgpu.load).parameters


def _load_vec(ref, axis, interpret):
    """SMEM vector -> registers, laid out to broadcast along `axis` of a wgmma result:
    axis 1 = one value per row, axis 0 = one value per column."""
    if interpret:
        return ref[...]
    layout = plgpu.Layout.WGMMA.reduce(axis)
    return plgpu.load(ref, (), layout=layout) if _LOAD_TAKES_INDEX else plgpu.load(ref, layout=layout)


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


def _split(width, rows, head_tile):
    """-> (tile, chunk) for a head dim of `width` whose float32 output tiles have `rows` rows:
    the output slice one CTA computes, and the chunk its contractions over this dim stream.
    Whole (width, width) if it fits the register budget and head_tile; else the widest multiple
    of 64 dividing width that does, with 64-wide (CHUNK) contraction chunks."""
    fits = [w for w in range(64, width + 1, 64) if width % w == 0 and w <= head_tile and rows * w <= _ACC_ELEMS]
    if not fits:
        raise ValueError(f"no 64-multiple slice of head dim {width} fits {rows} rows and head_tile {head_tile}")
    return (width, width) if fits[-1] == width else (fits[-1], CHUNK)


def _operand(n, bar, slot, chunk, dst):
    """A contraction operand given chunk-wise (`chunk(c)`: the GMEM ref of chunk c). With one chunk
    it is copied to dst here, once, and stays resident (the returned function gives None: nothing
    to stream); with more, `_contract` streams the chunks through dst."""
    if n == 1:
        _fetch(bar, slot, (chunk(0), dst))
        return lambda c: None
    return chunk


def _contract(bar, slot, n, a, b, a_s, b_s, interp):
    """sum over c < n of a(c) [M,ck] @ b(c) [ck,N] -> [M,N] float32: each chunk is TMA-copied to
    a_s / b_s (barriers slot, slot+1) and multiplied in turn; a(c) or b(c) None: resident already."""
    def chunk(c):
        _fetch(bar, slot, *[(src, dst) for src, dst in ((a(c), a_s), (b(c), b_s)) if src is not None])
        return _mm(a_s, b_s)
    if n == 1:
        return chunk(0)
    return lax.fori_loop(0, n, lambda c, acc: acc + chunk(c), _zeros((a_s.shape[0], b_s.shape[1]), interp))


def _pad_rows(x, axis, multiple):
    pad = -x.shape[axis] % multiple
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def _offset(token_offset):
    """The selected kernels' token offset as a one-element int32 array (an operand in GMEM)."""
    return jnp.asarray(token_offset, jnp.int32).reshape(1)


def _check(block_or_tile, dk, dv):
    if block_or_tile != 64 or dk % 64 or dv % 64:
        raise ValueError(f"Mosaic GPU NSA kernels need 64-token blocks and head dims that are multiples of 64; "
                         f"got block {block_or_tile}, dk {dk}, dv {dv}")


def _online_softmax(carry, s, mask, v_s, v_bar, p_s):
    """One flash-attention step: scores s [M,L] (masked by mask) into the running (acc, max, sum);
    V's tile arrives in v_s on v_bar."""
    acc, m, l = carry
    s = jnp.where(mask, s, NEG_INF)
    m_new = jnp.maximum(m, s.max(axis=1))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(mask, jnp.exp(s - lax.broadcast_in_dim(m_new, s.shape, [0])), 0.0)
    l = l * alpha + p.sum(axis=1)
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    plgpu.barrier_wait(v_bar)
    return acc + _pv(p, p_s, v_s), m_new, l


def _finish(carry, o_s, lse_s, o_dst, lse_dst):
    acc, m, l = carry
    o_s[...] = acc / lax.broadcast_in_dim(l, acc.shape, [0])
    lse_s[...] = m + jnp.log(l)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_s, o_dst)
    plgpu.copy_smem_to_gmem(lse_s, lse_dst)
    plgpu.wait_smem_to_gmem(0)


def _softmax_init(rows, dv, interp):
    return (_zeros((rows, dv), interp), _vec(jnp.full((rows,), NEG_INF, jnp.float32), interp),
            _vec(jnp.zeros((rows,), jnp.float32), interp))


def selected_fwd(q, k, v, sel, doc_start, *, block, scale, token_tile=None, token_offset=0, head_tile=HEAD_TILE,
                 interpret=None):
    """-> (o [B,G,T,Hg,Dv] float32, lse [B,G,T,Hg,1] float32). sel [B,G,T,n] canonical; q, sel,
    doc_start hold T query tokens from absolute index token_offset (an int or a traced int32,
    read by every CTA from a one-element array); k, v the whole row."""
    del token_tile  # one token per CTA
    b_, g_, t_, hg, dk = q.shape
    dv, n = v.shape[-1], sel.shape[-1]
    _check(block, dk, dv)
    rows = -(-hg // ROWS) * ROWS
    ck, (tv, _) = _split(dk, rows, head_tile)[1], _split(dv, rows, head_tile)
    nk, nv = dk // ck, dv // tv
    qp = _pad_rows(q, 3, ROWS).astype(jnp.bfloat16)
    kt = jnp.swapaxes(k, 2, 3).astype(jnp.bfloat16)  # [B,G,Dk,T]
    vb = v.astype(jnp.bfloat16)
    interp = interpret is not None

    def body(sel_ref, ds_ref, off_ref, q_ref, kt_ref, v_ref, o_ref, lse_ref, q_s, k_s, v_s, p_s, o_s, lse_s, bar):
        bg, t, d = lax.axis_index("bg"), lax.axis_index("t"), lax.axis_index("d")
        b, g = bg // g_, bg % g_
        q_c = _operand(nk, bar, 0, lambda c: q_ref.at[b, g, t, :, pl.ds(c * ck, ck)], q_s)
        ds, last = ds_ref[b, t], off_ref[0] + t  # the token's document start and absolute index

        def step(i, carry):
            blk = sel_ref[b, g, t, i]
            active = (i == 0) | (blk != sel_ref[b, g, t, jnp.maximum(i - 1, 0)])
            keys = pl.ds(blk * block, block)
            plgpu.copy_gmem_to_smem(v_ref.at[b, g, keys, pl.ds(d * tv, tv)], v_s, bar.at[2])
            s = _contract(bar, 0, nk, q_c, lambda c: kt_ref.at[b, g, pl.ds(c * ck, ck), keys], q_s, k_s, interp) * scale
            pos = blk * block + _iota((rows, block), 1, interp)
            mask = (pos <= last) & (pos >= ds) & active
            return _online_softmax(carry, s, mask, v_s, bar.at[2], p_s)

        out = lax.fori_loop(0, n, step, _softmax_init(rows, tv, interp))
        _finish(out, o_s, lse_s, o_ref.at[b, g, t, :, pl.ds(d * tv, tv)], lse_ref.at[b, g, t, d])

    o, lse = plgpu.kernel(
        body,
        out_type=[jax.ShapeDtypeStruct((b_, g_, t_, rows, dv), jnp.float32),
                  jax.ShapeDtypeStruct((b_, g_, t_, nv, rows), jnp.float32)],  # lse once per Dv slice
        scratch_types=[_smem((rows, ck)), _smem((ck, block)), _smem((block, tv)), _smem((rows, block)),
                       _f32_smem((rows, tv)), _f32_smem((rows,)), plgpu.Barrier(num_barriers=3)],
        grid=(b_ * g_, t_, nv), grid_names=("bg", "t", "d"), interpret=interpret,
    )(sel.astype(jnp.int32), doc_start.astype(jnp.int32), _offset(token_offset), qp, kt, vb)
    return o[:, :, :, :hg], lse[:, :, :, 0, :hg, None]


def window_fwd(q, k, v, rows_ds, *, window, scale, tile, head_tile=HEAD_TILE, interpret=None):
    """q rows [B,G,T*Hg,Dk] (row = token * Hg + head), k [B,G,T,Dk], v [B,G,T,Dv], rows_ds [B,T*Hg,1]
    -> (o [B,G,T*Hg,Dv] float32, lse [B,G,T*Hg,1] float32)."""
    b_, g_, r_, dk = q.shape
    t_, dv = k.shape[2], v.shape[-1]
    hg = r_ // t_
    _check(tile, dk, dv)
    nw = -(-(window - 1) // tile) + 1
    ck, (tv, _) = _split(dk, tile, head_tile)[1], _split(dv, tile, head_tile)
    nk, nv = dk // ck, dv // tv
    # per-head query rows: [B,G,Hg,T,Dk]; doc starts per token [B,T]
    qh = jnp.moveaxis(q.reshape(b_, g_, t_, hg, dk), 3, 2).astype(jnp.bfloat16)
    ds = rows_ds[:, ::hg, 0]
    kt = jnp.swapaxes(k, 2, 3).astype(jnp.bfloat16)
    vb = v.astype(jnp.bfloat16)
    interp = interpret is not None

    def body(ds_ref, q_ref, kt_ref, v_ref, o_ref, lse_ref, q_s, k_s, v_s, p_s, ds_s, o_s, lse_s, bar):
        bgh, qt, d = lax.axis_index("bgh"), lax.axis_index("qt"), lax.axis_index("d")
        b, g, h = bgh // (g_ * hg), (bgh // hg) % g_, bgh % hg
        qs = pl.ds(qt * tile, tile)
        _fetch(bar, 0, (ds_ref.at[b, qs], ds_s))
        q_c = _operand(nk, bar, 0, lambda c: q_ref.at[b, g, h, qs, pl.ds(c * ck, ck)], q_s)
        row_ds = lax.broadcast_in_dim(_load_vec(ds_s, 1, interp), (tile, tile), [0])
        trow = qt * tile + _iota((tile, tile), 0, interp)

        def step(j, carry):
            kt_idx = jnp.maximum(qt - (nw - 1) + j, 0)
            live = qt - (nw - 1) + j >= 0
            keys = pl.ds(kt_idx * tile, tile)
            plgpu.copy_gmem_to_smem(v_ref.at[b, g, keys, pl.ds(d * tv, tv)], v_s, bar.at[2])
            s = _contract(bar, 0, nk, q_c, lambda c: kt_ref.at[b, g, pl.ds(c * ck, ck), keys], q_s, k_s, interp) * scale
            pos = kt_idx * tile + _iota((tile, tile), 1, interp)
            mask = (pos <= trow) & (trow - pos < window) & (pos >= row_ds) & live
            return _online_softmax(carry, s, mask, v_s, bar.at[2], p_s)

        out = lax.fori_loop(0, nw, step, _softmax_init(tile, tv, interp))
        _finish(out, o_s, lse_s, o_ref.at[b, g, h, qs, pl.ds(d * tv, tv)], lse_ref.at[b, g, h, d, qs])

    o, lse = plgpu.kernel(
        body,
        out_type=[jax.ShapeDtypeStruct((b_, g_, hg, t_, dv), jnp.float32),
                  jax.ShapeDtypeStruct((b_, g_, hg, nv, t_), jnp.float32)],  # lse once per Dv slice
        scratch_types=[_smem((tile, ck)), _smem((ck, tile)), _smem((tile, tv)), _smem((tile, tile)),
                       plgpu.SMEM((tile,), jnp.int32), _f32_smem((tile, tv)), _f32_smem((tile,)),
                       plgpu.Barrier(num_barriers=3)],
        grid=(b_ * g_ * hg, t_ // tile, nv), grid_names=("bgh", "qt", "d"), interpret=interpret,
    )(ds.astype(jnp.int32), qh, kt, vb)
    o = jnp.moveaxis(o, 2, 3).reshape(b_, g_, r_, dv)
    lse = jnp.moveaxis(lse[:, :, :, 0], 2, 3).reshape(b_, g_, r_, 1)
    return o, lse


# ---------------------------------------------------------------- backward, shared steps
# Flash-attention-2 backward: P = exp(S - lse) is recomputed from the forward's lse, and with
# delta = rowsum(dO * O): dV = P^T dO, dS = P * (dO V^T - delta), dQ = scale dS K, dK = scale dS^T Q.
# The dK/dV kernels work in the transposed frame (rows = keys, columns = queries), so every
# product is `SMEM [M,K] @ SMEM [K,N]`; the transposed operands (K^T, V^T, Q^T, dO^T) come from XLA.

def _probs(s, lse, mask, axis):
    """P = exp(S - lse), masked; lse a per-row (axis 0) or per-column (axis 1) vector."""
    return jnp.exp(jnp.where(mask, s, NEG_INF) - lax.broadcast_in_dim(lse, s.shape, [axis]))


def _dscores(p, dp, delta, axis):
    """dS = P * (dP - delta); delta a per-row (axis 0) or per-column (axis 1) vector."""
    return p * (dp - lax.broadcast_in_dim(delta, p.shape, [axis]))


def _store(pairs):
    """Writes (register value, f32 SMEM staging ref, GMEM destination) triples out by TMA."""
    for x, x_s, _ in pairs:
        x_s[...] = x
    plgpu.commit_smem()
    for _, x_s, dst in pairs:
        plgpu.copy_smem_to_gmem(x_s, dst)
    plgpu.wait_smem_to_gmem(0)


def _dkv_zeros(e_k, e_v, rows, tk, tv, interp):
    """Accumulators of a dK/dV program: dK `[rows, tk]` if it writes Dk slice e_k, dV likewise."""
    return (None if e_k is None else _zeros((rows, tk), interp),
            None if e_v is None else _zeros((rows, tv), interp))


def _store_dkv(dk, dv, scale, e_k, e_v, r, dk_ref, dv_ref, rows, tk, tv):
    """Writes a dK/dV program's results to dk_ref / dv_ref `[B,G,T,D]` at `rows` (batch, group,
    key slice): dK (times the softmax scale) slice e_k and/or dV slice e_v (None: not this
    program's)."""
    outs = []
    if e_k is not None:
        outs.append((dk * scale, r["dk_s"], dk_ref.at[(*rows, pl.ds(e_k * tk, tk))]))
    if e_v is not None:
        outs.append((dv, r["dv_s"], dv_ref.at[(*rows, pl.ds(e_v * tv, tv))]))
    _store(outs)


def _dkv_plan(dk, dv, rows, head_tile):
    """Slices of a dK/dV kernel whose output tiles have `rows` (key) rows -> (tk, ck, ek, tv, cv, ev,
    programs): Dk slices tk (ek of them) and chunks ck, the same for Dv, and the programs per key tile
    (1 when both widths are whole, else ek + ev: one per dK slice, then one per dV slice)."""
    (tk, ck), (tv, cv) = _split(dk, rows, head_tile), _split(dv, rows, head_tile)
    ek, ev = dk // tk, dv // tv
    return tk, ck, ek, tv, cv, ev, 1 if ek == ev == 1 else ek + ev


def _dkv_programs(d, ek, ev, run):
    """Program d of a dK/dV kernel: run(dK slice or None, dV slice or None)."""
    if ek == ev == 1:
        run(0, 0)
    else:
        pl.when(d < ek)(lambda: run(d, None))
        pl.when(d >= ek)(lambda: run(None, d - ek))


def _dkv_scratch(want_dk, want_dv, block, cols, tk, ck, tv, cv):
    """SMEM for one dK/dV program (allocated per program kind, so the two kinds share the space):
    cols = queries per step. Barriers: 0-1 chunk pairs, 2 Q slice, 3 dO slice, 4-6 per-step vectors."""
    types = {"k_s": _smem((block, ck)), "qt_s": _smem((ck, cols)), "p_s": _smem((block, cols)),
             "lse_s": _f32_smem((cols,)), "dl_s": _f32_smem((cols,)), "ds_s": plgpu.SMEM((cols,), jnp.int32),
             "bar": plgpu.Barrier(num_barriers=7)}
    if want_dk:
        types |= {"v_s": _smem((block, cv)), "dot_s": _smem((cv, cols)), "q_s": _smem((cols, tk)),
                  "dk_s": _f32_smem((block, tk))}
    if want_dv:
        types |= {"do_s": _smem((cols, tv)), "dv_s": _f32_smem((block, tv))}
    return types


def _dkv_step(carry, r, st, mask, lse, delta, dpt, q_wait, do_wait):
    """One tile of queries for a block of keys -> carry (dS^T @ Q slice without the softmax scale, or
    None; P^T @ dO slice, or None). st = scaled S^T [keys, queries]; lse/delta per column; dpt():
    dP^T = V dO^T; q_wait/do_wait: the barriers of the Q and dO slices in r["q_s"] / r["do_s"]."""
    dk, dv = carry
    pt = _probs(st, lse, mask, 1)
    if dv is not None:
        plgpu.barrier_wait(do_wait)
        dv = dv + _pv(pt, r["p_s"], r["do_s"])
    if dk is not None:
        dst = _dscores(pt, dpt(), delta, 1)
        plgpu.barrier_wait(q_wait)
        dk = dk + _pv(dst, r["p_s"], r["q_s"])
    return dk, dv


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


def _selected_dq(sel, ds, off, qp, dop, lse, dl, kt, kb, vt, *, block, scale, head_tile, interpret):
    """-> dq [B,G,T,rows,Dk] float32: one CTA per (batch*group, token, Dk slice), looping over its n blocks."""
    b_, g_, t_, rows, dk = qp.shape
    dv, n = dop.shape[-1], sel.shape[-1]
    (tk, ck), cv = _split(dk, rows, head_tile), _split(dv, rows, head_tile)[1]
    nk, nv = dk // ck, dv // cv
    interp = interpret is not None

    def body(sel_ref, ds_ref, off_ref, q_ref, do_ref, lse_ref, dl_ref, kt_ref, k_ref, vt_ref, dq_ref,
             q_s, do_s, lse_s, dl_s, kt_s, k_s, vt_s, p_s, dq_s, bar):
        bg, t, e = lax.axis_index("bg"), lax.axis_index("t"), lax.axis_index("e")
        b, g = bg // g_, bg % g_
        _fetch(bar, 0, (lse_ref.at[b, g, t], lse_s), (dl_ref.at[b, g, t], dl_s))
        q_c = _operand(nk, bar, 0, lambda c: q_ref.at[b, g, t, :, pl.ds(c * ck, ck)], q_s)
        do_c = _operand(nv, bar, 0, lambda c: do_ref.at[b, g, t, :, pl.ds(c * cv, cv)], do_s)
        lse, delta = _load_vec(lse_s, 1, interp), _load_vec(dl_s, 1, interp)
        start, last = ds_ref[b, t], off_ref[0] + t

        def step(i, dq):
            blk = sel_ref[b, g, t, i]
            active = (i == 0) | (blk != sel_ref[b, g, t, jnp.maximum(i - 1, 0)])
            keys = pl.ds(blk * block, block)
            plgpu.copy_gmem_to_smem(k_ref.at[b, g, keys, pl.ds(e * tk, tk)], k_s, bar.at[2])
            pos = blk * block + _iota((rows, block), 1, interp)
            mask = (pos <= last) & (pos >= start) & active
            kt_c = lambda c: kt_ref.at[b, g, pl.ds(c * ck, ck), keys]
            s = _contract(bar, 0, nk, q_c, kt_c, q_s, kt_s, interp) * scale
            dp = _contract(bar, 0, nv, do_c, lambda c: vt_ref.at[b, g, pl.ds(c * cv, cv), keys], do_s, vt_s, interp)
            plgpu.barrier_wait(bar.at[2])
            return dq + _pv(_dscores(_probs(s, lse, mask, 0), dp, delta, 0), p_s, k_s)

        dq = lax.fori_loop(0, n, step, _zeros((rows, tk), interp))
        _store([(dq * scale, dq_s, dq_ref.at[b, g, t, :, pl.ds(e * tk, tk)])])

    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((b_, g_, t_, rows, dk), jnp.float32),
        scratch_types=[_smem((rows, ck)), _smem((rows, cv)), _f32_smem((rows,)), _f32_smem((rows,)),
                       _smem((ck, block)), _smem((block, tk)), _smem((cv, block)), _smem((rows, block)),
                       _f32_smem((rows, tk)), plgpu.Barrier(num_barriers=3)],
        grid=(b_ * g_, t_, dk // tk), grid_names=("bg", "t", "e"), interpret=interpret,
    )(sel, ds, off, qp, dop, lse, dl, kt, kb, vt)


def _selected_dkv(offsets, tokens, ds, off, kb, vb, qtp, qp, dotp, dop, lse, dl, *, block, scale, head_tile,
                  interpret):
    """-> (dk [B,G,S,Dk], dv [B,G,S,Dv]) float32: one CTA per (batch*group, key block, output slice),
    looping over the tokens that selected the block (CSR from `selection_csr`), one token's Hg heads
    (padded to `rows`) per step."""
    b_, g_, _, rows, dk = qp.shape
    s_ = kb.shape[2]
    dv = dop.shape[-1]
    tk, ck, ek, tv, cv, ev, programs = _dkv_plan(dk, dv, block, head_tile)
    nk, nv = dk // ck, dv // cv
    interp = interpret is not None

    def body(off_ref, tok_ref, ds_ref, base_ref, k_ref, v_ref, qt_ref, q_ref, dot_ref, do_ref, lse_ref, dl_ref,
             dk_ref, dv_ref):
        bg, j, d = lax.axis_index("bg"), lax.axis_index("blk"), lax.axis_index("d")
        b, g = bg // g_, bg % g_
        keys = pl.ds(j * block, block)
        pos = j * block + _iota((block, rows), 0, interp)

        def program(e_k, e_v, **r):
            bar = r["bar"]
            k_c = _operand(nk, bar, 0, lambda c: k_ref.at[b, g, keys, pl.ds(c * ck, ck)], r["k_s"])
            if e_k is not None:
                v_c = _operand(nv, bar, 0, lambda c: v_ref.at[b, g, keys, pl.ds(c * cv, cv)], r["v_s"])

            def step(p, carry):
                t = tok_ref[b, g, p]
                if e_k is not None:
                    plgpu.copy_gmem_to_smem(q_ref.at[b, g, t, :, pl.ds(e_k * tk, tk)], r["q_s"], bar.at[2])
                if e_v is not None:
                    plgpu.copy_gmem_to_smem(do_ref.at[b, g, t, :, pl.ds(e_v * tv, tv)], r["do_s"], bar.at[3])
                _fetch(bar, 4, (lse_ref.at[b, g, t], r["lse_s"]), (dl_ref.at[b, g, t], r["dl_s"]))
                mask = (pos <= base_ref[0] + t) & (pos >= ds_ref[b, t])
                st = _contract(bar, 0, nk, k_c, lambda c: qt_ref.at[b, g, t, pl.ds(c * ck, ck), :],
                               r["k_s"], r["qt_s"], interp) * scale
                dpt = lambda: _contract(bar, 0, nv, v_c, lambda c: dot_ref.at[b, g, t, pl.ds(c * cv, cv), :],
                                        r["v_s"], r["dot_s"], interp)
                # the zero rows padding Hg to `rows` have dO = 0 and delta = 0: they add exactly 0
                return _dkv_step(carry, r, st, mask, _load_vec(r["lse_s"], 0, interp),
                                 _load_vec(r["dl_s"], 0, interp), dpt, bar.at[2], bar.at[3])

            init = _dkv_zeros(e_k, e_v, block, tk, tv, interp)
            dk_acc, dv_acc = lax.fori_loop(off_ref[b, g, j], off_ref[b, g, j + 1], step, init)
            _store_dkv(dk_acc, dv_acc, scale, e_k, e_v, r, dk_ref, dv_ref, (b, g, keys), tk, tv)

        def run(e_k, e_v):
            types = _dkv_scratch(e_k is not None, e_v is not None, block, rows, tk, ck, tv, cv)
            pl.run_scoped(lambda **r: program(e_k, e_v, **r), **types)

        _dkv_programs(d, ek, ev, run)

    return plgpu.kernel(
        body,
        out_type=[jax.ShapeDtypeStruct((b_, g_, s_, dk), jnp.float32),
                  jax.ShapeDtypeStruct((b_, g_, s_, dv), jnp.float32)],
        grid=(b_ * g_, s_ // block, programs), grid_names=("bg", "blk", "d"), interpret=interpret,
    )(offsets, tokens, ds, off, kb, vb, qtp, qp, dotp, dop, lse, dl)


def selected_bwd(q, k, v, sel, doc_start, do, lse, delta, *, block, scale, token_tile=None, token_offset=0,
                 head_tile=HEAD_TILE, interpret=None):
    """-> (dq, dk, dv) in kernel layout (q, k, v's shapes and dtypes), from two kernels:

    - dQ (`_selected_dq`): the forward's grid (Dk slices for Dv slices), recomputing P from lse.
    - dK/dV (`_selected_dkv`): one CTA per (batch*group, key block, output slice) walks the tokens
      that selected its block, listed by `selection_csr` (an XLA sort of the T*n (block, token)
      pairs), and accumulates the block's dK and/or dV slice in registers; each output tile is
      written by exactly one CTA, so there are no atomics and no races, and the sum order is fixed
      (deterministic).
    Cost: the sort is O(T n log(T n)) per (batch, group); the first block of a long document is
    selected by all its tokens, so its CTA walks up to T tokens (load imbalance, as in other
    NSA/FSA GPU backwards); each step copies one token's Q, Q^T, dO, dO^T (Hg heads padded to 64
    rows) without double buffering, so the kernel is latency-bound; XLA writes Q^T and dO^T.
    """
    del token_tile  # one token per CTA
    hg, dk = q.shape[3:]
    s_, dv = k.shape[2], v.shape[-1]
    _check(block, dk, dv)
    if s_ % block:
        raise ValueError(f"the GPU selected backward needs the keys padded to a multiple of {block} (ops.py does); "
                         f"got {s_}")
    bf = lambda x: x.astype(jnp.bfloat16)
    qp, dop = bf(_pad_rows(q, 3, ROWS)), bf(_pad_rows(do, 3, ROWS))  # [B,G,T,rows,D]
    lse_p = _pad_rows(lse[..., 0].astype(jnp.float32), 3, ROWS)  # [B,G,T,rows]
    dl_p = _pad_rows(delta[..., 0].astype(jnp.float32), 3, ROWS)
    kb, vb = bf(k), bf(v)
    sel, ds = sel.astype(jnp.int32), doc_start.astype(jnp.int32)
    kw = {"block": block, "scale": scale, "head_tile": head_tile, "interpret": interpret}
    off = _offset(token_offset)
    dq = _selected_dq(sel, ds, off, qp, dop, lse_p, dl_p, jnp.swapaxes(kb, 2, 3), kb, jnp.swapaxes(vb, 2, 3), **kw)
    offsets, tokens = selection_csr(sel, s_ // block)
    dk_, dv_ = _selected_dkv(offsets, tokens, ds, off, kb, vb, jnp.swapaxes(qp, 3, 4), qp, jnp.swapaxes(dop, 3, 4),
                             dop, lse_p, dl_p, **kw)
    return dq[:, :, :, :hg].astype(q.dtype), dk_.astype(k.dtype), dv_.astype(v.dtype)


# ---------------------------------------------------------------- sliding window, backward

def _window_dq(ds, qh, doh, lse, dl, kt, kb, vt, *, window, scale, tile, head_tile, interpret):
    """-> dq [B,G,Hg,T,Dk] float32: one CTA per (batch*group*head, query tile, Dk slice), looping over
    the key tiles that can fall inside the window."""
    b_, g_, hg, t_, dk = qh.shape
    dv = doh.shape[-1]
    nw = -(-(window - 1) // tile) + 1
    (tk, ck), cv = _split(dk, tile, head_tile), _split(dv, tile, head_tile)[1]
    nk, nv = dk // ck, dv // cv
    interp = interpret is not None

    def body(ds_ref, q_ref, do_ref, lse_ref, dl_ref, kt_ref, k_ref, vt_ref, dq_ref,
             q_s, do_s, lse_s, dl_s, ds_s, kt_s, k_s, vt_s, p_s, dq_s, bar):
        bgh, qt, e = lax.axis_index("bgh"), lax.axis_index("qt"), lax.axis_index("e")
        b, g, h = bgh // (g_ * hg), (bgh // hg) % g_, bgh % hg
        qs = pl.ds(qt * tile, tile)
        _fetch(bar, 0, (lse_ref.at[b, g, h, qs], lse_s), (dl_ref.at[b, g, h, qs], dl_s), (ds_ref.at[b, qs], ds_s))
        q_c = _operand(nk, bar, 0, lambda c: q_ref.at[b, g, h, qs, pl.ds(c * ck, ck)], q_s)
        do_c = _operand(nv, bar, 0, lambda c: do_ref.at[b, g, h, qs, pl.ds(c * cv, cv)], do_s)
        lse, delta = _load_vec(lse_s, 1, interp), _load_vec(dl_s, 1, interp)
        row_ds = lax.broadcast_in_dim(_load_vec(ds_s, 1, interp), (tile, tile), [0])
        trow = qt * tile + _iota((tile, tile), 0, interp)

        def step(kt_idx, dq):
            keys = pl.ds(kt_idx * tile, tile)
            plgpu.copy_gmem_to_smem(k_ref.at[b, g, keys, pl.ds(e * tk, tk)], k_s, bar.at[3])
            pos = kt_idx * tile + _iota((tile, tile), 1, interp)
            mask = (pos <= trow) & (trow - pos < window) & (pos >= row_ds)
            kt_c = lambda c: kt_ref.at[b, g, pl.ds(c * ck, ck), keys]
            s = _contract(bar, 0, nk, q_c, kt_c, q_s, kt_s, interp) * scale
            dp = _contract(bar, 0, nv, do_c, lambda c: vt_ref.at[b, g, pl.ds(c * cv, cv), keys], do_s, vt_s, interp)
            plgpu.barrier_wait(bar.at[3])
            return dq + _pv(_dscores(_probs(s, lse, mask, 0), dp, delta, 0), p_s, k_s)

        dq = lax.fori_loop(jnp.maximum(qt - (nw - 1), 0), qt + 1, step, _zeros((tile, tk), interp))
        _store([(dq * scale, dq_s, dq_ref.at[b, g, h, qs, pl.ds(e * tk, tk)])])

    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((b_, g_, hg, t_, dk), jnp.float32),
        scratch_types=[_smem((tile, ck)), _smem((tile, cv)), _f32_smem((tile,)), _f32_smem((tile,)),
                       plgpu.SMEM((tile,), jnp.int32), _smem((ck, tile)), _smem((tile, tk)), _smem((cv, tile)),
                       _smem((tile, tile)), _f32_smem((tile, tk)), plgpu.Barrier(num_barriers=4)],
        grid=(b_ * g_ * hg, t_ // tile, dk // tk), grid_names=("bgh", "qt", "e"), interpret=interpret,
    )(ds, qh, doh, lse, dl, kt, kb, vt)


def _window_dkv(ds, kb, vb, qht, qh, doht, doh, lse, dl, *, window, scale, tile, head_tile, interpret):
    """-> (dk [B,G,T,Dk], dv [B,G,T,Dv]) float32: one CTA per (batch*group, key tile, output slice),
    looping over the Hg heads of the group and the query tiles whose window reaches the key tile."""
    b_, g_, hg, t_, dk = qh.shape
    dv, nq = doh.shape[-1], t_ // tile
    nw = -(-(window - 1) // tile) + 1
    tk, ck, ek, tv, cv, ev, programs = _dkv_plan(dk, dv, tile, head_tile)
    nk, nv = dk // ck, dv // cv
    interp = interpret is not None

    def body(ds_ref, k_ref, v_ref, qt_ref, q_ref, dot_ref, do_ref, lse_ref, dl_ref, dk_ref, dv_ref):
        bg, kt, d = lax.axis_index("bg"), lax.axis_index("kt"), lax.axis_index("d")
        b, g = bg // g_, bg % g_
        keys = pl.ds(kt * tile, tile)
        kpos = kt * tile + _iota((tile, tile), 0, interp)

        def program(e_k, e_v, **r):
            bar = r["bar"]
            k_c = _operand(nk, bar, 0, lambda c: k_ref.at[b, g, keys, pl.ds(c * ck, ck)], r["k_s"])
            if e_k is not None:
                v_c = _operand(nv, bar, 0, lambda c: v_ref.at[b, g, keys, pl.ds(c * cv, cv)], r["v_s"])

            def head(h, carry):
                def step(qt, carry):
                    qs = pl.ds(qt * tile, tile)
                    if e_k is not None:
                        plgpu.copy_gmem_to_smem(q_ref.at[b, g, h, qs, pl.ds(e_k * tk, tk)], r["q_s"], bar.at[2])
                    if e_v is not None:
                        plgpu.copy_gmem_to_smem(do_ref.at[b, g, h, qs, pl.ds(e_v * tv, tv)], r["do_s"], bar.at[3])
                    _fetch(bar, 4, (lse_ref.at[b, g, h, qs], r["lse_s"]), (dl_ref.at[b, g, h, qs], r["dl_s"]),
                           (ds_ref.at[b, qs], r["ds_s"]))
                    qpos = qt * tile + _iota((tile, tile), 1, interp)
                    col_ds = lax.broadcast_in_dim(_load_vec(r["ds_s"], 0, interp), (tile, tile), [1])
                    mask = (kpos <= qpos) & (qpos - kpos < window) & (kpos >= col_ds)
                    st = _contract(bar, 0, nk, k_c, lambda c: qt_ref.at[b, g, h, pl.ds(c * ck, ck), qs],
                                   r["k_s"], r["qt_s"], interp) * scale
                    dpt = lambda: _contract(bar, 0, nv, v_c, lambda c: dot_ref.at[b, g, h, pl.ds(c * cv, cv), qs],
                                            r["v_s"], r["dot_s"], interp)
                    return _dkv_step(carry, r, st, mask, _load_vec(r["lse_s"], 0, interp),
                                     _load_vec(r["dl_s"], 0, interp), dpt, bar.at[2], bar.at[3])
                return lax.fori_loop(kt, jnp.minimum(kt + nw, nq), step, carry)

            init = _dkv_zeros(e_k, e_v, tile, tk, tv, interp)
            dk_acc, dv_acc = lax.fori_loop(0, hg, head, init)
            _store_dkv(dk_acc, dv_acc, scale, e_k, e_v, r, dk_ref, dv_ref, (b, g, keys), tk, tv)

        def run(e_k, e_v):
            types = _dkv_scratch(e_k is not None, e_v is not None, tile, tile, tk, ck, tv, cv)
            pl.run_scoped(lambda **r: program(e_k, e_v, **r), **types)

        _dkv_programs(d, ek, ev, run)

    return plgpu.kernel(
        body,
        out_type=[jax.ShapeDtypeStruct((b_, g_, t_, dk), jnp.float32),
                  jax.ShapeDtypeStruct((b_, g_, t_, dv), jnp.float32)],
        grid=(b_ * g_, nq, programs), grid_names=("bg", "kt", "d"), interpret=interpret,
    )(ds, kb, vb, qht, qh, doht, doh, lse, dl)


def window_bwd(q, k, v, rows_ds, do, lse, delta, *, window, scale, tile, head_tile=HEAD_TILE, interpret=None):
    """-> (dq rows, dk, dv) in kernel layout (q, k, v's shapes and dtypes), from two kernels:
    dQ per (head, query tile, Dk slice) over the key tiles in its window (`_window_dq`), and dK/dV
    per (key tile, output slice) over the group's heads and the query tiles whose window reaches it
    (`_window_dkv`), which owns its output tile: no atomics, no cross-CTA reduction. XLA writes Q^T
    and dO^T."""
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
    kw = {"window": window, "scale": scale, "tile": tile, "head_tile": head_tile, "interpret": interpret}
    dq = _window_dq(ds, qh, doh, lse_h, dl_h, jnp.swapaxes(kb, 2, 3), kb, jnp.swapaxes(vb, 2, 3), **kw)
    dk_, dv_ = _window_dkv(ds, kb, vb, jnp.swapaxes(qh, 3, 4), qh, jnp.swapaxes(doh, 3, 4), doh, lse_h, dl_h,
                           **kw)
    dq = jnp.moveaxis(dq, 2, 3).reshape(q.shape)
    return dq.astype(q.dtype), dk_.astype(k.dtype), dv_.astype(v.dtype)
