"""Stage `serve`: the OpenAI-compatible server over the engine (coder/serve/server.py, docs/serve.md).

    python main.py --config=configs/quickstart.py --config.stage=serve

serves `POST /v1/chat/completions`, `POST /v1/feedback`, `GET /v1/models` and `GET /health` on
`serve.host:serve.port` until SIGINT / SIGTERM.

The model: `init_from` (a coder checkpoint or a Hugging Face directory), else the newest
checkpoint of the config's own chain in `workdir` (`config.stages`, from the last stage back;
the quickstart's grpo checkpoint after `python main.py --config=configs/quickstart.py`), else a
freshly initialised model (with a warning: its replies are noise). Its tokenizer is the one
stored with it (coder.train.checkpoint.stage_tokenizer). The engine holds `serve.max_slots`
sequences of `serve.max_len` tokens on this process's devices (coder.rl.actor.engine_mesh), in
`serve.dtype`; with `serve.speculative_k` = k > 0 each decode step drafts k tokens with the
model's MTP modules and verifies them in one forward (coder/infer/speculative.py: the replies are
distributed exactly as plain decoding's; `check` refuses k > model.num_mtp_layers, and
`check_drafts` a checkpoint without the MTP modules k needs). Every completion and every
feedback goes to the trajectory log at `serve.log_store` (default
`{workdir}/serve/trajectories`); with `serve.weight_store` set the server follows the weight
store the realtime stage publishes to.

On several processes (one job: `jax.distributed`, e.g. a TPU slice of several hosts) the
engine spans every process's devices (coder/infer/engine.py): process 0 serves HTTP and leads,
the others follow its engine calls until it stops; the weight store reaches every process (each
reads its own slices). Each process still loads the starting checkpoint whole before placing
its shards: a model larger than one host's memory starts from the weight store instead.
"""
from __future__ import annotations

import logging
import os
import signal

import jax
from flax import nnx

from coder.env import transcripts
from coder.infer import speculative
from coder.infer.engine import Engine
from coder.rl.actor import engine_mesh, engine_rules
from coder.serve.trajectory_log import TrajectoryLog
from coder.stages import inherit_model_config
from coder.train import checkpoint as ckpt_lib
from coder.train.state import build_model, load_into


def check(config) -> None:
    """Stops at start-up on serve keys that cannot work, naming them."""
    s = config.serve
    if not 0 <= int(s.port) <= 65535:
        raise ValueError(f"serve.port={s.port} is not a port number")
    max_len = served_len(config)
    if max_len > int(config.model.max_position_embeddings) or max_len < 2:
        raise ValueError(f"serve.max_len={s.max_len}: must be in [2, model.max_position_embeddings="
                         f"{config.model.max_position_embeddings}] (0 = model.max_position_embeddings)")
    for key in ("max_slots", "decode_steps", "max_tokens"):
        if int(s[key]) < 1:
            raise ValueError(f"serve.{key}={s[key]} must be >= 1")
    if not -1 <= int(s.prefix_cache_slots) < int(s.max_slots):
        raise ValueError(f"serve.prefix_cache_slots={s.prefix_cache_slots} must be in [-1, serve.max_slots="
                         f"{s.max_slots}) (-1 = a quarter of serve.max_slots, 0 = no prefix cache)")
    for key in ("flush_seconds", "retention_days"):
        if float(s[key]) < 0:
            raise ValueError(f"serve.{key}={s[key]} must be >= 0")
    if float(s.poll_seconds) <= 0:
        raise ValueError(f"serve.poll_seconds={s.poll_seconds} must be > 0")
    speculative.check_draft_depth("serve.speculative_k", s.speculative_k, config.model.num_mtp_layers)


def check_drafts(config, loaded: dict, path: str) -> None:
    """Stops at start-up when serve.speculative_k would draft with MTP modules the checkpoint did
    not hold (a Hugging Face checkpoint saves none: they start fresh, and untrained drafts are
    exact but almost never accepted, so every step would cost a verify forward for nothing).
    `loaded` is coder.train.state.load_into's report."""
    k = int(config.serve.speculative_k)
    fresh = sorted(int(d) for d in loaded.get("fresh_mtp", ()) if int(d) < k)
    if fresh:
        raise ValueError(f"serve.speculative_k={k} drafts with MTP modules 0..{k - 1}, but {path} holds no "
                         f"weights for module(s) {fresh} (they would start untrained): distil them first "
                         f"(stage mtp with init_from={path}) and serve that checkpoint, or set "
                         "serve.speculative_k=0")


def served_len(config) -> int:
    return int(config.serve.max_len) or int(config.model.max_position_embeddings)


def log_store(config) -> str | None:
    """The trajectory log's URL (None: logging off)."""
    url = config.serve.log_store
    if url == "none":
        return None
    return url or os.path.join(config.workdir, "serve", "trajectories")


def served_checkpoint(config, init_from: str) -> str:
    """`init_from`, else the newest checkpoint of the config's chain in workdir, else ""."""
    if init_from:
        return init_from
    for name in reversed(tuple(config.stages)):
        directory = os.path.join(config.workdir, name, "checkpoints")
        try:
            ckpt_lib.checkpoint_step(directory)
        except FileNotFoundError:
            continue
        return directory
    return ""


def build_engine(config, init_from: str = ""):
    """(engine, model, tokenizer, checkpoint path) of the config: the engine on this process's
    devices, or on every process's when the job has several (process 0 leads)."""

    check(config)
    path = served_checkpoint(config, init_from)
    if path != init_from:
        config = inherit_model_config(config, path)
        logging.info("[serve] serving %s (the newest checkpoint of workdir's stages)", path)
    tok = ckpt_lib.stage_tokenizer(config, path, agent_text=transcripts.tokenizer_agent_text)
    if path:
        model = build_model(config)
        check_drafts(config, load_into(model, path, require_all=True), path)
    else:
        logging.warning("[serve] no init_from and no checkpoint of stages %s in %s: serving a freshly "
                        "initialised model", tuple(config.stages), config.workdir)
        model = build_model(config)
    s = config.serve
    devices = jax.devices() if jax.process_count() > 1 else None
    engine = Engine(model, config.model, max_len=served_len(config), max_slots=int(s.max_slots),
                    decode_steps=int(s.decode_steps), speculative_k=int(s.speculative_k), dtype=s.dtype or None,
                    mesh=engine_mesh(config, devices), rules=engine_rules(config),
                    prefix_cache_slots=prefix_cache_slots(config))
    return engine, model, tok, path


def prefix_cache_slots(config) -> int:
    """serve.prefix_cache_slots, -1 resolved to a quarter of serve.max_slots."""
    n = int(config.serve.prefix_cache_slots)
    return int(config.serve.max_slots) // 4 if n < 0 else n


def build(config, init_from: str = ""):
    """The Server of the config (stage docstring), following the weight store when one is set
    (the leader's part on several processes: see `run`)."""
    engine, model, tok, path = build_engine(config, init_from)
    return serve_engine(config, engine, model, tok, path)


def serve_engine(config, engine, model, tok, path: str):
    """The Server over a built engine (leader only)."""
    from coder.serve.server import Server  # optional: fastapi of the serve extra

    s = config.serve
    url = log_store(config)
    log = None if url is None else TrajectoryLog(url, flush_seconds=float(s.flush_seconds),
                                                  retention_days=float(s.retention_days))
    server = Server(engine, tok, model_name=s.model_name, log=log, max_tokens=int(s.max_tokens),
                    system_prompt=s.system_prompt, seed=int(config.seed), workers=max(64, 2 * int(s.max_slots)))
    if s.weight_store:
        server.follow(s.weight_store, nnx.state(model), float(s.poll_seconds))
    logging.info("[serve] model %r (%s), %d slots x %d tokens, speculative_k %d, log %s, weight store %s",
                 s.model_name, path or "fresh", int(s.max_slots), served_len(config), int(s.speculative_k),
                 url or "off", s.weight_store or "none")
    return server


def run(config, stage_dir: str, init_from: str) -> str:
    """Serves until SIGINT / SIGTERM; returns the checkpoint it served (for a following stage)."""
    import uvicorn  # optional: the serve extra

    del stage_dir  # the server writes only its trajectory log (serve.log_store)
    engine, model, tok, path = build_engine(config, init_from)
    if not engine.is_leader:  # process 0 serves; this one runs its engine calls until it stops
        logging.info("[serve] following the engine of process 0")
        engine.follow()
        return served_checkpoint(config, init_from)
    server = serve_engine(config, engine, model, tok, path)
    # uvicorn shuts down gracefully on SIGTERM, then re-raises the signal to the handler it found:
    # the default one would kill the process before the trajectory log is flushed and the
    # followers are stopped. A no-op handler lets `run` return and the cleanup below run.
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        uvicorn.Server(uvicorn.Config(server.app, host=config.serve.host, port=int(config.serve.port),
                                      log_level="info", timeout_graceful_shutdown=30)).run()
    finally:
        signal.signal(signal.SIGTERM, previous)
        server.close()
        server.engine.close()
    return served_checkpoint(config, init_from)
