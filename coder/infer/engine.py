"""The rollout and serving engine: continuous batching over a pool of MLA cache slots, multi-step
decode on device, on a mesh. Public API (coder/rl and coder/serve are written against it):

    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=256,
                            stop_token_ids=())
    engine = Engine(model, model_cfg, *, max_len, max_slots=64, decode_steps=16,
                    speculative_k=0, mesh=None, rules=None, dtype=None,
                    batch_buckets=(1, 2, 4, 8, 16, 32), len_buckets=(16, 32, ..., >= max_len))
    group = engine.start_group(prompt_ids, n)
        n rows sharing a prompt: the prompt is prefilled ONCE (one slot) and its cache copied to
        the other n - 1 slots. Blocks until the group has slots (they free as other groups
        close); raises after `admission_timeout_s` during which every slot was held by an open
        group with no row decoding (in one thread, that wait would be forever).
    gens = engine.generate(group, params, rng, rows=None) -> list[Generation]
        Decodes the given rows (default: every row not finished) until each stops. Thread-safe:
        calls from many threads (one per agent) run together in the same decode batches.
        `on_tokens(row, tokens, logprobs)` streams each decode call's new tokens.
        Generation(tokens, logprobs, expert_ids `[n_tokens, moe_layers, top_k]` uint8/uint16,
        finish_reason "stop" | "length" | "max_len", policy_version per token). Row i samples
        with keys fold_in(fold_in(rng, i), position): its tokens do not depend on which rows
        share its batches (tests compare rows decoded together and alone).
    engine.append(group, row, token_ids)
        Observation tokens for a row (a tool's output); the next `generate` of that row prefills
        only them, never the history. The row keeps its slot and cache while it waits, unless
        `offload_idle_rows`: then a waiting row whose slot other work needs moves its slot's
        state (KV cache, logits, hidden states) to host memory, and its next `generate` writes
        it back into a free slot first: the same tokens, with more groups open than slots.
    engine.set_weights(state, version=None)
        New weights (an `nnx.State`, partial states allowed, or a model), from any thread; they
        apply between two decode calls (in flight: rows keep their caches). Every sampled token
        records the policy version whose logits it was drawn from. Sharded states are placed
        on the engine's mesh (gathered across processes when the learner spans several).
    engine.load_weights(loader, version)
        New weights that every process reads for itself (`loader(shardings) -> {flat name:
        jax.Array}`, picklable, e.g. coder.rl.weight_channel.StoreLoad(url, version): each process
        reads only its own devices' slices); applies like set_weights.
    group.close() returns the group's slots (also when the group is garbage-collected).
    group.tokens(row), group.expert_ids(row) `[len, moe_layers, top_k]`, group.length(row).

Over several processes (a multi-controller job, `mesh` spanning every process's devices): each
process builds the same Engine; process 0, the leader, owns the scheduler and takes every call
above; the others call `engine.follow()`, which runs the leader's device calls (coder/infer/
channel.py: their host inputs posted once per call) until the leader's `close()`, or until its
`settle()` hands them back to their own work for a while (a colocated GRPO job: the learner's
step runs on the same devices between two phases of rollouts; `follow()` says which). Same
tokens, logprobs and expert ids as one process on the same devices. Weights then come by
`load_weights` (a `set_weights` state lives on one process); a state that already spans the
job's processes (a colocated learner's) is resharded on device into the engine's shardings. A
follower that dies or stalls makes the leader's next call raise `channel.FollowerLost` naming it.

Recorded logprob of a token: `log_softmax(logits / T)[token]` over the full vocabulary
(T = 0: `log_softmax(logits)`), see coder/infer/sampling.py; a training forward at the same
temperature reproduces it.

How it runs. One thread (started on first use) owns the device store (programs.Store, a pool
of slots) and loops: admit groups waiting for slots (batched prefill of their prompts, then the
slot copies), prefill the observations of rows about to decode, and run one `programs.decode`
call over the whole pool: up to `decode_steps` steps (x (k + 1) tokens with speculative
decoding) on device in one `lax.while_loop`, rows leaving on their stop token or budget. The
host reads the emitted tokens once per call. Callers block on their own rows only.
Compiled shapes: the pool's slot count is a batch bucket covering the highest slot in use (slots
are handed out lowest first), its cache capacity a length bucket covering the longest row (+
the call's room to grow), a prefill chunk a batch bucket x length bucket: a run compiles a
handful of programs and none per request (`compilations` counts traces).

On a mesh: weights shard by the training rules (`coder.model.sharding`: tensor / expert /
fsdp axes), the pool's slots split over the batch axes when they divide the slot count.
`dtype` casts floating weights (e.g. bfloat16 serving weights while the learner keeps float32);
an engine built from an abstract model serves the weights it is given later in it too.

Counters: `prefill_tokens`, `decode_steps`, `decode_calls`, `emitted`, `offloads` / `swap_ins`
(rows moved to host memory and back) and `offloaded_bytes`, with speculative decoding
`drafted` / `accepted` and `accepted_by_depth` `[k]`; `stats()` adds the decode batch occupancy.
"""
from __future__ import annotations

import atexit
import collections
import functools
import itertools
import math
import threading
import time
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from coder.infer import channel as channel_lib
from coder.infer import programs, speculative
from coder.infer.scheduler import (BATCH_BUCKETS, FINISH_REASONS, Call, Generation, Request, Row, SamplingParams,
                                   Scheduler, bucket, default_len_buckets)
from coder.model import init_cache, sharding

__all__ = ["Engine", "Group", "Generation", "SamplingParams", "FINISH_REASONS", "default_len_buckets"]


class Group:
    """n rows that share a prompt. Rows live in the engine's slot pool until `close()`."""

    def __init__(self, engine: "Engine", rows: list[Row]):
        self._engine = engine
        self.rows = rows
        self._finalizer = weakref.finalize(self, engine._release, rows)

    @property
    def n(self) -> int:
        return len(self.rows)

    def tokens(self, row: int) -> list:
        return list(self.rows[row].tokens)

    def length(self, row: int) -> int:
        return len(self.rows[row].tokens)

    def prefill_counts(self, row: int) -> tuple[int, int]:
        """(tokens prefill computed in the row's slot, prompt tokens it took from a cached prefix
        instead); a group's shared prompt counts in its first row only."""
        r = self.rows[row]
        return r.prefilled, r.reused

    def expert_ids(self, row: int) -> np.ndarray:
        return np.concatenate(self.rows[row].expert_chunks, axis=0)

    def finished(self, row: int) -> str | None:
        return self.rows[row].finish_reason

    @property
    def cache(self):
        """The rows' model caches gathered from the pool: leaves `[n, capacity, ...]`."""
        return self._engine._gather_cache([r.slot for r in self.rows])

    def release(self, row: int) -> None:
        """Return one row's slot to the pool (the row is done: e.g. its agent moved on to a new
        generation); the group's other rows keep theirs."""
        self._engine._release([self.rows[row]])

    def close(self) -> None:
        self._finalizer()


class Engine:
    thread_safe = True  # generate / append / set_weights may be called from many threads

    def __init__(self, model, model_cfg, *, max_len: int, max_slots: int = 64, decode_steps: int = 16,
                 batch_buckets=BATCH_BUCKETS, len_buckets=None, speculative_k: int = 0,
                 cache_dtype=None, mesh=None, rules=None, dtype=None, admission_timeout_s: float = 300.0,
                 follower_timeout_s: float = 60.0, prefix_cache_slots: int = 0, offload_idle_rows: bool = False,
                 prefix_in_place: bool = False):
        if max_len < 2:
            raise ValueError(f"max_len={max_len}: need room for a prompt and a token")
        speculative.check_draft_depth("speculative_k", speculative_k, model_cfg.num_mtp_layers)
        if decode_steps < 1 or max_slots < 1:
            raise ValueError(f"decode_steps={decode_steps}, max_slots={max_slots}: both must be >= 1")
        if not 0 <= prefix_cache_slots < max_slots:
            raise ValueError(f"prefix_cache_slots={prefix_cache_slots}: between 0 and max_slots - 1 "
                             f"(max_slots={max_slots}; cached prefixes hold slots no row decodes in)")
        self.cfg = model_cfg
        self.max_len = int(max_len)
        self.spec_k = int(speculative_k)
        self.decode_steps_per_call = int(decode_steps)
        self.batch_buckets = tuple(sorted({int(b) for b in batch_buckets}))
        self.len_buckets = tuple(sorted({int(b) for b in (len_buckets or default_len_buckets(max_len))}))
        if self.batch_buckets[0] < 1 or self.len_buckets[0] < 1:
            raise ValueError("batch_buckets and len_buckets must be positive")
        self.dtype = None if dtype in (None, "") else jnp.dtype(dtype)
        self.cache_dtype = jnp.dtype(cache_dtype or self.dtype or model_cfg.dtype)
        self.moe_layers = max(0, model_cfg.num_hidden_layers - model_cfg.first_k_dense_replace)
        self.top_k_experts = int(model_cfg.num_experts_per_tok)
        self.experts_dtype = programs.expert_dtype(int(model_cfg.n_routed_experts))
        self.mesh, self.rules = mesh, tuple(tuple(r) for r in (rules or ()))
        processes = {d.process_index for d in mesh.devices.flat} if mesh is not None else {jax.process_index()}
        if len(processes) > 1 and processes != set(range(jax.process_count())):
            raise ValueError(f"the engine's mesh spans processes {sorted(processes)}: a multi-process "
                             f"engine spans every process of its job (0..{jax.process_count() - 1})")
        # several processes: process 0 leads, the others follow its calls (module docstring)
        self._channel = (channel_lib.Channel(f"engine{next(_ENGINES)}", timeout_s=follower_timeout_s)
                         if len(processes) > 1 else None)
        self.is_leader = self._channel is None or self._channel.is_leader
        self.processes = len(processes)
        if offload_idle_rows and self._channel is not None:
            raise ValueError("offload_idle_rows: built for an engine on one process only (over several, a "
                             "slot's state spans the processes' devices and no path moves it to host and back)")
        self.offload_idle_rows = bool(offload_idle_rows)
        graphdef, state = nnx.split(model)
        self._graphdef = graphdef
        self._state_shardings = self._weight_shardings(state)
        # an abstract model (nnx.eval_shape) holds its parameter dtype: its weights come later,
        # in the serving dtype, which the engine's signature takes now
        self._state = self._place(state) if not _is_abstract(state) else jax.tree.map(self._serving, state)
        self._state_struct = _signature(self._state)
        self._lock = threading.Condition()
        self._pending_weights = None
        self.policy_version = 0
        self.sched = Scheduler(max_slots=int(max_slots), max_len=self.max_len, spec_k=self.spec_k,
                               num_steps=self.decode_steps_per_call, moe_layers=self.moe_layers,
                               top_k=self.top_k_experts, expert_dtype=self.experts_dtype,
                               prefix_cache_slots=int(prefix_cache_slots), prefix_in_place=bool(prefix_in_place))
        self._store = None  # programs.Store of `_slots` slots and `_capacity` positions
        self._slots = self._capacity = 0
        self._thread = None
        self._busy = False  # the engine thread is between taking work and finishing it
        self._closing = False
        self.admission_timeout_s = float(admission_timeout_s)
        self._stuck_since = None
        self._broken: BaseException | None = None
        self._key_shape = jax.random.key_data(jax.random.key(0)).shape
        self.compilations = collections.Counter()  # traces per compiled program
        self.prefill_tokens = 0  # real tokens run through prefill (shared prompts count once)
        self.prefix_hits = 0  # groups that started from a cached prefix
        self.prefix_tokens = 0  # prompt tokens those groups did not prefill
        self.decode_steps = 0  # decode (or draft + verify) steps
        self.decode_calls = 0  # host calls of the multi-step decode program
        self.emitted = 0  # tokens emitted by decode calls
        self.row_steps = 0  # sum over steps of the rows that took part (occupancy numerator)
        self.slot_steps = 0  # sum over steps of the pool's slot count (occupancy denominator)
        self.drafted = 0  # speculative: drafts proposed for active rows
        self.accepted = 0  # speculative: drafts accepted
        self.accepted_by_depth = np.zeros((self.spec_k,), np.int64)
        self.offloads = self.swap_ins = self.offloaded_bytes = 0
        self._check_cache_layout()
        bind = dict(experts_dtype=self.experts_dtype)
        # the programs that return a new store take the old one's buffers (donated): the pool is
        # held once, not twice (without it K2's 256k decode needed 111 GiB a chip, the cache twice)
        self._prefill_fn = jax.jit(self._counted("prefill", functools.partial(
            programs.prefill, graphdef, spec_k=self.spec_k, **bind)), donate_argnums=(1,))
        self._prefill_pool_fn = jax.jit(self._counted("prefill_pool", functools.partial(
            programs.prefill_pool, graphdef, spec_k=self.spec_k, **bind)), donate_argnums=(1,))
        self._decode_fn = jax.jit(self._counted("decode", functools.partial(
            programs.decode, graphdef, num_steps=self.decode_steps_per_call, **bind)), donate_argnums=(1,))
        self._copy_fn = jax.jit(self._counted("copy", programs.copy_slots), donate_argnums=(0,))
        self._read_slot_fn = jax.jit(self._counted("read_slot", programs.read_slot))
        self._write_slot_fn = jax.jit(self._counted("write_slot", programs.write_slot), donate_argnums=(0,))
        self._resize_fns = {}  # (slots, capacity) -> jitted programs.resize to that shape
        self._calls = {"pool": self._call_pool, "prefill": self._call_prefill, "prefill_pool": self._call_prefill_pool,
                       "copy": self._call_copy, "decode": self._call_decode, "weights": self._call_weights}

    # ------------------------------------------------------------------ public API
    def start_group(self, prompt_ids, n: int) -> Group:
        """Rows sharing `prompt_ids`, prefilled once; blocks until the group has n slots."""
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("start_group: empty prompt")
        if len(prompt) > self.max_len:
            raise ValueError(f"start_group: prompt of {len(prompt)} tokens exceeds max_len={self.max_len}")
        if n < 1:
            raise ValueError(f"start_group: n={n}, need at least one row")
        if n > self.sched.pool.max_slots:
            raise ValueError(f"start_group: n={n} rows exceed the engine's max_slots={self.sched.pool.max_slots}")
        self._check_leader("start_group")
        rows = [Row(tokens=list(prompt), logits_version=self.policy_version) for _ in range(n)]
        call = Call(1)
        with self._lock:
            self._check_alive()
            self.sched.admissions.append((rows, call))
            self._wake()
        self._wait(call)
        return Group(self, rows)

    def append(self, group: Group, row: int, token_ids) -> None:
        """Append observation tokens to `row`; the next generate of the row prefills them."""
        r = group.rows[row]
        ids = [int(t) for t in token_ids]
        if len(r.tokens) + len(ids) > self.max_len:
            raise ValueError(f"append: row {row} would hold {len(r.tokens) + len(ids)} tokens, "
                             f"more than max_len={self.max_len}")
        with self._lock:
            if r.request is not None:
                raise RuntimeError(f"append: row {row} is being decoded by a generate call")
            if r.closed:
                raise RuntimeError(f"append: row {row}'s group was closed")
            r.tokens.extend(ids)
            r.finish_reason = None

    def generate(self, group: Group, params: SamplingParams, rng, rows=None, on_tokens=None) -> list:
        """Decode `rows` (default: all unfinished) until each stops; one Generation per row.

        on_tokens: `fn(row, tokens, logprobs)`, called from the engine's thread with each decode
        call's new tokens of a row (streaming); it must be quick and must not call the engine. A
        truthy return cancels the row: it leaves the batch after these tokens with finish_reason
        "cancelled" (a server's stop string, a client that went away), keeping its slot and cache
        like any finished row, so a later generate of the row continues from there."""
        self._check_leader("generate")
        if rows is None:
            rows = [i for i, r in enumerate(group.rows) if r.finish_reason is None]
        rows = [int(r) for r in rows]
        if len(set(rows)) != len(rows):
            raise ValueError(f"generate: duplicate rows {rows}")
        out, live = {}, []
        for i in rows:
            r = group.rows[i]
            if r.closed:
                raise RuntimeError(f"generate: row {i}'s group was closed")
            if len(r.tokens) >= self.max_len or params.max_new_tokens <= 0:
                reason = "max_len" if len(r.tokens) >= self.max_len else "length"
                r.finish_reason = reason
                out[i] = Generation([], [], np.zeros((0, self.moe_layers, self.top_k_experts), self.experts_dtype),
                                    reason, [])
            else:
                live.append(i)
        if live:
            call = Call(len(live))
            keys = _row_key_data(rng, np.asarray(live, np.uint32))
            with self._lock:
                self._check_alive()
                for i, key in zip(live, keys):
                    r = group.rows[i]
                    if r.request is not None:
                        raise RuntimeError(f"generate: row {i} is already being decoded")
                    stream = None if on_tokens is None else functools.partial(on_tokens, i)
                    r.request = Request(params, key, call, stream)
                self._wake()
            self._wait(call)
            for i in live:
                out[i], group.rows[i].result = group.rows[i].result, None
        return [out[i] for i in rows]

    def set_weights(self, state, version: int | None = None) -> None:
        """Use `state` (nnx.State, possibly partial, or a model) from the next decode call on."""
        self._check_leader("set_weights")
        if self._channel is not None:
            raise RuntimeError("set_weights: a state lives on one process; an engine over several "
                               "processes takes weights by load_weights(loader, version)")
        if isinstance(state, nnx.Module):
            state = nnx.state(state)
        with self._lock:
            base = self._pending_weights[0] if self._pending_weights else self._state
        if callable(base):
            raise RuntimeError("set_weights: a load_weights is pending; call one of them at a time")
        model = nnx.merge(self._graphdef, base)
        nnx.update(model, state)
        if _is_abstract(nnx.state(model)):
            raise RuntimeError("set_weights: the engine holds no weights for some variables (built from an "
                               "abstract model, or released by settle(release=True)): give a whole state, or "
                               "load_weights")
        new = self._place(nnx.state(model))
        if _signature(new) != self._state_struct:
            raise ValueError("set_weights: the new state's structure, shapes or dtypes differ from "
                             "the engine's model (that would recompile every program)")
        with self._lock:
            self._pending_weights = (new, version)
            self._wake()

    def load_weights(self, loader, version: int | None = None) -> None:
        """Weights that every process of the engine reads for itself, from the next decode call on:
        `loader(shardings)` gets {flat name: the engine's sharding of that leaf} and returns
        {flat name: jax.Array} in them (e.g. coder.rl.weight_channel.StoreLoad(url, version)); it
        must pickle (it travels to the followers). Floating leaves are cast to the engine's dtype."""
        self._check_leader("load_weights")
        with self._lock:
            self._check_alive()
            self._pending_weights = (loader, version)
            self._wake()

    def follow(self) -> str:
        """A follower process's part of the engine: run the leader's device calls until the leader
        closes the engine ("closed") or settles it ("settled": the leader's `settle()`; call
        follow() again for its next calls), or is lost (raises)."""
        if self.is_leader:
            raise RuntimeError("follow: this process leads the engine (process 0 takes the calls)")
        while True:
            op, args = self._channel.receive()
            if op == "close":
                return "closed"
            if op == "settle":
                if args[0]:
                    self._release_memory()
                return "settled"
            self._calls[op](*args)

    def settle(self, release: bool = False) -> None:
        """Leader: wait until the engine is idle (pending weights applied, nothing decoding or
        waiting for a slot), then, over several processes, hand the followers back: their
        `follow()` returns "settled", so every process can run programs of its own (a learner's
        step) until the leader's next call, which the followers take in their next `follow()`.
        The caller must start no engine work until settle returns.

        `release`: every process also drops the engine's device memory, its slot pool (KV
        caches) and its weights (a colocated learner steps in that memory); no row may be held
        (close every group first). The next `load_weights` brings weights back, and the next
        group a fresh pool."""
        self._check_leader("settle")
        with self._lock:
            while self._busy or self._has_work() or self.sched.admissions:
                self._check_alive()
                self._lock.wait(timeout=0.5)
            self._check_alive()
            if release and self.sched.rows:
                raise RuntimeError(f"settle(release=True): {len(self.sched.rows)} row(s) still hold slots "
                                   "(close their groups first)")
            if self._channel is not None:  # under the lock: the engine thread sends nothing meanwhile
                self._channel.send("settle", (bool(release),))
            if release:
                self._release_memory()

    def _release_memory(self) -> None:
        """Drop the slot pool and the weights (settle(release=True)); the weights' structure stays."""
        self.sched.flush_prefixes()
        self._store, self._slots, self._capacity = None, 0, 0
        self._state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                                   self._state)

    def close(self) -> None:
        """Stop the engine's thread (pending calls fail); the followers' `follow()` returns."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            if self._thread is not None:
                self._lock.notify_all()
        if self._thread is not None:
            self._thread.join()
        if self._channel is not None and self.is_leader:
            try:
                self._channel.send("close", ())
            except channel_lib.FollowerLost:  # already gone: nothing to stop
                pass

    @property
    def num_compilations(self) -> int:
        return sum(self.compilations.values())

    def stats(self) -> dict:
        """Counters (cumulative; a caller diffs two snapshots), the decode batch occupancy (rows
        decoding / pool slots, over all steps) and, with speculative decoding, the drafts
        accepted at each depth (`accepted_depth{d}`; depth d is examined only when drafts
        1..d-1 were accepted)."""
        s = dict(prefill_tokens=self.prefill_tokens, prefix_hits=self.prefix_hits,
                 prefix_tokens=self.prefix_tokens, decode_steps=self.decode_steps,
                 decode_calls=self.decode_calls, emitted=self.emitted, row_steps=self.row_steps,
                 slot_steps=self.slot_steps, occupancy=self.row_steps / self.slot_steps if self.slot_steps else 0.0,
                 rows_per_step=self.row_steps / self.decode_steps if self.decode_steps else 0.0)
        if self.spec_k:
            s.update(drafted=self.drafted, accepted=self.accepted,
                     **{f"accepted_depth{d + 1}": int(a) for d, a in enumerate(self.accepted_by_depth)})
        if self.offload_idle_rows:
            s.update(offloads=self.offloads, swap_ins=self.swap_ins, offloaded_bytes=self.offloaded_bytes,
                     rows_offloaded_now=len(self.sched.offloaded))
        return s

    def lower(self, batch: int, capacity: int, prefill_len: int, *, state_shardings=None,
              store_sharding=None, num_steps: int = 1, copy_rows: int = 0) -> dict:
        """Lower (never run) the prefill and decode programs of one shape: a pool of `batch`
        slots, cache `capacity`, prefill chunks of `batch` x `prefill_len` tokens, a decode
        call of `num_steps` steps (1: the cost of one step), and with `copy_rows` the slot copy
        that shares a group's prefilled prompt with that many rows. The engine may be built from an
        abstract model (`nnx.eval_shape`): nothing is allocated, which is how stage `compile`
        compiles a full-size engine for a TPU slice. state_shardings: a tree like the model
        state; store_sharding: `leaf -> sharding` for every `[batch, ...]` store leaf.
        Returns {"prefill": Lowered, "decode": Lowered, "state": ..., "store": ...}."""
        def put(tree, shardings):
            if shardings is None:
                return tree
            return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), tree, shardings)

        state = put(jax.tree.map(self._serving, self._state), state_shardings)
        store = jax.eval_shape(lambda: programs.empty_store(self.cfg, batch, capacity, self.cache_dtype, self.spec_k))
        rows_sh = None
        if store_sharding is not None:
            store = put(store, jax.tree.map(store_sharding, store))
            rows_sh = store_sharding(jax.ShapeDtypeStruct((batch,), jnp.int32))
        vec = lambda dt, *shape: jax.ShapeDtypeStruct((batch, *shape), dt, sharding=rows_sh)
        tokens = vec(jnp.int32, prefill_len)
        if store_sharding is not None and self._rows_split(store_sharding):  # as _prefill runs it
            prefill = self._prefill_pool_fn.lower(state, store, tokens, tokens, tokens, vec(jnp.int32))
        else:
            prefill = self._prefill_fn.lower(state, store, vec(jnp.int32), tokens, tokens, tokens, vec(jnp.int32))
        inputs = programs.SlotInputs(
            length=vec(jnp.int32), active=vec(jnp.bool_), budget=vec(jnp.int32),
            rng=vec(jnp.uint32, *self._key_shape), temperature=vec(jnp.float32), top_k=vec(jnp.int32),
            top_p=vec(jnp.float32), stops=vec(jnp.int32, 8))
        decode_fn = self._decode_fn if num_steps == self.decode_steps_per_call else jax.jit(functools.partial(
            programs.decode, self._graphdef, num_steps=num_steps, experts_dtype=self.experts_dtype),
            donate_argnums=(1,))
        decode = decode_fn.lower(state, store, inputs, jax.ShapeDtypeStruct((), jnp.int32))
        out = {"prefill": prefill, "decode": decode, "state": state, "store": store}
        if copy_rows:  # a group's prompt copied from its first row to the other `copy_rows` rows
            pairs = jax.ShapeDtypeStruct((copy_rows,), jnp.int32)
            out["copy"] = self._copy_fn.lower(store, pairs, pairs)
        return out

    # ------------------------------------------------------------------ placement
    def _serving(self, x) -> jax.ShapeDtypeStruct:
        """The shape and dtype the engine serves leaf `x` in: floating leaves in `dtype` (when set)."""
        cast = self.dtype is not None and jnp.issubdtype(x.dtype, jnp.floating)
        return jax.ShapeDtypeStruct(x.shape, self.dtype if cast else x.dtype)

    def _weight_shardings(self, state):
        if self.mesh is None:
            dev = SingleDeviceSharding(jax.local_devices()[0])
            return jax.tree.map(lambda _: dev, state)
        return sharding.state_shardings(state, self.mesh, self.rules)

    def _place(self, state):
        """The engine's own copy of `state`: cast to the serving dtype, on the engine's shardings.
        Always fresh buffers: a trainer donates its arrays to each step."""
        def put(x, sh):
            spans = isinstance(x, jax.Array) and not x.is_fully_addressable and x.sharding != sh
            if spans and self._channel is None:
                x = multihost_utils.process_allgather(x, tiled=True)  # a learner over several hosts
            if self.dtype is not None and jnp.issubdtype(x.dtype, jnp.floating):
                x = x.astype(self.dtype)
            if spans and self._channel is not None:  # every process is in this call: reshard on device
                return jax.jit(_identity, out_shardings=sh)(x)
            if not sh.is_fully_addressable and (not isinstance(x, jax.Array) or x.is_fully_addressable):
                x = np.asarray(x)  # the same host value on every process: each places its devices' part
                return jax.make_array_from_callback(x.shape, sh, lambda i, x=x: x[i])
            return jax.device_put(x, sh)
        placed = jax.tree.map(put, state, self._state_shardings)
        return _fresh_copy(placed)

    def _pool_split(self, slots: int) -> bool:
        """Whether a pool of `slots` splits its rows over several devices (then prefill runs
        aligned to the pool, programs.prefill_pool)."""
        return self._rows_split(self._store_sharding(slots))

    @staticmethod
    def _rows_split(store_sharding) -> bool:
        sh = store_sharding(jax.ShapeDtypeStruct((1,), jnp.int32))
        return isinstance(sh, NamedSharding) and sh.spec and sh.spec[0] is not None and \
            math.prod(sh.mesh.shape[a] for a in ((sh.spec[0],) if isinstance(sh.spec[0], str) else sh.spec[0])) > 1

    def _store_sharding(self, slots: int):
        if self.mesh is None:
            sh = SingleDeviceSharding(jax.local_devices()[0])
            return lambda leaf: sh
        axes = sharding.mesh_axes_of("batch", self.rules)
        axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
        n = int(np.prod([self.mesh.shape[a] for a in axes])) if axes else 1
        split = axes if axes and slots % n == 0 else None
        return lambda leaf: NamedSharding(self.mesh, PartitionSpec(split, *([None] * (leaf.ndim - 1))))

    def _gather_cache(self, slots):
        if self._channel is not None:
            raise RuntimeError("Group.cache: the cache of an engine over several processes spans them")
        if any(s < 0 for s in slots):
            raise RuntimeError("Group.cache: a row is offloaded to host memory (or its group closed)")
        with self._lock:
            idx = jnp.asarray(slots, jnp.int32)
            return jax.tree.map(lambda x: jnp.take(x, idx, axis=0), self._store.cache)

    # ------------------------------------------------------------------ the engine thread
    def _wake(self):
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
            self._thread.start()
            _RUNNING.add(self)
        self._lock.notify_all()

    def _check_leader(self, what: str):
        if not self.is_leader:
            raise RuntimeError(f"{what}: this process follows the engine (call engine.follow()); "
                               "process 0 takes the calls")

    def _check_alive(self):
        if self._broken is not None:
            raise RuntimeError("the engine's thread failed earlier") from self._broken
        if self._closing:
            raise RuntimeError("the engine is closed")

    def _wait(self, call: Call) -> None:
        call.done.wait()
        if call.error is not None:
            raise RuntimeError(f"engine: {call.error}") from call.error

    def _release(self, rows):
        with self._lock:
            for r in rows:
                if r.request is not None:
                    raise RuntimeError("release: the row is being decoded by a generate call")
            self.sched.drop_offloaded(rows)
            self.sched.to_release += [r.slot for r in rows if r.slot >= 0 and r.slot not in self.sched.to_release]
            if self._thread is not None:
                self._lock.notify_all()

    def _has_work(self) -> bool:
        s = self.sched
        room = len(s.pool.free) + len(s.prefixes) + (len(s.idle()) if self.offload_idle_rows else 0)
        admissible = bool(s.admissions) and len(s.admissions[0][0]) <= room
        back = room > 0 and any(r.request is not None for r in s.offloaded)
        return bool(admissible or back or s.to_release or s.decoding() or self._pending_weights)

    def _check_stuck(self) -> None:
        """Groups that wait for slots while every slot is held by an idle open group: fine for a
        while (their agents may be running tools), an error after `admission_timeout_s`."""
        if not self.sched.stuck(self.offload_idle_rows):
            self._stuck_since = None
            return
        now = time.monotonic()
        self._stuck_since = self._stuck_since or now
        if now - self._stuck_since > self.admission_timeout_s:
            n = self.sched.pool.max_slots
            for _, call in self.sched.admissions:
                call.fail(RuntimeError(
                    f"waited {self.admission_timeout_s:.0f} s for a slot while all {n} are held by open "
                    "groups that are not decoding: close() groups you are done with, or raise max_slots"))
            self.sched.admissions = []
            self._stuck_since = None

    def _loop(self):
        while True:
            with self._lock:
                while not self._closing and not self._has_work():
                    self._check_stuck()
                    self._lock.wait(timeout=0.5 if self.sched.admissions else None)
                if self._closing:
                    self.sched.fail_all(RuntimeError("the engine was closed"))
                    return
                self._busy = True
            try:
                self._iterate()
            except BaseException as e:  # noqa: BLE001 - every waiting caller gets it, never a hang
                with self._lock:
                    self._broken = e
                    self._busy = False
                    self.sched.fail_all(e)
                    self._lock.notify_all()
                return
            with self._lock:
                self._busy = False
                self._lock.notify_all()  # settle() waits for an idle engine

    def _iterate(self):
        self._sync_weights()
        with self._lock:
            self.sched.release_closed()
            victims = self.sched.offload_victims() if self.offload_idle_rows else []
        if victims:
            self._offload(victims)
        with self._lock:
            back = self.sched.swap_in_ready()
            admitted = self.sched.admit_ready()
            prefill = self.sched.to_prefill()
        if back:
            self._swap_in(back)
        if admitted:
            self._admit(admitted)
        if prefill:
            self._prefill(prefill)
        with self._lock:
            ready = self.sched.ready()
            waiting = bool(self.sched.admissions)
        if ready:
            self._decode(ready, waiting)

    def _sync_weights(self):
        with self._lock:
            pending, self._pending_weights = self._pending_weights, None
        if pending is not None:
            new, version = pending
            if callable(new):  # load_weights: every process reads its own part
                self._device("weights", new)
            else:
                self._state = new
            with self._lock:
                self.sched.new_weights()  # cached prefixes and held rows' caches: old weights
            self.policy_version = self.policy_version + 1 if version is None else int(version)

    def _fit_pool(self, capacity_needed: int) -> None:
        """Resize the store to cover the used slots and `capacity_needed` (and every held row).

        The slot count only grows (a batch bucket covering the highest slot ever used): it
        settles at the workload's concurrency, so programs are not recompiled as groups come
        and go. The capacity grows to the length bucket needed and shrinks only to a quarter
        of itself or less (long rows gone), which bounds the shapes a run compiles."""
        held = max([r.length for r in self.sched.rows.values()] +
                   [len(tokens) for tokens, _ in self.sched.prefixes.values()], default=0)
        slots = max(bucket(self.batch_buckets, max(self.sched.pool.high, 1)), self._slots)
        cap = bucket(self.len_buckets, max(capacity_needed, held, 1))
        if self._capacity and cap < self._capacity and cap * 4 > self._capacity:
            cap = self._capacity
        if self._store is not None and (slots, cap) == (self._slots, self._capacity):
            return
        self._device("pool", slots, cap)

    def _device(self, op: str, *args):
        """Run device call `op` (one of `self._calls`), on the followers too: they take its host
        inputs first (leader only)."""
        if self._channel is not None:
            self._channel.send(op, args)
        return self._calls[op](*args)

    # ------------------------------------------------------------------ device calls
    # Each runs on every process of the engine with the same host inputs (the leader's); what
    # they return is read on the leader.
    def _call_pool(self, slots: int, cap: int) -> None:
        """A store of `slots` slots and `cap` positions (new, or the old one resized)."""
        target = jax.eval_shape(lambda: programs.empty_store(self.cfg, slots, cap, self.cache_dtype, self.spec_k))
        sh = self._store_sharding(slots)
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh(x)), target)
        out_shardings = jax.tree.map(lambda t: t.sharding, target)
        if self._store is None:
            zeros = lambda: jax.tree.map(lambda t: jnp.zeros(t.shape, t.dtype), target)
            self._store = jax.jit(zeros, out_shardings=out_shardings)()
        else:
            if (slots, cap) not in self._resize_fns:
                fn = self._counted("resize", lambda store, target=target: programs.resize(store, target))
                self._resize_fns[slots, cap] = jax.jit(fn, out_shardings=out_shardings)
            self._store = self._run(self._resize_fns[slots, cap], self._store)
        self._slots, self._capacity = slots, cap

    def _call_prefill(self, *args, fn=None) -> np.ndarray:
        if _is_abstract(self._state):
            raise RuntimeError("the engine was built from an abstract model and has no weights yet: "
                               "load_weights first")
        fn = self._prefill_fn if fn is None else fn
        self._store, experts = self._run(fn, self._state, self._store, *self._global(args))
        return self._host(experts)

    def _call_prefill_pool(self, *args) -> np.ndarray:
        return self._call_prefill(*args, fn=self._prefill_pool_fn)

    def _call_copy(self, src: np.ndarray, dst: np.ndarray) -> None:
        self._store = self._run(self._copy_fn, self._store, *self._global((src, dst)))

    def _call_decode(self, fields: dict, stop_below) -> dict:
        inputs = programs.SlotInputs(**self._global(fields))
        self._store, emitted = self._run(self._decode_fn, self._state, self._store, inputs,
                                         self._global(stop_below))
        return {k: self._host(getattr(emitted, k)) for k in ("tokens", "logprobs", "experts", "count", "stopped",
                                                             "steps", "row_steps", "accepted")}

    def _call_weights(self, loader) -> None:
        from coder.train import flat as flat_lib

        shardings = flat_lib.state_to_flat(self._state_shardings)
        flat = loader(shardings)
        missing = set(shardings) - set(flat)
        if missing:
            raise ValueError(f"load_weights: the loader gave no {sorted(missing)[:5]} ({len(missing)} leaves)")
        held = flat_lib.state_to_flat(self._state)  # the store's dtype (e.g. bf16) -> the engine's, on device
        flat = {k: flat[k] if flat[k].dtype == held[k].dtype else flat[k].astype(held[k].dtype) for k in held}
        new = self._place(flat_lib.flat_to_state(self._state, flat))
        if _is_abstract(self._state):  # built from an abstract model: the first weights set the signature
            self._state_struct = _signature(new)
        elif _signature(new) != self._state_struct:
            raise ValueError("load_weights: the loaded state's shapes or dtypes differ from the engine's model")
        self._state = new

    def _global(self, tree):
        """Host inputs as arrays replicated over the engine's mesh (over several processes a
        numpy input has no device of its own); as they are on one process."""
        if self._channel is None:
            return tree
        rep = NamedSharding(self.mesh, PartitionSpec())
        return jax.tree.map(lambda x: jax.make_array_from_callback(np.shape(x), rep, lambda i, x=np.asarray(x): x[i]),
                            tree)

    def _host(self, x) -> np.ndarray:
        """A program's output on the host (over several processes: gathered, every process calls)."""
        if x.is_fully_addressable:
            return np.asarray(x)
        if x.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    def _run(self, fn, *args):
        if self.mesh is None:
            return fn(*args)
        with sharding.activate(self.mesh, self.rules):
            return fn(*args)

    def _admit(self, admitted) -> None:
        """Prefill each admitted group's prompt once (in its first row's slot), copy it to the
        group's other slots, and release the waiting start_group calls."""
        seeds = [rows[0] for rows, _ in admitted]
        reused = [r for r in seeds if r.reuse is not None]
        if reused:  # cached prefixes: copy their slots, prefill only the rest of each prompt
            self._fit_pool(max(n for _, n in (r.reuse for r in reused)))
            b = bucket(self.batch_buckets, len(reused))
            pad = lambda xs: np.asarray(xs + [self._slots] * (b - len(xs)), np.int32)
            self._device("copy", pad([r.reuse[0] for r in reused]), pad([r.slot for r in reused]))
            with self._lock:
                for r in reused:
                    slot, n = r.reuse
                    chunks = self.sched.prefixes[slot][1]  # pinned by admit_ready until now
                    r.length, r.expert_chunks, r.reuse, r.reused = n, [np.concatenate(chunks)[:n]], None, n
        for r in seeds:  # copied prefixes, and those a row took in their own slot (admit_ready)
            if r.reused:
                self.prefix_hits += 1
                self.prefix_tokens += r.reused
        self._prefill(seeds)
        src, dst = [], []
        for rows, _ in admitted:
            for r in rows[1:]:
                src.append(rows[0].slot)
                dst.append(r.slot)
                r.length, r.logits_version = rows[0].length, rows[0].logits_version
                r.expert_chunks = list(rows[0].expert_chunks)
        if dst:
            n = bucket(self.batch_buckets, len(dst))
            pad = lambda xs: np.asarray(xs + [self._slots] * (n - len(xs)), np.int32)
            self._device("copy", pad(src), pad(dst))
        for _, call in admitted:
            call.finish_one()

    def _offload(self, rows: list[Row]) -> None:
        """Copy the rows' slot states to host memory; then (unless a generate took a row since it
        was chosen) free their slots."""
        for r in rows:
            host = jax.tree.map(np.asarray, self._run(self._read_slot_fn, self._store, np.int32(r.slot)))
            with self._lock:
                if self.sched.offload(r, host):
                    self.offloads += 1
                    self.offloaded_bytes += sum(x.nbytes for x in jax.tree.leaves(host))

    def _swap_in(self, rows: list[Row]) -> None:
        """Write offloaded rows' states back into the slots they were given (the pool sized for
        them first; programs.write_slot fits each leaf to the pool's capacity, which holds the row)."""
        self._fit_pool(max(r.length for r in rows))
        for r in rows:
            self._store = self._run(self._write_slot_fn, self._store, r.host, np.int32(r.slot))
            with self._lock:
                r.host = None
                self.swap_ins += 1

    def _prefill(self, rows: list[Row]) -> None:
        """Write the pending tokens of `rows` (slots held) into the cache, in batches and length
        buckets; rows longer than the largest length bucket go in several chunks."""
        chunk = self.len_buckets[-1]
        while True:
            todo = [r for r in rows if r.pending]
            if not todo:
                return
            # a pool split over devices prefills aligned to itself: every row that has tokens, at once
            top = len(todo) if self._pool_split(self._slots) else self.batch_buckets[-1]
            for i in range(0, len(todo), top):
                part = todo[i:i + top]
                need = max(r.length + min(len(r.pending), chunk) for r in part)
                self._fit_pool(need)
                aligned = self._pool_split(self._slots)
                b = self._slots if aligned else bucket(self.batch_buckets, len(part))
                chunks, at, args = self.sched.prefill_batch(part, chunk, self.len_buckets, b, self._slots,
                                                            aligned=aligned)
                experts = self._device("prefill_pool" if aligned else "prefill", *args)
                self.prefill_tokens += sum(len(c) for c in chunks)
                for r, c in zip(part, chunks):
                    r.prefilled += len(c)
                with self._lock:
                    self.sched.absorb_prefill(part, chunks, at, experts, self.policy_version)

    def _decode(self, ready: list[Row], waiting: bool) -> None:
        """One multi-step decode call over the pool; the rows' requests absorb what it emitted."""
        self._fit_pool(self.sched.needed_capacity(ready))
        f = self.sched.decode_inputs(ready, self._slots, self._key_shape)
        # rows waiting for a slot: hand control back as soon as one row leaves
        stop_below = np.int32(len(ready) if waiting else 1)
        out = self._device("decode", f, stop_below)
        steps = int(out["steps"])
        self.decode_calls += 1
        self.decode_steps += steps
        self.emitted += int(out["count"].sum())
        self.row_steps += int(out["row_steps"].sum())
        self.slot_steps += steps * self._slots
        if self.spec_k:
            self.drafted += self.spec_k * int(out["row_steps"].sum())
            self.accepted += int(out["accepted"].sum())
            self.accepted_by_depth += out["accepted"]
        with self._lock:
            self.sched.absorb_decode(ready, out, self.policy_version)

    # ------------------------------------------------------------------ internals
    def _counted(self, name, fn):
        def traced(*args, **kw):
            self.compilations[name] += 1  # runs only when jit traces, i.e. on a cache miss
            return fn(*args, **kw)
        return traced

    def _check_cache_layout(self):
        """Every cache leaf must be `[batch, ...]` with exactly one later axis growing with the
        capacity (slots: axis 1, or 2 behind init_cache's layer axis) and the others independent of
        it (programs.resize relies on it); fail early otherwise."""
        shapes = lambda b, c: jax.eval_shape(lambda: init_cache(self.cfg, b, c, self.cache_dtype))
        a, b, c = shapes(2, 64), shapes(3, 64), shapes(2, 1024)
        for x, y, z in zip(jax.tree.leaves(a), jax.tree.leaves(b), jax.tree.leaves(c)):
            grows = [i for i in range(1, x.ndim) if x.shape[i] != z.shape[i]]
            if (x.ndim < 2 or (x.shape[0], y.shape[0]) != (2, 3) or x.shape[1:] != y.shape[1:]
                    or len(grows) != 1 or not 0 < x.shape[grows[0]] < z.shape[grows[0]]):
                raise ValueError(f"init_cache leaf {x.shape} (batch 2, capacity 64) is not "
                                 "[batch, ..., slots growing with the capacity, ...] with one such axis")


_RUNNING = weakref.WeakSet()  # engines whose thread runs: stopped before the interpreter exits
_ENGINES = itertools.count()  # multi-process engines, numbered in the order every process builds them


@atexit.register
def _close_running():
    for engine in list(_RUNNING):
        engine.close()


def _signature(state):
    return jax.tree.structure(state), tuple((x.shape, x.dtype) for x in jax.tree.leaves(state))


def _is_abstract(state) -> bool:
    return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(state))


def _identity(x):
    return x


@jax.jit
def _fresh_copy(tree):
    return jax.tree.map(jnp.copy, tree)


@jax.jit
def _fold_rows(rng, rows):
    """fold_in(rng, row) for each of `rows` [n] -> keys [n] (typed or raw, as `rng` is)."""
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(rng, rows)


def _row_key_data(rng, rows: np.ndarray) -> np.ndarray:
    """Key data `[n, *key_shape]` uint32 of fold_in(rng, row) for each row.

    One jitted program per power-of-two row count (the rows padded with zeros, the padding's
    keys dropped): once per group and turn, an eager vmap over a fresh lambda retraced every
    call and took as much of a rollout actor's time as its model's decode (py-spy, the
    sandboxed learning test)."""
    n = len(rows)
    padded = np.zeros(max(1, 1 << (n - 1).bit_length()), np.uint32)
    padded[:n] = rows
    keys = _fold_rows(rng, padded)
    if jnp.issubdtype(keys.dtype, jax.dtypes.prng_key):
        keys = jax.random.key_data(keys)
    return np.asarray(keys)[:n]
