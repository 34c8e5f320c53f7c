"""The GRPO driver: hands the epoch's tasks to the actors (through coder/rl/actor_hosts.py's
`ActorHost`) and queues their finished groups for the learner, in a thread of its own (docs/rl.md,
section 4).

Two modes, the same pieces (`rl.topology.asynchronous`):
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

Failures: the groups an actor that died was rolling out are dropped, never scored, counted
(`dropped_rollouts`), and their tasks handed out again (a task lost MAX_ATTEMPTS times is skipped,
logged). A dead env worker is already an InfraError inside a rollout (masked in its group). Any
other exception of an actor is a bug and stops the run.

Single epoch: each driver walks its tasks in order (process 0's all of them when it scatters,
each process its share with the actor in its own process: coder/rl/topology.py); `Epoch` records
which ones were used (trained on, or skipped) and travels in every checkpoint as the trainer's
data state, so a resumed stage continues with the next unused tasks. Groups in flight when a run
stopped were never trained on: the resumed run generates them again (same sampling key, new
weights).
"""
from __future__ import annotations

import collections
import logging
import threading
import time

import numpy as np

from coder.rl import dispatch
from coder.rl.actor_hosts import ActorLost
from coder.rl.actor_worker import Work, capacity
from coder.rl.dispatch import ActorState

MAX_ATTEMPTS = 3  # a task whose group was lost with its actor this many times is skipped
WAIT_NOTE_S = 120.0  # a learner step waiting this long for its groups logs where they are


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
        self.asynchronous = bool(config.rl.topology.asynchronous)
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
