"""The stage table: what `config.stage` / `config.stages` name, and running them in order.

A stage is a function `(config, stage_dir, init_from) -> checkpoint_dir`: it trains (or
evaluates) in `stage_dir = {workdir}/{stage}`, starting from the checkpoint directory
`init_from` ("" = from scratch), and returns the directory the next stage starts from. Each
stage restores its own latest checkpoint when it has one, so re-running a multi-stage command
after a preemption skips finished stages (they find themselves at their last step) and resumes
the interrupted one exactly.

Stages are imported lazily by dotted path: a stage whose module is missing fails, with its name,
only when it is chosen.
"""
from __future__ import annotations

import copy
import importlib
import json
import logging
import math
import os
import time

import jax
from etils import epath

# name -> "module:function"
STAGES = {
    "pretrain": "coder.train.lm_stages:pretrain",
    "longctx": "coder.train.lm_stages:longctx",
    "mtp": "coder.train.mtp:run",
    "sft": "coder.train.lm_stages:sft",
    "grpo": "coder.rl.stage:run",
    "eval": "coder.train.lm_stages:evaluate",
    "compile": "coder.train.compile:run",
}

# Model keys a later stage takes from the checkpoint it starts from rather than from its own
# config: the long-context stage changes them, and every later stage must run the model the
# way it was trained.
INHERITED_MODEL_KEYS = ("max_position_embeddings", "rope_scaling")


def stage_names(config) -> list[str]:
    """`config.stages` if set, else `[config.stage]`; ValueError naming the key on an unknown name."""
    names = list(config.stages) if config.stages else [config.stage]
    key = "stages" if config.stages else "stage"
    for name in names:
        if name not in STAGES:
            raise ValueError(
                f"config.{key}: unknown stage {name!r}; the stages are {', '.join(STAGES)}"
            )
    return names


def resolve(name: str):
    """The function of stage `name` (imported now)."""
    target = STAGES[name]
    module_name, fn_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise ImportError(
            f"stage {name!r} needs {module_name}, which could not be imported ({e})"
        ) from e
    fn = getattr(module, fn_name, None)
    if fn is None:
        raise ImportError(f"stage {name!r}: {module_name} has no function {fn_name!r}")
    return fn


def validate(config, n_devices: int | None = None) -> list[str]:
    """Check the config before anything runs; ValueError naming the keys to change.

    Returns the stage names. Checks: stage names, the mesh against the model (coder.model.
    sharding.validate), the batch against the mesh's batch axes and grad_accum.
    """
    from coder.model import sharding

    names = stage_names(config)
    n_devices = jax.device_count() if n_devices is None else n_devices
    if "compile" in names and len(names) == 1:
        return names  # compiles for a target topology, not for the local devices
    sizes = sharding.validate(config.model, config.mesh, n_devices)
    batch_shards = math.prod(sizes[a] for a in sharding.mesh_axes_of("batch", config.mesh.rules))
    accum = int(config.train.grad_accum)
    if accum < 1:
        raise ValueError(f"train.grad_accum={accum} must be >= 1")
    if config.data.batch_size % accum:
        raise ValueError(
            f"data.batch_size={config.data.batch_size} is not a multiple of "
            f"train.grad_accum={accum}; change one of them"
        )
    if (config.data.batch_size // accum) % batch_shards:
        raise ValueError(
            f"data.batch_size={config.data.batch_size} / train.grad_accum={accum} rows per "
            f"micro-batch do not divide over the {batch_shards} devices of the batch mesh axes "
            f"{sharding.mesh_axes_of('batch', config.mesh.rules)}; change data.batch_size, "
            "train.grad_accum or mesh.data/mesh.fsdp"
        )
    return names


def inherit_model_config(config, init_from: str):
    """Copy of `config` whose INHERITED_MODEL_KEYS come from the checkpoint `init_from`."""
    from coder.train.checkpoint import read_config

    config = copy.deepcopy(config)
    if not init_from:
        return config
    try:
        saved = read_config(init_from)
    except FileNotFoundError:
        return config  # not a coder checkpoint (e.g. an HF import); the stage reports it
    model = saved.get("model", {})
    for key in INHERITED_MODEL_KEYS:
        if key not in model:
            continue
        value = model[key]
        current = config.model[key]
        if hasattr(current, "to_dict"):
            if current.to_dict() != value:
                logging.info("model.%s from %s: %s", key, init_from, value)
                current.update(value)
        elif current != value:
            logging.info("model.%s from %s: %s", key, init_from, value)
            config.model[key] = type(current)(value)
    return config


def summarize(stage: str, stage_dir: str, seconds: float, checkpoint: str) -> dict:
    """Loss at the start and the end of a stage, from its metrics.jsonl."""
    path = epath.Path(stage_dir) / "metrics.jsonl"
    first = last = None
    if jax.process_index() == 0 and path.exists():
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if "loss" in record:
                first = record if first is None else first
                last = record
    return {
        "stage": stage,
        "loss_start": None if first is None else first["loss"],
        "loss_end": None if last is None else last["loss"],
        "steps": None if last is None else last["step"],
        "seconds": seconds,
        "checkpoint": checkpoint,
    }


def _print_summary(rows: list[dict]):
    if jax.process_index() != 0:
        return
    print("\nstage      loss start -> end        steps   wall time  checkpoint", flush=True)
    for r in rows:
        loss = "-"
        if r["loss_start"] is not None:
            loss = f"{r['loss_start']:.4f} -> {r['loss_end']:.4f}"
        steps = "-" if r["steps"] is None else str(r["steps"])
        print(f"{r['stage']:<10} {loss:<24} {steps:>5}  {r['seconds']:>8.1f}s  {r['checkpoint']}",
              flush=True)


def run(config) -> str:
    """Run the configured stage(s) in order; returns the last checkpoint directory."""
    names = validate(config)
    init_from = config.init_from
    rows = []
    for name in names:
        fn = resolve(name)
        stage_dir = os.path.join(config.workdir, name)
        stage_config = inherit_model_config(config, init_from)
        logging.info("stage %s in %s (init_from=%r)", name, stage_dir, init_from)
        t0 = time.perf_counter()
        checkpoint = fn(stage_config, stage_dir, init_from)
        rows.append(summarize(name, stage_dir, time.perf_counter() - t0, checkpoint or ""))
        _print_summary(rows[-1:])
        init_from = checkpoint or init_from
    if len(rows) > 1:
        _print_summary(rows)
    return init_from
