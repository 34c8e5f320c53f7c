"""What the GRPO driver (coder/rl/driver.py `Driver`) keeps track of, one idea per class:

    ActorHealth     each actor UP / DOWN / PROBING / GONE, and the transitions between them
    StalenessGate   the step a group handed out now is trained at, and whether it may go out yet
    GroupQueue      finished groups waiting for the learner; rollouts received and dropped
    ActorCounters   the actors' cumulative counters -> their change since the previous step

None of them talks to an actor or takes a lock: the driver does both (it holds its condition
variable around every call).
"""
from __future__ import annotations

import collections
import enum
import time


class ActorState(enum.Enum):
    UP = "up"  # takes work
    DOWN = "down"  # lost a group (its process died: Ray restarts it); probed when its time comes
    PROBING = "probing"  # a probe call is out
    GONE = "gone"  # Ray will not restart it


class ActorHealth:
    """Each actor's state and its transitions:

        UP --lost a group--> DOWN --probe due--> PROBING --answered--> UP
                                 ^                   |--still restarting--> DOWN (retry_s later)
                                 +-------------------+--lost for good--> GONE
    """

    def __init__(self, n: int, *, retry_s: float = 1.0, clock=time.monotonic):
        self.state = [ActorState.UP] * int(n)
        self.retry_s, self.clock = float(retry_s), clock
        self._probe_at: dict[int, float] = {}

    def up(self) -> list[int]:
        """The actors that take work."""
        return [i for i, s in enumerate(self.state) if s is ActorState.UP]

    def lost(self, actor: int) -> None:
        """`actor` lost a group: no work for it until a probe answers (a DOWN or PROBING actor
        stays as it is)."""
        if self.state[actor] is ActorState.UP:
            self.state[actor] = ActorState.DOWN
            self._probe_at[actor] = self.clock()

    def due(self) -> list[int]:
        """The DOWN actors whose probe is due, now PROBING (the caller sends the probes)."""
        now = self.clock()
        out = [a for a, t in self._probe_at.items() if self.state[a] is ActorState.DOWN and t <= now]
        for a in out:
            self.state[a] = ActorState.PROBING
            del self._probe_at[a]
        return out

    def answered(self, actor: int, *, back: bool, for_good: bool = False) -> ActorState:
        """A probe of `actor` returned: back (UP), still restarting (DOWN, probed again
        `retry_s` later) or lost for good (GONE). Returns the new state."""
        if self.state[actor] is not ActorState.PROBING:
            raise ValueError(f"actor {actor} answered a probe in state {self.state[actor].value}")
        if back:
            self.state[actor] = ActorState.UP
        elif for_good:
            self.state[actor] = ActorState.GONE
        else:
            self.state[actor] = ActorState.DOWN
            self._probe_at[actor] = self.clock() + self.retry_s
        return self.state[actor]

    @property
    def recovering(self) -> bool:
        """Some actor is DOWN or PROBING (it may come back with work to do)."""
        return any(s in (ActorState.DOWN, ActorState.PROBING) for s in self.state)

    @property
    def all_gone(self) -> bool:
        return all(s is ActorState.GONE for s in self.state)


class StalenessGate:
    """When a group may go out. Groups are trained in the order they finish, `local` per learner
    step; with q groups outstanding (handed out or queued) ahead of it, a group handed out now
    is trained at step (taken + q) // local, and it may go out once the learner's version is
    within `bound` of that step (async: grpo.max_staleness; sync: 0, so a step's tasks go out
    once the learner published the weights they are sampled with)."""

    def __init__(self, *, bound: int, local: int, taken: int):
        if local < 1 or bound < 0:
            raise ValueError(f"local={local} must be >= 1 and bound={bound} >= 0")
        self.bound, self.local, self.taken = int(bound), int(local), int(taken)

    def step_of(self, outstanding: int) -> int:
        """The step a group handed out now is trained at."""
        return (self.taken + int(outstanding)) // self.local

    def admits(self, step: int, version: int) -> bool:
        return step - self.bound <= version

    def min_version(self, step: int) -> int:
        """The oldest weights a group of `step` may be sampled with."""
        return step - self.bound

    def took(self) -> None:
        """The learner took a step's groups."""
        self.taken += self.local


class GroupQueue:
    """Finished groups, oldest first, and the rollouts received and dropped (lost with their
    actor) since the previous take and in all."""

    def __init__(self):
        self._results: collections.deque = collections.deque()
        self.received = self.dropped = self.dropped_total = 0

    def __len__(self) -> int:
        return len(self._results)

    def put(self, result) -> None:
        self._results.append(result)
        self.received += len(result.rollouts)

    def drop(self, rollouts: int) -> None:
        self.dropped += rollouts
        self.dropped_total += rollouts

    def take(self, n: int) -> tuple[list, int, int]:
        """(the n oldest results, rollouts received and dropped since the previous take)."""
        if n > len(self._results):
            raise ValueError(f"take({n}) with {len(self._results)} groups queued")
        out = [self._results.popleft() for _ in range(n)]
        received, dropped = self.received, self.dropped
        self.received = self.dropped = 0
        return out, received, dropped


class ActorCounters:
    """The actors' cumulative counters (each actor's latest `stats`: idle_s, versions, read_bytes,
    apply_s, its engine's counters, its pid, processes and weights version) -> their change since
    the previous `deltas()`, summed over actors (and the processes the actors span). A restarted
    actor (another pid) counts from 0."""

    KEYS = ("idle_s", "versions", "read_bytes", "apply_s")

    def __init__(self):
        self.latest: dict = {}  # actor -> its last stats
        self._mark: dict = {}  # actor -> its stats at the previous deltas()

    def update(self, actor: int, stats: dict) -> None:
        self.latest[actor] = stats

    def deltas(self) -> dict:
        d = dict.fromkeys(self.KEYS, 0.0)
        engine_before, engine_after = collections.Counter(), collections.Counter()
        for actor, now in self.latest.items():
            before = self._mark.get(actor)
            if before is None or before["pid"] != now["pid"]:
                before = dict.fromkeys(self.KEYS, 0.0) | {"engine": {}}
            for k in self.KEYS:
                d[k] += now[k] - before[k]
            for k, v in now["engine"].items():
                engine_before[k] += before["engine"].get(k, 0)
                engine_after[k] += v
        self._mark = dict(self.latest)
        per = max(d["versions"], 1)
        return dict(actor_processes=sum(int(s.get("processes", 1)) for s in self.latest.values()),
                    actor_idle_s=d["idle_s"], sync_versions=d["versions"], sync_read_bytes=d["read_bytes"] / per,
                    sync_apply_s=d["apply_s"] / per, engine_before=dict(engine_before),
                    engine_after=dict(engine_after))

    def oldest_version(self, default: int) -> int:
        """The oldest weights version an actor reported (`default` before any report)."""
        return min([s["version"] for s in self.latest.values()] or [default])
