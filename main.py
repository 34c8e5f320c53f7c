"""coder's single entry point.

    python main.py --config=configs/quickstart.py [--config.train.lr=1e-4 --config.stage=sft ...]

The config file's `get_config()` gives every key (configs/base.py is the schema); `--config.a.b=v`
overrides one key, checked against the schema: an unknown key or a value of the wrong type stops
here with the key named (ml_collections config_flags); an unknown stage or a model that does not
fit the mesh stops in coder.stages.validate before anything is built.

On a multi-host slice / cluster (detected from the environment the launchers set, see
`_multi_process`), `jax.distributed.initialize()` connects the processes first; every process
logs its index, only process 0 writes metrics.
"""
from __future__ import annotations

import os

from absl import app, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Python config file with get_config(); override keys with --config.a.b=v"
)


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


class _QuietLibraries:
    """Drop INFO lines of orbax / jax / grain internals (hundreds per checkpoint); keep warnings."""

    def filter(self, record) -> bool:
        if record.levelno >= 30:  # WARNING and above always pass
            return True
        if record.name.startswith(("jax", "orbax", "grain")):
            return False
        return not any(f"/{lib}/" in record.pathname for lib in ("orbax", "jax", "grain"))


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}; set keys with --config.a.b=v")
    config = _CONFIG.value
    if config is None:
        raise app.UsageError("--config=configs/NAME.py is required")

    logging.get_absl_handler().addFilter(_QuietLibraries())
    import jax

    if _multi_process():
        jax.distributed.initialize()
    logging.info(
        "process %d of %d, %d local / %d global devices (%s)",
        jax.process_index(), jax.process_count(), jax.local_device_count(), jax.device_count(),
        jax.devices()[0].platform,
    )
    from coder import stages

    stages.validate(config)
    stages.run(config)


if __name__ == "__main__":
    app.run(main)
