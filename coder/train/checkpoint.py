"""Orbax checkpoints: one directory per stage, one step subfolder per save.

Layout of `{stage_dir}/checkpoints/{step}/` (one orbax item per subfolder):
  state/      arrays (one orbax PyTree): {"model": {name: array}, "opt_state": {name: array}}
              with flat string names ("layers.0.attn.wq"). "model" holds every variable of the
              model (trained or not, e.g. the router bias), whatever the stage trained, so a
              checkpoint is readable without the code that wrote it and variables are matched
              by name when a later stage adds modules (fresh MTP heads).
  meta/       JSON (`metadata`): step, RNG key data, counters (skipped steps), stage.
  config/     JSON (`metadata`): the full config of the run that wrote it.
  tokenizer/  JSON (`metadata`): the tokenizer the model's ids mean, as
              coder.data.tokenizer.to_record writes it: {"kind", "files": {name: base64},
              "sha256", "source"}. Later stages and resumes take it from here
              (`stage_tokenizer` below), never from the running interpreter's stdlib.
  data/       `process_{i}-of-{n}.json`: the data iterator's `get_state()` of each process i
              of the n that wrote it, each written by its own process (ProcessJsonHandler) and
              restored by the process of the same index.

Saves are asynchronous (orbax copies device arrays to host before `save` returns, then writes in
the background), keep the last K, and are restored with the shardings of an abstract target, so
a checkpoint written on one mesh restores onto another. A checkpoint whose arrays do not match
the model (another model config or optimizer) is a ValueError naming the variables and the
directory, before orbax reads anything.

Every item has its handler registered with the manager (no "could not be restored" warnings),
and other runs' checkpoints (`init_from`) are read through the item handlers directly, without a
read-only CheckpointManager (which warns on construction and synchronises hosts).

`stage_tokenizer(config, init_from, stage_dir)` is the one function stages call for their
tokenizer: the checkpoint's (resumed or `init_from`), else `data.tokenizer`, else one trained
once on process 0 and shared.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import re
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

ITEMS = ("state", "meta", "config", "tokenizer", "data")


# --- the per-process data item --------------------------------------------------------------
def _process_file(index: int, count: int) -> str:
    return f"process_{index}-of-{count}.json"


class ProcessJsonHandler(ocp.CheckpointHandler):
    """One JSON file per process: every process writes its own state and reads its own back.

    orbax's JsonCheckpointHandler writes on the primary host only, so a multi-host job would keep
    process 0's data position and every host would restore it. Here process i of n writes
    `process_{i}-of-{n}.json` (as grain's own orbax handler does). `restore` returns None when
    this process has no file (the checkpoint was written by another number of processes).
    """

    def save(self, directory: epath.Path, args: "ProcessJsonSave"):
        name = _process_file(jax.process_index(), jax.process_count())
        (epath.Path(directory) / name).write_text(json.dumps(args.item))

    def restore(self, directory: epath.Path, args: "ProcessJsonRestore | None" = None):
        del args
        directory = epath.Path(directory)
        path = directory / _process_file(jax.process_index(), jax.process_count())
        if path.exists():
            return json.loads(path.read_text())
        legacy = directory / "metadata"  # checkpoints written before per-process data states
        if jax.process_count() == 1 and legacy.exists():
            return json.loads(legacy.read_text())
        return None

    def metadata(self, directory: epath.Path):
        del directory
        return None

    def finalize(self, directory: epath.Path):
        del directory

    def close(self):
        pass


@ocp.args.register_with_handler(ProcessJsonHandler, for_save=True)
@dataclasses.dataclass
class ProcessJsonSave(ocp.args.CheckpointArgs):
    item: Any


@ocp.args.register_with_handler(ProcessJsonHandler, for_restore=True)
@dataclasses.dataclass
class ProcessJsonRestore(ocp.args.CheckpointArgs):
    pass


# Replica-parallel saving splits a replicated array's write between its replicas, each slice cut
# by an eager XLA slice compiled once per process and shape. Below this many bytes per slice one
# replica writes the whole array: a split saves nothing there, and its compiles were ~7% of a
# small GRPO stage process's CPU (py-spy; every array of a data-parallel model is replicated).
MIN_REPLICA_SLICE_BYTES = 1 << 20


def _array_types() -> ocp.type_handlers.TypeHandlerRegistry:
    """orbax's standard type handlers, with jax.Array's split between replicas only when each
    replica's slice is at least MIN_REPLICA_SLICE_BYTES."""
    th = ocp.type_handlers
    default = th.get_type_handler(jax.Array)
    arrays = th.ArrayHandler(min_slice_bytes_for_replica_parallel=MIN_REPLICA_SLICE_BYTES,
                             array_metadata_store=default._array_metadata_store)
    return th.create_type_handler_registry(
        *[(ty, arrays if ty is jax.Array else th.get_type_handler(ty)) for ty in th.supported_types()])


def _registry() -> ocp.handlers.DefaultCheckpointHandlerRegistry:
    """A handler for every item of the layout, for saving and restoring."""
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    kinds = {"state": (functools.partial(ocp.PyTreeCheckpointHandler, type_handler_registry=_array_types()),
                       ocp.args.PyTreeSave, ocp.args.PyTreeRestore),
             "data": (ProcessJsonHandler, ProcessJsonSave, ProcessJsonRestore)}
    for item in ITEMS:
        handler_cls, save, restore = kinds.get(
            item, (ocp.JsonCheckpointHandler, ocp.args.JsonSave, ocp.args.JsonRestore))
        handler = handler_cls()
        registry.add(item, save, handler)
        registry.add(item, restore, handler)
    return registry


# --- shape checks ---------------------------------------------------------------------------
def _stored_shapes(tree_metadata) -> dict:
    """{"model": {name: shape}, "opt_state": {name: shape}} of a `state` item's metadata."""
    tree = getattr(tree_metadata, "tree", tree_metadata)
    return {part: {k: tuple(v.shape) for k, v in tree.get(part, {}).items()} for part in tree}


def mismatches(stored: dict, target: dict) -> list[str]:
    """Differences between stored shapes and an abstract target, both {part: {name: shape}}:
    one line per variable with another shape, missing from the checkpoint or not in the target."""
    out = []
    for part, names in target.items():
        have = stored.get(part, {})
        for name, x in names.items():
            shape = tuple(getattr(x, "shape", x))
            if name not in have:
                out.append(f"{part} {name}: not in the checkpoint (the model has shape {shape})")
            elif have[name] != shape:
                out.append(f"{part} {name}: shape {have[name]} in the checkpoint, {shape} in the model")
        for name in sorted(set(have) - set(names)):
            out.append(f"{part} {name}: in the checkpoint (shape {have[name]}), not in the model")
    return out


def absolute(path: str) -> str:
    """A local path made absolute (orbax's tensorstore reads and writes refuse relative ones), a
    URL (gs://...) as it is."""
    return path if "://" in path else os.path.abspath(path)


class Checkpointer:
    """CheckpointManager over `directory` keeping `keep` checkpoints."""

    def __init__(self, directory: str, *, keep: int, async_save: bool = True):
        self.directory = absolute(directory)
        self._mngr = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, enable_async_checkpointing=async_save, create=True
            ),
            handler_registry=_registry(),
        )

    def latest_step(self) -> int | None:
        return self._mngr.latest_step()

    def save(self, step: int, *, arrays: dict, meta: dict, data_state, config: dict,
             tokenizer: dict | None = None, force=False):
        """Start an async save of step. arrays = {"model", "opt_state"} flat dicts; data_state:
        this process's data-iterator state (every process saves its own); tokenizer: the JSON
        record of coder.data.tokenizer.to_record."""
        args = dict(
            state=ocp.args.PyTreeSave(arrays),
            meta=ocp.args.JsonSave(meta),
            config=ocp.args.JsonSave(config),
        )
        if tokenizer is not None:
            args["tokenizer"] = ocp.args.JsonSave(tokenizer)
        if data_state is not None:
            args["data"] = ProcessJsonSave(data_state)
        return self._mngr.save(step, args=ocp.args.Composite(**args), force=force)

    def items(self, step: int) -> set[str]:
        """The items step `step` holds."""
        d = epath.Path(self.directory) / str(step)
        return {item for item in ITEMS if (d / item).exists()}

    def restore(self, step: int, abstract_arrays: dict, *, data: bool = True) -> "Restored":
        """Restore `step` onto the shardings of the target `abstract_arrays` ({"model": {name:
        ShapeDtypeStruct}, "opt_state": {...}}), plus its JSON items and, with `data`, this
        process's data-iterator state. A checkpoint whose arrays differ from the target in names
        or shapes raises ValueError naming them (it was written by another model config)."""
        items = self.items(step)
        stored = _stored_shapes(self._mngr.item_metadata(step)["state"])
        diff = mismatches(stored, abstract_arrays)
        if diff:
            raise ValueError(self._mismatch_message(step, diff))
        args = dict(
            state=ocp.args.PyTreeRestore(
                item=abstract_arrays,
                restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_arrays),
            ),
            meta=ocp.args.JsonRestore(),
        )
        if "tokenizer" in items:
            args["tokenizer"] = ocp.args.JsonRestore()
        if data and "data" in items:
            args["data"] = ProcessJsonRestore()
        try:
            out = self._mngr.restore(step, args=ocp.args.Composite(**args))
        except ValueError as e:  # a mismatch the metadata check did not see (dtype, layout)
            raise ValueError(self._mismatch_message(step, [str(e).splitlines()[0]])) from e
        data_state = out.get("data") if "data" in args else None
        if data and "data" in items and data_state is None:
            logging.warning(
                "%s/%d holds no data-iterator state for process %d of %d (written by another "
                "number of processes): this process's data starts from its beginning",
                self.directory, step, jax.process_index(), jax.process_count())
        return Restored(out["state"], out["meta"], data_state, out.get("tokenizer"))

    def _mismatch_message(self, step: int, diff: list[str]) -> str:
        model = [d for d in diff if d.startswith("model ")]
        shown = model or diff  # the optimizer state mirrors the model's differences
        more = len(shown) - 8
        shown = "\n  ".join(shown[:8]) + (f"\n  ... and {more} more" if more > 0 else "")
        if model and len(diff) > len(model):
            shown += f"\n  (and {len(diff) - len(model)} optimizer-state entries)"
        return (
            f"the checkpoint {self.directory}/{step} does not match the model being trained: it was "
            f"written by a different model config (or optimizer):\n  {shown}\n"
            f"Delete {self.directory} to start this stage afresh, or restore the model config "
            "(and train.optimizer) it was written with."
        )

    def wait(self):
        self._mngr.wait_until_finished()

    def close(self):
        self._mngr.wait_until_finished()
        self._mngr.close()


@dataclasses.dataclass
class Restored:
    """What `Checkpointer.restore` read: arrays {"model", "opt_state"}, meta, this process's
    data-iterator state (or None) and the tokenizer record (or None)."""

    arrays: dict
    meta: dict
    data_state: Any = None
    tokenizer: dict | None = None


# --- other runs' checkpoints (init_from) ----------------------------------------------------
def _resolve(path: str) -> tuple[str, int]:
    """A manager directory (latest step) or one step's directory -> (manager dir, step).

    Local paths (relative ones made absolute: `absolute`) and URLs orbax understands (gs://...)
    both work (etils.epath). Only finalized steps count (orbax's own
    listing), and nothing is written or synchronised.
    """
    p = epath.Path(absolute(path))
    if re.fullmatch(r"\d+", p.name) and (p / "state").exists():
        return os.fspath(p.parent), int(p.name)
    if not p.exists():
        raise FileNotFoundError(f"init_from={path!r}: no such checkpoint directory")
    steps = ocp.path.step.checkpoint_steps(p)
    if not steps:
        raise FileNotFoundError(f"init_from={path!r}: the directory holds no checkpoint")
    return os.fspath(p), max(steps)


def step_dir(path: str) -> str:
    """The step directory of a checkpoint directory's latest save (or of a step directory)."""
    directory, step = _resolve(path)
    return os.fspath(epath.Path(directory) / str(step))


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
    item_dir = epath.Path(directory) / str(step) / "state"
    handler = ocp.PyTreeCheckpointHandler()
    try:
        stored = _stored_shapes(handler.metadata(item_dir)).get("model", {})
        found_abs, missing = {}, []
        for name, target in abstract_params.items():
            if name not in stored:
                missing.append(name)
                continue
            if stored[name] != tuple(target.shape):
                raise ValueError(
                    f"init_from={path!r}: parameter {name} has shape {stored[name]} in the checkpoint "
                    f"and {tuple(target.shape)} in the model: the model config must match the "
                    "checkpoint's"
                )
            found_abs[name] = target
        unexpected = sorted(set(stored) - set(abstract_params))
        target = {"model": found_abs}
        restored = handler.restore(item_dir, args=ocp.args.PyTreeRestore(
            item=target,
            restore_args=ocp.checkpoint_utils.construct_restore_args(target),
            partial_restore=True,
        ))
    finally:
        handler.close()
    logging.debug("%s step %d: %d variables restored", directory, step, len(found_abs))
    return restored["model"], sorted(missing), unexpected


def read_item(path: str, item: str) -> dict | None:
    """A JSON item ("config", "meta", "tokenizer") of a checkpoint directory's latest step (or
    of a step directory); None when that step has no such item."""
    directory, step = _resolve(path)
    f = epath.Path(directory) / str(step) / item / "metadata"
    return json.loads(f.read_text()) if f.exists() else None


def read_config(path: str) -> dict:
    """The config (as a dict) saved with a checkpoint directory's latest step (or a step dir)."""
    config = read_item(path, "config")
    if config is None:
        raise FileNotFoundError(f"{path}: the checkpoint holds no config")
    return config


# --- the tokenizer of a stage -----------------------------------------------------------------
def _checkpoint_tokenizer(path: str):
    """(the tokenizer stored in the checkpoint directory `path`, its step directory), or (None,
    "") when `path` holds no checkpoint or its checkpoint holds no tokenizer."""
    try:
        sdir = step_dir(path)
    except FileNotFoundError:
        return None, ""
    from coder.data import tokenizer as tokenizer_lib

    record = read_item(sdir, "tokenizer")
    if record is None:
        logging.warning("%s holds no tokenizer (written before checkpoints carried one)", sdir)
        return None, ""
    return tokenizer_lib.from_record(record, sdir), sdir


def stage_tokenizer(config, init_from: str = "", stage_dir: str = "", *,
                    cache_dir: str | None = None, agent_text=None):
    """The tokenizer of a stage running in `stage_dir` from the checkpoint `init_from`.

    In order: the tokenizer of this stage's own latest checkpoint (`{stage_dir}/checkpoints`,
    a resume), else of `init_from`'s, else, when `init_from` is a Hugging Face checkpoint, the
    tokenizer beside it (or at `data.tokenizer`) with the chat template's tokens
    (`data.chat_tokens`; coder.model.hf_import.tokenizer_of), else (a run from scratch)
    `data.tokenizer`, else one trained by `load_or_train` on process 0 and broadcast to the
    others (coder.data.tokenizer.load_or_train_shared; `cache_dir`: its cache; `agent_text`: the
    agent's format for data.tokenizer_agent_text, coder.env.transcripts.tokenizer_agent_text). A checkpoint
    written before checkpoints carried a tokenizer is skipped with a warning. When the tokenizer
    comes from a coder checkpoint and `data.tokenizer` is set to a different one, ValueError
    naming both. The model's vocabulary must hold the tokenizer's ids (ValueError naming the keys).
    """
    from coder.data import tokenizer as tokenizer_lib
    from coder.model import hf_import

    tok, where = None, ""
    for path in (os.path.join(stage_dir, "checkpoints") if stage_dir else "", init_from):
        if path:
            tok, where = _checkpoint_tokenizer(path)
            if tok is not None:
                break
    explicit = config.data.tokenizer
    if tok is None and hf_import.is_hf_checkpoint(init_from):
        tok = hf_import.tokenizer_of(init_from, config.data)
        logging.info("tokenizer of the Hugging Face checkpoint %s (%s, sha256 %s)", init_from,
                     tok.source, tokenizer_lib.fingerprint(tok)[:16])
    elif tok is not None:
        sha = tokenizer_lib.fingerprint(tok)
        logging.info("tokenizer of %s (sha256 %s, %s)", where, sha[:16], tok.source)
        if explicit:
            given = tokenizer_lib.fingerprint(tokenizer_lib.load_config(config, explicit))
            if given != sha:
                raise ValueError(
                    f"data.tokenizer={explicit!r} (sha256 {given[:16]}) differs from the tokenizer "
                    f"stored in the checkpoint {where} (sha256 {sha[:16]}, {tok.source}): the model "
                    "was trained on the checkpoint's ids. Set data.tokenizer='' to use the "
                    f"checkpoint's tokenizer, or start from a checkpoint trained with {explicit}"
                )
    elif explicit:
        tok = tokenizer_lib.load_config(config, explicit)
    else:
        tok = tokenizer_lib.load_or_train_shared(config, cache_dir, agent_text=agent_text)
    if tok.padded_vocab_size > config.model.vocab_size:
        raise ValueError(
            f"the tokenizer ({tok.source}) has {tok.padded_vocab_size} ids (padded) but "
            f"model.vocab_size={config.model.vocab_size}; set model.vocab_size >= "
            f"{tok.padded_vocab_size} or data.tokenizer_vocab_size lower (a stage starting from a "
            "Hugging Face checkpoint sets it from config.json and the tokenizer's added tokens)"
        )
    return tok
