"""The actor-learner system of stage grpo: actors on Ray, the learner in the stage's process,
weights through the weight store (docs/rl.md, section 4).

    learner  (the stage's process; each process of a multi-controller JAX job runs its own: with
              Ray actors, process 0's Driver takes every group and scatters them to the others,
              coder/rl/step_channel.py)
      Driver.take()             the step's B groups of rollouts, as its actors finish them
      Learner.batch, one step   (tokens more than grpo.max_staleness versions old carry no loss)
      learner_weights().publish()  the new version, in the serving dtype, to the weight store
      Driver.published(v)       nudges the actors to poll the store now
    actor    (ActorWorker: a Ray actor process, rl.num_actors of them; or rl.num_actors = 0:
              threads inside the learner's process, the same class without Ray)
      an Engine on this process's devices, built from the store's newest version
      coder.rl.actor.Actor: the agent loops (one thread per rollout), env worker processes
      run_group(work)           one task's G rollouts, started only once the actor holds weights
                                of version >= work.min_version (the staleness bound)
      a poller thread           EngineFollower.poll() -> engine.set_weights(state, version): applied
                                between two decode calls, rows keep their caches, so one rollout
                                may hold tokens of several versions (each token records its own)

Two modes, the same pieces (`grpo.async`):
- async: each actor holds up to `capacity` groups at once (its engine's slots / G); the driver
  keeps at most (grpo.max_staleness + 1) x B groups outstanding (queued or rolling out), so a
  group handed out while the learner is at version u is trained at about u + (groups ahead of
  it) / B; it starts only with weights >= that step - grpo.max_staleness (`Work.min_version`),
  so actors never run further ahead than the learner's mask allows. The learner takes whichever
  B groups finished first; a group overtaken many times grows stale and the learner masks its
  old tokens (Learner.batch).
- sync: one actor; the step's B tasks are handed out only when nothing is outstanding, with
  min_version = the learner's version (weights synced before the collection), and the learner
  waits for all B (the queue drained every step), in task order.

Failures: a Ray actor whose process dies is restarted by Ray (MAX_RESTARTS); the groups it was
rolling out are dropped, never scored, counted (`dropped_rollouts`), and their tasks handed out
again (a task lost MAX_ATTEMPTS times is skipped, logged). A dead env worker is already an
InfraError inside a rollout (masked in its group). Any other exception of an actor is a bug and
stops the run.

Single epoch: each driver walks its tasks in order (process 0's all of them with Ray actors,
each process its share with the actor in its own process); `Epoch` records which ones
were used (trained on, or skipped) and travels in every checkpoint as the trainer's data state,
so a resumed stage continues with the next unused tasks. Groups in flight when a run stopped
were never trained on: the resumed run generates them again (same sampling key, new weights).
A group's sampling key is fold_in(fold_in(key(seed), task index), attempt): it depends on the
task, not on the actor or the timing.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import logging
import math
import os
import threading
import time

import jax
import numpy as np

from coder.rl import actor as actor_lib
from coder.rl import dispatch, weight_channel, weight_sync

MAX_RESTARTS = 8  # Ray restarts of one actor process
MAX_ATTEMPTS = 3  # a task whose group was lost with its actor this many times is skipped
POLL_S = 0.5  # an actor polls the store this often when nothing nudges it
WAIT_NOTE_S = 120.0  # a learner step waiting this long for its groups logs where they are


class ActorLost(RuntimeError):
    """The actor process running a call died or is restarting (a group is dropped); `for_good`:
    the actor is dead and Ray will not restart it."""

    def __init__(self, message: str, for_good: bool = False):
        super().__init__(message)
        self.for_good = for_good


@dataclasses.dataclass
class Work:
    """One task's group, as the driver hands it to an actor."""

    index: int  # the task's index in the epoch (global over processes): its sampling key
    task: object  # coder.env.tasks.Task
    attempt: int = 0  # 1, 2, ... when earlier groups of it were lost with their actor
    min_version: int = 0  # the oldest weights version the group may start with
    seed: int = 0

    def key(self):
        return jax.random.fold_in(jax.random.fold_in(jax.random.key(self.seed), self.index), self.attempt)


@dataclasses.dataclass
class GroupResult:
    """One finished group: G Rollouts (plain dataclasses, pickled through Ray)."""

    index: int
    attempt: int
    rollouts: list
    actor: int
    version: int  # the actor's weights version when the group started
    seconds: float  # the group's wall time on the actor (waiting for weights excluded)
    stats: dict  # the actor's cumulative counters when it finished (ActorWorker.stats)


def capacity(config) -> int:
    """Groups one actor rolls out at once: its engine's slots over G (coder.rl.actor.make_engine)."""
    return max(1, actor_lib.engine_slots(config) // int(config.rl.group_size))


def env_workers(config) -> int:
    """Env workers of one actor: rl.env_workers, 0 = one per rollout of `capacity` groups, at
    most 16."""
    rl = config.rl
    return int(rl.env_workers) or min(16, capacity(config) * int(rl.group_size))


def store_url(config, stage_dir: str) -> str:
    return config.rl.weight_store or os.path.join(stage_dir, "weights")


# --- the actor ---------------------------------------------------------------------------------
class ActorWorker:
    """One actor (module docstring): hosted by a Ray actor process (`RayActors`) or by the
    learner's process (`LocalActors`); every method may be called from several threads.

    Args:
      config: the run config (rl, model, mesh, env, seed).
      tokenizer: a coder.data.tokenizer tokenizer, or its `to_record` (through Ray).
      make_episode: `task -> episode`; an `EpisodeFactory` runs its episodes in env workers of
        this actor (rl.env_workers, 0 = one per rollout of `capacity` groups, at most 16; local
        processes or Ray actors, env.workers_backend), any other callable (in-process test
        episodes) in the rollout's thread.
      model_fn: `() -> nnx.Module` giving the model's structure (default Transformer(config.model));
        its weights are never used: they come from the store.
      url: the weight store; the actor starts from its newest complete version.
      timeout_s: how long the actor waits for the weights it needs (default rl.weight_timeout_s):
        the store's first version, the version a group waits for (`run_group`), or a store whose
        reads keep failing (a corrupt leaf, a missing version). Then `run_group` raises, naming
        the store, the version and the leaf, for that group and every later one: the run stops,
        never hangs, and never rolls out on the weights it held when the store failed.
      colocated: colocated mode (rl.colocated): `url` is unused, and the learner gives every
        version by `push` (no store, no poller): each process's staged learner arrays resharded
        on device into the engine's shardings and dtype (coder.rl.weight_channel.OnDevice).
      mesh: the engine's devices (default: this process's, `coder.rl.actor.engine_mesh`). A mesh
        over several processes (coder/rl/actor_group.py, or a colocated learner's job) makes this
        the engine's leader: every process loads its own devices' part of each version
        (`Engine.load_weights`); the other processes follow.

    The engine is built from the abstract model, in the serving dtype (coder.rl.actor.serving_dtype,
    the dtype the learner publishes); every version, the first included, reaches it one way: by
    `push` (colocated) or through its EngineFollower (`first`, then the poller's `try_poll`).
    """

    def __init__(self, config, tokenizer, make_episode, model_fn, url: str, index: int = 0,
                 timeout_s: float | None = None, mesh=None, colocated: bool = False, version: int = -1):
        from flax import nnx

        from coder.data import tokenizer as tokenizer_lib

        if isinstance(tokenizer, dict):
            tokenizer = tokenizer_lib.from_record(tokenizer)
        self.index, self.config, self.url = int(index), config, url
        self.timeout_s = float(config.rl.weight_timeout_s if timeout_s is None else timeout_s)
        self._failed = ""  # the poller's StoreUnreadable, with the actor's words: every run_group raises it
        self._cond = threading.Condition()
        self._nudge = threading.Event()
        self._closed = False

        abstract = nnx.eval_shape(model_fn or actor_lib.model_fn(config))
        self.engine = actor_lib.make_engine(abstract, config, mesh=mesh)
        self.follower = None  # colocated: the learner's arrays, resharded on device at each push
        if not colocated:
            self.follower = weight_channel.EngineFollower(self.engine, url, nnx.state(abstract),
                                                          timeout_s=self.timeout_s)
            version = self.follower.first()  # the learner publishes the actors' first version
        self.version = int(version)
        self.pool = None
        self.actor = actor_lib.Actor(self.engine, tokenizer, config, self._episodes(make_episode))
        # counters (cumulative; the driver diffs them per step)
        self.versions_applied, self.apply_s = 0, 0.0
        self._active, self._idle_s, self._idle_since = 0, 0.0, time.perf_counter()
        self._poller = None
        if self.follower is not None:
            self._poller = threading.Thread(target=self._poll_loop, name=f"actor{index}-weights", daemon=True)
            self._poller.start()
        logging.info("[actor %d] pid %d: engine on %d device(s) of %d process(es), weights version %d", index,
                     os.getpid(), self.engine.mesh.devices.size, self.engine.processes, version)

    def _episodes(self, make_episode):
        """`task -> episode` for the rollout threads: pooled env workers for an EpisodeFactory."""
        from coder.env.pool import PooledEpisode
        from coder.rl.actor import EpisodeFactory

        rl = self.config.rl
        if not (isinstance(make_episode, EpisodeFactory) and rl.concurrent):
            return make_episode
        self.pool = make_episode.pool(env_workers(self.config))  # local processes or Ray actors
        return functools.partial(PooledEpisode, self.pool)

    # --- weights ---------------------------------------------------------------------------
    def _poll_loop(self):
        from coder.rl.weight_channel import StoreUnreadable

        while not self._closed:
            self._nudge.wait(POLL_S)
            self._nudge.clear()
            if self._closed:
                return
            try:
                self._apply(self.follower.try_poll)  # a failed poll is counted, up to timeout_s
            except StoreUnreadable as e:
                self._fail(f"[actor {self.index}] {e} (rl.weight_timeout_s={self.timeout_s:g}): the actor stops "
                           f"rather than roll out with version {self.version}")
                return

    def _fail(self, message: str) -> None:
        """The store failed the actor: every run_group from now on raises StoreUnreadable(the first message)."""
        with self._cond:
            if not self._failed:
                self._failed = message
                logging.error("%s", message)
            self._cond.notify_all()

    def sync(self) -> bool:
        """Applies the store's newest version when it is new; True when it did. Raises what
        reading the store raised."""
        return self._apply(self.follower.poll)

    def _apply(self, poll) -> bool:
        t0 = time.perf_counter()
        version = poll()  # to the engine from its next decode call
        if version is None:
            return False
        with self._cond:
            self.version = version
            self.versions_applied += 1
            self.apply_s += time.perf_counter() - t0
            self._cond.notify_all()
        return True

    def push(self, version: int) -> float:
        """Colocated mode: the learner's arrays every process staged as `version`
        (`weight_channel.stage_on_device`), resharded on device into the engine's shardings and
        dtype from its next decode call on; `Engine.settle()` waits until they are. Returns the
        seconds taken here."""
        t0 = time.perf_counter()
        self.engine.load_weights(weight_channel.OnDevice(int(version)), version)
        with self._cond:
            self.versions_applied += int(version) != self.version  # a reload after a release: not new
            self.version = int(version)
            self.apply_s += time.perf_counter() - t0
            self._cond.notify_all()
        return time.perf_counter() - t0

    def notify(self, version: int | None = None) -> None:
        """The learner published a version: poll now."""
        del version
        self._nudge.set()

    # --- rollouts --------------------------------------------------------------------------
    def run_group(self, work: Work) -> GroupResult:
        """G rollouts of `work.task`, started once the actor holds version >= work.min_version;
        raises once the store is unreadable or that version has not come within `timeout_s`
        (class docstring)."""
        from coder.rl.weight_channel import StoreUnreadable

        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while self.version < work.min_version and not self._closed and not self._failed:
                if time.monotonic() > deadline:
                    if self.follower is None or not self.follower.failures:
                        raise TimeoutError(self._not_there(work.min_version))
                    self._fail(self._not_there(work.min_version))  # the store is failing: the actor stops
                    break
                self._nudge.set()
                self._cond.wait(POLL_S)
            if self._failed:
                raise StoreUnreadable(self._failed)
            version = self.version
            if self._active == 0:
                self._idle_s += time.perf_counter() - self._idle_since
            self._active += 1
        t0 = time.perf_counter()
        try:
            (group,) = self.actor.collect([work.task], work.key())
        finally:
            with self._cond:
                self._active -= 1
                if self._active == 0:
                    self._idle_since = time.perf_counter()
        return GroupResult(work.index, work.attempt, group, self.index, version,
                           time.perf_counter() - t0, self.stats())

    def _not_there(self, needed: int) -> str:
        """Why a group that needs version >= `needed` did not start (run_group's TimeoutError)."""
        if self.follower is None:
            return (f"[actor {self.index}] waited {self.timeout_s:g} s (rl.weight_timeout_s) for weights version >= "
                    f"{needed}: it holds version {self.version}, and the learner pushed none newer (rl.colocated)")
        try:
            newest = weight_sync.latest_version(self.url)
        except Exception as e:  # noqa: BLE001 - the message says so
            newest = f"unknown ({type(e).__name__}: {e})"
        failing = f"; its polls fail: {self.follower.last_error}" if self.follower.failures else ""
        return (f"[actor {self.index}] waited {self.timeout_s:g} s (rl.weight_timeout_s={self.timeout_s:g}) for "
                f"weights version >= {needed} from the weight store {self.url}: it holds version {self.version}, "
                f"the store's newest complete version is {newest}{failing}")

    def stats(self) -> dict:
        """Cumulative counters: engine work, idle seconds (no group rolling out: waiting for
        work or for weights), versions applied, bytes read from the store, seconds applying."""
        with self._cond:
            idle = self._idle_s + (time.perf_counter() - self._idle_since if self._active == 0 else 0.0)
            return dict(pid=os.getpid(), processes=self.engine.processes, version=self.version, idle_s=idle,
                        versions=self.versions_applied,
                        read_bytes=self.follower.bytes_read if self.follower else 0, apply_s=self.apply_s,
                        engine={k: v for k, v in self.engine.stats().items() if not isinstance(v, float)})

    def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._nudge.set()
        if self._poller is not None:
            self._poller.join(timeout=10)
        self.actor.close()
        if self.pool is not None:
            self.pool.close()
        self.engine.close()


# --- hosts: where the actors live --------------------------------------------------------------
class LocalActors:
    """One ActorWorker inside the learner's process (rl.num_actors = 0): no Ray, no second JAX
    runtime; its groups run in threads. Its engine also serves the agent eval."""

    def __init__(self, worker: ActorWorker, slots: int):
        self.workers = [worker]
        self._ex = concurrent.futures.ThreadPoolExecutor(slots, thread_name_prefix="actor-group")

    def __len__(self):
        return 1

    def submit(self, i: int, work: Work):
        return self._ex.submit(self.workers[i].run_group, work)

    def wait(self, tokens: list, timeout: float) -> list:
        done, _ = concurrent.futures.wait(tokens, timeout, return_when=concurrent.futures.FIRST_COMPLETED)
        return list(done)

    def result(self, token) -> GroupResult:
        return token.result()

    def probe(self, i: int):
        return self._ex.submit(self.workers[i].pid)

    def notify(self, version: int) -> None:
        self.workers[0].notify(version)

    def close(self) -> None:
        self._ex.shutdown(wait=False, cancel_futures=True)
        self.workers[0].close()


def local_ray_cpus(config, n: int, processes: int) -> int:
    """Logical CPUs of a local Ray instance for `n` Ray actors of `processes` processes each
    (n = 0: the actor in the learner's process), one more for the driver's calls, and, with
    env.workers_backend "ray", every env worker pool the run starts: each actor's (`env_workers`)
    and the agent eval's in the learner's process 0 (rl.env_workers, else up to 16). A pool
    whose actors the instance cannot place waits for CPUs that never come (ray_pool's start
    timeout): each must fit beside the others."""
    cpus = n * processes + 1
    if config.env.workers_backend == "ray":
        eval_workers = int(config.rl.env_workers) or 16
        workers = max(n, 1) * env_workers(config) + eval_workers
        cpus += math.ceil(workers * float(config.env.ray_num_cpus_per_worker))
    return max(os.cpu_count() or 1, cpus)


def start_ray(config, n: int, processes: int) -> bool:
    """Connects to the Ray cluster at rl.ray_address, or starts a local instance (even when
    RAY_ADDRESS names another cluster) with `local_ray_cpus`. False when Ray was already up."""
    import ray  # heavy: ray (the Ray deployments only)

    if ray.is_initialized():
        return False
    address = str(config.rl.ray_address)
    if address:
        ray.init(address=address)
        return True
    ray.init(address="local", num_cpus=local_ray_cpus(config, n, processes), include_dashboard=False)
    return True


class RayActors:
    """`n` ActorWorkers as Ray actor processes (restarted by Ray when they die), on the cluster
    at `rl.ray_address` or on a local Ray instance started here ("" = local)."""

    def __init__(self, config, n: int, tokenizer, make_episode, model_fn, url: str, slots: int):
        import ray  # heavy: ray (the Ray deployments only)

        from coder.data import tokenizer as tokenizer_lib

        address = str(config.rl.ray_address)
        self._started = start_ray(config, n, processes=1)
        options = dict(max_restarts=MAX_RESTARTS, max_task_retries=0, max_concurrency=slots + 4,
                       **_placement(local=not address))
        remote = ray.remote(ActorWorker).options(**options)
        # the constructor's arguments in the object store, held here for the run: Ray re-runs the
        # constructor with them when it restarts a dead actor (arguments it put there itself for
        # the first call may be freed by then: the restart then fails to start)
        self._args = [ray.put(a) for a in (config, tokenizer_lib.to_record(tokenizer), make_episode, model_fn)]
        self.handles = [remote.remote(*self._args, url, i) for i in range(n)]

    def __len__(self):
        return len(self.handles)

    def submit(self, i: int, work: Work):
        return self.handles[i].run_group.remote(work)

    def wait(self, tokens: list, timeout: float) -> list:
        import ray  # heavy: ray (the Ray deployments only)

        ready, _ = ray.wait(tokens, num_returns=1, timeout=timeout)
        return ready

    def result(self, token) -> GroupResult:
        import ray  # heavy: ray (the Ray deployments only)

        try:
            return ray.get(token)
        except ray.exceptions.RayActorError as e:  # died (restarting) or unreachable
            if e.actor_init_failed:  # not a lost process: the actor cannot start at all
                raise RuntimeError(f"[grpo] an actor failed to start: {e}") from None
            raise ActorLost(str(e).splitlines()[0], isinstance(e, ray.exceptions.ActorDiedError)) from None

    def probe(self, i: int):
        """A call that returns once actor `i` is up (after a restart)."""
        return self.handles[i].pid.remote()

    def notify(self, version: int) -> None:
        for h in self.handles:
            h.notify.remote(version)

    def pids(self, timeout: float = 600.0) -> list[int]:
        import ray  # heavy: ray (the Ray deployments only)

        return ray.get([h.pid.remote() for h in self.handles], timeout=timeout)

    def close(self) -> None:
        import ray  # heavy: ray (the Ray deployments only)

        for h in self.handles:
            try:
                ray.kill(h, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        if self._started:
            ray.shutdown()


def _placement(local: bool) -> dict:
    """Ray resources of one actor: a CPU; on a cluster with accelerators, all of one host's
    (one actor per TPU / GPU host)."""
    if local:
        return {"num_cpus": 1}
    import ray  # heavy: ray (the Ray deployments only)

    try:
        nodes = ray.nodes()
    except Exception:  # noqa: BLE001 - a client that cannot list nodes: let Ray place it
        nodes = []
    for node in nodes:
        res = node.get("Resources", {}) if node.get("Alive") else {}
        if res.get("TPU"):
            return {"num_cpus": 1, "resources": {"TPU": res["TPU"]}}
        if res.get("GPU"):
            return {"num_cpus": 1, "num_gpus": res["GPU"]}
    return {"num_cpus": 1}


# --- the learner's side ------------------------------------------------------------------------
class Epoch:
    """Which of this process's tasks (positions 0, 1, ... in its order) the run has used
    (trained on, or skipped); the trainer saves `get_state()` with every checkpoint."""

    def __init__(self):
        self.below, self.extra = 0, set()  # every position < below is used, and those in extra

    def __contains__(self, pos: int) -> bool:
        return pos < self.below or pos in self.extra

    def add(self, pos: int) -> None:
        self.extra.add(int(pos))
        while self.below in self.extra:
            self.extra.remove(self.below)
            self.below += 1

    def __len__(self) -> int:
        return self.below + len(self.extra)

    def get_state(self) -> dict:
        return {"format": 1, "below": self.below, "extra": sorted(self.extra)}

    def set_state(self, state: dict) -> None:
        self.below, self.extra = int(state["below"]), {int(p) for p in state["extra"]}


def learner_weights(config, url: str):
    """The learner's publisher (weight_channel.ModelPublisher) of stage grpo: every variable, floating
    ones in the serving dtype `rl.engine_dtype or model.dtype`, each process writing its own
    devices' slices."""
    return weight_channel.ModelPublisher(url, dtype=actor_lib.serving_dtype(config),
                                      anchor_every=int(config.rl.anchor_every))


def staleness_histogram(groups: list, version: int, bins: int) -> dict:
    """The staleness of the step's policy tokens (learner `version` minus the version that
    sampled each), as fractions: `staleness_hist_{k}` for k = 0..bins, `staleness_hist_over`
    beyond (those tokens carry no loss: grpo.max_staleness = bins)."""
    counts = np.zeros(bins + 2, np.int64)
    for group in groups:
        for rollout in group:
            for g in rollout.generations:
                pv = np.asarray(g.policy_version)[np.asarray(g.policy, bool)]
                s = version - pv[pv >= 0]
                counts += np.bincount(np.clip(s, 0, bins + 1), minlength=bins + 2)
    frac = counts / max(int(counts.sum()), 1)
    out = {f"staleness_hist_{k}": float(frac[k]) for k in range(bins + 1)}
    out["staleness_hist_over"] = float(frac[bins + 1])
    return out


class Driver:
    """Hands this process's tasks to its actors and queues their finished groups, in a thread of
    its own, so the queue fills while the learner steps (module docstring). Its bookkeeping is
    coder/rl/dispatch.py's: actor health, the staleness gate, the group queue, actor counters.

    Args:
      actors: LocalActors or RayActors.
      order: [(global task index, Task)] of this process's share of the epoch, in order.
      epoch: the positions of `order` already used (a resumed run's).
      needed: groups the run still trains on (steps left x `local`).
      local: groups per learner step from this process.
      version: the learner's version (published before the driver starts).
    """

    def __init__(self, config, actors, order: list, epoch: Epoch, *, needed: int, local: int, version: int):
        self.actors, self.epoch, self.local = actors, epoch, int(local)
        self.asynchronous = bool(config.grpo["async"])
        self.hist_bins = int(config.grpo.max_staleness)
        self.group_size, self.seed = int(config.rl.group_size), int(config.seed)
        self.slots = capacity(config)
        self.position = {index: pos for pos, (index, _) in enumerate(order)}
        self.todo = collections.deque(Work(index, task, 0, 0, self.seed)
                                      for pos, (index, task) in enumerate(order) if pos not in epoch)
        self.needed, self.version = int(needed), int(version)
        self.gate = dispatch.StalenessGate(bound=int(config.grpo.max_staleness) if self.asynchronous else 0,
                                           local=self.local, taken=self.version * self.local)
        self.health = dispatch.ActorHealth(len(actors))
        self.queue = dispatch.GroupQueue()
        self.counters = dispatch.ActorCounters()
        self.pending: dict = {}  # token -> (actor, Work)
        self.probes: dict = {}  # token -> actor
        self.load = [0] * len(actors)
        self.skipped = 0
        self._last_take = time.perf_counter()
        self._cond = threading.Condition()
        self._closing = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="grpo-driver", daemon=True)
        self._thread.start()

    # --- the driver's thread: hand out, collect ---------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    if self._closing:
                        return
                    self._fill()
                    for actor in self.health.due():  # ask each actor that lost a group if it is back
                        self.probes[self.actors.probe(actor)] = actor
                    tokens = list(self.pending) + list(self.probes)
                    if not tokens:
                        self._cond.wait(1.0)  # until the learner takes a batch or publishes
                        continue
                done = self.actors.wait(tokens, 0.5)
                with self._cond:
                    for token in done:
                        self._finished(token)
                    self._cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - handed to the learner by take()
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def _fill(self) -> None:
        """Hands out tasks while an actor that is up has room and the staleness gate admits the
        step the next group would be trained at."""
        while self.todo and len(self.pending) + len(self.queue) < self.needed:
            step = self.gate.step_of(len(self.pending) + len(self.queue))
            if not self.gate.admits(step, self.version):
                return  # the learner must step first
            free = [i for i in self.health.up() if self.load[i] < self.slots]
            if not free:
                return
            i = min(free, key=lambda j: (self.load[j], j))
            work = self.todo.popleft()
            work.min_version = self.gate.min_version(step)
            self.pending[self.actors.submit(i, work)] = (i, work)
            self.load[i] += 1

    def _probed(self, token) -> None:
        from coder.rl.dispatch import ActorState

        actor = self.probes.pop(token)
        try:
            self.actors.result(token)
            state = self.health.answered(actor, back=True)
        except ActorLost as e:
            state = self.health.answered(actor, back=False, for_good=e.for_good)
            if state is ActorState.GONE:
                logging.error("[grpo] actor %d is gone for good (Ray will not restart it): %s", actor, e)
                if self.health.all_gone:
                    raise RuntimeError("[grpo] every actor died and Ray will not restart them") from None
        if state is ActorState.UP:
            logging.info("[grpo] actor %d is back", actor)

    def _finished(self, token) -> None:
        if token in self.probes:
            return self._probed(token)
        actor, work = self.pending.pop(token)
        self.load[actor] -= 1
        try:
            res = self.actors.result(token)
        except ActorLost as e:
            self._lost(actor, work, e)
            return
        self.counters.update(actor, res.stats)
        self.queue.put(res)

    def _lost(self, actor: int, work: Work, err: Exception) -> None:
        self.queue.drop(self.group_size)
        logging.warning("[grpo] actor %d lost the group of task %d (attempt %d): %s", actor, work.index,
                        work.attempt, err)
        self.health.lost(actor)  # no work for it until a probe answers
        if work.attempt + 1 < MAX_ATTEMPTS:
            self.todo.appendleft(Work(work.index, work.task, work.attempt + 1, 0, self.seed))
        else:
            self.skipped += 1
            self.epoch.add(self.position[work.index])  # the run takes the next task instead
            logging.error("[grpo] task %d skipped: its group was lost %d times", work.index, MAX_ATTEMPTS)

    # --- the learner's end -----------------------------------------------------------------
    def published(self, version: int) -> None:
        """The learner published `version`: actors poll now; gates may open."""
        with self._cond:
            self.version = int(version)
            self._cond.notify_all()
        self.actors.notify(self.version)

    def take(self) -> tuple[list | None, dict]:
        """The next step's `local` finished groups ([B][G] Rollouts; in task order in sync mode)
        and the driver's metrics of the step; (None, {}) when the epoch has no tasks left."""
        t0 = next_note = time.perf_counter()
        with self._cond:
            while len(self.queue) < self.local:
                if self._error is not None:
                    raise self._error
                if self._closing:
                    raise RuntimeError("[grpo] the driver closed while the learner waited for groups")
                if not self.pending and not self.todo and not self.health.recovering:
                    return None, {}
                self._cond.wait(1.0)
                if time.perf_counter() > next_note + WAIT_NOTE_S:  # a slow or stuck step shows
                    next_note = time.perf_counter()
                    logging.warning("[grpo] step %d has waited %.0f s for groups: %d of %d finished, %d on "
                                    "actors (states %s), %d tasks not handed out", self.version + 1,
                                    next_note - t0, len(self.queue), self.local, len(self.pending),
                                    [s.value for s in self.health.state], len(self.todo))
            results, received, dropped = self.queue.take(self.local)
            for r in results:
                self.epoch.add(self.position[r.index])
            self.gate.took()
            self.needed -= self.local
            deltas = self.counters.deltas()
            self._cond.notify_all()  # room for the next tasks
        now = time.perf_counter()
        if not self.asynchronous:
            results.sort(key=lambda r: r.index)
        groups = [r.rollouts for r in results]
        versions = [set(v for g in ro.generations for v, p in zip(g.policy_version, g.policy) if p)
                    for grp in groups for ro in grp]
        hist = staleness_histogram(groups, self.version, int(self.hist_bins))
        m = dict(learner_idle_s=now - t0, rollouts_per_s=received / max(now - self._last_take, 1e-9),
                 dropped_rollouts=dropped, dropped_rollouts_total=self.queue.dropped_total,
                 skipped_tasks=self.skipped, rollout_time_s=float(np.mean([r.seconds for r in results])),
                 mixed_version_rollouts=sum(len(v) > 1 for v in versions),
                 version_lag=float(np.mean([self.version - r.version for r in results])),
                 step_seconds=now - self._last_take, **hist, **deltas)
        self._last_take = now
        return groups, m

    def oldest_actor_version(self) -> int:
        with self._cond:
            return self.counters.oldest_version(self.version)

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout=30)
        self.actors.close()
