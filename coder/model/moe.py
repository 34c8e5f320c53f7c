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
the expert FFN runs in a `shard_map`; each device holds E/ep experts. model.moe_dispatch picks how
pairs reach them (`_expert_parallel_ffn`; "auto" decides when the program is lowered):
- ragged_all_to_all (TPU/GPU; `_ragged_dispatch`): each device routes its own share of the
  tokens, sorts its pairs by destination device, and `jax.lax.ragged_all_to_all` sends only the
  routed pairs to their experts' devices and the results back. The receive buffer is static:
  the worst case (every pair of the expert group on one device) unless
  model.moe_a2a_buffer_factor bounds it (then overflowing pairs are dropped and counted).
- all_gather (CPU, whose XLA has no ragged-all-to-all; and always with a capacity factor;
  `_all_gather_dispatch`): each device gathers the tokens of its expert group (all-gather over
  the mesh axes that shard both tokens and experts), computes its own experts' share of every
  pair, and a reduce-scatter (psum_scatter) returns each token's sum to its owner: ep x the
  token traffic and ep x the sort / gather work of the ragged form.
"""
from __future__ import annotations


import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from coder.model import sharding
from coder.model.config import routing_errors
from coder.model.layers import MLP, dtype_of, param, weight


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
    """Top-k expert choice. logits `[..., E]` float32 (e.g. `[B, T, E]`), bias `[E]`.

    Returns (weights `[..., k]` float32, ids `[..., k]` int32). With `expert_ids` given (router
    replay) the choice is taken from them and only the weights are recomputed. Every op keeps
    the leading axes, so tokens split over a mesh stay split (flattening `[B, T]` with T split
    would make XLA replicate the routing on every device).
    """
    lead, e = logits.shape[:-1], logits.shape[-1]
    scores = jax.nn.sigmoid(logits)
    if expert_ids is None:
        choice = scores + bias.astype(jnp.float32)
        if cfg.n_group > 1:
            g = cfg.n_group
            grouped = choice.reshape(*lead, g, e // g)
            group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [..., n_group]
            _, top_groups = jax.lax.top_k(group_scores, cfg.topk_group)
            keep = jax.nn.one_hot(top_groups, g, dtype=jnp.bool_).any(-2)  # [..., n_group]
            keep = jnp.repeat(keep, e // g, axis=-1)
            choice = jnp.where(keep, choice, -jnp.inf)
        _, ids = jax.lax.top_k(choice, cfg.num_experts_per_tok)
    else:
        ids = expert_ids.reshape(*lead, -1)
    ids = ids.astype(jnp.int32)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, ids


def load_fraction(ids, valid, n_experts: int):
    """Fraction of the valid tokens' top-k assignments per expert `[E]` (sums to 1)."""
    weight = jnp.broadcast_to(valid.reshape(*ids.shape[:-1], 1), ids.shape).astype(jnp.float32)
    counts = jnp.zeros((n_experts,), jnp.float32).at[ids].add(weight)
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


def grouped_matmul(x, w, group_sizes, mask_rows: bool = True):
    """megablox `gmm` on TPU (`megablox_grouped_matmul`), `jax.lax.ragged_dot` on GPU, the
    block-padded form on CPU, where XLA lowers ragged_dot to a dense product with every group.
    mask_rows=False: rows past sum(group_sizes) of the result are unspecified (megablox's
    contract with its caller, `megablox_grouped_matmul`); the other two give zeros there.

    The choice is made when the program is lowered for its platform (`platform_dependent`),
    not from the process's default backend: stage `compile` lowers for TPU from a CPU host.
    """
    # any K / N: megablox_grouped_matmul pads them to Mosaic's 128 lanes (tiny models included);
    # ragged_dot has no vmap rule for an unbatched weight, so under the trainer's per-replica
    # vmap (train.reduce_grads_once) GPU takes the block-padded form
    gpu = block_grouped_matmul if sharding.vmapped_axis() else jax.lax.ragged_dot
    tpu = functools.partial(megablox_grouped_matmul, mask_rows=mask_rows)
    return jax.lax.platform_dependent(x, w, group_sizes, tpu=tpu, cpu=block_grouped_matmul, default=gpu)


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
    pairs, `[N, D]` in x.dtype. Pairs of other experts are sorted past the last group; those
    rows are zeroed on the way in and dropped on the way out (the grouped matmul leaves them
    unspecified). With N * El <= DENSE_FFN_MAX the CPU lowering is
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
    local_rows = is_local[order][:, None]  # [N*k, 1]: the rows of the local groups come first
    # rows past the local groups: zero, so their (unspecified) cotangent never reaches dx
    xs = jnp.where(local_rows, x[token], 0)  # [N*k, D]
    dt = x.dtype
    h = jax.nn.silu(grouped_matmul(xs, wg.astype(dt), group_sizes, mask_rows=False)) * grouped_matmul(
        xs, wu.astype(dt), group_sizes, mask_rows=False)
    y = grouped_matmul(h, wd.astype(dt), group_sizes, mask_rows=False)  # [N*k, D]
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


DISPATCHES = ("auto", "all_gather", "ragged_all_to_all")


def _expert_parallel_ffn(x, ids, weights, wg, wu, wd, mesh, rules, capacity_factor=0.0,
                         dispatch="auto", buffer_factor=0.0, ragged_a2a=jax.lax.ragged_all_to_all):
    """local_experts_ffn over the mesh: experts split on the `exp` axes, F on the `exp_mlp` axes.

    x `[B, T, D]`, ids/weights `[B, T, k]`; returns (`[B, T, D]`, dropped pairs per token
    `[B, T]`). With a capacity, each device's experts take their share of the pairs it sees
    (always the all-gather form). Dropless, `dispatch` (model.moe_dispatch) picks the form:
    "all_gather" (`_all_gather_dispatch`), "ragged_all_to_all" (`_ragged_dispatch`; XLA:CPU
    cannot compile it) or "auto": ragged on TPU/GPU, all-gather on CPU, chosen when the program
    is lowered (`platform_dependent`). buffer_factor and ragged_a2a: see `_ragged_dispatch`.
    """
    if dispatch not in DISPATCHES:
        raise ValueError(f"model.moe_dispatch={dispatch!r} must be one of {DISPATCHES}")
    ep = _size(mesh, sharding.mesh_axes_of("exp", rules))
    tok_axes, seq_axes, exp_axes, mlp_axes = _token_layout(mesh, rules, *x.shape[:2])
    if set(mlp_axes) & (set(tok_axes) | set(seq_axes)):
        dispatch = "all_gather"  # F split over axes that split the tokens too: gathered there
    if capacity_factor > 0 or ep == 1 or dispatch == "all_gather":
        return _all_gather_dispatch(x, ids, weights, wg, wu, wd, mesh, rules, capacity_factor)
    ragged = functools.partial(_ragged_dispatch, mesh=mesh, rules=rules,
                               buffer_factor=buffer_factor, ragged_a2a=ragged_a2a)
    if dispatch == "ragged_all_to_all":
        return ragged(x, ids, weights, wg, wu, wd)
    gather = functools.partial(_all_gather_dispatch, mesh=mesh, rules=rules)
    return jax.lax.platform_dependent(x, ids, weights, wg, wu, wd, cpu=gather, default=ragged)


def _token_layout(mesh, rules, b: int, t: int):
    """(token batch axes, token sequence axes, exp axes, exp_mlp-only axes) of x `[B, T, D]`."""
    tok_axes = _dividing(mesh, sharding.mesh_axes_of("batch", rules), b)
    # a decode step's single token (or a batch smaller than the data axes) cannot be split:
    # those axes then hold a replica of the tokens and compute the same expert sums
    seq_axes = _dividing(mesh, tuple(a for a in sharding.mesh_axes_of("res_seq", rules)
                                     if a not in tok_axes), t)
    exp_axes = sharding.mesh_axes_of("exp", rules)
    mlp_axes = tuple(a for a in sharding.mesh_axes_of("exp_mlp", rules) if a not in exp_axes)
    return tok_axes, seq_axes, exp_axes, mlp_axes


def _spec(axes):
    return (axes if len(axes) > 1 else axes[0]) if axes else None


def _all_gather_dispatch(x, ids, weights, wg, wu, wd, mesh, rules, capacity_factor=0.0):
    """Expert parallelism by all-gathering tokens: every device computes its experts' share of
    every pair of its expert group and psum / psum_scatter return the sums (all backends).
    Shapes as `_expert_parallel_ffn`."""
    b, t = x.shape[:2]
    tok_axes, seq_axes, exp_axes, mlp_axes = _token_layout(mesh, rules, b, t)
    token_sharded = set(tok_axes) | set(seq_axes)
    # axes splitting both the tokens and the experts (or their F): collect those token shards,
    # and return each shard's sum with psum_scatter; axes splitting only the weights: psum
    gather = tuple(a for a in exp_axes + mlp_axes if a in token_sharded)
    reduce = tuple(a for a in exp_axes + mlp_axes if a not in token_sharded)
    spec = _spec
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


def _ragged_dispatch(x, ids, weights, wg, wu, wd, mesh, rules, buffer_factor=0.0,
                     ragged_a2a=jax.lax.ragged_all_to_all):
    """Dropless expert parallelism moving only the routed pairs (`jax.lax.ragged_all_to_all`).

    Shapes as `_expert_parallel_ffn`. Each device takes its own share of the tokens (its slice
    along the exp axes that replicate them), sorts its (token, expert) pairs by expert (so by
    destination device), and all-gathers every device's per-expert pair counts `[ep, E]`
    (ep * E int32: from them each device derives every send / receive size and offset without
    a round trip). One ragged_all_to_all sends the pairs' rows; the receiver permutes them into
    local-expert order, runs the grouped matmuls, permutes back, and a second ragged_all_to_all
    returns the `[pairs, D]` results, which the owner weights and sums per token; an all-gather
    over the replicating exp axes restores the replication. exp_mlp (F) shards each compute a
    partial sum of the same pairs: one psum of the `[tokens, D]` result.

    The receive buffer has a static row count R. buffer_factor = 0 (model.moe_a2a_buffer_factor)
    makes it the worst case, every pair of the expert group on one device: R = share * k * ep
    rows for share tokens per device, so x and the FFN activations are ep times the average
    load (e.g. ep=64, 4096 tokens, k=8, D=7168 bf16: 28 GiB per buffer: too much at scale).
    f > 0 sets R = min(worst case, ceil(f * share * k)); pairs past a receiver's R rows
    (sources in device order, experts in order within a source) are not sent and count as
    dropped (returned per token, stats["dropped"]).

    ragged_a2a: the collective (signature of `jax.lax.ragged_all_to_all`); XLA:CPU has none,
    so tests pass an emulation with its semantics.
    """
    b, t = x.shape[:2]
    tok_axes, seq_axes, exp_axes, mlp_axes = _token_layout(mesh, rules, b, t)
    token_sharded = set(tok_axes) | set(seq_axes)
    rep = tuple(a for a in exp_axes if a not in token_sharded)  # exp axes holding replicas
    ep, n_rep = _size(mesh, exp_axes), _size(mesh, rep)
    k = ids.shape[-1]
    share, rows = ragged_buffer(mesh, rules, b, t, k, buffer_factor)
    tok_spec = P(_spec(tok_axes), _spec(seq_axes), None)
    w_in = P(_spec(exp_axes), None, _spec(mlp_axes))
    w_out = P(_spec(exp_axes), _spec(mlp_axes), None)

    def local(x, ids, weights, wg, wu, wd):
        bl, tl, d = x.shape
        xs, i, w = x.reshape(bl * tl, d), ids.reshape(bl * tl, k), weights.reshape(bl * tl, k)
        real = jnp.ones((bl * tl,), bool)
        if rep:  # replicated tokens: each device of the replica group routes its own slice
            pad = share * n_rep - bl * tl
            xs, i, w, real = (jnp.pad(a, ((0, pad),) + ((0, 0),) * (a.ndim - 1)) for a in (xs, i, w, real))
            start = jax.lax.axis_index(rep) * share
            xs, i, w, real = (jax.lax.dynamic_slice_in_dim(a, start, share) for a in (xs, i, w, real))
        y, dropped = _ragged_local(xs, i, w, real, wg, wu, wd, exp_axes, ep, rows, ragged_a2a)
        if mlp_axes:
            y = jax.lax.psum(y, mlp_axes)
        if rep:
            y = jax.lax.all_gather(y, rep, axis=0, tiled=True)[:bl * tl]
            dropped = jax.lax.all_gather(dropped, rep, axis=0, tiled=True)[:bl * tl]
        return y.reshape(bl, tl, d).astype(x.dtype), dropped.reshape(bl, tl)

    fn = jax.shard_map(local, mesh=mesh, in_specs=(tok_spec, tok_spec, tok_spec, w_in, w_in, w_out),
                       out_specs=(tok_spec, P(*tok_spec[:2])), check_vma=False)
    return fn(x, ids, weights, wg, wu, wd)


def ragged_buffer(mesh, rules, b: int, t: int, k: int, buffer_factor: float) -> tuple[int, int]:
    """(tokens each device routes, receive buffer rows) of `_ragged_dispatch` for x `[b, t, D]`
    and top-k routing: the buffer is share * k * ep rows (worst case) or
    min(worst case, ceil8(buffer_factor * share * k))."""
    tok_axes, seq_axes, exp_axes, _ = _token_layout(mesh, rules, b, t)
    rep = tuple(a for a in exp_axes if a not in set(tok_axes) | set(seq_axes))
    n_dev = b * t // _size(mesh, tok_axes + seq_axes)  # tokens per device (with replicas)
    share = -(-n_dev // _size(mesh, rep))
    worst = share * k * _size(mesh, exp_axes)
    rows = worst if buffer_factor <= 0 else min(worst, -(-int(buffer_factor * share * k) // 8) * 8)
    return share, rows


def grouped_rows_fraction(cfg, mesh, rules, b: int, t: int) -> float:
    """The fraction of the TPU grouped matmuls' rows a balanced routing fills, for a dropless
    expert-parallel MoE on x `[b, t, D]` under (mesh, rules): routed pairs per device over the
    rows the kernels are given (the ragged dispatch's receive buffer, or every gathered pair
    with the all-gather dispatch). megablox visits only the tiles of its groups (a dynamic
    grid), but its cost estimate counts every row: stage `compile` scales it by this."""
    ep = _size(mesh, sharding.mesh_axes_of("exp", rules))
    if float(cfg.moe_capacity_factor) > 0 or ep == 1:
        return 1.0
    if cfg.moe_dispatch == "all_gather":
        return 1.0 / ep
    share, rows = ragged_buffer(mesh, rules, b, t, int(cfg.num_experts_per_tok),
                                float(cfg.moe_a2a_buffer_factor))
    return share * int(cfg.num_experts_per_tok) / rows


def _excl_cumsum(a, axis=-1):
    return jnp.cumsum(a, axis=axis) - a


def _ragged_local(x, ids, weights, real, wg, wu, wd, axes, ep: int, rows: int, ragged_a2a):
    """One device's part of `_ragged_dispatch` (inside the shard_map over `axes`).

    x `[n, D]`, ids/weights `[n, k]`, real `[n]` (False: padding, not routed), wg/wu `[El, D, F]`,
    wd `[El, F, D]`; rows: the receive buffer's size. Returns (`[n, D]` float32, dropped pairs
    per token `[n]` float32).
    """
    n, k = ids.shape
    n_local = wg.shape[0]
    n_exp = n_local * ep
    me = jax.lax.axis_index(axes)
    send = jnp.repeat(real, k)
    key = jnp.where(send, ids.reshape(-1), n_exp)  # padding sorts past every device's segment
    order = jnp.argsort(key, stable=True)  # [n*k]: by destination device, then expert
    counts = jnp.bincount(key, length=n_exp + 1)[:n_exp].astype(jnp.int32)
    c = jax.lax.all_gather(counts, axes).reshape(ep, ep, n_local)  # [src, dst, local expert]
    seg = c.sum(-1)  # [src, dst] pairs src sends dst
    seg_off = _excl_cumsum(seg, axis=0)  # where src's segment starts in dst's buffer
    kept_seg = jnp.clip(rows - seg_off, 0, seg)  # a full buffer keeps the earlier sources
    seg_off = jnp.where(kept_seg > 0, seg_off, 0)  # an empty send's offset stays in bounds
    kept = jnp.clip(kept_seg[..., None] - _excl_cumsum(c), 0, c)  # [src, dst, expert]
    in_off = _excl_cumsum(seg)  # [src, dst]: dst's segment in src's sorted pairs

    dt = x.dtype
    token = order // k
    buf = ragged_a2a(x[token], jnp.zeros((rows, x.shape[1]), dt), in_off[me], kept_seg[me],
                     seg_off[me], kept_seg[:, me], axis_name=axes)  # [rows, D]
    # the buffer holds blocks (src, expert), src-major; the grouped matmul wants expert-major
    mine = kept[:, me]  # [src, El]
    b_start = _excl_cumsum(mine.reshape(-1)).reshape(ep, n_local)
    s_sizes = mine.T.reshape(-1)  # blocks in (expert, src) order
    s_start = _excl_cumsum(s_sizes).reshape(n_local, ep)
    r = jnp.arange(rows)
    blk = jnp.minimum(jnp.searchsorted(jnp.cumsum(s_sizes), r, side="right"), n_exp - 1)
    e_, s_ = blk // ep, blk % ep
    group_sizes = mine.sum(0)
    # expert-major; rows past the groups' sum zero (their unspecified cotangent would land on
    # received rows), and `back` reads only rows below it: the grouped matmuls mask nothing
    filled = (r < mine.sum())[:, None]
    xs = jnp.where(filled, buf[jnp.clip(b_start[s_, e_] + r - s_start[e_, s_], 0, rows - 1)], 0)
    h = jax.nn.silu(grouped_matmul(xs, wg.astype(dt), group_sizes, mask_rows=False)) * grouped_matmul(
        xs, wu.astype(dt), group_sizes, mask_rows=False)
    ys = grouped_matmul(h, wd.astype(dt), group_sizes, mask_rows=False)  # [rows, D]
    blk = jnp.minimum(jnp.searchsorted(jnp.cumsum(mine.reshape(-1)), r, side="right"), n_exp - 1)
    s_, e_ = blk // n_local, blk % n_local
    back = jnp.where(filled, ys[jnp.clip(s_start[e_, s_] + r - b_start[s_, e_], 0, rows - 1)], 0)
    # rows not returned (padding, dropped pairs) keep the zeros of the output buffer
    y = ragged_a2a(back, jnp.zeros((n * k, x.shape[1]), dt), seg_off[:, me], kept_seg[:, me],
                   in_off[:, me], kept_seg[me], axis_name=axes)  # [n*k, D] in `order`
    w = weights.reshape(-1)[order].astype(jnp.float32)
    out = jnp.zeros((n, x.shape[1]), jnp.float32).at[token].add(y.astype(jnp.float32) * w[:, None])
    dst = jnp.minimum(key[order] // n_local, ep - 1)
    lost = send[order] & (jnp.arange(n * k) - in_off[me][dst] >= kept_seg[me][dst])
    return out, jnp.zeros((n,), jnp.float32).at[token].add(lost.astype(jnp.float32))


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
        self.router = param(rngs, (d, e), ("embed", None), cfg, float32_compute=True)
        self.bias = RouterBias(jnp.zeros((e,), jnp.float32), logical_axes=(None,))
        self.wg = param(rngs, (e, d, f), ("exp", "embed", "exp_mlp"), cfg)
        self.wu = param(rngs, (e, d, f), ("exp", "embed", "exp_mlp"), cfg)
        self.wd = param(rngs, (e, f, d), ("exp", "exp_mlp", "embed"), cfg)
        self.shared = MLP(cfg, f * cfg.n_shared_experts, rngs, axis="mlp",
                          data_parallel=bool(getattr(cfg, "moe_shared_data_parallel", False))
                          ) if cfg.n_shared_experts else None
        self.dtype = dtype_of(cfg.dtype)

    def __call__(self, x, valid, expert_ids=None):
        """x `[B,T,D]`, valid `[B,T]` bool (non-padding), expert_ids `[B,T,k]` to replay.

        stats: load `[E]`, expert_ids `[B,T,k]` int32 (the ids used: the replayed ones when
        given), router_ids `[B,T,k]` int32 (this router's own top-k on x: equal to expert_ids
        without replay; with replay, the choice replay overrode, one top-k over `[N, E]` scores
        already computed, dead code unless read), z (mean logsumexp(router logits)^2), and with
        model.moe_capacity_factor > 0 (or a bounded ragged_all_to_all buffer,
        model.moe_a2a_buffer_factor > 0) `dropped` (fraction of pairs over capacity / buffer).
        """
        b, t, d = x.shape
        cfg = self.cfg
        x = x.astype(self.dtype)
        logits = jnp.einsum("btd,de->bte", x.astype(jnp.float32), weight(self.router, jnp.float32))
        logits = sharding.constrain(logits, ("batch", "res_seq", None))
        weights, ids = route(logits, self.bias[...], cfg, expert_ids)  # [B, T, k]
        validf = valid.astype(jnp.float32)
        z = (jax.nn.logsumexp(logits, axis=-1) ** 2 * validf).sum() / jnp.maximum(validf.sum(), 1.0)
        own = ids if expert_ids is None else route(logits, self.bias[...], cfg)[1]
        stats = dict(load=load_fraction(ids, valid, cfg.n_routed_experts),
                     expert_ids=ids, router_ids=own, z=z)
        ctx = sharding.current()
        # under any mesh the experts run in a shard_map, also when they are not split: the TPU
        # grouped matmul is a Mosaic kernel, which XLA cannot partition by itself
        distributed = ctx is not None
        cf = float(getattr(cfg, "moe_capacity_factor", 0.0))
        dispatch = getattr(cfg, "moe_dispatch", "auto")
        buffer_factor = float(getattr(cfg, "moe_a2a_buffer_factor", 0.0))
        if distributed:
            y, dropped = _expert_parallel_ffn(x, ids, weights,
                                              self.wg[...], self.wu[...], self.wd[...], *ctx,
                                              capacity_factor=cf, dispatch=dispatch,
                                              buffer_factor=buffer_factor)
        else:
            y, dropped = local_experts_ffn(x.reshape(b * t, d), ids.reshape(b * t, -1),
                                           weights.reshape(b * t, -1), self.wg[...],
                                           self.wu[...], self.wd[...], 0, cf, cfg.n_routed_experts)
            y = y.reshape(b, t, d)
        # a bounded ragged_all_to_all buffer can drop pairs too (zero on the all-gather path)
        truncating = distributed and buffer_factor > 0 and dispatch != "all_gather"
        if cf > 0 or truncating:  # fraction of the valid tokens' (token, expert) pairs dropped
            stats["dropped"] = (dropped.reshape(b, t) * validf).sum() / jnp.maximum(
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
