"""Expert parallelism: the MoE's expert FFN over a mesh, experts split on the `exp` axes.

Inside `coder.model.sharding.activate` with experts split over mesh axes, the expert FFN runs in
a `shard_map`; each device holds E/ep experts. model.moe_dispatch picks how pairs reach them
(`expert_parallel_ffn`; "auto" decides when the program is lowered):
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
Each device's experts run `coder.model.expert_ffn.local_experts_ffn` (all-gather) or their
grouped matmuls directly (ragged). `ragged_buffer` and `grouped_rows_fraction` give the ragged
dispatch's sizes to the compile stage's cost estimates.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from coder.model import sharding
from coder.model.expert_ffn import local_experts_ffn
from coder.model.grouped_matmul import grouped_matmul
from coder.model.quantized import operand, spec_for


DISPATCHES = ("auto", "all_gather", "ragged_all_to_all")


def expert_parallel_ffn(x, ids, weights, wg, wu, wd, mesh, rules, capacity_factor=0.0,
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
    return sharding.platform_dependent(x, ids, weights, wg, wu, wd, cpu=gather, default=ragged)


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
    Shapes as `expert_parallel_ffn`."""
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
    w_specs = (spec_for(wg, w_in), spec_for(wu, w_in), spec_for(wd, w_out))  # a quantized weight's scale too
    n_local = wg.shape[0] // max(1, _size(mesh, exp_axes))

    def local(x, ids, weights, wg, wu, wd):
        b, t, d = x.shape
        xs, i, w = x.reshape(b * t, d), ids.reshape(b * t, -1), weights.reshape(b * t, -1)
        if gather:
            xs = jax.lax.all_gather(xs, gather, axis=0, tiled=True)
            i = jax.lax.all_gather(i, gather, axis=0, tiled=True)
            w = jax.lax.all_gather(w, gather, axis=0, tiled=True)
        # experts split over nothing (size-1 axes): the first is a Python 0, so the local FFN knows
        # every pair is local (expert_ffn.sorted_ffn's gathers, no masks)
        first = jax.lax.axis_index(exp_axes) * n_local if _size(mesh, exp_axes) > 1 else 0
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

    fn = jax.shard_map(local, mesh=mesh, in_specs=(tok_spec, tok_spec, tok_spec, *w_specs),
                       out_specs=(tok_spec, P(*tok_spec[:2])), check_vma=False)
    return fn(x, ids, weights, wg, wu, wd)


def _ragged_dispatch(x, ids, weights, wg, wu, wd, mesh, rules, buffer_factor=0.0,
                     ragged_a2a=jax.lax.ragged_all_to_all):
    """Dropless expert parallelism moving only the routed pairs (`jax.lax.ragged_all_to_all`).

    Shapes as `expert_parallel_ffn`. Each device takes its own share of the tokens (its slice
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
    w_specs = (spec_for(wg, w_in), spec_for(wu, w_in), spec_for(wd, w_out))  # a quantized weight's scale too

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

    fn = jax.shard_map(local, mesh=mesh, in_specs=(tok_spec, tok_spec, tok_spec, *w_specs),
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
    h = jax.nn.silu(grouped_matmul(xs, operand(wg, dt), group_sizes, mask_rows=False)) * grouped_matmul(
        xs, operand(wu, dt), group_sizes, mask_rows=False)
    ys = grouped_matmul(h, operand(wd, dt), group_sizes, mask_rows=False)  # [rows, D]
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
