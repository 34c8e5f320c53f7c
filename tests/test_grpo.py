"""GRPO math against numbers computed by hand, and the k1 KL gradient against the exact one."""
import math

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
