"""The policy's own trunk as a text encoder: the default encoder of the `semantic_search` tool.

A coder checkpoint's model embeds a text as the mean over its tokens of the final-norm hidden
state, L2-normalised (`PolicyEncoder`): no extra weights to ship. `semantic_spec(env_cfg,
checkpoint)` turns `config.env`'s semantic-search keys into the spec the tool's workers build
from (coder.env.tools.semantic_search.SemanticSpec).

The encoder is the stage's *starting* checkpoint, frozen on purpose: hidden states move with
every update, and an index mixing vectors of different steps would compare incomparable things;
frozen, one index per repository snapshot serves the whole run. It runs where the tool runs (an
env worker, on its CPU: `jax_platforms` is set to cpu there when nothing has initialised a
backend yet, so it never takes the trainer's accelerator), which suits a model a host's memory
holds. A policy a CPU worker cannot hold (the 1T configs) needs an installed encoder
(`env.semantic_encoder = "package.module:factory"`) or an embedding service behind one.
Measured against BM25: coder/env/tools/semantic_search.py's table.
"""
from __future__ import annotations

import hashlib
import os
import threading

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from coder.env.tools.semantic_search import SemanticSpec
from coder.model import sharding
from coder.model.config import default_rules
from coder.model.transformer import count_params
from coder.train import checkpoint as ckpt_lib
from coder.train.state import load_model

POLICY = f"{__name__}:PolicyEncoder"


def semantic_spec(env_cfg, checkpoint: str = "") -> SemanticSpec | None:
    """The spec of `config.env` (None when env.semantic_encoder is empty: the tool says it is
    off). "policy" embeds with `checkpoint` (the stage's starting policy) unless
    env.semantic_checkpoint names another; anything else is an installed encoder's factory."""
    name = str(env_cfg.semantic_encoder)
    if not name:
        return None
    cache = str(env_cfg.semantic_cache_dir)
    if name == "policy":
        ckpt = str(env_cfg.semantic_checkpoint) or checkpoint
        if not ckpt:
            raise ValueError("env.semantic_encoder='policy' needs a checkpoint: set env.semantic_checkpoint "
                             "or start the stage from one (init_from)")
        check_policy_checkpoint(ckpt)
        options = (("checkpoint", ckpt), ("max_tokens", int(env_cfg.semantic_max_tokens)))
        return SemanticSpec(POLICY, options, cache)
    if ":" not in name:
        raise ValueError(f"env.semantic_encoder={name!r}: 'policy' or an installed encoder's "
                         "'package.module:factory'")
    return SemanticSpec(name, (), cache)


# An env worker holds its own copy of the encoder and several share a host: the policy encoder is
# refused when one float32 copy would take more than this share of the host's memory.
MAX_HOST_SHARE = 1 / 8


def check_policy_checkpoint(path: str) -> None:
    """ValueError, before any worker starts, when `path` holds no coder checkpoint (e.g. a Hugging
    Face directory) or its model is too large to embed with in env workers (MAX_HOST_SHARE)."""

    try:
        saved = ckpt_lib.read_config(ckpt_lib.step_dir(path))
    except FileNotFoundError as e:
        raise ValueError(f"env.semantic_encoder='policy' embeds with a coder checkpoint's trunk; {path} holds "
                         f"none ({e}): set env.semantic_checkpoint to one, or env.semantic_encoder to an "
                         "installed encoder's 'package.module:factory'") from None
    weights = 4 * count_params(ml_collections.ConfigDict(saved["model"]))["total"]
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if weights > MAX_HOST_SHARE * host:
        raise ValueError(f"env.semantic_encoder='policy': {path}'s model is {weights / 2**30:.1f} GiB of float32 "
                         f"weights, more than {MAX_HOST_SHARE:.0%} of this host's {host / 2**30:.0f} GiB, and "
                         "every env worker would load its own copy: use an installed encoder "
                         "(env.semantic_encoder = 'package.module:factory'), or leave semantic_search out of rl.tools")


class PolicyEncoder:
    """Mean-pooled final-norm hidden states of a coder checkpoint's trunk, L2-normalised.

    `encode(texts)` -> `[n, hidden_size]` float32. Texts are cut to `max_tokens` tokens and padded
    to a power of two (at most log2(max_tokens) programs are compiled)."""

    def __init__(self, checkpoint: str, max_tokens: int = 256, batch: int = 32):
        try:  # an env worker that never touched JAX: keep it off the trainer's accelerator
            from jax._src import xla_bridge

            if not xla_bridge.backends_are_initialized():
                jax.config.update("jax_platforms", "cpu")
        except (ImportError, AttributeError):
            pass
        step_dir = ckpt_lib.step_dir(checkpoint)
        config = ml_collections.ConfigDict(ckpt_lib.read_config(step_dir))
        # one CPU device: the run's mesh and its rules (lists once saved as JSON) do not apply
        config.mesh.update(data=1, fsdp=1, expert=1, tensor=1, sequence=1, num_slices=1)
        config.mesh.rules = default_rules()
        device = jax.devices("cpu")[0]
        with jax.default_device(device):
            self.model = load_model(config, step_dir, sharding.make_mesh(config.mesh, [device]))
        self.tokenizer = ckpt_lib.stage_tokenizer(config, init_from=step_dir)
        self.device, self.max_tokens, self.batch = device, int(max_tokens), int(batch)
        self.name = "policy-" + hashlib.sha256(
            f"{os.path.realpath(step_dir)}|{max_tokens}".encode()).hexdigest()[:16]
        graphdef, state = nnx.split(self.model)

        @jax.jit
        def pooled(state, tokens, valid):
            model = nnx.merge(graphdef, state)
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
            _, aux = model(tokens, positions, valid.astype(jnp.int32), mtp=False)
            h = model.norm(aux["hidden"]).astype(jnp.float32)  # [B, T, D]
            w = valid[..., None].astype(jnp.float32)
            v = (h * w).sum(1) / jnp.maximum(w.sum(1), 1.0)  # [B, D]
            return v / jnp.maximum(jnp.linalg.norm(v, axis=-1, keepdims=True), 1e-9)

        self._state, self._pooled, self._lock = state, pooled, threading.Lock()

    def encode(self, texts: list[str]) -> np.ndarray:
        ids = [self.tokenizer.encode(t, allow_special=False)[: self.max_tokens] or [0] for t in texts]
        out = []
        with self._lock, jax.default_device(self.device):  # one forward at a time per process
            for b in range(0, len(ids), self.batch):
                rows = ids[b:b + self.batch]
                width = 1 << (max(len(r) for r in rows) - 1).bit_length()  # next power of two
                tokens = np.zeros((self.batch, width), np.int32)
                valid = np.zeros((self.batch, width), bool)
                for i, r in enumerate(rows):
                    tokens[i, :len(r)], valid[i, :len(r)] = r, True
                out.append(np.asarray(self._pooled(self._state, tokens, valid))[:len(rows)])
        return np.concatenate(out) if out else np.zeros((0, 0), np.float32)
