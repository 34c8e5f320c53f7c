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
inside this process. The stage connects actors and learner through the trainer's `fit` (a batch
generator that takes groups from the driver, an `after_step` hook that publishes the new
weights), which also gives GRPO the shared log / checkpoint cadence and SIGTERM handling; the
epoch's position (which tasks were used) is the trainer's data state, saved in every checkpoint.
Router replay: `grpo.router_replay` feeds the engine's expert ids (prompt and observation tokens
included) to the learner's forward as `routing=`.

Metrics (`{stage_dir}/metrics.jsonl`, one line per step): loss, reward, pass_rate, outcome,
test_reward, kl, clip_fraction, ratio_mean/max, entropy, stale_tokens, staleness_mean/max,
behaviour_logp_abs_diff(_max), routing_mismatch, unrouted_tokens (the engine/learner gap),
broken_call_rate, infra_failures, turns, tool_calls, thinking/tool_io/output tokens, summaries,
generations, tokens_per_rollout, submitted, abs_advantage, rollout_time_s, learner_time_s,
learner_idle_s, actor_idle_s, rollouts_per_s, dropped_rollouts(_total), mixed_version_rollouts,
version_lag, sync_bytes / sync_raw_bytes / sync_publish_s (the version this step published),
sync_read_bytes / sync_apply_s (per version the actors applied), the engine's, plus the
trainer's (grad_norm, lr, ...).
"""
from __future__ import annotations

import logging
import time

import jax
from flax import nnx

from coder.rl import actor_learner
from coder.rl import reward as reward_lib
from coder.rl.actor import episode_factory, eval_tasks, make_engine, rollout_metrics, score_groups, train_tasks
from coder.rl.learner import Learner


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
    if not config.grpo["async"] and int(rl.num_actors) > 1:
        raise ValueError(f"grpo.async=False runs one actor: set rl.num_actors to 0 or 1 (it is "
                         f"{rl.num_actors}), or grpo.async=True")


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
def train(config, stage_dir: str, init_from: str, *, tokenizer, tasks, make_episode,
          held_out=None, model_fn=None) -> str:
    """The GRPO loop over `tasks` (single epoch). Returns the checkpoint directory.

    `make_episode(task)` builds the env episode of one rollout (it runs in the actors: with Ray
    actors it is pickled, closures included); `held_out` tasks (optional) are evaluated with
    coder.rl.eval at the end (and every grpo.eval_every steps).
    """
    from coder.rl import eval as eval_lib

    validate(config)
    rl = config.rl
    b = int(rl.tasks_per_step)
    processes, pid = jax.process_count(), jax.process_index()
    if b % processes:
        raise ValueError(f"rl.tasks_per_step={b} does not split over {processes} processes (each "
                         "process's actors roll out its share of every step's tasks)")
    local = b // processes
    steps = min(int(config.train.steps), len(tasks) // b)
    if steps < int(config.train.steps):
        logging.warning("[grpo] %d tasks make %d single-epoch steps of %d tasks, fewer than "
                        "train.steps=%d", len(tasks), steps, b, config.train.steps)
    learner = Learner(config, stage_dir, init_from, model_fn, tokenizer=tokenizer)
    trainer = learner.trainer
    # this process's share of the epoch: of every B consecutive tasks, the `local` at its offset
    order = [(i, t) for i, t in enumerate(tasks[:len(tasks) // b * b]) if (i % b) // local == pid]
    epoch = actor_learner.Epoch()
    _restore_epoch(trainer, epoch, local)
    trainer.data_iterator = epoch  # saved with every checkpoint: a resumed stage takes the next tasks
    url = actor_learner.store_url(config, stage_dir)
    weights = actor_learner.LearnerWeights(config, url)
    start = weights.publish(trainer.model, trainer.step)  # the actors start from this version
    logging.info("[grpo] weights version %d in %s (%d bytes); %s mode, %s", trainer.step, url,
                 start["sync_bytes"], "async" if config.grpo["async"] else "sync",
                 f"{rl.num_actors} Ray actor(s)" if int(rl.num_actors) else "the actor in this process")
    actors = actor_learner.start_actors(config, tokenizer=tokenizer, make_episode=make_episode,
                                        model_fn=model_fn, url=url)
    driver = actor_learner.Driver(config, actors, order, epoch, needed=max(steps - trainer.step, 0) * local,
                                  local=local, version=trainer.step)
    eval_every, anchor_every = int(config.grpo.eval_every), int(rl.anchor_every)
    eval_engine = []  # the learner's own engine for agent evals when the actors are Ray processes
    step_record = {}  # the current step's rollout metrics, logged with its learner metrics

    def batches():
        """The learner's batches: the next B finished groups, scored."""
        while True:
            groups, record = driver.take()
            if groups is None:
                return  # the epoch's tasks ran out (fit logs it)
            t1 = time.perf_counter()
            score_groups(groups, rl)
            before, after = record.pop("engine_before"), record.pop("engine_after")
            step_record.clear()
            step_record.update(rollout_metrics(groups), **record, learner_start=t1)
            if after:
                step_record.update(engine_metrics(before, after, record["step_seconds"]))
            yield learner.batch(groups)

    def evaluate(step: int) -> dict:
        if isinstance(actors, actor_learner.LocalActors):
            engine = actors.workers[0].engine
        else:
            if not eval_engine:
                eval_engine.append(make_engine(trainer.model, config))
            engine = eval_engine[0]
        engine.set_weights(nnx.state(trainer.model), version=trainer.step)
        return eval_lib.run_agent_eval(config, trainer.model, tokenizer, stage_dir, step=step,
                                       tasks=held_out, make_episode=make_episode, engine=engine)

    def after_step(trainer, metrics) -> dict:
        sync = weights.publish(trainer.model, trainer.step)  # before the next step's collection
        driver.published(trainer.step)
        if trainer.step % anchor_every == 0:  # drop what no actor can still need
            weights.gc(driver.oldest_actor_version())
        jax.block_until_ready(metrics)
        record = dict(step_record, **sync)
        record["learner_time_s"] = time.perf_counter() - record.pop("learner_start")
        if held_out and eval_every and trainer.step % eval_every == 0 and trainer.step < steps:
            evaluate(trainer.step)
        return record

    try:
        trainer.fit(batches(), steps, after_step=after_step)  # logging, checkpoints, SIGTERM
        if held_out:
            res = evaluate(trainer.step)
            logging.info("[grpo] agent eval at step %d: %s", trainer.step, res)
    finally:
        for engine in eval_engine:
            engine.close()
        driver.close()
        trainer.close()
    return trainer.checkpoint_dir


def _restore_epoch(trainer, epoch, local: int) -> None:
    """The epoch's position saved with the checkpoint the trainer resumed from (a checkpoint
    without one: the first steps x local tasks, as the synchronous loop used them)."""
    if trainer.step == 0:
        return
    from etils import epath

    from coder.train import checkpoint as ckpt_lib

    state = ckpt_lib.ProcessJsonHandler().restore(epath.Path(trainer.checkpoint_dir) / str(trainer.step) / "data")
    if state is None:
        for pos in range(trainer.step * local):
            epoch.add(pos)
    else:
        epoch.set_state(state)


def run(config, stage_dir: str, init_from: str) -> str:
    """Stage `grpo`: tasks from `rl.tasks`, sandboxed episodes, eval on `rl.eval_tasks`."""
    from coder.train.checkpoint import stage_tokenizer

    tok = stage_tokenizer(config, init_from, stage_dir)  # the checkpoint's (resumed or init_from)
    make_episode = episode_factory(config)
    return train(config, stage_dir, init_from, tokenizer=tok, tasks=train_tasks(config),
                 make_episode=make_episode, held_out=eval_tasks(config))
