"""Stage `grpo`: synchronous GRPO of the agent in its own harness (DESIGN.md, Composer 2).

One step:
    tasks  = the next B tasks (single epoch: each task is used once, in a fixed seeded order)
    actor  : G rollouts per task (coder.rl.rollout.Agent over the engine and env episodes)
    reward : outcome - length penalty + auxiliary rewards (coder.rl.reward), per group
    adv    : coder.rl.grpo.advantages (infra failures masked out of their group)
    learner: batch (one generation per row), reference logprobs of the frozen initial policy,
             the trainer's step with coder.rl.grpo's loss, then the new weights to the engine.

Seams for the asynchronous version: `Actor.collect` only needs an engine (weights arrive by
`engine.set_weights(state, version)` and every sampled token records its policy version);
`Learner.update` only needs finished rollouts (their tokens, behaviour logprobs, routing); the
step loop in `train` is the only place that connects them, so an actor thread / process pool
and a weight-sync channel replace it without touching either side. Router replay:
`grpo.router_replay` feeds the engine's expert ids (prompt and observation tokens included) to
the learner's forward as `routing=`.

Metrics (`{stage_dir}/metrics.jsonl`, one line per step): loss, reward, pass_rate, outcome,
test_reward, kl, clip_fraction, ratio_mean/max, entropy, broken_call_rate, infra_failures,
turns, tool_calls, thinking/tool_io/output tokens, summaries, generations, tokens_per_rollout,
submitted, abs_advantage, rollout_time_s, learner_time_s, plus the trainer's (grad_norm, lr, ...).
"""
from __future__ import annotations

import copy
import glob
import logging
import math
import random
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from coder.rl import grpo
from coder.rl import reward as reward_lib
from coder.rl import rollout as rollout_lib


# --- tasks and episodes ------------------------------------------------------------------------
def _all_tasks(source: str, seed: int) -> list:
    from coder.env import tasks as tasks_lib

    if source == "toy":
        return [t for t, _ in tasks_lib.toy_tasks(45, seed)]
    paths = sorted(glob.glob(source))
    if not paths:
        raise FileNotFoundError(f"rl.tasks / rl.eval_tasks={source!r}: no such JSONL file")
    tasks = [t for p in paths for t in tasks_lib.read_tasks(p)]
    random.Random(seed).shuffle(tasks)
    return tasks


def train_tasks(config) -> list:
    """Training tasks in their (seeded) order; with the same source for eval, the last
    `rl.eval_num_tasks` are held out."""
    tasks = _all_tasks(config.rl.tasks, int(config.seed))
    if config.rl.eval_tasks == config.rl.tasks:
        tasks = tasks[: len(tasks) - int(config.rl.eval_num_tasks)]
    return tasks


def eval_tasks(config) -> list:
    tasks = _all_tasks(config.rl.eval_tasks, int(config.seed))
    return tasks[len(tasks) - int(config.rl.eval_num_tasks):]


def episode_factory(config):
    """`task -> SandboxEpisode` with the rollout config's tools and tool timeout."""
    timeout, tools = float(config.rl.tool_timeout_s), tuple(config.rl.tools)
    return lambda task: rollout_lib.SandboxEpisode(task, tools=tools, tool_timeout_s=timeout)


# --- engine ------------------------------------------------------------------------------------
def sampling_params(rl_cfg):
    from coder.infer.engine import SamplingParams

    def make(max_new_tokens, stop_ids):
        return SamplingParams(temperature=float(rl_cfg.temperature), top_p=float(rl_cfg.top_p),
                              top_k=int(rl_cfg.top_k), max_new_tokens=int(max_new_tokens),
                              stop_token_ids=tuple(int(s) for s in stop_ids))

    return make


def detached_state(model) -> nnx.State:
    """The model's variables copied onto one device: the engine's own buffers (the trainer
    donates its arrays to each step, so sharing them would hand the engine deleted buffers)."""
    dev = jax.devices()[0]
    return jax.tree.map(lambda x: jnp.copy(jax.device_put(x, dev)), nnx.state(model))


def make_engine(model, config):
    from coder.infer.engine import Engine

    m = nnx.merge(nnx.graphdef(model), detached_state(model))
    return Engine(m, config.model, max_len=int(config.rl.context_budget),
                  speculative_k=int(config.rl.speculative_k))


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


# --- actor -------------------------------------------------------------------------------------
class Actor:
    """Produces groups of rollouts with an engine (the inference side)."""

    def __init__(self, engine, tokenizer, config, make_episode):
        self.engine, self.config, self.make_episode = engine, config, make_episode
        self.agent = rollout_lib.Agent(engine, tokenizer, config.rl, sampling_params(config.rl))

    def collect(self, tasks, rng) -> list[list]:
        """G rollouts for each task: `[B][G]` Rollouts."""
        g = int(self.config.rl.group_size)
        return [self.agent.run_group(t.id, t.prompt, [self.make_episode(t) for _ in range(g)],
                                     jax.random.fold_in(rng, i)) for i, t in enumerate(tasks)]


def score_groups(groups: list[list], rl_cfg) -> dict:
    """Sets `reward` and `advantage` on every rollout; returns the `[N, G]` arrays."""
    outcomes = np.array([[r.outcome for r in g] for g in groups], np.float64)
    correct = np.array([[r.correct for r in g] for g in groups], bool)
    valid = grpo.valid_mask([[bool(r.infra_error) for r in g] for g in groups])
    usage = np.array([[r.usage() for r in g] for g in groups], np.float64)
    aux = np.array([[reward_lib.aux_total(r, rl_cfg.aux_rewards) for r in g] for g in groups])
    broken = np.array([[r.broken_calls > 0 for r in g] for g in groups], bool)
    rewards = reward_lib.group_rewards(outcomes, correct, valid, usage, aux, rl_cfg.length_penalty,
                                       broken, float(rl_cfg.broken_call_penalty))
    adv = np.asarray(grpo.advantages(rewards, correct, valid))
    for i, g in enumerate(groups):
        for j, r in enumerate(g):
            r.reward, r.advantage = float(rewards[i, j]), float(adv[i, j])
    return dict(rewards=rewards, correct=correct, valid=valid, advantages=adv)


def rollout_metrics(groups: list[list]) -> dict:
    """Means over valid rollouts (and counts over all) of what the stage logs."""
    flat = [r for g in groups for r in g]
    ok = [r for r in flat if not r.infra_error]
    m = {"rollouts": len(flat), "infra_failures": len(flat) - len(ok)}
    if not ok:
        return m

    def mean(f):
        return float(np.mean([f(r) for r in ok]))

    m.update(
        reward=mean(lambda r: r.reward), pass_rate=mean(lambda r: r.correct),
        outcome=mean(lambda r: r.outcome), test_reward=mean(lambda r: r.test_reward),
        broken_call_rate=mean(lambda r: r.broken_calls > 0), turns=mean(lambda r: r.turns),
        tool_calls=mean(lambda r: r.tool_calls), thinking_tokens=mean(lambda r: r.thinking_tokens),
        tool_io_tokens=mean(lambda r: r.tool_io_tokens), output_tokens=mean(lambda r: r.output_tokens),
        summaries=mean(lambda r: r.summaries), tokens_per_rollout=mean(lambda r: r.policy_tokens),
        generations=mean(lambda r: len(r.generations)), submitted=mean(lambda r: r.finish == "submit"),
        abs_advantage=mean(lambda r: abs(r.advantage)),
    )
    return m


# --- learner -----------------------------------------------------------------------------------
class Learner:
    """The trainer with the GRPO loss and the frozen reference policy (the training side)."""

    def __init__(self, config, stage_dir, init_from, model_fn=None):
        from coder.train.trainer import Trainer

        self.config = config
        g, acc = config.grpo, int(config.train.grad_accum)
        tokens_per_group = int(g.tokens_per_group) or int(config.rl.group_size) * int(config.rl.max_rollout_tokens)
        # Constant normalizer: tokens per group budget x groups per step. The trainer averages
        # micro-batch losses, so each micro-batch divides by 1/accum of it (sum / normalizer).
        self.normalizer = tokens_per_group * int(config.rl.tasks_per_step) / acc
        loss_fn = grpo.grpo_loss_fn(clip_low=float(g.clip_low), clip_high=float(g.clip_high),
                                    kl_coef=float(g.kl_coef), normalizer=self.normalizer,
                                    temperature=float(config.rl.temperature),
                                    router_replay=bool(g.router_replay))
        self.trainer = Trainer(config, stage_dir, loss_fn, init_from=init_from, model_fn=model_fn,
                               stage="grpo")
        self.ref = self._reference(init_from, model_fn)
        temperature = float(config.rl.temperature)
        graphdef = nnx.graphdef(self.ref)

        def ref_logp(state, tokens, positions, segment_ids):
            logits, _ = nnx.merge(graphdef, state)(tokens, positions, segment_ids)
            return grpo.target_logp(logits, tokens, segment_ids, temperature)[0]

        self._ref_logp = jax.jit(ref_logp)
        self._ref_state = nnx.state(self.ref)
        self.row_multiple = jax.device_count() * acc

    def _reference(self, init_from, model_fn):
        """The frozen reference policy: the weights this stage started from.

        Fresh stage: a copy of the trainer's initial weights. Resumed stage: the same weights
        rebuilt (init_from's checkpoint, or the seeded initialisation when there is none).
        """
        if self.trainer.step == 0:
            m = self.trainer.model
            return nnx.merge(nnx.graphdef(m), detached_state(m))
        from coder.model import Transformer
        from coder.train import checkpoint as ckpt_lib

        m = model_fn() if model_fn else Transformer(self.config.model, rngs=nnx.Rngs(int(self.config.seed)))
        if init_from:
            flat = ckpt_lib.state_to_flat(nnx.state(m, nnx.Param))
            abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in flat.items()}
            found, _, _ = ckpt_lib.load_params(init_from, abstract)
            flat.update(found)
            nnx.update(m, ckpt_lib.flat_to_state(nnx.state(m, nnx.Param), flat))
        return m

    def batch(self, groups: list[list]) -> dict:
        """The GRPO batch of the step's rollouts (rows padded to a power of two, multiple of
        devices x grad_accum, so few shapes compile) with the reference logprobs."""
        rollouts = [r for g in groups for r in g]
        n = sum(len(r.generations) for r in rollouts if not r.infra_error)
        rows = max(self.row_multiple, 1 << max(0, math.ceil(math.log2(max(n, 1)))))
        rows = -(-rows // self.row_multiple) * self.row_multiple
        b = rollout_lib.to_batch(rollouts, int(self.config.rl.context_budget), rows)
        b["ref_logp"] = np.asarray(self._ref_logp(self._ref_state, b["tokens"], b["positions"], b["segment_ids"]))
        if "expert_ids" in b:
            b["expert_ids"] = np.maximum(b["expert_ids"], 0)  # unrouted tokens predict nothing
            if not self.config.grpo.router_replay:
                del b["expert_ids"]
        b.pop("policy_version")
        return b

    def update(self, groups: list[list]) -> dict:
        return self.trainer.train_step(self.batch(groups))


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
    steps = min(int(config.train.steps), len(tasks) // b)
    if steps < int(config.train.steps):
        logging.warning("[grpo] %d tasks make %d single-epoch steps of %d tasks, fewer than "
                        "train.steps=%d", len(tasks), steps, b, config.train.steps)
    learner = Learner(config, stage_dir, init_from, model_fn)
    trainer = learner.trainer
    engine = make_engine(trainer.model, config)
    engine.set_weights(detached_state(trainer.model), version=trainer.step)
    actor = Actor(engine, tokenizer, config, make_episode)
    log_every, ckpt_every = max(1, int(config.train.log_every)), max(1, int(config.train.ckpt_every))
    eval_every = int(config.grpo.eval_every)
    key = jax.random.key(int(config.seed))
    try:
        while trainer.step < steps:
            s = trainer.step
            t0 = time.perf_counter()
            groups = actor.collect(tasks[s * b:(s + 1) * b], jax.random.fold_in(key, s))
            t1 = time.perf_counter()
            score_groups(groups, rl)
            metrics = learner.update(groups)
            engine.set_weights(detached_state(trainer.model), version=trainer.step)
            jax.block_until_ready(metrics)
            t2 = time.perf_counter()
            record = {**{k: v for k, v in metrics.items()}, **rollout_metrics(groups),
                      "rollout_time_s": t1 - t0, "learner_time_s": t2 - t1}
            if trainer.step % log_every == 0 or trainer.step == steps:
                trainer.log(record, total_steps=steps)
            if trainer.step % ckpt_every == 0 and trainer.step < steps:
                trainer.save()
            if held_out and eval_every and trainer.step % eval_every == 0 and trainer.step < steps:
                eval_lib.run_agent_eval(config, trainer.model, tokenizer, stage_dir, step=trainer.step,
                                        tasks=held_out, make_episode=make_episode, engine=engine)
        trainer.save(force=True)
        trainer.ckpt.wait()
        if held_out:
            res = eval_lib.run_agent_eval(config, trainer.model, tokenizer, stage_dir, step=trainer.step,
                                          tasks=held_out, make_episode=make_episode, engine=engine)
            logging.info("[grpo] agent eval at step %d: %s", trainer.step, res)
    finally:
        trainer.close()
    return trainer.checkpoint_dir


def grpo_config(config):
    """The config of the grpo stage: grpo.steps / grpo.lr over train."""
    c = copy.deepcopy(config)
    c.train.steps = int(c.grpo.steps)
    c.train.lr = float(c.grpo.lr)
    return c


def run(config, stage_dir: str, init_from: str) -> str:
    """Stage `grpo`: tasks from `rl.tasks`, sandboxed episodes, eval on `rl.eval_tasks`."""
    from coder.data import tokenizer as tokenizer_lib

    config = grpo_config(config)
    tok = tokenizer_lib.load_or_train(config)
    make_episode = episode_factory(config)
    return train(config, stage_dir, init_from, tokenizer=tok, tasks=train_tasks(config),
                 make_episode=make_episode, held_out=eval_tasks(config))
