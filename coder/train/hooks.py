"""The parts of `Trainer.fit`'s loop, each owning its cadence (levanter's `TrainerHooks`).

`fit` runs the optimizer step and, after it, each hook whose cadence is due, in this order:

  the caller's  GRPO's `after_step` (every step), then any `hooks=` (e.g. `Hook(fn, every=N)`);
                the scalars they return join the step's log line;
  MetricsLog    every train.log_every steps and at the fit's last step: the log line (`loss` the
                mean over the non-skipped steps since the last line, `loss_step` this step's,
                `tokens_per_s`, `mfu`, the data iterator's counters) and the ETA;
  Preemption    every step: after SIGTERM (seen by any process of the job) save, wait for the
                write and raise `Preempted` (exit code 0);
  Checkpoint    every train.ckpt_every steps before the fit's last; when the loop ends (steps
                reached or data exhausted) the final save, waited for.

A hook: `__call__(trainer, info) -> dict | None` after each step `due(info)` accepts (default: a
multiple of `every`); `observe(trainer, info)` after every step (accumulators); `start(trainer)`
before the first step; `end(trainer, completed)` after the loop, in reverse order, also when it
raised (`completed` False then).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import signal
import threading
import time
from typing import Any, Callable

import jax
import numpy as np


class Preempted(SystemExit):
    """Raised by `fit` after SIGTERM: the checkpoint is written; the process exits with code 0."""

    def __init__(self, step: int):
        super().__init__(0)
        self.step = step


@dataclasses.dataclass
class StepInfo:
    """What a hook sees after a step: `step` the trainer's step after it, `steps` where the fit
    stops, the step's `metrics` (jax scalars), its host `batch`, the fit's `iterator`, and
    `record`: the scalars earlier hooks returned (they join the step's log line)."""

    step: int
    steps: int
    metrics: dict
    batch: dict
    iterator: Any
    record: dict = dataclasses.field(default_factory=dict)


class Hook:
    """`fn(trainer, info) -> dict | None` after every step that is a multiple of `every` (see the
    module docstring for the methods a hook with state overrides)."""

    def __init__(self, fn: Callable | None = None, every: int = 1):
        self.fn = fn
        self.every = max(1, int(every))

    def due(self, info: StepInfo) -> bool:
        return info.step % self.every == 0

    def __call__(self, trainer, info: StepInfo) -> dict | None:
        return self.fn(trainer, info)

    def observe(self, trainer, info: StepInfo) -> None:
        pass

    def start(self, trainer) -> None:
        pass

    def end(self, trainer, completed: bool) -> None:
        pass


@contextlib.contextmanager
def running(hooks, trainer):
    """`start` each hook; on leaving, `end` each in reverse order (every one, even when another
    raises), `completed` False when the loop raised."""
    with contextlib.ExitStack() as stack:
        for hook in hooks:
            hook.start(trainer)
            stack.push(lambda exc_type, exc, tb, hook=hook: hook.end(trainer, exc_type is None))
        yield


def after_step(fn: Callable) -> Hook:
    """The caller's `after_step(trainer, metrics) -> dict | None` as a hook of every step."""
    return Hook(lambda trainer, info: fn(trainer, info.metrics))


class MetricsLog(Hook):
    """The log line every `every` steps and at the fit's last (module docstring). Throughput is
    timed from the end of the fit's first step (it includes compilation); the loss sum stays on
    the devices (no host sync per step)."""

    def __init__(self, every: int):
        super().__init__(every=every)
        self.loss_sum, self.loss_n = 0.0, 0
        self.t_first = self.t_last = self.first_step = None
        self.tokens, self.timed_steps = 0, 0
        self.fpt = None

    def due(self, info):
        return info.step % self.every == 0 or info.step == info.steps

    def observe(self, trainer, info):
        m = info.metrics
        if not int(m["skipped"]):
            self.loss_sum, self.loss_n = self.loss_sum + m["loss"], self.loss_n + 1
        if self.t_last is None:  # the first step includes compilation: time from its end
            jax.block_until_ready(m)
            self.t_last = self.t_first = time.perf_counter()
            self.first_step = info.step
        else:
            self.tokens += int(np.sum(np.asarray(info.batch["segment_ids"]) > 0)) * jax.process_count()
            self.timed_steps += 1

    def __call__(self, trainer, info):
        m = info.metrics
        record = dict(m, loss_step=m["loss"])
        record["loss"] = self.loss_sum / self.loss_n if self.loss_n else m["loss"]
        self.loss_sum, self.loss_n = 0.0, 0
        now, eta = time.perf_counter(), None
        if self.timed_steps:
            if self.fpt is None:
                self.fpt = trainer._flops_per_token(np.asarray(info.batch["tokens"]).shape[1])
            tps = self.tokens / max(now - self.t_last, 1e-9)
            record["tokens_per_s"] = tps
            record["mfu"] = tps * self.fpt / trainer.peak_flops()
            eta = (info.steps - info.step) * (now - self.t_first) / max(info.step - self.first_step, 1)
        record.update(data_metrics(info.iterator))
        record.update(info.record)
        trainer.log(record, total_steps=info.steps, eta_s=eta)
        self.t_last, self.tokens, self.timed_steps = now, 0, 0


class Preemption(Hook):
    """SIGTERM, checked after every step: save, wait for the write, raise Preempted. The handler
    is installed for the fit (from the main thread only) and the previous one restored after it;
    a signal seen stays seen by this hook (the trainer keeps one across its fits)."""

    def __init__(self):
        super().__init__(every=1)
        self.signalled = False
        self._prev = None

    def start(self, trainer):
        if threading.current_thread() is threading.main_thread():
            self._prev = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame):
        del signum, frame
        self.signalled = True

    def preempted(self) -> bool:
        """SIGTERM seen by this process or, in a job of several, by any of them: every process
        stops after the same step (the checkpoint is written by all of them together; a process
        that stopped alone would leave the others waiting in the next step's collectives)."""
        if jax.process_count() == 1:
            return self.signalled
        from jax.experimental import multihost_utils

        return bool(np.max(multihost_utils.process_allgather(np.int32(self.signalled))))

    def __call__(self, trainer, info):
        if self.preempted():
            trainer.save(force=True)
            trainer.ckpt.wait()
            logging.warning("[%s] SIGTERM: checkpoint at step %d written, exiting", trainer.stage, trainer.step)
            raise Preempted(trainer.step)

    def end(self, trainer, completed):
        if self._prev is not None:
            signal.signal(signal.SIGTERM, self._prev)
            self._prev = None


class Checkpoint(Hook):
    """A checkpoint every `every` steps before the fit's last; the final one (forced, waited
    for) when the loop ends without an exception."""

    def due(self, info):
        return info.step % self.every == 0 and info.step < info.steps

    def __call__(self, trainer, info):
        trainer.save()

    def end(self, trainer, completed):
        if completed:
            trainer.save(force=True)
            trainer.ckpt.wait()


def data_metrics(it) -> dict:
    """The data iterator's counters (coder.data: records seen / bad per kind), when it has them.

    `skipped_records` is the number of bad records skipped so far (malformed, empty, ...).
    """
    fn = getattr(it, "metrics", None)
    if not callable(fn):
        return {}
    out = dict(fn())
    if "data/records_bad" in out:
        out["skipped_records"] = out["data/records_bad"]
    return out
