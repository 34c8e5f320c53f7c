"""Two processes with jax.distributed on localhost (4 CPU devices each) train as one job.

They run the same training steps of a tiny config as one process with 8 devices, each process
feeding only its own rows of every batch, and must produce the same losses.
"""
import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 3
BATCH, SEQ = 8, 64


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _batches(vocab: int):
    """STEPS copies of one packed batch `[BATCH, SEQ]` (two documents per row): the loss must
    fall as the model fits it."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, vocab, size=(BATCH, SEQ), dtype=np.int32)
    cut = SEQ // 2 + 5
    seg = np.where(np.arange(SEQ) < cut, 1, 2).astype(np.int32)[None].repeat(BATCH, 0)
    pos = np.concatenate([np.arange(cut), np.arange(SEQ - cut)]).astype(np.int32)
    batch = dict(tokens=tokens, positions=pos[None].repeat(BATCH, 0), segment_ids=seg,
                 loss_mask=np.ones((BATCH, SEQ), np.float32))
    return [batch] * STEPS


def worker(process_id: int, num_processes: int, port: int, workdir: str):
    """One process of the job: train STEPS steps, print the losses as JSON (process 0)."""
    import jax

    if num_processes > 1:
        jax.distributed.initialize(coordinator_address=f"localhost:{port}",
                                   num_processes=num_processes, process_id=process_id)
    from coder.train.losses import lm_loss_fn
    from coder.train.trainer import Trainer
    from configs import quickstart

    config = quickstart.get_config()
    config.data.seq_len, config.data.batch_size = SEQ, BATCH
    config.mesh.update(dict(data=4, fsdp=2))  # batch over 8 devices, params over 2 (FSDP)
    config.model.num_mtp_layers = 0  # a smaller step to compile; MoE and dense layers stay
    trainer = Trainer(config, os.path.join(workdir, "pretrain"), lm_loss_fn(config.train))
    rows = BATCH // jax.process_count()
    lo = jax.process_index() * rows
    losses = []
    for batch in _batches(config.model.vocab_size):
        local = {k: v[lo:lo + rows] for k, v in batch.items()}  # this host's rows only
        losses.append(float(trainer.train_step(local)["loss"]))
    trainer.close()
    if jax.process_index() == 0:
        print("LOSSES " + json.dumps(losses), flush=True)


def _spawn(process_id, num_processes, devices, port, workdir):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    return subprocess.Popen(
        [sys.executable, __file__, str(process_id), str(num_processes), str(port), workdir],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _losses(proc):
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    line = next(x for x in out.splitlines() if x.startswith("LOSSES "))
    return json.loads(line[len("LOSSES "):])


@pytest.mark.slow
def test_two_processes_train_like_one_process_with_eight_devices(tmp_path):
    reference = _losses(_spawn(0, 1, 8, _free_port(), str(tmp_path / "single")))
    # the pair starts together, so that both reach their first collective at about the same time
    port = _free_port()
    pair = [_spawn(i, 2, 4, port, str(tmp_path / "multi")) for i in range(2)]
    multi = _losses(pair[0])
    pair[1].communicate(timeout=600)
    assert pair[1].returncode == 0
    assert len(reference) == STEPS and np.all(np.isfinite(reference))
    np.testing.assert_allclose(multi, reference, rtol=2e-5)
    assert reference[-1] < reference[0]  # it trains


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
