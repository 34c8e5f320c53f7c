"""coder.rl.agreement.agreement against numbers computed by hand."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coder.rl.agreement import METRICS, agreement


def test_agreement_by_hand():
    engine = np.array([[-1.0, -2.0, -3.0], [-0.5, 9.0, 0.0]], np.float32)  # 9.0: garbage, masked
    learner = np.array([[-1.0, -2.5, -2.9], [-0.5, -1e9, 0.0]], np.float32)
    mask = np.array([[1, 1, 1], [1, 0, 0]], np.float32)
    m = {k: float(v) for k, v in agreement(engine, learner, mask).items()}
    d = np.array([0.0, -0.5, 0.1, 0.0])
    assert m["abs_diff_mean"] == pytest.approx(0.15, rel=1e-6)
    assert m["abs_diff_max"] == pytest.approx(0.5, rel=1e-6)
    assert m["kl_k3"] == pytest.approx(np.mean(np.exp(d) - 1 - d), rel=1e-5)
    assert m["routing_mismatch"] == m["routing_mismatch_tokens"] == 0.0  # no ids given
    assert set(m) == set(METRICS)


def test_agreement_is_zero_when_equal_and_under_jit():
    lp = np.log(np.full((2, 4), 0.25, np.float32))
    m = jax.jit(agreement)(lp, lp, np.ones((2, 4)))
    assert all(float(v) == 0.0 for v in m.values())
    empty = agreement(lp, lp + 1.0, np.zeros((2, 4)))  # nothing compared: 0, not NaN
    assert all(float(v) == 0.0 for v in empty.values())


def test_kl_k3_is_an_unbiased_kl_estimate():
    """Tokens drawn from the engine's distribution p: mean k3 -> KL(p || q) of the learner's q."""
    p = jnp.array([0.5, 0.3, 0.2])
    q = jnp.array([0.4, 0.4, 0.2])
    x = jax.random.categorical(jax.random.key(0), jnp.log(p), shape=(1, 200_000))
    m = agreement(jnp.log(p)[x], jnp.log(q)[x], jnp.ones(x.shape))
    exact = float(jnp.sum(p * jnp.log(p / q)))
    assert float(m["kl_k3"]) == pytest.approx(exact, rel=0.05)


def test_routing_mismatch_by_hand():
    """One MoE layer of two, top-2, three routed tokens and an unrouted one: a set in another
    order is no mismatch; token 1 differs in layer 0, token 2 in both layers."""
    engine = np.full((2, 1, 4, 2), -1, np.int32)
    engine[:, 0, :3] = [[0, 1], [2, 3], [4, 5]]
    own = np.array(engine)
    own[0, 0, 0] = [1, 0]  # same set
    own[0, 0, 1] = [2, 7]
    own[:, 0, 2] = [4, 6]
    own[:, 0, 3] = [1, 2]  # the engine routed nothing there: not compared
    m = agreement(np.zeros((1, 4)), np.zeros((1, 4)), np.ones((1, 4)), engine, own)
    assert float(m["routing_mismatch"]) == pytest.approx(3 / 6)
    assert float(m["routing_mismatch_tokens"]) == pytest.approx(2 / 3)
    none = agreement(np.zeros((1, 4)), np.zeros((1, 4)), np.ones((1, 4)), engine[:0], own[:0])  # no MoE
    assert float(none["routing_mismatch"]) == 0.0 and not math.isnan(float(none["routing_mismatch_tokens"]))
