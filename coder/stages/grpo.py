"""Stage `grpo`: synchronous GRPO of the agent in its own harness (docs/rl.md; after Composer 2).

One step:
    tasks  = the next B tasks (single epoch: each task is used once, in a fixed seeded order)
    actor  : G rollouts per task (coder.rl.rollout.Agent over the engine and env episodes)
    reward : outcome - length penalty + auxiliary rewards (coder.rl.reward), per group
    adv    : coder.rl.grpo.advantages (infra failures masked out of their group)
    learner: batch (one generation per row), reference logprobs of the frozen initial policy,
             the trainer's step with coder.rl.grpo's loss, then the new weights to the engine.

Seams for the asynchronous version: `Actor.collect` only needs an engine (weights arrive by
`engine.set_weights(state, version)` and every sampled token records its policy version);
`Learner.batch` only needs finished rollouts (their tokens, behaviour logprobs, routing); `train`
connects them through the trainer's `fit` (a batch generator that collects rollouts, an
`after_step` hook that hands the new weights to the engine), which also gives GRPO the shared
log / checkpoint cadence and SIGTERM handling. Router replay:
`grpo.router_replay` feeds the engine's expert ids (prompt and observation tokens included) to
the learner's forward as `routing=`.

Metrics (`{stage_dir}/metrics.jsonl`, one line per step): loss, reward, pass_rate, outcome,
test_reward, kl, clip_fraction, ratio_mean/max, entropy, broken_call_rate, infra_failures,
turns, tool_calls, thinking/tool_io/output tokens, summaries, generations, tokens_per_rollout,
submitted, abs_advantage, rollout_time_s, learner_time_s, plus the trainer's (grad_norm, lr, ...).
"""
from __future__ import annotations

import logging
import time

import jax
from flax import nnx

from coder.rl import reward as reward_lib
from coder.rl.actor import Actor, episode_factory, eval_tasks, make_engine, rollout_metrics, score_groups, train_tasks
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

    `make_episode(task)` builds the env episode of one rollout; `held_out` tasks (optional) are
    evaluated with coder.rl.eval at the end (and every grpo.eval_every steps).
    """
    from coder.rl import eval as eval_lib

    validate(config)
    rl = config.rl
    b = int(rl.tasks_per_step)
    processes, pid = jax.process_count(), jax.process_index()
    if b % processes:
        raise ValueError(f"rl.tasks_per_step={b} does not split over {processes} processes (each "
                         "process's actor rolls out its share of every step's tasks)")
    local = b // processes
    steps = min(int(config.train.steps), len(tasks) // b)
    if steps < int(config.train.steps):
        logging.warning("[grpo] %d tasks make %d single-epoch steps of %d tasks, fewer than "
                        "train.steps=%d", len(tasks), steps, b, config.train.steps)
    learner = Learner(config, stage_dir, init_from, model_fn, tokenizer=tokenizer)
    trainer = learner.trainer
    engine = make_engine(trainer.model, config)  # its own copy of the weights, on the actor's mesh
    engine.set_weights(nnx.state(trainer.model), version=trainer.step)
    actor = Actor(engine, tokenizer, config, make_episode)
    eval_every = int(config.grpo.eval_every)
    key = jax.random.key(int(config.seed))
    rollout_record = {}  # the current step's rollout metrics, logged with its learner metrics

    def batches():
        """The learner's batches: each step's tasks rolled out by the actor and scored."""
        while True:
            s = trainer.step
            t0 = time.perf_counter()
            before = engine.stats()
            # each process's actor rolls out its share of the step's tasks on its own devices
            mine = tasks[s * b + pid * local:s * b + (pid + 1) * local]
            groups = actor.collect(mine, jax.random.fold_in(jax.random.fold_in(key, s), pid))
            t1 = time.perf_counter()
            score_groups(groups, rl)
            rollout_record.clear()
            rollout_record.update(rollout_metrics(groups), **engine_metrics(before, engine.stats(), t1 - t0),
                                  rollout_time_s=t1 - t0, learner_start=t1)
            yield learner.batch(groups)

    def after_step(trainer, metrics) -> dict:
        engine.set_weights(nnx.state(trainer.model), version=trainer.step)
        jax.block_until_ready(metrics)
        record = dict(rollout_record)
        record["learner_time_s"] = time.perf_counter() - record.pop("learner_start")
        if held_out and eval_every and trainer.step % eval_every == 0 and trainer.step < steps:
            eval_lib.run_agent_eval(config, trainer.model, tokenizer, stage_dir, step=trainer.step,
                                    tasks=held_out, make_episode=make_episode, engine=engine)
        return record

    try:
        trainer.fit(batches(), steps, after_step=after_step)  # logging, checkpoints, SIGTERM
        if held_out:
            res = eval_lib.run_agent_eval(config, trainer.model, tokenizer, stage_dir, step=trainer.step,
                                          tasks=held_out, make_episode=make_episode, engine=engine)
            logging.info("[grpo] agent eval at step %d: %s", trainer.step, res)
    finally:
        trainer.close()
    return trainer.checkpoint_dir


def run(config, stage_dir: str, init_from: str) -> str:
    """Stage `grpo`: tasks from `rl.tasks`, sandboxed episodes, eval on `rl.eval_tasks`."""
    from coder.train.checkpoint import stage_tokenizer

    tok = stage_tokenizer(config, init_from, stage_dir)  # the checkpoint's (resumed or init_from)
    make_episode = episode_factory(config)
    return train(config, stage_dir, init_from, tokenizer=tok, tasks=train_tasks(config),
                 make_episode=make_episode, held_out=eval_tasks(config))
