"""Preemption: SIGKILL after a checkpoint then resume gives the uninterrupted run's losses
bit-for-bit; SIGTERM writes a checkpoint and exits 0. In process: saving, resuming and starting
from another stage's checkpoint log no orbax warnings; resuming a checkpoint of another model
config is an error naming the variables and the directory.

The training runs in a subprocess (this file run as a script): a toy nnx LM through the real
Trainer.fit (8 fake CPU devices, async orbax checkpoints, data-iterator state in the
checkpoint), with a data iterator that sleeps a little per batch so the test can kill it mid-run.
"""
import json
import os
import signal
import sys
import time

import pytest

from tests import multiprocess_jobs as jobs

pytestmark = pytest.mark.subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 12


class SyntheticData:
    """Deterministic batches from (seed, index); the index is the checkpointed state."""

    def __init__(self, seed: int, sleep_s: float):
        self.seed, self.index, self.sleep_s = seed, 0, sleep_s

    def __iter__(self):
        return self

    def __next__(self):
        import numpy as np

        time.sleep(self.sleep_s)
        rng = np.random.default_rng([self.seed, self.index])
        self.index += 1
        tokens = rng.integers(1, 64, (8, 16)).astype(np.int32)
        seg = np.ones((8, 16), np.int32)
        pos = np.tile(np.arange(16, dtype=np.int32), (8, 1))
        return dict(tokens=tokens, positions=pos, segment_ids=seg, loss_mask=np.ones((8, 16), np.float32))

    def get_state(self):
        return {"index": self.index}

    def set_state(self, state):
        self.index = int(state["index"])


def _toy(width: int = 32):
    """A toy nnx LM (embedding, one tanh layer, head) of hidden size `width`."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    class Toy(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Param(jax.random.normal(rngs.params(), (64, width)) * 0.5)
            self.w = nnx.Param(jax.random.normal(rngs.params(), (width, width)) * 0.2)
            self.lm_head = nnx.Param(jax.random.normal(rngs.params(), (width, 64)) * 0.2)

        def __call__(self, tokens, positions, segment_ids):
            h = jnp.tanh(self.embed[...][tokens] @ self.w[...])
            return h @ self.lm_head[...], {}

    return Toy(nnx.Rngs(3))


def _run(stage_dir: str, sleep_s: float):
    from coder.train.losses import lm_loss_fn
    from coder.train.trainer import Trainer
    from configs import base

    c = base.get_config()
    c.train.steps = STEPS
    c.train.warmup_steps = 2
    c.train.log_every = 1
    c.train.ckpt_every = 3
    c.train.keep_checkpoints = 2
    c.train.grad_accum = 2
    data = SyntheticData(seed=7, sleep_s=sleep_s)
    trainer = Trainer(c, stage_dir, lm_loss_fn(c.train), model_fn=_toy,
                      data_iterator=data, stage="pretrain")
    try:
        trainer.fit(data)
    finally:
        trainer.close()


def _spawn(stage_dir, sleep_s):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return jobs.Job([sys.executable, __file__, stage_dir, str(sleep_s)], merged=True, cwd=ROOT, env=env)


def _losses(stage_dir) -> dict:
    """step -> loss; a step re-run after a resume keeps its last record."""
    out = {}
    with open(os.path.join(stage_dir, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            out[r["step"]] = r["loss"]
    return out


def _committed_steps(stage_dir):
    d = os.path.join(stage_dir, "checkpoints")
    if not os.path.isdir(d):
        return []
    return sorted(int(n) for n in os.listdir(d) if n.isdigit())


def _wait_for(pred, proc, timeout=240):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if pred():
            return
        if proc.poll() is not None:
            raise AssertionError(f"trainer exited early ({proc.returncode}):\n{proc.output()[0]}")
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("timed out waiting for the trainer")


@pytest.mark.slow
def test_sigkill_then_resume_is_bit_identical(tmp_path):
    ref_dir, run_dir = str(tmp_path / "ref"), str(tmp_path / "run")
    ref = _spawn(ref_dir, 0.0)
    proc = _spawn(run_dir, 0.3)
    _wait_for(lambda: any(s >= 3 for s in _committed_steps(run_dir)), proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = max(_losses(run_dir))
    assert killed_at < STEPS, "the run finished before it was killed"
    resumed = _spawn(run_dir, 0.0)
    out = resumed.communicate(timeout=240)[0]
    assert resumed.returncode == 0, out
    assert ref.wait(timeout=240) == 0, ref.output()[0]
    expected, got = _losses(ref_dir), _losses(run_dir)
    assert sorted(expected) == list(range(1, STEPS + 1))
    assert got == expected  # exact float equality, every step
    assert _committed_steps(run_dir)[-1] == STEPS


@pytest.mark.slow
def test_sigterm_saves_and_exits_zero(tmp_path):
    run_dir = str(tmp_path / "run")
    proc = _spawn(run_dir, 0.3)
    _wait_for(lambda: os.path.exists(os.path.join(run_dir, "metrics.jsonl")) and len(_losses(run_dir)) >= 2, proc)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out
    last = max(_losses(run_dir))
    assert last < STEPS
    assert _committed_steps(run_dir)[-1] == last  # the step it stopped at is checkpointed
    data = os.path.join(run_dir, "checkpoints", str(last), "data", "process_0-of-1.json")
    assert json.load(open(data)) == {"index": last}  # the data position is saved with it


def _config(steps: int):
    from configs import base

    c = base.get_config()
    c.train.update(dict(steps=steps, warmup_steps=0, log_every=1))
    return c


def test_checkpoints_log_no_orbax_warnings(tmp_path, caplog):
    """Save, resume (data position included), init_from into another stage and read its config:
    orbax warns about nothing (every item has its handler; nothing is opened read-only)."""
    import logging

    from coder.train import checkpoint as ckpt_lib
    from coder.train.losses import lm_loss_fn
    from coder.train.trainer import Trainer

    caplog.set_level(logging.WARNING)
    c = _config(2)
    first = str(tmp_path / "pretrain")
    data = SyntheticData(seed=1, sleep_s=0.0)
    t = Trainer(c, first, lm_loss_fn(c.train), model_fn=_toy, data_iterator=data)
    t.fit(data)
    t.close()
    data = SyntheticData(seed=1, sleep_s=0.0)
    t = Trainer(c, first, lm_loss_fn(c.train), model_fn=_toy, data_iterator=data)  # resumes
    assert t.step == 2 and data.index == 2
    t.close()
    t = Trainer(c, str(tmp_path / "next"), lm_loss_fn(c.train), model_fn=_toy, init_from=t.checkpoint_dir)
    assert t.step == 0 and len(t.init_report["loaded"]) == 3
    t.close()
    assert ckpt_lib.read_config(first + "/checkpoints")["train"]["steps"] == 2
    assert ckpt_lib.checkpoint_step(first + "/checkpoints") == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not warnings, warnings


def test_resume_with_another_model_config_names_the_variables(tmp_path):
    from coder.train.losses import lm_loss_fn
    from coder.train.trainer import Trainer

    c = _config(1)
    stage_dir = str(tmp_path / "pretrain")
    t = Trainer(c, stage_dir, lm_loss_fn(c.train), model_fn=_toy)
    t.fit(SyntheticData(seed=1, sleep_s=0.0))
    t.close()
    with pytest.raises(ValueError) as e:
        Trainer(c, stage_dir, lm_loss_fn(c.train), model_fn=lambda: _toy(16))
    msg = str(e.value)
    assert "strict" not in msg  # not orbax's own advice
    for part in ("stage pretrain", "different model config", "embed", "(64, 32)", "(64, 16)",
                 f"Delete {os.path.join(stage_dir, 'checkpoints')}", "restore the model config"):
        assert part in msg, (part, msg)


if __name__ == "__main__":
    _run(sys.argv[1], float(sys.argv[2]))
