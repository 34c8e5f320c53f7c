"""The training side of RL: the trainer with the GRPO loss and the frozen reference policy."""
from __future__ import annotations

import math

import jax
import numpy as np
from flax import nnx

from coder.rl import grpo
from coder.rl import rollout as rollout_lib
from coder.train.trainer import Trainer
from coder.train.state import build_model, copy_model, load_into


class Learner:
    """The trainer with the GRPO loss and the frozen reference policy (the training side)."""

    def __init__(self, config, stage_dir, init_from, model_fn=None, tokenizer=None):
        self.config = config
        g, acc = config.grpo, int(config.train.grad_accum)
        tokens_per_group = int(g.tokens_per_group) or int(config.rl.group_size) * int(config.rl.max_rollout_tokens)
        # Constant normalizer: tokens per group budget x groups per step. The trainer averages
        # micro-batch losses, so each micro-batch divides by 1/accum of it (sum / normalizer).
        self.normalizer = tokens_per_group * int(config.rl.tasks_per_step) / acc
        loss_fn = grpo.grpo_loss_fn(clip_low=float(g.clip_low), clip_high=float(g.clip_high),
                                    kl_coef=float(g.kl_coef), normalizer=self.normalizer,
                                    temperature=float(config.rl.temperature),
                                    router_replay=bool(g.router_replay))
        self.trainer = Trainer(config, stage_dir, loss_fn, init_from=init_from, model_fn=model_fn,
                               stage="grpo", tokenizer=tokenizer)  # saved in its checkpoints
        self.ref = self._reference(init_from, model_fn)
        temperature = float(config.rl.temperature)
        graphdef = nnx.graphdef(self.ref)

        def ref_logp(state, tokens, positions, segment_ids):
            logits, _ = nnx.merge(graphdef, state)(tokens, positions, segment_ids)
            return grpo.target_logp(logits, tokens, segment_ids, temperature)[0]

        self._ref_logp = jax.jit(ref_logp)
        self._ref_state = nnx.state(self.ref)
        self.row_multiple = jax.device_count() * acc

    def _reference(self, init_from, model_fn):
        """The frozen reference policy: the weights this stage started from.

        Fresh stage: a copy of the trainer's initial weights. Resumed stage: the same weights
        rebuilt (init_from's checkpoint, or the seeded initialisation when there is none).
        """
        if self.trainer.step == 0:
            return copy_model(self.trainer.model)
        m = build_model(self.config, self.trainer.mesh, model_fn=model_fn)
        if init_from:  # every variable, the router bias included
            load_into(m, init_from)
        return m

    def batch(self, groups: list[list]) -> dict:
        """The GRPO batch of the step's rollouts (rows padded to a power of two, multiple of
        devices x grad_accum, so few shapes compile) with the reference logprobs."""
        rollouts = [r for g in groups for r in g]
        n = sum(len(r.generations) for r in rollouts if not r.infra_error)
        rows = max(self.row_multiple, 1 << max(0, math.ceil(math.log2(max(n, 1)))))
        rows = -(-rows // self.row_multiple) * self.row_multiple
        b = rollout_lib.to_batch(rollouts, int(self.config.rl.context_budget), rows)
        b["ref_logp"] = np.asarray(self._ref_logp(self._ref_state, b["tokens"], b["positions"], b["segment_ids"]))
        if "expert_ids" in b:
            b["expert_ids"] = np.maximum(b["expert_ids"], 0)  # unrouted tokens predict nothing
            if not self.config.grpo.router_replay:
                del b["expert_ids"]
        b.pop("policy_version")
        return b

    def update(self, groups: list[list]) -> dict:
        return self.trainer.train_step(self.batch(groups))
