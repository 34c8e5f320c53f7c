"""Shared-prefix packing (grpo.shared_prefix_len): a group's prompt computed once, its rollouts'
continuations after it (coder.rl.trajectory.shared_prefix_rows / to_shared_batch), equal to the
unshared batch (one generation per row, `to_batch`) in per-token logprobs, GRPO loss, metrics
and gradients on a tiny MoE model (a dense layer, two scanned MoE layers, remat, router replay).

The rollouts are hand-made: a group of three whose first windows share a 9-token prompt, one
of them a chain with a second window (a self-summary's own prompt: not shared), an infra-failed
rollout (left out), a group whose prompts differ in their first token (nothing shared), and a
group whose recorded routing of the prompt differs from its 5th token (with router replay
only those 4 tokens are shared).
"""
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coder.rl import grpo, trajectory
from coder.rl.trajectory import ContextWindow, Rollout

L_MOE, TOP_K, EXPERTS, VOCAB = 2, 2, 4, 256


def _config():
    from configs import quickstart

    c = quickstart.get_config()
    c.model.update(dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                        num_attention_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                        v_head_dim=8, max_position_embeddings=128, num_hidden_layers=1 + L_MOE,
                        first_k_dense_replace=1, n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K,
                        scan_layers=True, remat="full"))
    c.model.rope_scaling.original_max_position_embeddings = 128
    c.rl.update(dict(context_budget=64, summary_reserve=8, max_rollout_tokens=16))
    return c


def _window(rng, prompt, pieces, routing=None):
    """A context window: `prompt` ids, then `pieces` alternating sampled (policy) and observed
    token counts; every token routed (random experts, `routing` overriding the prompt's)."""
    w = ContextWindow()
    w.add_context(prompt)
    for i, n in enumerate(pieces):
        ids = rng.integers(1, VOCAB, n)
        if i % 2 == 0:
            gen = types.SimpleNamespace(tokens=ids, logprobs=rng.normal(-2.0, 0.5, n).astype(np.float32),
                                        policy_version=3)
            w.add_sampled(gen)
        else:
            w.add_context(ids)
    experts = rng.integers(0, EXPERTS, (len(w), L_MOE, TOP_K))
    experts[..., 1] = (experts[..., 0] + 1) % EXPERTS  # distinct top-k ids
    if routing is not None:
        experts[:len(prompt)] = routing
    w.set_routing(experts)
    return w


def _groups():
    rng = np.random.default_rng(0)
    prompt = list(rng.integers(1, VOCAB, 9))
    routing = rng.integers(0, EXPERTS, (9, L_MOE, TOP_K))
    routing[..., 1] = (routing[..., 0] + 1) % EXPERTS
    r = lambda adv, *w, **kw: Rollout(task_id="t", generations=list(w), advantage=adv, **kw)
    g1 = [r(0.7, _window(rng, prompt, [5, 3, 4], routing)),
          r(-1.2, _window(rng, prompt, [7], routing), _window(rng, prompt[:4] + [7, 8], [6])),  # a chain
          r(0.5, _window(rng, prompt, [3, 2, 2], routing)),
          r(0.0, _window(rng, prompt, [4], routing), infra_error="sandbox")]
    other = list(rng.integers(1, VOCAB, 6))
    g2 = [r(0.3, _window(rng, other, [4])), r(-0.3, _window(rng, [other[0] + 1] + other[1:], [5]))]
    routing2 = routing.copy()
    routing2[4:, 0, 0] = (routing[4:, 0, 0] + 2) % EXPERTS  # the engine routed token 5 on differently
    routing2[4:, 0, 1] = (routing2[4:, 0, 0] + 1) % EXPERTS
    g3 = [r(0.9, _window(rng, prompt, [6], routing)), r(-0.9, _window(rng, prompt, [5, 2, 3], routing2))]
    return [g1, g2, g3]


def test_shared_prefix_len_stops_at_policy_tokens_other_ids_and_other_routing():
    g1, g2, g3 = _groups()
    firsts = lambda g: [r.generations[0] for r in g if not r.infra_error]
    assert trajectory.shared_prefix_len(firsts(g1)) == 9
    assert trajectory.shared_prefix_len(firsts(g2)) == 0
    assert trajectory.shared_prefix_len(firsts(g3)) == 9  # routing not compared without replay
    assert trajectory.shared_prefix_len(firsts(g3), match_routing=True) == 4
    # two windows that sampled the same first token share only the prompt (a sampled token has a
    # loss, a behaviour logprob and a version of its own)
    a, b = ContextWindow(), ContextWindow()
    for w in (a, b):
        w.add_context([5, 6])
        w.add_sampled(types.SimpleNamespace(tokens=[9, 9], logprobs=[-1.0, -2.0], policy_version=0))
    assert trajectory.shared_prefix_len([a, b]) == 2
    assert trajectory.shared_prefix_len([a]) == 0


def test_shared_rows_layout_and_split_over_rows():
    """The prompt once, each continuation from the last shared token on, positions going on
    from the prompt's; a group too long for one row repeats its prompt in the next."""
    g1 = _groups()[0]
    plan = trajectory.shared_prefix_rows([g1], seq_len=64)
    b = trajectory.to_shared_batch(plan, 64)
    row = [i for i, p in enumerate(plan) if any(role == "prompt" for *_, role in p)]
    assert len(row) == 1
    i = row[0]
    # prompt tokens [0, 8) once, then continuations starting at token 8 (the last shared one)
    lens = [len(r.generations[0]) - 8 for r in g1[:3]]
    seg, pre, pos = b["segment_ids"][i], b["prefix_segment"][i], b["positions"][i]
    p_seg = seg[0]
    assert (seg[:8] == p_seg).all() and (pre[:8] == 0).all() and list(pos[:8]) == list(range(8))
    at = 8
    for n, r in zip(lens, g1[:3]):
        assert (pre[at:at + n] == p_seg).all() and len(set(seg[at:at + n])) == 1
        assert list(pos[at:at + n]) == list(range(8, 8 + n))
        assert list(b["tokens"][i, at:at + n]) == r.generations[0].tokens[8:]
        assert (b["advantages"][i, at:at + n] == np.float32(r.advantage)).all()
        at += n
    assert b["loss_mask"].sum() == sum(r.policy_tokens for r in g1[:3])
    # rows of 8 + 14 tokens: one continuation per row, the prompt repeated in each
    short = trajectory.shared_prefix_rows([g1], seq_len=max(len(r.generations[0]) for r in g1[:3]))
    prompts = [sum(role == "prompt" for *_, role in p) for p in short]
    assert sum(prompts) == 3
    with pytest.raises(ValueError, match="exceeds seq_len"):
        trajectory.shared_prefix_rows([g1], seq_len=10)


def _positions_of(batch_rows):
    """{(id(window), token index): (row, col)} of a batch laid out by `batch_rows` pieces."""
    where = {}
    for i, pieces in enumerate(batch_rows):
        at = 0
        for g, lo, hi, *_ in pieces:
            for j in range(lo, hi):
                where[(id(g), j)] = (i, at + j - lo)
            at += hi - lo
    return where


@pytest.mark.slow
def test_shared_prefix_learner_equals_unshared():
    """With router replay (the harder case: the prompt's recorded routing must be shared too);
    without it the learner routes each token itself, the same in both layouts."""
    replay = True
    from flax import nnx

    from coder.model import Transformer

    c = _config()
    model, ref = Transformer(c.model, nnx.Rngs(0)), Transformer(c.model, nnx.Rngs(1))
    groups = _groups()
    rollouts = [r for g in groups for r in g]
    unshared = trajectory.to_batch(rollouts, 64)
    plan = trajectory.shared_prefix_rows(groups, 64, match_routing=replay)
    shared = trajectory.to_shared_batch(plan, 64)
    assert shared["tokens"].shape[0] < unshared["tokens"].shape[0]
    assert (shared["segment_ids"] > 0).sum() < (unshared["segment_ids"] > 0).sum()  # the prompts once

    ref_def, ref_state = nnx.split(ref)

    @jax.jit
    def ref_logp(state, tokens, positions, segment_ids, prefix_segment):
        logits, _ = nnx.merge(ref_def, state)(tokens, positions, segment_ids, mtp=False,
                                              prefix_segment=prefix_segment)
        return grpo.target_logp(logits, tokens, segment_ids, 0.9)[0]

    def finish(b):
        b = {k: jnp.asarray(v) for k, v in b.items() if k != "policy_version"}
        b["ref_logp"] = ref_logp(ref_state, b["tokens"], b["positions"], b["segment_ids"],
                                 b.get("prefix_segment"))
        return b

    bu, bs = finish(unshared), finish(shared)
    kw = dict(clip_low=0.2, clip_high=0.28, kl_coef=0.1, normalizer=40.0, temperature=0.9,
              router_replay=replay, tis_cap=2.0)
    loss_fn = grpo.grpo_loss_fn(**kw)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    @jax.jit
    def run(p, b):
        def f(p):
            return loss_fn(nnx.merge(graphdef, p, rest), b, None)
        (value, metrics), grads = jax.value_and_grad(f, has_aux=True)(p)
        routing = jnp.maximum(b["expert_ids"], 0) if replay else None
        logits, _ = nnx.merge(graphdef, p, rest)(b["tokens"], b["positions"], b["segment_ids"],
                                                 routing=routing, mtp=False,
                                                 prefix_segment=b.get("prefix_segment"))
        return value, metrics, grads, grpo.target_logp(logits, b["tokens"], b["segment_ids"], 0.9)[0]

    vu, mu, gu, lu = run(params, bu)
    vs, ms, gs, ls = run(params, bs)
    lu, ls = np.asarray(lu), np.asarray(ls)
    # every token that predicts in both layouts has one logprob (the last shared token starts
    # its continuation's segment in the packed row: it predicts nothing there, and carries no loss)
    gens = [g for r in rollouts if not r.infra_error for g in r.generations]
    at_u = _positions_of([[(g, 0, len(g))] for g in gens])
    at_s = _positions_of(plan)
    prompt_of = {}  # a continuation's window -> its row's prompt window (tokens before lo)
    for pieces in plan:
        for g, lo, _, _, role in pieces:
            if role == "prompt":
                prompt_window = g
            elif role == "cont":
                prompt_of[id(g)] = (id(prompt_window), lo)
    starts = {(k, lo) for k, (_, lo) in prompt_of.items()}

    def packed_at(k):
        if k in at_s:
            return at_s[k]
        return at_s[(prompt_of[k[0]][0], k[1])]  # a prompt token: the shared copy's

    pairs = [(at_u[k], packed_at(k)) for k in at_u if k[1] > 0 and k not in starts]
    assert len(pairs) > 100
    np.testing.assert_allclose([ls[s] for _, s in pairs], [lu[u] for u, _ in pairs], rtol=1e-5, atol=1e-5)
    assert float(vu) != 0.0
    np.testing.assert_allclose(float(vs), float(vu), rtol=1e-5, atol=1e-7)
    for k in ("kl", "clip_fraction", "ratio_mean", "ratio_max", "policy_tokens", "advantage_mean", "entropy",
              "behaviour_logp_abs_diff", "tis_weight_mean"):
        np.testing.assert_allclose(float(ms[k]), float(mu[k]), rtol=1e-5, atol=1e-7, err_msg=k)
    flat_u, flat_s = dict(nnx.to_flat_state(gu)), dict(nnx.to_flat_state(gs))
    assert flat_u.keys() == flat_s.keys()
    for k in flat_u:
        u, s = np.asarray(flat_u[k][...]), np.asarray(flat_s[k][...])
        atol = 1e-6 * max(1.0, float(np.abs(u).max()))
        np.testing.assert_allclose(s, u, rtol=2e-4, atol=atol, err_msg=str(k))
    assert max(float(np.abs(np.asarray(v[...])).max()) for v in flat_u.values()) > 0


def test_shared_prefix_config_is_refused_where_it_cannot_hold():
    from coder.rl.learner import check_shared_prefix

    c = _config()
    assert check_shared_prefix(c) == 0  # off by default
    c.grpo.shared_prefix_len = 128
    c.grpo.mtp_weight = 0.0
    assert check_shared_prefix(c) == 128
    c.grpo.shared_prefix_len = 32
    with pytest.raises(ValueError, match="rl.context_budget=64"):
        check_shared_prefix(c)
    c.grpo.shared_prefix_len = 128
    c.model.attention_backend = "nsa"
    with pytest.raises(ValueError, match="model.attention_backend='dense'"):
        check_shared_prefix(c)
    c.model.attention_backend = "dense"
    c.grpo.mtp_weight = 0.1
    with pytest.raises(ValueError, match="grpo.mtp_weight"):
        check_shared_prefix(c)
