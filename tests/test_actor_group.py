"""GRPO with an actor that spans two processes (coder/rl/actor_group.py) under a local Ray: the
learner in this process (8 CPU devices), the actor a JAX job of two Ray processes with 4 CPU
devices each, weights through the sharded store (each member reads its own slices).

- The run equals the one whose actor is the learner's own 8-device engine (sync mode, fixed
  keys): same rewards, losses and token counts at every step.
- A member killed mid-run breaks its group: the group's groups are dropped, the group is
  replaced by a new one that reads the newest version, and the run completes.
"""
import json
import os
import signal
import sys

import numpy as np
import pytest
from flax import nnx

from coder.model import Transformer
from coder.stages import grpo as grpo_stage
from tests import rl_toy as rl_test
from tests import xla_flags

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]


@pytest.fixture(scope="module")
def ray_4_devices():
    """A local Ray whose worker processes see 4 CPU devices each: a 2-process group has the 8
    devices the learner's own engine has."""
    import ray
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the episodes below travel by value
    flags = xla_flags.merged(os.environ.get("XLA_FLAGS", ""), devices=4)
    ray.init(address="local", num_cpus=4, include_dashboard=False, runtime_env={"env_vars": {"XLA_FLAGS": flags}})
    yield
    ray.shutdown()


def config(tok, **rl):
    cfg = rl_test.tiny_config(tok, 256)
    cfg.rl.update({"group_size": 4, "tasks_per_step": 2, "max_turns": 1, **rl})
    cfg.grpo["async"] = False
    cfg.train.update(dict(steps=2, warmup_steps=0))  # version 1 differs from version 0
    # the weights split over experts and heads, so a group's member holds half of them (data = 1)
    cfg.mesh.update(dict(expert=4, tensor=2))
    return cfg


def model_fn_of(cfg, weights, pid_dir=None):
    """The model with `weights`; in `pid_dir`, a file per process that built it (every member of
    a group builds the structure)."""
    def model_fn():
        if pid_dir is not None:
            open(os.path.join(pid_dir, str(os.getpid())), "w").close()
        m = Transformer(cfg.model, rngs=nnx.Rngs(1))
        nnx.update(m, weights)
        return m

    return model_fn


def run(tmp_path, name, cfg, tok, make_episode, model_fn, tasks, held_out=None):
    stage_dir = str(tmp_path / name)
    grpo_stage.train(cfg, stage_dir, "", tokenizer=tok, tasks=tasks, make_episode=make_episode,
                     model_fn=model_fn, held_out=held_out)
    with open(os.path.join(stage_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def tok():
    return rl_test.tokenizer()


def test_two_process_actor_equals_the_learners_own_engine(tmp_path, tok, ray_4_devices):
    """Sync GRPO, 2 steps of 2 tasks x 4 rollouts: actor in the learner's process (8 devices) vs
    one Ray actor of 2 processes x 4 devices. Same tokens (rewards, prompt and decode counts)
    and the same losses."""
    weights = nnx.state(Transformer(config(tok).model, rngs=nnx.Rngs(5)))
    tasks = [t for t, _ in rl_test.make_tasks(6, seed=0)]
    episode = lambda task: rl_test.SubmitEpisode(rl_test.LUCKY)
    runs, evals = {}, {}
    for name, rl in (("local", dict(num_actors=0)), ("group", dict(num_actors=1, actor_processes=2))):
        cfg = config(tok, **rl)
        cfg.rl.eval_samples = 4
        runs[name] = run(tmp_path, name, cfg, tok, episode, model_fn_of(cfg, weights), tasks[:4], tasks[4:])
        with open(tmp_path / name / "agent_eval" / "step_00000002.json") as f:
            evals[name] = json.load(f)
    # the final agent eval: on the in-process actor's engine (local), on an engine of the learner's
    # own that follows the store (group): the same version, the same results
    assert "pass@1" in evals["local"]["summary"]
    assert evals["local"]["summary"] == evals["group"]["summary"], evals
    local, group = runs["local"], runs["group"]
    assert [r["step"] for r in group] == [1, 2]
    assert [r["actor_processes"] for r in local] == [1, 1] and [r["actor_processes"] for r in group] == [2, 2]
    # the leader counts the bytes of its own slices of version 1 (that each member reads about its
    # share of every version is tests/test_weight_sync.py's two-process test)
    assert group[1]["sync_versions"] == 1 and group[1]["sync_read_bytes"] > 0
    for a, b in zip(local, group):
        for key in ("reward", "tokens_per_rollout", "output_tokens", "submitted", "engine_prefill_tokens"):
            assert a[key] == b[key], (key, a[key], b[key])
        np.testing.assert_allclose([a["loss"], a["entropy"]], [b["loss"], b["entropy"]], rtol=1e-5)


class KillMember(rl_test.SubmitEpisode):
    """Built in the group's leader: the first time, kills every other process that built the
    model but the learner's (the group's follower)."""

    def __init__(self, expected, pid_dir, marker, learner):
        if not os.path.exists(marker):
            open(marker, "w").close()
            for pid in map(int, os.listdir(pid_dir)):
                if pid not in (os.getpid(), learner):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        super().__init__(expected)


def test_a_killed_member_breaks_its_group_and_a_new_group_finishes_the_run(tmp_path, tok, ray_4_devices):
    """The follower of the actor's group is SIGKILLed while the leader starts task 2's group:
    the leader's engine raises within rl.actor_timeout_s, the group's rollouts are dropped, the
    group is replaced (new processes, the newest weights from the store) and every step trains
    on whole groups."""
    cfg = config(tok, num_actors=1, actor_processes=2, actor_timeout_s=10.0, tasks_per_step=1)
    cfg.grpo["async"] = True
    cfg.train.steps = 3
    weights = nnx.state(Transformer(cfg.model, rngs=nnx.Rngs(5)))
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    marker = str(tmp_path / "killed")
    tasks = [t for t, _ in rl_test.make_tasks(5, seed=0)]
    victim, learner = tasks[1].id, os.getpid()

    def make_episode(task):
        if task.id == victim:
            return KillMember(rl_test.LUCKY, str(pid_dir), marker, learner)
        return rl_test.SubmitEpisode(rl_test.LUCKY)

    m = run(tmp_path, "grpo", cfg, tok, make_episode, model_fn_of(cfg, weights, str(pid_dir)), tasks)
    assert os.path.exists(marker)
    assert [r["step"] for r in m] == [1, 2, 3]
    assert m[-1]["dropped_rollouts_total"] >= 4 and m[-1]["dropped_rollouts_total"] % 4 == 0
    assert all(r["rollouts"] == 4 and r["infra_failures"] == 0 for r in m)
    assert len(os.listdir(pid_dir)) >= 5  # the learner, the first group, a second group's two processes
