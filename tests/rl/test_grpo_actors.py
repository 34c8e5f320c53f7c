"""Stage grpo's actors and learner end to end, in-process and on Ray (coder/rl/topology.py, its
actors coder/rl/actor_worker.py, coder/rl/actor_hosts.py, coder/rl/driver.py): in-flight weight
updates, the staleness mask, learning in async and sync mode, a killed actor.

The runs use tests/rl_toy.py's in-process toy task ("submit the lucky number", one
`submit` tool, reward 1 for "3") and its tiny model, SFT-ed (tests/rl_toy.py fitted_policy) on the call
format with a random answer; the sync learning test uses its sandboxed variant (FILE_TOY: write
lucky.py so that its pytest test passes, in bwrap sandboxes) and that variant's fitted model.
In-process episodes reach Ray actors by cloudpickle (their classes by reference to this module,
the lambdas by value).
"""
import functools
import json
import os
import signal
import time

import numpy as np
import pytest
from flax import nnx

from coder.model import Transformer
from coder.rl import actor as actor_lib
from coder.rl import topology
from coder.rl import weight_sync
from coder.stages import grpo as grpo_stage
from tests import rl_toy as rl_test


@pytest.fixture(scope="module")
def toy(toy_policy):
    """(tokenizer, stage_len, SFT-ed weights): the model writes well-formed submit calls
    (checked once per session: tests/rl_toy.py fitted_policy)."""
    return toy_policy.tokenizer, toy_policy.stage_len, toy_policy.state


@pytest.fixture(scope="module")
def sandboxed_toy():
    """(tokenizer, stage_len, SFT-ed weights) of the sandboxed variant (tests/rl_toy.py FILE_TOY):
    the model writes lucky.py through the env's write_file with a uniformly random digit."""
    p = rl_test.fitted_policy(os.environ["CODER_TEST_SHARED_DIR"], rl_test.FILE_TOY)
    return p.tokenizer, p.stage_len, p.state


@pytest.fixture(scope="module")
def ray_local():
    import sys

    import ray
    from ray import cloudpickle

    # pytest imports this file as a top-level module the Ray workers cannot import: its episode
    # classes travel by value (as a script's would)
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(address="local", num_cpus=4, include_dashboard=False)
    yield
    ray.shutdown()


def config(tok, stage_len, kind=rl_test.SUBMIT_TOY, **overrides):
    cfg = rl_test.tiny_config(tok, stage_len, kind)
    for key, value in overrides.items():  # "rl__topology__actors": cfg.rl.topology.actors
        *sections, name = key.split("__")
        functools.reduce(lambda node, s: node[s], sections, cfg)[name] = value
    return cfg


def model_fn_of(cfg, state):
    def model_fn():
        m = Transformer(cfg.model, rngs=nnx.Rngs(1))
        if state is not None:
            nnx.update(m, state)
        return m

    return model_fn


def metrics(stage_dir):
    with open(os.path.join(stage_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


class HeldEpisode(rl_test.SubmitEpisode):
    """The first submit is refused and answered only once the weight store holds `version`
    (and the actor had time to apply it): the rollout's next turn samples with newer weights."""

    def __init__(self, expected, url, version):
        super().__init__(expected)
        self.url, self.version, self.calls = url, version, 0

    def call(self, call):
        self.calls += 1
        if self.calls > 1:
            return super().call(call)
        deadline = time.monotonic() + 120
        while (weight_sync.latest_version(self.url) or 0) < self.version and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(2.0)  # the actor's poller is nudged on publish; this covers a busy machine
        return "error: not accepted yet, submit again"


@pytest.mark.slow
def test_in_flight_update_mixes_versions_and_stale_tokens_carry_no_loss(tmp_path, toy):
    """Task 1's rollouts sample their first turn with version 0, wait in the tool call until the
    learner has published version 2 (it steps on tasks 0 and 2 meanwhile: async), and sample
    their second turn with version 2: one rollout, tokens of two versions, each recorded. With
    grpo.max_staleness = 1 the learner (at version >= 2) masks the version-0 tokens."""
    tok, stage_len, state = toy
    cfg = config(tok, stage_len + 64, rl__group_size=4, rl__tasks_per_step=1, rl__engine_slots=8,
                 rl__topology__asynchronous=True, grpo__max_staleness=1, train__steps=4)  # room for a second turn
    stage_dir = str(tmp_path / "grpo")
    url = topology.store_url(cfg, stage_dir)
    tasks = [t for t, _ in rl_test.make_tasks(5, seed=0)]
    held = tasks[1].id

    def make_episode(task):
        if task.id == held:
            return HeldEpisode(rl_test.LUCKY, url, 2)
        return rl_test.SubmitEpisode(rl_test.LUCKY)

    grpo_stage.train(cfg, stage_dir, "", tokenizer=tok, tasks=tasks, make_episode=make_episode,
                     model_fn=model_fn_of(cfg, state))
    m = metrics(stage_dir)
    assert [r["step"] for r in m] == [1, 2, 3, 4]
    mixed = [r for r in m if r["mixed_version_rollouts"] > 0]
    assert mixed, [(r["mixed_version_rollouts"], r["version_lag"]) for r in m]
    assert all(r["stale_tokens"] > 0 and r["staleness_max"] <= 1 for r in mixed)
    assert all(r["staleness_hist_over"] > 0 for r in mixed)  # the histogram sees the masked tokens
    assert all(abs(sum(r[f"staleness_hist_{k}"] for k in ("0", "1", "over")) - 1) < 1e-6 for r in m)
    assert sum(r["stale_tokens"] for r in m) == sum(r["stale_tokens"] for r in mixed)
    assert all(r["sync_bytes"] > 0 and r["sync_versions"] >= 0 for r in m)
    assert weight_sync.latest_version(url) == 4
    with open(os.path.join(stage_dir, "checkpoints", "4", "data", "process_0-of-1.json")) as f:
        assert json.load(f) == {"format": 1, "below": 4, "extra": []}  # tasks 0-3 used: the epoch's position


def run_toy(tmp_path, toy, kind=rl_test.SUBMIT_TOY, seed=0, **overrides) -> list[dict]:
    """Stage grpo's `train` on the toy task `kind` (tests/rl_toy.py: SUBMIT_TOY in-process,
    FILE_TOY in bwrap sandboxes built by the stage's own EpisodeFactory) -> its metrics.jsonl
    records, after asserting the mechanics every run must show whether or not it learns: every
    step logged, the fitted format calling its tool from the first step, a finite loss with
    entropy (no KL: kl_coef 0), nonzero gradients, the engine's work counted."""
    tok, stage_len, state = toy
    cfg = config(tok, stage_len, kind, **overrides)
    cfg.seed = seed
    steps = cfg.train.steps
    tasks = kind.make_tasks(steps * cfg.rl.tasks_per_step, seed=seed)
    if kind is rl_test.SUBMIT_TOY:
        def make_episode(task):
            return rl_test.SubmitEpisode(rl_test.LUCKY)
    else:
        make_episode = actor_lib.episode_factory(cfg)
    stage_dir = str(tmp_path / "grpo")
    grpo_stage.train(cfg, stage_dir, "", tokenizer=tok, tasks=[t for t, _ in tasks], make_episode=make_episode,
                     model_fn=model_fn_of(cfg, state))
    m = metrics(stage_dir)
    print("rewards", [round(r["reward"], 2) for r in m], "pass_rate", [round(r["pass_rate"], 2) for r in m],
          "staleness_max", [r["staleness_max"] for r in m])
    assert [r["step"] for r in m] == list(range(1, steps + 1))
    assert all(r["infra_failures"] == 0 for r in m)
    # the SFT-ed format works: learning is about the answer
    assert m[0]["submitted"] > 0.8 if kind is rl_test.SUBMIT_TOY else m[0]["broken_call_rate"] < 0.4
    # grpo.kl_coef = 0 (tests/rl_toy.py's default): no reference policy, so no KL metric
    assert all(np.isfinite(r["loss"]) and ("kl" in r) == (cfg.grpo.kl_coef > 0) and "entropy" in r for r in m)
    assert all(r["grad_norm"] > 0 for r in m)  # the loss reaches the weights
    # the engine's work is logged: the step's 64 rows decode together in the slot pool. An async
    # actor that ran ahead may have rolled out a step's groups before its window: zeros there
    # (a CI run had one such step)
    worked = [r for r in m if r["engine_decode_steps"] > 0]
    assert len(worked) == len(m) or (cfg.rl.topology.asynchronous and worked), [r["engine_decode_steps"] for r in m]
    assert all(r["engine_tokens_per_s"] > 0 and 0 < r["engine_occupancy"] <= 1 for r in worked)
    # an async window may only decode groups prefilled in the window before it (seen in a local
    # run here: a window of decode steps with 0 prefill tokens, groups started the window before)
    prefilled = [r["engine_prefill_tokens"] > 0 for r in worked]
    assert all(prefilled) or (cfg.rl.topology.asynchronous and sum(prefilled) >= len(worked) // 2), prefilled
    return m


def reward_gain(m: list[dict]) -> tuple[float, float]:
    """(mean reward of the first two steps, mean reward of the second half)."""
    return float(np.mean([r["reward"] for r in m[:2]])), float(np.mean([r["reward"] for r in m[len(m) // 2:]]))


LEARN = dict(rl__tasks_per_step=8, rl__group_size=8, train__steps=12)  # tests/rl_toy.py's lr 1.5e-3
# Sync mode on the sandboxed tasks: B=4 tasks x G=8 rollouts, 16 steps at lr 1e-3 with a KL of
# 0.05 to the fitted policy, from the committed fitted sandboxed toy. Learning is measured as the
# least-squares slope of the per-step pass rate over the 16 steps (it uses every step; a
# difference of two windows was twice as noisy). Measured 2026-11-29 on the slower 2-core machine
# (AMD EPYC), seeds 0-9 of config.seed (tasks and sampling): slopes 0.0191 / 0.0322 / 0.0316 /
# 0.0327 / 0.0318 / 0.0273 / 0.0229 / 0.0331 / 0.0244 / 0.0292 per step (mean 0.0284, seed-to-seed
# sd 0.0049; the pass rate goes from ~0.25 to ~0.6). A run that does not learn has a slope of 0
# with a standard deviation of 0.0042-0.0048 (a step's pass rate over 32 rollouts at p = 0.25-0.5
# moves by 0.077-0.088, over the 16 steps' spread of 340; the runs' residuals about their lines:
# 0.056-0.124). SYNC_PASS_SLOPE is 3 of those null sds above 0 and 2.9 seed-to-seed sds under the
# measured mean (the lowest seed, 0.0191, clears it by 1 sd). At 12 steps (until 2026-11-29) the
# margin was ~2 null sds (0.0125 against 0.0064-0.0072). Tried and dropped: lr 1.5e-3 (with or
# without the KL) learns faster but one seed in four lost the call format at step 6 (pass rate 0
# for the rest of the run without the KL; 0.0087 with it).
SANDBOXED = dict(rl__tasks_per_step=4, rl__group_size=8, rl__env_workers=4, train__steps=16, train__lr=1e-3,
                 grpo__kl_coef=0.05)
SYNC_PASS_SLOPE = 0.0145


def pass_rate_slope(m: list[dict]) -> float:
    """The least-squares slope of the per-step pass rate (per step)."""
    return float(np.polyfit(np.arange(len(m)), [r["pass_rate"] for r in m], 1)[0])


@pytest.mark.slow
@pytest.mark.learning
def test_sync_mode_raises_the_sandboxed_pass_rate_with_a_ray_actor(tmp_path, sandboxed_toy, ray_local):
    """rl.topology.asynchronous=False, one Ray actor process: each step's groups are sampled with the weights
    the learner just published, and every token is trained on-policy. The tasks are coding tasks
    in bwrap sandboxes (tests/rl_toy.py FILE_TOY: write lucky.py so that its test passes), the
    episodes the stage's own (coder.rl.actor.EpisodeFactory), the reward pytest's verdict: the
    pass rate rises by SYNC_PASS_SLOPE = 0.0145 per step or more (the least-squares slope over
    the 16 steps). Measured over seeds 0-9: slopes 0.019-0.033, mean 0.0284, seed-to-seed sd
    0.0049; a run that does not learn: slope 0 with sd 0.0042-0.0048. So the margin is 3 null
    sds, the measured mean 6 null sds and 2.9 seed-to-seed sds above the margin (details beside
    the constant). (The actor inside the learner's process runs this mode in
    tests/rl/test_grpo_preemption.py.)"""
    m = run_toy(tmp_path, sandboxed_toy, rl_test.FILE_TOY, rl__topology__asynchronous=False, rl__topology__actors=1, **SANDBOXED)
    assert all(r["staleness_max"] == 0 and r["stale_tokens"] == 0 for r in m)
    assert all(r["version_lag"] == 0 and r["mixed_version_rollouts"] == 0 for r in m)
    assert all(r["staleness_hist_0"] == 1.0 for r in m)
    assert all(r["rollouts"] == 32 for r in m)  # every rollout scored (no infra failure: run_toy)
    # identical workspaces of a group share one test run (coder/env/scoring/verdicts.py): the toy's
    # rollouts write one of a few files, so most verdicts are shared
    shared = sum(r["shared_verdicts"] for r in m)
    print("shared verdicts", shared, "of", 32 * len(m))
    assert shared > 0
    slope = pass_rate_slope(m)
    assert slope > SYNC_PASS_SLOPE, (slope, [round(r["pass_rate"], 2) for r in m])


# Async mode (12 steps, one Ray actor): its batches mix versions and mask stale tokens, so it is
# noisier than sync, and at this toy's lr (1.5e-3) it can lose the call format once it has
# learned the answer. Measured, first two steps 0.10 in every run: four runs on the developers'
# machine reached 0.47 / 0.43 / 0.43 / 0.51 by step 8 and kept learning (second-half means
# 0.37-0.40); two CI runs (one with grpo.tis_cap 0, one with 2) reached 0.47 by step 8 and then
# stopped submitting (reward -0.3 from step 10). So the test asserts the mechanics of running
# ahead and a loose learning bound: the best step after the first two beats them by ASYNC_GAIN.
# Without learning a step's mean moves by ~0.05 (sd), so the best of 10 such steps sits ~0.08
# above the start; 0.15 is twice that and under half the best-step gain of every measured run (0.36+).
ASYNC_GAIN = 0.15


@pytest.mark.slow
def test_async_mode_runs_ahead_and_learns_with_a_ray_actor(tmp_path, toy, ray_local):
    """rl.topology.asynchronous=True, one Ray actor process: it rolls out while the learner steps, at most
    grpo.max_staleness versions ahead, and it learns: its best step beats the first two by
    ASYNC_GAIN (measured gains, noise and the collapse it can show beside the constant)."""
    m = run_toy(tmp_path, toy, rl__topology__asynchronous=True, rl__topology__actors=1, **LEARN)
    assert max(r["staleness_max"] for r in m) >= 1  # it did run ahead
    assert all(r["staleness_max"] <= 4 for r in m)  # grpo.max_staleness
    early, _ = reward_gain(m)
    best = max(r["reward"] for r in m[2:])
    assert best > early + ASYNC_GAIN, (early, best, [round(r["reward"], 2) for r in m])


class KillerEpisode(rl_test.SubmitEpisode):
    """Kills the process it runs in (the Ray actor) the first time it is built for its task."""

    def __init__(self, expected, marker):
        if not os.path.exists(marker):
            with open(marker, "w") as f:
                f.write(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        super().__init__(expected)


@pytest.mark.slow
def test_a_killed_actor_is_replaced_and_its_rollouts_dropped(tmp_path, ray_local):
    """The actor process dies mid-run (SIGKILL while it rolls out task 2): Ray restarts it, the
    groups it held are dropped (counted, never scored), their tasks rolled out again, and the
    run completes. The model_fn carries its weights (as a test's or a script's may): Ray re-runs
    the actor's constructor with its arguments, which must still be in the object store then."""
    import pickle

    tok = rl_test.tokenizer()
    cfg = config(tok, 256, rl__group_size=2, rl__tasks_per_step=1, rl__topology__actors=1, rl__topology__asynchronous=True,
                 train__steps=4)
    weights = nnx.state(Transformer(cfg.model, rngs=nnx.Rngs(5)))
    assert len(pickle.dumps(weights)) > 200_000  # above what Ray passes inline with a call
    tasks = [t for t, _ in rl_test.make_tasks(6, seed=0)]
    marker = str(tmp_path / "killed")
    victim = tasks[2].id

    def make_episode(task):
        if task.id == victim:
            return KillerEpisode(rl_test.LUCKY, marker)
        return rl_test.SubmitEpisode(rl_test.LUCKY)

    stage_dir = str(tmp_path / "grpo")
    grpo_stage.train(cfg, stage_dir, "", tokenizer=tok, tasks=tasks, make_episode=make_episode,
                     model_fn=model_fn_of(cfg, weights))
    m = metrics(stage_dir)
    assert [r["step"] for r in m] == [1, 2, 3, 4]
    assert os.path.exists(marker)
    assert m[-1]["dropped_rollouts_total"] >= 2 and m[-1]["dropped_rollouts_total"] % 2 == 0
    assert sum(r["dropped_rollouts"] for r in m) == m[-1]["dropped_rollouts_total"]
    assert all(r["rollouts"] == 2 and r["infra_failures"] == 0 for r in m)  # whole groups, none masked


# Measured 2026-12-03 (LEARN, seed 0, sync, the in-process actor): with int8 the rewards went
# 0.06, 0.15, ... 0.51, 0.43, 0.45, 0.55, 0.49 (last three 0.50); with int4_experts 0.06, 0.15, ...
# dipping to -0.19 at step 7, then 0.50, 0.52, 0.44 (last three 0.49): the first two steps 0.105
# in both. Without learning a step's mean moves by ~0.05 (sd: the async constant's note), so
# the last three steps' mean less the first two's has an sd of ~0.046: QUANTIZED_GAIN = 0.15 is
# 3.3 of those, under half the measured gains (0.38-0.40). (The second half's mean, 0.19 with
# the int4 run's dip, was too noisy a measure.)
QUANTIZED_GAIN = 0.15


@pytest.mark.slow
@pytest.mark.learning
def test_sync_mode_learns_with_an_int4_experts_engine(tmp_path, toy):
    """rl.engine_quantization="int4_experts": the in-process actor's engine holds the routed
    experts in INT4 with a scale per 32 inputs (coder/infer/quantize.py; Kimi K2.5's released
    form) while the learner trains its float32 masters; each step's weights reach the engine
    full precision and are quantized there. The behaviour log-probs are the quantized engine's
    (the learner's recomputation differs from them) and the run learns: the last three steps'
    mean reward beats the first two steps' by QUANTIZED_GAIN (measured beside the constant)."""
    m = run_toy(tmp_path, toy, rl__engine_quantization="int4_experts", rl__topology__asynchronous=False, **LEARN)
    assert all(r["staleness_max"] == 0 for r in m)
    assert all(r["behaviour_logp_abs_diff"] > 0 for r in m)  # the engine is not the learner
    early = float(np.mean([r["reward"] for r in m[:2]]))
    late = float(np.mean([r["reward"] for r in m[-3:]]))
    assert late > early + QUANTIZED_GAIN, (early, late, [round(r["reward"], 2) for r in m])
