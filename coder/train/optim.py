"""Optimizers: AdamW or Muon, warmup + cosine learning rate, global-norm clipping.

Parameters stay in float32 (the model's `param_dtype`, the master weights); the model casts to
its compute dtype (`model.dtype`, bfloat16) inside each matmul, so gradients and optimizer
moments are float32 too.

Muon (Jordan et al. 2024; Kimi K2 / Moonlight, Liu et al. 2025 "Muon is Scalable for LLM
Training") orthogonalises the momentum of every weight *matrix* with Newton-Schulz iterations.
Moonlight keeps AdamW for embeddings, the output head and vectors (norms, biases), and scales
Muon's update to RMS 0.2 ("consistent RMS") so that AdamW's learning rate and weight decay carry
over unchanged; that is what `make_optimizer` does with optax.contrib.muon.

Which matrix a parameter is (`muon_dimension_numbers`): optax's MuonDimensionNumbers name the
reduction (input) axes and output axes of a parameter, which are flattened to the matrix
`[prod(reduction), prod(output)]`; every other axis is a batch axis (one matrix per index).
The rule is explicit per parameter kind, by parameter name, on the per-layer shape:

    kind                              per-layer shape      matrix                 Muon axes
    2-D weight, x @ W (every Linear)  [in, out]            [in, out]              red 0, out 1
    MLA q_proj / q_b_proj             [D or q_lora, H, dq] [D or q_lora, H*dq]    red 0, out (1, 2)
    MLA kv_b_proj                     [r, H, dn+dv]        [r, H*(dn+dv)]         red 0, out (1, 2)
    MLA o_proj                        [H, dv, D]           [H*dv, D]              red (0, 1), out 2
    NSA gate_w                        [D, H, 3]            [D, H*3]               red 0, out (1, 2)
    routed experts wg / wu / wd       [E, in, out]         E matrices [in, out]   batch 0, red 1, out 2
    embed, lm_head, head, NSA pos     tables / the head    -                      AdamW
    vectors (norms), NSA gate_b       [n], bias [H, 3]     -                      AdamW

(the MLA projections are HF DeepSeek-V3's Linear layers q_b_proj `H*dq x q_lora`, kv_b_proj
`H*(dn+dv) x r`, o_proj `D x H*dv`, so Muon sees the same matrices as a PyTorch Muon would).
Parameters under `moe_stack` (model.scan_layers: the MoE layers stacked by
transformer.stack_blocks) carry a leading layer axis `[L, ...]`, one more batch axis. A
parameter of 3 or more (per-layer) axes that is not in this table raises an error naming it:
a new kind must be given its axes here rather than fall back to AdamW unnoticed.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

MuonDims = optax.contrib.MuonDimensionNumbers

# Parameters with one of these names (any path component) are lookup tables / the output
# head: Muon's orthogonalisation is meant for hidden-layer matrices only (Moonlight, section 2).
# "pos" is NSA's compression position embedding (coder/pallas/nsa/module.py, added to blocks).
_ADAM_ONLY = ("embed", "lm_head", "head", "pos")

# Biases stored with more than one axis (NSA's gate bias `[H, 3]`): AdamW, outside decay_mask.
_BIASES = ("gate_b",)

# Containers whose every parameter has a leading layer axis (transformer.stack_blocks).
_LAYER_STACKS = ("moe_stack",)

# Per-layer N-D weights by parameter name: (ndim, reduction axes, output axes); the remaining
# axes are batch axes. Shapes in coder/model/attention.py, moe.py, coder/pallas/nsa/module.py.
_LAYOUTS = {
    "q_proj": (3, (0,), (1, 2)),  # [D, H, dn+dr]
    "q_b_proj": (3, (0,), (1, 2)),  # [q_lora_rank, H, dn+dr]
    "kv_b_proj": (3, (0,), (1, 2)),  # [kv_lora_rank, H, dn+dv]
    "o_proj": (3, (0, 1), (2,)),  # [H, dv, D]
    "gate_w": (3, (0,), (1, 2)),  # NSA gates [D, H, 3]
    "wg": (3, (1,), (2,)),  # routed experts [E, D, F]
    "wu": (3, (1,), (2,)),  # [E, D, F]
    "wd": (3, (1,), (2,)),  # [E, F, D]
}
_MATRIX = (2, (0,), (1,))  # any other 2-D weight: x @ W, [in, out]

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


def _names(path) -> tuple[str, ...]:
    """A pytree path's key names, without the `value` attribute of an nnx.Variable."""
    names = tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)
    return names[:-1] if names and names[-1] in ("value", "raw_value") else names


def _layer_axes(names) -> int:
    """Leading layer axes of a parameter: 1 inside a stacked-layer container, else 0."""
    return int(any(n in _LAYER_STACKS for n in names))


def _muon_rule(path, shape) -> MuonDims | None:
    """The MuonDimensionNumbers of one parameter (None = AdamW); see the module docstring."""
    names = _names(path)
    lead = _layer_axes(names)
    ndim = len(shape) - lead  # the per-layer rank
    if any(n in _ADAM_ONLY for n in names) or (names and names[-1] in _BIASES) or ndim <= 1:
        return None
    name = "/".join(names)
    layout = _LAYOUTS.get(names[-1] if names else "")
    if layout is None and ndim == 2:
        layout = _MATRIX
    if layout is None:
        raise ValueError(
            f"Muon: no rule for parameter {name!r} of shape {tuple(shape)}: a {ndim}-axis "
            f"weight is not a known kind; give its reduction/output axes in "
            f"coder/train/optim.py _LAYOUTS (or list it in _ADAM_ONLY)")
    want, red, out = layout
    if ndim != want:
        stacked = f" after its {lead} leading layer axis" if lead else ""
        raise ValueError(
            f"Muon: parameter {name!r} of shape {tuple(shape)} has {ndim} axes{stacked}; "
            f"its kind {names[-1]!r} has {want} (coder/train/optim.py _LAYOUTS)")
    return MuonDims(reduction_axis=tuple(a + lead for a in red),
                    output_axis=tuple(a + lead for a in out))


def decay_mask(params):
    """Decoupled weight decay on matrices only (per-layer ndim >= 2: a stacked layer's norm
    `[L, D]` is a vector); norms and biases are not decayed. This mask governs AdamW and Muon's
    matrices; optax.contrib.muon's own AdamW branch (embeddings, head, vectors) takes no mask and
    decays all it holds at train.weight_decay, as Moonlight's reference implementation does."""

    def decayed(path, p):
        names = _names(path)
        return p.ndim - _layer_axes(names) >= 2 and not (names and names[-1] in _BIASES)

    return jax.tree_util.tree_map_with_path(decayed, params)


def muon_dimension_numbers(params):
    """Which axes Muon orthogonalises, per parameter (None = AdamW for that parameter).

    A tree like `params` of optax MuonDimensionNumbers / None, per the table of the module
    docstring: 2-D `[in, out]` weights, MLA's per-head projections as the matrices of their
    fused heads, routed experts as one matrix per expert, a leading layer axis under
    `moe_stack` as a batch axis; embeddings, the head, vectors and biases -> AdamW. An
    unknown N-D parameter raises ValueError naming it.
    """
    return jax.tree_util.tree_map_with_path(lambda path, p: _muon_rule(path, p.shape), params)


def make_optimizer(train_cfg) -> optax.GradientTransformation:
    """The optimizer of `train_cfg.optimizer`, preceded by global-norm clipping when grad_clip > 0."""
    schedule = lr_schedule(train_cfg)
    name = train_cfg.optimizer
    mu_dtype = str(train_cfg.mu_dtype)
    if mu_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"train.mu_dtype={mu_dtype!r}: choose 'float32' or 'bfloat16'")
    if name == "adamw":
        tx = optax.adamw(
            learning_rate=schedule,
            b1=float(train_cfg.b1),
            b2=float(train_cfg.b2),
            weight_decay=float(train_cfg.weight_decay),
            mask=decay_mask,
            mu_dtype=jnp.dtype(mu_dtype),
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
            mu_dtype=jnp.dtype(mu_dtype),
        )
    else:
        raise ValueError(f"train.optimizer={name!r}: expected 'adamw' or 'muon'")
    if float(train_cfg.grad_clip) > 0:
        tx = optax.chain(optax.clip_by_global_norm(float(train_cfg.grad_clip)), tx)
    return tx
