"""Language-model losses: next-token and multi-token-prediction cross-entropy, router z-loss.

Batch semantics (docs/contracts.md): the next-token loss at index t predicts `tokens[t+1]` with
weight `loss_mask[t+1]` when `segment_ids[t] == segment_ids[t+1]` (and that segment is not
padding); MTP depth d (module k = d - 1) at index t predicts `tokens[t+d+1]` with weight
`loss_mask[t+d+1]` when `segment_ids[t] == segment_ids[t+d+1]`. Segments are contiguous, so equal
ids at both ends mean the whole span lies in one document and a target is never the first token
of a document.

    loss = CE_next + mtp_loss_weight * mean_d CE_mtp(d) + z_loss_weight * router_z_loss

Each CE is a mean over its own targets in the (micro-)batch. `lm_loss_fn` reports the number of
next-token targets as `weight`, so gradient accumulation weighs micro-batches by their targets
and equals the big batch (coder.train.trainer).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def shifted_targets(tokens, segment_ids, loss_mask, shift: int):
    """Targets and weights for predicting `shift` tokens ahead.

    tokens, segment_ids: int32 `[B, T]`; loss_mask: float32 `[B, T]`; shift >= 1.
    Returns (targets int32 `[B, T - shift]`, weights float32 `[B, T - shift]`): position t of the
    result is the prediction made at index t for `tokens[t + shift]`.
    """
    targets = tokens[:, shift:]
    same_doc = (segment_ids[:, :-shift] == segment_ids[:, shift:]) & (segment_ids[:, shift:] > 0)
    weights = loss_mask[:, shift:].astype(jnp.float32) * same_doc.astype(jnp.float32)
    return targets, weights


def aligned_targets(tokens, segment_ids, loss_mask, shift: int):
    """`shifted_targets` at the length of the row: targets and weights `[B, T]`, position t
    predicting `tokens[t + shift]`, the last `shift` positions weight 0 (target 0). The loss then
    reads the logits `[B, T, V]` whole: slicing them to `[B, T - shift, V]` made XLA pad the
    float32 cotangent back to T, a copy of the whole logits (8.6 GB a step on the ~1B MoE's H100
    step, both heads)."""
    targets, weights = shifted_targets(tokens, segment_ids, loss_mask, shift)
    pad = ((0, 0), (0, shift))
    return jnp.pad(targets, pad), jnp.pad(weights, pad)


def pick_targets(values, targets):
    """`values[..., targets]` along the last (vocabulary) axis. values `[..., V]`, targets
    int32 `[...]` -> `[...]`.

    A compare-and-sum over the vocabulary, not `take_along_axis`: the logits are split over
    the vocabulary on a mesh, and a gather along a split axis makes XLA's partitioner reshard
    the whole `[rows, T, V]` float32 tensor first (for Kimi K2 on two v5p-512 slices, an
    all-to-all across DCN every micro-batch: 10.7 GB per chip per step). The masked sum is
    elementwise on each shard plus a reduction of one number per token.
    """
    vocab = jax.lax.broadcasted_iota(jnp.int32, values.shape, values.ndim - 1)
    return jnp.sum(jnp.where(vocab == targets[..., None], values, 0), axis=-1)


def cross_entropy_sum(logits, targets, weights):
    """Weighted sum of -log p(target) and the sum of weights.

    logits: `[B, L, V]` (any float dtype; computed in float32); targets int32 `[B, L]`;
    weights float32 `[B, L]`. Returns (loss_sum, weight_sum), float32 scalars.
    """
    logits = logits.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logit = pick_targets(logits, targets)
    nll = log_z - target_logit
    return jnp.sum(nll * weights), jnp.sum(weights)


def next_token_loss(logits, batch):
    """Mean next-token cross-entropy over targets. logits `[B, T, V]`. Returns (mean, count)."""
    targets, weights = aligned_targets(batch["tokens"], batch["segment_ids"], batch["loss_mask"], 1)
    total, count = cross_entropy_sum(logits, targets, weights)
    return total / jnp.maximum(count, 1.0), count


def mtp_loss(mtp_logits, batch):
    """Mean over depths of each depth's mean CE. mtp_logits `[D, B, T, V]`; depth d = k + 1.

    Module k at index t predicts `tokens[t + k + 2]`. Returns (loss, per-depth losses `[D]`).
    """
    per_depth = []
    for k in range(mtp_logits.shape[0]):
        shift = k + 2
        targets, weights = aligned_targets(batch["tokens"], batch["segment_ids"], batch["loss_mask"], shift)
        total, count = cross_entropy_sum(mtp_logits[k], targets, weights)
        per_depth.append(total / jnp.maximum(count, 1.0))
    per_depth = jnp.stack(per_depth)
    return jnp.mean(per_depth), per_depth


def lm_loss(logits, aux, batch, *, mtp_loss_weight: float, z_loss_weight: float):
    """The LM objective from the model's outputs. Returns (loss, metrics).

    logits `[B, T, V]`; aux as docs/contracts.md (`mtp_logits` `[D, B, T, V]` when the model has
    MTP modules, `router_load`, `router_z_loss` when it has MoE layers).
    metrics: `ce` (next-token, mean over targets), `mtp_ce` and `mtp_ce_{d}` (when MTP runs),
    `z_loss` (MoE), `moe_dropped` (with an expert capacity), `weight` (the target count),
    `router_load` / `mtp_router_load` (passed through for the trainer's bias update).
    """
    ce, count = next_token_loss(logits, batch)
    loss = ce
    metrics = {"ce": ce, "weight": count}
    mtp_logits = aux.get("mtp_logits") if aux else None
    if mtp_loss_weight > 0 and mtp_logits is not None and mtp_logits.shape[0] > 0:
        mtp, per_depth = mtp_loss(mtp_logits, batch)
        loss = loss + mtp_loss_weight * mtp
        metrics["mtp_ce"] = mtp
        for k in range(per_depth.shape[0]):
            metrics[f"mtp_ce_{k + 1}"] = per_depth[k]
    if aux and "router_z_loss" in aux:
        z = jnp.asarray(aux["router_z_loss"], jnp.float32)
        metrics["z_loss"] = z
        if z_loss_weight > 0:
            loss = loss + z_loss_weight * z
    if aux and "router_dropped" in aux:
        metrics["moe_dropped"] = aux["router_dropped"]
    for key in ("router_load", "mtp_router_load"):
        if aux and key in aux:
            metrics[key] = aux[key]
    return loss, metrics


def lm_loss_fn(train_cfg, *, use_mtp: bool = True):
    """`loss_fn(model, batch, rng)` for the trainer: forward pass + `lm_loss`.

    use_mtp=False ignores the MTP heads (e.g. a stage that trains the trunk of a model whose
    MTP modules are not trained yet).
    """
    mtp_w = float(train_cfg.mtp_loss_weight) if use_mtp else 0.0
    z_w = float(train_cfg.z_loss_weight)

    def loss_fn(model, batch, rng):
        del rng  # the LM objective is deterministic (no dropout)
        logits, aux = model(batch["tokens"], batch["positions"], batch["segment_ids"])
        return lm_loss(logits, aux, batch, mtp_loss_weight=mtp_w, z_loss_weight=z_w)

    return loss_fn
