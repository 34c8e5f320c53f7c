"""GRPO as coder defines it (docs/rl.md, "GRPO as coder defines it").

For one task, G rollouts with rewards r_i (outcome reward minus length penalty, see
`coder.rl.reward`) and correctness scores c_i:

    A_i = r_i - mean_j(r_j)                         over the group's valid rollouts
    A_i = A_i / (std_j(r_j) + eps)                  only if the c_j are not all equal

so when every rollout shares one correctness score the small length-penalty differences are
left as they are instead of being amplified into +-1 (Composer 2). Rollouts that failed for
infrastructure reasons (sandbox crash, harness timeout) are *not* failures of the agent: they
are masked out of their group (no advantage, no loss) instead of scoring 0.

Per token t of a rollout (token arrays `[R, T]`, one rollout-generation per row):

    ratio_t = exp(logp_t - behaviour_logp_t)        vs the policy that sampled the token
    kl_t    = stop_gradient(logp_t - ref_logp_t)    k1 estimator of KL(pi_theta || pi_ref)
    A_t     = A_row - kl_coef * kl_t                KL folded into the reward, detached
    L       = -sum_t mask_t * min(ratio_t A_t, clip(ratio_t, 1 - clip_low, 1 + clip_high) A_t)
              / normalizer

`normalizer` is a constant (tokens per group budget x groups), never each sequence's own length:
dividing by |o_i| would weight a token of a short rollout more than one of a long rollout (the
length bias of GRPO's length standardization that Composer 2 drops).

Why the KL is folded into the advantage: d/dtheta of the detached penalty term gives
E_{x~pi}[(log pi - log pi_ref) grad log pi] = grad KL(pi || pi_ref) exactly, while a
differentiated k1 loss term `mean(log pi - log pi_ref)` has expected gradient
E_{x~pi}[grad log pi] = 0 (tests/rl/test_grpo.py checks both on a small categorical policy).

Off-policy hygiene (docs/rl.md, "Staleness"): a token sampled by policy version v and trained
at learner version u keeps its loss only if 0 <= u - v <= max_staleness (`staleness_mask`);
with `tis_cap > 0` each token's policy-gradient weight is truncated at the cap (`ppo_clip`).
The surrogate is a registry (`POLICY_LOSSES`, `@register_policy_loss("name")`): a variant is one
function of the per-token log-ratio and advantage.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from coder.rl import agreement as agreement_lib
from coder.train import distill
from coder.train.losses import pick_targets


def valid_mask(infra_error: np.ndarray) -> np.ndarray:
    """Rollouts that count in their group: `[N, G]` bool, False where the infrastructure failed."""
    return ~np.asarray(infra_error, dtype=bool)


def advantages(rewards, correct, valid=None, *, eps: float = 1e-6):
    """Group-relative advantages.

    Args:
      rewards: `[N, G]` float, N groups (tasks) of G rollouts.
      correct: `[N, G]` correctness score of each rollout (bool or float, e.g. tests passed).
      valid: optional `[N, G]` bool; False rollouts (infrastructure failures) are left out of
        their group's mean and std and get advantage 0.
      eps: added to the std before dividing.
    Returns:
      `[N, G]` float32. A group with fewer than two valid rollouts has advantage 0 everywhere
      (no baseline to compare against). The std is the population std (ddof=0) of the valid
      rewards.
    """
    r = jnp.asarray(rewards, jnp.float32)
    c = jnp.asarray(correct, jnp.float32)
    v = jnp.ones(r.shape, bool) if valid is None else jnp.asarray(valid, bool)
    vf = v.astype(jnp.float32)
    n = vf.sum(axis=1, keepdims=True)
    safe_n = jnp.maximum(n, 1.0)
    mean = (r * vf).sum(axis=1, keepdims=True) / safe_n
    centred = (r - mean) * vf
    std = jnp.sqrt((centred**2).sum(axis=1, keepdims=True) / safe_n)
    # Correctness differs within the group <=> max != min over the valid rollouts.
    c_max = jnp.where(v, c, -jnp.inf).max(axis=1, keepdims=True)
    c_min = jnp.where(v, c, jnp.inf).min(axis=1, keepdims=True)
    differs = c_max > c_min
    adv = jnp.where(differs, centred / (std + eps), centred)
    return jnp.where(n >= 2, adv, 0.0) * vf


# name -> fn(log_ratio, adv, mask, *, clip_low, clip_high, tis_cap) -> (surrogate [R, T], metrics)
POLICY_LOSSES: dict[str, Callable] = {}


def register_policy_loss(name: str):
    """Registers a per-token surrogate under `name` (policy_loss(..., loss=name)).

    The function gets `log_ratio` `[R, T]` = logp - behaviour_logp (differentiable; 0 on masked
    positions), `adv` `[R, T]` (the row advantage with the KL penalty folded in), `mask` `[R, T]`
    and the keyword hyperparameters `clip_low, clip_high, tis_cap`; it returns the surrogate to
    *maximise* per token (policy_loss masks, sums and divides by the normalizer) and a dict of
    scalar metrics (means over loss tokens).
    """

    def register(fn):
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is registered twice")
        POLICY_LOSSES[name] = fn
        return fn

    return register


def _masked_mean(x, mask, n_tok):
    return (jax.lax.stop_gradient(jnp.asarray(x, jnp.float32)) * mask).sum() / n_tok


@register_policy_loss("grpo")
def ppo_clip(log_ratio, adv, mask, *, clip_low: float, clip_high: float, tis_cap: float = 0.0):
    """PPO's clipped surrogate against the behaviour policy, optionally with truncated IS.

        ratio_t = exp(logp_t - behaviour_logp_t)
        s_t     = min(ratio_t A_t, clip(ratio_t, 1 - clip_low, 1 + clip_high) A_t)

    What the two logprobs are: `logp` is the learner's current model (this step's weights,
    version u, before the update: the trainer makes one pass, so the learner's "old policy" is
    the current model); `behaviour_logp` is what the engine recorded when it sampled the token
    (version v <= u, with the engine's own numerics: serving dtype, cached decode, kernels).

    Truncated importance sampling (`tis_cap > 0`; Yao et al. 2025, "Your efficient RL
    framework secretly brings you off-policy RL training"; verl's `tis_imp_ratio_cap`):

        rho_t = exp(stop_gradient(logp_t) - behaviour_logp_t)     current model / engine
        w_t   = min(rho_t, tis_cap)
        s_t  <- stop_gradient(w_t / rho_t) * s_t

    The ratio is against the behaviour logprob, so it already carries the importance weight:
    its value is rho_t and its gradient rho_t grad log pi. Multiplying the surrogate by w_t as
    well would apply the weight twice; the detached factor w_t / rho_t = min(1, cap / rho_t)
    makes each token's policy-gradient weight exactly w_t = min(rho_t, tis_cap) (1 when engine
    and learner agree), while the PPO clip stays against the behaviour policy. For a token of
    staleness 0, rho_t is the engine/learner numerical mismatch alone; for a stale token it also
    holds the policy change from v to u. The cap matters most for negative advantages, where
    PPO's min() never clips a large ratio.
    """
    ratio = jnp.exp(log_ratio)
    clipped = jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    surrogate = jnp.minimum(ratio * adv, clipped * adv)
    n_tok = jnp.maximum(mask.sum(), 1.0)
    sg_ratio = jax.lax.stop_gradient(ratio)
    # A token is clipped when the clipped branch is the one taken by min() and it differs.
    is_clipped = (clipped * adv < ratio * adv) & (sg_ratio != clipped)
    metrics = {
        "clip_fraction": _masked_mean(is_clipped, mask, n_tok),
        "ratio_mean": _masked_mean(sg_ratio, mask, n_tok),
        "ratio_max": jnp.where(mask > 0, sg_ratio, 0.0).max(),
    }
    if tis_cap > 0:
        weight = jnp.minimum(sg_ratio, tis_cap)
        # w / rho = min(1, cap / rho), in log space: no 0 / 0 where the ratio underflows
        factor = jnp.minimum(1.0, tis_cap * jnp.exp(-jax.lax.stop_gradient(log_ratio)))
        surrogate = factor * surrogate
        metrics["tis_weight_mean"] = _masked_mean(weight, mask, n_tok)
        metrics["tis_truncated_fraction"] = _masked_mean(sg_ratio > tis_cap, mask, n_tok)
    return surrogate, metrics


def tis_weight(logp, behaviour_logp, tis_cap: float):
    """The truncated importance weight min(exp(logp - behaviour_logp), tis_cap), detached: the
    policy-gradient weight `ppo_clip` gives each token when tis_cap > 0 (`[R, T]`)."""
    rho = jnp.exp(jax.lax.stop_gradient(jnp.asarray(logp, jnp.float32))
                  - jnp.asarray(behaviour_logp, jnp.float32))
    return jnp.minimum(rho, tis_cap)


def policy_loss(
    logp,
    behaviour_logp,
    ref_logp,
    advantages,
    loss_mask,
    *,
    clip_low: float,
    clip_high: float,
    kl_coef: float,
    normalizer: float,
    entropy=None,
    loss: str = "grpo",
    tis_cap: float = 0.0,
):
    """Clipped GRPO policy loss with the k1 KL penalty folded into the per-token advantage.

    Args:
      logp: `[R, T]` log pi_theta of each token (differentiable): the learner's current model.
      behaviour_logp: `[R, T]` logprob recorded by the engine when the token was sampled.
      ref_logp: `[R, T]` log pi_ref of each token (frozen reference policy), or None with
        kl_coef 0 (no reference is kept; no "kl" metric).
      advantages: `[R]` one advantage per row (all tokens of a rollout share it), or `[R, T]` per
        token (shared-prefix rows hold several rollouts: coder.rl.trajectory.to_shared_batch).
      loss_mask: `[R, T]` 1 on policy-sampled tokens, 0 on prompt / tool output / padding.
      clip_low, clip_high: the ratio is clipped to [1 - clip_low, 1 + clip_high].
      kl_coef: weight of the k1 penalty (0 = no KL).
      normalizer: constant divisor (tokens per group budget x number of groups).
      entropy: optional `[R, T]` per-token entropy of pi_theta, reported as a metric only.
      loss: the surrogate, a name in POLICY_LOSSES (default "grpo": `ppo_clip`).
      tis_cap: truncated importance weight cap (0 = off; see `ppo_clip`).
    Returns:
      (loss scalar, metrics dict of scalars: kl, clip_fraction, ratio_mean, ratio_max,
      policy_tokens, advantage_mean, entropy when given, tis_weight_mean and
      tis_truncated_fraction when tis_cap > 0). Metrics are means over loss tokens.
    """
    if loss not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {loss!r}; registered: {sorted(POLICY_LOSSES)}")
    mask = jnp.asarray(loss_mask, jnp.float32)
    logp = jnp.asarray(logp, jnp.float32)
    behaviour_logp = jnp.asarray(behaviour_logp, jnp.float32)
    adv_row = jnp.asarray(advantages, jnp.float32)
    adv_row = adv_row if adv_row.ndim == 2 else adv_row[:, None]
    if ref_logp is None:
        if kl_coef:
            raise ValueError(f"kl_coef={kl_coef} needs the reference logprobs (ref_logp)")
        kl, adv = None, adv_row
    else:
        kl = jax.lax.stop_gradient(logp - jnp.asarray(ref_logp, jnp.float32))
        adv = adv_row - kl_coef * kl
    # Masked-out positions may hold garbage logprobs (padding): zero the log-ratio there so
    # exp() cannot overflow into a NaN that a 0-weight would not remove from the gradient.
    log_ratio = jnp.where(mask > 0, logp - behaviour_logp, 0.0)
    surrogate, metrics = POLICY_LOSSES[loss](log_ratio, adv, mask, clip_low=clip_low,
                                             clip_high=clip_high, tis_cap=tis_cap)
    value = -(surrogate * mask).sum() / normalizer

    n_tok = jnp.maximum(mask.sum(), 1.0)
    metrics = {
        **({} if kl is None else {"kl": (kl * mask).sum() / n_tok}),
        **metrics,
        "policy_tokens": mask.sum(),
        "advantage_mean": (jnp.broadcast_to(adv_row, mask.shape) * mask).sum() / n_tok,
    }
    if entropy is not None:
        metrics["entropy"] = _masked_mean(entropy, mask, n_tok)
    return value, metrics


def staleness_mask(staleness, loss_mask, max_staleness: int):
    """Drops the loss of tokens sampled too many versions ago.

    Args:
      staleness: `[R, T]` int, learner version minus the version that sampled the token (the
        learner's version is its optimizer step count, the version its weights were published
        under); anything on tokens outside `loss_mask`.
      loss_mask: `[R, T]` the tokens that would carry loss.
      max_staleness: a token keeps its loss only if 0 <= staleness <= max_staleness (a negative
        staleness is a token of a version this learner never produced, e.g. one published
        before a restart from an earlier checkpoint).
    Returns:
      (mask `[R, T]` float32, metrics: stale_tokens = loss tokens dropped, staleness_mean and
      staleness_max over the tokens that keep their loss).
    """
    mask = jnp.asarray(loss_mask, jnp.float32)
    s = jnp.asarray(staleness, jnp.int32)
    fresh = (s >= 0) & (s <= max_staleness)
    kept = mask * fresh
    n_kept = jnp.maximum(kept.sum(), 1.0)
    metrics = {
        "stale_tokens": (mask * ~fresh).sum(),
        "staleness_mean": (s * kept).sum() / n_kept,
        "staleness_max": jnp.where(kept > 0, s, 0).max().astype(jnp.float32),
    }
    return kept, metrics


def target_logp(logits, tokens, segment_ids, temperature: float = 1.0):
    """Log-probability of each token under the logits of the previous position.

    Args:
      logits: `[B, T, V]` model output; position t predicts token t+1.
      tokens: `[B, T]` int32.
      segment_ids: `[B, T]` int32, 0 = padding.
      temperature: the sampling temperature; the engine records log_softmax(logits / temp),
        so the learner's logprobs use the same scaling to make ratio = 1 on-policy.
    Returns:
      (logp `[B, T]` at the *target* index (logp[:, 0] = 0), entropy `[B, T]` of the
      distribution that predicted each target, valid `[B, T]` bool: same segment as the
      previous token and not padding).
    """
    logz = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32) / temperature, axis=-1)
    tgt = tokens[:, 1:]
    lp = pick_targets(logz, tgt)
    ent = -(jnp.exp(logz) * logz).sum(-1)
    valid = (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] > 0)
    pad = jnp.zeros(tokens.shape[:1] + (1,), jnp.float32)
    lp = jnp.concatenate([pad, jnp.where(valid, lp, 0.0)], axis=1)
    ent = jnp.concatenate([pad, jnp.where(valid, ent, 0.0)], axis=1)
    valid = jnp.concatenate([jnp.zeros_like(pad, bool), valid], axis=1)
    return lp, ent, valid


def routing_diagnostics(engine_ids, router_ids, segment_ids):
    """How far the learner's routing is from the engine's (the case for router replay).

    Args:
      engine_ids: `[moe_layers, B, T, top_k]` int, the experts the engine chose for each token
        (`to_batch`'s expert_ids: -1 on tokens it never routed, and on padding).
      router_ids: `[moe_layers, B, T, top_k]` int, the learner's own top-k for the same tokens
        (the forward's aux["router_ids"]: its choice even where replay overrode it).
      segment_ids: `[B, T]` int32, 0 = padding.
    Returns metrics:
      routing_mismatch: fraction of routed (token, MoE layer) pairs whose top-k *set* differs
        between learner and engine; with f32 learner weights against bf16 serving weights,
        ties broken differently by rounding make it > 0; without replay each such token runs
        other experts in the learner than in the engine.
      routing_mismatch_tokens: fraction of routed tokens whose set differs in some MoE layer
        (both: coder.rl.agreement.routing_agreement).
      unrouted_tokens: tokens that predict a next token (not padding, not a row's last) but
        carry no engine routing; replay feeds them expert 0, so it must be 0 for the learner to
        reproduce the engine (every token's ids must reach the batch, prompt and tool output
        included).
    """
    engine_ids = engine_ids.astype(jnp.int32)
    routed = (engine_ids >= 0).all(-1)  # [L, B, T]
    predicts = (segment_ids[:, 1:] > 0) & (segment_ids[:, 1:] == segment_ids[:, :-1])
    predicts = jnp.pad(predicts, ((0, 0), (0, 1)))  # position t predicts token t + 1
    unrouted = predicts & ~routed.all(0) if engine_ids.shape[0] else jnp.zeros_like(predicts)
    return {**agreement_lib.routing_agreement(engine_ids, router_ids),
            "unrouted_tokens": unrouted.sum().astype(jnp.float32)}


def learner_forward(model, batch, router_replay: bool = False):
    """The learner's forward of a GRPO batch -> (logits `[B, T, V]` float32, aux): the policy
    head only (no MTP), the engine's `expert_ids` replayed as `routing=` with `router_replay`
    (-1 clamped to expert 0: such a token predicts nothing), `prefix_segment` when the batch
    has it (shared-prefix rows). `grpo_loss_fn` and the agreement bench (bench/agreement.py)
    both run it, so the bench measures the log-probs the loss trains on."""
    engine_ids = batch.get("expert_ids")
    routing = jnp.maximum(engine_ids, 0) if router_replay and engine_ids is not None else None
    # shared-prefix rows only: a model that takes no prefix_segment still serves unshared batches
    shared = {"prefix_segment": batch["prefix_segment"]} if "prefix_segment" in batch else {}
    return model(batch["tokens"], batch["positions"], batch["segment_ids"], routing=routing, mtp=False, **shared)


def loss_normalizer(config) -> float:
    """The constant normalizer of a micro-batch's loss: tokens per group budget
    (grpo.tokens_per_group, default rl.group_size x rl.max_rollout_tokens) x groups per step
    (rl.tasks_per_step) / train.grad_accum (the trainer averages the micro-batch losses)."""
    g = config.grpo
    tokens_per_group = int(g.tokens_per_group) or int(config.rl.group_size) * int(config.rl.max_rollout_tokens)
    return tokens_per_group * int(config.rl.tasks_per_step) / int(config.train.grad_accum)


def loss_fn_from_config(config):
    """`grpo_loss_fn` as the learner runs it (and stage compile lowers it): config.grpo's clip,
    KL, router replay, staleness mask and TIS cap, rl.temperature and `loss_normalizer`."""
    g = config.grpo
    return grpo_loss_fn(clip_low=float(g.clip_low), clip_high=float(g.clip_high), kl_coef=float(g.kl_coef),
                        normalizer=loss_normalizer(config), temperature=float(config.rl.temperature),
                        router_replay=bool(g.router_replay), max_staleness=int(g.max_staleness),
                        tis_cap=float(g.tis_cap),
                        mtp_weight=float(g.mtp_weight) if int(config.model.num_mtp_layers) else 0.0)


def grpo_loss_fn(*, clip_low, clip_high, kl_coef, normalizer, temperature, router_replay=False,
                 max_staleness: int | None = None, tis_cap: float = 0.0, loss: str = "grpo",
                 mtp_weight: float = 0.0):
    """A trainer loss `loss_fn(model, batch, rng) -> (loss, metrics)` for GRPO batches.

    The batch (docs/contracts.md) holds `tokens, positions, segment_ids, loss_mask` `[B, T]`,
    `behaviour_logp, ref_logp` `[B, T]` at the target index, `advantages` `[B]` (or `[B, T]`), and
    with grpo.shared_prefix_len `prefix_segment` `[B, T]` (a group's prompt computed once: the
    model's shared-prefix mask, coder.rl.trajectory.to_shared_batch), and (MoE) the
    engine's `expert_ids` `[moe_layers, B, T, top_k]` (-1 where it did not route a token); with
    `router_replay` they are passed as `routing=` (-1 clamped to expert 0: such a token predicts
    nothing). With `max_staleness` set and a batch key `staleness` `[B, T]` (learner version
    minus the token's policy version, `coder.rl.learner.Learner.batch`), stale tokens carry no
    loss (`staleness_mask`). `loss` and `tis_cap` pick the surrogate (`policy_loss`).
    `normalizer` may be a number or the batch key "normalizer" (a scalar) when it varies.

    Diagnostics of the engine/learner gap, from the training forward itself (it runs before
    the update, so it is the first on-policy forward of the batch; no extra forward):
    `behaviour_logp_abs_diff` (mean) and `behaviour_logp_abs_diff_max` of |logp -
    behaviour_logp| over the loss tokens (`ratio_mean` hides it: ratios above and below 1
    average out) and `behaviour_kl_k3`, the k3 estimate of KL(engine || learner)
    (coder.rl.agreement, the definitions bench/agreement.py reports), and with `expert_ids` in
    the batch `routing_diagnostics`' routing_mismatch, routing_mismatch_tokens and
    unrouted_tokens (the learner's own top-k is aux["router_ids"] of the same forward).
    `metric_weight` (the micro-batch's loss tokens) makes the trainer's average of the token
    means over micro-batches the step's token means (coder.train.trainer.reduce_metrics).

    MTP refresh (`mtp_weight` > 0): the MTP modules keep learning the current policy's
    distribution on the batch's sampled tokens (loss_mask), with stage mtp's objective
    (coder.train.distill.distill_loss) on the trunk held fixed (`detached_mtp_logits`: the
    policy's gradient is unchanged), added as mtp_weight x KL; metrics mtp_kl, mtp_accept and
    mtp_accept_{d} per depth (the draft acceptance rate under the current policy). Without it the
    drafts go stale as RL moves the policy, exactly when the engine needs them.
    """

    def loss_fn(model, batch, rng):
        del rng  # the GRPO loss is deterministic given the batch
        engine_ids = batch.get("expert_ids")
        logits, aux = learner_forward(model, batch, router_replay)
        logp, ent, valid = target_logp(logits, batch["tokens"], batch["segment_ids"], temperature)
        mask = batch["loss_mask"] * valid
        stale = {}
        if max_staleness is not None and "staleness" in batch:
            mask, stale = staleness_mask(batch["staleness"], mask, max_staleness)
        norm = batch.get("normalizer", normalizer)
        value, metrics = policy_loss(
            logp, batch["behaviour_logp"], batch.get("ref_logp"), batch["advantages"], mask,
            clip_low=clip_low, clip_high=clip_high, kl_coef=kl_coef, normalizer=norm, entropy=ent,
            loss=loss, tis_cap=tis_cap,
        )
        agree = agreement_lib.agreement(batch["behaviour_logp"], jax.lax.stop_gradient(logp), mask)
        diag = {"behaviour_logp_abs_diff": agree["abs_diff_mean"], "behaviour_logp_abs_diff_max": agree["abs_diff_max"],
                "behaviour_kl_k3": agree["kl_k3"],
                "metric_weight": mask.sum()}  # the token means above are exact over the step's micro-batches
        if engine_ids is not None and "router_ids" in aux:
            diag.update(routing_diagnostics(engine_ids, aux["router_ids"], batch["segment_ids"]))
        if mtp_weight:
            if "prefix_segment" in batch:
                raise ValueError("grpo.mtp_weight > 0 with grpo.shared_prefix_len: the MTP modules have no "
                                 "shared-prefix mask; set one of them to 0")
            mtp_logits = distill.detached_mtp_logits(model, aux["hidden"], batch["tokens"], batch["positions"],
                                                     batch["segment_ids"])
            kl, m = distill.distill_loss(logits, mtp_logits, batch, ce_weight=0.0)
            value = value + mtp_weight * kl
            diag.update({f"mtp_{k}": v for k, v in m.items() if k.startswith(("kl", "accept"))})
        return value, {**metrics, **stale, **diag}

    return loss_fn
