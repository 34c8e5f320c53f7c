"""The inference side of RL: tasks, sandboxed episodes, the engine, and the actor that
produces groups of rollouts with it; scoring of finished groups (rewards and advantages).

Used by stage `grpo` (coder/stages/grpo.py) and the agent eval (coder/rl/eval.py).
"""
from __future__ import annotations

import glob
import random

import jax
import numpy as np

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


def engine_mesh(config):
    """The actor's mesh: this process's devices, with the training mesh's expert / tensor /
    sequence axes and everything else over data (rows). The same logical rules as training
    place the weights; FSDP is folded into data (an inference engine gathers nothing per step).
    On a multi-process job each process's actor decodes on its own devices."""
    from coder.model import sharding

    cfg = config.mesh.copy_and_resolve_references()
    with cfg.unlocked():
        cfg.update(dict(data=-1, fsdp=1, num_slices=1))
    return sharding.make_mesh(cfg, jax.local_devices())


def make_engine(model, config, *, mesh=None):
    """The RL engine on `mesh` (default: `engine_mesh(config)`), with its own copy of the
    model's weights in `rl.engine_dtype`; slots for the larger of a step's B x G rollouts and an
    eval's groups."""
    from coder.infer.engine import Engine

    rl = config.rl
    slots = int(rl.engine_slots) or max(int(rl.tasks_per_step) * int(rl.group_size), int(rl.eval_samples))
    return Engine(model, config.model, max_len=int(rl.context_budget), speculative_k=int(rl.speculative_k),
                  max_slots=slots, decode_steps=int(rl.decode_steps), dtype=rl.engine_dtype or None,
                  mesh=engine_mesh(config) if mesh is None else mesh, rules=config.mesh.rules)


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
