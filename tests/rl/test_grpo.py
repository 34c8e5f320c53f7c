"""GRPO math against numbers computed by hand, and the k1 KL gradient against the exact one;
staleness, truncated importance weights, the loss registry, and the learner's reference on resume."""
import json
import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coder.rl import grpo


def test_advantages_std_normalised_when_correctness_differs():
    rewards = [[1.0, 0.0, 0.0, 1.0]]
    correct = [[1, 0, 0, 1]]
    # mean 0.5, deviations +-0.5, population std 0.5 -> +-1.
    np.testing.assert_allclose(grpo.advantages(rewards, correct), [[1, -1, -1, 1]], atol=1e-5)


def test_advantages_not_amplified_when_correctness_equal():
    rewards = [[0.9, 0.8, 0.8, 0.9]]
    correct = [[1, 1, 1, 1]]
    # All correct: only the length-penalty differences remain, not divided by std (0.05).
    np.testing.assert_allclose(grpo.advantages(rewards, correct), [[0.05, -0.05, -0.05, 0.05]], atol=1e-6)


def test_advantages_groups_are_independent():
    rewards = [[1.0, 0.0], [0.3, 0.1]]
    correct = [[True, False], [False, False]]
    np.testing.assert_allclose(grpo.advantages(rewards, correct), [[1, -1], [0.1, -0.1]], atol=1e-5)


def test_infra_failed_rollout_leaves_its_group():
    rewards = [[1.0, 0.0, 0.5, 1.0]]
    correct = [[1, 0, 0, 1]]
    valid = [[True, True, False, True]]
    # Valid rewards 1, 0, 1: mean 2/3, deviations 1/3, -2/3, 1/3, std sqrt(2/9).
    want = [[1 / math.sqrt(2), -math.sqrt(2), 0.0, 1 / math.sqrt(2)]]
    np.testing.assert_allclose(grpo.advantages(rewards, correct, valid), want, atol=1e-5)
    # Without the mask the failed rollout would drag the mean and change every advantage.
    assert not np.allclose(grpo.advantages(rewards, correct), want, atol=1e-3)


def test_infra_mask_changes_whether_correctness_differs():
    # The only incorrect rollout is an infra failure: the rest all share one score.
    rewards = [[0.9, 0.7, 0.0]]
    correct = [[1, 1, 0]]
    valid = grpo.valid_mask([[False, False, True]])
    np.testing.assert_allclose(grpo.advantages(rewards, correct, valid), [[0.1, -0.1, 0.0]], atol=1e-6)


def test_group_with_one_valid_rollout_has_no_advantage():
    adv = grpo.advantages([[1.0, 0.0]], [[1, 0]], [[True, False]])
    np.testing.assert_allclose(adv, [[0.0, 0.0]])


def _hand_loss(logp, blogp, rlogp, adv, mask, cl, ch, kl_coef, norm):
    total = 0.0
    for lp, bp, rp, m in zip(logp, blogp, rlogp, mask):
        a = adv - kl_coef * (lp - rp)
        ratio = math.exp(lp - bp)
        total += m * min(ratio * a, min(max(ratio, 1 - cl), 1 + ch) * a)
    return -total / norm


@pytest.mark.parametrize("adv", [2.0, -2.0])
def test_policy_loss_matches_hand_computation(adv):
    logp = [-1.0, -2.0, -0.5, -3.0]
    blogp = [-1.0, -1.5, -0.9, -3.0]  # ratios 1, 0.607, 1.49, 1
    rlogp = [-1.2, -2.0, -0.4, -1.0]
    mask = [1.0, 1.0, 1.0, 0.0]
    loss, m = grpo.policy_loss(
        jnp.array([logp]), jnp.array([blogp]), jnp.array([rlogp]), jnp.array([adv]), jnp.array([mask]),
        clip_low=0.2, clip_high=0.28, kl_coef=0.1, normalizer=10.0,
    )
    want = _hand_loss(logp, blogp, rlogp, adv, mask, 0.2, 0.28, 0.1, 10.0)
    assert float(loss) == pytest.approx(want, rel=1e-5)
    # k1 over the 3 loss tokens: (0.2 + 0 - 0.1) / 3.
    assert float(m["kl"]) == pytest.approx(0.1 / 3, rel=1e-5)
    # adv>0: the ratio 1.49 > 1.28 is clipped; adv<0: the ratio 0.607 < 0.8 is clipped.
    assert float(m["clip_fraction"]) == pytest.approx(1 / 3, rel=1e-5)
    assert float(m["policy_tokens"]) == 3.0


def test_policy_loss_constant_normalizer_no_length_bias():
    # Two rollouts with the same advantage: 1 token and 3 tokens. Per token the gradient is
    # identical (-A / normalizer); per-sequence normalisation would give the short one 3x more.
    logp = jnp.full((2, 3), -1.0)
    mask = jnp.array([[1.0, 0, 0], [1, 1, 1]])
    adv = jnp.array([1.0, 1.0])

    def f(lp):
        return grpo.policy_loss(lp, jax.lax.stop_gradient(lp), lp, adv, mask, clip_low=0.2,
                                clip_high=0.2, kl_coef=0.0, normalizer=8.0)[0]

    g = jax.grad(f)(logp)
    np.testing.assert_allclose(g, -mask / 8.0, atol=1e-7)
    assert float(f(logp)) == pytest.approx(-4 / 8.0)


def test_policy_loss_masked_tokens_have_no_gradient_even_with_garbage():
    logp = jnp.array([[-1.0, 50.0, -2.0]])  # a padding position with a garbage logprob
    blogp = jnp.array([[-1.0, -80.0, -2.0]])
    mask = jnp.array([[1.0, 0.0, 1.0]])

    def f(lp):
        return grpo.policy_loss(lp, blogp, lp, jnp.array([1.0]), mask, clip_low=0.2, clip_high=0.2,
                                kl_coef=0.5, normalizer=2.0)[0]

    g = jax.grad(f)(logp)
    assert np.isfinite(np.asarray(g)).all()
    assert float(g[0, 1]) == 0.0
    assert float(g[0, 0]) == pytest.approx(-0.5)


def test_loss_sign_increases_probability_of_positive_advantage_tokens():
    theta = jnp.zeros(4)
    tokens = jnp.array([[1, 2]])

    def f(th):
        lp = jax.nn.log_softmax(th)[tokens]
        return grpo.policy_loss(lp, jax.lax.stop_gradient(lp), lp, jnp.array([1.0]), jnp.ones((1, 2)),
                                clip_low=0.2, clip_high=0.2, kl_coef=0.0, normalizer=2.0)[0]

    theta2 = theta - 0.5 * jax.grad(f)(theta)
    p = jax.nn.softmax(theta2)
    assert p[1] > 0.25 and p[2] > 0.25 and p[0] < 0.25


def test_k1_kl_gradient_is_unbiased_estimate_of_exact_kl_gradient():
    """Expected gradient (from 200k samples of pi_theta) of the folded k1 penalty = grad KL."""
    theta = jnp.array([0.5, -0.3, 1.2, 0.0, -1.0])
    theta_ref = jnp.array([-0.2, 0.4, 0.3, 0.8, -0.5])
    n = 200_000
    x = jax.random.categorical(jax.random.key(0), theta, shape=(n,))
    ref_lp = jax.nn.log_softmax(theta_ref)[x][None]

    def folded(th):  # the project's loss with zero task advantage: only the KL part remains
        lp = jax.nn.log_softmax(th)[x][None]
        return grpo.policy_loss(lp, jax.lax.stop_gradient(lp), ref_lp, jnp.zeros(1), jnp.ones((1, n)),
                                clip_low=0.2, clip_high=0.2, kl_coef=1.0, normalizer=float(n))[0]

    def exact_kl(th):
        lp, lr = jax.nn.log_softmax(th), jax.nn.log_softmax(theta_ref)
        return (jnp.exp(lp) * (lp - lr)).sum()

    def differentiated_k1(th):  # what the project does *not* do
        return (jax.nn.log_softmax(th)[x] - ref_lp[0]).mean()

    g_exact = jax.grad(exact_kl)(theta)
    g_folded = jax.grad(folded)(theta)
    np.testing.assert_allclose(g_folded, g_exact, atol=0.01)
    assert float(jnp.abs(g_exact).max()) > 0.1  # the check is not vacuous
    # A differentiated k1 term has expected gradient 0, not grad KL.
    np.testing.assert_allclose(jax.grad(differentiated_k1)(theta), 0.0, atol=0.01)


def test_target_logp_alignment_and_segments():
    v = 3
    logits = jnp.log(jnp.array([[[0.5, 0.25, 0.25], [0.1, 0.1, 0.8], [1 / 3, 1 / 3, 1 / 3], [0.2, 0.2, 0.6]]]))
    tokens = jnp.array([[1, 2, 1, 0]])
    segs = jnp.array([[1, 1, 2, 0]])  # a document boundary before index 2, padding at 3
    lp, ent, valid = grpo.target_logp(logits, tokens, segs)
    np.testing.assert_allclose(lp, [[0, math.log(0.25), 0, 0]], atol=1e-6)
    np.testing.assert_array_equal(valid, [[False, True, False, False]])
    ent_want = -(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25))
    assert float(ent[0, 1]) == pytest.approx(ent_want, rel=1e-5)
    assert v == logits.shape[-1]


def test_grpo_loss_fn_only_sees_policy_tokens():
    """Changing the model's logits that predict prompt tokens does not change the loss."""
    rng = np.random.default_rng(0)
    logits_a = jnp.asarray(rng.normal(size=(1, 5, 7)), jnp.float32)
    logits_b = logits_a.at[0, 0, 4].add(3.0)  # position 0 predicts token 4 at index 1: a prompt token

    def model_with(logits):
        return lambda tokens, positions, segment_ids, routing=None, mtp=None: (logits, {})

    batch = dict(
        tokens=jnp.array([[3, 4, 5, 6, 0]]), positions=jnp.array([[0, 1, 2, 3, 0]]),
        segment_ids=jnp.array([[1, 1, 1, 1, 0]]), loss_mask=jnp.array([[0.0, 0, 1, 1, 0]]),
        behaviour_logp=jnp.full((1, 5), -2.0), ref_logp=jnp.full((1, 5), -2.0), advantages=jnp.array([0.7]),
    )
    fn = grpo.grpo_loss_fn(clip_low=0.2, clip_high=0.2, kl_coef=0.05, normalizer=4.0, temperature=1.0)
    la, ma = fn(model_with(logits_a), batch, None)
    lb, _ = fn(model_with(logits_b), batch, None)
    assert float(la) == pytest.approx(float(lb))
    assert float(ma["policy_tokens"]) == 2.0
    logits_c = logits_a.at[0, 2, 6].add(3.0)  # position 2 predicts token 6 at index 3: a policy token
    lc, _ = fn(model_with(logits_c), batch, None)
    assert float(lc) != pytest.approx(float(la))


# ---------------------------------------------------------------- staleness, TIS, registry

def _logits_model(logits):
    return lambda tokens, positions, segment_ids, routing=None, mtp=None: (logits, {})


def _stale_batch():
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, 7, (2, 6)), jnp.int32)
    return dict(
        tokens=tokens, positions=jnp.broadcast_to(jnp.arange(6), (2, 6)),
        segment_ids=jnp.ones((2, 6), jnp.int32),
        loss_mask=jnp.array([[0.0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0]]),
        behaviour_logp=jnp.asarray(rng.normal(-2.0, 0.3, (2, 6)), jnp.float32),
        ref_logp=jnp.asarray(rng.normal(-2.0, 0.3, (2, 6)), jnp.float32),
        advantages=jnp.array([0.8, -1.3]),
        # learner version - policy version; max_staleness 2 below: 3 and 5 are stale, -1 is a
        # version the learner never produced; 9 sits on a token without loss (no effect)
        staleness=jnp.array([[9, 0, 3, 2, 0, 1], [0, 5, -1, 2, 0, 0]], jnp.int32),
    )


def test_stale_tokens_carry_no_loss():
    """A batch with stale tokens = the same batch with those tokens' loss_mask zeroed (loss and
    gradient), and the metrics count them."""
    batch = _stale_batch()
    logits = jnp.asarray(np.random.default_rng(2).normal(size=(2, 6, 7)), jnp.float32)
    kw = dict(clip_low=0.2, clip_high=0.28, kl_coef=0.05, normalizer=8.0, temperature=1.0)
    fn = grpo.grpo_loss_fn(max_staleness=2, **kw)
    zeroed = dict(batch, loss_mask=batch["loss_mask"] * jnp.array([[1.0, 1, 0, 1, 1, 1], [1, 0, 0, 1, 1, 1]]))
    del zeroed["staleness"]
    plain = grpo.grpo_loss_fn(**kw)

    def loss(f, b):
        return lambda lg: f(_logits_model(lg), b, None)

    (la, ma), ga = jax.value_and_grad(loss(fn, batch), has_aux=True)(logits)
    (lb, mb), gb = jax.value_and_grad(loss(plain, zeroed), has_aux=True)(logits)
    assert float(la) == float(lb)
    np.testing.assert_array_equal(np.asarray(ga), np.asarray(gb))
    assert float(ma["stale_tokens"]) == 3.0
    assert float(ma["policy_tokens"]) == float(mb["policy_tokens"]) == 4.0
    # kept loss tokens have staleness 2, 0, 1 (row 0) and 2 (row 1)
    assert float(ma["staleness_mean"]) == pytest.approx(5 / 4)
    assert float(ma["staleness_max"]) == 2.0
    # Without a max the key is ignored: every policy token keeps its loss.
    (lc, mc) = grpo.grpo_loss_fn(**kw)(_logits_model(logits), batch, None)
    assert float(mc["policy_tokens"]) == 7.0 and "stale_tokens" not in mc


def test_tis_weight_is_capped_and_one_when_logprobs_agree():
    logp = jnp.array([[-1.0, -2.0, -0.5, -3.0]])
    np.testing.assert_array_equal(grpo.tis_weight(logp, logp, 2.0), np.ones((1, 4)))
    blogp = logp - jnp.array([[0.0, 0.5, 1.0, -0.3]])  # ratios 1, 1.65, 2.72, 0.74
    np.testing.assert_allclose(grpo.tis_weight(logp, blogp, 2.0),
                               [[1.0, math.exp(0.5), 2.0, math.exp(-0.3)]], rtol=1e-6)


@pytest.mark.parametrize("adv", [1.5, -1.5])
def test_tis_policy_gradient_weight_is_truncated_ratio(adv):
    """With tis_cap each token's gradient is min(rho, cap) x the on-policy one (where PPO's clip
    does not zero it); with engine == learner logprobs the loss is the plain one."""
    logp = jnp.array([[-1.0, -2.0, -0.5, -3.0, -1.0]])
    shift = jnp.array([[0.0, 0.15, 1.0, -0.1, 3.0]])  # ratios 1, 1.16, 2.72, 0.90, 20.1
    blogp = logp - shift
    mask = jnp.array([[1.0, 1, 1, 1, 1]])
    kw = dict(clip_low=0.2, clip_high=0.28, kl_coef=0.0, normalizer=5.0)

    def f(lp, b, cap):
        return grpo.policy_loss(lp, b, lp, jnp.array([adv]), mask, tis_cap=cap, **kw)

    # engine and learner agree: identical loss, gradient and a weight of 1
    (l0, m0), g0 = jax.value_and_grad(f, has_aux=True)(logp, logp, 2.0)
    (l1, _), g1 = jax.value_and_grad(f, has_aux=True)(logp, logp, 0.0)
    assert float(l0) == float(l1)
    np.testing.assert_array_equal(np.asarray(g0), np.asarray(g1))
    assert float(m0["tis_weight_mean"]) == 1.0 and float(m0["tis_truncated_fraction"]) == 0.0

    (_, m), g = jax.value_and_grad(f, has_aux=True)(logp, blogp, 2.0)
    rho = np.exp(np.asarray(shift[0]))
    w = np.minimum(rho, 2.0)
    # the unclipped branch: d(-ratio * A / norm)/dlogp = -rho A / norm, times w / rho
    live = (rho <= 1.28) if adv > 0 else (rho >= 0.8)
    want = np.where(live, -w * adv / 5.0, 0.0)
    np.testing.assert_allclose(np.asarray(g[0]), want, rtol=1e-5, atol=1e-7)
    assert float(m["tis_truncated_fraction"]) == pytest.approx(2 / 5)
    assert float(m["tis_weight_mean"]) == pytest.approx(w.mean(), rel=1e-5)
    # without TIS the ratio 20 token would weigh 20x (negative advantage: PPO never clips it)
    if adv < 0:
        g_plain = jax.grad(lambda lp: f(lp, blogp, 0.0)[0])(logp)
        assert float(g_plain[0, 4]) == pytest.approx(-rho[4] * adv / 5.0, rel=1e-5)


def test_policy_loss_registry():
    assert "grpo" in grpo.POLICY_LOSSES
    lp = jnp.array([[-1.0, -2.0]])
    kw = dict(clip_low=0.2, clip_high=0.2, kl_coef=0.0, normalizer=2.0)
    with pytest.raises(ValueError, match="unknown policy loss"):
        grpo.policy_loss(lp, lp, lp, jnp.array([1.0]), jnp.ones((1, 2)), loss="nope", **kw)

    @grpo.register_policy_loss("test_plain_pg")
    def plain(log_ratio, adv, mask, *, clip_low, clip_high, tis_cap):
        return jnp.exp(log_ratio) * adv, {}

    try:
        with pytest.raises(ValueError, match="registered twice"):
            grpo.register_policy_loss("test_plain_pg")(plain)
        loss, m = grpo.policy_loss(lp, lp - 1.0, lp, jnp.array([1.0]), jnp.ones((1, 2)),
                                   loss="test_plain_pg", **kw)
        assert float(loss) == pytest.approx(-math.e)  # unclipped: 2 tokens of ratio e / 2
        assert "clip_fraction" not in m and float(m["policy_tokens"]) == 2.0
    finally:
        del grpo.POLICY_LOSSES["test_plain_pg"]


# ---------------------------------------------------------------- the learner's reference

def _learner_config():
    from configs import quickstart

    c = quickstart.get_config()
    c.model.update(dict(vocab_size=256, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                        num_attention_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                        v_head_dim=8, max_position_embeddings=64))
    c.model.rope_scaling.original_max_position_embeddings = 64
    c.rl.update(dict(context_budget=32, summary_reserve=8, max_rollout_tokens=16))
    c.train.update(dict(lr=1e-2, warmup_steps=0, ckpt_every=1))
    c.grpo.max_staleness = 1
    return c


def _learner_batch(rows=8, t=32):
    r = np.random.default_rng(0)
    return dict(tokens=r.integers(1, 256, (rows, t)).astype(np.int32),
                positions=np.broadcast_to(np.arange(t, dtype=np.int32), (rows, t)).copy(),
                segment_ids=np.ones((rows, t), np.int32), loss_mask=np.ones((rows, t), np.float32),
                behaviour_logp=np.full((rows, t), -5.0, np.float32),
                ref_logp=np.full((rows, t), -5.0, np.float32),
                advantages=r.normal(size=rows).astype(np.float32),
                staleness=np.where(np.arange(t) < 4, 3, 0).astype(np.int32)[None].repeat(rows, 0))


def _flat(model):
    from flax import nnx

    from coder.train.flat import state_to_flat

    return {k: np.asarray(v) for k, v in state_to_flat(nnx.state(model)).items()}


def _with_bias(model, value):
    """`model` with every MoE router bias (an nnx.Variable, not a Param) set to `value` + its
    expert index (non-zero and distinct)."""
    from flax import nnx

    from coder.model.routing import RouterBias

    state = nnx.state(model, RouterBias)
    state = jax.tree.map(lambda b: b + value + jnp.arange(b.shape[-1], dtype=b.dtype), state)
    nnx.update(model, state)
    return model


def test_batch_sequence_is_bucketed_to_the_longest_generation():
    from coder.rl.learner import seq_bucket

    assert [seq_bucket(n, 1024) for n in (1, 128, 129, 300, 700, 1024)] == [128, 128, 256, 512, 1024, 1024]
    assert seq_bucket(900, 1000) == 1000 and seq_bucket(20, 32) == 32  # capped at the budget
    with pytest.raises(ValueError, match="rl.context_budget=1000"):
        seq_bucket(1001, 1000)


@pytest.mark.slow
def test_resumed_reference_equals_fresh_bit_for_bit(tmp_path, with_init_from=True):
    """The reference a resumed stage rebuilds = the fresh stage's, every variable (the router
    bias included), bit for bit; init_from is pinned to the step it resolved to, so a newer
    checkpoint there later does not move it; a changed source is refused. (A stage without
    init_from, its reference from model_fn, resumes bit for bit in tests/rl/test_grpo_preemption.py.)"""
    from coder.model import Transformer
    from coder.rl.learner import REFERENCE_RECORD, Learner
    from flax import nnx

    c = _learner_config()

    def biased():
        return _with_bias(Transformer(c.model, rngs=nnx.Rngs(7)), 0.01)

    init_from, model_fn = "", biased
    if with_init_from:  # a previous stage's checkpoint with a trained (non-zero) router bias
        pre = Learner(c, str(tmp_path / "pre"), "", biased)
        pre.trainer.save(force=True)
        pre.trainer.ckpt.wait()
        init_from, model_fn = pre.trainer.checkpoint_dir, None

    fresh = Learner(c, str(tmp_path / "grpo"), init_from, model_fn)
    want = _flat(fresh.ref)
    biases = [k for k in want if k.endswith("mlp.bias")]
    assert biases and all(np.abs(want[k]).min() > 0 for k in biases)  # the check is not vacuous
    fresh.trainer.state.step += 1  # a step later (no update needed: the reference is what is checked)
    # Learner.batch: staleness = the learner's version - each sampled token's policy version
    from coder.rl import trajectory

    gen = trajectory.ContextWindow()
    gen.add_context([5, 6, 7])
    gen.add_sampled(types.SimpleNamespace(tokens=[8, 9, 10], logprobs=[-1.0, -2.0, -3.0],
                                          policy_version=[0, 1, 1]))
    rollout = trajectory.Rollout(task_id="t", generations=[gen], advantage=1.0)
    b = fresh.batch([[rollout]])
    assert "policy_version" not in b
    np.testing.assert_array_equal(b["staleness"][0, :7], [0, 0, 0, 1, 0, 0, 0])
    np.testing.assert_array_equal(fresh.batch([[rollout]], version=3)["staleness"][0, :6], [0, 0, 0, 3, 2, 2])
    fresh.trainer.save(force=True)
    fresh.trainer.ckpt.wait()
    if with_init_from:  # init_from's directory gets a newer checkpoint with other weights
        pre.trainer.state.step += 1
        pre.trainer.state.params = jax.tree.map(lambda x: x + 1.0, pre.trainer.state.params)
        pre.trainer.save(force=True)
        pre.trainer.ckpt.wait()

    resumed = Learner(c, str(tmp_path / "grpo"), init_from, model_fn)
    assert resumed.version == 1
    got = _flat(resumed.ref)
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)

    record = tmp_path / "grpo" / REFERENCE_RECORD
    rec = json.loads(record.read_text())
    rec["checksums"][biases[0]] ^= 1
    record.write_text(json.dumps(rec))
    with pytest.raises(ValueError, match="reference policy rebuilt on resume"):
        Learner(c, str(tmp_path / "grpo"), init_from, model_fn)


@pytest.mark.slow
def test_without_a_kl_term_the_learner_keeps_no_reference(tmp_path):
    """grpo.kl_coef = 0: no reference copy of the model (at 1T parameters it would be a second
    model on the learner's devices), no ref_logp in the batch, no "kl" metric; the step trains.
    The loss refuses a KL weight without reference logprobs."""
    from coder.model import Transformer
    from coder.rl import trajectory
    from coder.rl.learner import REFERENCE_RECORD, Learner
    from flax import nnx

    c = _learner_config()
    c.grpo.kl_coef = 0.0
    learner = Learner(c, str(tmp_path / "grpo"), "", lambda: Transformer(c.model, rngs=nnx.Rngs(7)))
    assert learner.ref is None and not (tmp_path / "grpo" / REFERENCE_RECORD).exists()
    rollouts = []
    for adv in (1.0, -1.0):
        gen = trajectory.ContextWindow()
        gen.add_context([5, 6, 7])
        gen.add_sampled(types.SimpleNamespace(tokens=[8, 9, 10], logprobs=[-1.0, -2.0, -3.0],
                                              policy_version=[0, 0, 0]))
        rollouts.append(trajectory.Rollout(task_id="t", generations=[gen], advantage=adv))
    b = learner.batch([rollouts])
    assert "ref_logp" not in b
    m = learner.trainer.train_step(b)
    assert "kl" not in m and np.isfinite(float(m["loss"])) and float(m["grad_norm"]) > 0
    with pytest.raises(ValueError, match="needs the reference logprobs"):
        grpo.policy_loss(jnp.zeros((1, 2)), jnp.zeros((1, 2)), None, jnp.ones((1,)), jnp.ones((1, 2)),
                         clip_low=0.2, clip_high=0.2, kl_coef=0.1, normalizer=1.0)


# ---------------------------------------------------------------- the MTP refresh

@pytest.mark.slow
def test_mtp_refresh_trains_the_mtp_modules_and_leaves_the_policy_gradient_unchanged():
    """grpo.mtp_weight > 0: the distillation term reaches the MTP modules only (the trunk's,
    embedding's and head's gradients equal the plain GRPO loss's), the MTP modules get a
    non-zero gradient, and the term is stage mtp's KL on the batch's policy tokens, reported with
    its acceptance rate per depth."""
    from flax import nnx

    from coder.model import Transformer
    from coder.train import distill

    c = _learner_config()
    model = Transformer(c.model, nnx.Rngs(0))
    assert len(model.mtp) == c.model.num_mtp_layers > 0
    batch = {k: jnp.asarray(v) for k, v in _learner_batch(rows=2, t=16).items()}
    batch["loss_mask"] = batch["loss_mask"].at[:, :6].set(0.0)  # a prompt: no policy tokens there
    kw = dict(clip_low=0.2, clip_high=0.28, kl_coef=0.001, normalizer=32.0, temperature=1.0)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def grads(mtp_weight):
        def loss(p):
            value, metrics = grpo.grpo_loss_fn(**kw, mtp_weight=mtp_weight)(nnx.merge(graphdef, p, rest), batch, None)
            return value, metrics
        return jax.grad(loss, has_aux=True)(params)

    (g0, m0), (g1, m1) = grads(0.0), grads(0.5)
    flat0, flat1 = dict(nnx.to_flat_state(g0)), dict(nnx.to_flat_state(g1))
    mtp_keys = [k for k in flat1 if "mtp" in k]
    assert mtp_keys and len(mtp_keys) < len(flat1)
    for k, v in flat1.items():
        if "mtp" in k:
            assert float(jnp.abs(flat0[k][...]).max()) == 0.0  # plain GRPO: no MTP gradient
        else:
            np.testing.assert_allclose(np.asarray(v[...]), np.asarray(flat0[k][...]), rtol=1e-6, atol=1e-9)
    assert max(float(jnp.abs(flat1[k][...]).max()) for k in mtp_keys) > 0

    logits, aux = model(batch["tokens"], batch["positions"], batch["segment_ids"], mtp=True)
    kl, expected = distill.distill_loss(logits, aux["mtp_logits"], batch, ce_weight=0.0)
    assert float(m1["mtp_kl"]) == pytest.approx(float(kl), rel=1e-5)
    assert float(m1["mtp_accept_1"]) == pytest.approx(float(expected["accept_1"]), rel=1e-5)
    assert 0 < float(m1["mtp_accept_1"]) < 1 and "mtp_kl" not in m0
