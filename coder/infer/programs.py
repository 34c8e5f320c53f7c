"""The engine's compiled programs: pure functions of (weights, slot store, per-slot inputs).

coder/infer/engine.py jits them (binding the static model graph and sizes) and
coder/infer/scheduler.py decides what they run on; nothing here holds state or touches the host.

The store (`Store`) is a pool of S cache slots; a slot holds one row (a sequence) and is
indexed by absolute position. Every program runs on the whole pool (`decode`) or on the
slots it is given (`prefill`, `copy_slots`); a slot that takes no part feeds segment id 0,
which the model never writes into the cache, and keeps its state.

`decode` runs up to `num_steps` decode steps inside one `lax.while_loop` (vLLM-TPU's multi-step
decode): each step samples every active slot's next token from the logits it holds and feeds
it through the model, which caches it and yields the next logits. With speculative_k = k > 0 a
step instead drafts k tokens with the MTP modules and verifies them with one main-model forward
(coder/infer/speculative.py), emitting 1 .. k+1 tokens per row. A row leaves the loop (on
device) when it samples one of its stop tokens or spends its budget; the loop ends when every
row has left, after `num_steps` steps, or as soon as fewer than `stop_below` rows are left (so a
host with rows waiting for a slot regains control when one frees). The host reads the emitted
tokens once per call.

Shapes: S slots, C cache capacity, V vocabulary, D hidden size, k drafts, W = num_steps x
(k + 1) emitted tokens at most per row and call, L MoE layers, K experts per token.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx, struct

from coder.infer import sampling, speculative
from coder.model import init_cache


@struct.dataclass
class Store:
    """Per-slot device state of the pool."""

    cache: dict  # coder.model.init_cache leaves `[S, C or ceil(C / d), ...]`
    logits: jax.Array  # [S, V] float32: next-token logits after the cached tokens
    hidden: jax.Array  # [S, D]: trunk hidden state of the last cached token
    mtp_hidden: jax.Array  # [S, k, D]: the hidden state each MTP depth owes the next (speculative.py)
    residual: jax.Array  # [S, V] (speculative) or [S, 0]: draft distribution rejected at the next position
    has_residual: jax.Array  # [S] bool: the next token is drawn from max(0, p - residual)


@struct.dataclass
class SlotInputs:
    """What the host tells `decode` about every slot (inactive slots: anything)."""

    length: jax.Array  # [S] int32 tokens in the slot's cache
    active: jax.Array  # [S] bool decode this slot
    budget: jax.Array  # [S] int32 tokens the row may emit in this call (>= 1 when active)
    rng: jax.Array  # [S] typed PRNG keys: fold_in(request rng, row); token keys fold in the position
    temperature: jax.Array  # [S] float32 (0 = greedy)
    top_k: jax.Array  # [S] int32 (0 = off)
    top_p: jax.Array  # [S] float32 (1 = off)
    stops: jax.Array  # [S, n] int32 stop token ids, -1 padded


@struct.dataclass
class Emitted:
    """What one `decode` call produced, per slot; the host reads it once per call."""

    tokens: jax.Array  # [S, W] int32; the first `count` of each row are real
    logprobs: jax.Array  # [S, W] float32 log_softmax(logits / T)[token]
    experts: jax.Array  # [S, W, L, K] uint8 / uint16 expert ids that routed each emitted token
    count: jax.Array  # [S] int32 tokens emitted
    stopped: jax.Array  # [S] bool: the last emitted token is a stop token
    steps: jax.Array  # [] int32 decode steps run
    row_steps: jax.Array  # [S] int32 steps each row took part in (occupancy = sum / (steps x S))
    accepted: jax.Array  # [k] int32 drafts accepted at depth 1..k (summed over rows and steps)


def expert_dtype(num_experts: int):
    return jnp.uint8 if num_experts <= 256 else jnp.uint16


def empty_store(cfg, slots: int, capacity: int, cache_dtype, spec_k: int) -> Store:
    d, v = cfg.hidden_size, cfg.vocab_size
    return Store(
        cache=init_cache(cfg, slots, capacity, cache_dtype),
        logits=jnp.zeros((slots, v), jnp.float32),
        hidden=jnp.zeros((slots, d), cache_dtype),
        mtp_hidden=jnp.zeros((slots, spec_k, d), cache_dtype),
        residual=jnp.zeros((slots, v if spec_k else 0), jnp.float32),
        has_residual=jnp.zeros((slots,), bool),
    )


def resize(store: Store, target: Store) -> Store:
    """Zero-pad or cut every leaf to the shape of `target`'s (abstract) leaf: the pool at another
    slot count (axis 0) or cache capacity (axis 1 of cache leaves). Cutting capacity is only
    valid when no row holds tokens past the new capacity (the scheduler's invariant)."""
    return jax.tree.map(lambda x, t: _fit(x, t.shape), store, target)


def _fit(x, shape):
    """`x` cut or zero-padded to `shape`."""
    if not shape:  # a per-slot scalar (has_residual once its slot axis is gone)
        return x
    x = x[tuple(slice(0, n) for n in shape)]
    return jnp.pad(x, [(0, n - m) for n, m in zip(shape, x.shape)])


def copy_slots(store: Store, src, dst) -> Store:
    """Copy slots `src` `[n]` to slots `dst` `[n]` (dst == S: dropped padding). How a group's
    prompt, prefilled once, is shared by its rows. Over a pool split across devices the rows
    read out of the pool are on every chip, so the caches go one layer at a time: the stacked
    layers in a loop, the others chained one after another (each layer's copy waits for the one
    before: XLA otherwise ran them side by side, 24 GB of DeepSeek-V3's 256k rows on every chip
    of a v5p-256); n rows of one layer are in flight, not of every layer (n rows of K2's whole
    256k stack are 18 GB each)."""
    copy = lambda x: x.at[dst].set(jnp.take(x, src, axis=0, mode="clip"), mode="drop")

    def copy_stack(x):  # [S, L, C, ...]
        def layer(i, x):
            rows = jnp.take(jax.lax.dynamic_index_in_dim(x, i, axis=1, keepdims=False), src, axis=0, mode="clip")
            return x.at[dst, i].set(rows, mode="drop")
        return jax.lax.fori_loop(0, x.shape[1], layer, x)

    cache = dict(store.cache)
    stack = cache.pop("stack", None)
    leaves, treedef = jax.tree.flatten(cache)
    done = []
    for leaf in leaves:
        if done:  # ordered after the copy before it
            done[-1], leaf = jax.lax.optimization_barrier((done[-1], leaf))
        done.append(copy(leaf))
    out = jax.tree.map(copy, store.replace(cache={})).replace(cache=jax.tree.unflatten(treedef, done))
    if stack is not None:
        last = done[-1] if done else None
        stack = jax.tree.map(copy_stack, stack if last is None else jax.lax.optimization_barrier((last, stack))[1])
        out = out.replace(cache=dict(out.cache, stack=stack))
    return out


def read_slot(store: Store, slot) -> Store:
    """Slot `slot`'s state: every leaf without its slot axis (a row moving to host memory)."""
    return jax.tree.map(lambda x: x[slot], store)


def write_slot(store: Store, row: Store, slot) -> Store:
    """`row` (leaves without the slot axis, read at any capacity: each cut or zero-padded to
    this store's, which holds the row's tokens) into slot `slot`."""
    return jax.tree.map(lambda x, r: x.at[slot].set(_fit(r, x.shape[1:])), store, row)


def _compact_experts(expert_ids, dtype):
    """Model aux expert ids `[L, B, T, K]` int32 -> `[B, T, L, K]` compact."""
    return jnp.transpose(expert_ids, (1, 2, 0, 3)).astype(dtype)


def prefill(graphdef, state, store: Store, idx, tokens, positions, segment_ids, last, *, spec_k: int,
            experts_dtype):
    """Write a chunk of tokens into slots `idx` `[B]` (== S: padding, dropped).

    tokens/positions/segment_ids `[B, T]` (padding segment 0), last `[B]` index of each row's
    last real token. Returns (store with the rows' tokens cached, their held logits / hidden
    taken at `last` and no residual owed, expert ids `[B, T, L, K]`). The model reads and writes
    the pool's cache in place at the rows' slots (`cache_rows`): a row's cache is never copied
    out of the pool and back whole. Reading one layer's rows is still a gather, which over a
    pool split across devices brings those rows to every device: such pools take
    `prefill_pool`."""
    take = lambda x: jnp.take(x, idx, axis=0, mode="clip")
    put = lambda x, v: x.at[idx].set(v.astype(x.dtype), mode="drop")
    return _prefill(graphdef, state, store, idx, take, put, tokens, positions, segment_ids, last, spec_k,
                    experts_dtype)


def prefill_pool(graphdef, state, store: Store, tokens, positions, segment_ids, last, *, spec_k: int,
                 experts_dtype):
    """`prefill` with the batch aligned to the pool: row b is slot b (tokens etc. `[S, T]`; a slot
    with nothing to prefill is a row of padding and keeps its state). What a pool split over
    devices prefills with: every row is computed where its slot's cache lives, so nothing is
    gathered (K2 at 256k on a v5p-256: the gathered form needed 214 GiB a chip for 256 rows)."""
    has = (segment_ids > 0).any(axis=1)  # [S] slots this chunk writes
    keep = lambda x, v: jnp.where(has.reshape(-1, *([1] * (x.ndim - 1))), v.astype(x.dtype), x)
    return _prefill(graphdef, state, store, None, lambda x: x, keep, tokens, positions, segment_ids, last,
                    spec_k, experts_dtype)


def _prefill(graphdef, state, store, idx, take, put, tokens, positions, segment_ids, last, spec_k, experts_dtype):
    """prefill's body: `take` a pool leaf's batch rows, `put` the rows' new values back."""
    model = nnx.merge(graphdef, state)
    logits, aux = model(tokens, positions, segment_ids, cache=store.cache, cache_rows=idx)
    pick = last[:, None, None]
    cache, mtp_hidden = aux["cache"], take(store.mtp_hidden)
    if spec_k:
        cache, mtp_hidden = speculative.advance(model, cache, take(store.hidden), mtp_hidden, aux["hidden"], tokens,
                                                positions[:, 0], last + 1, segment_ids[:, 0] > 0, cache_rows=idx)
    b = tokens.shape[0]
    new = dict(
        logits=jnp.take_along_axis(logits, pick, axis=1)[:, 0],
        hidden=jnp.take_along_axis(aux["hidden"], pick, axis=1)[:, 0],
        mtp_hidden=mtp_hidden,
        residual=jnp.zeros((b, *store.residual.shape[1:])),
        has_residual=jnp.zeros((b,), bool),
    )
    out = store.replace(cache=cache, **{k: put(getattr(store, k), v) for k, v in new.items()})
    return out, _compact_experts(aux["expert_ids"], experts_dtype)


def _plain_step(model, store: Store, rows: SlotInputs, length, active, left, experts_dtype):
    """One step: sample from the held logits, feed the token. Returns (store, tokens `[S,1]`,
    count `[S]`, logprobs `[S,1]`, experts `[S,1,L,K]`, stopped `[S]`, accepted-per-depth `[0]`)."""
    keys = sampling.position_keys(rows.rng, length)
    tok, logp = sampling.sample(store.logits, keys, rows.temperature, rows.top_k, rows.top_p)
    logits, aux = model(tok[:, None], length[:, None], active.astype(jnp.int32)[:, None], cache=store.cache)
    keep = active[:, None]
    new = store.replace(
        cache=aux["cache"], logits=jnp.where(keep, logits[:, 0].astype(jnp.float32), store.logits),
        hidden=jnp.where(keep, aux["hidden"][:, 0].astype(store.hidden.dtype), store.hidden))
    stopped = (tok[:, None] == rows.stops).any(-1)
    count = active.astype(jnp.int32)
    return (new, tok[:, None], count, logp[:, None], _compact_experts(aux["expert_ids"], experts_dtype),
            stopped, jnp.zeros((0,), jnp.int32))


def _spec_step(model, store: Store, rows: SlotInputs, length, active, left, experts_dtype):
    """One speculative step (speculative.py): t0 from the held logits (or the residual of a
    draft rejected at this position), k MTP drafts, one verifying forward of the k + 1 tokens.
    Emits tokens `[S, k+1]` of which the first `count` `[S]` count (cut after a stop token or
    at the row's budget `left`); the row's state ends after them."""
    k = store.mtp_hidden.shape[1]
    b = length.shape[0]
    t, tk, tp = rows.temperature, rows.top_k, rows.top_p
    held = store.logits
    p_held = sampling.sampling_probs(held, t, tk, tp)
    p0 = jnp.where(store.has_residual[:, None], speculative.residual(p_held, store.residual), p_held)
    t0 = speculative.draw(p0, sampling.position_keys(rows.rng, length), t)
    draft_rng = jax.vmap(lambda r: jax.random.fold_in(r, 1))(rows.rng)
    draft_keys = jnp.stack([sampling.position_keys(draft_rng, length + d) for d in range(1, k + 1)])
    drafts, q, cache = speculative.draft(model, store.cache, store.hidden, store.mtp_hidden, t0, length,
                                         active, draft_keys, k, t, tk, tp)
    toks = jnp.concatenate([t0[:, None], drafts], axis=1)  # [S, k+1] at positions L..L+k
    pos = length[:, None] + jnp.arange(k + 1)[None]
    logits, aux = model(toks, pos, jnp.broadcast_to(active[:, None], toks.shape).astype(jnp.int32), cache=cache)
    rep = lambda x: jnp.repeat(x, k)  # per-row settings for the [S * k] verified positions
    p = sampling.sampling_probs(logits[:, :k].reshape(b * k, -1), rep(t), rep(tk), rep(tp))
    accept_rng = jax.vmap(lambda r: jax.random.fold_in(r, 2))(rows.rng)
    u = jax.vmap(lambda key: jax.random.uniform(key, (k,)))(sampling.position_keys(accept_rng, length))
    n_acc = speculative.accept(p.reshape(b, k, -1), q, drafts, u)
    j = jnp.arange(k + 1)[None]
    is_stop = (toks[:, :, None] == rows.stops[:, None, :]).any(-1) & (j <= n_acc[:, None])
    first_stop = jnp.where(is_stop.any(1), jnp.argmax(is_stop, axis=1), k + 1)
    count = jnp.minimum(jnp.minimum(n_acc + 1, first_stop + 1), left)
    count = jnp.where(active, jnp.maximum(count, 1), 0)
    stopped = first_stop < count
    last = jnp.maximum(count - 1, 0)[:, None, None]
    cache, mtp_hidden = speculative.advance(model, aux["cache"], store.hidden, store.mtp_hidden, aux["hidden"],
                                            toks, length, count, active)
    keep = active[:, None]
    # the residual is owed only if the step ended at a rejection and the row goes on
    rejected = active & ~stopped & (count < left) & (n_acc < k) & (count == n_acc + 1)
    q_next = jnp.take_along_axis(q, jnp.minimum(n_acc, k - 1)[:, None, None], axis=1)[:, 0]
    new = Store(
        cache=cache,
        logits=jnp.where(keep, jnp.take_along_axis(logits, last, axis=1)[:, 0].astype(jnp.float32), held),
        hidden=jnp.where(keep, jnp.take_along_axis(aux["hidden"], last, axis=1)[:, 0].astype(store.hidden.dtype),
                         store.hidden),
        mtp_hidden=jnp.where(keep[:, :, None], mtp_hidden.astype(store.mtp_hidden.dtype), store.mtp_hidden),
        residual=jnp.where(keep, q_next, store.residual),
        has_residual=jnp.where(active, rejected, store.has_residual),
    )
    logp = jnp.concatenate([sampling.token_logprob(held, t0, t)[:, None],
                            sampling.token_logprob(logits[:, :k], drafts, t[:, None])], axis=1)
    n_acc = jnp.where(active, n_acc, 0)
    by_depth = (n_acc[:, None] >= jnp.arange(1, k + 1)[None]).sum(0).astype(jnp.int32)
    return new, toks, count, logp, _compact_experts(aux["expert_ids"], experts_dtype), stopped, by_depth


def decode(graphdef, state, store: Store, rows: SlotInputs, stop_below, *, num_steps: int, experts_dtype):
    """Up to `num_steps` decode steps over every slot, in one `lax.while_loop` (module docstring).

    stop_below `[]` int32: leave the loop as soon as fewer rows than this are still active.
    Returns (store, Emitted)."""
    model = nnx.merge(graphdef, state)
    k = store.mtp_hidden.shape[1]
    step_fn = _spec_step if k else _plain_step
    s = rows.length.shape[0]
    w = num_steps * (k + 1)
    moe_layers = max(0, model.cfg.num_hidden_layers - model.cfg.first_k_dense_replace)
    out = Emitted(
        tokens=jnp.zeros((s, w), jnp.int32), logprobs=jnp.zeros((s, w), jnp.float32),
        experts=jnp.zeros((s, w, moe_layers, model.cfg.num_experts_per_tok), experts_dtype),
        count=jnp.zeros((s,), jnp.int32), stopped=jnp.zeros((s,), bool), steps=jnp.zeros((), jnp.int32),
        row_steps=jnp.zeros((s,), jnp.int32), accepted=jnp.zeros((k,), jnp.int32))
    slot = jnp.arange(s)[:, None]

    def cond(carry):
        _, active, out = carry
        n = active.sum()
        return (out.steps < num_steps) & (n > 0) & (n >= stop_below)

    def body(carry):
        store, active, out = carry
        length = rows.length + out.count
        left = rows.budget - out.count
        store, toks, count, logp, experts, stopped, by_depth = step_fn(model, store, rows, length, active, left,
                                                                       experts_dtype)
        j = jnp.arange(toks.shape[1])[None]
        at = jnp.where(j < count[:, None], out.count[:, None] + j, w)  # w: dropped
        out = Emitted(
            tokens=out.tokens.at[slot, at].set(toks, mode="drop"),
            logprobs=out.logprobs.at[slot, at].set(logp, mode="drop"),
            experts=out.experts.at[slot, at].set(experts, mode="drop"),
            count=out.count + count, stopped=out.stopped | (active & stopped), steps=out.steps + 1,
            row_steps=out.row_steps + active.astype(jnp.int32), accepted=out.accepted + by_depth)
        active = active & ~stopped & (out.count < rows.budget)
        return store, active, out

    store, _, out = jax.lax.while_loop(cond, body, (store, rows.active & (rows.budget > 0), out))
    return store, out
