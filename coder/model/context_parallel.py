"""Context parallelism: how the dense attention's queries and keys meet when the mesh splits a
row over its `seq` axes (n shards; shard s holds the tokens [s T/n, (s+1) T/n)).

`model.context_parallel` names the way, one of MODES:

  * "gather": each device keeps its queries and gathers the row's keys and values whole (XLA
    all-gathers them over the `seq` axes, and reduce-scatters dK / dV in the backward); the
    queries are exchanged into zigzag order (`zigzag_positions`) for the kernel so every shard
    does the same causal work. Per device: whole-row K / V, ~T x heads x (dq + dv) per layer.
  * "ring": nothing is gathered. Each device holds two half-chunks of the row in zigzag order
    (a = its early one, b = its late one) and passes its keys and values around the ring of the
    `seq` axes, n - 1 hops forward (and n hops of keys, values and their gradients backward),
    combining each visiting block's partial softmax by its log-sum-exp (Liu et al. 2023, ring
    attention; Brandon et al. 2023, striped). At hop t a device meets the keys of shard
    src = me - t: its late queries b see src's early keys c whole; its early queries a see c
    whole when src < me, its late queries b see src's late keys d whole when src > me; at hop 0
    (its own keys) a x c and b x d are causal and b x c whole. So every device computes two
    half x half blocks a hop (the causal work of the row split evenly), and holds only T / n
    keys and values (plus one visiting block) at a time.

`ring_attention` is the backend-independent ring; a backend gives it its block kernels as
`Blocks` (coder.model.attention_kernels: splash on TPU, the Triton flash kernel on GPU, XLA on
CPU: `reference_blocks`). The backward is the ring's own (`jax.custom_vjp`): each block's
gradients from the *final* output and log-sum-exp (the flash backward's delta = sum(dO * O)
and P = exp(S - L) hold for every block once L is the row's), so no block's partial softmax is
kept. Equal to whole-row attention up to float rounding (tests/model/test_context_parallel.py).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

MODES = ("gather", "ring")
NEG_INF = -1e30  # finite: a block with no visible key gives a finite log-sum-exp, never a NaN
# the checkpoint name of the ring's output and log-sum-exp (model.remat="save_attention" keeps
# them, as it keeps the splash kernel's): remat never reruns the ring's forward
RESIDUALS = "attention_residuals"
# the named scope of the ring's whole-block kernel calls: coder.train.aot.hlo_stats counts their
# (query, key) pairs whole, where a causal block visits about half
FULL_BLOCK_SCOPE = "ring_full_block"


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"model.context_parallel={mode!r}: choose one of {MODES}")
    return mode


# ----------------------------------------------------------------------------- zigzag order
def zigzag_positions(seq: int, shards: int):
    """`[seq]` int32: the original position of each query in zigzag order, where shard s holds
    half-chunks s and 2*shards-1-s of the row (2*shards half-chunks of seq / (2*shards)).

    Under a causal mask the query shard holding the row's end does ~(2n-1)/n times the
    average work when shards hold contiguous chunks; in zigzag order every shard pairs an early
    half-chunk with a late one and does the average (Brandon et al. 2023, striped attention;
    Llama-3's context parallelism)."""
    half = seq // (2 * shards)
    chunks = [c for s in range(shards) for c in (s, 2 * shards - 1 - s)]
    return np.concatenate([np.arange(c * half, (c + 1) * half) for c in chunks]).astype(np.int32)


def to_zigzag(x, axes, n: int, inverse: bool = False):
    """x `[B, Tl, ...]`, this device's tokens along the `axes` (n shards) in row order (shard s:
    half-chunks 2s, 2s+1) -> the same device's tokens in zigzag order (half-chunks s, then
    2n-1-s), by two collective permutes of half a shard each; `inverse` undoes it."""
    dest = lambda j: j if j < n else 2 * n - 1 - j  # the zigzag shard holding half-chunk j
    me = jax.lax.axis_index(axes)
    half = x.shape[1] // 2
    lo, hi = x[:, :half], x[:, half:]
    if not inverse:
        even = jax.lax.ppermute(lo, axes, [(s, dest(2 * s)) for s in range(n)])
        odd = jax.lax.ppermute(hi, axes, [(s, dest(2 * s + 1)) for s in range(n)])
        # zigzag shard s holds half-chunks s and 2n-1-s: the even one first when s is even
        return jnp.where(me % 2 == 0, jnp.concatenate([even, odd], 1), jnp.concatenate([odd, even], 1))
    even = jnp.where(me % 2 == 0, lo, hi)
    odd = jnp.where(me % 2 == 0, hi, lo)
    lo = jax.lax.ppermute(even, axes, [(dest(2 * s), s) for s in range(n)])
    hi = jax.lax.ppermute(odd, axes, [(dest(2 * s + 1), s) for s in range(n)])
    return jnp.concatenate([lo, hi], 1)


# ----------------------------------------------------------------------------- block kernels
@dataclasses.dataclass(frozen=True)
class Blocks:
    """One backend's attention over a block of queries and a block of keys (both `length` tokens,
    the same half-chunk length), masked by segment ids, causal (query i sees keys <= i: the
    diagonal block) or whole (every key of the query's segment):

      fwd(causal, q, k, v, q_seg, kv_seg) -> (o `[B,Tq,H,dv]`, lse `[B,H,Tq]` float32)
      bwd(causal, q, k, v, q_seg, kv_seg, o, lse, do) -> (dq, dk, dv)

    q `[B,Tq,H,dq]`, k `[B,S,H,dq]`, v `[B,S,H,dv]`, segment ids `[B,Tq]` / `[B,S]` int32; the
    softmax scale is the backend's. `bwd` takes the row's final o and lse (not the block's)."""

    fwd: Callable
    bwd: Callable


def reference_blocks(scale: float) -> Blocks:
    """`Blocks` in XLA: the `[B, H, Tq, S]` scores of one block (CPU; the ring's test oracle)."""
    f32 = jnp.float32

    def scores(causal, q, k, q_seg, kv_seg):
        s = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=f32) * scale
        seen = q_seg[:, :, None] == kv_seg[:, None, :]
        if causal:
            seen = seen & (jnp.arange(q.shape[1])[:, None] >= jnp.arange(k.shape[1])[None, :])
        return s, seen[:, None]

    def fwd(causal, q, k, v, q_seg, kv_seg):
        s, seen = scores(causal, q, k, q_seg, kv_seg)
        s = jnp.where(seen, s, NEG_INF)
        lse = jax.nn.logsumexp(s, axis=-1)
        o = jnp.einsum("bhts,bshd->bthd", jnp.exp(s - lse[..., None]), v.astype(f32))
        return o, lse

    def bwd(causal, q, k, v, q_seg, kv_seg, o, lse, do):
        s, seen = scores(causal, q, k, q_seg, kv_seg)
        p = jnp.where(seen, jnp.exp(s - lse[..., None]), 0.0)
        do = do.astype(f32)
        dv = jnp.einsum("bhts,bthd->bshd", p, do)
        dp = jnp.einsum("bthd,bshd->bhts", do, v.astype(f32))
        delta = jnp.einsum("bthd,bthd->bht", do, o.astype(f32))
        ds = p * (dp - delta[..., None])
        dq = jnp.einsum("bhts,bshd->bthd", ds, k.astype(f32)) * scale
        dk = jnp.einsum("bhts,bthd->bshd", ds, q.astype(f32)) * scale
        return dq, dk, dv

    return Blocks(fwd, bwd)


# ----------------------------------------------------------------------------- the ring
def ring_attention(q, k, v, segment_ids, blocks: Blocks, axes, n: int):
    """One device's share of causal, segment-masked attention inside a `shard_map` over `axes`
    (n shards, each a contiguous part of the rows): q `[B,Tl,H,dq]`, k `[B,Tl,H,dq]`,
    v `[B,Tl,H,dv]`, segment_ids `[B,Tl]` -> o `[B,Tl,H,dv]` in q's dtype (module docstring).
    Tl must be even (two half-chunks)."""
    if q.shape[1] % 2:
        raise ValueError(f"ring attention splits a device's {q.shape[1]} tokens into two half-chunks: "
                         "they must be even")
    zz = lambda a: to_zigzag(a, axes, n)
    o = _ring(zz(q), zz(k), zz(v), zz(segment_ids), blocks, axes, n)
    return to_zigzag(o, axes, n, inverse=True)


def _halves(x, axis: int = 1):
    h = x.shape[axis] // 2
    return jax.lax.slice_in_dim(x, 0, h, axis=axis), jax.lax.slice_in_dim(x, h, 2 * h, axis=axis)


def _combine(acc, part):
    """Two partial softmax attentions of the same queries over disjoint keys -> their union:
    (o `[B,T,H,dv]` float32, lse `[B,H,T]`) each, weighted by exp(lse - the union's lse)."""
    (o, lse), (o2, lse2) = acc, part
    new = jnp.logaddexp(lse, lse2)
    w = lambda a: jnp.swapaxes(jnp.exp(a - new), 1, 2)[..., None]  # [B,H,T] -> [B,T,H,1]
    return o * w(lse) + o2.astype(jnp.float32) * w(lse2), new


def _shift(tree, axes, n: int):
    """Every device's `tree` to the next device of the ring (s -> s + 1 mod n)."""
    return jax.tree.map(lambda a: jax.lax.ppermute(a, axes, [(s, (s + 1) % n) for s in range(n)]), tree)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _ring(q, k, v, seg, blocks, axes, n):
    return _ring_fwd(q, k, v, seg, blocks, axes, n)[0]


# A hop's second block depends on whether the visiting shard precedes this one (module
# docstring): a `lax.cond`, so each device computes that one block and updates one accumulator
# (rather than selecting operands and results with `where`); the visiting keys and values, and
# backward their gradients, travel as separate half-chunks. Compiled for DeepSeek-V3 at 128k
# on v5p-512 the two forms move the same bytes within 1% (docs/scale/README.md).

def _ring_fwd(q, k, v, seg, blocks, axes, n):
    """Zigzag-ordered local q, k, v, seg (half-chunks a, b) -> o and its residuals."""
    f32 = lambda part: (part[0].astype(jnp.float32), part[1])
    fwd = lambda causal, *a: f32(blocks.fwd(causal, *a))
    me = jax.lax.axis_index(axes)
    qa, qb = _halves(q)
    sa, sb = _halves(seg)
    kc, kd = _halves(k)
    vc, vd = _halves(v)
    acc_a = fwd(True, qa, kc, vc, sa, sa)
    acc_b = _combine(fwd(True, qb, kd, vd, sb, sb), fwd(False, qb, kc, vc, sb, sa))
    visiting = (kc, kd, vc, vd, sa, sb)
    for hop in range(1, n):
        visiting = _shift(visiting, axes, n)
        kc, kd, vc, vd, sc, sd = visiting
        acc_b = _combine(acc_b, fwd(False, qb, kc, vc, sb, sc))
        acc_a, acc_b = jax.lax.cond(
            (me - hop) % n < me,  # the visiting keys' shard precedes this one's
            lambda acc_a, acc_b: (_combine(acc_a, fwd(False, qa, kc, vc, sa, sc)), acc_b),
            lambda acc_a, acc_b: (acc_a, _combine(acc_b, fwd(False, qb, kd, vd, sb, sd))),
            acc_a, acc_b)
    o = checkpoint_name(jnp.concatenate([acc_a[0], acc_b[0]], 1).astype(q.dtype), RESIDUALS)
    lse = checkpoint_name(jnp.concatenate([acc_a[1], acc_b[1]], 2), RESIDUALS)
    return o, (q, k, v, seg, o, lse)


def _ring_bwd(blocks, axes, n, res, do):
    q, k, v, seg, o, lse = res
    me = jax.lax.axis_index(axes)
    qa, qb = _halves(q)
    sa, sb = _halves(seg)
    oa, ob = _halves(o)
    la, lb = _halves(lse, axis=2)
    da, db = _halves(do)
    mine_a, mine_b = (qa, sa, oa, la, da), (qb, sb, ob, lb, db)

    def grads(causal, mine, keys, values, kv_seg):
        qx, sx, ox, lx, dx = mine
        return tuple(g.astype(jnp.float32) for g in blocks.bwd(causal, qx, keys, values, sx, kv_seg, ox, lx, dx))

    add = lambda acc, g: tuple(a + b for a, b in zip(acc, g))
    kc, kd = _halves(k)
    vc, vd = _halves(v)
    dq_a, dk_c, dv_c = grads(True, mine_a, kc, vc, sa)
    dq_b, dk_d, dv_d = grads(True, mine_b, kd, vd, sb)
    dq_b, dk_c, dv_c = add((dq_b, dk_c, dv_c), grads(False, mine_b, kc, vc, sa))
    visiting, dkv = (kc, kd, vc, vd, sa, sb), (dk_c, dk_d, dv_c, dv_d)
    for hop in range(1, n):
        visiting, dkv = _shift((visiting, dkv), axes, n)
        kc, kd, vc, vd, sc, sd = visiting
        dk_c, dk_d, dv_c, dv_d = dkv
        dq_b, dk_c, dv_c = add((dq_b, dk_c, dv_c), grads(False, mine_b, kc, vc, sc))

        def before(dq_a, dq_b, dk_c, dk_d, dv_c, dv_d, kc=kc, vc=vc, sc=sc):
            dq_a, dk_c, dv_c = add((dq_a, dk_c, dv_c), grads(False, mine_a, kc, vc, sc))
            return dq_a, dq_b, dk_c, dk_d, dv_c, dv_d

        def after(dq_a, dq_b, dk_c, dk_d, dv_c, dv_d, kd=kd, vd=vd, sd=sd):
            dq_b, dk_d, dv_d = add((dq_b, dk_d, dv_d), grads(False, mine_b, kd, vd, sd))
            return dq_a, dq_b, dk_c, dk_d, dv_c, dv_d

        dq_a, dq_b, dk_c, dk_d, dv_c, dv_d = jax.lax.cond((me - hop) % n < me, before, after,
                                                          dq_a, dq_b, dk_c, dk_d, dv_c, dv_d)
        dkv = (dk_c, dk_d, dv_c, dv_d)
    # after n - 1 hops a device holds the gradients of the keys of shard me + 1: one hop home
    dk_c, dk_d, dv_c, dv_d = _shift(dkv, axes, n) if n > 1 else dkv
    dq = jnp.concatenate([dq_a, dq_b], 1)
    dk, dv = jnp.concatenate([dk_c, dk_d], 1), jnp.concatenate([dv_c, dv_d], 1)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_ring.defvjp(_ring_fwd, _ring_bwd)
