"""The README's main command, shortened: main.py with configs/quickstart.py runs every stage of
the chain (pretrain -> longctx -> mtp -> sft -> grpo -> eval) end to end in a subprocess, with the real
tokenizer, data pipelines, env transcripts and model, a few steps each."""
import json
import math
import os
import subprocess
import sys

import pytest

from tests import xla_flags

pytestmark = pytest.mark.subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_quickstart_chain_runs_end_to_end(tmp_path):
    workdir = tmp_path / "qs"
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    # one CPU device, as a user's run; XLA:CPU compiling as fast as the rest of the suite
    # (tests/xla_flags.py): a few steps per stage, so compiling dominates
    env["XLA_FLAGS"] = xla_flags.one_device(env.get("XLA_FLAGS", ""))
    cmd = [
        sys.executable, "main.py", "--config=configs/quickstart.py",
        f"--config.workdir={workdir}",
        "--config.train.steps=3", "--config.train.log_every=1",
        "--config.longctx.steps=2",
        "--config.sft.steps=2", "--config.sft.toy_tasks=4",
        "--config.mtp.steps=2", "--config.mtp.eval_batches=1",
        "--config.grpo.steps=1", "--config.eval.agent_tasks=1", "--config.rl.eval_samples=2",
        "--config.rl.eval_num_tasks=2",
        "--config.eval.batches=2", "--config.train.heldout_batches=1",
        # every stage's code as in the README's run at a fraction of its work (measured alone on a
        # 2-core machine: 125 s -> 75 s of wall time, 167 s -> 95 s of CPU): the long eval on 2
        # rows and 2 retrieval rows, GRPO's step on 2 tasks x 4 rollouts of up to 2 turns, the
        # trained-task eval on 2 tasks
        "--config.eval.long_rows=2", "--config.eval.retrieval_examples=2",
        "--config.rl.group_size=4", "--config.rl.tasks_per_step=2", "--config.rl.train_num_tasks=2",
        "--config.rl.max_turns=2", "--config.rl.max_rollout_tokens=128",
    ]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]

    for stage, steps in (("pretrain", 3), ("longctx", 2), ("sft", 2)):
        records = [json.loads(x) for x in (workdir / stage / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records if "loss" in r] == list(range(1, steps + 1)), stage
        assert all(math.isfinite(r["loss"]) for r in records if "loss" in r)
        if stage != "sft":  # (4 transcripts leave the SFT held-out split empty: a warning, no record)
            # the held-out loss on the same batches before and after the stage
            assert [r["step"] for r in records if "heldout_loss" in r] == [0, steps], stage
        assert (workdir / stage / "checkpoints" / str(steps)).is_dir()
    # the long-context checkpoint carries the YaRN settings the later stages inherit
    saved = json.loads((workdir / "longctx" / "checkpoints" / "2" / "config" / "metadata").read_text())
    assert saved["model"]["rope_scaling"]["type"] == "yarn"
    assert saved["model"]["rope_scaling"]["factor"] == 1024 / 256
    sft_saved = json.loads((workdir / "sft" / "checkpoints" / "2" / "config" / "metadata").read_text())
    assert sft_saved["model"]["rope_scaling"] == saved["model"]["rope_scaling"]
    mtp = [json.loads(x) for x in (workdir / "mtp" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in mtp] == [1, 2, 2]  # two steps, then the held-out record
    assert 0 < mtp[-1]["heldout/accept_1"] <= 1
    # GRPO on the env's toy tasks in real bwrap sandboxes: every rollout ran and was scored
    grpo = [json.loads(x) for x in (workdir / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert grpo[-1]["step"] == 1 and math.isfinite(grpo[-1]["reward"]) and math.isfinite(grpo[-1]["loss"])
    assert grpo[-1]["rollouts"] > 0 and grpo[-1]["infra_failures"] == 0
    assert 0.0 <= grpo[-1]["pass_rate"] <= 1.0 and grpo[-1]["rollout_time_s"] > 0
    assert 0 < grpo[-1]["mtp_accept_1"] <= 1  # the MTP refresh (grpo.mtp_weight) runs beside the policy
    # the agent eval before the first step (the baseline) and after the last
    assert sorted(os.listdir(workdir / "grpo" / "agent_eval")) == ["step_00000000.json", "step_00000001.json"]
    # and on GRPO's own training tasks (rl.eval_trained): the quickstart's measure of learning
    trained = [json.loads((workdir / "grpo" / "agent_eval_trained" / f"step_0000000{s}.json").read_text())
               for s in (0, 1)]
    assert [len(r["tasks"]) for r in trained] == [2, 2]  # rl.train_num_tasks
    # the long-context eval on the held-out repository (coder/pallas) at 1024, before and after
    # longctx and in the eval stage: 4 position buckets and the far retrieval
    longctx = [json.loads(x) for x in (workdir / "longctx" / "metrics.jsonl").read_text().splitlines()]
    long_keys = {"long/loss_0_256", "long/loss_768_1024", "long/loss_far", "long/retrieval_gain"}
    assert [r["step"] for r in longctx if long_keys <= set(r)] == [0, 2]
    assert all(r["long/retrieval_examples"] > 0 for r in longctx if "long/loss_far" in r)
    (ev,) = [json.loads(x) for x in (workdir / "eval" / "metrics.jsonl").read_text().splitlines()]
    assert long_keys <= set(ev) and math.isfinite(ev["long/loss_far"])
    assert ev["step"] == 1 and ev["tokens"] > 0  # the grpo checkpoint
    assert "pass@1" in ev
    assert ev["perplexity"] == pytest.approx(math.exp(ev["loss"]), rel=1e-6)
    # the closing summary names every stage with its checkpoint and what it improved, then the report
    summary = p.stdout[p.stdout.rindex("\nstage "):]
    lines = {line.split()[0]: line for line in summary.splitlines()[2:] if line.strip() and " -> " in line}
    for stage in ("pretrain", "longctx"):
        assert "held-out " in lines[stage] and "loss " in lines[stage], lines
    assert "far loss " in lines["longctx"] and "retrieval gain " in lines["longctx"], lines
    assert "loss " in lines["sft"], lines
    assert "reward " in lines["grpo"] and "pass@1 " in lines["grpo"] and " -> " in lines["grpo"], lines
    assert "trained pass@1 " in lines["grpo"], lines
    assert str(workdir / "sft" / "checkpoints") in summary
    assert summary.rstrip().splitlines()[-1] == f"report: {workdir / 'report' / 'report.md'}"
    assert (workdir / "report" / "pretrain.png").stat().st_size > 5000
