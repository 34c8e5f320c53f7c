"""How far the learner's log-probs of the sampled tokens are from the engine's (the behaviour
policy's), as one pure function: the GRPO loss logs it every step (coder.rl.grpo.grpo_loss_fn,
from the training forward itself) and bench/agreement.py reports it per precision pairing.

For the loss tokens t (mask), with e_t the engine's recorded log-prob of the sampled token and
l_t the learner's recomputation (same weights, same tokens, same temperature):

    abs_diff_mean = mean_t |l_t - e_t|          abs_diff_max = max_t |l_t - e_t|
    kl_k3         = mean_t (r_t - 1) - log r_t,   r_t = exp(l_t - e_t)

kl_k3 is Schulman's k3 estimator of KL(pi_engine || pi_learner) from tokens the engine sampled
(unbiased, >= 0 per token, low variance when the two are close); a learner that reproduces the
engine gives exactly 0 everywhere.

Routing (MoE), from the engine's expert ids and the learner's own router choice (the forward's
aux["router_ids"], also where router replay overrode it), `[moe_layers, B, T, top_k]`, -1 where
the engine routed nothing (padding, a last appended token). Over every token the engine routed
(prompt and tool output included: their routing shapes the keys the sampled tokens attend to):

    routing_mismatch        (token, MoE layer) pairs whose top-k *set* differs
    routing_mismatch_tokens tokens whose set differs in at least one MoE layer
"""
from __future__ import annotations

import jax.numpy as jnp

METRICS = ("abs_diff_mean", "abs_diff_max", "kl_k3", "routing_mismatch", "routing_mismatch_tokens")


def agreement(engine_logp, learner_logp, mask, engine_ids=None, learner_ids=None) -> dict:
    """Engine/learner agreement metrics (module docstring), float32 scalars.

    Args:
      engine_logp, learner_logp: `[B, T]` log-probs of the sampled tokens (any garbage where
        mask is 0: it is never read).
      mask: `[B, T]` the tokens compared (the loss tokens), float or bool.
      engine_ids, learner_ids: optional `[moe_layers, B, T, top_k]` int expert ids (engine: -1
        where it routed nothing); without them, or without MoE layers, the routing metrics are 0.
    Returns {abs_diff_mean, abs_diff_max, kl_k3, routing_mismatch, routing_mismatch_tokens};
    means over no token are 0. Works inside jit (the loss) and on numpy arrays (the bench).
    """
    m = jnp.asarray(mask, jnp.float32)
    on = m > 0
    d = jnp.where(on, jnp.asarray(learner_logp, jnp.float32) - jnp.asarray(engine_logp, jnp.float32), 0.0)
    n = jnp.maximum(m.sum(), 1.0)
    gap = jnp.abs(d)
    k3 = jnp.where(on, jnp.expm1(d) - d, 0.0)  # (r - 1) - log r with r = exp(d), accurate near 0
    out = {"abs_diff_mean": (gap * m).sum() / n, "abs_diff_max": gap.max(initial=0.0),
           "kl_k3": (k3 * m).sum() / n}
    out = {k: jnp.asarray(v, jnp.float32) for k, v in out.items()}
    if engine_ids is None or learner_ids is None:
        zero = jnp.zeros((), jnp.float32)
        return {**out, "routing_mismatch": zero, "routing_mismatch_tokens": zero}
    return {**out, **routing_agreement(engine_ids, learner_ids)}


def routing_agreement(engine_ids, learner_ids) -> dict:
    """{routing_mismatch, routing_mismatch_tokens} (module docstring) of `[moe_layers, B, T,
    top_k]` expert ids; 0 without MoE layers or routed tokens."""
    e = jnp.asarray(engine_ids).astype(jnp.int32)
    own = jnp.asarray(learner_ids).astype(jnp.int32)
    routed = (e >= 0).all(-1)  # [L, B, T]
    # the same set: every engine expert is among the learner's k (a top-k's ids are distinct)
    same = (e[..., :, None] == own[..., None, :]).any(-1).all(-1)
    differs = routed & ~same
    zero = jnp.zeros((), jnp.float32)
    if e.shape[0] == 0:
        return {"routing_mismatch": zero, "routing_mismatch_tokens": zero}
    pairs = differs.sum() / jnp.maximum(routed.sum(), 1)
    tokens = differs.any(0).sum() / jnp.maximum(routed.any(0).sum(), 1)
    return {"routing_mismatch": zero + pairs, "routing_mismatch_tokens": zero + tokens}
