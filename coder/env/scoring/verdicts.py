"""One test run per distinct workspace: verdicts shared by the rollouts that left the same files.

The rollouts of a GRPO group often end in identical workspaces (the same one-line fix, or no
change at all when the agent gives up), and their hidden tests then give the same verdict up to
flakiness. `EpisodePool.score` (coder/env/pool.py) asks the episode's worker for its scoring
digest first (`coder.env.scoring.score.scoring_digest`: the task's scoring fields, the reward mode,
the test timeout and the prepared workspace's whole tree) and gives every episode with a digest
already scored that verdict instead of running the tests again. Each episode still applies its
own rules to it (broken tool calls score 0), so only the test run is shared.

    verdicts = SharedVerdicts()
    with verdicts.slot(digest) as slot:   # waits while another thread scores the same digest
        verdict = run_or_reuse(slot.verdict)   # slot.verdict: a reward.Score, or None: run them
        slot.offer(verdict)                    # kept unless it is an infrastructure error

A digest being scored is claimed by its first caller; later callers wait for it and then read
its verdict, so concurrent identical rollouts run the tests once. A verdict with an
infrastructure error is not kept (the next caller runs the tests itself), and neither is one
from a caller that raised. Thread-safe; the pool's rollout threads share one instance.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import threading


class Claim(enum.Enum):
    """What a slot's holder does: reuse a kept verdict, run the tests and offer theirs, or run
    them without sharing (no digest: the workspace could not be read)."""

    REUSE = "reuse"
    RUN = "run"
    UNSHARED = "unshared"


class Slot:
    """One caller's claim on a digest (`SharedVerdicts.slot`)."""

    def __init__(self, claim: Claim, verdict=None):
        self.claim, self.verdict, self.offered = claim, verdict, None

    def offer(self, verdict) -> None:
        """The verdict of the test run this slot's holder made (ignored unless it ran them)."""
        if self.claim is Claim.RUN:
            self.offered = verdict


class SharedVerdicts:
    """Test verdicts by scoring digest (at most `capacity`, least recently used dropped)."""

    def __init__(self, capacity: int = 4096):
        if capacity < 1:
            raise ValueError(f"SharedVerdicts: capacity={capacity}, need at least 1")
        self.capacity = capacity
        self._mu = threading.Lock()
        self._kept: collections.OrderedDict = collections.OrderedDict()  # digest -> verdict
        self._running: dict = {}  # digest -> Event set when its first caller is done
        self.reused = 0  # verdicts given without a test run
        self.runs = 0  # test runs made through claimed slots

    @contextlib.contextmanager
    def slot(self, digest: str | None):
        """A `Slot` for `digest` (None: unshared); see the module docstring."""
        if digest is None:
            yield Slot(Claim.UNSHARED)
            return
        slot = self._claim(digest)
        if slot.claim is Claim.REUSE:
            yield slot
            return
        try:
            yield slot
        finally:
            with self._mu:
                done = self._running.pop(digest)
                self.runs += 1
                v = slot.offered
                if v is not None and not getattr(v, "infra_error", ""):
                    self._kept[digest] = v
                    while len(self._kept) > self.capacity:
                        self._kept.popitem(last=False)
            done.set()

    def _claim(self, digest: str) -> Slot:
        while True:
            with self._mu:
                if digest in self._kept:
                    self._kept.move_to_end(digest)
                    self.reused += 1
                    return Slot(Claim.REUSE, self._kept[digest])
                running = self._running.get(digest)
                if running is None:
                    self._running[digest] = threading.Event()
                    return Slot(Claim.RUN)
            running.wait()  # its holder is bounded by the pool's command timeout
