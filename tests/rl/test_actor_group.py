"""GRPO with an actor that spans two processes (coder/rl/actor_group.py) under a local Ray: the
actor a JAX job of two Ray processes with 4 CPU devices each, weights through the sharded store
(each member reads its own slices).

- With the learner in this process (8 CPU devices), the run equals the colocated one, whose
  engine is on the learner's own 8 devices (sync mode, fixed keys): same rewards, losses and
  token counts at every step, and the same final agent eval.
- The disaggregated layout as a cluster runs it, on 4 processes: the learner a job of two
  processes (4 devices each) whose process 0 drives the actor and hands each step's groups to
  process 1 (coder/rl/step_channel.py), async, the rollouts' sandboxes in env workers that are
  Ray actors; a one-process learner fed the same rollouts gives the same losses, and the final
  agent eval runs on an engine over the learner job that loads from the store. (That the
  2-process actor's rollouts are the learner's own engine's is the first test; that a 2-process
  learner trains as one process does, tests/test_multiprocess.py.)
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


def config(tok, topology, **rl):
    """Sync GRPO of 2 tasks x 4 rollouts per step, 2 steps; `topology` (rl.topology) and `rl` keys on top."""
    cfg = rl_test.tiny_config(tok, 256)
    cfg.rl.update({"group_size": 4, "tasks_per_step": 2, "max_turns": 1, **rl})
    cfg.rl.topology.update({"asynchronous": False, **topology})
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
    rl.topology.colocated) -> (metrics, the final agent eval's report)."""
    tmp_path = tmp_path_factory.mktemp("local")
    cfg = config(tok, dict(actors=0, colocated=True), eval_samples=4)
    tasks = [t for t, _ in rl_test.make_tasks(6, seed=0)]
    m = run(tmp_path, "local", cfg, tok, lambda task: rl_test.SubmitEpisode(rl_test.LUCKY),
            model_fn_of(cfg, nnx.state(Transformer(cfg.model, rngs=nnx.Rngs(5)))), tasks[TASKS], tasks[HELD_OUT])
    with open(tmp_path / "local" / "agent_eval" / "step_00000002.json") as f:
        return m, json.load(f)


def test_two_process_actor_equals_the_learners_own_engine(tmp_path, tok, ray_4_devices, local_run):
    """One Ray actor of 2 processes x 4 devices rolls out what the learner's own 8-device engine
    does (`local_run`): the same tokens and losses, and the same final agent eval."""
    cfg = config(tok, dict(actors=1, actor_processes=2), eval_samples=4)
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


ENV_TOOLS = ("write_file", "run_tests", "submit")
ENV_PREAMBLE = "Fix answer.py with the tools, then submit."


def env_tokenizer():
    """A small tokenizer of the sandboxed toy tasks' system prompt, prompts and solutions."""
    from coder.data import tokenizer as tokenizer_lib
    from coder.env import protocol
    from coder.env.tools import registry as env_tools
    from coder.env.tasks import toy_tasks

    pairs = toy_tasks(8, seed=3)
    specs = [s for s in env_tools.SPECS if s.name in ENV_TOOLS]
    texts = [protocol.render_system_prompt(specs, ENV_PREAMBLE)] * 4 + [t.prompt for t, _ in pairs] + \
        [s["answer.py"] for _, s in pairs]
    return tokenizer_lib.train_tokenizer(texts, 400)


def env_config(tok):
    """Async GRPO (staleness bound 1) of 2 sandboxed toy tasks x 4 rollouts per step, 2 steps,
    the rollouts' sandboxes in env workers that are Ray actors (env.workers_backend="ray")."""
    cfg = rl_test.tiny_config(tok, 768)
    cfg.rl.update(dict(group_size=4, tasks_per_step=2, max_turns=2, max_turn_tokens=24, max_rollout_tokens=48,
                       context_budget=768, summary_reserve=16, system_prompt=ENV_PREAMBLE, tools=ENV_TOOLS,
                       concurrent=True, env_workers=2, eval_samples=2))
    cfg.rl.topology.update(dict(actors=1, actor_processes=2, asynchronous=True))
    cfg.env.workers_backend = "ray"
    cfg.grpo.max_staleness = 1
    # a small step: version 1 still emits the broken calls that make a group's rewards differ
    cfg.train.update(dict(steps=2, warmup_steps=0, lr=1e-5))
    cfg.mesh.update(dict(expert=4, tensor=2))
    return cfg


def env_learner_worker(process_id: int, num_processes: int, port: int, workdir: str):
    """One process of the 2-process learner of `test_async_disaggregated_run_with_env_workers_as_ray_actors`:
    stage grpo on sandboxed toy tasks (coder.env.tasks), its actor a Ray actor of 2 processes
    whose episodes run in env workers that are Ray actors. Writes each step's batch (this
    process's rows, as `Learner.batch` built them) and, on process 0, the Ray actors of the env
    pool it saw while training; prints the metrics."""
    import pickle

    import jax

    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=num_processes,
                               process_id=process_id)
    import ray

    from coder.data import tokenizer as tokenizer_lib
    from coder.env.tasks import toy_tasks
    from coder.rl import actor as actor_lib
    from coder.rl import learner as learner_lib
    from coder.rl import step_channel

    step_channel.PART_BYTES = 4096  # each step's groups reach process 1 in several parts
    with open(os.path.join(workdir, "tok.json")) as f:
        tok = tokenizer_lib.from_record(json.load(f))
    cfg = env_config(tok)
    os.makedirs(os.path.join(workdir, "batches"), exist_ok=True)
    batch, env_actors = learner_lib.Learner.batch, set()

    def recording_batch(self, groups, version=None):
        b = batch(self, groups, version)
        with open(os.path.join(workdir, "batches", f"{self.version + 1}_{process_id}.pkl"), "wb") as f:
            pickle.dump(b, f)
        if ray.is_initialized():  # process 0 started the run's Ray: the env workers are its actors
            env_actors.update(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                              if a["name"].startswith("coder-env-"))
        return b

    learner_lib.Learner.batch = recording_batch
    stage_dir = os.path.join(workdir, "grpo")
    tasks = [t for t, _ in toy_tasks(6, seed=3)]  # const 9, const 6, scale 8, scale 2; 2 held out
    grpo_stage.train(cfg, stage_dir, "", tokenizer=tok, tasks=[tasks[i] for i in (0, 2, 1, 3)], held_out=tasks[4:],
                     make_episode=actor_lib.episode_factory(cfg),
                     model_fn=model_fn_of(cfg, nnx.state(Transformer(cfg.model, rngs=nnx.Rngs(5)))))
    out = {"process": jax.process_index(), "env_actors": sorted(env_actors)}
    if process_id == 0:
        with open(os.path.join(stage_dir, "metrics.jsonl")) as f:
            out["metrics"] = [json.loads(line) for line in f]
        with open(os.path.join(stage_dir, "agent_eval", "step_00000002.json")) as f:
            report = json.load(f)
        out["eval"], out["eval_tasks"] = report["summary"], len(report["tasks"])
    print("LEARNER " + json.dumps(out), flush=True)


def test_async_disaggregated_run_with_env_workers_as_ray_actors(tmp_path):
    """The disaggregated layout as a cluster runs it, on 4 processes and local Ray: a learner job
    of 2 processes x 4 devices, one Ray actor of 2 processes x 4 devices, async (the actor runs
    up to one version ahead), each rollout's sandbox in an env worker that is a Ray actor
    started by the actor group's leader. The tiny model does not learn the sandboxed tasks in 2
    steps on 2 cores; what shows the layout trains right: a one-process learner on 8 devices
    (the colocated run's learner) fed the same rollouts gives the same losses, entropies,
    importance ratios, gradient norms and learner-vs-engine logprob gaps, step for step."""
    import glob
    import pickle

    from coder.data import tokenizer as tokenizer_lib
    from coder.rl import learner as learner_lib
    from tests import multiprocess_jobs as jobs

    tok = env_tokenizer()
    with open(tmp_path / "tok.json", "w") as f:
        json.dump(tokenizer_lib.to_record(tok), f)
    port = jobs.free_port()
    procs = [jobs.spawn(__file__, (i, 2, port, tmp_path), devices=4) for i in range(2)]
    outs = [jobs.tagged_json(p, "LEARNER") for p in procs]
    m = outs[0]["metrics"]
    assert [r["step"] for r in m] == [1, 2] and all(r["rollouts"] == 8 and r["infra_failures"] == 0 for r in m)
    assert all(r["actor_processes"] == 2 for r in m)
    assert len(outs[0]["env_actors"]) >= 2, outs[0]  # the env pool's workers: Ray actors
    # the actor ran ahead: step 2 trained on tokens sampled with version 0 (staleness 1)
    assert m[0]["grad_norm"] > 0 and any(r["staleness_max"] == 1 for r in m), m
    # the final agent eval, on sandboxed held-out tasks: an engine over the learner job's 8
    # devices loading version 2 from the store (process 0 leads; no host gathers the model)
    assert 0.0 <= outs[0]["eval"]["pass@1"] <= 1.0 and outs[0]["eval_tasks"] == 2, outs[0]
    # the same rollouts through a one-process learner over this process's 8 devices
    cfg = env_config(tok)
    learner = learner_lib.Learner(cfg, str(tmp_path / "replay"), "",
                                  model_fn=model_fn_of(cfg, nnx.state(Transformer(cfg.model, rngs=nnx.Rngs(5)))))
    assert len(glob.glob(str(tmp_path / "batches" / "*.pkl"))) == 4
    batches = []
    for step in (1, 2):
        parts = []
        for p in (0, 1):
            with open(tmp_path / "batches" / f"{step}_{p}.pkl", "rb") as f:
                parts.append(pickle.load(f))
        # the mesh's batch axes (data 1, fsdp 1) do not span the processes: each fed the whole batch
        assert parts[0].keys() == parts[1].keys()
        for k in parts[0]:
            np.testing.assert_array_equal(parts[0][k], parts[1][k], err_msg=f"step {step} {k}")
        batches.append(parts[0])
    learner.trainer.fit(iter(batches), steps=2)
    learner.trainer.close()
    with open(tmp_path / "replay" / "metrics.jsonl") as f:
        replay = [json.loads(line) for line in f]
    assert [r["step"] for r in replay] == [1, 2]
    for a, b in zip(m, replay):
        np.testing.assert_allclose([a[k] for k in REPLAYED], [b[k] for k in REPLAYED], rtol=2e-5, atol=1e-7,
                                   err_msg=str(a["step"]))


REPLAYED = ("loss", "entropy", "ratio_mean", "grad_norm", "behaviour_logp_abs_diff", "policy_tokens")


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
    the leader's engine raises within rl.topology.actor_timeout_s, the group's rollouts are dropped, the
    group is replaced (new processes, the newest weights from the store) and every step trains
    on whole groups."""
    cfg = config(tok, dict(actors=1, actor_processes=2, actor_timeout_s=10.0, asynchronous=True), tasks_per_step=1)
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
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1`: a stuck job's stacks
    env_learner_worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
