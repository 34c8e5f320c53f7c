"""Stage `grpo`: GRPO of the agent in its own harness (docs/rl.md; after Composer 2).

One learner step:
    groups = the next B finished groups of G rollouts (coder.rl.actor_learner.Driver.take):
             actors (an Engine + the agent loops + env workers each) roll out the epoch's tasks
             in order (single epoch: each task is used once) with the weights of the store
    reward : outcome - length penalty + auxiliary rewards (coder.rl.reward), per group
    adv    : coder.rl.grpo.advantages (infra failures masked out of their group)
    learner: batch (one generation per row; each token's staleness from its policy version),
             reference logprobs of the frozen initial policy, the trainer's step with
             coder.rl.grpo's loss, then the new version to the weight store (rl.weight_store),
             which the actors poll and apply between two decode calls.

`grpo.async=True` lets actors run ahead of the learner by up to grpo.max_staleness versions
(tokens older than that carry no loss); `grpo.async=False` is the same pieces in lockstep: one
actor, each step's tasks rolled out with the learner's latest weights. `rl.num_actors` actors are
Ray processes (a local Ray instance, or the cluster at `rl.ray_address`); 0 runs the one actor
inside this process; each Ray actor may span `rl.actor_processes` processes (one engine over
their devices: coder/rl/actor_group.py). Colocated (`rl.colocated`, sync): no store; the job's
processes take turns between an engine over all their devices (process 0 leads it, the others
follow) and the learner's step, each version resharded on device into the engine
(coder/rl/colocated.py), and `rl.offload_optimizer` keeps the optimizer state in host memory
while the engine runs (its KV cache gets that device memory).
`GrpoRun` connects actors and learner through the trainer's `fit` (it is
the batch iterator that takes groups from the driver, and its `after_step` hook publishes the
new weights), which also gives GRPO the shared log / checkpoint cadence and SIGTERM handling;
the epoch's position (which tasks were used) is the trainer's data state, saved in every
checkpoint and restored with it.
Router replay: `grpo.router_replay` feeds the engine's expert ids (prompt and observation tokens
included) to the learner's forward as `routing=`.

Metrics (`{stage_dir}/metrics.jsonl`, one line per step): loss, reward, pass_rate, outcome,
test_reward, kl, clip_fraction, ratio_mean/max, entropy, stale_tokens, staleness_mean/max,
behaviour_logp_abs_diff(_max), routing_mismatch, unrouted_tokens (the engine/learner gap),
broken_call_rate, infra_failures, turns, tool_calls, thinking/tool_io/output tokens, summaries,
generations, tokens_per_rollout, submitted, abs_advantage, rollout_time_s, learner_time_s,
learner_idle_s, actor_idle_s, rollouts_per_s, dropped_rollouts(_total), mixed_version_rollouts,
version_lag, sync_bytes / sync_raw_bytes / sync_publish_s (the version this step published),
sync_read_bytes / sync_apply_s (per version the actors applied; an actor over several processes:
its leader's own slices), actor_processes, offload_bytes / offload_s (rl.offload_optimizer: the
optimizer state moved to host memory for the rollout and back), the engine's, plus the
trainer's (grad_norm, lr, ...).
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import os
import time

import jax
from flax import nnx

from coder.env import pool as env_pool
from coder.env import transcripts
from coder.infer import speculative
from coder.model import sharding
from coder.rl import actor as actor_lib
from coder.rl import actor_group, actor_learner, colocated, step_channel, weight_channel
from coder.rl import eval as eval_lib
from coder.rl import reward as reward_lib
from coder.rl.actor import (Actor, episode_factory, eval_tasks, format_bytes, make_engine, rollout_metrics,
                            score_groups, train_tasks, trained_tasks)
from coder.rl.learner import Learner, check_shared_prefix
from coder.train.checkpoint import stage_tokenizer


def validate(config) -> None:
    """Stops at start-up on budgets that cannot work, naming the keys."""
    rl = config.rl
    if rl.context_budget > config.model.max_position_embeddings:
        raise ValueError(f"rl.context_budget={rl.context_budget} > model.max_position_embeddings="
                         f"{config.model.max_position_embeddings}")
    if not 0 < rl.summary_reserve < rl.context_budget:
        raise ValueError(f"rl.summary_reserve={rl.summary_reserve} must be in (0, rl.context_budget)")
    if rl.group_size < 2:
        raise ValueError(f"rl.group_size={rl.group_size}: GRPO needs at least 2 rollouts per task")
    unknown = set(rl.aux_rewards.keys()) - set(reward_lib.AUX_REWARDS)
    if unknown:
        raise ValueError(f"rl.aux_rewards: unknown {sorted(unknown)}; known {sorted(reward_lib.AUX_REWARDS)}")
    if int(rl.num_actors) < 0 or int(rl.anchor_every) < 1:
        raise ValueError(f"rl.num_actors={rl.num_actors} must be >= 0 (0 = one actor in the learner's "
                         f"process) and rl.anchor_every={rl.anchor_every} >= 1")
    if int(rl.actor_processes) < 1 or (int(rl.actor_processes) > 1 and int(rl.num_actors) < 1):
        raise ValueError(f"rl.actor_processes={rl.actor_processes} must be >= 1, and > 1 only with Ray actors "
                         f"(rl.num_actors={rl.num_actors} >= 1): the actor in the learner's process is one process")
    if (rl.colocated or rl.offload_optimizer) and config.grpo["async"]:
        raise ValueError(f"rl.colocated={rl.colocated} / rl.offload_optimizer={rl.offload_optimizer} need "
                         "grpo.async=False: the learner and the actor take turns on the same devices")
    if rl.offload_optimizer and config.train.offload_optimizer:
        raise ValueError("rl.offload_optimizer=True and train.offload_optimizer=True both keep the optimizer "
                         "state in host memory (the first while the actor rolls out, the second between "
                         "steps, inside every step): set one")
    if rl.colocated and int(rl.num_actors) != 0:
        raise ValueError(f"rl.colocated=True runs the actor in the learner's process: set rl.num_actors=0 "
                         f"(it is {rl.num_actors})")
    if float(rl.actor_timeout_s) <= 0 or float(rl.weight_timeout_s) <= 0:
        raise ValueError(f"rl.actor_timeout_s={rl.actor_timeout_s} and rl.weight_timeout_s={rl.weight_timeout_s} "
                         "must be > 0")
    g = config.grpo
    if int(g.max_staleness) < 0 or float(g.tis_cap) < 0:
        raise ValueError(f"grpo.max_staleness={g.max_staleness} and grpo.tis_cap={g.tis_cap} must be >= 0 "
                         "(tis_cap 0 = off)")
    if not config.grpo["async"] and int(rl.num_actors) > 1:
        raise ValueError(f"grpo.async=False runs one actor: set rl.num_actors to 0 or 1 (it is "
                         f"{rl.num_actors}), or grpo.async=True")
    speculative.check_draft_depth("rl.speculative_k", rl.speculative_k, config.model.num_mtp_layers)
    check_shared_prefix(config)
    env_pool.check_config(config.env)  # where the env workers run
    check_engine_layout(config, jax.process_count())


def check_engine_layout(config, processes: int) -> None:
    """Stops at start-up when the in-process actor's engine (rl.num_actors = 0) cannot be held by
    the devices it is built on, naming the keys; `processes` is the learner's process count
    (jax.process_count()). Ray actors' engines are checked where each actor builds its own, on its
    own slice (coder.rl.actor.make_engine: this process cannot see those devices).

    The engine's devices: colocated (rl.colocated), the job's (one engine over the learner's
    devices, process 0 leading); otherwise this process's own. On a learner of several processes
    the second means every process builds an engine of the whole model on its own devices from
    the weight store (coder.rl.actor_learner.ActorWorker: the store's newest version read whole
    into host memory, then placed): allowed while one host holds it (the two-process test job of
    tests/test_multiprocess.py runs that way), refused, naming rl.num_actors and rl.colocated, when
    the whole model in the serving dtype exceeds the host's memory or the engine's weights and one
    row at rl.context_budget exceed its devices' memory. Then the engine against its devices'
    memory (coder.rl.actor.check_engine_memory; CPU devices report no limit)."""
    rl = config.rl
    if int(rl.num_actors) > 0:
        return
    devices = jax.devices() if rl.colocated else jax.local_devices()
    limit = actor_lib.device_bytes_limit(devices)
    shape = actor_lib.engine_mesh_shape(config, len(devices)) if limit is not None else None
    if processes > 1 and not rl.colocated:  # an engine of the whole model per process
        whole = actor_lib.engine_memory(config, {axis: 1 for axis in sharding.AXES}).weights
        host = actor_lib.host_memory_bytes()
        one = actor_lib.engine_memory(config, shape).per_device(1) if shape is not None else 0
        why = ""
        if whole > host:
            why = (f"the whole model is {format_bytes(whole)} in {actor_lib.serving_dtype(config).name}, more "
                   f"than this host's {format_bytes(host)} of memory")
        elif shape is not None and one > limit:
            why = (f"its weights and one row at rl.context_budget={rl.context_budget} need {format_bytes(one)} "
                   f"per device over this process's {len(devices)} devices, more than their {format_bytes(limit)}")
        if why:
            raise ValueError(f"rl.num_actors=0 and rl.colocated=False on a learner of {processes} processes: every "
                             "process builds its own engine of the whole model on its own devices, from the "
                             f"weight store's whole version in its host memory, and {why}: set rl.num_actors >= 1 "
                             "(Ray actors, each an engine on its own slice) or rl.colocated=True with "
                             f"grpo.async=False (one engine over the devices of all {processes} processes)")
    if shape is not None:
        actor_lib.check_engine_memory(config, shape, limit)


def grpo_config(config):
    """The stage's config: a log record every step (a step is minutes of rollouts, and its
    rollout metrics reach metrics.jsonl only in a record)."""
    c = copy.deepcopy(config)
    c.train.log_every = 1
    return c


def engine_metrics(before: dict, after: dict, seconds: float) -> dict:
    """The engine's work between two `Engine.stats()` snapshots `seconds` apart: decode tokens/s,
    prefill tokens, decode steps, batch occupancy (rows decoding / pool slots, per step) and,
    with speculative decoding, the acceptance rate of each draft depth (depth d: of the steps
    whose drafts 1..d-1 were accepted)."""
    d = {k: after[k] - before[k] for k in after if not isinstance(after[k], float)}
    out = dict(engine_tokens_per_s=d["emitted"] / max(seconds, 1e-9), engine_prefill_tokens=d["prefill_tokens"],
               engine_decode_steps=d["decode_steps"],
               engine_occupancy=d["row_steps"] / d["slot_steps"] if d["slot_steps"] else 0.0)
    reached = d["row_steps"]  # every decoding row of every step drafts depth 1
    for depth in range(1, 1 + sum(k.startswith("accepted_depth") for k in d)):
        out[f"engine_accept_depth{depth}"] = d[f"accepted_depth{depth}"] / reached if reached else 0.0
        reached = d[f"accepted_depth{depth}"]
    return out


# --- the stage ---------------------------------------------------------------------------------
@dataclasses.dataclass
class StepRecord:
    """What one learner step's batch came with: the rollout metrics of its groups (the driver's
    timing and the engine's counters included) and when the learner took it."""

    rollout: dict
    learner_start: float


TRAINED_EVAL = "agent_eval_trained"  # reports of the agent eval on the training tasks (rl.eval_trained)


class GrpoRun:
    """One run of stage grpo over `tasks` (single epoch): a Learner whose trainer's `fit` drives
    the loop, with this object as its batch iterator and `after_step` as its hook.

    Per step, `__next__` takes the next B finished groups from the driver, scores them and
    returns the learner's batch (keeping their `StepRecord` as `current`); the trainer steps
    on it; `after_step` publishes the new weights to the store (the actors' next version),
    lets the weight store drop what no actor still needs, runs the held-out agent eval every
    grpo.eval_every steps and returns the step's rollout metrics for its log line. `fit` calls
    `__next__` once before each step and `after_step` once after it.

    `make_episode(task)` builds the env episode of one rollout (it runs in the actors: with Ray
    actors it is pickled, closures included); `held_out` tasks (optional) are evaluated with
    coder.rl.eval at the end (and every grpo.eval_every steps).
    """

    def __init__(self, config, stage_dir: str, init_from: str, *, tokenizer, tasks, make_episode,
                 held_out=None, model_fn=None, trained=None):
        validate(config)
        rl = config.rl
        self.config, self.stage_dir, self.tokenizer = config, stage_dir, tokenizer
        self.make_episode, self.held_out, self.trained = make_episode, held_out, trained
        self.model_fn = model_fn or actor_lib.model_fn(config)  # the model's structure
        b = int(rl.tasks_per_step)
        processes, pid = jax.process_count(), jax.process_index()
        if b % processes:
            raise ValueError(f"rl.tasks_per_step={b} does not split over {processes} processes (each "
                             "learner process feeds its share of every step's groups)")
        local = b // processes
        # Ray actors, or a colocated engine, on a learner of several processes: process 0 drives
        # every actor over the whole epoch and scatters each step's groups (coder/rl/
        # step_channel.py); the actor in the learner's process (rl.num_actors = 0, not
        # colocated): every process drives its own over its share
        self.colocated = bool(rl.colocated)
        self.scatter = processes > 1 and (int(rl.num_actors) > 0 or self.colocated)
        taken = b if self.scatter else local  # groups per step this process's driver takes
        self.steps = min(int(config.train.steps), len(tasks) // b)
        if self.steps < int(config.train.steps):
            logging.warning("[grpo] %d tasks make %d single-epoch steps of %d tasks, fewer than "
                            "train.steps=%d", len(tasks), self.steps, b, config.train.steps)
        # the epoch's position (which tasks were used) is the trainer's data state: a resumed
        # trainer restores it with the checkpoint
        self.epoch = actor_learner.Epoch()
        self.learner = Learner(config, stage_dir, init_from, model_fn, tokenizer=tokenizer,
                               data_iterator=self.epoch)
        self.trainer = trainer = self.learner.trainer
        # each process feeds its own rows of a step's batch, or (the batch axes do not span the
        # processes) every process the whole batch
        self.shares = trainer.batch_row_shares() if processes > 1 else 1
        if self.shares != processes and not self.scatter and processes > 1:
            raise ValueError(f"every process of this {processes}-process learner feeds the whole batch (the "
                             f"mesh's batch axes do not span the processes: {dict(trainer.mesh.shape)}), but "
                             "each process's own actor rolls out only its share of the tasks: use Ray actors "
                             "(rl.num_actors >= 1, driven by process 0) or put data / fsdp over the processes")
        if trainer.step > 0 and len(self.epoch) == 0:
            # a checkpoint without the epoch's position (written before it was saved): the first
            # steps x local tasks, as the synchronous loop used them
            for pos in range(trainer.step * taken):
                self.epoch.add(pos)
        # the driver's tasks: every task (scatter), or this process's share: of every B
        # consecutive tasks, the `local` at its offset
        order = [(i, t) for i, t in enumerate(tasks[:len(tasks) // b * b])
                 if self.scatter or (i % b) // local == pid]
        self.url = actor_learner.store_url(config, stage_dir)
        self.weights = None if self.colocated else actor_learner.learner_weights(config, self.url)
        if self.weights is not None:
            start = self.weights.publish(trainer.model, trainer.step)  # the actors start from this version
            logging.info("[grpo] weights version %d in %s (%d bytes)", trainer.step, self.url, start["bytes"])
        logging.info("[grpo] %s mode, %s", "async" if config.grpo["async"] else "sync",
                     f"{rl.num_actors} Ray actor(s)" + (f" driven by process 0 of {processes}" if self.scatter else "")
                     if int(rl.num_actors) else
                     "the actor in this process" + (", colocated (weights copied on device)" if self.colocated else ""))
        self.channel = step_channel.StepChannel() if self.scatter else None
        self.actors = self.driver = None  # scatter: only process 0 has them
        # colocated: one engine over the job's devices, process 0's leading
        mesh = actor_lib.engine_mesh(config, jax.devices()) if self.colocated and processes > 1 else None
        if pid == 0 or not self.scatter:
            self.actors = actor_group.start_actors(config, tokenizer=tokenizer, make_episode=make_episode,
                                                   model_fn=model_fn, url=self.url, mesh=mesh)
            self.driver = actor_learner.Driver(config, self.actors, order, self.epoch,
                                               needed=max(self.steps - trainer.step, 0) * taken, local=taken,
                                               version=trainer.step)
        self.turns = None
        if self.colocated:
            worker = self.actors.workers[0] if self.actors is not None else None
            engine = worker.engine if worker is not None else make_engine(
                nnx.eval_shape(self.model_fn), config, mesh=mesh)
            self.turns = colocated.ColocatedTurns(trainer, engine, worker.push if worker is not None else None,
                                                  offload=bool(rl.offload_optimizer))
            self.turns.stage(trainer.step)
        self.eval_every, self.anchor_every = int(config.grpo.eval_every), int(rl.anchor_every)
        self._eval_engine = None  # the learner's own engine for agent evals when actors are Ray processes
        self._eval_turns = self._eval_actor = None  # ... over several processes: its engine phases
        self.current: StepRecord | None = None  # the batch `fit` is stepping on

    # --- the trainer's iterator and hook -------------------------------------------------------
    def __iter__(self):
        return self

    def __next__(self) -> dict:
        """The learner's next batch: the next B finished groups, scored (StopIteration when the
        epoch's tasks ran out; fit logs it); scatter: this process's share of them."""
        if self.driver is None:  # process p > 0 of a scatter: its share, from process 0
            if self.turns is not None:  # follow process 0's rollouts on our devices first
                self.turns.engine_phase(None)
            share = self.channel.receive()
            if share is None:
                raise StopIteration
            groups, rollout, epoch_state = share
            self.epoch.set_state(epoch_state)  # every process checkpoints process 0's position
            self.current = StepRecord(rollout, learner_start=time.perf_counter())
            return self.learner.batch(groups)
        offload = {}
        if self.turns is not None:  # the learner waits while the engine runs on its devices
            pushed_s = self.turns.push_s
            (groups, record), offload = self.turns.engine_phase(self.driver.take)
            offload["sync_push_s"] = self.turns.push_s - pushed_s
        else:
            groups, record = self.driver.take()
        if groups is None:
            if self.channel is not None:
                self.channel.send([None] * jax.process_count())
            raise StopIteration
        record.update(offload)
        t1 = time.perf_counter()
        score_groups(groups, self.config.rl)
        before, after = record.pop("engine_before"), record.pop("engine_after")
        rollout = dict(rollout_metrics(groups), **record)
        if after:
            rollout.update(engine_metrics(before, after, record["step_seconds"]))
        self.current = StepRecord(rollout, learner_start=t1)
        if self.channel is not None:  # each process's rows in process order (B / P groups each), or all B
            n = len(groups) // self.shares
            epoch_state = self.epoch.get_state()
            shares = [groups[p * n:(p + 1) * n] if self.shares > 1 else groups for p in range(jax.process_count())]
            self.channel.send([(share, rollout, epoch_state) for share in shares])
            groups = shares[0]
        return self.learner.batch(groups)

    def after_step(self, trainer, metrics) -> dict:
        """Publish the step's weights, then its log record (rollout metrics, sync, timing)."""
        if self.turns is not None:  # the next engine phase reshards it on device: nothing crosses the host
            self.turns.stage(trainer.step)
            sync = dict(sync_bytes=0, sync_raw_bytes=0, sync_publish_s=0.0)
        else:
            info = self.weights.publish(trainer.model, trainer.step)  # before the next step's collection
            sync = dict(sync_bytes=info["bytes"], sync_raw_bytes=info["raw_bytes"], sync_publish_s=info["seconds"])
        if self.driver is not None:
            self.driver.published(trainer.step)
        if self.weights is not None and self.driver is not None and trainer.step % self.anchor_every == 0:
            # drop what no actor still needs (the store's gc runs on process 0)
            self.weights.gc(self.driver.oldest_actor_version())
        jax.block_until_ready(metrics)
        record = dict(self.current.rollout, **sync)
        record["learner_time_s"] = time.perf_counter() - self.current.learner_start
        if self.held_out and self.eval_every and trainer.step % self.eval_every == 0 and trainer.step < self.steps:
            self.evaluate()
        return record

    # --- eval and the run ----------------------------------------------------------------------
    def evaluate(self, tasks=None, name: str = "agent_eval") -> dict:
        """The agent eval (coder.rl.eval) of the learner's current weights (the store's newest
        version, or the colocated engine's) on `tasks` (default: the held-out ones), on the
        in-process actor's engine or, with Ray actors, an engine of the learner's own that follows
        the store. Reports go to {stage_dir}/{name}/. Colocated, or Ray actors, over several
        processes: process 0 evaluates every task on an engine over the job's devices (the
        colocated one; with Ray actors one that loads the version from the store, each process its
        own slices, and frees its memory after), the others follow it and return {}."""
        trainer = self.trainer
        tasks = self.held_out if tasks is None else tasks
        turns, version = self._eval_turns_of()
        if turns is not None:  # an engine phase of its own over the job's devices (process 0 leads)
            def run():
                actor = self.actors.workers[0].actor if turns is self.turns else self._eval_actor
                return eval_lib.run_agent_eval(self.config, trainer.model, self.tokenizer, self.stage_dir,
                                               step=trainer.step, tasks=tasks, actor=actor, name=name, alone=True)

            return turns.engine_phase(run, version)[0] or {}
        if isinstance(self.actors, actor_learner.LocalActors):
            worker = self.actors.workers[0]
            worker.sync()  # the store's newest version (this step's), now
            actor = worker.actor  # its env workers too
        else:  # an engine of the learner's own, following the store like the actors
            if self._eval_engine is None:
                self._eval_engine = make_engine(trainer.model, self.config)
                self._eval_follower = weight_channel.EngineFollower(self._eval_engine, self.url, nnx.state(trainer.model))
                self._eval_actor = Actor(self._eval_engine, self.tokenizer, self.config, self.make_episode)
            self._eval_follower.poll()
            actor = self._eval_actor
        return eval_lib.run_agent_eval(self.config, trainer.model, self.tokenizer, self.stage_dir,
                                       step=trainer.step, tasks=tasks, actor=actor, name=name)

    def _eval_turns_of(self):
        """(turns, version) of the engine phase an agent eval runs in, or (None, None): the
        colocated engine's (its newest staged version), or, with Ray actors on a learner of several
        processes, an engine over the job's devices that loads the learner's version from the
        store (no host holds the whole model), built at the first eval."""
        if self.turns is not None:
            return self.turns, None
        if isinstance(self.actors, actor_learner.LocalActors) or jax.process_count() == 1:
            return None, None
        if self._eval_turns is None:
            mesh = actor_lib.engine_mesh(self.config, jax.devices())
            self._eval_engine = make_engine(nnx.eval_shape(self.model_fn), self.config, mesh=mesh)
            load = colocated.ColocatedTurns.from_store(self._eval_engine, self.url) if self.driver else None
            self._eval_turns = colocated.ColocatedTurns(self.trainer, self._eval_engine, load)
            if self.driver is not None:
                self._eval_actor = Actor(self._eval_engine, self.tokenizer, self.config, self.make_episode)
        return self._eval_turns, self.trainer.step

    def run(self) -> str:
        """Trains to the end of the epoch (or train.steps); returns the checkpoint directory."""
        try:
            if self.trainer.step == 0 and self.config.grpo.eval_at_start:  # the baselines
                if self.trained:
                    res = self.evaluate(self.trained, TRAINED_EVAL)
                    logging.info("[grpo] agent eval on the training tasks before the first step: %s",
                                 _eval_line(res))
                if self.held_out:
                    res = self.evaluate()
                    logging.info("[grpo] agent eval before the first step: %s", _eval_line(res))
            self.trainer.fit(self, self.steps, after_step=self.after_step)  # logging, checkpoints, SIGTERM
            if self.trained:
                res = self.evaluate(self.trained, TRAINED_EVAL)
                logging.info("[grpo] agent eval on the training tasks at step %d: %s", self.trainer.step,
                             _eval_line(res))
            if self.held_out:
                res = self.evaluate()
                logging.info("[grpo] agent eval at step %d: %s", self.trainer.step, _eval_line(res))
        finally:
            self.close()
        return self.trainer.checkpoint_dir

    def close(self) -> None:
        if self._eval_engine is not None:
            if self._eval_actor is not None:
                self._eval_actor.close()
            if self._eval_engine.is_leader:
                self._eval_engine.close()
            else:
                self._eval_turns.close()  # takes process 0's close
        if self.driver is not None:
            self.driver.close()  # colocated: process 0's engine closes, and ...
        if self.turns is not None:
            self.turns.close()  # ... the followers take its close
        self.trainer.close()


def _eval_line(res: dict) -> str:
    """The agent eval's summary for the console: pass@k, tasks, infra failures."""
    if not res:
        return "run by process 0 on the colocated engine"
    parts = [f"{k} {v:.3f}" for k, v in res.items() if k.startswith("pass@")]
    parts.append(f"{res['num_tasks']} tasks, {res['infra_failures']} infra failures")
    return ", ".join(parts) + ("  REGRESSED" if res.get("regressed") else "")


def train(config, stage_dir: str, init_from: str, *, tokenizer, tasks, make_episode,
          held_out=None, model_fn=None, trained=None) -> str:
    """The GRPO loop over `tasks` (single epoch; `GrpoRun`). Returns the checkpoint directory."""
    return GrpoRun(config, stage_dir, init_from, tokenizer=tokenizer, tasks=tasks, make_episode=make_episode,
                   held_out=held_out, model_fn=model_fn, trained=trained).run()


def run(config, stage_dir: str, init_from: str) -> str:
    """Stage `grpo`: tasks from `rl.tasks`, sandboxed episodes, eval on `rl.eval_tasks`."""
    # the checkpoint's (resumed or init_from)
    tok = stage_tokenizer(config, init_from, stage_dir, agent_text=transcripts.tokenizer_agent_text)
    tasks, trained, held_out = stage_tasks(config)
    # the run's agent memory: training tasks write the train split, held-out ones the eval split;
    # each agent eval runs in a memory session of its own (coder/rl/eval.py)
    make_episode = episode_factory(config, memory_dir=os.path.join(stage_dir, "memory"),
                                   eval_ids=[t.id for t in held_out], policy_checkpoint=init_from)
    return train(config, stage_dir, init_from, tokenizer=tok, tasks=tasks, make_episode=make_episode,
                 held_out=held_out, trained=trained if config.rl.eval_trained else None)


def stage_tasks(config) -> tuple[list, list, list]:
    """The stage's tasks, read once at its start: (GRPO's task stream `train_tasks`, the distinct
    tasks it trains on `trained_tasks`, the held-out ones `eval_tasks`), refused (ValueError
    naming them, coder.rl.actor.check_heldout) when the held-out ones share task ids or
    repositories with the trained ones."""
    trained, held_out = trained_tasks(config), eval_tasks(config)
    actor_lib.check_heldout(config, trained, held_out)
    return train_tasks(config), trained, held_out
