"""Stage `mtp`: train the multi-token-prediction modules by self-distillation.

Composer 2 trains its MTP layers from scratch to match the *exact* distribution of the main
head, so they can draft for speculative decoding. Here the trunk, the embedding and the output
head are frozen (no gradient, no optimizer state: the trainer's `trainable` filter selects only
`mtp` parameters) and the modules are trained on coder.train.distill's objective (forward KL to
the frozen main head, optional CE); KL, top-1 agreement and the acceptance rate per depth are
reported on training batches and on held-out data at the end of the stage.

The router balancing bias of the trunk stays as trained (it is part of the frozen trunk); the
MTP modules' own MoE bias is not updated in this stage either, so the trunk's variables are
bit-identical before and after.
"""
from __future__ import annotations

import copy
import logging

import jax
import numpy as np
from flax import nnx

from coder.data.pretrain import make_pretrain_iterator
from coder.env import transcripts
from coder.model import sharding
from coder.stages import exclude as exclude_lib
from coder.train.checkpoint import stage_tokenizer
from coder.train.distill import MTP_PARAMS, distill_loss_fn
from coder.train.state import build_model
from coder.train.trainer import Trainer


def mtp_config(config):
    """The config of the mtp stage: mtp.steps / lr over train."""
    c = copy.deepcopy(config)
    if int(c.model.num_mtp_layers) < 1:
        raise ValueError("stage mtp trains the MTP modules: set model.num_mtp_layers >= 1")
    c.train.mtp_loss_weight = 0.0  # the objective is distillation (distill_loss), not train's mix
    return c


def _fresh_mtp_params(trainer) -> None:
    """Re-initialise the MTP modules (Composer 2 trains them from scratch) after init_from."""
    fresh = build_model(trainer.config, trainer.mesh, seed=int(trainer.config.seed) + 1)
    _, fresh_params, _ = nnx.split(fresh, MTP_PARAMS, ...)
    # Adam's state is zeros whatever the parameter values, so it stays valid.
    trainer.params = jax.tree.map(lambda new, old: new.astype(old.dtype), fresh_params, trainer.params)


def heldout_metrics(trainer, iterator, batches: int) -> dict:
    """Mean distillation metrics over held-out batches (weighted by target count)."""
    sums, total = {}, 0.0
    for i, batch in enumerate(iterator):
        if i >= batches:
            break
        m = {k: float(np.asarray(v)) for k, v in trainer.eval_step(batch).items() if np.ndim(v) == 0}
        w = m.pop("weight")
        for k, v in m.items():
            sums[k] = sums.get(k, 0.0) + v * w
        total += w
    if total == 0:
        raise ValueError("mtp: the held-out split gave no targets; raise data.heldout_fraction")
    return {f"heldout/{k}": v / total for k, v in sums.items()}


def run(config, stage_dir: str, init_from: str) -> str:
    """Self-distil the MTP modules of the `init_from` model; returns the checkpoint directory."""

    if not init_from:
        raise ValueError("stage mtp distils a trained model: set init_from or run it after pretrain in stages")
    c = config
    # the checkpoint's (resumed or init_from)
    tok = stage_tokenizer(c, init_from, stage_dir, agent_text=transcripts.tokenizer_agent_text)
    it = make_pretrain_iterator(c, tok, "train", *sharding.data_shard(c), exclude=exclude_lib.training_exclude(c))
    trainer = Trainer(c, stage_dir, distill_loss_fn(float(c.mtp.ce_weight)), trainable=MTP_PARAMS,
                      init_from=init_from, data_iterator=it, tokenizer=tok)
    try:
        if trainer.step == 0 and c.mtp.fresh:
            _fresh_mtp_params(trainer)
            logging.info("mtp: MTP modules re-initialised (mtp.fresh)")
        trainer.fit(it, int(c.train.steps))
        held = make_pretrain_iterator(c, tok, "heldout", *sharding.data_shard(c),
                                      num_epochs=None)
        record = heldout_metrics(trainer, held, int(c.mtp.eval_batches))
        held.close()
        record["loss"] = record["heldout/kl"]
        trainer.log(record)
        logging.info("mtp: held-out %s", {k: round(v, 4) for k, v in record.items()})
    finally:
        trainer.close()
        it.close()
    return trainer.checkpoint_dir
