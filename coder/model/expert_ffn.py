"""The local expert computation: SwiGLU experts over the (token, expert) pairs whose expert a
device holds (all of them without expert parallelism) -> the pairs' weighted sum per token.

Dropless (default, `grouped_ffn`): the N*k (token, expert) pairs are sorted by expert and run
through a grouped matmul over contiguous groups (`sorted_ffn`; coder.model.grouped_matmul), then
scattered back and summed; no token dropped. Few tokens x local experts on CPU (decoding) run
every local expert on every token instead (`dense_ffn`).
Capacity (model.moe_capacity_factor = c > 0, `capacity_ffn`): each expert takes its first
ceil(c * N*k / E) pairs in token order into a fixed `[experts, capacity, D]` buffer (GShard);
later pairs are dropped and counted (stats["dropped"]); its matmuls are ordinary batched ones.
`local_experts_ffn` picks one of the two; under expert parallelism coder.model.expert_dispatch
runs it on each device.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from coder.model import sharding
from coder.model.grouped_matmul import grouped_matmul
from coder.model.quantized import as_dtype, operand


DENSE_FFN_MAX = 512  # tokens x local experts up to which CPU runs every expert on every token


def dense_ffn(x, ids, weights, wg, wu, wd, first_expert=0):
    """`grouped_ffn`'s result with every local expert run on every token, each token keeping its
    routed experts' outputs: N * El expert FFNs instead of N * k, and no sort, gather or scatter.
    On CPU that is the fastest form when N * El is small (decoding a few rows), where the
    sorted form's dozens of tiny ops cost more than the matmuls. Shapes as `grouped_ffn`."""
    n, n_local = x.shape[0], wg.shape[0]
    local = ids - first_expert
    slot = jnp.where((local >= 0) & (local < n_local), local, n_local)  # n_local: dropped
    combine = jnp.zeros((n, n_local), jnp.float32).at[jnp.arange(n)[:, None], slot].add(weights, mode="drop")
    dt = x.dtype
    h = jax.nn.silu(jnp.einsum("nd,edf->nef", x, as_dtype(wg, dt))) * jnp.einsum("nd,edf->nef", x, as_dtype(wu, dt))
    y = jnp.einsum("nef,efd->ned", h, as_dtype(wd, dt)).astype(jnp.float32)
    return jnp.einsum("ned,ne->nd", y, combine).astype(dt)


def grouped_ffn(x, ids, weights, wg, wu, wd, first_expert=0, all_local: bool = False):
    """Dropless SwiGLU experts for the (token, expert) pairs whose expert is local.

    x `[N, D]`, ids/weights `[N, k]`, wg/wu `[El, D, F]`, wd `[El, F, D]` hold experts
    first_expert .. first_expert+El-1. Returns `sum_j weights_j * FFN_{ids_j}(x)` over the local
    pairs, `[N, D]` in x.dtype. all_local: every expert is here (no expert parallelism), so
    every pair is local. Otherwise pairs of other experts are sorted past the last group; those
    rows are zeroed on the way in and dropped on the way out (the grouped matmul leaves them
    unspecified). With N * El <= DENSE_FFN_MAX the CPU lowering is `dense_ffn` (decoding);
    other platforms always take the sorted form.
    """
    sorted_form = functools.partial(sorted_ffn, first_expert=first_expert, all_local=all_local)
    if x.shape[0] * wg.shape[0] <= DENSE_FFN_MAX:
        return sharding.platform_dependent(x, ids, weights, wg, wu, wd, cpu=functools.partial(
            dense_ffn, first_expert=first_expert), default=sorted_form)
    return sorted_form(x, ids, weights, wg, wu, wd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def dispatch_rows(x, order, inverse, k: int):
    """The pairs' rows in sorted order: xs `[N*k, D]`, xs[i] = x[order[i] // k], for x `[N, D]`,
    order `[N*k]` a permutation of the pairs (token-major: pair p is token p // k's) and inverse
    its inverse. Its cotangent is a gather as well (each token's k rows summed, found through
    `inverse`), where JAX's transpose of the gather is a scatter-add of `[N*k, D]` rows."""
    return x[order // k]


def _dispatch_fwd(x, order, inverse, k):
    return x[order // k], inverse


def _dispatch_bwd(k, inverse, dxs):
    n = inverse.shape[0] // k
    dx = dxs[inverse].reshape(n, k, -1).astype(jnp.float32).sum(1)
    return dx.astype(dxs.dtype), None, None


dispatch_rows.defvjp(_dispatch_fwd, _dispatch_bwd)


@jax.custom_vjp
def combine_rows(ys, weights, order, inverse):
    """Each token's weighted sum of its pairs' rows: y `[N, D]` float32, y[n] = sum_j
    weights[n, j] * ys[inverse[n*k + j]], for ys `[N*k, D]` in sorted order, weights `[N, k]`,
    order / inverse as `dispatch_rows`. A gather and a sum where the scatter-add form
    (`zeros.at[token].add(ys)`) writes float32 `[N*k, D]` rows, forward and backward."""
    n, k = weights.shape
    return jnp.einsum("nkd,nk->nd", ys[inverse].reshape(n, k, -1).astype(jnp.float32), weights)


def _combine_fwd(ys, weights, order, inverse):
    return combine_rows(ys, weights, order, inverse), (ys, weights, order, inverse)


def _combine_bwd(res, dy):
    ys, weights, order, inverse = res
    n, k = weights.shape
    # [N*k, D]: each pair's token's cotangent in sorted order, gathered in ys' dtype (the rows
    # it makes are in that dtype: a float32 gather read twice the bytes)
    dy_rows = dy.astype(ys.dtype)[order // k].astype(jnp.float32)
    dys = (dy_rows * weights.reshape(-1)[order][:, None]).astype(ys.dtype)
    # each pair's gate cotangent in sorted order (one pass over ys, fused with dys), then its place
    dweights = jnp.sum(dy_rows * ys.astype(jnp.float32), axis=-1)[inverse].reshape(n, k)
    return dys, dweights.astype(weights.dtype), None, None


combine_rows.defvjp(_combine_fwd, _combine_bwd)


def sorted_ffn(x, ids, weights, wg, wu, wd, first_expert=0, all_local: bool = False):
    """`grouped_ffn` by sorting the pairs by expert and one grouped matmul per projection.
    all_local: gathers in and out (`dispatch_rows`, `combine_rows`), no masks; otherwise the
    pairs of other experts' rows are masked in and out and the sum is a scatter-add."""
    n, k = ids.shape
    n_local = wg.shape[0]
    dt = x.dtype

    def experts(xs, group_sizes):
        h = jax.nn.silu(grouped_matmul(xs, operand(wg, dt), group_sizes, mask_rows=False)) * grouped_matmul(
            xs, operand(wu, dt), group_sizes, mask_rows=False)
        return grouped_matmul(h, operand(wd, dt), group_sizes, mask_rows=False)  # [N*k, D]

    if all_local:
        key = ids.reshape(-1)
        order = jnp.argsort(key, stable=True)  # [N*k]
        inverse = jnp.zeros_like(order).at[order].set(jnp.arange(n * k, dtype=order.dtype))
        group_sizes = jnp.bincount(key, length=n_local).astype(jnp.int32)
        ys = experts(dispatch_rows(x, order, inverse, k), group_sizes)
        return combine_rows(ys, weights, order, inverse).astype(dt)
    local = ids.reshape(-1) - first_expert
    is_local = (local >= 0) & (local < n_local)
    key = jnp.where(is_local, local, n_local)
    order = jnp.argsort(key, stable=True)  # [N*k]
    group_sizes = jnp.bincount(key, length=n_local + 1)[:n_local].astype(jnp.int32)
    token = order // k
    local_rows = is_local[order][:, None]  # [N*k, 1]: the rows of the local groups come first
    # rows past the local groups: zero, so their (unspecified) cotangent never reaches dx
    xs = jnp.where(local_rows, x[token], 0)  # [N*k, D]
    y = experts(xs, group_sizes)
    w = jnp.where(local_rows[:, 0], weights.reshape(-1)[order], 0.0)
    y = jnp.where(local_rows, y.astype(jnp.float32) * w[:, None], 0.0)
    return jnp.zeros((n, x.shape[1]), jnp.float32).at[token].add(y).astype(dt)


def expert_capacity(pairs: int, n_experts: int, factor: float) -> int:
    """Pairs each expert takes of `pairs` (token, expert) pairs: ceil(factor * pairs / experts),
    rounded up to a multiple of 8 (sublane tiles), at most `pairs`."""
    c = -(-int(factor * pairs) // n_experts)
    return max(8, min(pairs, -(-c // 8) * 8))


def capacity_ffn(x, ids, weights, wg, wu, wd, capacity: int, first_expert=0):
    """SwiGLU experts with a fixed buffer of `capacity` pairs per local expert (GShard).

    x `[N, D]`, ids/weights `[N, k]`, wg/wu `[El, D, F]`, wd `[El, F, D]` hold experts
    first_expert .. first_expert+El-1. Each local expert takes its first `capacity` pairs in
    token order; later pairs are dropped (no contribution). Returns (`sum_j weights_j *
    FFN_{ids_j}(x)` over the kept local pairs `[N, D]` in x.dtype, dropped local pairs per
    token `[N]` float32). The matmuls are dense `[El, capacity, D] x [El, D, F]`.
    """
    n, k = ids.shape
    n_local = wg.shape[0]
    local = ids.reshape(-1) - first_expert  # [N*k] in token order
    is_local = (local >= 0) & (local < n_local)
    e = jnp.where(is_local, local, 0)
    onehot = jax.nn.one_hot(e, n_local, dtype=jnp.int32) * is_local[:, None].astype(jnp.int32)
    rank = jnp.take_along_axis(jnp.cumsum(onehot, axis=0), e[:, None], axis=1)[:, 0] - 1
    kept = is_local & (rank < capacity)
    slot = jnp.where(kept, e * capacity + rank, n_local * capacity)  # past the end: dropped
    token = jnp.arange(n * k) // k
    dt = x.dtype
    buf = jnp.zeros((n_local * capacity, x.shape[1]), dt).at[slot].set(x[token], mode="drop")
    buf = buf.reshape(n_local, capacity, -1)
    h = jax.nn.silu(jnp.einsum("ecd,edf->ecf", buf, as_dtype(wg, dt))) * jnp.einsum(
        "ecd,edf->ecf", buf, as_dtype(wu, dt))
    y = jnp.einsum("ecf,efd->ecd", h, as_dtype(wd, dt)).reshape(n_local * capacity, -1)
    w = jnp.where(kept, weights.reshape(-1), 0.0)
    y_pairs = y[jnp.minimum(slot, n_local * capacity - 1)].astype(jnp.float32) * w[:, None]
    out = jnp.zeros((n, x.shape[1]), jnp.float32).at[token].add(y_pairs).astype(dt)
    dropped = (is_local & ~kept).astype(jnp.float32).reshape(n, k).sum(-1)
    return out, dropped


def local_experts_ffn(x, ids, weights, wg, wu, wd, first_expert, capacity_factor: float, n_experts: int):
    """Dropless (`grouped_ffn`) or capacity-bounded (`capacity_ffn`) experts -> (y, dropped)."""
    if capacity_factor > 0:
        cap = expert_capacity(ids.size, n_experts, capacity_factor)
        return capacity_ffn(x, ids, weights, wg, wu, wd, cap, first_expert)
    all_local = isinstance(first_expert, int) and first_expert == 0 and wg.shape[0] == n_experts
    y = grouped_ffn(x, ids, weights, wg, wu, wd, first_expert, all_local)
    return y, jnp.zeros(x.shape[:1], jnp.float32)
