"""Stage `mtp`: train the multi-token-prediction modules by self-distillation.

Composer 2 trains its MTP layers from scratch to match the *exact* distribution of the main
head, so they can draft for speculative decoding (../shared/seeds/002, "Continued Pretraining
and MTP"). Here the trunk, the embedding and the output head are frozen (no gradient, no
optimizer state: the trainer's `trainable` filter selects only `mtp` parameters) and module k
(depth d = k + 1) at index t is trained towards the main head's distribution for the same
token, which the main model predicts at index t + d:

    L = mean_d  KL(p_main(. | x_<=t+d) || p_mtp_d(. | h_t, x_t+1..t+d))  [+ ce_weight * CE_d]

with p_main held fixed (stop-gradient). KL(p || q) is the forward KL: q is pushed to cover
every token the main head would sample, which is what speculative sampling's acceptance
rate rewards. The acceptance rate of one drafted token is

    alpha_d = sum_v min(p_main(v), p_mtp_d(v)) = 1 - TV(p_main, p_mtp_d)

(Leviathan et al., 2023), reported per depth beside the KL and the top-1 agreement, on
training batches and on held-out data at the end of the stage.

The router balancing bias of the trunk stays as trained (it is part of the frozen trunk); the
MTP modules' own MoE bias is not updated in this stage either, so the trunk's variables are
bit-identical before and after.
"""
from __future__ import annotations

import copy
import logging

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from coder.train.losses import cross_entropy_sum, shifted_targets
from coder.train.trainer import Trainer

# The parameters this stage trains: everything under the model's `mtp` list, nothing else.
MTP_PARAMS = nnx.All(nnx.Param, nnx.PathContains("mtp"))


def distill_terms(main_logits, mtp_logits, weights):
    """Per-position distillation terms of one depth.

    main_logits: `[B, L, V]` the main head's logits for the same targets (held fixed);
    mtp_logits: `[B, L, V]` the MTP module's logits; weights: float32 `[B, L]`.
    Returns weighted sums (kl, top1_agree, accept) and the weight sum, float32 scalars.
    """
    log_p = jax.nn.log_softmax(jax.lax.stop_gradient(main_logits).astype(jnp.float32), axis=-1)
    log_q = jax.nn.log_softmax(mtp_logits.astype(jnp.float32), axis=-1)
    p, q = jnp.exp(log_p), jnp.exp(log_q)
    kl = jnp.sum(p * (log_p - log_q), axis=-1)
    agree = (jnp.argmax(log_p, -1) == jnp.argmax(log_q, -1)).astype(jnp.float32)
    accept = jnp.sum(jnp.minimum(p, q), axis=-1)
    w = weights.astype(jnp.float32)
    return jnp.sum(kl * w), jnp.sum(agree * w), jnp.sum(accept * w), jnp.sum(w)


def distill_loss(logits, mtp_logits, batch, *, ce_weight: float):
    """The self-distillation objective. Returns (loss, metrics).

    logits: `[B, T, V]` main head; mtp_logits: `[D, B, T, V]`; batch as docs/contracts.md.
    Module k at index t predicts tokens[t + k + 2], which the main head predicts at index
    t + k + 1; both are scored where that target exists in the same document.
    metrics: kl_d, agree_d, accept_d per depth d (1-based), their means, ce_d when
    ce_weight > 0, and `weight` (the depth-1 target count, for gradient accumulation).
    """
    t = logits.shape[1]
    losses, metrics = [], {}
    weight = None
    for k in range(mtp_logits.shape[0]):
        shift = k + 2
        targets, w = shifted_targets(batch["tokens"], batch["segment_ids"], batch["loss_mask"], shift)
        kl, agree, accept, n = distill_terms(logits[:, k + 1:t - 1], mtp_logits[k][:, :t - shift], w)
        n_safe = jnp.maximum(n, 1.0)
        d = k + 1
        loss_d = kl / n_safe
        metrics[f"kl_{d}"] = loss_d
        metrics[f"agree_{d}"] = agree / n_safe
        metrics[f"accept_{d}"] = accept / n_safe
        if ce_weight > 0:
            ce, _ = cross_entropy_sum(mtp_logits[k][:, :t - shift], targets, w)
            metrics[f"ce_{d}"] = ce / n_safe
            loss_d = loss_d + ce_weight * ce / n_safe
        losses.append(loss_d)
        weight = n if weight is None else weight
    depths = mtp_logits.shape[0]
    for name in ("kl", "agree", "accept"):
        metrics[name] = sum(metrics[f"{name}_{d}"] for d in range(1, depths + 1)) / depths
    metrics["weight"] = weight
    return sum(losses) / depths, metrics


def distill_loss_fn(ce_weight: float):
    """`loss_fn(model, batch, rng)` for the trainer."""

    def loss_fn(model, batch, rng):
        del rng
        logits, aux = model(batch["tokens"], batch["positions"], batch["segment_ids"], mtp=True)
        return distill_loss(logits, aux["mtp_logits"], batch, ce_weight=ce_weight)

    return loss_fn


def mtp_config(config):
    """The config of the mtp stage: mtp.steps / lr over train."""
    c = copy.deepcopy(config)
    if int(c.model.num_mtp_layers) < 1:
        raise ValueError("stage mtp trains the MTP modules: set model.num_mtp_layers >= 1")
    c.train.steps = int(c.mtp.steps)
    c.train.lr = float(c.mtp.lr)
    c.train.mtp_loss_weight = 0.0  # the objective is distillation (distill_loss), not train's mix
    return c


def _fresh_mtp_params(trainer) -> None:
    """Re-initialise the MTP modules (Composer 2 trains them from scratch) after init_from."""
    from coder.model import Transformer, sharding

    fresh = sharding.create_sharded(
        lambda: Transformer(trainer.config.model, rngs=nnx.Rngs(int(trainer.config.seed) + 1)),
        trainer.mesh, trainer.rules,
    )
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
    from coder.data.pretrain import make_pretrain_iterator
    from coder.train.lm_stages import _tokenizer

    if not init_from:
        raise ValueError("stage mtp distils a trained model: set init_from or run it after pretrain in stages")
    c = mtp_config(config)
    tok = _tokenizer(c)
    it = make_pretrain_iterator(c, tok, "train", jax.process_index(), jax.process_count())
    trainer = Trainer(c, stage_dir, distill_loss_fn(float(c.mtp.ce_weight)), trainable=MTP_PARAMS,
                      init_from=init_from, data_iterator=it)
    try:
        if trainer.step == 0 and c.mtp.fresh:
            _fresh_mtp_params(trainer)
            logging.info("mtp: MTP modules re-initialised (mtp.fresh)")
        trainer.fit(it, int(c.train.steps))
        held = make_pretrain_iterator(c, tok, "heldout", jax.process_index(), jax.process_count(),
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
