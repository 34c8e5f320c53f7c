"""The SFT data tests' inputs (tests/data/test_sft.py, tests/data/test_decontaminate.py): agent
conversations of a small vocabulary, a JSONL writer, the data config, each segment of a batch."""
import json
import random

import numpy as np

from configs import base

WORDS = "fix the bug in parser tests pass shell read file grep edit submit".split()


def conversation(i, n_turns=2, words=6):
    rng = random.Random(i)

    def say():
        return f"#{i} " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, words)))

    messages = [{"role": "system", "content": "You are a coding agent."}]
    for _ in range(n_turns):
        messages.append({"role": "user", "content": say()})
        messages.append({"role": "assistant", "content": say() + '<tool_call>{"name": "shell"}</tool_call>'})
        messages.append({"role": "tool", "content": "<tool_result>" + say() + "</tool_result>"})
        messages.append({"role": "assistant", "content": say()})
    return {"messages": messages}


def write(path, records):
    with open(path, "wb") as f:
        for r in records:
            f.write(r if isinstance(r, bytes) else json.dumps(r).encode())
            f.write(b"\n")


def config(seq_len=128, batch_size=4, **data):
    cfg = base.get_config()
    cfg.data.seq_len, cfg.data.batch_size, cfg.data.heldout_fraction = seq_len, batch_size, 0.0
    for k, v in data.items():
        cfg.data[k] = v
    return cfg


def segments(batches):
    """(tokens, loss_mask, positions) of every segment, in batch / row / segment order."""
    out = []
    for b in batches:
        for r in range(b["tokens"].shape[0]):
            for s in np.unique(b["segment_ids"][r]):
                if s:
                    where = b["segment_ids"][r] == s
                    out.append((b["tokens"][r, where], b["loss_mask"][r, where], b["positions"][r, where]))
    return out
