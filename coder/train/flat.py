"""Flat string names of a model's variables and of any pytree: `("layers", 0, "kernel")` ->
"layers.0.kernel". Checkpoints store arrays under these names (coder.train.checkpoint), the weight
store publishes them (coder.rl.weight_channel), and a state is matched to a template by them, so a
later stage's new modules (fresh MTP heads) find their variables by name.
"""
from __future__ import annotations

import jax
from flax import nnx

SEP = "."


def flat_name(path) -> str:
    """`("layers", 0, "kernel")` / jax key paths -> "layers.0.kernel"."""
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                k = getattr(k, attr)
                break
        parts.append(str(k))
    return SEP.join(parts)


def state_to_flat(state: nnx.State) -> dict:
    """nnx.State -> {flat name: array}."""
    return {flat_name(path): var.get_value() for path, var in nnx.to_flat_state(state)}


def flat_to_state(template: nnx.State, flat: dict) -> nnx.State:
    """Inverse of `state_to_flat`: the values of `flat` in `template`'s structure and types."""
    leaves = []
    for path, var in nnx.to_flat_state(template):
        leaves.append((path, var.replace(flat[flat_name(path)])))
    return nnx.from_flat_state(leaves)


def tree_to_flat(tree) -> dict:
    """Any pytree (an optax state) -> {flat name of the key path: leaf}."""
    return {flat_name(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def flat_to_tree(template, flat: dict):
    """Inverse of `tree_to_flat` for a template with the same structure."""
    paths, treedef = jax.tree_util.tree_flatten_with_path(template)
    return jax.tree_util.tree_unflatten(treedef, [flat[flat_name(p)] for p, _ in paths])
