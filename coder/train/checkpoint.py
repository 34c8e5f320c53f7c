"""Orbax checkpoints: one directory per stage, one step subfolder per save.

Layout of `{stage_dir}/checkpoints/{step}/`:
  state/   arrays (one orbax PyTree): {"model": {name: array}, "opt_state": {name: array}}
           with flat string names ("layers.0.attn.wq"). "model" holds every variable of the
           model (trained or not, e.g. the router bias), whatever the stage trained, so a
           checkpoint is readable without the code that wrote it and variables are matched by
           name when a later stage adds modules (fresh MTP heads).
  meta/    JSON: step, RNG key data, counters (skipped steps).
  data/    JSON: the data iterator's `get_state()`.
  config/  JSON: the full config of the run that wrote it.

Saves are asynchronous (orbax copies device arrays to host before `save` returns, then writes in
the background), keep the last K, and are restored with the shardings of an abstract target, so
a checkpoint written on one mesh restores onto another.
"""
from __future__ import annotations

import json
import logging
import os
import re

import jax
import orbax.checkpoint as ocp
from etils import epath
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


def abstract(tree, shardings):
    """ShapeDtypeStructs carrying the target shardings (what orbax restores onto)."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


class Checkpointer:
    """CheckpointManager over `directory` keeping `keep` checkpoints."""

    def __init__(self, directory: str, *, keep: int, async_save: bool = True):
        self.directory = directory if "://" in directory else os.path.abspath(directory)
        self._mngr = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, enable_async_checkpointing=async_save, create=True
            ),
        )

    def latest_step(self) -> int | None:
        return self._mngr.latest_step()

    def save(self, step: int, *, arrays: dict, meta: dict, data_state, config: dict, force=False):
        """Start an async save of step. arrays = {"model", "opt_state"} flat dicts."""
        args = dict(
            state=ocp.args.PyTreeSave(arrays),
            meta=ocp.args.JsonSave(meta),
            config=ocp.args.JsonSave(config),
        )
        if data_state is not None:
            args["data"] = ocp.args.JsonSave(data_state)
        return self._mngr.save(step, args=ocp.args.Composite(**args), force=force)

    def restore(self, step: int, abstract_arrays: dict) -> tuple[dict, dict, object]:
        """Restore (arrays, meta, data_state or None) of `step` onto the shardings of the target."""
        items = self._mngr.item_metadata(step).keys()
        args = dict(
            state=ocp.args.PyTreeRestore(
                item=abstract_arrays,
                restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_arrays),
            ),
            meta=ocp.args.JsonRestore(),
        )
        if "data" in items:
            args["data"] = ocp.args.JsonRestore()
        out = self._mngr.restore(step, args=ocp.args.Composite(**args))
        return out["state"], out["meta"], out.get("data") if "data" in items else None

    def wait(self):
        self._mngr.wait_until_finished()

    def close(self):
        self._mngr.wait_until_finished()
        self._mngr.close()


def _resolve(path: str) -> tuple[str, int]:
    """A manager directory (latest step) or one step's directory -> (manager dir, step).

    Local paths and URLs orbax understands (gs://...) both work (etils.epath).
    """
    p = epath.Path(path)
    if re.fullmatch(r"\d+", p.name) and (p / "state").exists():
        return os.fspath(p.parent), int(p.name)
    if not p.exists():
        raise FileNotFoundError(f"init_from={path!r}: no such checkpoint directory")
    mngr = ocp.CheckpointManager(p, options=ocp.CheckpointManagerOptions(read_only=True))
    step = mngr.latest_step()
    mngr.close()
    if step is None:
        raise FileNotFoundError(f"init_from={path!r}: the directory holds no checkpoint")
    return os.fspath(p), step


def checkpoint_step(path: str) -> int:
    """The step of a checkpoint directory's latest save (or of a step directory)."""
    return _resolve(path)[1]


def load_params(path: str, abstract_params: dict) -> tuple[dict, list[str], list[str]]:
    """Model variables of a checkpoint for `init_from`, matched by name.

    path: a checkpoint directory (its latest step) or one step's subfolder.
    abstract_params: {flat name: ShapeDtypeStruct with sharding} of the model being started
    (every variable: params and the router bias).
    Returns (found {name: array} restored onto the target shardings, missing names (in the model,
    not in the checkpoint: they keep their initialisation), unexpected names (in the checkpoint,
    not in the model)). A name present in both with a different shape raises ValueError.
    """
    directory, step = _resolve(path)
    mngr = ocp.CheckpointManager(
        directory,
        options=ocp.CheckpointManagerOptions(read_only=True),
        item_handlers={"state": ocp.PyTreeCheckpointHandler()},
    )
    stored = mngr.item_metadata(step)["state"]
    stored = getattr(stored, "tree", stored)["model"]
    found_abs, missing = {}, []
    for name, target in abstract_params.items():
        if name not in stored:
            missing.append(name)
            continue
        shape = tuple(stored[name].shape)
        if shape != tuple(target.shape):
            raise ValueError(
                f"init_from={path!r}: parameter {name} has shape {shape} in the checkpoint and "
                f"{tuple(target.shape)} in the model: the model config must match the checkpoint's"
            )
        found_abs[name] = target
    unexpected = sorted(set(stored) - set(abstract_params))
    target = {"model": found_abs}
    restored = mngr.restore(
        step,
        args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore(
                item=target,
                restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                partial_restore=True,
            )
        ),
    )
    mngr.close()
    logging.info("init_from %s step %d: %d params loaded", directory, step, len(found_abs))
    return restored["state"]["model"], sorted(missing), unexpected


def read_config(path: str) -> dict:
    """The config (as a dict) saved with a checkpoint directory's latest step (or a step dir)."""
    directory, step = _resolve(path)
    return json.loads((epath.Path(directory) / str(step) / "config" / "metadata").read_text())
