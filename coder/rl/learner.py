"""The training side of RL: the trainer with the GRPO loss and the frozen reference policy.

The learner's version is its optimizer step count (`Learner.version`): the version its weights
are handed to an engine (`set_weights(state, version)`) or published under
(coder.rl.weight_sync). `Learner.batch` turns each token's recorded policy version into its
staleness (learner version - policy version) and the loss drops the tokens more than
`grpo.max_staleness` behind (coder.rl.grpo.staleness_mask).

The reference policy is the weights the stage started from, kept (a second copy of the model on
the learner's devices) only when grpo.kl_coef > 0. A fresh stage copies the trainer's
initial weights and records, in `{stage_dir}/reference.json`, where they came from (init_from
pinned to the checkpoint step it resolved to) and a checksum of every variable; a resumed stage
rebuilds them from that source and checks every checksum, so a resumed run trains against the
same reference bit for bit or stops and says why.
"""
from __future__ import annotations

import json
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from flax import nnx
from jax.experimental import multihost_utils

from coder.rl import grpo, trajectory
from coder.train import checkpoint as ckpt_lib
from coder.train import flat as flat_lib
from coder.train.state import build_model, copy_model, load_into
from coder.train.trainer import Trainer

REFERENCE_RECORD = "reference.json"


def _mix(x):
    """uint32 avalanche (murmur3's finaliser)."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def _checksum(x) -> jax.Array:
    """uint32 checksum of an array's bits and positions: a wrapping sum of per-element hashes,
    so neither the sharding nor the reduction order changes it."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        bits = x.astype(jnp.uint32)
    else:
        width = x.dtype.itemsize
        uint = {1: jnp.uint8, 2: jnp.uint16}.get(width, jnp.uint32)
        bits = jax.lax.bitcast_convert_type(x, uint).astype(jnp.uint32)  # width 8: [..., 2]
    pos = jnp.uint32(1)
    for d in range(bits.ndim):
        iota = jax.lax.broadcasted_iota(jnp.uint32, bits.shape, d)
        pos = pos + iota * jnp.uint32(0x9E3779B1 + 2 * d)
    return jnp.sum(_mix(_mix(bits) ^ _mix(pos + jnp.uint32(0x27D4EB2F))), dtype=jnp.uint32)


def fingerprint(model: nnx.Module) -> dict[str, int]:
    """{flat variable name: uint32 checksum} of every variable of `model` (params, router bias)."""
    flat = flat_lib.state_to_flat(nnx.state(model))
    sums = jax.jit(lambda f: {k: _checksum(v) for k, v in f.items()})(flat)
    return {k: int(np.asarray(v.addressable_data(0))) for k, v in sums.items()}


class Learner:
    """The trainer with the GRPO loss and the frozen reference policy (the training side)."""

    def __init__(self, config, stage_dir, init_from, model_fn=None, tokenizer=None, data_iterator=None):
        self.config = config
        self.stage_dir = stage_dir
        acc = int(config.train.grad_accum)
        self.normalizer = grpo.loss_normalizer(config)
        loss_fn = grpo.loss_fn_from_config(config)
        self.shared_prefix_len = check_shared_prefix(config)  # at start-up, before any model is built
        # the tokenizer and the data position (stage grpo: the epoch's used tasks) travel in every
        # checkpoint; a resumed trainer hands the position back to `data_iterator`
        self.trainer = Trainer(config, stage_dir, loss_fn, init_from=init_from, model_fn=model_fn,
                               stage="grpo", tokenizer=tokenizer, data_iterator=data_iterator)
        # no KL term: no reference (at 1T parameters it is a second copy of the model on device)
        self.ref = self._reference(init_from, model_fn) if float(config.grpo.kl_coef) > 0 else None
        if self.ref is not None:
            temperature = float(config.rl.temperature)
            graphdef = nnx.graphdef(self.ref)

            def ref_logp(state, tokens, positions, segment_ids, prefix_segment):
                shared = {} if prefix_segment is None else dict(prefix_segment=prefix_segment, mtp=False)
                logits, _ = nnx.merge(graphdef, state)(tokens, positions, segment_ids, **shared)
                return grpo.target_logp(logits, tokens, segment_ids, temperature)[0]

            self._ref_logp = jax.jit(ref_logp)
            self._ref_state = nnx.state(self.ref)
        self.row_multiple = jax.local_device_count() * acc  # rows this process feeds per step
        # router replay runs the prompt's recorded routing once: share only tokens routed alike
        self._match_routing = bool(config.grpo.router_replay)

    @property
    def version(self) -> int:
        """The policy version of the learner's current weights: its optimizer step count."""
        return self.trainer.step

    def _reference(self, init_from, model_fn):
        """The frozen reference policy: the weights this stage started from (module docstring).

        Fresh stage: a copy of the trainer's initial weights, recorded in reference.json. Resumed
        stage: rebuilt from the recorded source (init_from's checkpoint step, or the seeded
        initialisation / `model_fn` when there is none), every variable (the router bias
        included), and checked against the recorded checksums.
        """
        record_path = epath.Path(self.stage_dir) / REFERENCE_RECORD
        if self.trainer.step == 0:
            ref = copy_model(self.trainer.model)
            source = init_from
            if init_from and not _is_hf(init_from):
                source = ckpt_lib.step_dir(init_from)  # pinned: init_from's latest step may move
            checksums = fingerprint(ref)  # a program over the global mesh: every process runs it
            if jax.process_index() == 0:
                record_path.parent.mkdir(parents=True, exist_ok=True)
                record_path.write_text(json.dumps({"init_from": source, "checksums": checksums}))
            return ref
        record = json.loads(record_path.read_text()) if record_path.exists() else None
        source = record["init_from"] if record is not None else init_from
        ref = build_model(self.config, self.trainer.mesh, model_fn=model_fn)
        if source:
            load_into(ref, source)  # every variable, the router bias included
        if record is None:
            logging.warning("[grpo] %s has no %s: the reference policy is rebuilt from %s unchecked",
                            self.stage_dir, REFERENCE_RECORD, source or "the seeded initialisation")
            return ref
        mine, saved = fingerprint(ref), record["checksums"]
        diff = sorted(k for k in set(mine) | set(saved) if mine.get(k) != saved.get(k))
        if diff:
            raise ValueError(
                f"[grpo] the reference policy rebuilt on resume from "
                f"{source or 'the seeded initialisation (model_fn)'} differs from the one this stage "
                f"started with in {len(diff)} variables, e.g. {diff[:4]}: that source changed since; "
                f"restore it, or restart the stage from scratch (delete {self.stage_dir})")
        return ref

    def batch(self, groups: list[list], version: int | None = None) -> dict:
        """The GRPO batch of the step's rollouts (rows padded to a power of two, multiple of
        devices x grad_accum, and the sequence to `seq_bucket` of the longest generation, so few
        shapes compile and short rollouts do not pay for rl.context_budget) with the reference
        logprobs.

        `staleness` `[R, T]` int32 = `version` (default: the learner's) minus each token's policy
        version (0 on tokens no policy sampled); the loss drops tokens more than
        grpo.max_staleness behind (coder.rl.grpo.staleness_mask).
        """
        version = self.version if version is None else int(version)
        rollouts = [r for g in groups for r in g]
        gens = [g for r in rollouts if not r.infra_error for g in r.generations]
        n, longest = len(gens), max((len(g) for g in gens), default=1)
        budget = int(self.config.rl.context_budget)
        seq_len, plan = seq_bucket(longest, budget), None
        if self.shared_prefix_len:
            # rows as long as the longest group's packed prompt + continuations (bucketed), at
            # most grpo.shared_prefix_len; first the plan at that length, to count the rows
            seq_len = seq_bucket(max(longest, self.shared_prefix_len), self.shared_prefix_len)
            packed = max((sum(hi - lo for _, lo, hi, _, _ in row) for row in
                          trajectory.shared_prefix_rows(groups, seq_len, self._match_routing)), default=1)
            seq_len = seq_bucket(max(longest, packed), self.shared_prefix_len)
            plan = trajectory.shared_prefix_rows(groups, seq_len, self._match_routing)
            n = len(plan)
        if jax.process_count() > 1:  # every process feeds the same shape: the largest
            n, seq_len = (int(x) for x in np.max(multihost_utils.process_allgather(
                np.array([n, seq_len], np.int32)), axis=0))
            if plan is not None:  # a longer row may hold this process's chunks in fewer rows
                plan = trajectory.shared_prefix_rows(groups, seq_len, self._match_routing)
        rows = max(self.row_multiple, 1 << max(0, math.ceil(math.log2(max(n, 1)))))
        rows = -(-rows // self.row_multiple) * self.row_multiple
        if plan is None:
            b = trajectory.to_batch(rollouts, seq_len, rows)
        else:
            b = trajectory.to_shared_batch(plan, seq_len, rows)
        if self.ref is not None:  # reference logprobs of the global batch (each process's rows on its devices)
            keys = ("tokens", "positions", "segment_ids") + (() if plan is None else ("prefix_segment",))
            inputs = self.trainer.device_batch({k: b[k] for k in keys})
            b["ref_logp"] = self._ref_logp(self._ref_state, inputs["tokens"], inputs["positions"],
                                           inputs["segment_ids"], inputs.get("prefix_segment"))
        # expert_ids stay in the batch with or without replay (-1 = not routed; the loss clamps
        # them for `routing=`): the loss measures the learner's routing against them
        pv = b.pop("policy_version")
        b["staleness"] = np.where(pv >= 0, version - pv, 0).astype(np.int32)
        return b

def check_shared_prefix(config) -> int:
    """grpo.shared_prefix_len (0 = off: one generation per row), refused where the packed rows
    cannot compute what unshared rows would: the NSA backend (its compressed / selected /
    window branches have no prefix mask), the MTP refresh (its shifted targets cross from a
    prompt into continuations) and rows shorter than rl.context_budget."""
    n = int(config.grpo.get("shared_prefix_len", 0))
    if not n:
        return 0
    budget = int(config.rl.context_budget)
    if n < budget:
        raise ValueError(f"grpo.shared_prefix_len={n} must be >= rl.context_budget={budget} (a packed row "
                         "holds a whole generation), or 0 (off)")
    if config.model.attention_backend != "dense":
        raise ValueError(f"grpo.shared_prefix_len={n} needs model.attention_backend='dense' (it is "
                         f"{config.model.attention_backend!r}: no shared-prefix mask); set it to 0")
    if int(config.model.num_mtp_layers) and float(config.grpo.mtp_weight):
        raise ValueError(f"grpo.shared_prefix_len={n} with grpo.mtp_weight={config.grpo.mtp_weight}: the MTP "
                         "refresh has no shared-prefix mask; set grpo.mtp_weight=0 or "
                         "grpo.shared_prefix_len=0")
    return n


def seq_bucket(longest: int, budget: int, smallest: int = 128) -> int:
    """The batch's sequence length for generations of at most `longest` tokens: the next power
    of two from `smallest` up, capped at `budget` (rl.context_budget, what a generation can hold).
    The loss does not depend on it (padding carries no loss; the normaliser is a constant)."""
    if longest > budget:
        raise ValueError(f"a generation of {longest} tokens exceeds rl.context_budget={budget}")
    return min(budget, max(smallest, 1 << max(0, math.ceil(math.log2(max(longest, 1))))))


def _is_hf(path: str) -> bool:
    from coder.model import hf_import

    return hf_import.is_hf_checkpoint(path)
