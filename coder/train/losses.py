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

import functools

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


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def chunked_cross_entropy_sum(hidden, w, targets, weights, chunks: int):
    """`cross_entropy_sum(hidden @ w, targets, weights)` without the whole logits: `chunks`
    parts of each row's tokens at a time, forward and backward.

    hidden `[B, T, D]` (the final normed hidden states, the model's dtype), w `[D, V]` (the
    head's weight, the same dtype), targets int32 / weights float32 `[B, T]`; T a multiple of
    `chunks`. Returns (loss_sum, weight_sum), float32 scalars. A chunk holds every `chunks`-th
    token of a row (token t = i * chunks + j is in chunk j), so each chunk is spread over the
    devices that split the row as the row is.

    At most `[B, T / chunks, V]` float32 logits live at once (a 128k row's logits over a
    163,840-token vocabulary are 86 GB in float32). The forward keeps each token's log-sum-exp;
    the backward recomputes a chunk's logits once and multiplies in the model's dtype with
    float32 accumulation, dW summed over the chunks in float32 (what `head_logits`' backward
    does for the whole logits)."""
    return _chunked_ce_fwd(hidden, w, targets, weights, chunks)[0]


def _token_chunks(x, chunks: int):
    """`[B, T, ...]` -> `[chunks, B, T / chunks, ...]`, chunk j holding tokens i * chunks + j."""
    b, t = x.shape[:2]
    if t % chunks:
        raise ValueError(f"train.loss_chunks={chunks} does not divide rows of {t} tokens")
    return jnp.moveaxis(x.reshape(b, t // chunks, chunks, *x.shape[2:]), 2, 0)


def _chunked_ce_fwd(hidden, w, targets, weights, chunks):
    def chunk(total, xs):
        h, tg, wt = xs
        logits = jnp.einsum("btd,dv->btv", h, w, preferred_element_type=jnp.float32)
        log_z = jax.nn.logsumexp(logits, axis=-1)
        return total + jnp.sum((log_z - pick_targets(logits, tg)) * wt), log_z

    xs = tuple(_token_chunks(a, chunks) for a in (hidden, targets, weights))
    total, log_z = jax.lax.scan(chunk, jnp.zeros((), jnp.float32), xs)
    return (total, jnp.sum(weights)), (hidden, w, targets, weights, log_z)


def _chunked_ce_bwd(chunks, res, cotangents):
    hidden, w, targets, weights, log_z = res
    g_total = cotangents[0]

    def chunk(dw, xs):
        h, tg, wt, lz = xs
        logits = jnp.einsum("btd,dv->btv", h, w, preferred_element_type=jnp.float32)
        vocab = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 2)
        # d(lse - logit[target]) / d logits = softmax - onehot, per token times its weight
        g = (jnp.exp(logits - lz[..., None]) - (vocab == tg[..., None])) * (wt * g_total)[..., None]
        g = g.astype(h.dtype)
        dh = jnp.einsum("btv,dv->btd", g, w, preferred_element_type=jnp.float32).astype(h.dtype)
        return dw + jnp.einsum("btd,btv->dv", h, g, preferred_element_type=jnp.float32), dh

    xs = tuple(_token_chunks(a, chunks) for a in (hidden, targets, weights)) + (log_z,)
    dw, dh = jax.lax.scan(chunk, jnp.zeros(w.shape, jnp.float32), xs)
    b, t = targets.shape
    dh = jnp.moveaxis(dh, 0, 2).reshape(b, t, hidden.shape[-1])
    return dh, dw.astype(w.dtype), None, None


chunked_cross_entropy_sum.defvjp(_chunked_ce_fwd, _chunked_ce_bwd)


def next_token_loss(logits, batch, ce_sum=cross_entropy_sum):
    """Mean next-token cross-entropy over targets. logits `[B, T, V]` (or what `ce_sum` takes:
    `lm_loss`). Returns (mean, count)."""
    targets, weights = aligned_targets(batch["tokens"], batch["segment_ids"], batch["loss_mask"], 1)
    total, count = ce_sum(logits, targets, weights)
    return total / jnp.maximum(count, 1.0), count


def mtp_loss(mtp_logits, batch, ce_sum=cross_entropy_sum):
    """Mean over depths of each depth's mean CE. mtp_logits `[D, B, T, V]` (or what `ce_sum`
    takes); depth d = k + 1.

    Module k at index t predicts `tokens[t + k + 2]`. Returns (loss, per-depth losses `[D]`).
    """
    per_depth = []
    for k in range(mtp_logits.shape[0]):
        shift = k + 2
        targets, weights = aligned_targets(batch["tokens"], batch["segment_ids"], batch["loss_mask"], shift)
        total, count = ce_sum(mtp_logits[k], targets, weights)
        per_depth.append(total / jnp.maximum(count, 1.0))
    per_depth = jnp.stack(per_depth)
    return jnp.mean(per_depth), per_depth


def lm_loss(logits, aux, batch, *, mtp_loss_weight: float, z_loss_weight: float, ce_sum=cross_entropy_sum):
    """The LM objective from the model's outputs. Returns (loss, metrics).

    logits `[B, T, V]`; aux as docs/contracts.md (`mtp_logits` `[D, B, T, V]` when the model has
    MTP modules, `router_load`, `router_z_loss` when it has MoE layers).
    ce_sum: (outputs, targets, weights) -> (loss sum, weight sum): `cross_entropy_sum` of logits,
    or the chunked head of a model called with logits=False (its hidden states in place of the
    logits, aux["mtp_hidden"] in place of aux["mtp_logits"]: `lm_loss_fn`).
    metrics: `ce` (next-token, mean over targets), `mtp_ce` and `mtp_ce_{d}` (when MTP runs),
    `z_loss` (MoE), `moe_dropped` (with an expert capacity), `weight` (the target count),
    `router_load` / `mtp_router_load` (passed through for the trainer's bias update).
    """
    ce, count = next_token_loss(logits, batch, ce_sum)
    loss = ce
    metrics = {"ce": ce, "weight": count}
    mtp_logits = (aux.get("mtp_logits", aux.get("mtp_hidden"))) if aux else None
    if mtp_loss_weight > 0 and mtp_logits is not None and mtp_logits.shape[0] > 0:
        mtp, per_depth = mtp_loss(mtp_logits, batch, ce_sum)
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
    chunks = int(train_cfg.get("loss_chunks", 1) or 1)
    if chunks < 1:
        raise ValueError(f"train.loss_chunks={chunks}: 1 (the whole logits) or more")

    def loss_fn(model, batch, rng):
        del rng  # the LM objective is deterministic (no dropout)
        if chunks == 1:
            logits, aux = model(batch["tokens"], batch["positions"], batch["segment_ids"])
            return lm_loss(logits, aux, batch, mtp_loss_weight=mtp_w, z_loss_weight=z_w)
        hidden, aux = model(batch["tokens"], batch["positions"], batch["segment_ids"], logits=False)
        w = model.head_weight()
        ce_sum = lambda h, targets, weights: chunked_cross_entropy_sum(h, w, targets, weights, chunks)
        return lm_loss(hidden, aux, batch, mtp_loss_weight=mtp_w, z_loss_weight=z_w, ce_sum=ce_sum)

    return loss_fn
