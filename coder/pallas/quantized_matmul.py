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

Layout: each group's rows are placed at a `block`-aligned offset (as coder.model.grouped_matmul's
block-padded form), so a row block belongs to one group: the grid is (N / tn, row blocks), a
scalar-prefetched block -> group table picks the weight tile, and a tile stays resident while
its group's blocks pass (padding blocks past the last group keep the last group's tile), so
each weight is read from HBM once a call. Sized for decode and short prefill chunks: a row
block holds all K inputs of its rows. Forward only: the
engine never differentiates its weights (the learner trains the full-precision masters).

`reference` is the same product in jnp (dequantize, then the block-padded grouped matmul).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

BLOCK = 128  # rows per block (the MXU's rows; a group is padded to whole blocks)


def _tile(n: int, preferred: int) -> int:
    """The largest multiple of 128 <= preferred that divides n (n itself when none does)."""
    for t in range(min(preferred, n) // 128 * 128, 0, -128):
        if n % t == 0:
            return t
    return n


def _kernel(block_group, x_ref, v_ref, s_ref, o_ref, *, group: int, tk: int):
    """One row block times one column tile of its group's weight, `tk` inputs at a time."""
    del block_group  # used by the index maps only
    k, tn = v_ref.shape
    acc = jnp.zeros((x_ref.shape[0], tn), jnp.float32)
    for t in range(k // tk):  # static: a few slices of the resident tiles
        w = v_ref[t * tk:(t + 1) * tk, :].astype(jnp.float32)
        if group:  # one scale per `group` inputs: rows t*tk/g ... of the [K / g, tn] scale tile
            s = s_ref[t * tk // group:(t + 1) * tk // group, :].astype(jnp.float32)
            w = (w.reshape(tk // group, group, tn) * s[:, None, :]).reshape(tk, tn)
        else:
            w = w * s_ref[...].astype(jnp.float32)  # [1, tn]
        # a narrow integer times the scale is exact in float32: rounding it once to x's dtype
        # is Quantized.dequantize's rounding (values * scale in that dtype)
        acc += jnp.dot(x_ref[:, t * tk:(t + 1) * tk], w.astype(x_ref.dtype), preferred_element_type=jnp.float32)
    o_ref[...] = acc.astype(o_ref.dtype)


def _padded_rows(m: int, group_sizes, g: int, block: int):
    """(dest `[M]` row of each row in the padded layout (n_blocks * block: dropped), block_group
    `[n_blocks]`, n_blocks, valid `[M]`) of coder.model.grouped_matmul's block-padded form."""
    n_blocks = -(-(m + g * block) // block)
    padded = -(-group_sizes // block) * block
    start = jnp.cumsum(group_sizes) - group_sizes
    pstart = jnp.cumsum(padded) - padded
    rows = jnp.arange(m)
    grp = jnp.searchsorted(jnp.cumsum(group_sizes), rows, side="right")
    valid = grp < g
    grp = jnp.minimum(grp, g - 1)
    dest = jnp.where(valid, pstart[grp] + rows - start[grp], n_blocks * block)
    block_group = jnp.searchsorted(jnp.cumsum(padded), jnp.arange(n_blocks) * block, side="right")
    return dest, jnp.minimum(block_group, g - 1).astype(jnp.int32), n_blocks, valid


@functools.partial(jax.jit, static_argnames=("block", "interpret"))
def gmm(x, values, scale, group_sizes, block: int = BLOCK, interpret: bool = False):
    """The grouped matmul of x with the quantized weights (module docstring) -> `[M, N]` in x's dtype."""
    m, k = x.shape
    g, k2, n = values.shape
    if k2 != k or scale.shape[0] != g or scale.shape[2] != n:
        raise ValueError(f"quantized gmm: x {x.shape}, values {values.shape}, scale {scale.shape} do not agree")
    group = 0 if scale.shape[1] == 1 else k // scale.shape[1]
    tk = _tile(k, 512)
    # a column tile of a group's weight stays resident while its row blocks pass (the row
    # blocks are the inner grid axis: the pipeline fetches a block only when its index changes),
    # so each group's weight is read once per call; <= 4 MiB of values a tile
    bits = jax.dtypes.itemsize_bits(values.dtype)
    tn = _tile(n, max(128, min(512, (32 << 20) // max(1, k * bits) // 128 * 128)))
    if group and tk % group:
        raise ValueError(f"quantized gmm: a k tile of {tk} holds no whole groups of {group}")
    dest, block_group, n_blocks, valid = _padded_rows(m, group_sizes, g, block)
    xp = jnp.zeros((n_blocks * block, k), x.dtype).at[dest].set(x, mode="drop")
    out = pl.pallas_call(
        functools.partial(_kernel, group=group, tk=tk),
        out_shape=jax.ShapeDtypeStruct((n_blocks * block, n), x.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(n // tn, n_blocks),
            in_specs=[pl.BlockSpec((block, k), lambda j, i, bg: (i, 0)),
                      pl.BlockSpec((None, k, tn), lambda j, i, bg: (bg[i], 0, j)),
                      pl.BlockSpec((None, scale.shape[1], tn), lambda j, i, bg: (bg[i], 0, j))],
            out_specs=pl.BlockSpec((block, tn), lambda j, i, bg: (i, j))),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        cost_estimate=pl.CostEstimate(  # x once per column tile, each group's weight once
            flops=2 * n_blocks * block * k * n, transcendentals=0,
            bytes_accessed=int(xp.size * xp.dtype.itemsize * (n // tn) + n_blocks * block * n * x.dtype.itemsize
                               + values.size * bits // 8 + scale.size * scale.dtype.itemsize)),
        interpret=interpret,
    )(block_group, xp, values, scale)
    return jnp.where(valid[:, None], out[jnp.minimum(dest, n_blocks * block - 1)], 0).astype(x.dtype)


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
