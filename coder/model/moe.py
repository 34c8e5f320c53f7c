"""DeepSeek-V3 mixture of experts: sigmoid router, aux-loss-free bias, dropless grouped matmuls.

Routing for token x (DeepSeek-V3 section 2.1.2), N tokens, E experts, k = num_experts_per_tok:
    s      = sigmoid(x W_r)                         [N, E]   scores (float32)
    c      = s + b                                  bias b (RouterBias) only for *selection*
    group score = sum of the top-2 c in each of n_group groups; keep the topk_group best groups
    ids    = top-k of c over the kept groups        [N, k]
    g      = s[ids] / sum s[ids]  (norm_topk_prob)  * routed_scaling_factor
    y      = sum_j g_j FFN_{ids_j}(x) + sum_shared FFN_shared(x)
Balancing (aux-loss-free): after each optimizer step, b += rate * sign(mean load - load).

Dropless dispatch (default): the N*k (token, expert) pairs are sorted by expert and run through a
grouped matmul over contiguous groups (`grouped_matmul`: the Pallas megablox kernels on TPU,
`jax.lax.ragged_dot` on GPU, a block-padded einsum on CPU), then scattered back and summed; no
token dropped. megablox's backward is a grouped matmul too (`tgmm` for the weight gradient), so
forward and backward cost the routed pairs only; XLA:TPU's own ragged_dot gradient w.r.t. the
expert weights is a dense masked product of every expert with every pair (docs/scale/README.md).
Capacity dispatch (model.moe_capacity_factor = c > 0, `capacity_ffn`): each expert takes its first
ceil(c * N*k / E) pairs in token order into a fixed `[experts, capacity, D]` buffer (GShard);
later pairs are dropped and counted (stats["dropped"]); its matmuls are ordinary batched ones.

Expert parallelism: inside `coder.model.sharding.activate` with experts split over mesh axes,
the expert FFN runs in a `shard_map`. Each device holds E/ep experts; it gathers the tokens of
its expert group (all-gather over the mesh axes that shard both tokens and experts), computes its
own experts' share of every pair, and a reduce-scatter (psum_scatter) returns each token's sum
to its owner. This padded, all-gather form runs on every backend (CPU included); on TPU/GPU
`jax.lax.ragged_all_to_all` would move only the routed pairs (not implemented here).
"""
from __future__ import annotations


import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from coder.model import sharding
from coder.model.config import routing_errors
from coder.model.layers import MLP, dtype_of, param


class RouterBias(nnx.Variable):
    """Expert-selection bias: updated by `update_router_bias`, never by the optimizer."""


# ----------------------------------------------------------------------------- routing
def balancing_warning(cfg, steps: int) -> str:
    """Why aux-loss-free balancing cannot keep up in a from-scratch run of `steps` steps ("" if
    it can).

    The bias moves bias_update_rate per step (a sign update) and must cancel the score gaps
    the router learns between experts (sigmoid scores in (0, 1)); early in training the hidden
    states share one direction, so such a gap routes every token to the same top-k experts.
    A bias that cannot move by 1 over the run cannot undo an arbitrary gap: e.g. the quickstart's
    150 steps at DeepSeek-V3's 1e-3 (tuned for a run of ~10^5 steps) left every token of every
    MoE layer on 2 of 4 experts (load_imbalance 2.00 = E/k) for the whole pretraining.
    """
    moe = cfg.n_routed_experts > 0 and (cfg.num_hidden_layers > cfg.first_k_dense_replace
                                        or cfg.num_mtp_layers > 0)
    rate = float(cfg.bias_update_rate)
    if not moe or rate * steps >= 1.0:
        return ""
    return (f"model.bias_update_rate={rate:g} x {steps} steps moves the router bias by at most "
            f"{rate * steps:.2g}, less than the sigmoid scores' range (1): routing may collapse onto "
            f"{cfg.num_experts_per_tok} of {cfg.n_routed_experts} experts (load_imbalance "
            f"{cfg.n_routed_experts / cfg.num_experts_per_tok:.2f}); raise model.bias_update_rate "
            f"to >= {1.0 / max(steps, 1):.2g}")


def route(logits, bias, cfg, expert_ids=None):
    """Top-k expert choice. logits `[N, E]` float32, bias `[E]`.

    Returns (weights `[N, k]` float32, ids `[N, k]` int32). With `expert_ids` given (router
    replay) the choice is taken from them and only the weights are recomputed.
    """
    n, e = logits.shape
    scores = jax.nn.sigmoid(logits)
    if expert_ids is None:
        choice = scores + bias.astype(jnp.float32)[None]
        if cfg.n_group > 1:
            grouped = choice.reshape(n, cfg.n_group, e // cfg.n_group)
            group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [N, n_group]
            _, top_groups = jax.lax.top_k(group_scores, cfg.topk_group)
            keep = jnp.zeros((n, cfg.n_group), bool).at[jnp.arange(n)[:, None], top_groups].set(True)
            keep = jnp.repeat(keep, e // cfg.n_group, axis=1)
            choice = jnp.where(keep, choice, -jnp.inf)
        _, ids = jax.lax.top_k(choice, cfg.num_experts_per_tok)
    else:
        ids = expert_ids.reshape(n, -1)
    ids = ids.astype(jnp.int32)
    weights = jnp.take_along_axis(scores, ids, axis=1)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, ids


def load_fraction(ids, valid, n_experts: int):
    """Fraction of the valid tokens' top-k assignments per expert `[E]` (sums to 1)."""
    counts = jnp.zeros((n_experts,), jnp.float32).at[ids.reshape(-1)].add(
        jnp.repeat(valid.reshape(-1).astype(jnp.float32), ids.shape[-1]))
    return counts / jnp.maximum(counts.sum(), 1.0)


# ----------------------------------------------------------------------------- experts
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


def _tile(dim: int, sizes=(512, 256, 128)) -> int:
    """The largest of `sizes` dividing dim, else dim itself (a block spanning the whole axis
    satisfies Mosaic's (8, 128) block rule for any size)."""
    return next((s for s in sizes if dim % s == 0), dim)


def gmm_tiling(m: int, k: int, n: int) -> tuple[int, int, int]:
    """(tm, tk, tn) for megablox over x `[m, k]`, w `[G, k, n]`: tk / tn divide k / n (megablox
    masks a ragged k tile but not a ragged n tile); tm <= 512 rows, a multiple of 16 (bf16
    sublane pairs), and m is padded up to a multiple of it. Each group boundary inside a row
    tile costs that tile once more, so tm trades per-tile overhead against G * tm wasted rows."""
    tm = min(512, -(-m // 16) * 16)
    return tm, _tile(k), _tile(n)


def megablox_grouped_matmul(x, w, group_sizes, interpret: bool = False, tiling=None):
    """Grouped matmul with the Pallas megablox kernels (TPU; `interpret=True` runs them on CPU).

    x `[M, K]` rows sorted by group, w `[G, K, N]`, group_sizes `[G]` (sum <= M) -> `[M, N]`
    in x.dtype, zero in rows past sum(group_sizes). The custom VJP computes dx with `gmm`
    against w^T and dw with `tgmm` (each group's rows^T x its output cotangent): both cost the
    routed rows only, where XLA:TPU's ragged_dot gradient w.r.t. w is a masked dense product
    of every group with every row. tiling (tm, tk, tn) defaults to `gmm_tiling`.

    megablox leaves rows past the last group uninitialised (forward: output rows; backward: dx
    rows, written by the same kernel), so both x and the result are masked with `where` (a
    product with 0 would keep NaN/inf garbage).
    """
    from jax.experimental.pallas.ops.tpu.megablox import gmm

    m, k = x.shape
    tm, tk, tn = tiling or gmm_tiling(m, k, w.shape[2])
    group_sizes = group_sizes.astype(jnp.int32)
    valid = (jnp.arange(m) < jnp.sum(group_sizes))[:, None]
    xp = jnp.pad(jnp.where(valid, x, 0), ((0, -m % tm), (0, 0)))  # megablox needs tm | M
    y = gmm(xp, w.astype(x.dtype), group_sizes, preferred_element_type=x.dtype,
            tiling=(tm, tk, tn), interpret=interpret)[:m]
    return jnp.where(valid, y, 0)


def grouped_matmul(x, w, group_sizes):
    """megablox `gmm` on TPU (`megablox_grouped_matmul`), `jax.lax.ragged_dot` on GPU, the
    block-padded form on CPU, where XLA lowers ragged_dot to a dense product with every group.

    The choice is made when the program is lowered for its platform (`platform_dependent`),
    not from the process's default backend: stage `compile` lowers for TPU from a CPU host.
    """
    return jax.lax.platform_dependent(x, w, group_sizes, tpu=megablox_grouped_matmul,
                                      cpu=block_grouped_matmul, default=jax.lax.ragged_dot)


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
    h = jax.nn.silu(jnp.einsum("nd,edf->nef", x, wg.astype(dt))) * jnp.einsum("nd,edf->nef", x, wu.astype(dt))
    y = jnp.einsum("nef,efd->ned", h, wd.astype(dt)).astype(jnp.float32)
    return jnp.einsum("ned,ne->nd", y, combine).astype(dt)


def grouped_ffn(x, ids, weights, wg, wu, wd, first_expert=0):
    """Dropless SwiGLU experts for the (token, expert) pairs whose expert is local.

    x `[N, D]`, ids/weights `[N, k]`, wg/wu `[El, D, F]`, wd `[El, F, D]` hold experts
    first_expert .. first_expert+El-1. Returns `sum_j weights_j * FFN_{ids_j}(x)` over the local
    pairs, `[N, D]` in x.dtype. Pairs of other experts are sorted past the last group, where
    the grouped matmul produces zeros. With N * El <= DENSE_FFN_MAX the CPU lowering is
    `dense_ffn` (decoding); other platforms always take the sorted form.
    """
    if x.shape[0] * wg.shape[0] <= DENSE_FFN_MAX:
        return jax.lax.platform_dependent(x, ids, weights, wg, wu, wd, cpu=functools.partial(
            dense_ffn, first_expert=first_expert), default=functools.partial(
            sorted_ffn, first_expert=first_expert))
    return sorted_ffn(x, ids, weights, wg, wu, wd, first_expert)


def sorted_ffn(x, ids, weights, wg, wu, wd, first_expert=0):
    """`grouped_ffn` by sorting the pairs by expert and one grouped matmul per projection."""
    n, k = ids.shape
    n_local = wg.shape[0]
    local = ids.reshape(-1) - first_expert
    is_local = (local >= 0) & (local < n_local)
    key = jnp.where(is_local, local, n_local)
    order = jnp.argsort(key, stable=True)  # [N*k]
    group_sizes = jnp.bincount(key, length=n_local + 1)[:n_local].astype(jnp.int32)
    token = order // k
    xs = x[token]  # [N*k, D]
    dt = x.dtype
    h = jax.nn.silu(grouped_matmul(xs, wg.astype(dt), group_sizes)) * grouped_matmul(
        xs, wu.astype(dt), group_sizes)
    y = grouped_matmul(h, wd.astype(dt), group_sizes)  # [N*k, D]
    w = jnp.where(is_local[order], weights.reshape(-1)[order], 0.0)
    y = jnp.where(is_local[order][:, None], y.astype(jnp.float32) * w[:, None], 0.0)
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
    h = jax.nn.silu(jnp.einsum("ecd,edf->ecf", buf, wg.astype(dt))) * jnp.einsum(
        "ecd,edf->ecf", buf, wu.astype(dt))
    y = jnp.einsum("ecf,efd->ecd", h, wd.astype(dt)).reshape(n_local * capacity, -1)
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
    y = grouped_ffn(x, ids, weights, wg, wu, wd, first_expert)
    return y, jnp.zeros(x.shape[:1], jnp.float32)


def _expert_parallel_ffn(x, ids, weights, wg, wu, wd, mesh, rules, capacity_factor=0.0):
    """local_experts_ffn over the mesh: experts split on the `exp` axes, F on the `exp_mlp` axes.

    x `[B, T, D]`, ids/weights `[B, T, k]`; returns (`[B, T, D]`, dropped pairs per token
    `[B, T]`). With a capacity, each device's experts take their share of the pairs it sees.
    """
    b, t = x.shape[:2]
    tok_axes = _dividing(mesh, sharding.mesh_axes_of("batch", rules), b)
    # a decode step's single token (or a batch smaller than the data axes) cannot be split:
    # those axes then hold a replica of the tokens and compute the same expert sums
    seq_axes = _dividing(mesh, tuple(a for a in sharding.mesh_axes_of("seq", rules)
                                     if a not in tok_axes), t)
    exp_axes = sharding.mesh_axes_of("exp", rules)
    mlp_axes = tuple(a for a in sharding.mesh_axes_of("exp_mlp", rules) if a not in exp_axes)
    token_sharded = set(tok_axes) | set(seq_axes)
    gather = tuple(a for a in exp_axes if a in token_sharded)  # token shards to collect
    reduce = tuple(a for a in exp_axes if a not in token_sharded) + mlp_axes
    spec = lambda axes: (axes if len(axes) > 1 else axes[0]) if axes else None
    tok_spec = P(spec(tok_axes), spec(seq_axes), None)
    w_in = P(spec(exp_axes), None, spec(mlp_axes))
    w_out = P(spec(exp_axes), spec(mlp_axes), None)
    n_local = wg.shape[0] // max(1, _size(mesh, exp_axes))

    def local(x, ids, weights, wg, wu, wd):
        b, t, d = x.shape
        xs, i, w = x.reshape(b * t, d), ids.reshape(b * t, -1), weights.reshape(b * t, -1)
        if gather:
            xs = jax.lax.all_gather(xs, gather, axis=0, tiled=True)
            i = jax.lax.all_gather(i, gather, axis=0, tiled=True)
            w = jax.lax.all_gather(w, gather, axis=0, tiled=True)
        first = jax.lax.axis_index(exp_axes) * n_local if exp_axes else 0
        n_experts = wg.shape[0] * max(1, _size(mesh, exp_axes))
        y, dropped = local_experts_ffn(xs, i, w, wg, wu, wd, first, capacity_factor, n_experts)
        y = y.astype(jnp.float32)
        if reduce:
            y = jax.lax.psum(y, reduce)
        if gather:
            y = jax.lax.psum_scatter(y, gather, scatter_dimension=0, tiled=True)
        if capacity_factor > 0:
            # each pair lives on one expert shard; F-split (exp_mlp) shards drop the same pairs
            if exp_axes and (set(exp_axes) - token_sharded):
                dropped = jax.lax.psum(dropped, tuple(a for a in exp_axes if a not in token_sharded))
            if gather:
                dropped = jax.lax.psum_scatter(dropped, gather, scatter_dimension=0, tiled=True)
        else:  # dropless: no collectives for a count that is zero
            dropped = jnp.zeros((b * t,), jnp.float32)
        return y.reshape(b, t, d).astype(x.dtype), dropped.reshape(b, t)

    fn = jax.shard_map(local, mesh=mesh, in_specs=(tok_spec, tok_spec, tok_spec, w_in, w_in, w_out),
                       out_specs=(tok_spec, P(*tok_spec[:2])), check_vma=False)
    return fn(x, ids, weights, wg, wu, wd)


def _dividing(mesh, axes, n: int) -> tuple:
    """`axes` (a tuple of mesh axis names) if their total size divides n, else ()."""
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    return axes if n % _size(mesh, axes) == 0 else ()


def _size(mesh, axes):
    out = 1
    for a in axes:
        out *= mesh.shape[a]
    return out


# ----------------------------------------------------------------------------- module
class MoE(nnx.Module):
    """Routed + shared experts. x `[B,T,D]` -> (y `[B,T,D]`, stats)."""

    def __init__(self, cfg, rngs: nnx.Rngs):
        d, f, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts
        errors = routing_errors(cfg)
        if errors:
            raise ValueError("; ".join(errors))
        self.cfg = cfg
        self.router = param(rngs, (d, e), ("embed", None), cfg)
        self.bias = RouterBias(jnp.zeros((e,), jnp.float32), logical_axes=(None,))
        self.wg = param(rngs, (e, d, f), ("exp", "embed", "exp_mlp"), cfg)
        self.wu = param(rngs, (e, d, f), ("exp", "embed", "exp_mlp"), cfg)
        self.wd = param(rngs, (e, f, d), ("exp", "exp_mlp", "embed"), cfg)
        self.shared = MLP(cfg, f * cfg.n_shared_experts, rngs, axis="mlp") if cfg.n_shared_experts else None
        self.dtype = dtype_of(cfg.dtype)

    def __call__(self, x, valid, expert_ids=None):
        """x `[B,T,D]`, valid `[B,T]` bool (non-padding), expert_ids `[B,T,k]` to replay.

        stats: load `[E]`, expert_ids `[B,T,k]` int32 (the ids used: the replayed ones when
        given), router_ids `[B,T,k]` int32 (this router's own top-k on x: equal to expert_ids
        without replay; with replay, the choice replay overrode, one top-k over `[N, E]` scores
        already computed, dead code unless read), z (mean logsumexp(router logits)^2), and with
        model.moe_capacity_factor > 0 `dropped` (fraction of pairs over capacity).
        """
        b, t, d = x.shape
        cfg = self.cfg
        x = x.astype(self.dtype)
        logits = x.reshape(b * t, d).astype(jnp.float32) @ self.router[...].astype(jnp.float32)
        weights, ids = route(logits, self.bias[...], cfg, expert_ids)
        validf = valid.reshape(-1).astype(jnp.float32)
        z = (jax.nn.logsumexp(logits, axis=-1) ** 2 * validf).sum() / jnp.maximum(validf.sum(), 1.0)
        own = ids if expert_ids is None else route(logits, self.bias[...], cfg)[1]
        stats = dict(load=load_fraction(ids, valid, cfg.n_routed_experts),
                     expert_ids=ids.reshape(b, t, -1), router_ids=own.reshape(b, t, -1), z=z)
        ctx = sharding.current()
        distributed = ctx is not None and (
            _size(ctx[0], sharding.mesh_axes_of("exp", ctx[1])) > 1
            or _size(ctx[0], sharding.mesh_axes_of("exp_mlp", ctx[1])) > 1)
        cf = float(getattr(cfg, "moe_capacity_factor", 0.0))
        if distributed:
            y, dropped = _expert_parallel_ffn(x, ids.reshape(b, t, -1), weights.reshape(b, t, -1),
                                              self.wg[...], self.wu[...], self.wd[...], *ctx,
                                              capacity_factor=cf)
        else:
            y, dropped = local_experts_ffn(x.reshape(b * t, d), ids, weights, self.wg[...],
                                           self.wu[...], self.wd[...], 0, cf, cfg.n_routed_experts)
            y = y.reshape(b, t, d)
        if cf > 0:  # fraction of the valid tokens' (token, expert) pairs over capacity
            stats["dropped"] = (dropped.reshape(-1) * validf).sum() / jnp.maximum(
                validf.sum() * ids.shape[-1], 1.0)
        if self.shared is not None:
            y = y + self.shared(x)
        return y, stats


def moe_layers(model) -> list[MoE]:
    """The MoE modules of a model in forward order (trunk, then MTP modules). With
    model.scan_layers the stacked layers are one MoE whose variables are `[layers, ...]`."""
    out = []
    stack = getattr(model, "moe_stack", None)
    blocks = list(model.layers) + ([stack] if stack is not None else []) + list(getattr(model, "mtp", []))
    for layer in blocks:
        mlp = layer.block.mlp if hasattr(layer, "block") else layer.mlp
        if isinstance(mlp, MoE):
            out.append(mlp)
    return out


def _rows(moe: MoE) -> int:
    """Layers one MoE module holds: 1, or the stack's length."""
    return moe.bias.shape[0] if moe.bias.ndim == 2 else 1


def update_router_bias(model, router_load, rate: float, mtp_router_load=None) -> None:
    """b += rate * sign(mean_load - load) for every trunk MoE layer (and MTP layer if given).

    router_load `[moe_layers, E]` as in aux["router_load"]; mtp_router_load
    `[num_mtp_layers, E]` as in aux["mtp_router_load"]. Updates in place, outside the gradient.
    """
    layers = moe_layers(model)
    n_mtp = sum(1 for m in getattr(model, "mtp", []) if isinstance(m.block.mlp, MoE))
    trunk = layers[: len(layers) - n_mtp]
    n_trunk = sum(_rows(m) for m in trunk)
    if router_load.shape[0] != n_trunk:
        raise ValueError(f"router_load has {router_load.shape[0]} rows, the model {n_trunk} MoE layers")
    modules, loads, row = list(trunk), [], 0
    for moe in trunk:
        n = _rows(moe)
        loads.append(router_load[row] if moe.bias.ndim == 1 else router_load[row:row + n])
        row += n
    if mtp_router_load is not None:
        modules += layers[len(trunk):len(trunk) + mtp_router_load.shape[0]]
        loads += [mtp_router_load[i] for i in range(mtp_router_load.shape[0])]
    for moe, load in zip(modules, loads, strict=True):
        load = jnp.asarray(load, jnp.float32)
        moe.bias[...] = moe.bias[...] + rate * jnp.sign(load.mean(-1, keepdims=True) - load)
