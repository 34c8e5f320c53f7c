"""The MTP self-distillation objective: each MTP module learns the main head's distribution.

Module k (depth d = k + 1) at index t is trained towards the main head's distribution for the
same token, which the main model predicts at index t + d:

    L = mean_d  KL(p_main(. | x_<=t+d) || p_mtp_d(. | h_t, x_t+1..t+d))  [+ ce_weight * CE_d]

with p_main held fixed (stop-gradient). KL(p || q) is the forward KL: q is pushed to cover
every token the main head would sample, which is what speculative sampling's acceptance rate
rewards. The acceptance rate of one drafted token is

    alpha_d = sum_v min(p_main(v), p_mtp_d(v)) = 1 - TV(p_main, p_mtp_d)

(Leviathan et al., 2023), reported per depth beside the KL and the top-1 agreement.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from coder.train.losses import cross_entropy_sum, shifted_targets

# The parameters MTP distillation trains: everything under the model's `mtp` list, nothing else.
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


def detached_mtp_logits(model, hidden, tokens, positions, segment_ids):
    """The MTP modules' logits `[D, B, T, V]` on the trunk's final hidden states `hidden`
    `[B, T, d_model]` (aux["hidden"] of the main forward), as `model(..., mtp=True)` computes
    them, with every parameter outside the MTP modules (the shared embedding and output head
    included) and `hidden` held fixed: a loss on them trains the MTP modules only. For a stage
    that trains the trunk with another objective (GRPO) and keeps the drafts distilled beside it."""
    graphdef, mtp_params, rest = nnx.split(model, MTP_PARAMS, ...)
    fixed = nnx.merge(graphdef, mtp_params, jax.tree.map(jax.lax.stop_gradient, rest))
    h, out = jax.lax.stop_gradient(hidden), []
    for k in range(len(fixed.mtp)):
        nxt = jnp.pad(tokens[:, k + 1:], ((0, 0), (0, k + 1)))  # tokens[t+k+1], 0 past the end
        h, logits, _ = fixed.mtp_module(k, h, nxt, positions, segment_ids)
        out.append(logits)
    return jnp.stack(out)


def distill_loss_fn(ce_weight: float):
    """`loss_fn(model, batch, rng)` for the trainer."""

    def loss_fn(model, batch, rng):
        del rng
        logits, aux = model(batch["tokens"], batch["positions"], batch["segment_ids"], mtp=True)
        return distill_loss(logits, aux["mtp_logits"], batch, ce_weight=ce_weight)

    return loss_fn
