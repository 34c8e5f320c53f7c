"""The index of held-out code the training stages keep out of their data (`data.exclude_tasks`).

Built once per process from the held-out tasks (coder.rl.actor.heldout_tasks, their code by
coder.env.heldout.code_texts) and given to the pretraining and SFT pipelines of the stages that
train on them (pretrain, longctx, mtp, sft), which drop overlapping documents and count them
(`data/heldout_dropped` in the stage's metrics).
"""
from __future__ import annotations

import logging
import time

from coder.data.decontaminate import NgramIndex
from coder.env import heldout
from coder.rl.actor import heldout_tasks

_BUILT: dict = {}


def _key(config) -> tuple:
    rl = config.rl
    return (config.data.exclude_tasks, rl.eval_tasks, rl.tasks, int(rl.eval_num_tasks), int(config.seed),
            int(config.data.exclude_ngram), int(config.data.exclude_min_matches))


def check(config) -> None:
    """data.exclude_* at start-up (the index itself is built when a stage first reads data)."""
    for key in ("exclude_ngram", "exclude_min_matches"):
        if int(config.data[key]) < 1:
            raise ValueError(f"data.{key}={config.data[key]} must be >= 1")
    if not isinstance(config.data.exclude_tasks, str):
        raise ValueError(f"data.exclude_tasks={config.data.exclude_tasks!r}: \"eval\", \"\" or a Task JSONL path/glob")


def training_exclude(config):
    """The decontaminate.NgramIndex of the held-out tasks' code, or None when there is none."""
    key = _key(config)
    if key not in _BUILT:
        t0 = time.time()
        tasks = heldout_tasks(config)
        index = NgramIndex.from_texts(heldout.code_texts(tasks), int(config.data.exclude_ngram),
                                      int(config.data.exclude_min_matches)) if tasks else None
        if index is not None:
            logging.info("data.exclude_tasks=%r: %d held-out tasks, %d distinct %d-word runs of their code "
                         "kept out of training data (%.1f s)", config.data.exclude_tasks, len(tasks), len(index),
                         index.n, time.time() - t0)
        _BUILT[key] = index
    return _BUILT[key]
