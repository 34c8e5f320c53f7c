"""Asynchronous against synchronous GRPO (stage grpo, coder/rl/topology.py) on this machine,
with the sandbox in the loop: wall time per learner step, the bound that overlap allows, and the
weight channel's bytes and seconds per version.

    JAX_PLATFORMS=cpu python bench/async_rl.py [--steps 9 --warmup 3 --tasks_per_step 4 --group 4
                                               --hidden 256 --layers 4 --lr 1e-6]

Both runs call `coder.stages.grpo.train` on the same real toy tasks of coder.env (each rollout a
bwrap sandbox in the actor's env workers, scored by its hidden tests), with the same random
model, seed, number of steps and rollouts, one Ray actor process (`rl.topology.actors=1`) and the
learner in this process; only `rl.topology.asynchronous` differs. Learner and actor get disjoint cores in BOTH
runs: this process (the learner, its Ray driver threads) is pinned to core 0 before anything
starts, and a thread pins every `ray::ActorWorker` process, its threads and its descendants (env
workers, sandboxes) to core 1 as soon as it appears (Ray's own daemons are left unpinned).

Timed: the steps after --warmup (compilation, the env workers' start), as the time between the
learner taking its batches (`step_seconds`). From the sync run, the actor's time per step A (the
learner waits for the step's groups: `learner_idle_s`) and the learner's L (`learner_time_s`:
scoring, batch, reference logprobs, the step, publishing) give the bound overlap allows,
(A + L) / max(A, L). The learner publishes every version in the serving dtype (bfloat16 here:
`rl.engine_dtype`) to a local weight store; bytes per version are printed against the full
bfloat16 weights, both as written (anchors every rl.anchor_every versions included) and as the
actor read them (one delta per version), with seconds per publish and per apply (poll + set_weights).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# --- pinning -------------------------------------------------------------------------------------
def _children() -> dict:
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            out.setdefault(ppid, []).append(int(d))
    return out


def pin_tree(pid: int, cores: set) -> None:
    """Every thread of `pid` and of its descendants to `cores`."""
    kids, todo = _children(), [pid]
    while todo:
        p = todo.pop()
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                try:
                    os.sched_setaffinity(int(tid), cores)
                except OSError:
                    pass
        except OSError:
            pass
        todo += kids.get(p, [])


class ActorPinner(threading.Thread):
    """Pins every `ray::ActorWorker` process tree to `cores`, as soon as it appears and again
    while it runs (its new threads and sandboxes inherit the affinity of their creators)."""

    def __init__(self, cores: set):
        super().__init__(daemon=True)
        self.cores, self.stop = cores, threading.Event()

    def run(self):
        while not self.stop.is_set():
            for d in os.listdir("/proc"):
                if not d.isdigit():
                    continue
                try:
                    with open(f"/proc/{d}/cmdline", "rb") as f:
                        cmd = f.read()
                except OSError:
                    continue
                if cmd.startswith(b"ray::ActorWorker"):
                    pin_tree(int(d), self.cores)
            self.stop.wait(0.5)


# --- the runs ------------------------------------------------------------------------------------
def setup(args):
    """(config, tokenizer, toy tasks) shared by both runs."""
    from coder.data import tokenizer as tokenizer_lib
    from coder.env import protocol, tasks as tasks_lib
    from coder.env.tools.registry import SPECS
    from configs import quickstart

    c = quickstart.get_config()
    n = args.steps * args.tasks_per_step
    pairs = tasks_lib.toy_tasks(n, args.seed)
    texts = [protocol.render_system_prompt(SPECS)] * 4 + [t.prompt for t, _ in pairs]
    texts += [s["answer.py"] for _, s in pairs] + [protocol.render_tool_call("read_file", {"path": "answer.py"})] * 8
    tok = tokenizer_lib.train_tokenizer(texts, 512)
    c.model.update(dict(vocab_size=tok.padded_vocab_size, hidden_size=args.hidden, num_hidden_layers=args.layers,
                        intermediate_size=3 * args.hidden, max_position_embeddings=args.context, num_mtp_layers=0))
    c.model.rope_scaling.original_max_position_embeddings = args.context
    c.rl.update(dict(tasks_per_step=args.tasks_per_step, group_size=args.group, max_turn_tokens=args.max_turn_tokens,
                     max_turns=2, context_budget=args.context, summary_reserve=128,
                     max_rollout_tokens=2 * args.max_turn_tokens, engine_dtype="bfloat16"))
    c.rl.topology.actors = 1
    c.train.update(dict(steps=args.steps, lr=args.lr, warmup_steps=0, min_lr_ratio=1.0, log_every=1,
                        ckpt_every=10 ** 6))
    c.grpo.update(dict(steps=args.steps, lr=args.lr))
    c.seed = args.seed
    return c, tok, [t for t, _ in pairs]


def run(mode: str, c, tok, tasks, workdir: str) -> tuple[list, float]:
    from coder.rl.actor import episode_factory
    from coder.stages import grpo as grpo_stage

    cfg = c.copy_and_resolve_references()
    cfg.rl.topology.asynchronous = mode == "async"
    stage_dir = os.path.join(workdir, mode)
    t0 = time.perf_counter()
    grpo_stage.train(cfg, stage_dir, "", tokenizer=tok, tasks=tasks, make_episode=episode_factory(cfg))
    wall = time.perf_counter() - t0
    with open(os.path.join(stage_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f], wall


def summary(m: list, warmup: int) -> dict:
    import numpy as np

    timed = [r for r in m if r["step"] > warmup]
    mean = lambda k: float(np.mean([r[k] for r in timed]))  # noqa: E731
    return dict(step_s=mean("step_seconds"), actor_s=mean("learner_idle_s"), learner_s=mean("learner_time_s"),
                rollouts_per_s=mean("rollouts_per_s"), actor_idle_s=mean("actor_idle_s"),
                staleness_max=max(r["staleness_max"] for r in m), stale_tokens=sum(r["stale_tokens"] for r in m),
                mixed=sum(r["mixed_version_rollouts"] for r in m), reward=mean("reward"),
                infra=sum(r["infra_failures"] for r in m), rollouts=int(sum(r["rollouts"] for r in m)),
                steps=len(m))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of the timing")
    ap.add_argument("--tasks_per_step", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--max_turn_tokens", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if (os.cpu_count() or 1) < 2:
        raise SystemExit("needs 2 cores: the learner on core 0, the actor on core 1")
    os.sched_setaffinity(0, {0})  # before jax and Ray start threads: they inherit it
    import numpy as np
    import ray

    from coder.model import count_params

    c, tok, tasks = setup(args)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    pinner = ActorPinner({1})
    pinner.start()
    out = {}
    try:
        with tempfile.TemporaryDirectory() as workdir:
            for mode in ("sync", "async"):
                m, wall = run(mode, c, tok, tasks, workdir)
                out[mode] = dict(summary(m, args.warmup), wall_s=wall, metrics=m)
    finally:
        pinner.stop.set()
        ray.shutdown()
    s, a = out["sync"], out["async"]
    bound = (s["actor_s"] + s["learner_s"]) / max(s["actor_s"], s["learner_s"])
    params = count_params(c.model)["total"]
    print(f"GRPO async vs sync: {args.steps} steps ({args.warmup} warm-up) x {args.tasks_per_step} toy tasks x "
          f"{args.group} rollouts (bwrap sandbox, hidden tests), max_turn_tokens {args.max_turn_tokens}; model "
          f"{params / 1e6:.1f}M params (hidden {args.hidden}, {args.layers} layers), learner float32 on core 0, "
          f"one Ray actor (engine bfloat16, env workers) on core 1")
    for name, r in (("sync", s), ("async", a)):
        print(f"  {name:5s} {r['step_s']:6.2f} s/step  {r['rollouts_per_s']:5.2f} rollouts/s  learner waits "
              f"{r['actor_s']:5.2f} s/step, learner works {r['learner_s']:5.2f} s/step, actor idle "
              f"{r['actor_idle_s']:5.2f} s/step; staleness max {r['staleness_max']:.0f}, stale tokens "
              f"{r['stale_tokens']:.0f}, mixed-version rollouts {r['mixed']}; reward {r['reward']:.3f}; "
              f"{r['rollouts']} rollouts, {r['infra']} infra failures; whole run {r['wall_s']:.0f} s")
    print(f"  speed-up async / sync: {s['step_s'] / a['step_s']:.2f}x per step (whole runs, compilation included: "
          f"{s['wall_s'] / a['wall_s']:.2f}x); overlap allows (A + L) / max(A, L) = ({s['actor_s']:.2f} + "
          f"{s['learner_s']:.2f}) / {max(s['actor_s'], s['learner_s']):.2f} = {bound:.2f}x")
    m = a["metrics"] + s["metrics"]
    raw = float(np.mean([r["sync_raw_bytes"] for r in m]))
    written = float(np.mean([r["sync_bytes"] for r in m]))
    read = [r["sync_read_bytes"] for r in m if r["sync_versions"] > 0]
    print(f"  weight sync ({len(m)} versions, bfloat16 serving weights {raw / 1e6:.2f} MB, lr {args.lr:g}, anchor "
          f"every {c.rl.anchor_every}): written {written / raw:.1%} of the weights per version (anchors included), "
          f"read by the actor {float(np.mean(read)) / raw:.1%} per version applied (sha256-checked, lossless); "
          f"publish {np.mean([r['sync_publish_s'] for r in m]):.3f} s, apply (poll + set_weights) "
          f"{np.mean([r['sync_apply_s'] for r in m if r['sync_versions'] > 0]):.3f} s per version")
    deltas = [r["sync_bytes"] / r["sync_raw_bytes"] for r in m if r["step"] % c.rl.anchor_every]
    print(f"  deltas alone: {np.mean(deltas):.1%} of the weights per version (min {min(deltas):.1%}, "
          f"max {max(deltas):.1%})")
    return out


if __name__ == "__main__":
    main()
