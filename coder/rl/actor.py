"""The inference side of RL: tasks, sandboxed episodes, the engine, and the actor that
produces groups of rollouts with it; scoring of finished groups (rewards and advantages).

`Actor.collect(tasks, rng)` returns G rollouts of each task, `[B][G]`:
- `rl.concurrent=True`: all B x G rollouts at once, one thread per rollout driving its
  `coder.rl.agent.AgentRun` (`agent.drive`). A task's prompt is prefilled once for its G rows
  (`engine.start_group(prompt, G)`); each thread decodes its own row
  (`engine.generate(group, params, key, rows=[i])`, which a thread-safe engine batches with the
  other threads' rows) and runs its tool calls in an env worker (`rl.env_workers` of them:
  processes of this host, coder.env.pool, or Ray actors on CPU nodes, coder.env.ray_pool, as
  `env.workers_backend` says) while the other rows keep decoding.
- `rl.concurrent=False`: task after task with `Agent.run_group` (a group's rows decode together,
  each row's tool calls run on this thread, in local sandboxes).
The sampling key of task i is `fold_in(rng, i)` in both modes, and a row's tokens do not depend
on which rows share its decode batches, so both modes sample the same rollouts.

Used by stage `grpo` (coder/stages/grpo.py) and the agent eval (coder/rl/eval.py).
"""
from __future__ import annotations

import dataclasses
import math
import os
import random
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from coder.env import pool as pool_lib
from coder.env import tasks as tasks_lib
from coder.env.episode import Episode
from coder.env.pool import EpisodePool, PooledEpisode
from coder.env.tools.memory import Memory, repository_key
from coder.infer import embedding, programs, quantize
from coder.infer.engine import Engine, SamplingParams
from coder.infer.scheduler import BATCH_BUCKETS, bucket, default_len_buckets
from coder.model import Transformer, sharding
from coder.rl import agent as agent_lib
from coder.rl import grpo
from coder.rl import reward as reward_lib


# --- tasks and episodes ------------------------------------------------------------------------
def _all_tasks(source: str, seed: int, key: str) -> list:
    """The tasks of `source` (config key `key`): "toy", or a Task JSONL path or glob, local or an
    fsspec URL (`gs://bucket/tasks/*.jsonl`), its files read in sorted order; seeded shuffle."""
    if source == "toy":
        return [t for t, _ in tasks_lib.toy_tasks(45, seed)]
    paths = tasks_lib.glob_files(source)
    if not paths:
        raise FileNotFoundError(f"{key}={source!r}: no Task JSONL file matches this path/glob")
    tasks = [t for p in paths for t in tasks_lib.read_tasks(p)]
    random.Random(seed).shuffle(tasks)
    return tasks


def trained_tasks(config) -> list:
    """The distinct training tasks in their (seeded) order: with the same source for eval, the
    last `rl.eval_num_tasks` are held out; the first `rl.train_num_tasks` of the rest (0 = all)."""
    tasks = _all_tasks(config.rl.tasks, int(config.seed), "rl.tasks")
    if config.rl.eval_tasks == config.rl.tasks:
        tasks = tasks[: len(tasks) - int(config.rl.eval_num_tasks)]
    n = int(config.rl.train_num_tasks)
    if n < 0 or n > len(tasks):
        raise ValueError(f"rl.train_num_tasks={n}: between 0 (all) and the {len(tasks)} training tasks")
    return tasks[:n] if n else tasks


def train_tasks(config) -> list:
    """GRPO's task stream: `rl.epochs` passes over `trained_tasks`, each pass in its own seeded
    order (the first as given). Positions in this list are the epoch's state (a resumed run
    continues where it stopped)."""
    tasks, epochs = trained_tasks(config), int(config.rl.epochs)
    if epochs < 1:
        raise ValueError(f"rl.epochs={epochs}: at least 1")
    out = list(tasks)
    for e in range(1, epochs):
        again = list(tasks)
        random.Random(f"{int(config.seed)}/epoch/{e}").shuffle(again)
        out += again
    return out


def eval_tasks(config) -> list:
    tasks = _all_tasks(config.rl.eval_tasks, int(config.seed), "rl.eval_tasks")
    return tasks[len(tasks) - int(config.rl.eval_num_tasks):]


def check_heldout(config, trained: list, held: list) -> None:
    """ValueError when the agent eval's held-out tasks (`eval_tasks`) overlap the tasks GRPO
    trains on (`trained_tasks`): with two sources (rl.tasks != rl.eval_tasks), a task id or a
    repository in both (coder.env.tools.memory.repository_key: `metadata["repo"]`, else the task's
    `repo`; tasks without one compare by id only), named. One source needs no check: its last
    rl.eval_num_tasks tasks are held out and the others trained on, disjoint by construction."""
    rl = config.rl
    if rl.tasks == rl.eval_tasks:
        return

    def repositories(tasks) -> set:
        return {k.removeprefix("repo:") for k in map(repository_key, tasks) if k.startswith("repo:")}

    ids = sorted({t.id for t in trained} & {t.id for t in held})
    repos = sorted(repositories(trained) & repositories(held))
    if ids or repos:
        raise ValueError(
            f"rl.tasks={rl.tasks!r} and rl.eval_tasks={rl.eval_tasks!r} overlap: held-out tasks GRPO trains on "
            f"{ids[:5]} ({len(ids)}), repositories with tasks in both {repos[:5]} ({len(repos)}): the agent eval "
            "would measure work GRPO trains on. Take them out of one file, or give both keys one source (its "
            f"last rl.eval_num_tasks={rl.eval_num_tasks} tasks are held out, the others trained on)")


def heldout_tasks(config) -> list:
    """The tasks whose code training data must not hold (`data.exclude_tasks`): "eval" = every
    task of `rl.eval_tasks` (its held-out slice, `eval_tasks`, when it is `rl.tasks`' source too),
    and none for "toy" (generated one-line fixes: the train and held-out ones share their
    template by construction and differ in their numbers); "" = none; else a Task JSONL path or
    glob, all of its tasks."""
    source = config.data.exclude_tasks
    if not source or (source == "eval" and config.rl.eval_tasks == "toy"):
        return []
    if source != "eval":
        return _all_tasks(source, int(config.seed), "data.exclude_tasks")
    if config.rl.eval_tasks == config.rl.tasks:
        return eval_tasks(config)
    return _all_tasks(config.rl.eval_tasks, int(config.seed), "rl.eval_tasks")


def offers(rl_cfg, *tools: str) -> bool:
    """Whether `rl.tools` offers any of `tools` to the agent (() = every env tool)."""
    return not rl_cfg.tools or any(t in rl_cfg.tools for t in tools)


class EpisodeFactory:
    """`task -> Episode` (started, in a local sandbox): `Episode.from_config(config.env, ...)`
    with the tools of `rl.tools`, the preamble `rl.system_prompt` and the tool timeout
    `rl.tool_timeout_s`. `kwargs` are the same episode's constructor arguments for env workers,
    where the concurrent actor runs it: `pool(n)` starts them on the backend of
    `env.workers_backend`.

    Memory (the memory_write / memory_read tools, coder/env/tools/memory.py): with `memory_dir` (the
    stage's `{stage_dir}/memory`) the episodes share that run's notes, scoped per repository and
    split; `eval_ids` are the held-out tasks' ids (their notes are the `eval` split, never read
    by a training rollout); a rollout reads the notes other tasks wrote before it started, and
    its own (so a GRPO group's rollouts read the same notes); an agent eval runs in a memory
    session of its own (coder/rl/eval.py). Without it the memory tools answer that memory is off.

    semantic_search (coder/env/tools/semantic_search.py) embeds with `env.semantic_encoder`; the
    "policy" encoder reads `env.semantic_checkpoint`, else `policy_checkpoint` (the stage's
    starting policy, frozen for the run). Built only when `rl.tools` offers the tool."""

    def __init__(self, config, memory_dir: str | None = None, eval_ids=(), policy_checkpoint: str = ""):
        rl, env = config.rl, config.env
        pool_lib.check_config(env)
        memory = Memory.from_config(env, memory_dir, eval_ids) if memory_dir else None
        semantic = embedding.semantic_spec(env, policy_checkpoint) if offers(rl, "semantic_search") else None
        # The agent counts the ids it trains on itself; the count is only used by the episode's
        # text interface, which RL does not call.
        self.kwargs = Episode.config_kwargs(
            env, len, tools=tuple(rl.tools), system_preamble=rl.system_prompt or None,
            tool_timeout_s=float(rl.tool_timeout_s), memory=memory, semantic=semantic)
        self.backend = str(env.workers_backend)
        self.share_verdicts = bool(env.share_verdicts)
        self.ray = {"num_cpus": float(env.ray_num_cpus_per_worker), "resource": str(env.ray_resource),
                    "address": str(rl.topology.ray_address)}

    def pool(self, n_workers: int):
        """`n_workers` env workers running this factory's episodes (an `EpisodePool`): processes
        of this host (`env.workers_backend="local"`) or Ray actors (`"ray"`: coder/env/ray_pool.py,
        on the nodes `env.ray_resource` selects, `env.ray_num_cpus_per_worker` CPUs each). Every
        caller that runs a config's episodes in workers builds them here."""
        if self.backend == "ray":
            from coder.env.ray_pool import RayEpisodePool  # heavy: ray (env.workers_backend "ray" only)

            return RayEpisodePool(n_workers, timeout_s=self.harness_timeout_s, share_verdicts=self.share_verdicts,
                                  **self.ray, **self.kwargs)

        return EpisodePool(n_workers, timeout_s=self.harness_timeout_s, share_verdicts=self.share_verdicts,
                           **self.kwargs)

    @property
    def harness_timeout_s(self) -> float:
        """Longest an env worker may take for one command (a tool call, lint, scoring) before
        it counts as hung: the longest sandbox timeout, plus margin for the sandbox's setup."""
        k = self.kwargs
        return max(k["test_timeout_s"], k["tool_timeout_s"], k["limits"].timeout_s, 60.0) + 120.0

    def __call__(self, task) -> Episode:
        ep = Episode(**self.kwargs)
        ep.reset(task)
        return ep


def episode_factory(config, memory_dir: str | None = None, eval_ids=(),
                    policy_checkpoint: str = "") -> EpisodeFactory:
    return EpisodeFactory(config, memory_dir, eval_ids, policy_checkpoint)


# --- engine ------------------------------------------------------------------------------------
def sampling_params(rl_cfg):
    def make(max_new_tokens, stop_ids):
        return SamplingParams(temperature=float(rl_cfg.temperature), top_p=float(rl_cfg.top_p),
                              top_k=int(rl_cfg.top_k), max_new_tokens=int(max_new_tokens),
                              stop_token_ids=tuple(int(s) for s in stop_ids))

    return make


def model_fn(config):
    """`() -> the config's Transformer` (its structure; the actors' weights come from the store)."""
    return lambda: Transformer(config.model, rngs=nnx.Rngs(0))


def _engine_mesh_config(config, slices: int = 1):
    """The mesh config of `engine_mesh`: the training mesh's expert / tensor / sequence sizes
    (`rl.engine_mesh`'s where not 0), data = -1 (the rest: rows), fsdp = 1."""
    cfg = config.mesh.copy_and_resolve_references()
    own = {axis: int(n) for axis, n in config.rl.engine_mesh.items()}
    unknown = set(own) - {"expert", "tensor", "sequence"}
    if unknown or any(n < 0 for n in own.values()):
        raise ValueError(f"rl.engine_mesh={dict(own)}: sizes >= 0 (0 = the training mesh's) of expert, "
                         f"tensor and sequence only")
    with cfg.unlocked():
        cfg.update(dict(data=-1, fsdp=1, num_slices=slices, **{a: n for a, n in own.items() if n}))
    return cfg


def engine_mesh(config, devices=None):
    """An engine's mesh: `devices` (default: this process's), with the training mesh's expert /
    tensor / sequence axes and everything else over data (rows). The same logical rules as
    training place the weights; FSDP is folded into data (an inference engine gathers nothing
    per step). `rl.engine_mesh` sets the expert / tensor / sequence sizes where they are not 0 (an
    actor slice smaller than the learner's). On a multi-process job each process's actor decodes
    on its own devices; an engine over every process's devices (stage serve on several
    processes) passes `jax.devices()`."""
    devices = jax.local_devices() if devices is None else list(devices)
    slices = len({getattr(d, "slice_index", 0) for d in devices})  # a colocated multislice learner's
    return sharding.make_mesh(_engine_mesh_config(config, slices), devices)


def engine_mesh_shape(config, n_devices: int) -> dict[str, int]:
    """{axis: size} of `engine_mesh` over `n_devices` devices, without any device."""
    return dict(zip(sharding.AXES, sharding.mesh_shape(_engine_mesh_config(config), int(n_devices))))


ENGINE_ATTENTION = ("training", "data_parallel")


def engine_rules(config) -> tuple:
    """The logical rules an engine places weights, caches and activations by: the training rules
    (`rl.engine_attention="training"`), or rows split over the expert axes with attention data
    parallel (`"data_parallel"`, coder.model.sharding.data_parallel_attention). Used by the RL
    actors, stage serve, realtime and the compile stage's engine report."""
    rules = tuple(tuple(r) for r in config.mesh.rules)
    mode = config.rl.engine_attention
    if mode not in ENGINE_ATTENTION:
        raise ValueError(f"rl.engine_attention={mode!r}: one of {ENGINE_ATTENTION}")
    return sharding.data_parallel_attention(rules) if mode == "data_parallel" else rules


def engine_slots(config) -> int:
    """Rows the RL engine holds at once: `rl.engine_slots`, 0 = the larger of a step's B x G
    rollouts (rl.tasks_per_step x rl.group_size) and an eval's groups (rl.eval_samples)."""
    rl = config.rl
    return int(rl.engine_slots) or max(int(rl.tasks_per_step) * int(rl.group_size), int(rl.eval_samples))


def serving_dtype(config):
    """The one dtype of the RL weight path: the floating weights the learner publishes to the
    store, those the engine holds (`make_engine`) and its KV cache: `rl.engine_dtype`, "" =
    model.dtype."""
    return jnp.dtype(config.rl.engine_dtype or config.model.dtype)


def prefix_cache_slots(config) -> int:
    """The RL engine's cached prefixes at most: `rl.prefix_cache_slots`,
    -1 (the default) = every slot but one (`engine_slots(config) - 1`), 0 = no prefix cache.

    A self-summary chain's next window starts with the system prompt and task its previous
    window's row holds: that row's slot, released as the window ends (`agent.Lease.leave`),
    stays a cached prefix, and the next window prefills only the rest (the summary). Cached
    slots never keep a row waiting (admission evicts them, or a window takes its match's slot
    as it is), and new weights flush them, so no prefix of older weights is ever reused
    (coder/infer/scheduler.py)."""
    slots = engine_slots(config)
    n = int(config.rl.prefix_cache_slots)
    if not -1 <= n < slots:
        raise ValueError(f"rl.prefix_cache_slots={n} must be in [-1, engine slots={slots})")
    return slots - 1 if n == -1 else n


def make_engine(model, config, *, mesh=None, prefix_cache: int | None = None):
    """The RL engine on `mesh` (default: `engine_mesh(config)`), with its own copy of the
    model's weights in `serving_dtype(config)` (an abstract model: the weights it is given later,
    from the store or the learner, in that dtype); `engine_slots(config)` slots, and
    `prefix_cache` cached prefixes at most (default `prefix_cache_slots(config)`), the weights
    `rl.engine_quantization` names held quantized (coder.infer.quantize). Refuses (ValueError, before
    anything is placed) an engine that `check_engine_memory` finds too large for its devices."""

    rl = config.rl
    mesh = engine_mesh(config) if mesh is None else mesh
    check_engine_memory(config, dict(mesh.shape), device_bytes_limit(mesh.devices.flat))
    return Engine(model, config.model, max_len=int(rl.context_budget), speculative_k=int(rl.speculative_k),
                  max_slots=engine_slots(config), decode_steps=int(rl.decode_steps), dtype=serving_dtype(config),
                  quantization=rl.engine_quantization, mesh=mesh, rules=engine_rules(config),
                  follower_timeout_s=float(rl.topology.actor_timeout_s), offload_idle_rows=bool(rl.offload_idle_rows),
                  prefix_cache_slots=prefix_cache_slots(config) if prefix_cache is None else int(prefix_cache))


# --- the engine's memory -----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class EngineMemory:
    """What one device of an RL engine holds, by arithmetic on shapes (`engine_memory`):

      weights   bytes of the serving weights on the busiest device: every variable of the model in
                the serving dtype (floating ones), its largest shard under `engine_rules` over the
                engine mesh (a dimension that does not divide is padded, as XLA does);
      slot      bytes of one cache slot at `capacity` positions: the engine's store leaves
                (coder.infer.programs.empty_store: the MLA cache `[C, kv_lora_rank]` +
                `[C, qk_rope_head_dim]` per trunk layer and MTP module, NSA's compressed keys and
                values when on, the held logits `[V]` float32, hidden states `[D]`, the
                speculative residual `[V]`);
      capacity  positions per slot: the engine's length bucket of rl.context_budget (the smallest
                power of two >= it, at least 16), what a row at the budget makes the pool hold;
      batch_shards  the devices a pool's slots split over (the batch axes of the engine rules).

    An arithmetic lower bound: XLA's temporaries (activations, the logits of a prefill chunk, the
    decode loop's buffers) and the allocator's fragmentation come on top; stage compile's plan
    measures the real figure from the compiled programs."""

    weights: int
    slot: int
    capacity: int
    batch_shards: int

    def pool_slots(self, rows: int) -> int:
        """The slots the engine's pool holds for `rows` rows (its batch bucket, scheduler.BATCH_BUCKETS)."""

        return bucket(BATCH_BUCKETS, max(int(rows), 1))

    def per_device(self, rows: int) -> int:
        """Bytes on the busiest device with `rows` rows: the weights + the pool's slots, split over
        `batch_shards` when they divide the pool, else replicated (coder.infer.placement.Placement.store_sharding)."""
        pool = self.pool_slots(rows)
        local = pool // self.batch_shards if pool % self.batch_shards == 0 else pool
        return self.weights + local * self.slot

    def max_rows(self, bytes_limit: int, upto: int) -> int:
        """The largest row count in [1, upto] whose `per_device` fits `bytes_limit` (0: none)."""
        return max((n for n in range(1, int(upto) + 1) if self.per_device(n) <= bytes_limit), default=0)


def engine_memory(config, mesh_shape: dict) -> EngineMemory:
    """`EngineMemory` of the RL engine of `config` on a mesh of `mesh_shape` ({axis: size}, e.g.
    `engine_mesh_shape(config, n_devices)`), from the config alone: the model is built abstractly
    (nnx.eval_shape), nothing is allocated. The serving dtype is `serving_dtype(config)`: the dtype
    of the engine's weights (whichever way they reach it) and of its KV cache; the weights
    `rl.engine_quantization` names take their quantized bytes (int4: half a byte a value)."""

    rules, dtype = engine_rules(config), serving_dtype(config)
    sizes = {axis: int(n) for axis, n in mesh_shape.items()}

    def shards(entry) -> int:  # the devices one dimension splits over (a PartitionSpec entry)
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        return math.prod(sizes[a] for a in axes)

    served = quantize.abstract_served(nnx.state(nnx.eval_shape(model_fn(config))),
                                      quantize.quantization(config.rl.engine_quantization), dtype)

    def shard_bytes(x, spec) -> int:
        spec = tuple(spec) + (None,) * (len(x.shape) - len(spec))
        shard = [-(-n // shards(entry)) for n, entry in zip(x.shape, spec)]
        return (math.prod(shard) * jax.dtypes.itemsize_bits(x.dtype) + 7) // 8

    weights = sum(jax.tree.leaves(jax.tree.map(shard_bytes, served, sharding.state_specs(served, rules))))
    budget = int(config.rl.context_budget)
    capacity = bucket(default_len_buckets(budget), budget)
    store = jax.eval_shape(lambda: programs.empty_store(config.model, 1, capacity, dtype, int(config.rl.speculative_k)))
    slot = sum(math.prod(x.shape[1:]) * x.dtype.itemsize for x in jax.tree.leaves(store))
    return EngineMemory(weights=int(weights), slot=int(slot), capacity=capacity,
                        batch_shards=shards(sharding.mesh_axes_of("batch", rules)))


def device_bytes_limit(devices) -> int | None:
    """The smallest `memory_stats()["bytes_limit"]` of the `devices` this process addresses (TPU,
    GPU), None when none reports one (CPU)."""
    own = [d for d in devices if d.process_index == jax.process_index()]
    limits = [(d.memory_stats() or {}).get("bytes_limit") for d in own]
    limits = [int(n) for n in limits if n]
    return min(limits) if limits else None


def check_engine_devices(config, devices) -> None:
    """`check_engine_memory` of an engine over `devices` (`engine_mesh(config, devices)`) by the
    limit they report (none on CPU: nothing to check)."""
    limit = device_bytes_limit(devices)
    if limit is not None:
        check_engine_memory(config, engine_mesh_shape(config, len(devices)), limit)


def host_memory_bytes() -> int:
    """This host's physical memory in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def format_bytes(n: float) -> str:
    """`n` bytes for a message: GiB from 1 GiB up, else MiB."""
    return f"{n / 2 ** 30:.2f} GiB" if n >= 2 ** 30 else f"{n / 2 ** 20:.1f} MiB"


def check_engine_memory(config, mesh_shape: dict, bytes_limit: int | None) -> None:
    """ValueError naming the keys when the RL engine of `config` on a mesh of `mesh_shape` cannot
    hold, beside its weights, one slot at rl.context_budget tokens, or `engine_slots(config)`
    rows, within `bytes_limit` bytes per device (`device_bytes_limit`; None: the devices report
    no limit, nothing to check). By `engine_memory`, an arithmetic lower bound: a refused engine
    cannot fit; an accepted one may still not (stage compile's plan measures the real figure)."""
    if bytes_limit is None:
        return
    rl = config.rl
    mem = engine_memory(config, mesh_shape)
    where = (f"the RL engine on a mesh of {dict(mesh_shape)} in {serving_dtype(config).name} holds "
             f"{format_bytes(mem.weights)} of weights per device and {format_bytes(mem.slot)} per cache slot "
             f"({mem.capacity} positions)")
    limit = (f"the devices' {format_bytes(bytes_limit)} (memory_stats bytes_limit; an arithmetic lower bound "
             "without XLA's temporaries: stage compile's plan measures the real figure)")
    one = mem.per_device(1)
    if one > bytes_limit:
        raise ValueError(f"rl.context_budget={rl.context_budget}: {where}, so even one row at the budget needs "
                         f"{format_bytes(one)} per device, more than {limit}: lower rl.context_budget, spread the "
                         f"weights over more devices (rl.engine_mesh={dict(rl.engine_mesh)}: the expert / tensor "
                         f"sizes) or serve them narrower (rl.engine_dtype={rl.engine_dtype!r}, "
                         f"rl.engine_quantization={rl.engine_quantization!r})")
    rows = engine_slots(config)
    need = mem.per_device(rows)
    if need > bytes_limit:
        fits = mem.max_rows(bytes_limit, rows)
        raise ValueError(f"rl.engine_slots={rl.engine_slots} ({rows} rows; 0 = the larger of rl.tasks_per_step x "
                         f"rl.group_size and rl.eval_samples): {where}, so {rows} rows need {format_bytes(need)} "
                         f"per device, more than {limit}: set rl.engine_slots <= {fits}, the most rows that fit "
                         "by this estimate")


# --- actor -------------------------------------------------------------------------------------
class _Serialized:
    """An engine that is not thread-safe, called by one thread at a time."""

    thread_safe = True

    def __init__(self, engine):
        self._engine, self._lock = engine, threading.Lock()

    def start_group(self, prompt, n):
        with self._lock:
            return self._engine.start_group(prompt, n)

    def generate(self, group, params, rng, rows=None):
        with self._lock:
            return self._engine.generate(group, params, rng, rows=rows)

    def append(self, group, row, ids):
        with self._lock:
            return self._engine.append(group, row, ids)


class _SharedGroup:
    """A task's engine group, started by the first of its G rollout threads to need it."""

    def __init__(self, n: int):
        self.n, self._lock, self._lease = n, threading.Lock(), None

    def get(self, engine, prompt) -> agent_lib.Lease:
        with self._lock:
            if self._lease is None:
                self._lease = agent_lib.Lease(engine.start_group(prompt, self.n), self.n)
            return self._lease


class Actor:
    """Produces groups of rollouts with an engine (the inference side); see the module
    docstring. `make_episode(task)` builds a rollout's episode; an `EpisodeFactory` runs it in
    the actor's env workers in concurrent mode (started on first use, kept until `close()`),
    any other factory (in-process test episodes) in the rollout's own thread."""

    def __init__(self, engine, tokenizer, config, make_episode):
        self.engine, self.config, self.make_episode = engine, config, make_episode
        self.agent = agent_lib.Agent(engine, tokenizer, config.rl, sampling_params(config.rl))
        # The engine serializes nothing itself unless it says it is thread-safe.
        self._threaded_engine = engine if getattr(engine, "thread_safe", False) else _Serialized(engine)
        self.pool = None
        self._finalizer = None

    def collect(self, tasks, rng, *, group_size: int | None = None, keys=None) -> list[list]:
        """G rollouts for each task: `[B][G]` Rollouts. G is `group_size` (default
        rl.group_size: the agent eval asks for rl.eval_samples); task i samples with `keys[i]`
        (default fold_in(rng, i))."""
        g = int(self.config.rl.group_size if group_size is None else group_size)
        keys = [jax.random.fold_in(rng, i) for i in range(len(tasks))] if keys is None else list(keys)
        if not self.config.rl.concurrent:
            return [self.agent.run_group(t.id, t.prompt, [self.make_episode(t) for _ in range(g)], key)
                    for t, key in zip(tasks, keys)]
        return self._collect_concurrent(tasks, keys, g)

    def _collect_concurrent(self, tasks, keys, g: int) -> list[list]:
        make_episode = self._episode_maker(len(tasks) * g)
        engine, sp = self._threaded_engine, self.agent.sampling_params

        def rollout(task, shared: _SharedGroup, i: int, key):
            episode, seat = None, agent_lib.Seat(engine, None, i)
            try:
                episode = make_episode(task)
                run = self.agent.start(task.id, task.prompt, episode.tools, i)
                seat.lease = shared.get(engine, run.prompt)
                return agent_lib.drive(run, episode, engine, seat, key, sp)
            finally:
                if episode is not None:
                    episode.close()

        shared = [_SharedGroup(g) for _ in tasks]
        jobs = [(t, shared[b], i, keys[b]) for b, t in enumerate(tasks) for i in range(g)]
        with ThreadPoolExecutor(max_workers=len(jobs), thread_name_prefix="rollout") as ex:
            futures = [ex.submit(rollout, *job) for job in jobs]
            flat = [f.result() for f in futures]
        return [flat[b * g:(b + 1) * g] for b in range(len(tasks))]

    def _episode_maker(self, n_rollouts: int):
        """`task -> episode` for the concurrent mode: pooled when the factory allows it."""

        if not isinstance(self.make_episode, EpisodeFactory):
            return self.make_episode
        if self.pool is None:
            n = int(self.config.rl.env_workers) or min(n_rollouts, 16)
            self.pool = self.make_episode.pool(n)
            self._finalizer = weakref.finalize(self, self.pool.close)
        return lambda task: PooledEpisode(self.pool, task)

    def close(self) -> None:
        """Stops the env workers (if any were started)."""
        if self._finalizer is not None:
            self._finalizer()
        self.pool = self._finalizer = None


def score_groups(groups: list[list], rl_cfg) -> dict:
    """Sets `reward` and `advantage` on every rollout; returns the `[N, G]` arrays."""
    outcomes = np.array([[r.outcome for r in g] for g in groups], np.float64)
    correct = np.array([[r.correct for r in g] for g in groups], bool)
    valid = grpo.valid_mask([[bool(r.infra_error) for r in g] for g in groups])
    usage = np.array([[r.usage() for r in g] for g in groups], np.float64)
    aux = np.array([[reward_lib.aux_total(r, rl_cfg.aux_rewards) for r in g] for g in groups])
    broken = np.array([[r.broken_calls > 0 for r in g] for g in groups], bool)
    rewards = reward_lib.group_rewards(outcomes, correct, valid, usage, aux, rl_cfg.length_penalty,
                                       broken, float(rl_cfg.broken_call_penalty))
    adv = np.asarray(grpo.advantages(rewards, correct, valid))
    for i, g in enumerate(groups):
        for j, r in enumerate(g):
            r.reward, r.advantage = float(rewards[i, j]), float(adv[i, j])
    return dict(rewards=rewards, correct=correct, valid=valid, advantages=adv)


def rollout_metrics(groups: list[list]) -> dict:
    """Means over valid rollouts (and counts over all) of what the stage logs."""
    flat = [r for g in groups for r in g]
    ok = [r for r in flat if not r.infra_error]
    m = {"rollouts": len(flat), "infra_failures": len(flat) - len(ok)}
    if flat:  # time the rows spent waiting on the env (tool calls and lint; scoring), all rollouts
        tool = [r.tool_time_s for r in flat]
        m.update(tool_wait_s_sum=float(np.sum(tool)), tool_wait_s=float(np.mean(tool)),
                 score_time_s=float(np.mean([r.score_time_s for r in flat])),
                 shared_verdicts=int(sum(r.verdict_shared for r in flat)))
        # the engine's prefill per rollout: computed, and taken from its prefix cache instead
        computed, saved = sum(r.prefill_tokens for r in flat), sum(r.prefix_tokens_saved for r in flat)
        m.update(prefill_tokens=computed / len(flat), prefix_tokens_saved=saved / len(flat),
                 prefix_saved_frac=saved / (computed + saved) if computed + saved else 0.0)
    if not ok:
        return m

    def mean(f):
        return float(np.mean([f(r) for r in ok]))

    m.update(
        reward=mean(lambda r: r.reward), pass_rate=mean(lambda r: r.correct),
        outcome=mean(lambda r: r.outcome), test_reward=mean(lambda r: r.test_reward),
        broken_call_rate=mean(lambda r: r.broken_calls > 0), turns=mean(lambda r: r.turns),
        tool_calls=mean(lambda r: r.tool_calls), thinking_tokens=mean(lambda r: r.thinking_tokens),
        tool_io_tokens=mean(lambda r: r.tool_io_tokens), output_tokens=mean(lambda r: r.output_tokens),
        summaries=mean(lambda r: r.summaries), tokens_per_rollout=mean(lambda r: r.policy_tokens),
        generations=mean(lambda r: len(r.generations)), submitted=mean(lambda r: r.finish == "submit"),
        abs_advantage=mean(lambda r: abs(r.advantage)),
    )
    return m
