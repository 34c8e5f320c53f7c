"""Two processes with jax.distributed on localhost (4 CPU devices each) train as one job.

They run the same training steps of a tiny config as one process with 8 devices, each process
feeding only its own rows of every batch, and must produce the same losses. Each process reads
its own data shard where a batch's rows split over the processes, and the whole stream where
the mesh splits only the weights (coder.model.sharding.data_shard).

Resume (`resume_worker`): two processes (2 CPU devices each) with different data shards train a
few steps, stop, and a new trainer in each resumes: each process gets back its own data
position (coder.train.checkpoint writes one data state per process), and the tokenizer of a run
from scratch is trained once, on process 0, and received by the other.
"""
import functools
import json
import os
import sys

import numpy as np
import pytest

from tests import multiprocess_jobs as jobs

pytestmark = pytest.mark.subprocess

STEPS = 3
BATCH, SEQ = 8, 64


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
    from coder.train.balancing import router_balancing
    from coder.train.losses import lm_loss_fn
    from coder.train.trainer import Trainer
    from configs import quickstart

    config = quickstart.get_config()
    config.data.seq_len, config.data.batch_size = SEQ, BATCH
    config.mesh.update(dict(data=4, fsdp=2))  # batch over 8 devices, params over 2 (FSDP)
    config.model.num_mtp_layers = 0  # a smaller step to compile; MoE and dense layers stay
    trainer = Trainer(config, os.path.join(workdir, "pretrain"), lm_loss_fn(config.train),
                      post_update=router_balancing(config.model))
    rows = BATCH // jax.process_count()
    lo = jax.process_index() * rows
    losses = []
    for batch in _batches(config.model.vocab_size):
        local = {k: v[lo:lo + rows] for k, v in batch.items()}  # this host's rows only
        losses.append(float(trainer.train_step(local)["loss"]))
    trainer.close()
    if jax.process_index() == 0:
        print("LOSSES " + json.dumps(losses), flush=True)
    # which data each process reads: its own shard where the batch rows split over the
    # processes, the whole stream where every process feeds the whole batch (weights split only)
    from coder.model import sharding

    shards = {}
    for name, axes in (("data4_fsdp2", dict(data=4, fsdp=2)), ("expert4_tensor2", dict(data=1, expert=4, tensor=2))):
        c = quickstart.get_config()
        c.mesh.update(axes)
        shards[name] = [sharding.batch_row_shares(sharding.make_mesh(c.mesh), c.mesh.rules), *sharding.data_shard(c)]
    print("SHARDS " + json.dumps(shards), flush=True)


class _Shard:
    """This process's data: batch i is rows drawn from seed i; the state is the next index.
    Process p starts at 100 * p, so the two shards and their positions differ."""

    def __init__(self, start: int, rows: int):
        self.index, self.rows, self.seen = start, rows, []

    def __iter__(self):
        return self

    def __next__(self):
        rng = np.random.default_rng(self.index)
        self.seen.append(self.index)
        self.index += 1
        tokens = rng.integers(1, 64, (self.rows, 16)).astype(np.int32)
        ones = np.ones((self.rows, 16), np.int32)
        return dict(tokens=tokens, positions=np.cumsum(ones, 1, dtype=np.int32) - 1, segment_ids=ones,
                    loss_mask=ones.astype(np.float32))

    def get_state(self):
        return {"index": self.index}

    def set_state(self, state):
        self.index = int(state["index"])


def _toy_model():
    """A 64-token embedding + tanh + head language model (the resume and preemption jobs' model:
    their subject is the trainer, not the Transformer); built inside the job, after
    jax.distributed.initialize."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    class Toy(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Param(jax.random.normal(rngs.params(), (64, 16)) * 0.5)
            self.lm_head = nnx.Param(jax.random.normal(rngs.params(), (16, 64)) * 0.2)

        def __call__(self, tokens, positions, segment_ids):
            return jnp.tanh(self.embed[...][tokens]) @ self.lm_head[...], {}

    return Toy(nnx.Rngs(0))


def resume_worker(process_id: int, num_processes: int, port: int, workdir: str):
    """Tokenizer for a run from scratch, 3 steps, stop, resume in a new trainer, 5 steps; prints
    this process's tokenizer hash and where its cache went, the data position restored and the
    batches it consumed."""
    import jax

    jax.distributed.initialize(coordinator_address=f"localhost:{port}",
                               num_processes=num_processes, process_id=process_id)
    from coder.data import tokenizer as tk
    from coder.train.checkpoint import stage_tokenizer
    from coder.train.losses import lm_loss_fn
    from coder.train.trainer import Trainer
    from configs import base

    c = base.get_config()
    c.data.sources = ({"path": os.path.join(workdir, "corpus.jsonl")},)
    c.data.tokenizer_vocab_size = 300
    c.model.vocab_size = 384
    c.train.update(dict(warmup_steps=0, log_every=1))
    stage_dir = os.path.join(workdir, "pretrain")
    cache = os.path.join(workdir, f"cache_{process_id}")  # not shared: process 1 must not train
    tok = stage_tokenizer(c, "", stage_dir, cache_dir=cache)
    rows = 8 // jax.process_count()
    out = {"process": jax.process_index(), "tokenizer": tk.fingerprint(tok),
           "cache": os.path.isdir(cache)}
    for steps in (3, 5):
        data = _Shard(100 * jax.process_index(), rows)
        trainer = Trainer(c, stage_dir, lm_loss_fn(c.train), model_fn=_toy_model,
                          data_iterator=data, tokenizer=tok, stage="pretrain")
        out[f"restored_{steps}"] = data.index
        trainer.fit(data, steps)
        trainer.close()
        out[f"seen_{steps}"] = data.seen
    print("RESUME " + json.dumps(out), flush=True)


def preempt_worker(process_id: int, num_processes: int, port: int, workdir: str):
    """A 20-step run in which only process 1 gets SIGTERM (it signals itself while fetching its
    third batch); prints the step each process stopped at."""
    import signal

    import jax

    jax.distributed.initialize(coordinator_address=f"localhost:{port}",
                               num_processes=num_processes, process_id=process_id)
    from coder.train.hooks import Preempted
    from coder.train.losses import lm_loss_fn
    from coder.train.trainer import Trainer
    from configs import base

    start = 100 * jax.process_index()

    class Signalled(_Shard):
        def __next__(self):
            if jax.process_index() == 1 and self.index - start == 2:
                os.kill(os.getpid(), signal.SIGTERM)
            return super().__next__()

    c = base.get_config()
    c.model.vocab_size = 64
    c.train.update(dict(warmup_steps=0, log_every=1, ckpt_every=1000))
    data = Signalled(start, 8 // jax.process_count())
    trainer = Trainer(c, os.path.join(workdir, "pretrain"), lm_loss_fn(c.train), model_fn=_toy_model,
                      data_iterator=data, stage="pretrain")
    try:
        trainer.fit(data, 20)
        stopped = None
    except Preempted as e:
        stopped = trainer.step
        del e
    trainer.close()
    print("PREEMPT " + json.dumps({"process": jax.process_index(), "stopped": stopped}), flush=True)


def _spawn(process_id, num_processes, devices, port, workdir, mode="train"):
    return jobs.spawn(__file__, [process_id, num_processes, port, workdir, mode], devices)


def _losses(proc):
    return jobs.tagged_json(proc, "LOSSES", timeout=600)


@pytest.mark.slow
def test_two_processes_train_like_one_process_with_eight_devices(tmp_path):
    reference = _losses(_spawn(0, 1, 8, jobs.free_port(), str(tmp_path / "single")))
    # the pair starts together, so that both reach their first collective at about the same time
    port = jobs.free_port()
    pair = [_spawn(i, 2, 4, port, str(tmp_path / "multi")) for i in range(2)]
    out0, err0 = pair[0].communicate(timeout=600)
    out1, err1 = pair[1].communicate(timeout=600)
    assert pair[0].returncode == 0 and pair[1].returncode == 0, (err0[-3000:], err1[-3000:])
    multi = json.loads(next(x for x in out0.splitlines() if x.startswith("LOSSES "))[7:])
    shards = [json.loads(next(x for x in out.splitlines() if x.startswith("SHARDS "))[7:]) for out in (out0, out1)]
    # [row shares, data shard index, shard count] per process
    assert shards == [{"data4_fsdp2": [2, 0, 2], "expert4_tensor2": [1, 0, 1]},
                      {"data4_fsdp2": [2, 1, 2], "expert4_tensor2": [1, 0, 1]}], shards
    assert len(reference) == STEPS and np.all(np.isfinite(reference))
    np.testing.assert_allclose(multi, reference, rtol=2e-5)
    assert reference[-1] < reference[0]  # it trains


@pytest.mark.slow
def test_sigterm_to_one_process_stops_every_process_after_the_same_step(tmp_path):
    """Only process 1 gets SIGTERM (while fetching its third batch): both processes finish step
    3, write its checkpoint together (each its own data position) and stop; without agreeing
    on it, process 0 would go on into step 4's collectives alone."""
    port = jobs.free_port()
    pair = [_spawn(i, 2, 2, port, str(tmp_path), "preempt") for i in range(2)]
    outs = [jobs.tagged_json(proc, "PREEMPT", timeout=300) for proc in pair]
    assert [o["stopped"] for o in outs] == [3, 3], outs
    step_dir = tmp_path / "pretrain" / "checkpoints" / "3"
    for i, index in ((0, 3), (1, 103)):
        assert json.loads((step_dir / "data" / f"process_{i}-of-2.json").read_text()) == {"index": index}


@pytest.mark.slow  # ~40 s on 2 busy cores (two interpreters, two trainers each)
def test_two_processes_resume_their_own_data_positions(tmp_path):
    rng = np.random.default_rng(0)
    words = ["def", "return", "self", "import", "class", "for", "in", "if", "else", "x", "y", "0", "1"]
    with open(tmp_path / "corpus.jsonl", "w") as f:
        for _ in range(300):
            f.write(json.dumps({"text": "\n".join(" ".join(rng.choice(words, 8)) for _ in range(6))}) + "\n")
    port = jobs.free_port()
    pair = [_spawn(i, 2, 2, port, str(tmp_path), "resume") for i in range(2)]
    p0, p1 = [jobs.tagged_json(proc, "RESUME", timeout=600) for proc in pair]
    # one tokenizer, trained on process 0 only (process 1's cache directory was never made)
    assert p0["tokenizer"] == p1["tokenizer"] and p0["cache"] and not p1["cache"]
    # each process resumes its own shard's position, not process 0's
    assert (p0["restored_3"], p1["restored_3"]) == (0, 100)
    assert (p0["restored_5"], p1["restored_5"]) == (3, 103)
    assert p0["seen_3"] + p0["seen_5"] == [0, 1, 2, 3, 4]
    assert p1["seen_3"] + p1["seen_5"] == [100, 101, 102, 103, 104]
    step_dir = tmp_path / "pretrain" / "checkpoints" / "5"
    for i, index in ((0, 5), (1, 105)):
        assert json.loads((step_dir / "data" / f"process_{i}-of-2.json").read_text()) == {"index": index}
    assert (step_dir / "tokenizer" / "metadata").exists()


def grpo_worker(process_id: int, num_processes: int, port: int, workdir: str, colocated: bool = False):
    """Two GRPO steps and the agent eval of tests/rl_toy.py's in-process task: the
    learner on the global mesh (every process's devices), and either each process's actor
    (engine) on its own devices with its share of the tasks, or (`colocated`) one engine over
    every process's devices, led by process 0, taking turns with the learner. Prints the
    metrics and the eval summary."""
    import jax

    if num_processes > 1:
        jax.distributed.initialize(coordinator_address=f"localhost:{port}",
                                   num_processes=num_processes, process_id=process_id)
    from flax import nnx

    from coder.model import Transformer
    from coder.stages import grpo as grpo_stage
    from tests import rl_toy as rl_test

    tok = rl_test.tokenizer()
    cfg = rl_test.tiny_config(tok, 256)
    cfg.rl.update(dict(group_size=2, tasks_per_step=2, eval_num_tasks=2, eval_samples=2))
    cfg.train.update(dict(steps=2, ckpt_every=1000))
    cfg.grpo.kl_coef = 0.01
    if colocated:
        cfg.rl.topology.colocated = cfg.rl.topology.offload_optimizer = True
        cfg.rl.topology.asynchronous = False
    tasks = rl_test.make_tasks(6, seed=0)
    answer = {t.id: k for t, k in tasks}
    stage_dir = os.path.join(workdir, "grpo")
    grpo_stage.train(cfg, stage_dir, "", tokenizer=tok, tasks=[t for t, _ in tasks[:4]],
                     held_out=[t for t, _ in tasks[4:]], model_fn=lambda: Transformer(cfg.model, rngs=nnx.Rngs(3)),
                     make_episode=lambda task: rl_test.SubmitEpisode(answer[task.id]))
    out = {"process": jax.process_index(), "devices": jax.device_count(), "local": jax.local_device_count()}
    if jax.process_index() == 0:
        with open(os.path.join(stage_dir, "metrics.jsonl")) as f:
            out["metrics"] = [json.loads(line) for line in f]
        evals = sorted(os.listdir(os.path.join(stage_dir, "agent_eval")))
        with open(os.path.join(stage_dir, "agent_eval", evals[-1])) as f:
            out["eval"] = json.load(f)["summary"]
    print("GRPO " + json.dumps(out), flush=True)


@pytest.mark.slow
def test_grpo_and_agent_eval_on_two_processes_with_own_actors_and_colocated(tmp_path):
    """GRPO (learner + engine + agent eval) on two processes with 4 devices each, in both
    layouts of the actor in the learner's job: each process's actor decodes its share of the
    tasks on its own 4 devices (weights through the store), and colocated, where one engine
    over all 8 devices (process 0 leads, process 1 follows) takes turns with the learner, each
    version resharded on device and the optimizer state in host memory while the engine runs.
    The colocated pair equals one process with the same 8 devices, colocated: the same
    rollouts, and the same losses to float tolerance."""
    def run(procs):
        outs = []
        for proc in procs:
            out, err = proc.communicate(timeout=900)
            assert proc.returncode == 0, err[-4000:]
            outs.append(json.loads(next(x for x in out.splitlines() if x.startswith("GRPO "))[5:]))
        return outs

    (single,) = run([_spawn(0, 1, 8, jobs.free_port(), str(tmp_path / "single"), "colocated")])
    runs = {}
    for mode in ("grpo", "colocated"):
        port = jobs.free_port()
        runs[mode] = run([_spawn(i, 2, 4, port, str(tmp_path / mode), mode) for i in range(2)])
    for out in (single, runs["grpo"][0], runs["colocated"][0]):
        assert [m["step"] for m in out["metrics"]] == [1, 2]
        assert all(np.isfinite(m["loss"]) and m["engine_tokens_per_s"] > 0 for m in out["metrics"])
        assert set(out["eval"]) >= {"pass@1"} and 0.0 <= out["eval"]["pass@1"] <= 1.0
    pair = runs["colocated"]
    assert (single["devices"], pair[0]["devices"], pair[1]["local"]) == (8, 8, 4)
    for a, b in zip(single["metrics"], pair[0]["metrics"]):
        assert b["sync_bytes"] == 0 and b["offload_bytes"] > 0 and b["actor_processes"] == 2
        for key in ("reward", "tokens_per_rollout", "output_tokens", "engine_prefill_tokens"):
            assert a[key] == b[key], (key, a[key], b[key])
        np.testing.assert_allclose([a["loss"], a["grad_norm"]], [b["loss"], b["grad_norm"]], rtol=1e-4, atol=1e-7)
    assert single["eval"] == pair[0]["eval"]
    assert runs["grpo"][0]["metrics"][0]["sync_bytes"] > 0


if __name__ == "__main__":
    main = {"resume": resume_worker, "grpo": grpo_worker, "preempt": preempt_worker,
            "colocated": functools.partial(grpo_worker, colocated=True)}.get(sys.argv[5] if sys.argv[5:] else "", worker)
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
