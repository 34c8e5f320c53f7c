"""Where stage grpo's actors run and how the learner's weights reach them, as one value
(docs/rl.md, section 4).

    Topology.from_config(config, processes)   one of four kinds, validated once at start-up:
      IN_PROCESS   rl.topology.actors = 0: one ActorWorker (coder/rl/actor_worker.py) in each learner
                   process, threads beside the learner, following the weight store; each process
                   drives its own over its share of every step's tasks
      COLOCATED    rl.topology.colocated (asynchronous=False): one engine over the job's devices in turns with
                   the learner's steps (coder/rl/colocated.py); each version resharded on device,
                   no weight store
      RAY_ACTORS   rl.topology.actors = n >= 1 Ray actor processes (coder/rl/actor_hosts.py), each an
                   engine of its own that follows the weight store
      RAY_GROUPS   n actors of rl.topology.actor_processes = P >= 2 Ray processes each
                   (coder/rl/actor_group.py): one engine over a group's devices
      scatter      on a learner of several processes with any kind but IN_PROCESS: process 0's
                   driver takes every group and sends each process its share of the step
                   (coder/rl/step_channel.py); the others follow
    Topology.start(...) -> Deployment: this process's end of it, the only thing stage grpo talks
      to: `next_groups` (the step's groups, scored, this process's share), `publish` (the new
      version to the actors), `evaluate` (the agent eval on the engine this kind evaluates on)
      and `close`.

    learner   (every process of the learner's job)
      Deployment.next_groups    the driver's (coder/rl/driver.py) B finished groups, or a share
      Learner.batch, one step   (tokens more than grpo.max_staleness versions old carry no loss)
      Deployment.publish        the version to the weight store (or staged on device, colocated),
                                and the driver told, so the actors poll now and gates open
    actors    ActorWorker: an Engine, the agent loops, env workers; each version applied between
              two decode calls (coder/rl/actor_worker.py)

The weight path has one dtype, `Topology.dtype` (coder.rl.actor.serving_dtype): the learner
publishes its floating variables in it and every engine holds them in it.
"""
from __future__ import annotations

import dataclasses
import enum
import logging
import os
import time

import jax
from flax import nnx

from coder.model import sharding
from coder.rl import actor as actor_lib
from coder.rl import actor_group, colocated, step_channel, weight_channel
from coder.rl import driver as driver_lib
from coder.rl.actor_hosts import LocalActors, RayActors, start_ray
from coder.rl.actor_worker import ActorWorker, capacity


class Kind(enum.Enum):
    """Where the actors run (module docstring)."""

    IN_PROCESS = "the actor in this process"
    COLOCATED = "the actor in this process, colocated (weights copied on device)"
    RAY_ACTORS = "Ray actor(s)"
    RAY_GROUPS = "Ray actor group(s)"


def store_url(config, stage_dir: str) -> str:
    """The weight store of a run: rl.weight_store, "" = {stage_dir}/weights."""
    return config.rl.weight_store or os.path.join(stage_dir, "weights")


def learner_weights(config, url: str):
    """The learner's publisher (weight_channel.ModelPublisher) of stage grpo: every variable, floating
    ones in the serving dtype `rl.engine_dtype or model.dtype`, the weights rl.engine_quantization
    names in the engines' quantized form, each process writing its own devices' slices."""
    return weight_channel.ModelPublisher(url, dtype=actor_lib.serving_dtype(config),
                                         quantization=config.rl.engine_quantization,
                                         anchor_every=int(config.rl.anchor_every))


@dataclasses.dataclass(frozen=True)
class Topology:
    """GRPO's deployment (module docstring); build it with `from_config`."""

    kind: Kind
    actors: int  # actors the driver hands work to: rl.topology.actors on Ray, else the 1 in this process
    actor_processes: int  # processes of one actor's engine (> 1 only for RAY_GROUPS)
    learner_processes: int  # processes of the learner's job (jax.process_count())
    asynchronous: bool  # rl.topology.asynchronous
    dtype: object  # the weight path's dtype (coder.rl.actor.serving_dtype)

    @classmethod
    def from_config(cls, config, learner_processes: int) -> Topology:
        """The config's topology (the `rl.topology` section), or ValueError naming the keys that
        cannot work together (and the in-process engine that its devices or host cannot hold:
        `check_engine_layout`)."""
        t = config.rl.topology
        n, p, asynchronous = int(t.actors), int(t.actor_processes), bool(t.asynchronous)
        if n < 0:
            raise ValueError(f"rl.topology.actors={t.actors} must be >= 0 (0 = one actor in the learner's process)")
        if p < 1 or (p > 1 and n < 1):
            raise ValueError(f"rl.topology.actor_processes={t.actor_processes} must be >= 1, and > 1 only with Ray "
                             f"actors (rl.topology.actors={t.actors} >= 1): the actor in the learner's process is "
                             "one process")
        if (t.colocated or t.offload_optimizer) and asynchronous:
            raise ValueError(f"rl.topology.colocated={t.colocated} / rl.topology.offload_optimizer="
                             f"{t.offload_optimizer} need rl.topology.asynchronous=False: the learner and the actor "
                             "take turns on the same devices")
        if t.offload_optimizer and config.train.offload_optimizer:
            raise ValueError("rl.topology.offload_optimizer=True and train.offload_optimizer=True both keep the "
                             "optimizer state in host memory (the first while the actor rolls out, the second "
                             "between steps, inside every step): set one")
        if t.colocated and n != 0:
            raise ValueError(f"rl.topology.colocated=True runs the actor in the learner's process: set "
                             f"rl.topology.actors=0 (it is {t.actors})")
        if not asynchronous and n > 1:
            raise ValueError(f"rl.topology.asynchronous=False runs one actor: set rl.topology.actors to 0 or 1 (it "
                             f"is {t.actors}), or rl.topology.asynchronous=True")
        kind = (Kind.COLOCATED if t.colocated else Kind.IN_PROCESS if n == 0
                else Kind.RAY_ACTORS if p == 1 else Kind.RAY_GROUPS)
        topology = cls(kind, max(n, 1), p, int(learner_processes), asynchronous, actor_lib.serving_dtype(config))
        topology.check_engine_layout(config)
        return topology

    @property
    def scatter(self) -> bool:
        """Process 0 drives every actor and sends each learner process its share of a step."""
        return self.learner_processes > 1 and self.kind is not Kind.IN_PROCESS

    @property
    def on_ray(self) -> bool:
        return self.kind in (Kind.RAY_ACTORS, Kind.RAY_GROUPS)

    def describe(self) -> str:
        """The start-up log line's words for it."""
        what = (f"{self.actors} {self.kind.value}" if self.on_ray else self.kind.value)
        if self.kind is Kind.RAY_GROUPS:
            what += f" of {self.actor_processes} processes"
        if self.scatter:
            what += f" driven by process 0 of {self.learner_processes}"
        return f"{'async' if self.asynchronous else 'sync'} mode, {what}"

    def check_engine_layout(self, config) -> None:
        """Stops at start-up when the in-process engine (IN_PROCESS, COLOCATED) cannot be held by
        the devices it is built on, naming the keys. Ray actors' engines are checked where each
        actor builds its own, on its own slice (coder.rl.actor.make_engine: this process cannot
        see those devices).

        The engine's devices: colocated, the job's (one engine over the learner's devices, process
        0 leading); otherwise this process's own. On a learner of several processes the second
        means every process builds an engine of the whole model on its own devices from the weight
        store (coder.rl.actor_worker.ActorWorker: the store's newest version read whole into host
        memory, then placed): allowed while one host holds it (the two-process test job of
        tests/test_multiprocess.py runs that way), refused, naming rl.topology.actors and rl.topology.colocated,
        when the whole model in the serving dtype exceeds the host's memory or the engine's
        weights and one row at rl.context_budget exceed its devices' memory. Then the engine
        against its devices' memory (coder.rl.actor.check_engine_memory; CPU devices report no
        limit)."""
        if self.on_ray:
            return
        rl, processes = config.rl, self.learner_processes
        devices = jax.devices() if self.kind is Kind.COLOCATED else jax.local_devices()
        limit = actor_lib.device_bytes_limit(devices)
        shape = actor_lib.engine_mesh_shape(config, len(devices)) if limit is not None else None
        if processes > 1 and self.kind is Kind.IN_PROCESS:  # an engine of the whole model per process
            whole = actor_lib.engine_memory(config, {axis: 1 for axis in sharding.AXES}).weights
            host = actor_lib.host_memory_bytes()
            one = actor_lib.engine_memory(config, shape).per_device(1) if shape is not None else 0
            why = ""
            if whole > host:
                why = (f"the whole model is {actor_lib.format_bytes(whole)} in {self.dtype.name}, more than this "
                       f"host's {actor_lib.format_bytes(host)} of memory")
            elif shape is not None and one > limit:
                why = (f"its weights and one row at rl.context_budget={rl.context_budget} need "
                       f"{actor_lib.format_bytes(one)} per device over this process's {len(devices)} devices, "
                       f"more than their {actor_lib.format_bytes(limit)}")
            if why:
                raise ValueError("rl.topology.actors=0 and rl.topology.colocated=False on a learner of "
                                 f"{processes} processes: "
                                 "every process builds its own engine of the whole model on its own devices, from "
                                 f"the weight store's whole version in its host memory, and {why}: set "
                                 "rl.topology.actors >= 1 (Ray actors, each an engine on its own slice) or "
                                 "rl.topology.colocated=True with rl.topology.asynchronous=False (one engine over the "
                                 "devices of all "
                                 f"{processes} processes)")
        if shape is not None:
            actor_lib.check_engine_memory(config, shape, limit)

    def check_rows(self, shares: int, mesh_shape: dict) -> None:
        """Each learner process feeds `shares` parts of a step's rows (the trainer's
        `batch_row_shares`): one per process, or, when the mesh's batch axes do not span the
        processes, every process the whole batch, which only a scattering topology gives it."""
        processes = self.learner_processes
        if processes > 1 and shares != processes and not self.scatter:
            raise ValueError(f"every process of this {processes}-process learner feeds the whole batch (the "
                             f"mesh's batch axes do not span the processes: {mesh_shape}), but "
                             "each process's own actor rolls out only its share of the tasks: use Ray actors "
                             "(rl.topology.actors >= 1, driven by process 0) or put data / fsdp over the processes")

    def tasks_of(self, tasks: list, per_step: int, process: int) -> tuple[list, int]:
        """(order, taken): the [(global task index, task)] this process's driver walks, in order,
        and the groups it takes per step. Scatter: every task, all `per_step`; otherwise of every
        `per_step` consecutive tasks the share at this process's offset."""
        local = per_step // self.learner_processes
        usable = tasks[:len(tasks) // per_step * per_step]
        if self.scatter:
            return list(enumerate(usable)), per_step
        return [(i, t) for i, t in enumerate(usable) if (i % per_step) // local == process], local

    def start(self, config, trainer, *, url: str, tokenizer, make_episode, model_fn, order: list,
              epoch: driver_lib.Epoch, needed: int, taken: int, shares: int) -> Deployment:
        """This process's end of the topology, started: the learner's first version published
        (or staged), the actors up and the driver handing out `order` (on the processes that drive)."""
        cls = {Kind.IN_PROCESS: InProcess, Kind.COLOCATED: Colocated, Kind.RAY_ACTORS: OnRay,
               Kind.RAY_GROUPS: OnRay}[self.kind]
        deployment = cls(self, config, trainer, url=url, tokenizer=tokenizer, make_episode=make_episode,
                         model_fn=model_fn, epoch=epoch, shares=shares)
        logging.info("[grpo] %s", self.describe())
        if deployment.leads:
            deployment.host = deployment.start_host()
            deployment.driver = driver_lib.Driver(config, deployment.host, order, epoch, needed=needed,
                                                  local=taken, version=trainer.step)
        return deployment


# --- a started topology: this process's end ----------------------------------------------------
class Deployment:
    """One learner process's end of a started `Topology`. `leads`: this process drives the actors
    (its `host` and `driver`); a scatter's other processes receive their share of each step from
    process 0 (their `host` and `driver` are None)."""

    def __init__(self, topology: Topology, config, trainer, *, url: str, tokenizer, make_episode, model_fn,
                 epoch: driver_lib.Epoch, shares: int):
        self.topology, self.config, self.trainer, self.url = topology, config, trainer, url
        # model_fn: the model's structure (None: the config's Transformer), passed on to the actors as given
        self.tokenizer, self.make_episode, self.model_fn = tokenizer, make_episode, model_fn
        self.epoch, self.shares = epoch, int(shares)
        self.leads = not topology.scatter or jax.process_index() == 0
        self.channel = step_channel.StepChannel() if topology.scatter else None
        self.host = self.driver = None  # set by Topology.start where this process leads

    def abstract_model(self):
        return nnx.eval_shape(self.model_fn or actor_lib.model_fn(self.config))

    def start_host(self):
        """The actors' host (coder.rl.actor_hosts.ActorHost)."""
        raise NotImplementedError

    def _env_pools_on_ray(self) -> None:
        """The actor in this process with env.workers_backend "ray": a local Ray instance sized
        for its env pools and the eval's (it lives until the process exits, as the pools' own)."""
        if self.config.env.workers_backend == "ray":
            start_ray(self.config, 0, 1)

    # --- the step's groups -------------------------------------------------------------------
    def next_groups(self, score) -> tuple[list, dict, float] | None:
        """(this process's groups of the next step, the step's rollout record, when the groups
        were in hand: time.perf_counter()), or None when the epoch's tasks ran out. Where this
        process leads, `score(groups, record) -> rollout record` runs on all B groups first; a
        scatter then sends each process its rows (B / P groups each, in process order, or all B
        when every process feeds the whole batch)."""
        if not self.leads:
            return self._receive()
        groups, record = self._take()
        if groups is None:
            if self.channel is not None:
                self.channel.send([None] * self.topology.learner_processes)
            return None
        started = time.perf_counter()
        rollout = score(groups, record)
        if self.channel is not None:
            n = len(groups) // self.shares
            epoch_state = self.epoch.get_state()  # every process checkpoints process 0's position
            shares = [groups[p * n:(p + 1) * n] if self.shares > 1 else groups
                      for p in range(self.topology.learner_processes)]
            self.channel.send([(share, rollout, epoch_state) for share in shares])
            groups = shares[0]
        return groups, rollout, started

    def _take(self) -> tuple[list | None, dict]:
        return self.driver.take()

    def _receive(self):
        share = self.channel.receive()
        if share is None:
            return None
        groups, rollout, epoch_state = share
        self.epoch.set_state(epoch_state)  # every process checkpoints process 0's position
        return groups, rollout, time.perf_counter()

    # --- weights, eval, close ----------------------------------------------------------------
    def publish(self, step: int) -> dict:
        """The learner's version `step` to the actors; the sync metrics of the step."""
        raise NotImplementedError

    def evaluate(self, run) -> dict:
        """`run(actor, alone) -> report` on the engine this topology evaluates on, holding the
        learner's current version; {} on the processes that only follow it."""
        raise NotImplementedError

    def close(self) -> None:
        if self.driver is not None:
            self.driver.close()


class _OverStore(Deployment):
    """The kinds whose actors follow the weight store: every process publishes its own slices of
    each version; the first before any actor starts (they start from it)."""

    def __init__(self, topology, config, trainer, **kw):
        super().__init__(topology, config, trainer, **kw)
        self.weights = learner_weights(config, self.url)
        start = self.weights.publish(trainer.model, trainer.step)
        logging.info("[grpo] weights version %d in %s (%d bytes)", trainer.step, self.url, start["bytes"])

    def publish(self, step: int) -> dict:
        info = self.weights.publish(self.trainer.model, step)  # before the next step's collection
        if self.driver is not None:
            self.driver.published(step)
            if step % int(self.config.rl.anchor_every) == 0:  # drop what no actor still needs
                self.weights.gc(self.driver.oldest_actor_version())
        return dict(sync_bytes=info["bytes"], sync_raw_bytes=info["raw_bytes"], sync_publish_s=info["seconds"])


class InProcess(_OverStore):
    """IN_PROCESS: one ActorWorker in this process; its engine also serves the agent eval."""

    def start_host(self):
        self._env_pools_on_ray()
        worker = ActorWorker(self.config, self.tokenizer, self.make_episode, self.model_fn, self.url)
        return LocalActors(worker, capacity(self.config))

    def evaluate(self, run) -> dict:
        worker = self.host.workers[0]
        worker.sync()  # the store's newest version (this step's), now
        return run(worker.actor, False)  # its env workers too


class OnRay(_OverStore):
    """RAY_ACTORS / RAY_GROUPS. The agent eval runs on an engine of the learner's own that reads
    the store: on one process an engine following it; on several, an engine over the job's devices
    that loads each evaluated version (every process its own slices: no host holds the whole
    model), in an engine phase between two steps (coder/rl/colocated.py), built at the first eval."""

    def __init__(self, topology, config, trainer, **kw):
        super().__init__(topology, config, trainer, **kw)
        self._eval_engine = self._eval_actor = self._eval_follower = self._eval_turns = None

    def start_host(self):
        t, c = self.topology, self.config
        if t.kind is Kind.RAY_GROUPS:
            return actor_group.RayActorGroups(c, t.actors, t.actor_processes, self.tokenizer, self.make_episode,
                                              self.model_fn, self.url, capacity(c))
        return RayActors(c, t.actors, self.tokenizer, self.make_episode, self.model_fn, self.url, capacity(c))

    def evaluate(self, run) -> dict:
        if self.topology.learner_processes == 1:
            if self._eval_engine is None:
                model = self.trainer.model
                self._eval_engine = actor_lib.make_engine(model, self.config)
                self._eval_follower = weight_channel.EngineFollower(self._eval_engine, self.url, nnx.state(model))
                self._eval_actor = actor_lib.Actor(self._eval_engine, self.tokenizer, self.config, self.make_episode)
            self._eval_follower.poll()
            return run(self._eval_actor, False)
        if self._eval_turns is None:
            mesh = actor_lib.engine_mesh(self.config, jax.devices())
            self._eval_engine = actor_lib.make_engine(self.abstract_model(), self.config, mesh=mesh)
            load = colocated.ColocatedTurns.from_store(self._eval_engine, self.url) if self.leads else None
            self._eval_turns = colocated.ColocatedTurns(self.trainer, self._eval_engine, load)
            if self.leads:
                self._eval_actor = actor_lib.Actor(self._eval_engine, self.tokenizer, self.config, self.make_episode)
        return self._eval_turns.engine_phase(lambda: run(self._eval_actor, True), self.trainer.step)[0] or {}

    def close(self) -> None:
        if self._eval_engine is not None:
            if self._eval_actor is not None:
                self._eval_actor.close()
            if self._eval_engine.is_leader:
                self._eval_engine.close()
            else:
                self._eval_turns.close()  # takes process 0's close
        super().close()


class Colocated(Deployment):
    """COLOCATED: one engine over the job's devices (process 0's leads, the others follow), in
    turns with the learner's steps (coder/rl/colocated.py); each version staged on device after
    the step and resharded into the engine at the next engine phase. No weight store."""

    def __init__(self, topology, config, trainer, **kw):
        super().__init__(topology, config, trainer, **kw)
        multi = topology.learner_processes > 1
        self.mesh = actor_lib.engine_mesh(config, jax.devices()) if multi else None
        self.worker = None  # process 0's in-process actor (start_host)
        self.turns = None  # the engine phases: built with the host on process 0, here on the others
        if not self.leads:
            engine = actor_lib.make_engine(self.abstract_model(), config, mesh=self.mesh)
            self._turns(engine, None)

    def _turns(self, engine, push) -> None:
        self.turns = colocated.ColocatedTurns(self.trainer, engine, push,
                                              offload=bool(self.config.rl.topology.offload_optimizer))
        self.turns.stage(self.trainer.step)

    def start_host(self):
        self._env_pools_on_ray()
        self.worker = ActorWorker(self.config, self.tokenizer, self.make_episode, self.model_fn, self.url,
                                  mesh=self.mesh, colocated=True)
        self._turns(self.worker.engine, self.worker.push)
        return LocalActors(self.worker, capacity(self.config))

    def _take(self):
        """The driver's groups, taken in an engine phase (the learner waits while the engine runs
        on its devices); the phase's offload and push seconds join the record."""
        pushed_s = self.turns.push_s
        (groups, record), offload = self.turns.engine_phase(self.driver.take)
        record.update(offload, sync_push_s=self.turns.push_s - pushed_s)
        return groups, record

    def _receive(self):
        self.turns.engine_phase(None)  # follow process 0's rollouts on our devices first
        return super()._receive()

    def publish(self, step: int) -> dict:
        self.turns.stage(step)  # the next engine phase reshards it on device: nothing crosses the host
        if self.driver is not None:
            self.driver.published(step)
        return dict(sync_bytes=0, sync_raw_bytes=0, sync_publish_s=0.0)

    def evaluate(self, run) -> dict:
        return self.turns.engine_phase(lambda: run(self.worker.actor, True))[0] or {}

    def close(self) -> None:
        super().close()  # process 0's driver closes its actor and engine, and ...
        self.turns.close()  # ... the followers take its close
