"""Batched sampling engine over MLA's compressed-latent KV cache (prefill once, decode many).

API (coder/rl/rollout.py is written against exactly this):

    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=256,
                            stop_token_ids=())
    engine = Engine(model, model_cfg, *, max_len, batch_buckets=(1, 2, 4, 8, 16, 32),
                    len_buckets=(16, 32, ..., >= max_len), speculative_k=0)
        speculative_k > 0 drafts that many tokens per step with the MTP modules and verifies
        them with one main-model forward (coder/infer/speculative.py); the output distribution,
        greedy output and recorded logprobs are those of plain decoding.
    group = engine.start_group(prompt_ids: list[int], n: int)
        Prefills the prompt ONCE (batch 1) and broadcasts its cache to the n rows.
    gens = engine.generate(group, params, rng, rows=None) -> list[Generation]
        Decodes the given rows (default: every row not finished) together in one batch, until
        each stops; `gens[i]` belongs to `rows[i]`. Generation(tokens, logprobs, expert_ids
        `[n_tokens, moe_layers, top_k]`, finish_reason "stop" | "length" | "max_len",
        policy_version per token). Sampled tokens, the stop token included, stay in the row's
        cache, so the next call continues after them.
    engine.append(group, row, token_ids)
        Appends observation tokens to a row (multi-turn); they are prefilled (only they, the
        history is never recomputed) at the start of the next `generate` of that row, batched
        with the other rows that have appended tokens. The row is unfinished again.
    engine.set_weights(state, version=None)
        Swaps the weights (an `nnx.State`, partial states allowed, or a model) between two
        decode steps; safe to call from another thread while `generate` runs. Every sampled
        token records the policy version that computed the logits it was drawn from.
    group.tokens(row), group.expert_ids(row) `[len, moe_layers, top_k]`, group.length(row):
        the row's whole sequence (prompt, sampled and appended tokens) and the routing of every
        token in the cache, for router replay of prompt and observation tokens too.

Recorded logprob of a token: `log_softmax(logits / T)[token]` over the full vocabulary
(T = 0: `log_softmax(logits)`), see coder/infer/sampling.py; a training forward at the same
temperature reproduces it.

How it runs. The cache (`coder.model.init_cache`: per layer latent `[B, S, r]` and RoPE key
`[B, S, dr]`, indexed by absolute position; with the nsa backend also the compressed keys and
values `[B, ceil(S / d), 1, ...]`) of a group holds its n rows; a call runs on a
sub-batch of the requested rows, gathered from the group cache into a batch bucket and
scattered back afterwards, unless it covers every row in order (padding rows have segment id 0,
which the model never writes into the cache). One decode step samples every active row's next token from the logits it holds
and feeds that token through the model at its position, which writes it into the cache and
yields the next logits; finished rows ride along with segment 0 until the whole batch is done.
With speculative_k = k a step instead emits 1 .. k+1 tokens per row (speculative.py), and every
prefill also runs the MTP modules so that their caches follow the main one.
Compiled shapes: batch bucket x prefill length bucket x cache capacity bucket (the cache grows
by whole buckets, so short rows do not pay for `max_len` attention), so a run compiles a
handful of programs and none per request. The engine relies on one layout rule for every cache
leaf (checked at construction): `[batch, slots, ...]` where `slots` grows with the capacity S
(S itself, or ceil(S / d) for NSA's compressed entries), entries are indexed from slot 0, and
the other axes do not depend on S; growing the cache is then zero-padding axis 1 of each leaf
to its length at the new capacity. `compilations` counts the traces.

Counters for benchmarks and metrics: `prefill_tokens`, `decode_steps`, and with speculative
decoding `drafted` / `accepted` (acceptance rate = accepted / drafted).

Thread model: one thread calls start_group / generate / append; set_weights may come from any.
"""
from __future__ import annotations

import bisect
import collections
import dataclasses
import threading

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from coder.infer import sampling, speculative
from coder.model import init_cache

FINISH_REASONS = ("stop", "length", "max_len")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass (1 = off)
    top_k: int = 0  # keep the k most likely tokens (0 = off)
    max_new_tokens: int = 256  # per generate call and row
    stop_token_ids: tuple = ()  # a row stops after sampling one of these (it is kept)


@dataclasses.dataclass
class Generation:
    tokens: list  # sampled token ids
    logprobs: list  # log_softmax(logits / T)[token] per token
    expert_ids: np.ndarray  # [n_tokens, moe_layers, top_k] int32, routing of each token
    finish_reason: str  # "stop" | "length" | "max_len"
    policy_version: list  # weights version that produced each token's distribution


@dataclasses.dataclass
class _Row:
    tokens: list  # whole sequence: cached tokens, then pending (appended, not yet prefilled)
    length: int  # tokens in the cache (positions 0 .. length-1)
    expert_chunks: list  # np arrays [t, moe_layers, top_k] covering the cached tokens
    logits_version: int  # policy version of the logits the next token is sampled from
    finish_reason: str | None = None

    @property
    def pending(self) -> list:
        return self.tokens[self.length:]


class Group:
    """n rows that share a prompt, and the host-side bookkeeping of each row.

    `store` holds, per slot: `cache` (the model cache `[nb, capacity, ...]`), `logits` `[nb, V]`
    (next-token logits after the cached tokens), `hidden` `[nb, D]` (trunk hidden state of the
    last cached token) and `mtp_hidden` `[nb, k, D]` (the hidden state each MTP depth still owes
    the next, see speculative.py; k = 0 without speculative decoding). nb is n rounded up to a
    batch bucket (so groups of 3 and 4 share compiled programs); slots past n are scratch.
    """

    def __init__(self, rows, store, capacity):
        self.rows = rows
        self.store = store
        self.capacity = capacity

    @property
    def cache(self):
        return self.store["cache"]

    @property
    def n(self) -> int:
        return len(self.rows)

    @property
    def slots(self) -> int:
        return self.store["logits"].shape[0]

    def tokens(self, row: int) -> list:
        return list(self.rows[row].tokens)

    def length(self, row: int) -> int:
        return len(self.rows[row].tokens)

    def expert_ids(self, row: int) -> np.ndarray:
        return np.concatenate(self.rows[row].expert_chunks, axis=0)

    def finished(self, row: int) -> str | None:
        return self.rows[row].finish_reason


def default_len_buckets(max_len: int) -> tuple:
    """Powers of two from 16 up to the first one >= max_len."""
    b = [16]
    while b[-1] < max_len:
        b.append(b[-1] * 2)
    return tuple(b)


def _bucket(buckets, n: int) -> int:
    """Smallest bucket >= n; past the largest, the next multiple of the largest."""
    i = bisect.bisect_left(buckets, n)
    if i < len(buckets):
        return buckets[i]
    top = buckets[-1]
    return -(-n // top) * top


def _empty_experts(moe_layers: int, top_k: int) -> np.ndarray:
    return np.zeros((0, moe_layers, top_k), np.int32)


class Engine:
    def __init__(self, model, model_cfg, *, max_len: int, batch_buckets=(1, 2, 4, 8, 16, 32),
                 len_buckets=None, speculative_k: int = 0, cache_dtype=None):
        if max_len < 2:
            raise ValueError(f"max_len={max_len}: need room for a prompt and a token")
        if not 0 <= speculative_k <= model_cfg.num_mtp_layers:
            raise ValueError(f"speculative_k={speculative_k}: drafting uses one MTP module per token, "
                             f"the model has model.num_mtp_layers={model_cfg.num_mtp_layers}")
        self.cfg = model_cfg
        self.max_len = int(max_len)
        self.spec_k = int(speculative_k)
        self.batch_buckets = tuple(sorted({int(b) for b in batch_buckets}))
        self.len_buckets = tuple(sorted({int(b) for b in (len_buckets or default_len_buckets(max_len))}))
        if self.batch_buckets[0] < 1 or self.len_buckets[0] < 1:
            raise ValueError("batch_buckets and len_buckets must be positive")
        self.cache_dtype = jnp.dtype(cache_dtype or model_cfg.dtype)
        self.moe_layers = max(0, model_cfg.num_hidden_layers - model_cfg.first_k_dense_replace)
        self.top_k_experts = int(model_cfg.num_experts_per_tok)
        self._graphdef, self._state = nnx.split(model)
        self._state_struct = _signature(self._state)
        self._lock = threading.Lock()
        self._pending_weights = None
        self.policy_version = 0
        self.compilations = collections.Counter()  # traces per compiled function
        self.prefill_tokens = 0  # real tokens run through prefill (shared prompts count once)
        self.decode_steps = 0  # batched decode (or draft + verify) steps
        self.drafted = 0  # speculative: drafts proposed for active rows
        self.accepted = 0  # speculative: drafts accepted
        self._check_cache_layout()
        self._prefill_fn = jax.jit(self._counted("prefill", self._prefill_impl), static_argnums=2)
        self._decode_fn = jax.jit(self._counted("decode", self._decode_impl))
        self._spec_fn = jax.jit(self._counted("speculative", self._spec_impl))
        self._take_fn = jax.jit(self._counted("take", _take_rows))
        self._put_fn = jax.jit(self._counted("put", _put_rows))
        self._grow_fn = jax.jit(self._counted("grow", self._grow_impl), static_argnums=1)
        self._broadcast_fn = jax.jit(self._counted("broadcast", _broadcast), static_argnums=1)

    # ------------------------------------------------------------------ public API
    def start_group(self, prompt_ids, n: int, *, share_prefix: bool = True) -> Group:
        """Prefill `prompt_ids` once and share its cache among `n` rows.

        share_prefix=False prefills the prompt in every row instead (one batched prefill of n
        copies): the same result at n times the prefill work, kept as bench/engine.py's baseline.
        """
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("start_group: empty prompt")
        if len(prompt) > self.max_len:
            raise ValueError(f"start_group: prompt of {len(prompt)} tokens exceeds max_len={self.max_len}")
        if n < 1:
            raise ValueError(f"start_group: n={n}, need at least one row")
        self._sync_weights()
        cap = _bucket(self.len_buckets, len(prompt))
        slots = _bucket(self.batch_buckets, n)
        if not share_prefix:
            group = self._empty_group(prompt, n, slots, cap)
            self._prefill_pending(group, list(range(n)))
            return group
        seed = self._empty_group(prompt, 1, _bucket(self.batch_buckets, 1), cap)
        self._prefill_pending(seed, [0])
        r0 = seed.rows[0]
        rows = [_Row(tokens=list(prompt), length=r0.length, expert_chunks=list(r0.expert_chunks),
                     logits_version=r0.logits_version) for _ in range(n)]
        return Group(rows, self._broadcast_fn(seed.store, slots), seed.capacity)

    def append(self, group: Group, row: int, token_ids) -> None:
        """Append observation tokens to `row`; they are prefilled by the next generate."""
        r = group.rows[row]
        ids = [int(t) for t in token_ids]
        if len(r.tokens) + len(ids) > self.max_len:
            raise ValueError(f"append: row {row} would hold {len(r.tokens) + len(ids)} tokens, "
                             f"more than max_len={self.max_len}")
        r.tokens.extend(ids)
        r.finish_reason = None

    def set_weights(self, state, version: int | None = None) -> None:
        """Use `state` (nnx.State, possibly partial, or a model) from the next decode step on."""
        if isinstance(state, nnx.Module):
            state = nnx.state(state)
        with self._lock:
            base = self._pending_weights[0] if self._pending_weights else self._state
        model = nnx.merge(self._graphdef, base)
        nnx.update(model, state)
        new = nnx.state(model)
        if _signature(new) != self._state_struct:
            raise ValueError("set_weights: the new state's structure, shapes or dtypes differ from "
                             "the engine's model (that would recompile every program)")
        with self._lock:
            self._pending_weights = (new, version)

    def generate(self, group: Group, params: SamplingParams, rng, rows=None) -> list:
        """Decode `rows` (default: all unfinished) until each stops. Returns one Generation per row."""
        if rows is None:
            rows = [i for i, r in enumerate(group.rows) if r.finish_reason is None]
        rows = [int(r) for r in rows]
        if len(set(rows)) != len(rows):
            raise ValueError(f"generate: duplicate rows {rows}")
        self._sync_weights()
        self._prefill_pending(group, [r for r in rows if group.rows[r].pending])
        out = {}
        live = []
        for r in rows:
            row = group.rows[r]
            if len(row.tokens) >= self.max_len or params.max_new_tokens <= 0:
                reason = "max_len" if len(row.tokens) >= self.max_len else "length"
                row.finish_reason = reason
                out[r] = Generation([], [], _empty_experts(self.moe_layers, self.top_k_experts), reason, [])
            else:
                live.append(r)
        top = self.batch_buckets[-1]
        for i in range(0, len(live), top):
            out.update(self._decode_rows(group, live[i:i + top], params, rng))
        return [out[r] for r in rows]

    @property
    def num_compilations(self) -> int:
        return sum(self.compilations.values())

    def lower(self, batch: int, capacity: int, prefill_len: int, *, state_shardings=None,
              store_sharding=None) -> dict:
        """Lower (never run) the prefill and decode programs of one shape bucket.

        batch rows, cache `capacity` slots, prefill chunks of `prefill_len` tokens; the decode
        program is the speculative step when speculative_k > 0. Returns {"prefill": Lowered,
        "decode": Lowered, "state": abstract state, "store": abstract store}. The engine may
        be built from an abstract model (`nnx.eval_shape`): nothing is allocated, which is how
        stage `compile` compiles a full-size engine for a TPU slice.
        state_shardings: a tree like the model state; store_sharding: `leaf -> sharding` for
        every `[batch, ...]` store leaf (cache, logits, hidden).
        """
        def put(tree, shardings):
            if shardings is None:
                return tree
            return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                                tree, shardings)

        state = put(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), self._state),
                    state_shardings)
        store = jax.eval_shape(lambda: self._empty_store(batch, capacity))
        if store_sharding is not None:
            store = put(store, jax.tree.map(store_sharding, store))
        row_sh = None if store_sharding is None else store_sharding(jax.ShapeDtypeStruct((batch,), jnp.int32))
        vec = lambda dt, *shape: jax.ShapeDtypeStruct((batch, *shape), dt, sharding=row_sh)
        scalar = lambda dt: jax.ShapeDtypeStruct((), dt)
        tokens = jax.ShapeDtypeStruct((batch, prefill_len), jnp.int32)
        if store_sharding is not None:
            tokens = jax.ShapeDtypeStruct(tokens.shape, tokens.dtype, sharding=store_sharding(tokens))
        prefill = self._prefill_fn.lower(state, store, True, vec(jnp.int32), tokens, tokens, tokens,
                                         vec(jnp.int32))
        carry = (vec(jnp.float32, self.cfg.vocab_size), vec(jnp.bool_))
        step_fn = self._spec_fn if self.spec_k else self._decode_fn
        decode = step_fn.lower(state, store, carry, vec(jnp.int32), vec(jnp.int32), vec(jnp.bool_),
                               vec(jnp.int32), jax.ShapeDtypeStruct((8,), jnp.int32),
                               jax.eval_shape(lambda: jax.random.key(0)),
                               scalar(jnp.float32), scalar(jnp.int32), scalar(jnp.float32))
        return {"prefill": prefill, "decode": decode, "state": state, "store": store}

    # ------------------------------------------------------------------ internals
    def _counted(self, name, fn):
        def traced(*args):
            self.compilations[name] += 1  # runs only when jit traces, i.e. on a cache miss
            return fn(*args)
        return traced

    def _empty_store(self, slots: int, capacity: int) -> dict:
        """The all-zero store of a group of `slots` rows (see Group)."""
        d = self.cfg.hidden_size
        return {
            "cache": init_cache(self.cfg, slots, capacity, self.cache_dtype),
            "logits": jnp.zeros((slots, self.cfg.vocab_size), jnp.float32),
            "hidden": jnp.zeros((slots, d), self.cache_dtype),
            "mtp_hidden": jnp.zeros((slots, self.spec_k, d), self.cache_dtype),
        }

    def _empty_group(self, prompt, n: int, slots: int, capacity: int) -> Group:
        """n rows holding `prompt` as pending tokens, an all-zero store of `slots` rows."""
        store = self._empty_store(slots, capacity)
        rows = [_Row(tokens=list(prompt), length=0, expert_chunks=[], logits_version=self.policy_version)
                for _ in range(n)]
        return Group(rows, store, capacity)

    def _cache_shapes(self, batch: int, capacity: int):
        return jax.eval_shape(lambda: init_cache(self.cfg, batch, capacity, self.cache_dtype))

    def _check_cache_layout(self):
        """Every cache leaf must be `[batch, slots, ...]` with `slots` growing with the capacity and
        the other axes independent of it (module docstring); fail early otherwise."""
        a, b, c = self._cache_shapes(2, 64), self._cache_shapes(3, 64), self._cache_shapes(2, 1024)
        for x, y, z in zip(jax.tree.leaves(a), jax.tree.leaves(b), jax.tree.leaves(c)):
            if (x.ndim < 2 or (x.shape[0], y.shape[0]) != (2, 3) or x.shape[1:] != y.shape[1:]
                    or x.shape[2:] != z.shape[2:] or not 0 < x.shape[1] < z.shape[1]):
                raise ValueError(f"init_cache leaf {x.shape} (batch 2, capacity 64) is not "
                                 "[batch, slots growing with the capacity, fixed axes...]")

    def _grow_impl(self, cache, capacity: int):
        """Zero-pad every cache leaf's slot axis to its length at `capacity`."""
        return _grow(cache, self._cache_shapes(1, capacity))

    def _sync_weights(self):
        with self._lock:
            pending, self._pending_weights = self._pending_weights, None
        if pending is not None:
            self._state = pending[0]
            self.policy_version = self.policy_version + 1 if pending[1] is None else int(pending[1])

    # ------------------------------------------------------------------ compiled programs
    def _prefill_impl(self, state, store, identity, idx, tokens, positions, segment_ids, last):
        """Prefill group slots `idx` `[B]` of `store` (every slot in order if `identity`).

        tokens/positions/segment_ids `[B,T]`, last `[B]` index of each row's last real token.
        Returns (store with the rows' tokens cached and their logits / hidden taken at `last`,
        expert ids `[moe_layers, B, T, top_k]`)."""
        sub = store if identity else _take_rows(store, idx)
        model = nnx.merge(self._graphdef, state)
        logits, aux = model(tokens, positions, segment_ids, cache=sub["cache"])
        pick = last[:, None, None]
        cache, mtp_hidden = aux["cache"], sub["mtp_hidden"]
        if self.spec_k:
            cache, mtp_hidden = speculative.advance(
                model, cache, sub["hidden"], mtp_hidden, aux["hidden"], tokens, positions[:, 0],
                last + 1, segment_ids[:, 0] > 0)
        new = {
            "cache": cache,
            "logits": jnp.take_along_axis(logits, pick, axis=1)[:, 0],
            "hidden": jnp.take_along_axis(aux["hidden"], pick, axis=1)[:, 0].astype(self.cache_dtype),
            "mtp_hidden": mtp_hidden,
        }
        return (new if identity else _put_rows(store, idx, new)), aux["expert_ids"]

    def _decode_impl(self, state, sub, carry, row_ids, positions, active, budget, stops, rng,
                     temperature, top_k, top_p):
        """One plain step for `[B]` rows: sample from the held logits, feed the token.

        Inactive rows feed with segment 0 (no cache write) and keep their state. Returns
        (sub, carry, tokens `[B,1]`, emitted count `[B]`, logprobs `[B,1]`, expert ids
        `[moe_layers, B, 1, top_k]`, accepted drafts `[B]` (0))."""
        keys = sampling.row_keys(rng, row_ids, positions)
        tok, logp = sampling.sample(sub["logits"], keys, temperature, top_k, top_p)
        model = nnx.merge(self._graphdef, state)
        logits, aux = model(tok[:, None], positions[:, None], active.astype(jnp.int32)[:, None],
                            cache=sub["cache"])
        keep = active[:, None]
        new = dict(sub, cache=aux["cache"], logits=jnp.where(keep, logits[:, 0], sub["logits"]),
                   hidden=jnp.where(keep, aux["hidden"][:, 0].astype(self.cache_dtype), sub["hidden"]))
        ones = jnp.ones_like(positions)
        return new, carry, tok[:, None], ones, logp[:, None], aux["expert_ids"], 0 * ones

    def _spec_impl(self, state, sub, carry, row_ids, positions, active, budget, stops, rng,
                   temperature, top_k, top_p):
        """One speculative step (speculative.py) for `[B]` rows at cache lengths `positions`.

        carry: (q `[B,V]`, has_q `[B]`) the rejected draft distribution at the next position.
        budget `[B]`: tokens a row may still emit; stops `[S]` stop ids (-1 padded). Emits
        tokens `[B,k+1]` of which the first `count` `[B]` count; the row's state ends after them.
        """
        k = self.spec_k
        model = nnx.merge(self._graphdef, state)
        q_prev, has_q = carry
        b = positions.shape[0]
        held = sub["logits"]
        # t0: from the held logits, or from the residual of a draft rejected at this position
        p_held = sampling.sampling_probs(held, temperature, top_k, top_p)
        p0 = jnp.where(has_q[:, None], speculative.residual(p_held, q_prev), p_held)
        t0 = speculative.draw(p0, sampling.row_keys(rng, row_ids, positions), temperature)
        draft_keys = jnp.stack([sampling.row_keys(jax.random.fold_in(rng, 1), row_ids, positions + d)
                                for d in range(1, k + 1)])
        drafts, q, cache = speculative.draft(model, sub["cache"], sub["hidden"], sub["mtp_hidden"], t0,
                                             positions, active, draft_keys, k, temperature, top_k, top_p)
        toks = jnp.concatenate([t0[:, None], drafts], axis=1)  # [B, k+1] at positions L..L+k
        pos = positions[:, None] + jnp.arange(k + 1)[None]
        logits, aux = model(toks, pos, jnp.broadcast_to(active[:, None], toks.shape).astype(jnp.int32),
                            cache=cache)
        p = sampling.sampling_probs(logits[:, :k].reshape(b * k, -1), temperature, top_k, top_p)
        u = jax.vmap(lambda key: jax.random.uniform(key, (k,)))(
            sampling.row_keys(jax.random.fold_in(rng, 2), row_ids, positions))
        n_acc = speculative.accept(p.reshape(b, k, -1), q, drafts, u)
        # emitted: t0 and the accepted drafts, cut after a stop token or at the budget
        j = jnp.arange(k + 1)[None]
        is_stop = (toks[:, :, None] == stops[None, None, :]).any(-1) & (j <= n_acc[:, None])
        first_stop = jnp.where(is_stop.any(1), jnp.argmax(is_stop, axis=1), k + 1)
        count = jnp.minimum(jnp.minimum(n_acc + 1, first_stop + 1), budget)
        count = jnp.where(active, jnp.maximum(count, 1), 0)
        finished = (first_stop < count) | (count >= budget)
        last = jnp.maximum(count - 1, 0)[:, None, None]
        cache, mtp_hidden = speculative.advance(model, aux["cache"], sub["hidden"], sub["mtp_hidden"],
                                                aux["hidden"], toks, positions, count, active)
        keep = active[:, None]
        new = {
            "cache": cache,
            "logits": jnp.where(keep, jnp.take_along_axis(logits, last, axis=1)[:, 0], held),
            "hidden": jnp.where(keep, jnp.take_along_axis(aux["hidden"], last, axis=1)[:, 0].astype(self.cache_dtype),
                             sub["hidden"]),
            "mtp_hidden": jnp.where(keep[:, :, None], mtp_hidden, sub["mtp_hidden"]),
        }
        # the residual is owed only if the step ended at a rejection and the row goes on
        rejected = active & ~finished & (n_acc < k) & (count == n_acc + 1)
        q_next = jnp.take_along_axis(q, jnp.minimum(n_acc, k - 1)[:, None, None], axis=1)[:, 0]
        logp = jnp.concatenate([sampling.token_logprob(held, t0, temperature)[:, None],
                                sampling.token_logprob(logits[:, :k], drafts, temperature)], axis=1)
        return new, (q_next, rejected), toks, count, logp, aux["expert_ids"], jnp.where(active, n_acc, 0)

    # ------------------------------------------------------------------ host loops
    def _ensure_capacity(self, group: Group, need: int) -> None:
        if need > group.capacity:
            cap = _bucket(self.len_buckets, need)
            group.store = dict(group.store, cache=self._grow_fn(group.store["cache"], cap))
            group.capacity = cap

    def _prefill_pending(self, group: Group, rows) -> None:
        """Write the pending tokens of `rows` into the cache, in batches and length buckets."""
        max_chunk = self.len_buckets[-1]
        top = self.batch_buckets[-1]
        while True:
            todo = [r for r in rows if group.rows[r].pending]
            if not todo:
                return
            for i in range(0, len(todo), top):
                part = todo[i:i + top]
                chunks = [group.rows[r].pending[:max_chunk] for r in part]
                t = _bucket(self.len_buckets, max(len(c) for c in chunks))
                bb = _bucket(self.batch_buckets, len(part))
                tokens = np.zeros((bb, t), np.int32)
                positions = np.zeros((bb, t), np.int32)
                seg = np.zeros((bb, t), np.int32)
                last = np.zeros((bb,), np.int32)
                for j, (r, c) in enumerate(zip(part, chunks)):
                    start = group.rows[r].length
                    tokens[j, :len(c)] = c
                    positions[j, :len(c)] = np.arange(start, start + len(c))
                    seg[j, :len(c)] = 1
                    last[j] = len(c) - 1
                self._ensure_capacity(group, max(group.rows[r].length + len(c) for r, c in zip(part, chunks)))
                idx, identity = _row_index(part, bb, group.slots)
                group.store, eids = self._prefill_fn(self._state, group.store, identity, idx,
                                                     tokens, positions, seg, last)
                eids = np.asarray(eids)
                self.prefill_tokens += sum(len(c) for c in chunks)
                for j, (r, c) in enumerate(zip(part, chunks)):
                    row = group.rows[r]
                    row.expert_chunks.append(np.ascontiguousarray(eids[:, j, :len(c)].transpose(1, 0, 2)))
                    row.length += len(c)
                    row.logits_version = self.policy_version

    def _decode_rows(self, group: Group, rows, params: SamplingParams, rng) -> dict:
        """Decode `rows` (at most the largest batch bucket) to completion; returns {row: Generation}."""
        n = len(rows)
        bb = _bucket(self.batch_buckets, n)
        idx, identity = _row_index(rows, bb, group.slots)
        sub = group.store if identity else self._take_fn(group.store, idx)
        cap = group.capacity
        lengths = np.zeros((bb,), np.int32)
        lengths[:n] = [group.rows[r].length for r in rows]
        active = np.zeros((bb,), bool)
        active[:n] = True
        emitted = np.zeros((bb,), np.int32)
        row_ids = np.where(idx < group.n, idx, 0).astype(np.int32)  # sampling keys
        knobs = (np.float32(params.temperature), np.int32(params.top_k), np.float32(params.top_p))
        stops = {int(s) for s in params.stop_token_ids}
        stop_arr = np.full((-(-max(len(stops), 1) // 8) * 8,), -1, np.int32)  # padded: few shapes
        stop_arr[:len(stops)] = sorted(stops)
        step_fn = self._spec_fn if self.spec_k else self._decode_fn
        carry = (jnp.zeros((bb, self.cfg.vocab_size), jnp.float32), jnp.zeros((bb,), bool))
        gens = [Generation([], [], None, None, []) for _ in range(n)]
        experts = [[] for _ in range(n)]
        while active.any():
            self._sync_weights()
            need = int(lengths[active].max()) + 1 + self.spec_k
            if need > cap:
                cap = _bucket(self.len_buckets, need)
                sub = dict(sub, cache=self._grow_fn(sub["cache"], cap))
            budget = np.minimum(params.max_new_tokens - emitted, self.max_len - lengths).astype(np.int32)
            sub, carry, tok, count, logp, eids, n_acc = step_fn(
                self._state, sub, carry, row_ids, lengths, active, budget, stop_arr, rng, *knobs)
            tok, count, logp, eids = np.asarray(tok), np.asarray(count), np.asarray(logp), np.asarray(eids)
            self.decode_steps += 1
            if self.spec_k:
                self.drafted += self.spec_k * int(active.sum())
                self.accepted += int(np.asarray(n_acc).sum())
            for j in np.flatnonzero(active[:n]):
                row, gen = group.rows[rows[j]], gens[j]
                c = int(count[j])
                new = [int(t) for t in tok[j, :c]]
                gen.tokens += new
                gen.logprobs += [float(x) for x in logp[j, :c]]
                gen.policy_version += [row.logits_version] + [self.policy_version] * (c - 1)
                experts[j].append(eids[:, j, :c].transpose(1, 0, 2))
                row.tokens += new
                row.expert_chunks.append(experts[j][-1])
                row.length += c
                row.logits_version = self.policy_version
                lengths[j] += c
                emitted[j] += c
                if new[-1] in stops:
                    gen.finish_reason = "stop"
                elif row.length >= self.max_len:
                    gen.finish_reason = "max_len"
                elif emitted[j] >= params.max_new_tokens:
                    gen.finish_reason = "length"
                if gen.finish_reason is not None:
                    row.finish_reason = gen.finish_reason
                    active[j] = False
        if identity:
            group.store, group.capacity = sub, cap
        else:
            self._ensure_capacity(group, cap)
            group.store = self._put_fn(group.store, idx, sub)
        for gen, ex in zip(gens, experts):
            gen.expert_ids = np.concatenate(ex) if ex else _empty_experts(self.moe_layers, self.top_k_experts)
        return dict(zip(rows, gens))


# ---------------------------------------------------------------------- store plumbing (pure)
def _signature(state):
    return jax.tree.structure(state), tuple((x.shape, x.dtype) for x in jax.tree.leaves(state))


def _row_index(rows, bucket: int, slots: int) -> tuple:
    """Group slot of each batch slot `[bucket]`, and whether that is every slot in order.

    If the batch covers the group's storage exactly, padding batch slots take the group's
    scratch slots (no gather / scatter needed: padding has segment 0 and writes nothing);
    otherwise padding gets `slots` (out of range: gathers clip, scatters drop)."""
    idx = np.full((bucket,), slots, np.int32)
    idx[:len(rows)] = rows
    if bucket == slots and list(rows) == list(range(len(rows))):
        return np.arange(bucket, dtype=np.int32), True
    return idx, False


def _take_rows(tree, idx):
    """Gather batch rows `idx` `[b]` of every leaf `[n, ...]` -> `[b, ...]`."""
    return jax.tree.map(lambda x: jnp.take(x, idx, axis=0, mode="clip"), tree)


def _put_rows(tree, idx, sub):
    """Scatter `sub` leaves `[b, ...]` into rows `idx` of `tree` leaves `[n, ...]` (padding dropped).

    A sub-cache grows past the group's capacity only after the group cache was grown
    (Engine._ensure_capacity), so shapes match past the batch axis."""
    return jax.tree.map(lambda x, s: x.at[idx].set(s.astype(x.dtype), mode="drop"), tree, sub)


def _grow(cache, target):
    """Zero-pad axis 1 of every cache leaf `[B, s, ...]` to the length of the matching leaf of
    `target` (shapes of the cache at a larger capacity)."""
    def pad(x, t):
        widths = [(0, 0)] * x.ndim
        widths[1] = (0, t.shape[1] - x.shape[1])
        return jnp.pad(x, widths)
    return jax.tree.map(pad, cache, target)


def _broadcast(tree, n: int):
    """Repeat the first row of every leaf `[b, ...]` to `[n, ...]`."""
    return jax.tree.map(lambda x: jnp.broadcast_to(x[:1], (n,) + x.shape[1:]), tree)
