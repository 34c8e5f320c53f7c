"""Stage grpo survives preemption exactly: SIGTERM after the first step saves and exits 0; the
resumed run (grpo.kl_coef > 0) trains the next steps on the next tasks and ends where an
uninterrupted run ends, metric for metric and weight for weight. In two layouts: the actor in the
stage's one process, and disaggregated on 3 processes (a learner job of two processes, each
signalled, and a Ray actor). A multi-process actor (a JAX job of its own) is
tests/rl/test_actor_group.py's: its members' equality with the learner's engine, a killed member
and its replacement; here one process keeps each of the three runs ~20 s cheaper on 2 cores.

The runs are subprocesses (this file run as a script, like tests/train/test_checkpoint_resume.py):
stage grpo's `train` on tests/rl_toy.py's in-process toy task ("submit the lucky
number", reward 1 for "3") with its tiny MoE model, SFT-ed (tests/conftest.py toy_policy) on the call format
with a random answer (so rewards differ within a group, the policy moves, and the KL to the
frozen reference is > 0 from step 2 on). Sync mode (`rl.topology.asynchronous=False`, lockstep), the actor
inside the stage's process (`rl.topology.actors=0`: the driver's thread and the actor's group thread
run beside the learner when the signal arrives), checkpoints only at the end and on SIGTERM.

Why the resumed run can equal the uninterrupted one bit for bit: in sync mode step s's groups
are the tasks of positions [s B, (s+1) B) sampled with the learner's version-s weights; a
group's sampling key is fold_in(key(seed), task index, attempt), independent of timing and of
which rows share a decode call; the checkpoint holds the params, the optimizer state, the
router bias, the step and the epoch's position (`coder.rl.driver.Epoch`), and the reference is
rebuilt from its recorded source and checked (coder.rl.learner). One more condition: the
engine's behaviour logprobs (which enter the loss through the ratio) depend in their last bits
on which rows share a decode call (the batch's shapes; the MoE's dense or sorted dispatch,
chosen by the number of tokens). With concurrent rollouts (rl.concurrent, one thread per
rollout) that is thread timing, and two fresh runs already differ in the 7th digit of
grad_norm at step 2 (measured); so the actor here rolls out one group at a time
(rl.engine_slots = G) with rl.concurrent=False: a group's G rows decode in lockstep, the same
calls in every run. The groups the driver had
handed out for the step after the checkpoint (in flight at SIGTERM) were never trained on and
are not in the saved epoch: the resumed run samples them again, with the same keys and weights
(so that one is in flight, the script holds process 0's exit after SIGTERM until the actor has
started the next step's first group: on a loaded machine the actor's process can lag the
learner's check, and CI once saw the learner exit first).

The script records, per run, every trained batch's task ids (`trained.jsonl`, by wrapping
`Learner.batch`) and every episode started (`episodes.jsonl`), so the test can see tasks
trained exactly once and in-flight groups re-generated.
"""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests import xla_flags

pytestmark = pytest.mark.subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 4
B, G = 2, 4  # tasks per step, rollouts per task
STAGE_LEN = 256
COMPARED = ("loss", "reward", "kl", "ratio_mean", "entropy", "policy_tokens", "grad_norm", "pass_rate",
            "behaviour_logp_abs_diff")


# the layouts: (learner processes, the actors' keys). The actor in the stage's process; or the
# disaggregated layout on 3 processes: a learner job of two processes (one device each, one
# global mesh; process 0 drives the actors and scatters each step's groups) and one Ray actor
ACTORS = {"in_process": (1, dict(actors=0)),
          "disaggregated": (2, dict(actors=1, actor_processes=1))}


def _config(tok, actors="in_process"):
    from tests import rl_toy as rl_test

    cfg = rl_test.tiny_config(tok, STAGE_LEN)
    # one group at a time, its rows decoding together (module docstring: bit-exact engine)
    cfg.rl.update(dict(group_size=G, tasks_per_step=B, concurrent=False, engine_slots=G))
    cfg.rl.topology.update(dict(asynchronous=False, **ACTORS[actors][1]))
    cfg.grpo.kl_coef = 0.05
    cfg.train.update(dict(steps=STEPS, ckpt_every=1000, lr=3e-3, warmup_steps=0))
    return cfg


def _run(stage_dir: str, inputs: str, sleep_s: float, actors: str, process: int, port: int) -> None:
    """One stage process (the subprocess; `process` of ACTORS[actors][0], a jax.distributed job
    on `port`): the tokenizer and SFT-ed weights from `inputs`; each episode's submit call sleeps
    `sleep_s` (so the test can signal mid-run); the actor where `actors` (ACTORS) says. Episodes
    record the driving process's pid (they may run in an actor's)."""
    import jax

    processes = ACTORS[actors][0]
    if processes > 1:
        jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=processes,
                                   process_id=process)
    from flax import nnx

    from coder.data import tokenizer as tokenizer_lib
    from coder.model import Transformer
    from coder.rl import learner as learner_lib
    from coder.stages import grpo as grpo_stage
    from coder.train import hooks as hooks_lib
    from coder.train.flat import flat_to_state
    from tests import rl_toy as rl_test

    with open(os.path.join(inputs, "tokenizer.json")) as f:
        tok = tokenizer_lib.from_record(json.load(f))
    cfg = _config(tok, actors)
    flat = dict(np.load(os.path.join(inputs, "weights.npz")))

    def model_fn():
        m = Transformer(cfg.model, rngs=nnx.Rngs(1))
        nnx.update(m, flat_to_state(nnx.state(m), flat))
        return m

    os.makedirs(stage_dir, exist_ok=True)
    log = lambda name, rec: open(os.path.join(stage_dir, name), "a").write(json.dumps(rec) + "\n")
    batch = learner_lib.Learner.batch

    def recording_batch(self, groups, version=None):  # every process logs its share of the step
        log("trained.jsonl", {"pid": os.getpid(), "process": process, "step": self.version + 1,
                              "tasks": [grp[0].task_id for grp in groups]})
        return batch(self, groups, version)

    learner_lib.Learner.batch = recording_batch
    preemption_check = hooks_lib.Preemption.__call__

    def held_preemption_check(self, trainer, info):
        # the test checks that the group in flight at the exit is sampled again on resume: once
        # SIGTERM is seen, process 0 holds the exit until the actor (another process, which on a
        # loaded machine may lag the learner's check) has started the next step's first group
        if process == 0 and self.signalled:
            deadline = time.time() + 120
            while not _next_group_started(stage_dir) and time.time() < deadline:
                time.sleep(0.05)
        return preemption_check(self, trainer, info)

    hooks_lib.Preemption.__call__ = held_preemption_check

    class SlowEpisode(rl_test.SubmitEpisode):
        def call(self, call):
            time.sleep(sleep_s)
            return super().call(call)

    stage_pid = os.getpid()

    def make_episode(task):
        log("episodes.jsonl", {"pid": stage_pid, "task": task.id})
        return SlowEpisode(rl_test.LUCKY)

    tasks = [t for t, _ in rl_test.make_tasks(STEPS * B + B, seed=0)]  # one step's tasks to spare
    grpo_stage.train(cfg, stage_dir, "", tokenizer=tok, tasks=tasks, make_episode=make_episode,
                     model_fn=model_fn)


def _spawn(stage_dir, inputs, sleep_s, actors) -> list:
    """The run's processes (one per learner process), started together."""
    from tests import multiprocess_jobs as jobs

    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env["XLA_FLAGS"] = xla_flags.one_device(env.get("XLA_FLAGS", ""))  # one device per host
    port = jobs.free_port()
    return [jobs.Job([sys.executable, __file__, stage_dir, inputs, str(sleep_s), actors, str(i), str(port)],
                     merged=True, cwd=ROOT, env=env)
            for i in range(ACTORS[actors][0])]


def _finish(procs, timeout) -> None:
    """Every process of a run exits 0 (else the failing one's output's end; a process still
    running after `timeout` s fails the test with every process's stacks)."""
    for proc in procs:
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"a process still runs after {timeout} s; the stacks and logs:\n" + _stacks(procs))
        assert proc.returncode == 0, proc.output()[0][-4000:]


def _stacks(procs) -> str:
    """Every live process's Python stacks (faulthandler on SIGUSR1, `_run`) and the end of each
    one's output; then kills them all (a hung run must not outlive its test)."""
    from coder.env.runtime.terminal import _proc_tree

    below = [pid for p in procs for pid in _proc_tree(p.pid)]  # Ray's raylet, GCS, workers
    members = [pid for pid in below if b"GroupMember" in _cmdline(pid)]
    _signal([p.pid for p in procs] + members, signal.SIGUSR1)
    time.sleep(5)  # the stacks written; Ray forwards the members' to process 0's output
    _signal(below, signal.SIGKILL)
    for proc in procs:
        proc.kill()
        proc.wait()
    return "\n".join(f"--- process {i} (exit {p.returncode}) ---\n{p.output()[0][-12000:]}" for i, p in enumerate(procs))


def _signal(pids, sig) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _jsonl(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f]


def _next_group_started(stage_dir) -> bool:
    """An episode has started for a task no trained batch holds yet (after the first step: the
    next step's group is in flight). A line being written counts as not yet."""
    try:
        done = {t for r in _trained(stage_dir) for t in r["tasks"]}
        return bool(done) and bool({r["task"] for r in _jsonl(os.path.join(stage_dir, "episodes.jsonl"))} - done)
    except json.JSONDecodeError:
        return False


def _trained(stage_dir) -> list:
    """trained.jsonl's records in (step, process) order (the processes append concurrently)."""
    return sorted(_jsonl(os.path.join(stage_dir, "trained.jsonl")), key=lambda r: (r["step"], r["process"]))


def _final_weights(stage_dir):
    """(version, {name: array}) of the newest weights the run published: every variable of the
    learner's model after its last step (float32: the serving dtype is model.dtype here)."""
    from coder.rl import weight_sync

    return weight_sync.load(os.path.join(stage_dir, "weights"))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, toy_policy):
    """The tokenizer and the SFT-ed weights both runs start from (the session's fitted toy),
    written once for the subprocesses."""
    from coder.data import tokenizer as tokenizer_lib
    from coder.train.flat import state_to_flat

    d = tmp_path_factory.mktemp("inputs")
    with open(d / "tokenizer.json", "w") as f:
        json.dump(tokenizer_lib.to_record(toy_policy.tokenizer), f)
    np.savez(d / "weights.npz", **{k: np.asarray(v) for k, v in state_to_flat(toy_policy.state).items()})
    return str(d)


@pytest.mark.slow
@pytest.mark.parametrize("actors", sorted(ACTORS))
def test_sigterm_then_resume_equals_the_uninterrupted_run(tmp_path, inputs, actors):
    """Both layouts: the actor in the stage's process, and the disaggregated one on 3 processes
    (a 2-process learner whose every process gets SIGTERM, as a preempted slice's hosts do; the
    Ray actor group rebuilt from the store's newest version when the run resumes)."""
    ref_dir, run_dir = str(tmp_path / "ref"), str(tmp_path / "run")
    processes = ACTORS[actors][0]
    _finish(_spawn(ref_dir, inputs, 0.0, actors), timeout=900)
    procs = _spawn(run_dir, inputs, 0.3, actors)
    t0 = time.time()
    # signal once the first step is logged and the next step's first group is rolling out (what
    # the test checks is re-generated on resume; waiting for the metrics line alone let a loaded
    # machine's SIGTERM land before that group started: nothing in flight to check)
    while not (_jsonl(os.path.join(run_dir, "metrics.jsonl")) and _next_group_started(run_dir)):
        for proc in procs:
            assert proc.poll() is None, proc.output()[0][-4000:]
        if time.time() - t0 > 300:  # 15-30 s when well (2 cores, the suite's other worker busy)
            pytest.fail("no first step after 300 s; the processes' stacks and logs:\n" + _stacks(procs))
        time.sleep(0.05)
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    t_term = time.time()
    _finish(procs, timeout=180)  # no hang with the actor's threads still rolling out
    print(f"exited {time.time() - t_term:.1f} s after SIGTERM")
    stopped = max(r["step"] for r in _jsonl(os.path.join(run_dir, "metrics.jsonl")))
    assert 1 <= stopped < STEPS
    assert sorted(int(n) for n in os.listdir(os.path.join(run_dir, "checkpoints"))) == [stopped]
    for i in range(processes):  # the tasks used so far, process 0's position on every process
        with open(os.path.join(run_dir, "checkpoints", str(stopped), "data", f"process_{i}-of-{processes}.json")) as f:
            assert json.load(f) == {"format": 1, "below": stopped * B, "extra": []}
    first_pid = _trained(run_dir)[0]["pid"]

    _finish(_spawn(run_dir, inputs, 0.0, actors), timeout=900)

    # every task trained once, at the uninterrupted run's step, by the same process; the resumed
    # run starts at the next
    trained, expected = _trained(run_dir), _trained(ref_dir)
    assert [(r["step"], r["process"], r["tasks"]) for r in trained] == \
        [(r["step"], r["process"], r["tasks"]) for r in expected]
    trained = [r for r in trained if r["process"] == 0]
    assert [r["step"] for r in trained] == list(range(1, STEPS + 1))
    assert [r["pid"] == first_pid for r in trained] == [s <= stopped for s in range(1, STEPS + 1)]
    # the group in flight at SIGTERM (the next step's first task, handed out after the last
    # publish: one group at a time) was started, not trained, and sampled again on resume
    started = {}
    for r in _jsonl(os.path.join(run_dir, "episodes.jsonl")):
        started.setdefault(r["task"], []).append(r["pid"] == first_pid)
    steps = [{t for r in _trained(run_dir) if r["step"] == s for t in r["tasks"]} for s in range(1, STEPS + 1)]
    untrained = {t for t, runs in started.items() if True in runs} - set().union(*steps[:stopped])
    assert untrained and untrained <= steps[stopped], (untrained, steps[stopped])
    assert all(started[t].count(False) == G for t in untrained), started

    # the same numbers as the uninterrupted run, step for step (KL to the restored reference included)
    m, m_ref = _jsonl(os.path.join(run_dir, "metrics.jsonl")), _jsonl(os.path.join(ref_dir, "metrics.jsonl"))
    assert [r["step"] for r in m] == [r["step"] for r in m_ref] == list(range(1, STEPS + 1))
    for r, e in zip(m, m_ref):
        assert {k: r[k] for k in COMPARED} == {k: e[k] for k in COMPARED}, r["step"]
    assert all(r["kl"] != 0 for r in m[1:]), [r["kl"] for r in m]  # the KL term is live
    step, weights = _final_weights(run_dir)
    step_ref, weights_ref = _final_weights(ref_dir)
    assert step == step_ref == STEPS and weights.keys() == weights_ref.keys()
    for k in weights:
        np.testing.assert_array_equal(np.asarray(weights[k]), np.asarray(weights_ref[k]), err_msg=k)


if __name__ == "__main__":
    import faulthandler
    import logging

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test's `_stacks` of a hung run
    logging.basicConfig(level=logging.INFO)
    _run(sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4], int(sys.argv[5]), int(sys.argv[6]))
