"""The stage table: what `config.stage` / `config.stages` name, and running them in order.

A stage is a function `(config, stage_dir, init_from) -> checkpoint_dir`: it trains (or
evaluates) in `stage_dir = {workdir}/{stage}`, starting from the checkpoint directory
`init_from` ("" = from scratch), and returns the directory the next stage starts from. Each
stage restores its own latest checkpoint when it has one, so re-running a multi-stage command
after a preemption skips finished stages (they find themselves at their last step) and resumes
the interrupted one exactly.

Every entry point lives in this package (coder/stages/*.py); the libraries below it (model,
data, train, infer, env, rl) never import it. A stage's row in `STAGES` says, as data:
  target     "module:function" of its entry point (imported when it runs);
  overrides  (stage key, run key) pairs: the stage's own section over the shared `train` /
             `data` keys (`sft.lr` -> `train.lr`); a zero or empty stage value keeps the shared one;
  derive     "module:function" `config -> config` for what overrides cannot say (longctx's
             YaRN factor, mtp's loss mix);
  check      "module:function" `config -> None` validating the stage's own keys;
  tools      `config -> executables` the stage needs on PATH (the sandbox's bwrap).
`validate` runs, before anything is built, every chosen stage's derive + check + the mesh and
batch checks on the config that stage will run with, and checks the tools.
"""
from __future__ import annotations

import copy
import dataclasses
import importlib
import json
import logging
import math
import os
import shutil
import time
from typing import Callable

import jax
from etils import epath

from coder import report
from coder.model import hf_import, sharding
from coder.model.hf_import import ARCH_KEYS
from coder.model.routing import balancing_warning

# The sandbox (coder/env/runtime/sandbox.py) runs commands with these; scripts/setup.sh installs them.
SANDBOX_TOOLS = {"bwrap": "bubblewrap", "setpriv": "util-linux", "prlimit": "util-linux"}


def _no_tools(config) -> tuple:
    del config
    return ()


@dataclasses.dataclass(frozen=True)
class Stage:
    target: str
    overrides: tuple = ()
    derive: str = ""
    check: str = ""
    tools: Callable = _no_tools


def _steps_lr(section: str) -> tuple:
    return ((f"{section}.steps", "train.steps"), (f"{section}.lr", "train.lr"))


STAGES = {
    "pretrain": Stage("coder.stages.lm:pretrain", check="coder.stages.lm:check_data"),
    "longctx": Stage("coder.stages.lm:longctx",
                     _steps_lr("longctx") + (("longctx.repo_weight", "data.repo_weight"),
                                             ("longctx.grad_accum", "train.grad_accum"),
                                             ("longctx.remat", "model.remat")),
                     derive="coder.stages.lm:longctx_config", check="coder.stages.lm:check_data"),
    "mtp": Stage("coder.stages.mtp:run", _steps_lr("mtp") + (("mtp.grad_accum", "train.grad_accum"),),
                 derive="coder.stages.mtp:mtp_config"),
    "sft": Stage("coder.stages.lm:sft",
                 _steps_lr("sft") + (("sft.seq_len", "data.seq_len"), ("sft.batch_size", "data.batch_size"),
                                     ("sft.grad_accum", "train.grad_accum"), ("sft.remat", "model.remat")),
                 check="coder.stages.lm:check_sft", tools=lambda c: () if c.sft.data else tuple(SANDBOX_TOOLS)),
    "grpo": Stage("coder.stages.grpo:run", _steps_lr("grpo") + (("grpo.ckpt_every", "train.ckpt_every"),
                                                                ("grpo.warmup_steps", "train.warmup_steps"),
                                                                ("grpo.min_lr_ratio", "train.min_lr_ratio"),
                                                                ("grpo.grad_accum", "train.grad_accum"),
                                                                ("grpo.remat", "model.remat"),
                                                                ("grpo.offload_optimizer", "train.offload_optimizer")),
                  derive="coder.stages.grpo:grpo_config", check="coder.stages.grpo:validate",
                  tools=lambda c: tuple(SANDBOX_TOOLS)),
    "eval": Stage("coder.stages.lm:evaluate", check="coder.stages.lm:check_eval",
                  tools=lambda c: tuple(SANDBOX_TOOLS) if int(c.eval.agent_tasks) > 0 else ()),
    "compile": Stage("coder.stages.compile:run"),
    "serve": Stage("coder.stages.serve:run", check="coder.stages.serve:check"),
    "realtime": Stage("coder.stages.realtime:run", (("realtime.lr", "train.lr"),),
                      derive="coder.stages.realtime:realtime_config", check="coder.stages.realtime:validate",
                      tools=lambda c: tuple(SANDBOX_TOOLS) if int(c.rl.eval_num_tasks) > 0 else ()),
}

# Stages that run beside a chain rather than in it (they serve, or learn from serving, the chain's
# newest checkpoint): `--config.stage=serve` runs one even when the config file sets `stages`.
SERVICES = ("serve", "realtime")

# Stages that continue a trained model: the first stage of a run may be one only with init_from.
NEEDS_CHECKPOINT = ("longctx", "mtp", "eval")

# Model keys a later stage takes from the checkpoint it starts from rather than from its own
# config: the architecture (coder.model.hf_import.ARCH_KEYS: every key that fixes a parameter's
# shape or what the trained model computes, the vocabulary included: the tokenizer travels with
# the checkpoint), so every later stage runs the model the way it was trained; the long-context
# stage changes max_position_embeddings and rope_scaling. num_mtp_layers, dtypes, remat and the
# layout stay the stage's own.
INHERITED_MODEL_KEYS = ARCH_KEYS


def stage_names(config) -> list[str]:
    """`config.stages` or `[config.stage]` (exactly one of them set, except that a SERVICES stage
    in `config.stage` runs alone whatever `config.stages` says); ValueError naming the key."""
    if config.stages and config.stage and config.stage not in SERVICES:
        raise ValueError(
            f"config.stage={config.stage!r} and config.stages={tuple(config.stages)} are both set: "
            "run one stage with --config.stage=NAME --config.stages=() or several with "
            "--config.stages=... alone"
        )
    if not config.stages and not config.stage:
        raise ValueError(f"set config.stage (one of {', '.join(STAGES)}) or config.stages")
    names = [config.stage] if config.stage else list(config.stages)
    key = "stage" if config.stage else "stages"
    for name in names:
        if name not in STAGES:
            raise ValueError(
                f"config.{key}: unknown stage {name!r}; the stages are {', '.join(STAGES)}"
            )
    return names


def _import(target: str, what: str):
    module_name, fn_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise ImportError(f"{what} needs {module_name}, which could not be imported ({e})") from e
    fn = getattr(module, fn_name, None)
    if fn is None:
        raise ImportError(f"{what}: {module_name} has no function {fn_name!r}")
    return fn


def resolve(name: str):
    """The function of stage `name` (imported now)."""
    return _import(STAGES[name].target, f"stage {name!r}")


def stage_config(name: str, config):
    """The config stage `name` runs with: its overrides over `train` / `data`, then its derive."""
    stage = STAGES[name]
    c = copy.deepcopy(config)
    for src, dst in stage.overrides:
        section, key = src.split(".")
        value = c[section][key]
        if value:  # 0 / "" = keep the shared value
            dsec, dkey = dst.split(".")
            c[dsec][dkey] = type(c[dsec][dkey])(value)
    if stage.derive:
        c = _import(stage.derive, f"stage {name!r}")(c)
    return c


def missing_tools(config, names=None) -> dict:
    """{executable: system package} the chosen stages need and PATH lacks."""
    names = stage_names(config) if names is None else names
    needed = {t for n in names for t in STAGES[n].tools(config)}
    return {t: SANDBOX_TOOLS.get(t, t) for t in sorted(needed) if shutil.which(t) is None}


def check_batch(config, n_devices: int, name: str):
    """ValueError naming the keys when a micro-batch (data.batch_size / train.grad_accum rows)
    does not divide over the batch mesh axes of `n_devices` devices. Not a style rule: XLA pads
    the rows of an uneven split and reshards them in every micro-batch (stage compile measured an
    all-gather of the token ids across the slices inside the loop)."""
    sizes = sharding.validate(config.model, config.mesh, n_devices)
    batch_shards = math.prod(sizes[a] for a in sharding.mesh_axes_of("batch", config.mesh.rules))
    accum = int(config.train.grad_accum)
    where = f"stage {name}: "
    if accum < 1:
        raise ValueError(f"{where}train.grad_accum={accum} must be >= 1")
    if config.data.batch_size % accum:
        raise ValueError(
            f"{where}data.batch_size={config.data.batch_size} is not a multiple of "
            f"train.grad_accum={accum}; change one of them"
        )
    if (config.data.batch_size // accum) % batch_shards:
        raise ValueError(
            f"{where}data.batch_size={config.data.batch_size} / train.grad_accum={accum} rows per "
            f"micro-batch do not divide over the {batch_shards} devices of the batch mesh axes "
            f"{sharding.mesh_axes_of('batch', config.mesh.rules)}; change data.batch_size "
            "(or the stage's own batch_size), train.grad_accum or mesh.data/mesh.fsdp"
        )


def validate(config, n_devices: int | None = None, *, check_tools: bool = True) -> list[str]:
    """Check the config before anything runs; ValueError naming the keys to change.

    Returns the stage names. For every chosen stage, on the config it will run with: its derive
    and check, the mesh against the model (coder.model.sharding.validate, routing included), the
    batch against the mesh's batch axes and grad_accum; a warning when a first stage trains the
    MoE routers from scratch with a balancing bias too slow for its steps
    (coder.model.routing.balancing_warning); then the executables the stages need (RuntimeError
    naming the package and the command that installs it).
    """
    names = stage_names(config)
    if names[0] in NEEDS_CHECKPOINT and not config.init_from:
        raise ValueError(f"stage {names[0]} starts from a trained model: set init_from=CHECKPOINT_DIR "
                         "or run it after a training stage in config.stages")
    if config.plan:  # compiled for the target slice's chips, run nowhere: no tools, no checkpoint read
        from coder.train.aot import hardware

        n_devices = hardware.parse_topology(config.compile.topology, int(config.mesh.num_slices)).num_chips
        check_tools = False
    n_devices = jax.device_count() if n_devices is None else n_devices
    chained = copy.deepcopy(config) if config.plan else inherit_model_config(config, config.init_from)
    for name in names:
        c = stage_config(name, chained)
        if STAGES[name].check:
            _import(STAGES[name].check, f"stage {name!r}")(c)
        # compile checks against its TPU topology's devices (stages/compile.py); services train no batches
        if name != "compile" and name not in SERVICES:
            check_batch(c, n_devices, name)
        if name == names[0] and name != "compile" and not config.init_from:
            msg = balancing_warning(c.model, int(c.train.steps))
            if msg:  # routers trained from scratch by a balancing bias too slow for the run
                logging.warning("stage %s: %s", name, msg)
        for key in INHERITED_MODEL_KEYS:  # what the next stage takes from this one's checkpoint
            chained.model[key] = copy.deepcopy(c.model[key])
    if check_tools:
        missing = missing_tools(config, names)
        if missing:
            packages = " ".join(sorted(set(missing.values())))
            raise RuntimeError(
                f"stages {', '.join(names)} need {', '.join(missing)} (the env sandbox), which are not "
                f"installed: run `bash scripts/setup.sh` (installs the system packages: {packages}), "
                f"or `sudo apt-get install {packages}`"
            )
    return names


def inherit_model_config(config, init_from: str):
    """Copy of `config` whose INHERITED_MODEL_KEYS come from the checkpoint `init_from`.

    A coder checkpoint: from the config it was written with. A Hugging Face checkpoint directory
    (coder.model.hf_import.is_hf_checkpoint): from its config.json, and model.vocab_size =
    max(its vocab_size, the ids of its tokenizer with the chat template's added tokens)
    (hf_import.tokenizer_of), so the embedding grows by the tokens added. Every key that differs
    from the stage's own config is logged.
    """
    from coder.train.checkpoint import read_config

    config = copy.deepcopy(config)
    if not init_from:
        return config
    if hf_import.is_hf_checkpoint(init_from):
        model = hf_import.config_from_hf(hf_import.read_hf_config(init_from)).to_dict()
        tok = hf_import.tokenizer_of(init_from, config.data)
        model["vocab_size"] = max(int(model["vocab_size"]), int(tok.padded_vocab_size))
        what = f"{init_from}/config.json"
    else:
        try:
            saved = read_config(init_from)
        except FileNotFoundError:
            return config  # no checkpoint there: the stage reports it
        model = saved.get("model", {})
        what = init_from
    for key in INHERITED_MODEL_KEYS:
        if key not in model:
            continue
        value = model[key]
        current = config.model[key]
        if hasattr(current, "to_dict"):
            if current.to_dict() != value:
                _report(f"model.{key} from {what}: {value} (the config has {current.to_dict()})")
                current.update(value)
        elif current != value:
            _report(f"model.{key} from {what}: {value} (the config has {current})")
            config.model[key] = type(current)(value)
    return config


_REPORTED: set = set()


def _report(message: str) -> None:
    """Log a model key taken from a checkpoint once per process (validate and run both ask)."""
    if message not in _REPORTED:
        _REPORTED.add(message)
        logging.info("%s", message)


# What a stage's summary row compares, start -> end: (label, metrics.jsonl key), in order; the
# agent eval's pass@1 (its reports in {stage_dir}/agent_eval) comes after them.
SUMMARY_MEASURES = (("loss", "loss"), ("held-out", "heldout_loss"), ("reward", "reward"),
                    ("accept", "heldout/accept"), ("far loss", "long/loss_far"),
                    ("retrieval gain", "long/retrieval_gain"))


def summarize(stage: str, stage_dir: str, seconds: float, checkpoint: str) -> dict:
    """What a stage improved, from its own records: each of SUMMARY_MEASURES it logged at its
    first and last record ({label: (start, end)}), and pass@1 of its first and last agent eval
    (`pass@1`: (start, end)); start is None when there was one record. Only process 0 reads them."""
    measures: dict[str, tuple] = {}
    steps = None
    if jax.process_index() == 0:
        path = epath.Path(stage_dir) / "metrics.jsonl"
        records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        for label, key in SUMMARY_MEASURES:
            seen = [r[key] for r in records if isinstance(r.get(key), (int, float))]
            if seen:
                measures[label] = (seen[0] if len(seen) > 1 else None, seen[-1])
        steps = max((r["step"] for r in records), default=None)
        # the held-out agent eval's pass@1, then (stage grpo, rl.eval_trained) its training tasks'
        for label, name in (("pass@1", "agent_eval"), ("trained pass@1", "agent_eval_trained")):
            evals = sorted((epath.Path(stage_dir) / name).glob("step_*.json"))
            if evals:
                first, last = (json.loads(p.read_text())["summary"]["pass@1"] for p in (evals[0], evals[-1]))
                measures[label] = (first if len(evals) > 1 else None, last)
    return {"stage": stage, "measures": measures, "steps": steps, "seconds": seconds, "checkpoint": checkpoint}


def _print_summary(rows: list[dict]):
    if jax.process_index() != 0:
        return
    print(f"\n{'stage':<10} {'start -> end':<56} {'steps':>5}  {'wall time':>9}  checkpoint", flush=True)
    for r in rows:
        what = ", ".join(f"{label} {b:.4g}" if a is None else f"{label} {a:.4g} -> {b:.4g}"
                         for label, (a, b) in r["measures"].items()) or "-"
        steps = "-" if r["steps"] is None else str(r["steps"])
        print(f"{r['stage']:<10} {what:<56} {steps:>5}  {r['seconds']:>8.1f}s  {r['checkpoint']}", flush=True)


def run_one(name: str, config, stage_dir: str, init_from: str = "") -> str:
    """Stage `name` alone on `config` (its overrides and derive applied); returns its checkpoint."""
    return resolve(name)(stage_config(name, config), stage_dir, init_from)


def run(config) -> str:
    """Run the configured stage(s) in order; returns the last checkpoint directory (a plan,
    config.plan, is coder.stages.plan.run's: main.py calls it instead)."""
    if config.plan:
        raise ValueError("config.plan=True compiles the chain, it does not run it: call coder.stages.plan.run")
    names = validate(config)
    init_from = config.init_from
    rows = []
    for name in names:
        fn = resolve(name)
        stage_dir = os.path.join(config.workdir, name)
        c = stage_config(name, inherit_model_config(config, init_from))
        logging.info("stage %s in %s (init_from=%r)", name, stage_dir, init_from)
        t0 = time.perf_counter()
        checkpoint = fn(c, stage_dir, init_from)
        rows.append(summarize(name, stage_dir, time.perf_counter() - t0, checkpoint or ""))
        _print_summary(rows[-1:])
        init_from = checkpoint or init_from
    if len(rows) > 1:
        _print_summary(rows)
    write_report(config.workdir, rows)
    return init_from


def write_report(workdir: str, rows: list[dict]) -> str | None:
    """The run report of `workdir` (coder.report: Markdown + figures in {workdir}/report/, with
    the summary `rows` as printed), its path printed as the summary's last line; process 0 only.

    Returns the path, or None: not written (another process; no stage logged metrics, e.g. a
    compile-only run; or rendering failed: a warning says why, the finished run stands).
    """
    if jax.process_index() != 0:
        return None

    try:
        path = report.write_report(workdir, rows=rows)
    except report.NoMetricsError as e:
        logging.info("no run report: %s", e)
        return None
    except Exception as e:  # noqa: BLE001 (the training is done; the report is not worth failing it)
        logging.warning("the run report was not written (%s: %s); `python -m coder.report %s` "
                        "renders it", type(e).__name__, e, workdir)
        return None
    print(f"report: {path}", flush=True)
    return path
