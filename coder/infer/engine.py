"""Batched sampling engine over MLA's compressed-latent KV cache (prefill once, decode many).

API (coder/rl/rollout.py is written against exactly this):

    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=256,
                            stop_token_ids=())
    engine = Engine(model, model_cfg, *, max_len, batch_buckets=(1, 2, 4, 8, 16, 32),
                    len_buckets=(16, 32, ..., >= max_len))
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
`[B, S, dr]`, indexed by absolute position) of a group holds its n rows; a call runs on a
sub-batch of the requested rows, gathered from the group cache into a batch bucket and
scattered back afterwards (padding rows have segment id 0, which the model never writes into
the cache). One decode step samples every active row's next token from the logits it holds
and feeds that token through the model at its position, which writes it into the cache and
yields the next logits; finished rows ride along with segment 0 until the whole batch is done.
Compiled shapes: batch bucket x prefill length bucket x cache capacity bucket (the cache grows
by whole buckets, so short rows do not pay for `max_len` attention), so a run compiles a
handful of programs and none per request. `compilations` counts the traces.

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

from coder.infer import sampling
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
    """n rows that share a prompt: the cache `[nb, capacity]`, next-token logits `[nb, V]` and
    last hidden state `[nb, D]` of every row, and the host-side bookkeeping of each row.

    nb is n rounded up to a batch bucket (so groups of 3 and 4 share compiled programs); the
    rows past n are scratch space that no row owns."""

    def __init__(self, rows, cache, logits, hidden, capacity):
        self.rows = rows
        self.cache = cache
        self.logits = logits
        self.hidden = hidden
        self.capacity = capacity

    @property
    def n(self) -> int:
        return len(self.rows)

    @property
    def slots(self) -> int:
        return jax.tree.leaves(self.cache)[0].shape[0]

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
                 len_buckets=None, cache_dtype=None):
        if max_len < 2:
            raise ValueError(f"max_len={max_len}: need room for a prompt and a token")
        self.cfg = model_cfg
        self.max_len = int(max_len)
        self.batch_buckets = tuple(sorted(set(int(b) for b in batch_buckets)))
        self.len_buckets = tuple(sorted(set(int(b) for b in (len_buckets or default_len_buckets(max_len)))))
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
        self.decode_steps = 0  # batched decode steps
        self._check_cache_layout()
        self._prefill_fn = jax.jit(self._counted("prefill", self._prefill_impl), static_argnums=2)
        self._decode_fn = jax.jit(self._counted("decode", self._decode_impl))
        self._take_fn = jax.jit(self._counted("take", _take_rows))
        self._put_fn = jax.jit(self._counted("put", _put_rows))
        self._grow_fn = jax.jit(self._counted("grow", _grow), static_argnums=1)
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
        if not share_prefix:
            group = self._empty_group(prompt, n, _bucket(self.batch_buckets, n), cap)
            self._prefill_pending(group, list(range(n)))
            return group
        seed = self._empty_group(prompt, 1, 1, cap)
        self._prefill_pending(seed, [0])
        r0 = seed.rows[0]
        rows = [_Row(tokens=list(prompt), length=r0.length, expert_chunks=list(r0.expert_chunks),
                     logits_version=r0.logits_version) for _ in range(n)]
        slots = _bucket(self.batch_buckets, n)
        cache, logits, hidden = self._broadcast_fn((seed.cache, seed.logits, seed.hidden), slots)
        return Group(rows, cache, logits, hidden, seed.capacity)

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

    # ------------------------------------------------------------------ internals
    def _counted(self, name, fn):
        def traced(*args):
            self.compilations[name] += 1  # runs only when jit traces, i.e. on a cache miss
            return fn(*args)
        return traced

    def _empty_group(self, prompt, n: int, slots: int, capacity: int) -> Group:
        """n rows holding `prompt` as pending tokens, an all-zero cache of `slots` rows."""
        return Group(
            rows=[_Row(tokens=list(prompt), length=0, expert_chunks=[], logits_version=self.policy_version)
                  for _ in range(n)],
            cache=init_cache(self.cfg, slots, capacity, self.cache_dtype),
            logits=jnp.zeros((slots, self.cfg.vocab_size), jnp.float32),
            hidden=jnp.zeros((slots, self.cfg.hidden_size), self.cache_dtype),
            capacity=capacity,
        )

    def _check_cache_layout(self):
        """Every cache leaf must be `[batch, slots, ...]` (the contract); fail early otherwise."""
        a = jax.eval_shape(lambda: init_cache(self.cfg, 2, 8, self.cache_dtype))
        b = jax.eval_shape(lambda: init_cache(self.cfg, 3, 5, self.cache_dtype))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            if x.shape[:2] != (2, 8) or y.shape[:2] != (3, 5):
                raise ValueError(f"init_cache leaf {x.shape} is not [batch, max_len, ...]")

    def _sync_weights(self):
        with self._lock:
            pending, self._pending_weights = self._pending_weights, None
        if pending is not None:
            self._state = pending[0]
            self.policy_version = self.policy_version + 1 if pending[1] is None else int(pending[1])

    def _forward(self, state, tokens, positions, segment_ids, cache):
        model = nnx.merge(self._graphdef, state)
        logits, aux = model(tokens, positions, segment_ids, cache=cache)
        return logits, aux

    def _prefill_impl(self, state, store, identity, idx, tokens, positions, segment_ids, last):
        """Prefill group rows `idx` `[B]` (store = (cache, logits, hidden) of the whole group).

        tokens/positions/segment_ids `[B,T]`, last `[B]` index of each row's last real token.
        The rows are gathered from the group cache, run, and scattered back (unless `identity`:
        idx is every slot in order). Returns (store with the rows' cache written and their
        logits / hidden at `last`, expert ids `[moe_layers, B, T, top_k]`)."""
        cache = store[0] if identity else _take_rows(store[0], idx)
        logits, aux = self._forward(state, tokens, positions, segment_ids, cache)
        pick = last[:, None, None]
        last_logits = jnp.take_along_axis(logits, pick, axis=1)[:, 0]
        last_hidden = jnp.take_along_axis(aux["hidden"], pick, axis=1)[:, 0].astype(self.cache_dtype)
        sub = (aux["cache"], last_logits, last_hidden)
        return (sub if identity else _put_rows(store, idx, sub)), aux["expert_ids"]

    def _decode_impl(self, state, cache, logits, hidden, row_ids, positions, active, rng,
                     temperature, top_k, top_p):
        """One step for `[B]` rows: sample from `logits` `[B,V]`, feed the token at `positions`.

        Inactive rows feed with segment 0 (no cache write) and keep their logits/hidden.
        Returns (tokens `[B]`, logprobs `[B]`, logits `[B,V]`, hidden `[B,D]`, cache, expert ids
        `[moe_layers, B, top_k]`)."""
        keys = sampling.row_keys(rng, row_ids, positions)
        tok, logp = sampling.sample(logits, keys, temperature, top_k, top_p)
        seg = active.astype(jnp.int32)[:, None]
        new_logits, aux = self._forward(state, tok[:, None], positions[:, None], seg, cache)
        new_logits = jnp.where(active[:, None], new_logits[:, 0], logits)
        new_hidden = jnp.where(active[:, None], aux["hidden"][:, 0].astype(hidden.dtype), hidden)
        return tok, logp, new_logits, new_hidden, aux["cache"], aux["expert_ids"][:, :, 0]

    def _ensure_capacity(self, group: Group, need: int) -> None:
        if need > group.capacity:
            cap = _bucket(self.len_buckets, need)
            group.cache = self._grow_fn(group.cache, cap)
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
                (group.cache, group.logits, group.hidden), eids = self._prefill_fn(
                    self._state, (group.cache, group.logits, group.hidden), identity, idx,
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
        k = len(rows)
        bb = _bucket(self.batch_buckets, k)
        idx, identity = _row_index(rows, bb, group.slots)
        store = (group.cache, group.logits, group.hidden)
        sub_cache, logits, hidden = store if identity else self._take_fn(store, idx)
        cap = group.capacity
        lengths = np.zeros((bb,), np.int32)
        lengths[:k] = [group.rows[r].length for r in rows]
        active = np.zeros((bb,), bool)
        active[:k] = True
        row_ids = np.where(idx < group.n, idx, 0).astype(np.int32)  # sampling keys
        temperature = np.float32(params.temperature)
        top_k = np.int32(params.top_k)
        top_p = np.float32(params.top_p)
        stops = set(int(s) for s in params.stop_token_ids)
        toks = [[] for _ in range(k)]
        logps = [[] for _ in range(k)]
        experts = [[] for _ in range(k)]
        versions = [[] for _ in range(k)]
        reasons = [None] * k
        while active.any():
            self._sync_weights()
            need = int(lengths[active].max()) + 1
            if need > cap:
                cap = _bucket(self.len_buckets, need)
                sub_cache = self._grow_fn(sub_cache, cap)
            tok, logp, logits, hidden, sub_cache, eids = self._decode_fn(
                self._state, sub_cache, logits, hidden, row_ids, lengths, active, rng,
                temperature, top_k, top_p)
            tok, logp, eids = np.asarray(tok), np.asarray(logp), np.asarray(eids)
            self.decode_steps += 1
            for j in np.flatnonzero(active[:k]):
                row = group.rows[rows[j]]
                t = int(tok[j])
                toks[j].append(t)
                logps[j].append(float(logp[j]))
                experts[j].append(eids[:, j])
                versions[j].append(row.logits_version)
                row.tokens.append(t)
                row.expert_chunks.append(eids[None, :, j])
                row.length += 1
                row.logits_version = self.policy_version
                lengths[j] += 1
                if t in stops:
                    reasons[j] = "stop"
                elif row.length >= self.max_len:
                    reasons[j] = "max_len"
                elif len(toks[j]) >= params.max_new_tokens:
                    reasons[j] = "length"
                if reasons[j] is not None:
                    row.finish_reason = reasons[j]
                    active[j] = False
        if identity:
            group.cache, group.logits, group.hidden, group.capacity = sub_cache, logits, hidden, cap
        else:
            self._ensure_capacity(group, cap)
            group.cache, group.logits, group.hidden = self._put_fn(
                (group.cache, group.logits, group.hidden), idx, (sub_cache, logits, hidden))
        return {
            r: Generation(toks[j], logps[j],
                          np.stack(experts[j]) if experts[j] else _empty_experts(self.moe_layers, self.top_k_experts),
                          reasons[j], versions[j])
            for j, r in enumerate(rows)
        }


# ---------------------------------------------------------------------- cache plumbing (pure)
def _signature(state):
    return jax.tree.structure(state), tuple((x.shape, x.dtype) for x in jax.tree.leaves(state))


def _row_index(rows, bucket: int, slots: int) -> tuple:
    """Group slot of each batch slot `[bucket]`, and whether that is every slot in order.

    If the batch covers the group's storage exactly, padding batch slots take the group's
    scratch slots (no gather / scatter needed: padding has segment 0 and writes nothing);
    otherwise padding gets `slots` (out of range: gathers clip, scatters drop)."""
    idx = np.full((bucket,), slots, np.int32)
    idx[:len(rows)] = rows
    if bucket == slots and sorted(rows) == list(rows) and list(rows) == list(range(len(rows))):
        return np.arange(bucket, dtype=np.int32), True
    return idx, False


def _take_rows(tree, idx):
    """Gather batch rows `idx` `[b]` of every leaf `[n, ...]` -> `[b, ...]`."""
    return jax.tree.map(lambda x: jnp.take(x, idx, axis=0, mode="clip"), tree)


def _put_rows(tree, idx, sub):
    """Scatter `sub` leaves `[b, ...]` into rows `idx` of `tree` leaves `[n, ...]` (padding dropped).

    A sub-cache may have grown past the group cache's capacity only if the group cache was
    grown first (Engine._ensure_capacity), so shapes match past the batch axis."""
    return jax.tree.map(lambda x, s: x.at[idx].set(s.astype(x.dtype), mode="drop"), tree, sub)


def _grow(cache, capacity: int):
    """Zero-pad every cache leaf `[B, S, ...]` to `[B, capacity, ...]`."""
    def pad(x):
        widths = [(0, 0)] * x.ndim
        widths[1] = (0, capacity - x.shape[1])
        return jnp.pad(x, widths)
    return jax.tree.map(pad, cache)


def _broadcast(tree, n: int):
    """Repeat the single row of every leaf `[1, ...]` to `[n, ...]`."""
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (n,) + x.shape[1:]), tree)
