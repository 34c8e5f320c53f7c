"""GRPO with an actor that spans two processes (coder/rl/actor_group.py) under a local Ray: the
actor a JAX job of two Ray processes with 4 CPU devices each, weights through the sharded store
(each member reads its own slices).

- With the learner in this process (8 CPU devices), the run equals the colocated one, whose
  engine is on the learner's own 8 devices (sync mode, fixed keys): same rewards, losses and
  token counts at every step, and the same final agent eval.
- With the learner a job of two processes (4 devices each) whose process 0 drives the actor and
  scatters each step's groups (coder/rl/step_channel.py): the disaggregated layout on 4
  processes, the same run as the colocated one.
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
    """Sync GRPO of 2 tasks x 4 rollouts per step, 2 steps; `rl` keys on top."""
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


def equal_runs(local: list[dict], other: list[dict], rtol: float) -> None:
    """The same tokens (rewards, prompt and decode counts) at every step, and the same losses."""
    assert [r["step"] for r in other] == [r["step"] for r in local] == [1, 2]
    for a, b in zip(local, other):
        for key in ("reward", "tokens_per_rollout", "output_tokens", "submitted", "engine_prefill_tokens"):
            assert a[key] == b[key], (key, a[key], b[key])
        np.testing.assert_allclose([a["loss"], a["entropy"]], [b["loss"], b["entropy"]], rtol=rtol)


TASKS, HELD_OUT = slice(0, 4), slice(4, 6)


@pytest.fixture(scope="module")
def local_run(tmp_path_factory, tok):
    """The reference: sync GRPO, 2 steps of 2 tasks x 4 rollouts, colocated (the actor in the
    learner's process, its engine on the learner's 8 devices, each version resharded on device:
    rl.colocated) -> (metrics, the final agent eval's report)."""
    tmp_path = tmp_path_factory.mktemp("local")
    cfg = config(tok, num_actors=0, eval_samples=4, colocated=True)
    tasks = [t for t, _ in rl_test.make_tasks(6, seed=0)]
    m = run(tmp_path, "local", cfg, tok, lambda task: rl_test.SubmitEpisode(rl_test.LUCKY),
            model_fn_of(cfg, nnx.state(Transformer(cfg.model, rngs=nnx.Rngs(5)))), tasks[TASKS], tasks[HELD_OUT])
    with open(tmp_path / "local" / "agent_eval" / "step_00000002.json") as f:
        return m, json.load(f)


def test_two_process_actor_equals_the_learners_own_engine(tmp_path, tok, ray_4_devices, local_run):
    """One Ray actor of 2 processes x 4 devices rolls out what the learner's own 8-device engine
    does (`local_run`): the same tokens and losses, and the same final agent eval."""
    cfg = config(tok, num_actors=1, actor_processes=2, eval_samples=4)
    tasks = [t for t, _ in rl_test.make_tasks(6, seed=0)]
    group = run(tmp_path, "group", cfg, tok, lambda task: rl_test.SubmitEpisode(rl_test.LUCKY),
                model_fn_of(cfg, nnx.state(Transformer(cfg.model, rngs=nnx.Rngs(5)))), tasks[TASKS], tasks[HELD_OUT])
    with open(tmp_path / "group" / "agent_eval" / "step_00000002.json") as f:
        group_eval = json.load(f)
    local, local_eval = local_run
    # the final agent eval: on the colocated engine (local), on an engine of the learner's own
    # that follows the store (group): the same version, the same results
    assert "pass@1" in local_eval["summary"]
    assert local_eval["summary"] == group_eval["summary"], (local_eval, group_eval)
    assert [r["actor_processes"] for r in local] == [1, 1] and [r["actor_processes"] for r in group] == [2, 2]
    assert all(r["sync_bytes"] == 0 for r in local) and all(r["sync_bytes"] > 0 for r in group)
    # the leader counts the bytes of its own slices of version 1 (that each member reads about its
    # share of every version is tests/rl/test_weight_sync.py's two-process test)
    assert group[1]["sync_versions"] == 1 and group[1]["sync_read_bytes"] > 0
    equal_runs(local, group, rtol=1e-5)


def learner_worker(process_id: int, num_processes: int, port: int, workdir: str):
    """One process of a 2-process learner (4 CPU devices each) whose process 0 drives one Ray
    actor of 2 processes (a local Ray it starts; its workers inherit this process's 4 devices):
    stage grpo as `local_run` runs it, its final agent eval on an engine over both processes'
    devices that loads the version from the store (process 0 leads). Prints the metrics and the
    eval (process 0) and the epoch position each process checkpointed."""
    import jax

    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=num_processes,
                               process_id=process_id)
    from coder.rl import step_channel

    step_channel.PART_BYTES = 4096  # each step's share travels in several parts
    tok = rl_test.tokenizer()
    cfg = config(tok, num_actors=1, actor_processes=2, eval_samples=4)
    tasks = [t for t, _ in rl_test.make_tasks(6, seed=0)]
    stage_dir = os.path.join(workdir, "grpo")
    grpo_stage.train(cfg, stage_dir, "", tokenizer=tok, tasks=tasks[TASKS], held_out=tasks[HELD_OUT],
                     make_episode=lambda task: rl_test.SubmitEpisode(rl_test.LUCKY),
                     model_fn=model_fn_of(cfg, nnx.state(Transformer(cfg.model, rngs=nnx.Rngs(5)))))
    out = {"process": jax.process_index(), "devices": jax.device_count()}
    with open(os.path.join(stage_dir, "checkpoints", "2", "data", f"process_{process_id}-of-2.json")) as f:
        out["epoch"] = json.load(f)
    if process_id == 0:
        with open(os.path.join(stage_dir, "metrics.jsonl")) as f:
            out["metrics"] = [json.loads(line) for line in f]
        with open(os.path.join(stage_dir, "agent_eval", "step_00000002.json")) as f:
            out["eval"] = json.load(f)["summary"]
    print("LEARNER " + json.dumps(out), flush=True)


def test_two_process_learner_drives_a_two_process_actor(tmp_path, local_run):
    """The whole disaggregated layout on 4 processes: a learner job of 2 processes x 4 devices
    (one global mesh) whose process 0 drives the actors and scatters each step's groups to
    process 1 (coder/rl/step_channel.py), and one Ray actor of 2 processes x 4 devices. It trains
    what `local_run` trains: the same tokens and losses (rtol 2e-5, as the two-process trainer
    test), and both learner processes checkpoint the same epoch position. Its final agent eval
    runs on an engine over the learner job's 8 devices that loads the version from the store
    (no host gathers the model) and gives `local_run`'s results."""
    from tests import multiprocess_jobs as jobs

    port = jobs.free_port()
    procs = [jobs.spawn(__file__, (i, 2, port, tmp_path), devices=4) for i in range(2)]
    outs = [jobs.tagged_json(p, "LEARNER") for p in procs]
    assert [o["devices"] for o in outs] == [8, 8]
    assert outs[0]["epoch"] == outs[1]["epoch"] == {"format": 1, "below": 4, "extra": []}
    m = outs[0]["metrics"]
    assert [r["actor_processes"] for r in m] == [2, 2] and all(r["rollouts"] == 8 for r in m)
    equal_runs(local_run[0], m, rtol=2e-5)
    assert outs[0]["eval"] == local_run[1]["summary"]


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


if __name__ == "__main__":
    learner_worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
