"""One RL actor of stage grpo (`ActorWorker`): an Engine on its process's devices, the agent
loops and env workers, and a poller that applies each weights version from the store between two
decode calls (docs/rl.md, section 4).

    ActorWorker   (a Ray actor process, coder/rl/actor_hosts.py `RayActors`; member 0 of an actor
                  group, coder/rl/actor_group.py; or threads of the learner's process, `LocalActors`)
      an Engine on this process's devices (or a group's), built from the abstract model in the
      serving dtype; every version, the first included, through its EngineFollower
      coder.rl.actor.Actor: the agent loops (one thread per rollout), env worker processes
      run_group(work)           one task's G rollouts, started only once the actor holds weights
                                of version >= work.min_version (the staleness bound)
      a poller thread           EngineFollower.try_poll() -> engine.set_weights(state, version):
                                applied between two decode calls, rows keep their caches, so one
                                rollout may hold tokens of several versions (each token records its own)

A group's sampling key is fold_in(fold_in(key(seed), task index), attempt): it depends on the
task, not on the actor or the timing.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import time

import jax

from coder.data import tokenizer as tokenizer_lib
from coder.env.pool import PooledEpisode
from coder.rl import actor as actor_lib
from coder.rl import weight_channel, weight_sync
from coder.rl.actor import EpisodeFactory
from coder.rl.weight_channel import StoreUnreadable

POLL_S = 0.5  # an actor polls the store this often when nothing nudges it


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
      colocated: colocated mode (rl.topology.colocated): `url` is unused, and the learner gives every
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

        rl = self.config.rl
        if not (isinstance(make_episode, EpisodeFactory) and rl.concurrent):
            return make_episode
        self.pool = make_episode.pool(env_workers(self.config))  # local processes or Ray actors
        return functools.partial(PooledEpisode, self.pool)

    # --- weights ---------------------------------------------------------------------------
    def _poll_loop(self):
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
                    f"{needed}: it holds version {self.version}, and the learner pushed none newer (rl.topology.colocated)")
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
