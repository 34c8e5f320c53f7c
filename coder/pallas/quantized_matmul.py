"""A grouped matmul whose weights stay quantized in HBM: the MoE experts of a quantized engine
on TPU (coder.infer.quantize; the weight form coder.model.quantized.Quantized).

    gmm(x, values, scale, group_sizes) -> [M, N]
    x `[M, K]` rows sorted into contiguous groups (group_sizes `[G]`, sum <= M; rows past the
    sum give zeros), values `[G, K, N]` int8 / int4 / float8_e4m3fn, scale `[G, 1, N]` (one per
    output channel) or `[G, K / g, N]` (one per g inputs).

Why a kernel: the megablox grouped matmul takes bf16 operands only, so XLA writes each layer's
dequantized experts to HBM and the kernel reads them back, 2.5x the bytes of bf16 experts for
int8 (docs/scale/composer_k2/engine_quantization.md). Here each weight tile is read in its
narrow form and dequantized in VMEM: `values * scale` rounded to x's dtype, the same weights
`Quantized.dequantize` gives, then one MXU matmul accumulated in float32.

Layout: megablox's own visit schedule (`make_group_metadata`): for each group the row tiles
it touches, a tile spanning two groups visited once for each, only the visits that cover rows
(the grid's second axis is that count, known on device), so a static buffer of many more rows
than are routed (the ragged all-to-all's) costs only the routed ones. The column tiles are the
outer axis and a group's visits are consecutive, so each weight tile is fetched from HBM once
per call (the pipeline skips a block whose index did not change). A row tile holds all K
inputs of its rows (decode and short prefill chunks). Forward only: the engine never
differentiates its weights (the learner trains the full-precision masters).

`reference` is the same product in jnp (dequantize, then the block-padded grouped matmul).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

TM = 128  # rows per tile


def _tile(n: int, preferred: int) -> int:
    """The largest multiple of 128 <= preferred that divides n (n itself when none does)."""
    for t in range(min(preferred, n) // 128 * 128, 0, -128):
        if n % t == 0:
            return t
    return n


def _kernel(group_offsets, group_ids, m_tile_ids, x_ref, v_ref, s_ref, o_ref, *, group: int, tk: int):
    """Visit t: row tile m_tile_ids[t] times a column tile of group group_ids[t]'s weight, `tk`
    inputs at a time; only the group's rows of the tile are stored (a tile spanning two groups
    is visited once for each, consecutively: the out tile stays resident between the two)."""
    t = pl.program_id(1)
    tm = x_ref.shape[0]
    k, tn = v_ref.shape
    acc = jnp.zeros((tm, tn), jnp.float32)
    for i in range(k // tk):  # static: a few slices of the resident tiles
        w = v_ref[i * tk:(i + 1) * tk, :].astype(jnp.float32)
        if group:  # one scale per `group` inputs: rows i*tk/g ... of the [K / g, tn] scale tile
            s = s_ref[i * tk // group:(i + 1) * tk // group, :].astype(jnp.float32)
            w = (w.reshape(tk // group, group, tn) * s[:, None, :]).reshape(tk, tn)
        else:
            w = w * s_ref[...].astype(jnp.float32)  # [1, tn]
        # a narrow integer times the scale is exact in float32: rounding it once to x's dtype
        # is Quantized.dequantize's rounding (values * scale in that dtype)
        acc += jnp.dot(x_ref[:, i * tk:(i + 1) * tk], w.astype(x_ref.dtype), preferred_element_type=jnp.float32)
    g = group_ids[t]
    rows = jax.lax.broadcasted_iota(jnp.int32, (tm, tn), 0) + m_tile_ids[t] * tm
    mine = (rows >= group_offsets[g]) & (rows < group_offsets[g + 1])
    o_ref[...] = jnp.where(mine, acc.astype(o_ref.dtype), o_ref[...])


@functools.partial(jax.jit, static_argnames=("tm", "interpret"))
def gmm(x, values, scale, group_sizes, tm: int = TM, interpret: bool = False):
    """The grouped matmul of x with the quantized weights (module docstring) -> `[M, N]` in x's
    dtype, zero in rows past sum(group_sizes)."""
    from jax.experimental.pallas.ops.tpu.megablox.gmm import make_group_metadata

    m, k = x.shape
    g, k2, n = values.shape
    if k2 != k or scale.shape[0] != g or scale.shape[2] != n:
        raise ValueError(f"quantized gmm: x {x.shape}, values {values.shape}, scale {scale.shape} do not agree")
    group = 0 if scale.shape[1] == 1 else k // scale.shape[1]
    tk = _tile(k, 512)
    # <= 4 MiB of values a column tile
    bits = jax.dtypes.itemsize_bits(values.dtype)
    tn = _tile(n, max(128, min(512, (32 << 20) // max(1, k * bits) // 128 * 128)))
    if group and tk % group:
        raise ValueError(f"quantized gmm: a k tile of {tk} holds no whole groups of {group}")
    mp = -(-m // tm) * tm
    xp = x if mp == m else jnp.pad(x, ((0, mp - m), (0, 0)))
    # megablox's visits: for each group, the row tiles it touches, in order (its own metadata)
    (offsets, group_ids, m_tile_ids), visits = make_group_metadata(
        group_sizes=group_sizes.astype(jnp.int32), m=mp, tm=tm, start_group=jnp.zeros((), jnp.int32),
        num_nonzero_groups=g, visit_empty_groups=False)
    out = pl.pallas_call(
        functools.partial(_kernel, group=group, tk=tk),
        out_shape=jax.ShapeDtypeStruct((mp, n), x.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3, grid=(n // tn, visits),
            in_specs=[pl.BlockSpec((tm, k), lambda j, t, off, gid, mid: (mid[t], 0)),
                      pl.BlockSpec((None, k, tn), lambda j, t, off, gid, mid: (gid[t], 0, j)),
                      pl.BlockSpec((None, scale.shape[1], tn), lambda j, t, off, gid, mid: (gid[t], 0, j))],
            out_specs=pl.BlockSpec((tm, tn), lambda j, t, off, gid, mid: (mid[t], j))),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        cost_estimate=pl.CostEstimate(  # x once per column tile, each group's weight once
            flops=2 * mp * k * n, transcendentals=0,
            bytes_accessed=int(xp.size * xp.dtype.itemsize * (n // tn) + mp * n * x.dtype.itemsize
                               + values.size * bits // 8 + scale.size * scale.dtype.itemsize)),
        interpret=interpret,
    )(offsets, group_ids, m_tile_ids, xp, values, scale)
    return jnp.where((jnp.arange(m) < jnp.sum(group_sizes))[:, None], out[:m], 0).astype(x.dtype)


def reference(x, values, scale, group_sizes):
    """The same product in jnp: the weights dequantized into x's dtype (values * scale rounded
    to it), each row times its group's weight; rows past sum(group_sizes) are zero."""
    g, k, _ = values.shape
    s = scale.astype(jnp.float32)
    if scale.shape[1] != 1:
        s = jnp.repeat(s, k // scale.shape[1], axis=1)
    w = (values.astype(jnp.float32) * s).astype(x.dtype)  # [G, K, N]
    grp = jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(x.shape[0]), side="right")
    y = jnp.einsum("mk,mkn->mn", x.astype(jnp.float32), w[jnp.minimum(grp, g - 1)].astype(jnp.float32))
    return jnp.where((grp < g)[:, None], y, 0).astype(x.dtype)
