"""Router replay end to end through stage grpo: bf16 serving weights, f32 learner weights.

The engine (rl.engine_dtype = "bfloat16") and the learner (model.dtype = "float32") compute
the router scores of a token with different roundings, so where two experts' scores are close
they choose different top-k sets. Without replay the learner then runs other experts than the
ones that produced the sample, and its logprob of the sampled token is no longer the engine's;
with grpo.router_replay the engine's recorded ids of every token (prompt, tool output and
sampled tokens, `ContextWindow.set_routing` / `to_batch`) are the learner's `routing=`, so the two
differ by bf16 rounding alone.

What the stage logs and this test reads (coder.rl.grpo.grpo_loss_fn, from the training
forward, i.e. the first on-policy forward of each batch, before the update):
  routing_mismatch             routed (token, MoE layer) pairs whose top-k set the learner's
                               own router (aux["router_ids"]) would choose differently
  unrouted_tokens              tokens that predict a next token but carry no engine ids
  behaviour_logp_abs_diff(_max) mean / max |learner logp - engine logp| over the loss tokens

The model: tiny (hidden 64, 2 MoE layers of 8 experts, top-2), random weights with the experts'
down projections scaled up (EXPERT_SCALE) so the routed experts dominate the residual stream
and one flipped choice moves the logits by far more than bf16 rounding does (at init the
experts' share is small and a flip changes a logprob by about as little as the rounding).
Both runs sample the same rollouts (sync mode, same seed and weights, 1 step), so their gaps
are measured on the same tokens.
"""
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from coder.env import protocol
from coder.model import Transformer
from coder.model.moe import moe_layers
from coder.rl import grpo
from coder.stages import grpo as grpo_stage
from tests import rl_toy as rl_test

EXPERT_SCALE = 8.0
ROUTER_SPREAD = 0.01
BF16_TOL = 0.02  # |logp gap| of bf16 rounding alone (measured: mean 4e-4, max 2e-3 on this model)


def test_routing_diagnostics_by_hand():
    """One MoE layer, top-2, a row of 4 tokens (the last predicts nothing) and a padding row:
    a set in another order is no mismatch, one other expert is; a token without engine ids
    counts as unrouted only when it predicts a next token."""
    engine = np.full((1, 2, 4, 2), -1, np.int32)
    engine[0, 0, :3] = [[0, 1], [2, 3], [4, 5]]  # token 3 (the row's last) was never routed
    own = np.zeros((1, 2, 4, 2), np.int32)
    own[0, 0, :3] = [[1, 0], [2, 7], [4, 5]]  # same set, one expert differs, same
    seg = np.array([[1, 1, 1, 1], [0, 0, 0, 0]], np.int32)
    d = grpo.routing_diagnostics(jnp.asarray(engine), jnp.asarray(own), jnp.asarray(seg))
    assert float(d["routing_mismatch"]) == pytest.approx(1 / 3) and float(d["unrouted_tokens"]) == 0
    engine[0, 0, 1] = -1  # token 1 predicts token 2: replay would feed it expert 0
    d = grpo.routing_diagnostics(jnp.asarray(engine), jnp.asarray(own), jnp.asarray(seg))
    assert float(d["routing_mismatch"]) == 0 and float(d["unrouted_tokens"]) == 1


def _run(tmp_path, tok, stage_len, replay: bool) -> dict:
    cfg = rl_test.tiny_config(tok, stage_len)
    cfg.model.update(dict(n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=0, dtype="float32"))
    cfg.rl.update(dict(group_size=4, tasks_per_step=2, engine_dtype="bfloat16", max_turns=1,
                       max_turn_tokens=24, max_rollout_tokens=24))
    cfg.grpo.update(dict(router_replay=replay))
    cfg.train.steps = 1

    def model_fn():
        m = Transformer(cfg.model, rngs=nnx.Rngs(1))
        for moe in moe_layers(m):
            w = moe.router[...]  # [D, E]: one shared direction + small per-expert differences
            moe.router[...] = w[:, :1] + ROUTER_SPREAD * w
            moe.wd[...] = moe.wd[...] * EXPERT_SCALE
        return m

    stage_dir = tmp_path / f"replay_{replay}"
    tasks = [t for t, _ in rl_test.make_tasks(2, seed=0)]
    grpo_stage.train(cfg, str(stage_dir), "", tokenizer=tok, tasks=tasks, model_fn=model_fn,
                     make_episode=lambda task: rl_test.SubmitEpisode(rl_test.LUCKY))
    with open(os.path.join(stage_dir, "metrics.jsonl")) as f:
        (m,) = [json.loads(line) for line in f]
    return m


@pytest.mark.slow
def test_router_replay_makes_the_learner_reproduce_the_bf16_engine(tmp_path):
    tok = rl_test.tokenizer()
    head = len(tok.turn_ids("system", protocol.render_system_prompt([rl_test.SUBMIT], rl_test.PREAMBLE))) + 24
    stage_len = -(-(head + 40) // 16) * 16
    on, off = _run(tmp_path, tok, stage_len, True), _run(tmp_path, tok, stage_len, False)
    keys = ("routing_mismatch", "unrouted_tokens", "behaviour_logp_abs_diff", "behaviour_logp_abs_diff_max",
            "policy_tokens")
    print("replay", {k: on[k] for k in keys}, "no replay", {k: off[k] for k in keys})
    assert on["policy_tokens"] == off["policy_tokens"] > 0  # the same rollouts in both runs
    # every token that predicts one carries the engine's ids: prompt, tool output, sampled
    assert on["unrouted_tokens"] == 0 and off["unrouted_tokens"] == 0
    # bf16 serving weights choose other experts than the f32 learner for some tokens
    assert off["routing_mismatch"] > 0 and on["routing_mismatch"] > 0
    # with replay only bf16 rounding separates the logprobs ...
    assert on["behaviour_logp_abs_diff_max"] < BF16_TOL, on
    # ... without it the flipped choices move them by more
    assert off["behaviour_logp_abs_diff_max"] > 2 * on["behaviour_logp_abs_diff_max"], (on, off)
    assert off["behaviour_logp_abs_diff"] > on["behaviour_logp_abs_diff"], (on, off)
