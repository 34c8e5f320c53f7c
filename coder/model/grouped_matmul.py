"""Grouped matmul: x `[M, K]` rows sorted into contiguous groups, each group times its own
weight of w `[G, K, N]` (group_sizes `[G]`) -> `[M, N]`; the MoE's experts run through it.

`grouped_matmul` picks the form when the program is lowered for its platform: the Pallas
megablox kernels on TPU (`megablox_grouped_matmul`, tiles from `gmm_tiling`), coder's Pallas
Triton kernels on CUDA GPUs (coder.pallas.grouped_matmul_gpu), a block-padded einsum on CPU
(`block_grouped_matmul`; `grouped_matmul` says why not `jax.lax.ragged_dot`). Both kernels'
backward is a grouped matmul too (`tgmm` for the weight gradient), so forward and backward cost
the routed pairs only; XLA:TPU's own ragged_dot gradient w.r.t. the expert weights is a dense
masked product of every expert with every pair (docs/scale/README.md).
"""
from __future__ import annotations

import functools

import jax.numpy as jnp

from coder.model import sharding
from coder.model.quantized import Quantized, as_dtype
from coder.pallas import grouped_matmul_gpu, quantized_matmul

GMM_BLOCK = 128  # rows per block of the block-padded grouped matmul (CPU: bigger blocks run faster)


def block_grouped_matmul(x, w, group_sizes, block: int = GMM_BLOCK):
    """Grouped matmul by padding each group to whole row blocks (exact FLOPs up to padding).

    x `[M, K]` rows sorted by group, w `[G, K, N]`, group_sizes `[G]` (sum <= M; rows past the
    sum give zeros) -> `[M, N]`. Each group's rows are placed at a block-aligned offset, every
    block is multiplied by its group's weight (`[blocks, block, K] x [blocks, K, N]`), and the
    rows are gathered back: (M + G*block) * K * N multiply-adds instead of the M * G * K * N
    that XLA's CPU lowering of `ragged_dot` performs. With fewer rows than padding blocks
    would hold (decoding: a few tokens), each row is multiplied by its own group's gathered
    weight instead: M * K * N, no padding.
    """
    m, g = x.shape[0], w.shape[0]
    if m * 2 <= g * block:  # static: few rows (decode) do not fill padded blocks
        grp = jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(m), side="right")
        if m < g:  # fewer rows than groups: gather each row's weight (reads m weights)
            y = jnp.einsum("mk,mkn->mn", x, w[jnp.minimum(grp, g - 1)])
        else:  # every row through every group's weight (reads each weight once), keep its own
            y = jnp.einsum("mk,gkn->mgn", x, w)
            y = jnp.take_along_axis(y, jnp.minimum(grp, g - 1)[:, None, None], axis=1)[:, 0]
        return jnp.where((grp < g)[:, None], y, 0).astype(x.dtype)
    n_blocks = -(-(m + g * block) // block)
    padded = -(-group_sizes // block) * block
    start = jnp.cumsum(group_sizes) - group_sizes  # first row of each group in x
    pstart = jnp.cumsum(padded) - padded  # first row of each group in the padded layout
    rows = jnp.arange(m)
    grp = jnp.searchsorted(jnp.cumsum(group_sizes), rows, side="right")  # G for rows past the sum
    valid = grp < g
    grp = jnp.minimum(grp, g - 1)
    dest = jnp.where(valid, pstart[grp] + rows - start[grp], n_blocks * block)
    xp = jnp.zeros((n_blocks * block, x.shape[1]), x.dtype).at[dest].set(x, mode="drop")
    block_group = jnp.searchsorted(jnp.cumsum(padded), jnp.arange(n_blocks) * block, side="right")
    wb = w[jnp.minimum(block_group, g - 1)]  # [blocks, K, N]
    yp = jnp.einsum("jbk,jkn->jbn", xp.reshape(n_blocks, block, -1), wb).reshape(n_blocks * block, -1)
    return jnp.where(valid[:, None], yp[jnp.minimum(dest, n_blocks * block - 1)], 0).astype(x.dtype)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def gmm_tiling(m: int, k: int, n: int) -> tuple[int, int, int]:
    """(tm, tk, tn) for megablox over x `[m, k]`, w `[G, k, n]`, k and n multiples of 128.

    megablox's backward reuses the tiling with k and n swapped (dx = gmm(dy, w^T): its k is n),
    so tk = tn: the largest of 512/256/128 dividing both (Mosaic blocks: multiples of 128 in the
    lane dimension). tm <= 512 rows, a multiple of 16 (bf16 sublane pairs); m is padded up to a
    multiple of it. Each group boundary inside a row tile costs that tile once more, so tm
    trades per-tile overhead against up to G * tm extra rows."""
    t = next(s for s in (512, 256, 128) if k % s == 0 and n % s == 0)
    return min(512, _round_up(m, 16)), t, t


def megablox_grouped_matmul(x, w, group_sizes, interpret: bool = False, tiling=None,
                            mask_rows: bool = True):
    """Grouped matmul with the Pallas megablox kernels (TPU; `interpret=True` runs them on CPU).

    x `[M, K]` rows sorted by group, w `[G, K, N]`, group_sizes `[G]` (sum <= M) -> `[M, N]`
    in x.dtype, zero in rows past sum(group_sizes). The custom VJP computes dx with `gmm`
    against w^T and dw with `tgmm` (each group's rows^T x its output cotangent): both cost the
    routed rows only, where XLA:TPU's ragged_dot gradient w.r.t. w is a masked dense product
    of every group with every row.

    tiling None: K and N are zero-padded to multiples of 128 (a no-op for real model widths)
    and M to a multiple of tm (`gmm_tiling`). An explicit (tm, tk, tn) is used as given, with
    only M padded (interpret mode accepts any tiling; tests use small tiles).

    megablox leaves rows past the last group uninitialised (forward: output rows; backward: dx
    rows, written by the same kernel), so both x and the result are masked with `where` (a
    product with 0 would keep NaN/inf garbage). mask_rows=False leaves both to the caller, who
    must never read those rows of the result and must zero those rows of x's cotangent (a
    `where` on x where it is gathered): each mask is a pass over an `[M, K]` buffer, forward,
    in the remat forward and transposed in the backward, and the MoE's own gathers and
    combine already select rows (`sorted_ffn`, `_ragged_local`). tgmm selects its rows, so
    garbage rows never reach the weight gradient.
    """
    from jax.experimental.pallas.ops.tpu.megablox import gmm

    (m, k), n = x.shape, w.shape[2]
    kp, n_p = (k, n) if tiling else (_round_up(k, 128), _round_up(n, 128))
    tm, tk, tn = tiling or gmm_tiling(m, kp, n_p)
    group_sizes = group_sizes.astype(jnp.int32)
    valid = (jnp.arange(m) < jnp.sum(group_sizes))[:, None]
    xp = jnp.pad(jnp.where(valid, x, 0) if mask_rows else x, ((0, -m % tm), (0, kp - k)))
    wp = jnp.pad(w.astype(x.dtype), ((0, 0), (0, kp - k), (0, n_p - n)))
    y = gmm(xp, wp, group_sizes, preferred_element_type=x.dtype, tiling=(tm, tk, tn),
            interpret=interpret)[:m, :n]
    return jnp.where(valid, y, 0) if mask_rows else y


def gpu_grouped_matmul(x, w, group_sizes, mask_rows: bool = True):
    """coder.pallas.grouped_matmul_gpu.gmm in x's dtype; with mask_rows, rows past
    sum(group_sizes) zeroed (the kernel leaves them unwritten)."""
    y = grouped_matmul_gpu.gmm(x, w.astype(x.dtype), group_sizes.astype(jnp.int32))
    if not mask_rows:
        return y
    return jnp.where((jnp.arange(x.shape[0]) < jnp.sum(group_sizes))[:, None], y, 0)


def grouped_matmul(x, w, group_sizes, mask_rows: bool = True):
    """megablox `gmm` on TPU (`megablox_grouped_matmul`), coder's Triton kernels on CUDA GPUs
    (`gpu_grouped_matmul`), the block-padded form elsewhere (CPU). mask_rows=False: rows past
    sum(group_sizes) of the result are unspecified (the kernels' contract with their caller,
    `megablox_grouped_matmul`); the block form gives zeros there.

    Not `jax.lax.ragged_dot` on GPU: XLA rewrites a ragged dot into a dense product of every row
    with every group (xla/hlo/transforms/expanders/ragged_dot_rewriter.cc) unless the
    experimental cuDNN fusion is switched on (`--xla_gpu_experimental_use_ragged_dot_fusion`),
    G times the routed FLOPs and a [G, M, K] copy of x (64 experts: 64x); on an H100 the ~1B
    MoE trained at 1.9% MFU that way (docs/accelerator.md). Nor the block-padded form there:
    it gathers a copy of the weight for every row block (`[blocks, K, N]`, kept for the
    backward) and scatters the rows into padded blocks and back, 3 x 34 GB of the ~1B MoE's
    step on an H100 (docs/scale/moe_1b_h100 before the kernels). `bench/accelerator.py`'s part
    moe times the forms side by side.

    w may be `Quantized` (a quantized engine's experts): on TPU coder.pallas.quantized_matmul
    reads it in its narrow form; elsewhere it is dequantized first (as coder.model.quantized.
    value_of does, so a CPU engine reproduces its dequantized reference bit for bit).

    The choice is made when the program is lowered for its platform (`platform_dependent`),
    not from the process's default backend: stage `compile` lowers for TPU from a CPU host. A
    program whose platform is known while tracing (`sharding.platform_dependent`) traces its
    form alone.
    """
    if isinstance(w, Quantized):  # a quantized engine's experts: the TPU kernel reads them narrow
        dequantized = lambda x, w, gs: grouped_matmul(x, as_dtype(w, x.dtype), gs, mask_rows)  # noqa: E731
        return sharding.platform_dependent(x, w, group_sizes, tpu=lambda x, w, gs: quantized_matmul.gmm(
            x, w.values, w.scale, gs), default=dequantized)
    # any K / N: megablox_grouped_matmul pads them to Mosaic's 128 lanes (tiny models included)
    tpu = functools.partial(megablox_grouped_matmul, mask_rows=mask_rows)
    cuda = functools.partial(gpu_grouped_matmul, mask_rows=mask_rows)
    return sharding.platform_dependent(x, w, group_sizes, tpu=tpu, cuda=cuda, default=block_grouped_matmul)
