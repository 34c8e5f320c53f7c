"""Optimizers: AdamW or Muon, warmup + cosine learning rate, global-norm clipping.

Parameters stay in float32 (the model's `param_dtype`, the master weights); the model casts to
its compute dtype (`model.dtype`, bfloat16) inside each matmul, so gradients and optimizer
moments are float32 too.

Muon (Jordan et al. 2024; Kimi K2 / Moonlight, Liu et al. 2025 "Muon is Scalable for LLM
Training") orthogonalises the momentum of every weight *matrix* with Newton-Schulz iterations.
Moonlight keeps AdamW for embeddings, the output head and vectors (norms, biases), and scales
Muon's update to RMS 0.2 ("consistent RMS") so that AdamW's learning rate and weight decay carry
over unchanged; that is what `make_optimizer` does with optax.contrib.muon.
"""
from __future__ import annotations

import jax
import optax

# Parameters whose path contains one of these names are lookup tables / the output head:
# Muon's orthogonalisation is meant for hidden-layer matrices only (Moonlight, section 2).
_ADAM_ONLY = ("embed", "lm_head", "head")

# Moonlight's RMS matching constant: Muon's update RMS is scaled to AdamW's typical 0.2-0.4.
_MUON_RMS = 0.2


def lr_schedule(train_cfg) -> optax.Schedule:
    """Linear warmup from 0 to `lr` over `warmup_steps`, cosine to `lr * min_lr_ratio` at `steps`."""
    peak = float(train_cfg.lr)
    warmup = int(train_cfg.warmup_steps)
    decay_steps = max(int(train_cfg.steps), warmup + 1)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=peak,
        warmup_steps=warmup,
        decay_steps=decay_steps,
        end_value=peak * float(train_cfg.min_lr_ratio),
    )


def _path_names(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path).lower()


def decay_mask(params):
    """Decoupled weight decay on matrices only (ndim >= 2); norms and biases are not decayed."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def muon_dimension_numbers(params):
    """Which axes Muon orthogonalises, per parameter (None = AdamW for that parameter).

    `[in, out]` matrices -> reduction axis 0, output axis 1; stacked expert weights
    `[experts, in, out]` -> axes 1, 2 with the expert axis as a batch axis (each expert's matrix
    is orthogonalised on its own); embeddings, the head and vectors -> AdamW.
    """

    def rule(path, p):
        if any(name in _path_names(path) for name in _ADAM_ONLY):
            return None
        if p.ndim == 2:
            return optax.contrib.MuonDimensionNumbers(reduction_axis=0, output_axis=1)
        if p.ndim == 3:
            return optax.contrib.MuonDimensionNumbers(reduction_axis=1, output_axis=2)
        return None

    return jax.tree_util.tree_map_with_path(rule, params)


def make_optimizer(train_cfg) -> optax.GradientTransformation:
    """The optimizer of `train_cfg.optimizer`, preceded by global-norm clipping when grad_clip > 0."""
    schedule = lr_schedule(train_cfg)
    name = train_cfg.optimizer
    if name == "adamw":
        tx = optax.adamw(
            learning_rate=schedule,
            b1=float(train_cfg.b1),
            b2=float(train_cfg.b2),
            weight_decay=float(train_cfg.weight_decay),
            mask=decay_mask,
        )
    elif name == "muon":
        tx = optax.contrib.muon(
            learning_rate=schedule,
            beta=float(train_cfg.b1),
            weight_decay=float(train_cfg.weight_decay),
            weight_decay_mask=decay_mask,
            adam_b1=float(train_cfg.b1),
            adam_b2=float(train_cfg.b2),
            adam_weight_decay=float(train_cfg.weight_decay),
            muon_weight_dimension_numbers=muon_dimension_numbers,
            consistent_rms=_MUON_RMS,
        )
    else:
        raise ValueError(f"train.optimizer={name!r}: expected 'adamw' or 'muon'")
    if float(train_cfg.grad_clip) > 0:
        tx = optax.chain(optax.clip_by_global_norm(float(train_cfg.grad_clip)), tx)
    return tx
