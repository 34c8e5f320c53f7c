"""coder's single entry point.

    python main.py --config=configs/quickstart.py [--config.train.lr=1e-4 --config.stage=sft ...]

The config file's `get_config()` gives every key (configs/base.py is the schema, locked: a config
file or an override cannot add a key); `--config.a.b=v` overrides one key, checked against the
schema: an unknown key or a value of the wrong type stops here with the key named
(ml_collections config_flags; `_parse_flags` prints it as one line with the config file's line or
the override). Before jax starts, `check_tools` stops the run with one paragraph (no traceback)
when a chosen stage needs a program that is not installed (the sandbox's bwrap, setpriv, prlimit:
`bash scripts/setup.sh` installs them) or names an unknown stage; then coder.stages.validate
checks every chosen stage's config (a model / batch that does not fit the mesh, ...) the same way.

On a multi-host slice / cluster (detected from the environment the launchers set, see
`_multi_process`), `jax.distributed.initialize()` connects the processes first; every process
logs its index, only process 0 writes metrics.

The console: coder's own lines (coder logs through the root logger), one progress line per logged
step and a summary per stage. Libraries' INFO lines are silenced at their loggers (`QUIET_LOGGERS`:
orbax and grain log through absl's "absl" logger, jax through "jax.*", tensorboardX through its
own); their warnings still show.
`--logger_levels=absl:INFO,jax:INFO` brings their INFO lines back.

A run that seems stuck: `kill -USR1 <pid>` prints every thread's Python stack to its stderr and
the run goes on (faulthandler; the processes of a multi-process RL actor do the same).
"""
from __future__ import annotations

import faulthandler
import logging
import os
import re
import signal
import sys
import traceback

from absl import app, flags
from ml_collections import config_flags

from configs import base

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Python config file with get_config(); override keys with --config.a.b=v"
)

# Logger -> level for third-party libraries (absl's --logger_levels flag; a value given on the
# command line replaces this default). coder itself logs through the root logger at INFO.
QUIET_LOGGERS = {"absl": "WARNING", "jax": "WARNING", "orbax": "WARNING", "grain": "WARNING",
                 "tensorboardX": "WARNING"}
flags.FLAGS.set_default("logger_levels", ",".join(f"{k}:{v}" for k, v in QUIET_LOGGERS.items()))


def _multi_process() -> bool:
    """True when this process is one of several of one job (so jax.distributed must connect them).

    Cloud TPU VMs list their hosts in TPU_WORKER_HOSTNAMES (multi-host slices have several);
    multislice (GKE JobSet / launch/) sets MEGASCALE_COORDINATOR_ADDRESS; SLURM sets
    SLURM_NTASKS; Open MPI sets OMPI_COMM_WORLD_SIZE; an explicit JAX_COORDINATOR_ADDRESS always
    counts. jax.distributed.initialize() reads the same variables to find the coordinator.
    """
    env = os.environ
    if env.get("JAX_COORDINATOR_ADDRESS") or env.get("MEGASCALE_COORDINATOR_ADDRESS"):
        return True
    if len([h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]) > 1:
        return True
    for var in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        if int(env.get(var, "1") or 1) > 1:
            return True
    return False


def _fail(message: str):
    """Exit with `error: message` on stderr and code 1 (no traceback: the message says what to do)."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(1)


def _config_error(e: BaseException, argv: list[str]) -> str | None:
    """One line for an error ml_collections raised while reading the config, else None.

    A locked config refusing a key, a value of the wrong type, an override of an unknown key:
    the message names the key; this adds where it was set (the config file's line, or the
    `--config.` argument).
    """
    frames = traceback.extract_tb(e.__traceback__)
    if not frames or f"{os.sep}ml_collections{os.sep}" not in frames[-1].filename:
        return None  # not the config's own error (a bug in a config file keeps its traceback)
    inner = e
    while inner.args and isinstance(inner.args[0], BaseException):
        inner = inner.args[0]  # ConfigDict wraps its KeyError in an AttributeError
    message = inner.args[0] if inner.args and isinstance(inner.args[0], str) else str(inner)
    # Where: the last frame outside the libraries (a config file's get_config), else the overrides.
    site = os.path.dirname(os.path.dirname(os.__file__))
    ours = [f for f in frames if not f.filename.startswith(site) and "-packages" not in f.filename
            and os.path.abspath(f.filename) != os.path.abspath(__file__)]
    if ours:
        where = f"{ours[-1].filename}:{ours[-1].lineno} `{ours[-1].line}`"
    else:
        first, _, rest = message.partition("\n")
        key = first.strip("'\" ")
        overrides = [a for a in argv if a.startswith("--config.") and key and key in a]
        where = " ".join(overrides) or "--config.* overrides"
        if first.strip("'\"") == key:  # ConfigDict's KeyError says only the key
            message = f"unknown key {key!r} (configs/base.py defines every key) {rest}".strip()
    plain = where.replace("['", ".").replace("']", "").replace('["', ".").replace('"]', "")
    moved = [new for old, new in base.MOVED.items() if re.search(rf"\b{re.escape(old)}\b", plain)]
    if moved and isinstance(inner, (AttributeError, KeyError)):
        message += f"; it is {moved[0]} now"
    return f"{where}: {' '.join(message.split())}"


def _parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing; a config error (unknown key, wrong type) exits with one line."""
    try:
        return app.parse_flags_with_usage(argv)
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        message = _config_error(e, argv)
        if message is None:
            raise
        _fail(message)


def check_tools(config) -> None:
    """The programs the chosen stages need (coder.stages.missing_tools), before any device is touched.

    Runs before jax.distributed / the backend start, so a machine without bubblewrap fails in a
    second instead of minutes into the SFT stage.
    """
    from coder import stages

    try:
        names = stages.stage_names(config)
    except ValueError as e:
        _fail(str(e))
    missing = {} if config.plan else stages.missing_tools(config, names)  # a plan runs no sandbox
    if not missing:
        return
    needing = [n for n in names if set(stages.STAGES[n].tools(config)) & set(missing)]
    packages = " ".join(sorted(set(missing.values())))
    _fail(
        f"stage{'s' if len(needing) > 1 else ''} {', '.join(needing)} need{'' if len(needing) > 1 else 's'} "
        f"{', '.join(missing)} (the env sandbox), not found on PATH: run `bash scripts/setup.sh` "
        f"(installs the system packages {packages}; sudo when not root), or "
        f"`sudo apt-get install {packages}`; or leave these stages out with "
        f"--config.stages=... (e.g. --config.stages=\"('pretrain',)\")"
    )


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}; set keys with --config.a.b=v")
    config = _CONFIG.value
    if config is None:
        raise app.UsageError("--config=configs/NAME.py is required")

    # absl resets its own logger's level from --verbosity after parsing the flags: apply the
    # logger levels (QUIET_LOGGERS, or the command line's --logger_levels) now.
    for name, level in flags.FLAGS.logger_levels.items():
        logging.getLogger(name).setLevel(level)
    check_tools(config)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the stacks of a run that seems stuck
    import jax

    if _multi_process():
        jax.distributed.initialize()
    logging.info(
        "process %d of %d, %d local / %d global devices (%s)",
        jax.process_index(), jax.process_count(), jax.local_device_count(), jax.device_count(),
        jax.devices()[0].platform,
    )
    from coder import stages

    try:
        stages.validate(config)
    except (ValueError, RuntimeError) as e:  # config errors: the message names the key to change
        _fail(str(e))
    from coder.data.sft import SftDataError

    try:
        if config.plan:  # compile every program of the chain for its TPU layout (coder/stages/plan.py)
            from coder.stages import plan

            plan.run(config)
        else:
            stages.run(config)
    except SftDataError as e:  # SFT data that can never make a batch: the key to change
        _fail(str(e))


if __name__ == "__main__":
    app.run(main, flags_parser=_parse_flags)
