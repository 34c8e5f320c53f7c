"""Colocated GRPO (`rl.topology.colocated`): the learner's own job generates too, on the same devices, in
turns with the learner's steps (the usual shape on one TPU slice). No weight store: each version
reaches the engine by an on-device reshard.

Every process of the learner's job holds a part of one engine over the job's devices: process 0's
is the in-process actor's (`ActorWorker`, its scheduler, agent loops and env workers), the other
processes follow it (coder/infer/engine.py, several processes). Each step alternates two phases on
every process:

    engine phase   process 0: load the newest staged version (weight_channel.OnDevice), roll the
                   step's groups out (or run an agent eval), then `Engine.settle(release=True)`:
                   the load applied, nothing decoding, the engine's KV caches and weights freed
                   on every process, the followers handed back.
                   process p > 0: `Engine.follow()` until that settle.
    learner phase  every process: the learner's step, in the device memory the engine freed,
                   then `stage()` of its new arrays (no copy; the next engine phase loads them
                   before the step after donates them).

The same turns serve the agent eval of a learner job of several processes whose actors are Ray
processes: an engine of the job's own, loading each evaluated version from the weight store
(every process its own slices), in an engine phase between two steps.

Between the phases no process has an engine call in flight, so the learner's collectives and the
engine's never interleave differently on two processes. The device memory of a phase is its own
plus the learner's parameters and optimizer state; with `rl.topology.offload_optimizer` the optimizer
state waits in host memory during every engine phase and comes back for the step.
"""
from __future__ import annotations

import time

from coder.rl import weight_channel
from coder.train import state as state_lib


class ColocatedTurns:
    """The engine phases of one colocated run, on one process of the learner's job.

    Args:
      trainer: the learner's trainer (its `model` is staged; its `opt_state` offloaded).
      engine: this process's part of the engine (the in-process actor's on process 0).
      load: process 0's `version -> seconds`: gives the engine that version (default: None, a
        follower). Colocated: `ActorWorker.push` of the staged arrays; an eval engine: a load
        from the weight store (`from_store`).
      offload: rl.topology.offload_optimizer.
    """

    def __init__(self, trainer, engine, load=None, *, offload: bool = False):
        self.trainer, self.engine, self.load = trainer, engine, load
        self.offload = bool(offload)
        self.staged = None  # the newest staged version
        self.push_s = 0.0  # seconds process 0 spent handing versions to the engine (cumulative)

    @property
    def leads(self) -> bool:
        return self.load is not None

    def stage(self, version: int) -> None:
        """Every process, after each learner step (and before the first phase): the learner's
        arrays as `version`, loaded by the next engine phase."""
        weight_channel.stage_on_device(self.trainer.model, version)
        self.staged = int(version)

    def engine_phase(self, fn, version: int | None = None):
        """Process 0: `fn()` (rollouts or an eval) on the engine holding `version` (default: the
        newest staged), then settle; other processes: follow until process 0 settles (None).
        Returns (fn's result, {offload_bytes, offload_s} when offloading)."""
        record = {}
        if self.offload:
            t0 = time.perf_counter()
            self.trainer.opt_state, moved = state_lib.to_memory(self.trainer.opt_state, "pinned_host")
            record = dict(offload_bytes=moved, offload_s=time.perf_counter() - t0)
        try:
            if not self.leads:
                how = self.engine.follow()
                if how != "settled":
                    raise RuntimeError(f"colocated: process 0 {how} the engine in the middle of the run")
                return None, record
            # the last phase released the weights
            self.push_s += self.load(self.staged if version is None else int(version))
            try:
                return fn(), record
            finally:
                # the staged arrays are copied (the next step may donate them), the memory freed
                self.engine.settle(release=True)
        finally:
            if self.offload:
                t0 = time.perf_counter()
                self.trainer.opt_state, _ = state_lib.to_memory(self.trainer.opt_state, "device")
                record["offload_s"] += time.perf_counter() - t0

    @staticmethod
    def from_store(engine, url: str):
        """Process 0's `load` of an engine that follows the weight store: every process reads its
        own devices' slices of the version (coder.rl.weight_channel.StoreLoad)."""
        def load(version: int) -> float:
            t0 = time.perf_counter()
            engine.load_weights(weight_channel.StoreLoad(url, int(version)), int(version))
            return time.perf_counter() - t0

        return load

    def close(self) -> None:
        """Followers: take process 0's closing call (its engine's close, after the run)."""
        if not self.leads:
            how = self.engine.follow()
            if how != "closed":
                raise RuntimeError(f"colocated: the run ended but process 0 {how} the engine")
