"""The rollout and serving engine: continuous batching over a pool of MLA cache slots, multi-step
decode on device, on a mesh. Public API (coder/rl and coder/serve are written against it):

    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=256,
                            stop_token_ids=())
    engine = Engine(model, model_cfg, *, max_len, max_slots=64, decode_steps=16,
                    speculative_k=0, mesh=None, rules=None, dtype=None, quantization=None,
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
        finish_reason "stop" | "length" | "max_len" | "cancelled" (FINISH_REASONS),
        policy_version per token). Row i samples with keys fold_in(fold_in(rng, i), position): its
        tokens do not depend on which rows share its batches (tests compare rows decoded
        together and alone).
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
`quantization` ("int8", "fp8", "int4_experts": coder/infer/quantize.py) holds the weights it
names quantized (weight-only; the KV cache stays in the serving dtype), whatever full-precision
weights it is given: `weights.bytes_per_device` says what they take.

Parts (each its own module): `transport` (coder/infer/transport.py: the engine's role, LOCAL,
LEADER or FOLLOWER, and how a device call reaches every process), `placement`
(coder/infer/placement.py: shardings, the serving dtype, host inputs and outputs), `weights` and
`pool_store` (coder/infer/device_state.py: the served weights with their signature, and the slot
pool on the devices), `sched` (coder/infer/scheduler.py: rows, slots, prefixes, on the host) and
`counters` (coder/infer/counters.py): `prefill_tokens`, `decode_steps`, `decode_calls`,
`emitted`, `offloads` / `swap_ins` (rows moved to host memory and back) and `offloaded_bytes`,
with speculative decoding `drafted` / `accepted` and `accepted_by_depth` `[k]`; `stats()` is
their snapshot with the decode batch occupancy.
"""
from __future__ import annotations

import atexit
import functools
import threading
import time
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from coder.infer import programs, speculative
from coder.infer.counters import EngineCounters
from coder.infer.device_state import DeviceStore, ServedWeights
from coder.infer.placement import Placement
from coder.infer.scheduler import (BATCH_BUCKETS, FINISH_REASONS, Call, Generation, Request, Row, SamplingParams,
                                   Scheduler, bucket, default_len_buckets)
from coder.infer.transport import Transport
from coder.model import init_cache

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
    """Composed of its parts: `transport` (LOCAL / LEADER / FOLLOWER: how device calls reach every
    process), `placement` (where arrays live), `weights` (the served weights and the pending
    update), `pool_store` (the slot pool on the devices), `sched` (the host-side scheduler,
    coder/infer/scheduler.py) and `counters` (what it has done). The engine itself is the public
    API above and the thread that drives the scheduler's work through device calls."""

    thread_safe = True  # generate / append / set_weights may be called from many threads

    def __init__(self, model, model_cfg, *, max_len: int, max_slots: int = 64, decode_steps: int = 16,
                 batch_buckets=BATCH_BUCKETS, len_buckets=None, speculative_k: int = 0,
                 cache_dtype=None, mesh=None, rules=None, dtype=None, admission_timeout_s: float = 300.0,
                 follower_timeout_s: float = 60.0, prefix_cache_slots: int = 0, offload_idle_rows: bool = False,
                 prefix_in_place: bool = False, quantization=None):
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
        self.moe_layers = max(0, model_cfg.num_hidden_layers - model_cfg.first_k_dense_replace)
        self.top_k_experts = int(model_cfg.num_experts_per_tok)
        self.experts_dtype = programs.expert_dtype(int(model_cfg.n_routed_experts))
        self.mesh = mesh
        processes = {d.process_index for d in mesh.devices.flat} if mesh is not None else {jax.process_index()}
        self.transport = Transport(processes, {
            "pool": self._call_pool, "prefill": self._call_prefill, "prefill_pool": self._call_prefill_pool,
            "copy": self._call_copy, "decode": self._call_decode, "weights": self._call_weights},
            timeout_s=follower_timeout_s)
        if offload_idle_rows and self.transport.spans_processes:
            raise ValueError("offload_idle_rows: built for an engine on one process only (over several, a "
                             "slot's state spans the processes' devices and no path moves it to host and back)")
        self.offload_idle_rows = bool(offload_idle_rows)
        self.placement = Placement(mesh, rules, dtype, spans_processes=self.transport.spans_processes)
        self.dtype = self.placement.dtype
        self.cache_dtype = jnp.dtype(cache_dtype or self.dtype or model_cfg.dtype)
        self.counters = EngineCounters(spec_k=self.spec_k, offload=self.offload_idle_rows)
        graphdef, state = nnx.split(model)
        self.weights = ServedWeights(graphdef, state, self.placement, quantization)
        self.pool_store = DeviceStore(model_cfg, self.cache_dtype, self.spec_k, self.placement, self._counted)
        self.policy_version = 0
        self.sched = Scheduler(max_slots=int(max_slots), max_len=self.max_len, spec_k=self.spec_k,
                               num_steps=self.decode_steps_per_call, moe_layers=self.moe_layers,
                               top_k=self.top_k_experts, expert_dtype=self.experts_dtype,
                               prefix_cache_slots=int(prefix_cache_slots), prefix_in_place=bool(prefix_in_place))
        # the engine thread's state, under _lock: the weights waiting to apply and how it runs
        self._lock = threading.Condition()
        self._pending_weights = None  # (nnx.State or a loader, version)
        self._thread = None
        self._busy = False  # the engine thread is between taking work and finishing it
        self._closing = False
        self._broken: BaseException | None = None
        self.admission_timeout_s = float(admission_timeout_s)
        self._stuck_since = None
        self._key_shape = jax.random.key_data(jax.random.key(0)).shape
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

    @property
    def is_leader(self) -> bool:
        """This process takes the engine's calls (one process, or process 0 of several)."""
        return self.transport.is_leader

    @property
    def processes(self) -> int:
        return self.transport.processes

    @property
    def compilations(self):
        """Traces per compiled program (collections.Counter)."""
        return self.counters.compilations

    @property
    def num_compilations(self) -> int:
        return self.counters.num_compilations

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
        self.transport.check_leader("start_group")
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
        self.transport.check_leader("generate")
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
        self.transport.check_leader("set_weights")
        if self.transport.spans_processes:
            raise RuntimeError("set_weights: a state lives on one process; an engine over several "
                               "processes takes weights by load_weights(loader, version)")
        if isinstance(state, nnx.Module):
            state = nnx.state(state)
        with self._lock:
            base = self._pending_weights[0] if self._pending_weights else self.weights.state
        if callable(base):
            raise RuntimeError("set_weights: a load_weights is pending; call one of them at a time")
        new = self.weights.merged(state, base)
        with self._lock:
            self._pending_weights = (new, version)
            self._wake()

    def load_weights(self, loader, version: int | None = None) -> None:
        """Weights that every process of the engine reads for itself, from the next decode call on:
        `loader(shardings)` gets {flat name: the engine's sharding of that leaf} and returns
        {flat name: jax.Array} in them (e.g. coder.rl.weight_channel.StoreLoad(url, version)); it
        must pickle (it travels to the followers). Floating leaves are cast to the engine's dtype."""
        self.transport.check_leader("load_weights")
        with self._lock:
            self._check_alive()
            self._pending_weights = (loader, version)
            self._wake()

    def follow(self) -> str:
        """A follower process's part of the engine: run the leader's device calls until the leader
        closes the engine ("closed") or settles it ("settled": the leader's `settle()`; call
        follow() again for its next calls), or is lost (raises)."""
        return self.transport.follow(lambda release: release and self._release_memory())

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
        self.transport.check_leader("settle")
        with self._lock:
            while self._busy or self._has_work() or self.sched.admissions:
                self._check_alive()
                self._lock.wait(timeout=0.5)
            self._check_alive()
            if release and self.sched.rows:
                raise RuntimeError(f"settle(release=True): {len(self.sched.rows)} row(s) still hold slots "
                                   "(close their groups first)")
            self.transport.settle(release)  # under the lock: the engine thread sends nothing meanwhile
            if release:
                self._release_memory()

    def _release_memory(self) -> None:
        """Drop the slot pool and the weights (settle(release=True)); the weights' structure stays."""
        self.sched.flush_prefixes()
        self.pool_store.release()
        self.weights.release()

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
        self.transport.close()

    def stats(self) -> dict:
        """Counters (cumulative; a caller diffs two snapshots), the decode batch occupancy (rows
        decoding / pool slots, over all steps) and, with speculative decoding, the drafts
        accepted at each depth (`accepted_depth{d}`; depth d is examined only when drafts
        1..d-1 were accepted)."""
        return self.counters.snapshot(rows_offloaded_now=len(self.sched.offloaded))

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

        state = put(jax.tree.map(self.placement.serving, self.weights.state), state_shardings)
        store = jax.eval_shape(lambda: programs.empty_store(self.cfg, batch, capacity, self.cache_dtype, self.spec_k))
        rows_sh = None
        if store_sharding is not None:
            store = put(store, jax.tree.map(store_sharding, store))
            rows_sh = store_sharding(jax.ShapeDtypeStruct((batch,), jnp.int32))
        vec = lambda dt, *shape: jax.ShapeDtypeStruct((batch, *shape), dt, sharding=rows_sh)
        tokens = vec(jnp.int32, prefill_len)
        if store_sharding is not None and Placement.rows_split(store_sharding):  # as _prefill runs it
            prefill = self._prefill_pool_fn.lower(state, store, tokens, tokens, tokens, vec(jnp.int32))
        else:
            prefill = self._prefill_fn.lower(state, store, vec(jnp.int32), tokens, tokens, tokens, vec(jnp.int32))
        inputs = programs.SlotInputs(
            length=vec(jnp.int32), active=vec(jnp.bool_), budget=vec(jnp.int32),
            rng=vec(jnp.uint32, *self._key_shape), temperature=vec(jnp.float32), top_k=vec(jnp.int32),
            top_p=vec(jnp.float32), stops=vec(jnp.int32, 8))
        decode_fn = self._decode_fn if num_steps == self.decode_steps_per_call else jax.jit(functools.partial(
            programs.decode, self.weights.graphdef, num_steps=num_steps, experts_dtype=self.experts_dtype),
            donate_argnums=(1,))
        decode = decode_fn.lower(state, store, inputs, jax.ShapeDtypeStruct((), jnp.int32))
        out = {"prefill": prefill, "decode": decode, "state": state, "store": store}
        if copy_rows:  # a group's prompt copied from its first row to the other `copy_rows` rows
            pairs = jax.ShapeDtypeStruct((copy_rows,), jnp.int32)
            out["copy"] = self._copy_fn.lower(store, pairs, pairs)
        return out

    def _gather_cache(self, slots):
        if self.transport.spans_processes:
            raise RuntimeError("Group.cache: the cache of an engine over several processes spans them")
        if any(s < 0 for s in slots):
            raise RuntimeError("Group.cache: a row is offloaded to host memory (or its group closed)")
        with self._lock:
            idx = jnp.asarray(slots, jnp.int32)
            return jax.tree.map(lambda x: jnp.take(x, idx, axis=0), self.pool_store.store.cache)

    # ------------------------------------------------------------------ the engine thread
    def _wake(self):
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
            self._thread.start()
            _RUNNING.add(self)
        self._lock.notify_all()

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
                self.transport.call("weights", new)
            else:
                self.weights.state = new
            with self._lock:
                self.sched.new_weights()  # cached prefixes and held rows' caches: old weights
            self.policy_version = self.policy_version + 1 if version is None else int(version)

    def _fit_pool(self, capacity_needed: int) -> None:
        """Resize the store to cover the used slots and `capacity_needed` (and every held row).

        The slot count only grows (a batch bucket covering the highest slot ever used): it
        settles at the workload's concurrency, so programs are not recompiled as groups come
        and go. The capacity grows to the length bucket needed and shrinks only to a quarter
        of itself or less (long rows gone), which bounds the shapes a run compiles."""
        ps = self.pool_store
        held = max([r.length for r in self.sched.rows.values()] +
                   [len(tokens) for tokens, _ in self.sched.prefixes.values()], default=0)
        slots = max(bucket(self.batch_buckets, max(self.sched.pool.high, 1)), ps.slots)
        cap = bucket(self.len_buckets, max(capacity_needed, held, 1))
        if ps.capacity and cap < ps.capacity and cap * 4 > ps.capacity:
            cap = ps.capacity
        if ps.store is not None and (slots, cap) == (ps.slots, ps.capacity):
            return
        self.transport.call("pool", slots, cap)

    # ------------------------------------------------------------------ device calls
    # Each runs on every process of the engine with the same host inputs (the leader's, through
    # the transport); what they return is read on the leader.
    def _call_pool(self, slots: int, cap: int) -> None:
        """A store of `slots` slots and `cap` positions (new, or the old one resized)."""
        self.pool_store.fit(slots, cap)

    def _call_prefill(self, *args, fn=None) -> np.ndarray:
        self.weights.require()
        fn = self._prefill_fn if fn is None else fn
        ps, pl = self.pool_store, self.placement
        ps.store, experts = pl.run(fn, self.weights.state, ps.store, *pl.replicated(args))
        return pl.host(experts)

    def _call_prefill_pool(self, *args) -> np.ndarray:
        return self._call_prefill(*args, fn=self._prefill_pool_fn)

    def _call_copy(self, src: np.ndarray, dst: np.ndarray) -> None:
        ps, pl = self.pool_store, self.placement
        ps.store = pl.run(self._copy_fn, ps.store, *pl.replicated((src, dst)))

    def _call_decode(self, fields: dict, stop_below) -> dict:
        ps, pl = self.pool_store, self.placement
        inputs = programs.SlotInputs(**pl.replicated(fields))
        ps.store, emitted = pl.run(self._decode_fn, self.weights.state, ps.store, inputs, pl.replicated(stop_below))
        return {k: pl.host(getattr(emitted, k)) for k in ("tokens", "logprobs", "experts", "count", "stopped",
                                                          "steps", "row_steps", "accepted")}

    def _call_weights(self, loader) -> None:
        self.weights.load(loader)

    # ------------------------------------------------------------------ the scheduler's work
    def _admit(self, admitted) -> None:
        """Prefill each admitted group's prompt once (in its first row's slot), copy it to the
        group's other slots, and release the waiting start_group calls."""
        seeds = [rows[0] for rows, _ in admitted]
        reused = [r for r in seeds if r.reuse is not None]
        if reused:  # cached prefixes: copy their slots, prefill only the rest of each prompt
            self._fit_pool(max(n for _, n in (r.reuse for r in reused)))
            b = bucket(self.batch_buckets, len(reused))
            pad = lambda xs: np.asarray(xs + [self.pool_store.slots] * (b - len(xs)), np.int32)
            self.transport.call("copy", pad([r.reuse[0] for r in reused]), pad([r.slot for r in reused]))
            with self._lock:
                for r in reused:
                    slot, n = r.reuse
                    chunks = self.sched.prefixes[slot][1]  # pinned by admit_ready until now
                    r.length, r.expert_chunks, r.reuse, r.reused = n, [np.concatenate(chunks)[:n]], None, n
        for r in seeds:  # copied prefixes, and those a row took in their own slot (admit_ready)
            if r.reused:
                self.counters.prefix_hits += 1
                self.counters.prefix_tokens += r.reused
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
            pad = lambda xs: np.asarray(xs + [self.pool_store.slots] * (n - len(xs)), np.int32)
            self.transport.call("copy", pad(src), pad(dst))
        for _, call in admitted:
            call.finish_one()

    def _offload(self, rows: list[Row]) -> None:
        """Copy the rows' slot states to host memory; then (unless a generate took a row since it
        was chosen) free their slots."""
        for r in rows:
            host = jax.tree.map(np.asarray, self.placement.run(self._read_slot_fn, self.pool_store.store,
                                                               np.int32(r.slot)))
            with self._lock:
                if self.sched.offload(r, host):
                    self.counters.offloads += 1
                    self.counters.offloaded_bytes += sum(x.nbytes for x in jax.tree.leaves(host))

    def _swap_in(self, rows: list[Row]) -> None:
        """Write offloaded rows' states back into the slots they were given (the pool sized for
        them first; programs.write_slot fits each leaf to the pool's capacity, which holds the row)."""
        self._fit_pool(max(r.length for r in rows))
        ps = self.pool_store
        for r in rows:
            ps.store = self.placement.run(self._write_slot_fn, ps.store, r.host, np.int32(r.slot))
            with self._lock:
                r.host = None
                self.counters.swap_ins += 1

    def _prefill(self, rows: list[Row]) -> None:
        """Write the pending tokens of `rows` (slots held) into the cache, in batches and length
        buckets; rows longer than the largest length bucket go in several chunks."""
        chunk = self.len_buckets[-1]
        ps = self.pool_store
        while True:
            todo = [r for r in rows if r.pending]
            if not todo:
                return
            # a pool split over devices prefills aligned to itself: every row that has tokens, at once
            top = len(todo) if self.placement.pool_split(ps.slots) else self.batch_buckets[-1]
            for i in range(0, len(todo), top):
                part = todo[i:i + top]
                need = max(r.length + min(len(r.pending), chunk) for r in part)
                self._fit_pool(need)
                aligned = self.placement.pool_split(ps.slots)
                b = ps.slots if aligned else bucket(self.batch_buckets, len(part))
                chunks, at, args = self.sched.prefill_batch(part, chunk, self.len_buckets, b, ps.slots,
                                                            aligned=aligned)
                experts = self.transport.call("prefill_pool" if aligned else "prefill", *args)
                self.counters.prefill_tokens += sum(len(c) for c in chunks)
                for r, c in zip(part, chunks):
                    r.prefilled += len(c)
                with self._lock:
                    self.sched.absorb_prefill(part, chunks, at, experts, self.policy_version)

    def _decode(self, ready: list[Row], waiting: bool) -> None:
        """One multi-step decode call over the pool; the rows' requests absorb what it emitted."""
        self._fit_pool(self.sched.needed_capacity(ready))
        slots = self.pool_store.slots
        f = self.sched.decode_inputs(ready, slots, self._key_shape)
        # rows waiting for a slot: hand control back as soon as one row leaves
        stop_below = np.int32(len(ready) if waiting else 1)
        out = self.transport.call("decode", f, stop_below)
        self.counters.count_decode(out, slots)
        with self._lock:
            self.sched.absorb_decode(ready, out, self.policy_version)

    # ------------------------------------------------------------------ internals
    def _counted(self, name, fn):
        def traced(*args, **kw):
            self.counters.compilations[name] += 1  # runs only when jit traces, i.e. on a cache miss
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


@atexit.register
def _close_running():
    for engine in list(_RUNNING):
        engine.close()


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
