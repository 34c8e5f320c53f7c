"""DeepSeek-V3 MoE routing: sigmoid router scores, the aux-loss-free selection bias, load shares.

Routing for token x (DeepSeek-V3 section 2.1.2), N tokens, E experts, k = num_experts_per_tok:
    s      = sigmoid(x W_r)                         [N, E]   scores (float32)
    c      = s + b                                  bias b (RouterBias) only for *selection*
    group score = sum of the top-2 c in each of n_group groups; keep the topk_group best groups
    ids    = top-k of c over the kept groups        [N, k]
    g      = s[ids] / sum s[ids]  (norm_topk_prob)  * routed_scaling_factor
Balancing (aux-loss-free): after each optimizer step, b += rate * sign(mean load - load), with
load the `load_fraction` of each expert (coder.model.moe.update_router_bias applies it to a
model's MoE layers); `balancing_warning` says when the rate is too small for a run's length.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class RouterBias(nnx.Variable):
    """Expert-selection bias: updated by `update_router_bias`, never by the optimizer."""


def balancing_warning(cfg, steps: int) -> str:
    """Why aux-loss-free balancing cannot keep up in a from-scratch run of `steps` steps ("" if
    it can).

    The bias moves bias_update_rate per step (a sign update) and must cancel the score gaps
    the router learns between experts (sigmoid scores in (0, 1)); early in training the hidden
    states share one direction, so such a gap routes every token to the same top-k experts.
    A bias that cannot move by 1 over the run cannot undo an arbitrary gap: e.g. the quickstart's
    150 steps at DeepSeek-V3's 1e-3 (tuned for a run of ~10^5 steps) left every token of every
    MoE layer on 2 of 4 experts (load_imbalance 2.00 = E/k) for the whole pretraining.
    """
    moe = cfg.n_routed_experts > 0 and (cfg.num_hidden_layers > cfg.first_k_dense_replace
                                        or cfg.num_mtp_layers > 0)
    rate = float(cfg.bias_update_rate)
    if not moe or rate * steps >= 1.0:
        return ""
    return (f"model.bias_update_rate={rate:g} x {steps} steps moves the router bias by at most "
            f"{rate * steps:.2g}, less than the sigmoid scores' range (1): routing may collapse onto "
            f"{cfg.num_experts_per_tok} of {cfg.n_routed_experts} experts (load_imbalance "
            f"{cfg.n_routed_experts / cfg.num_experts_per_tok:.2f}); raise model.bias_update_rate "
            f"to >= {1.0 / max(steps, 1):.2g}")


def route(logits, bias, cfg, expert_ids=None):
    """Top-k expert choice. logits `[..., E]` float32 (e.g. `[B, T, E]`), bias `[E]`.

    Returns (weights `[..., k]` float32, ids `[..., k]` int32). With `expert_ids` given (router
    replay) the choice is taken from them and only the weights are recomputed. Every op keeps
    the leading axes, so tokens split over a mesh stay split (flattening `[B, T]` with T split
    would make XLA replicate the routing on every device).
    """
    lead, e = logits.shape[:-1], logits.shape[-1]
    scores = jax.nn.sigmoid(logits)
    if expert_ids is None:
        choice = scores + bias.astype(jnp.float32)
        if cfg.n_group > 1:
            g = cfg.n_group
            grouped = choice.reshape(*lead, g, e // g)
            group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [..., n_group]
            _, top_groups = jax.lax.top_k(group_scores, cfg.topk_group)
            keep = jax.nn.one_hot(top_groups, g, dtype=jnp.bool_).any(-2)  # [..., n_group]
            keep = jnp.repeat(keep, e // g, axis=-1)
            choice = jnp.where(keep, choice, -jnp.inf)
        _, ids = jax.lax.top_k(choice, cfg.num_experts_per_tok)
    else:
        ids = expert_ids.reshape(*lead, -1)
    ids = ids.astype(jnp.int32)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, ids


def load_fraction(ids, valid, n_experts: int):
    """Fraction of the valid tokens' top-k assignments per expert `[E]` (sums to 1)."""
    weight = jnp.broadcast_to(valid.reshape(*ids.shape[:-1], 1), ids.shape).astype(jnp.float32)
    counts = jnp.zeros((n_experts,), jnp.float32).at[ids].add(weight)
    return counts / jnp.maximum(counts.sum(), 1.0)
