"""Grouped matmul for GPUs (Pallas Triton): the MoE's expert matmuls over the routed rows only.

    y = gmm(x, w, group_sizes)
    x [M, K] rows sorted into contiguous groups, w [G, K, N], group_sizes [G] int32 -> y [M, N]

Row i of group g is x[i] @ w[g]. Rows past sum(group_sizes) of y are never written (unspecified,
as megablox leaves them: coder.model.grouped_matmul's mask_rows=False contract), and so are those
rows of x's cotangent. The backward is two grouped matmuls of the same kind: dx = gmm(dy, w^T)
and dw[g] = x_g^T dy_g (`tgmm`, each group's rows contracted), so forward and backward cost the
routed rows, plus at most one partial row tile per group, and read each weight tile once per
row tile.

The forward's grid is compact: `tile_table` lists the row tiles of every group (a group's tiles
start at its first row, the last one masked at its end), cdiv(M, block_m) + G tiles at most, so
each program multiplies one tile of one group. Why not a library's kernel: tokamax's Pallas-Triton
ragged dot (0.0.12) launches cdiv(M, block_m) x G programs per column tile, every group's program
for every row tile, of which all but one in G exit at once (64 experts: 63 of 64 programs empty),
and its Mosaic-GPU one refuses to lower without a GPU (it checks the default device's
architecture), so stage compile could not count it; `jax.lax.ragged_dot` becomes a dense product of
every row with every group on XLA:GPU (coder.model.grouped_matmul). `reference` is the plain-jnp
oracle of the tests, forward and backward.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Block sizes (rows, output columns, contraction) and Triton launch parameters. The forward
    holds num_stages x ([block_m, block_k] + [block_k, block_n]) bf16 tiles in shared memory
    (3 x 32 KiB at the defaults, within an H100's 227 KiB); tgmm's row chunk is block_k rows."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    interpret: bool = False

    def fit(self, k: int, n: int) -> "Tiles":
        """These tiles with block_k / block_n no larger than k / n (powers of two, at least 16:
        tiny test models); the caller pads k and n to whole blocks."""
        cap = lambda b, d: max(16, min(b, pl.next_power_of_2(d)))  # noqa: E731
        return dataclasses.replace(self, block_k=cap(self.block_k, k), block_n=cap(self.block_n, n))


def reference(x, w, group_sizes):
    """`gmm` in plain jnp, rows past the groups zero: each row times its group's weight."""
    m, g = x.shape[0], w.shape[0]
    grp = jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(m), side="right")
    y = jnp.einsum("mk,mkn->mn", x, w[jnp.minimum(grp, g - 1)], preferred_element_type=jnp.float32)
    return jnp.where((grp < g)[:, None], y, 0).astype(x.dtype)


def tile_table(group_sizes, m: int, block_m: int):
    """(group, first row, end row) of each row tile, `[cdiv(m, block_m) + G]` int32 each.

    Group g's tiles cover its rows block_m at a time from its first row; tiles past the last
    group's are empty (end = first row), so their programs do nothing."""
    g = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    per_group = (sizes + block_m - 1) // block_m
    last_tile = jnp.cumsum(per_group)
    first_row = jnp.cumsum(sizes) - sizes
    t = jnp.arange(-(-m // block_m) + g, dtype=jnp.int32)
    grp = jnp.minimum(jnp.searchsorted(last_tile, t, side="right").astype(jnp.int32), g - 1)
    start = first_row[grp] + (t - (last_tile[grp] - per_group[grp])) * block_m
    end = jnp.minimum(start + block_m, first_row[grp] + sizes[grp])
    start = jnp.minimum(start, m)
    return grp, start, jnp.maximum(jnp.minimum(end, m), start)


def _gmm_kernel(grp_ref, start_ref, end_ref, x_ref, w_ref, y_ref, *, block_m, block_k):
    """One row tile of one group times one column tile of its weight: y_ref rows [start, end)."""
    g, start, end = grp_ref[...], start_ref[...], end_ref[...]
    block_n = y_ref.shape[1]
    rows = pl.ds(start, block_m)
    live = (start + jnp.arange(block_m)) < end

    @pl.when(start < end)
    def _():
        def body(i, acc):
            ks = pl.ds(i * block_k, block_k)
            a = plgpu.load(x_ref.at[rows, ks], mask=live[:, None], other=0.0)
            b = w_ref[g, ks, :]
            return acc + plgpu.dot(a, b).astype(jnp.float32)

        acc = lax.fori_loop(0, x_ref.shape[1] // block_k, body, jnp.zeros((block_m, block_n), jnp.float32))
        plgpu.store(y_ref.at[rows, :], acc.astype(y_ref.dtype), mask=live[:, None])


def _tgmm_kernel(start_ref, end_ref, x_ref, dy_ref, dw_ref, *, block_rows):
    """dw tile [block_k, block_n] of one group: its rows' x^T dy, block_rows rows at a time."""
    start, end = start_ref[...], end_ref[...]

    def body(i, acc):
        r0 = start + i * block_rows
        live = (r0 + jnp.arange(block_rows)) < end
        rows = pl.ds(r0, block_rows)
        a = plgpu.load(x_ref.at[rows, :], mask=live[:, None], other=0.0)
        b = plgpu.load(dy_ref.at[rows, :], mask=live[:, None], other=0.0)
        return acc + plgpu.dot(a, b, trans_a=True).astype(jnp.float32)

    steps = (end - start + block_rows - 1) // block_rows
    acc = lax.fori_loop(0, steps, body, jnp.zeros(dw_ref.shape, jnp.float32))
    dw_ref[...] = acc.astype(dw_ref.dtype)


def _params(t: Tiles):
    return plgpu.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages)


def _pad_to(a, axis: int, multiple: int):
    pad = -a.shape[axis] % multiple
    if not pad:
        return a
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, pad)
    return jnp.pad(a, widths)


def _gmm(x, w, group_sizes, tiles: Tiles):
    (m, k), n = x.shape, w.shape[2]
    t = tiles.fit(k, n)
    xp, wp = _pad_to(x, 1, t.block_k), _pad_to(_pad_to(w, 1, t.block_k), 2, t.block_n)
    kp, n_p = xp.shape[1], wp.shape[2]
    grp, start, end = tile_table(group_sizes, m, t.block_m)
    # column tiles vary fastest: the programs in flight share a row tile of x and their group's
    # weight, so each is read from HBM about once (L2 hits after the first), not once per column
    scalar = pl.BlockSpec((None,), lambda j, i: (i,))
    y = pl.pallas_call(
        functools.partial(_gmm_kernel, block_m=t.block_m, block_k=t.block_k),
        grid=(n_p // t.block_n, grp.shape[0]),
        in_specs=[scalar, scalar, scalar,
                  pl.BlockSpec((m, kp), lambda j, i: (0, 0)),
                  pl.BlockSpec((w.shape[0], kp, t.block_n), lambda j, i: (0, 0, j))],
        out_specs=pl.BlockSpec((m, t.block_n), lambda j, i: (0, j)),
        out_shape=jax.ShapeDtypeStruct((m, n_p), x.dtype),
        compiler_params=_params(t), interpret=t.interpret, name="grouped_matmul_gpu",
    )(grp, start, end, xp, wp.astype(x.dtype))
    return y[:, :n] if n_p != n else y


def tgmm(x, dy, group_sizes, tiles: Tiles = Tiles()):
    """dw `[G, K, N]`, dw[g] = x_g^T dy_g over group g's rows of x `[M, K]` and dy `[M, N]`
    (rows past the groups are not read; a group without rows gets zeros), in x's dtype."""
    (m, k), n, g = x.shape, dy.shape[1], group_sizes.shape[0]
    t = tiles.fit(k, n)
    # dw tiles of [block_m, block_n] (K plays the forward's row role here), block_k rows a step
    bk, bn = min(t.block_m, pl.next_power_of_2(max(k, 16))), t.block_n
    xp, dyp = _pad_to(x, 1, bk), _pad_to(dy, 1, bn)
    sizes = group_sizes.astype(jnp.int32)
    start = jnp.cumsum(sizes) - sizes
    # the group varies slowest: a group's tiles run together and re-read its rows from L2
    scalar = pl.BlockSpec((None,), lambda j, i, gi: (gi,))
    dw = pl.pallas_call(
        functools.partial(_tgmm_kernel, block_rows=t.block_k),
        grid=(dyp.shape[1] // bn, xp.shape[1] // bk, g),
        in_specs=[scalar, scalar,
                  pl.BlockSpec((m, bk), lambda j, i, gi: (0, i)),
                  pl.BlockSpec((m, bn), lambda j, i, gi: (0, j))],
        out_specs=pl.BlockSpec((None, bk, bn), lambda j, i, gi: (gi, i, j)),
        out_shape=jax.ShapeDtypeStruct((g, xp.shape[1], dyp.shape[1]), x.dtype),
        compiler_params=_params(t), interpret=t.interpret, name="tgmm_gpu",
    )(start, start + sizes, xp, dyp.astype(x.dtype))
    return dw[:, :k, :n]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def gmm(x, w, group_sizes, tiles: Tiles = Tiles()):
    """x `[M, K]`, w `[G, K, N]`, group_sizes `[G]` -> `[M, N]` in x's dtype (module docstring)."""
    return _gmm(x, w, group_sizes, tiles)


def _gmm_fwd(x, w, group_sizes, tiles):
    return _gmm(x, w, group_sizes, tiles), (x, w, group_sizes)


def _gmm_bwd(tiles, res, dy):
    x, w, group_sizes = res
    dy = dy.astype(x.dtype)
    dx = _gmm(dy, jnp.swapaxes(w, 1, 2).astype(x.dtype), group_sizes, tiles)
    dw = tgmm(x, dy, group_sizes, tiles).astype(w.dtype)
    return dx, dw, None


gmm.defvjp(_gmm_fwd, _gmm_bwd)
