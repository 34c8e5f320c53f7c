"""Causal, segment-masked flash attention for GPUs (Pallas Triton) at given query positions.

    o = flash_attention(q, k, v, q_pos, q_seg, kv_seg, scale, q_prefix=None)
    q [B,Tq,H,dq], k [B,S,H,dq], v [B,S,H,dv], q_pos / q_seg / q_prefix [B,Tq] int32,
    kv_seg [B,S] int32 -> o [B,Tq,H,dv] in q's dtype

Query i sees key s iff s <= q_pos[i] and kv_seg[s] is q_seg[i], or q_prefix[i] when that is
> 0 (`reference`): the second term is the GRPO learner's shared-prefix rows (a group's prompt
once, each continuation attending to it and to itself: attention_kernels.attention_mask). With q_pos =
arange(S) and q_seg = kv_seg this is the dense backend's causal attention of packed documents
(coder.model.attention_kernels.attention_mask); with a device's share of the queries, in any
order, against the whole row's keys, it is that device's part of a sequence-parallel attention
(context parallelism: coder.model.attention_kernels.gpu_flash_attention gives each device its
zigzag-ordered queries). Why a kernel of our own: the flash kernel JAX ships for GPUs
(jax.experimental.pallas.ops.gpu.attention.mha) masks causally by array index (queries and keys
the same row, so no device share), and needs one head width for q, k and v (MLA's values are
narrower: 128 against 192); tokamax's Triton attention takes query indices but its backward
materialises the [Tq, S] mask.

The FlashAttention-2 scheme: the forward walks the key blocks a query block can see (up to its
largest position) with an online softmax and keeps the log-sum-exp; the backward recomputes the
probabilities from it, dQ in a kernel over query blocks and dK / dV in one over key blocks, which
skips a query block whose positions are all before the key block. Triton's tensors are powers
of two: the query / key width is taken in power-of-two column parts, each dot summed over them
(`width_parts`: MLA's 192 as 128 + 64, no padding: the padded 256 cost a third more Q K^T
FLOPs and a padded copy of q and k, forward and backward), else padded to a power of two (zeros
change no dot product); values are padded. Sequences must be whole blocks.
Float32 softmax statistics and accumulators; the matmul operands are the inputs' dtype.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

NEG_INF = -1e30  # finite: a masked score never makes a NaN


@dataclasses.dataclass(frozen=True)
class Tiles:
    """The kernels' block lengths (tokens) and Triton launch parameters. The forward holds a
    [block_q, 192] query tile and two stages of [block_k, 192] key and [block_k, 128] value tiles
    in shared memory at MLA's widths (bf16: 104 KiB at 64 x 64, within an H100's 227 KiB)."""

    block_q: int = 64
    block_k: int = 64
    block_q_bwd: int = 32
    block_k_bwd: int = 32
    num_warps: int = 8
    num_stages: int = 2
    interpret: bool = False


def reference(q, k, v, q_pos, q_seg, kv_seg, scale: float, q_prefix=None):
    """`flash_attention` in plain XLA (the [B, H, Tq, S] scores): the kernel's test oracle."""
    s = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=jnp.float32) * scale
    q_prefix = jnp.zeros_like(q_seg) if q_prefix is None else q_prefix
    seen = _seen(q_pos[:, :, None], q_seg[:, :, None], q_prefix[:, :, None], jnp.arange(k.shape[1])[None, None],
                 kv_seg[:, None])
    p = jax.nn.softmax(jnp.where(seen[:, None], s, NEG_INF), axis=-1)
    return jnp.einsum("bhts,bshd->bthd", p.astype(v.dtype), v).astype(q.dtype)


def width_parts(width: int) -> tuple[tuple[int, int], ...] | None:
    """The query / key width as column slices (start, size) of powers of two, each at least 16
    (Triton's tensors are powers of two, its dots at least 16 wide): 192 -> (0, 128), (128, 64);
    None when a part would be narrower (the width is then padded to a power of two)."""
    parts, start = [], 0
    for bit in reversed(range(width.bit_length())):
        size = 1 << bit
        if width & size:
            parts.append((start, size))
            start += size
    return tuple(parts) if all(n >= 16 for _, n in parts) else None


def _cols(ref, rows, parts):
    """Row slice `rows` of a [rows, width] ref, loaded as the column parts (a list of tiles)."""
    return [ref[rows, a:a + n] for a, n in parts]


def _scores(qs, ks):
    """Q K^T summed over the width's column parts ([bq, bk] float32)."""
    return sum(plgpu.dot(q, k, trans_b=True).astype(jnp.float32) for q, k in zip(qs, ks))


def _seen(q_pos, q_seg, q_pre, k_pos, k_seg):
    return (k_pos <= q_pos) & ((k_seg == q_seg) | ((k_seg == q_pre) & (q_pre > 0)))


# ----------------------------------------------------------------------------- kernels
def _fwd_kernel(q_ref, k_ref, v_ref, qpos_ref, qseg_ref, qpre_ref, kseg_ref, o_ref, lse_ref, *, scale, block_k,
                parts):
    """One query block of one (row, head): o_ref [bq, dv], lse_ref [bq]."""
    q, qpos, qseg, qpre = _cols(q_ref, slice(None), parts), qpos_ref[...], qseg_ref[...], qpre_ref[...]
    n_k = k_ref.shape[0] // block_k

    def body(j, carry):
        acc, m, l = carry
        ks = pl.ds(j * block_k, block_k)
        k, v, kseg = _cols(k_ref, ks, parts), v_ref[ks, :], kseg_ref[ks]
        s = _scores(q, k) * scale  # [bq, bk]
        seen = _seen(qpos[:, None], qseg[:, None], qpre[:, None], j * block_k + jnp.arange(block_k)[None, :],
                     kseg[None, :])
        s = jnp.where(seen, s, NEG_INF)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.where(seen, jnp.exp(s - m_new[:, None]), 0.0)
        corr = jnp.exp(m - m_new)
        acc = acc * corr[:, None] + plgpu.dot(p.astype(v.dtype), v).astype(jnp.float32)
        return acc, m_new, l * corr + jnp.sum(p, axis=1)

    bq, dv = q[0].shape[0], o_ref.shape[-1]
    hi = jnp.minimum(jnp.max(qpos) // block_k + 1, n_k)  # the blocks holding keys it can see
    init = (jnp.zeros((bq, dv), jnp.float32), jnp.full((bq,), NEG_INF, jnp.float32), jnp.zeros((bq,), jnp.float32))
    acc, m, l = lax.fori_loop(0, hi, body, init)
    l = jnp.where(l > 0, l, 1.0)  # a query sees at least itself; guards padding rows all the same
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(l)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qpos_ref, qseg_ref, qpre_ref, kseg_ref, dq_ref, *,
               scale, block_k, parts):
    """dQ of one query block: sum over the key blocks it sees of dS K (dS = P (dP - delta))."""
    q, do, lse, delta = _cols(q_ref, slice(None), parts), do_ref[...], lse_ref[...], delta_ref[...]
    qpos, qseg, qpre = qpos_ref[...], qseg_ref[...], qpre_ref[...]
    n_k = k_ref.shape[0] // block_k

    def body(j, dq):
        ks = pl.ds(j * block_k, block_k)
        k, v, kseg = _cols(k_ref, ks, parts), v_ref[ks, :], kseg_ref[ks]
        s = _scores(q, k) * scale
        seen = _seen(qpos[:, None], qseg[:, None], qpre[:, None], j * block_k + jnp.arange(block_k)[None, :],
                     kseg[None, :])
        p = jnp.where(seen, jnp.exp(s - lse[:, None]), 0.0)
        dp = plgpu.dot(do, v, trans_b=True).astype(jnp.float32)
        ds = (p * (dp - delta[:, None])).astype(k[0].dtype)
        return [acc + plgpu.dot(ds, kp).astype(jnp.float32) for acc, kp in zip(dq, k)]

    hi = jnp.minimum(jnp.max(qpos) // block_k + 1, n_k)
    dq = lax.fori_loop(0, hi, body, [jnp.zeros(qp.shape, jnp.float32) for qp in q])
    for (a, n), part in zip(parts, dq):
        dq_ref[:, a:a + n] = (part * scale).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qpos_ref, qseg_ref, qpre_ref, kseg_ref, dk_ref,
                dv_ref, *, scale, block_q, parts):
    """dK, dV of one key block: sums over the query blocks (any order of positions) that see it."""
    j = pl.program_id(0)
    k, v, kseg = _cols(k_ref, slice(None), parts), v_ref[...], kseg_ref[...]
    bk = v.shape[0]
    kpos = j * bk + jnp.arange(bk)
    n_q = q_ref.shape[0] // block_q

    def body(i, carry):
        qs = pl.ds(i * block_q, block_q)
        qpos = qpos_ref[qs]

        def add(carry):
            dk, dv = carry
            q, do, lse, delta = _cols(q_ref, qs, parts), do_ref[qs, :], lse_ref[qs], delta_ref[qs]
            qseg, qpre = qseg_ref[qs], qpre_ref[qs]
            s = _scores(q, k) * scale  # [bq, bk]
            seen = _seen(qpos[:, None], qseg[:, None], qpre[:, None], kpos[None, :], kseg[None, :])
            p = jnp.where(seen, jnp.exp(s - lse[:, None]), 0.0)
            dv = dv + plgpu.dot(p.astype(do.dtype), do, trans_a=True).astype(jnp.float32)
            dp = plgpu.dot(do, v, trans_b=True).astype(jnp.float32)
            ds = (p * (dp - delta[:, None])).astype(q[0].dtype)
            return [acc + plgpu.dot(ds, qp, trans_a=True).astype(jnp.float32) for acc, qp in zip(dk, q)], dv

        # a query block whose last position is before this key block sees none of it
        return lax.cond(jnp.max(qpos) >= j * bk, add, lambda c: c, carry)

    init = ([jnp.zeros(kp.shape, jnp.float32) for kp in k], jnp.zeros(v.shape, jnp.float32))
    dk, dv = lax.fori_loop(0, n_q, body, init)
    for (a, n), part in zip(parts, dk):
        dk_ref[:, a:a + n] = (part * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


# ----------------------------------------------------------------------------- calls
def _params(tiles: Tiles):
    return plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages)


def _forward(q, k, v, q_pos, q_seg, q_pre, kv_seg, scale: float, tiles: Tiles):
    """(o [B,Tq,H,dv], lse [B,H,Tq] float32); q / k widths in `width_parts`, v's a power of two."""
    b, tq, h, dq = q.shape
    s, dv = k.shape[1], v.shape[-1]
    bq, bk = tiles.block_q, tiles.block_k
    row = lambda length, width: pl.BlockSpec((None, length, None, width), lambda i, b_, h_: (b_, 0, h_, 0))
    return pl.pallas_call(
        functools.partial(_fwd_kernel, scale=scale, block_k=bk, parts=width_parts(dq)),
        grid=(tq // bq, b, h),
        in_specs=[pl.BlockSpec((None, bq, None, dq), lambda i, b_, h_: (b_, i, h_, 0)), row(s, dq), row(s, dv),
                  pl.BlockSpec((None, bq), lambda i, b_, h_: (b_, i)),
                  pl.BlockSpec((None, bq), lambda i, b_, h_: (b_, i)),
                  pl.BlockSpec((None, bq), lambda i, b_, h_: (b_, i)),
                  pl.BlockSpec((None, s), lambda i, b_, h_: (b_, 0))],
        out_specs=[pl.BlockSpec((None, bq, None, dv), lambda i, b_, h_: (b_, i, h_, 0)),
                   pl.BlockSpec((None, None, bq), lambda i, b_, h_: (b_, h_, i))],
        out_shape=[jax.ShapeDtypeStruct((b, tq, h, dv), q.dtype), jax.ShapeDtypeStruct((b, h, tq), jnp.float32)],
        compiler_params=_params(tiles), interpret=tiles.interpret, name="flash_fwd_at_positions",
    )(q, k, v, q_pos, q_seg, q_pre, kv_seg)


def _backward(q, k, v, q_pos, q_seg, q_pre, kv_seg, o, lse, do, scale: float, tiles: Tiles):
    b, tq, h, dq = q.shape
    s, dv = k.shape[1], v.shape[-1]
    delta = jnp.einsum("bthd,bthd->bht", o.astype(jnp.float32), do.astype(jnp.float32))
    whole = lambda length, width: pl.BlockSpec((None, length, None, width), lambda i, b_, h_: (b_, 0, h_, 0))
    tile = lambda length, width: pl.BlockSpec((None, length, None, width), lambda i, b_, h_: (b_, i, h_, 0))
    stat = lambda length, idx: pl.BlockSpec((None, None, length), idx)
    seq = lambda length, idx: pl.BlockSpec((None, length), idx)
    bq, bk = tiles.block_q_bwd, tiles.block_k_bwd
    dq_ = pl.pallas_call(
        functools.partial(_dq_kernel, scale=scale, block_k=bk, parts=width_parts(dq)),
        grid=(tq // bq, b, h),
        in_specs=[tile(bq, dq), whole(s, dq), whole(s, dv), tile(bq, dv),
                  stat(bq, lambda i, b_, h_: (b_, h_, i)), stat(bq, lambda i, b_, h_: (b_, h_, i)),
                  seq(bq, lambda i, b_, h_: (b_, i)), seq(bq, lambda i, b_, h_: (b_, i)),
                  seq(bq, lambda i, b_, h_: (b_, i)), seq(s, lambda i, b_, h_: (b_, 0))],
        out_specs=tile(bq, dq), out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=_params(tiles), interpret=tiles.interpret, name="flash_dq_at_positions",
    )(q, k, v, do, lse, delta, q_pos, q_seg, q_pre, kv_seg)
    dk, dv_ = pl.pallas_call(
        functools.partial(_dkv_kernel, scale=scale, block_q=bq, parts=width_parts(dq)),
        grid=(s // bk, b, h),
        in_specs=[whole(tq, dq), tile(bk, dq), tile(bk, dv), whole(tq, dv),
                  stat(tq, lambda j, b_, h_: (b_, h_, 0)), stat(tq, lambda j, b_, h_: (b_, h_, 0)),
                  seq(tq, lambda j, b_, h_: (b_, 0)), seq(tq, lambda j, b_, h_: (b_, 0)),
                  seq(tq, lambda j, b_, h_: (b_, 0)), seq(bk, lambda j, b_, h_: (b_, j))],
        out_specs=[tile(bk, dq), tile(bk, dv)],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=_params(tiles), interpret=tiles.interpret, name="flash_dkv_at_positions",
    )(q, k, v, do, lse, delta, q_pos, q_seg, q_pre, kv_seg)
    return dq_, dk, dv_


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _flash(q, k, v, q_pos, q_seg, q_pre, kv_seg, scale, tiles):
    return _forward(q, k, v, q_pos, q_seg, q_pre, kv_seg, scale, tiles)[0]


def _flash_fwd(q, k, v, q_pos, q_seg, q_pre, kv_seg, scale, tiles):
    o, lse = _forward(q, k, v, q_pos, q_seg, q_pre, kv_seg, scale, tiles)
    return o, (q, k, v, q_pos, q_seg, q_pre, kv_seg, o, lse)


def _flash_bwd(scale, tiles, res, do):
    q, k, v, q_pos, q_seg, q_pre, kv_seg, o, lse = res
    dq, dk, dv = _backward(q, k, v, q_pos, q_seg, q_pre, kv_seg, o, lse, do, scale, tiles)
    return dq, dk, dv, None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _check_tiles(tq: int, s: int, tiles: Tiles):
    for name, n, blocks in (("queries", tq, (tiles.block_q, tiles.block_q_bwd)),
                            ("keys", s, (tiles.block_k, tiles.block_k_bwd))):
        if any(n % blk for blk in blocks):
            raise ValueError(f"flash_attention: {n} {name} are not whole tiles of {blocks} tokens "
                             "(pad the rows: coder.model.attention_kernels pads to 128)")


def _widen(a, width: int):
    return a if a.shape[-1] == width else jnp.pad(a, [(0, 0)] * 3 + [(0, width - a.shape[-1])])


def _widths(dq: int, dv: int) -> tuple[int, int]:
    """The kernels' query / key and value widths: queries and keys in their width's power-of-two
    column parts (MLA's 192: 128 + 64), else padded to a power of two; values padded (MLA's 128
    is one already)."""
    return (dq if width_parts(dq) else pl.next_power_of_2(dq)), pl.next_power_of_2(dv)


def _int32_rows(q_pos, q_seg, kv_seg, q_prefix):
    q_pre = jnp.zeros_like(q_seg, jnp.int32) if q_prefix is None else q_prefix.astype(jnp.int32)
    return q_pos.astype(jnp.int32), q_seg.astype(jnp.int32), q_pre, kv_seg.astype(jnp.int32)


def flash_attention(q, k, v, q_pos, q_seg, kv_seg, scale: float, tiles: Tiles = Tiles(), q_prefix=None):
    """See the module docstring (q_prefix None: no shared prefix). Tq must be a multiple of the
    query tiles and S of the key tiles (ValueError naming them otherwise)."""
    _check_tiles(q.shape[1], k.shape[1], tiles)
    dv = v.shape[-1]
    wq, wv = _widths(q.shape[-1], dv)
    q_pos, q_seg, q_pre, kv_seg = _int32_rows(q_pos, q_seg, kv_seg, q_prefix)
    o = _flash(_widen(q, wq), _widen(k, wq), _widen(v, wv), q_pos, q_seg, q_pre, kv_seg, float(scale), tiles)
    return o[..., :dv]


def flash_forward(q, k, v, q_pos, q_seg, kv_seg, scale: float, tiles: Tiles = Tiles()):
    """`flash_attention`'s forward kernel alone, with its log-sum-exp: (o `[B,Tq,H,dv]`, lse
    `[B,H,Tq]` float32). For callers that combine partial attentions (ring attention,
    coder.model.context_parallel) and differentiate them with `flash_backward`."""
    _check_tiles(q.shape[1], k.shape[1], tiles)
    dv = v.shape[-1]
    wq, wv = _widths(q.shape[-1], dv)
    o, lse = _forward(_widen(q, wq), _widen(k, wq), _widen(v, wv), *_int32_rows(q_pos, q_seg, kv_seg, None),
                      float(scale), tiles)
    return o[..., :dv], lse


def flash_backward(q, k, v, q_pos, q_seg, kv_seg, o, lse, do, scale: float, tiles: Tiles = Tiles()):
    """The backward kernels of `flash_forward`'s attention given an output `o` and log-sum-exp
    `lse` (for a ring: the row's final ones, not this block's) -> (dq, dk, dv)."""
    dq_w, dv = q.shape[-1], v.shape[-1]
    wq, wv = _widths(dq_w, dv)
    dq, dk, dv_ = _backward(_widen(q, wq), _widen(k, wq), _widen(v, wv), *_int32_rows(q_pos, q_seg, kv_seg, None),
                            _widen(o, wv), lse, _widen(do, wv), float(scale), tiles)
    return dq[..., :dq_w], dk[..., :dq_w], dv_[..., :dv]
