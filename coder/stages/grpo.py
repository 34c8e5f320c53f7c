"""Stage `grpo`: GRPO of the agent in its own harness (docs/rl.md; after Composer 2).

One learner step:
    groups = the next B finished groups of G rollouts (coder.rl.driver.Driver.take, through
             the deployment coder.rl.topology.Topology.start gives):
             actors (an Engine + the agent loops + env workers each) roll out the epoch's tasks
             in order (single epoch: each task is used once) with the weights of the store
    reward : outcome - length penalty + auxiliary rewards (coder.rl.reward), per group
    adv    : coder.rl.grpo.advantages (infra failures masked out of their group)
    learner: batch (one generation per row; each token's staleness from its policy version),
             reference logprobs of the frozen initial policy, the trainer's step with
             coder.rl.grpo's loss, then the new version to the weight store (rl.weight_store),
             which the actors poll and apply between two decode calls.

`rl.topology.asynchronous=True` lets actors run ahead of the learner by up to grpo.max_staleness versions
(tokens older than that carry no loss); `rl.topology.asynchronous=False` is the same pieces in lockstep: one
actor, each step's tasks rolled out with the learner's latest weights. Where the actors run (in
this process, colocated on the learner's devices, Ray actors, Ray actor groups; on a learner of
several processes whether process 0 scatters each step's groups) is one value,
coder.rl.topology.Topology, validated by `validate`; this module talks only to the Deployment it
starts (`next_groups`, `publish`, `evaluate`, `close`) and never asks which one it has.
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
its leader's own slices), actor_processes, offload_bytes / offload_s (rl.topology.offload_optimizer: the
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

from coder.env import pool as env_pool
from coder.env import transcripts
from coder.infer import speculative
from coder.rl import actor as actor_lib
from coder.rl import eval as eval_lib
from coder.rl import reward as reward_lib
from coder.rl.actor import episode_factory, eval_tasks, rollout_metrics, score_groups, train_tasks, trained_tasks
from coder.rl.driver import Epoch
from coder.rl.learner import Learner, check_shared_prefix
from coder.rl.topology import Topology, store_url
from coder.train.checkpoint import stage_tokenizer


def validate(config) -> Topology:
    """Stops at start-up on budgets that cannot work, naming the keys; returns the run's
    deployment (coder.rl.topology.Topology, validated with the learner's process count)."""
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
    if int(rl.anchor_every) < 1:
        raise ValueError(f"rl.anchor_every={rl.anchor_every} must be >= 1")
    if float(rl.topology.actor_timeout_s) <= 0 or float(rl.weight_timeout_s) <= 0:
        raise ValueError(f"rl.topology.actor_timeout_s={rl.topology.actor_timeout_s} and "
                         f"rl.weight_timeout_s={rl.weight_timeout_s} must be > 0")
    g = config.grpo
    if int(g.max_staleness) < 0 or float(g.tis_cap) < 0:
        raise ValueError(f"grpo.max_staleness={g.max_staleness} and grpo.tis_cap={g.tis_cap} must be >= 0 "
                         "(tis_cap 0 = off)")
    speculative.check_draft_depth("rl.speculative_k", rl.speculative_k, config.model.num_mtp_layers)
    check_shared_prefix(config)
    env_pool.check_config(config.env)  # where the env workers run
    return Topology.from_config(config, jax.process_count())  # where the actors run; the in-process engine


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

    Per step, `__next__` takes this process's share of the next B finished groups from the
    deployment (coder.rl.topology), scored, and returns the learner's batch (keeping their
    `StepRecord` as `current`); the trainer steps on it; `after_step` publishes the new weights
    through the deployment (the actors' next version), runs the held-out agent eval every
    grpo.eval_every steps and returns the step's rollout metrics for its log line. `fit` calls
    `__next__` once before each step and `after_step` once after it.

    `make_episode(task)` builds the env episode of one rollout (it runs in the actors: with Ray
    actors it is pickled, closures included); `held_out` tasks (optional) are evaluated with
    coder.rl.eval at the end (and every grpo.eval_every steps).
    """

    def __init__(self, config, stage_dir: str, init_from: str, *, tokenizer, tasks, make_episode,
                 held_out=None, model_fn=None, trained=None):
        self.topology = validate(config)  # where the actors run: the one place that knows
        rl = config.rl
        self.config, self.stage_dir, self.tokenizer = config, stage_dir, tokenizer
        self.held_out, self.trained = held_out, trained
        b, processes = int(rl.tasks_per_step), jax.process_count()
        if b % processes:
            raise ValueError(f"rl.tasks_per_step={b} does not split over {processes} processes (each "
                             "learner process feeds its share of every step's groups)")
        self.steps = min(int(config.train.steps), len(tasks) // b)
        if self.steps < int(config.train.steps):
            logging.warning("[grpo] %d tasks make %d single-epoch steps of %d tasks, fewer than "
                            "train.steps=%d", len(tasks), self.steps, b, config.train.steps)
        # the epoch's position (which tasks were used) is the trainer's data state: a resumed
        # trainer restores it with the checkpoint
        self.epoch = Epoch()
        self.learner = Learner(config, stage_dir, init_from, model_fn, tokenizer=tokenizer,
                               data_iterator=self.epoch)
        self.trainer = trainer = self.learner.trainer
        # each process feeds its own rows of a step's batch, or (the batch axes do not span the
        # processes) every process the whole batch
        shares = trainer.batch_row_shares() if processes > 1 else 1
        self.topology.check_rows(shares, dict(trainer.mesh.shape))
        order, taken = self.topology.tasks_of(tasks, b, jax.process_index())
        if trainer.step > 0 and len(self.epoch) == 0:
            # a checkpoint without the epoch's position (written before it was saved): the first
            # steps x taken tasks, as the synchronous loop used them
            for pos in range(trainer.step * taken):
                self.epoch.add(pos)
        self.deployment = self.topology.start(
            config, trainer, url=store_url(config, stage_dir), tokenizer=tokenizer, make_episode=make_episode,
            model_fn=model_fn, order=order, epoch=self.epoch, needed=max(self.steps - trainer.step, 0) * taken,
            taken=taken, shares=shares)
        self.eval_every = int(config.grpo.eval_every)
        self.current: StepRecord | None = None  # the batch `fit` is stepping on

    # --- the trainer's iterator and hook -------------------------------------------------------
    def __iter__(self):
        return self

    def __next__(self) -> dict:
        """The learner's next batch: this process's share of the next B finished groups, scored
        (StopIteration when the epoch's tasks ran out; fit logs it)."""
        got = self.deployment.next_groups(self._score)
        if got is None:
            raise StopIteration
        groups, rollout, started = got
        self.current = StepRecord(rollout, learner_start=started)
        return self.learner.batch(groups)

    def _score(self, groups: list, record: dict) -> dict:
        """Scores the step's B groups in place (coder.rl.actor.score_groups); their rollout record."""
        score_groups(groups, self.config.rl)
        before, after = record.pop("engine_before"), record.pop("engine_after")
        rollout = dict(rollout_metrics(groups), **record)
        if after:
            rollout.update(engine_metrics(before, after, record["step_seconds"]))
        return rollout

    def after_step(self, trainer, metrics) -> dict:
        """Publish the step's weights, then its log record (rollout metrics, sync, timing)."""
        sync = self.deployment.publish(trainer.step)  # before the next step's collection
        jax.block_until_ready(metrics)
        record = dict(self.current.rollout, **sync)
        record["learner_time_s"] = time.perf_counter() - self.current.learner_start
        if self.held_out and self.eval_every and trainer.step % self.eval_every == 0 and trainer.step < self.steps:
            self.evaluate()
        return record

    # --- eval and the run ----------------------------------------------------------------------
    def evaluate(self, tasks=None, name: str = "agent_eval") -> dict:
        """The agent eval (coder.rl.eval) of the learner's current weights on `tasks` (default:
        the held-out ones), on the engine the topology evaluates on (coder.rl.topology: the
        in-process actor's, the colocated one, or an engine of the learner's own that reads the
        store). Reports go to {stage_dir}/{name}/; processes that only follow the eval's engine
        return {}."""
        trainer = self.trainer
        tasks = self.held_out if tasks is None else tasks

        def run(actor, alone: bool) -> dict:
            return eval_lib.run_agent_eval(self.config, trainer.model, self.tokenizer, self.stage_dir,
                                           step=trainer.step, tasks=tasks, actor=actor, name=name, alone=alone)

        return self.deployment.evaluate(run)

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
        self.deployment.close()
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
