"""Does a checkpoint copy the toy task's number, or remember it? (issue #30's diagnosis)

    python scripts/toy_digit_probe.py CKPT [CKPT ...] [--seed 0] [--group 4]

Every toy task (coder.env.tasks.toy_tasks) is solved by writing answer.py with one number `k`
taken from the prompt ("multiply x by 8" -> `return x * 8`); the rest of a quickstart rollout
is format the SFT model gets right. This teacher-forces each task's SFT transcript (write_file
tools, the quickstart's) up to that number and prints the model's probability of the right `k`
and whether it is the argmax: on the training tasks (the first `sft.toy_tasks` of
configs/quickstart.py, the ones SFT saw) and on the held-out ones (the next `rl.eval_num_tasks`,
the agent eval's). Held-out near chance (p ~ 0.11, 9
numbers) means the model remembers its training tasks instead of copying the number, and no
RL on other tasks can raise the held-out pass rate by sharpening. `--group`: also the mean p
over each consecutive group of that many training tasks (GRPO's tasks per step, in its order):
single-epoch GRPO's per-step pass rate follows it, whatever the policy learned.

One forward pass per checkpoint (seconds); the transcripts run in the sandbox once (bwrap).
"""
from __future__ import annotations

import argparse

import numpy as np


def transcripts(seed: int, n: int) -> list[tuple[str, list]]:
    """(task id, messages) of the first `n` toy tasks, in toy_tasks' (= the RL stages') order."""
    from coder.env.tasks import toy_tasks
    from coder.env.transcripts import transcript

    out = []
    for task, solution in toy_tasks(n, seed):
        conv, _ = transcript(task, solution, seed, edit_tool="write_file", tools=("write_file", "submit"))
        if conv is None:
            raise RuntimeError(f"{task.id}: the scripted transcript did not pass (check bwrap)")
        out.append((task.id, conv["messages"]))
    return out


def digit_probs(ckpt: str, convs) -> tuple[np.ndarray, np.ndarray]:
    """(p of the right number, right number is the argmax) per conversation."""
    import jax
    import jax.numpy as jnp

    from coder import stages
    from coder.model import sharding
    from coder.train.checkpoint import stage_tokenizer
    from coder.train.state import load_model
    from configs import quickstart

    c = stages.stage_config("grpo", stages.inherit_model_config(quickstart.get_config(), ckpt))
    tok = stage_tokenizer(c, ckpt)
    model = load_model(c, ckpt, sharding.make_mesh(c.mesh))
    rows, where = [], []
    for task_id, messages in convs:
        k = task_id.split("/")[-1]
        ids = list(tok.render_conversation(messages)[0])
        pieces = [tok.decode([i]) for i in ids]
        start = max(i for i, p in enumerate(pieces) if p.endswith('"content": "'))  # write_file's content
        at = next(i for i in range(start, len(ids)) if pieces[i] == k)
        rows.append(ids[:at + 1])
        where.append(at)
    length = -(-max(map(len, rows)) // 64) * 64
    toks = np.zeros((len(rows), length), np.int32)
    for i, r in enumerate(rows):
        toks[i, :len(r)] = r
    pos = np.broadcast_to(np.arange(length, dtype=np.int32), toks.shape)
    logits, _ = model(jnp.asarray(toks), jnp.asarray(pos), jnp.ones_like(jnp.asarray(toks)))
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
    idx = np.arange(len(rows))
    at = np.asarray(where)
    target = toks[idx, at]
    before = np.asarray(logp[idx, at - 1])
    return np.exp(before[idx, target]), before.argmax(-1) == target


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpts", nargs="+")
    ap.add_argument("--seed", type=int, default=0, help="config.seed of the run (it orders the tasks)")
    ap.add_argument("--group", type=int, default=4, help="tasks per GRPO step (rl.tasks_per_step)")
    args = ap.parse_args(argv)
    from configs import quickstart

    config = quickstart.get_config()
    n, g = config.sft.toy_tasks, args.group
    convs = transcripts(args.seed, n + config.rl.eval_num_tasks)
    for ckpt in args.ckpts:
        p, hit = digit_probs(ckpt, convs)
        print(f"{ckpt}: p(right number) train {p[:n].mean():.3f} (argmax {hit[:n].mean():.3f}), "
              f"held-out {p[n:].mean():.3f} (argmax {hit[n:].mean():.3f}); chance 0.111")
        steps = " ".join(f"{p[i:i + g].mean():.2f}" for i in range(0, n - g + 1, g))
        print("  per GRPO step's tasks:", steps)


if __name__ == "__main__":
    main()
