"""Sampling: top-k / top-p masks, the recorded logprob, greedy, and the sampled distribution."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coder.infer import sampling

# chi-squared 0.999 quantiles by degrees of freedom (scipy.stats.chi2.ppf(0.999, df))
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 7: 24.32}


def _draw(logits, n, temperature, top_k, top_p, seed=0):
    """n independent draws from one row of logits `[V]` -> (tokens `[n]`, logprobs `[n]`)."""
    keys = sampling.row_keys(jax.random.key(seed), jnp.arange(n), jnp.zeros(n, jnp.int32))
    rows = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (n, len(logits)))
    fn = jax.jit(sampling.sample)
    tok, logp = fn(rows, keys, np.float32(temperature), np.int32(top_k), np.float32(top_p))
    return np.asarray(tok), np.asarray(logp)


def _chi2(counts, probs):
    n = counts.sum()
    expected = n * probs
    return float(((counts - expected) ** 2 / expected).sum())


def test_top_p_keeps_smallest_prefix_reaching_mass():
    probs = np.array([0.05, 0.5, 0.15, 0.3])
    x = jnp.log(jnp.asarray(probs, jnp.float32))[None]
    # sorted: 0.5, 0.3, 0.15, 0.05; mass before each: 0, 0.5, 0.8, 0.95
    kept = lambda p: set(np.flatnonzero(np.isfinite(np.asarray(sampling.filter_logits(x, 0, p))[0])))
    assert kept(0.5) == {1}
    assert kept(0.79) == {1, 3}
    assert kept(0.81) == {1, 3, 2}
    assert kept(1.0) == {0, 1, 2, 3}
    assert kept(0.0) == {1}  # the most likely token always survives


def test_top_k_then_top_p():
    x = jnp.log(jnp.asarray([[0.1, 0.4, 0.2, 0.3]], jnp.float32))
    out = np.asarray(sampling.filter_logits(x, 2, 1.0))[0]
    assert set(np.flatnonzero(np.isfinite(out))) == {1, 3}
    # top-p acts on the top-k renormalised mass: 0.4/0.7 = 0.57 < 0.6 -> both kept
    out = np.asarray(sampling.filter_logits(x, 2, 0.6))[0]
    assert set(np.flatnonzero(np.isfinite(out))) == {1, 3}
    out = np.asarray(sampling.filter_logits(x, 2, 0.5))[0]
    assert set(np.flatnonzero(np.isfinite(out))) == {1}


def test_logprob_is_full_vocab_log_softmax_at_temperature():
    logits = np.array([2.0, 1.0, 0.5, -1.0, 0.0], np.float32)
    t = 0.7
    tok, logp = _draw(logits, 64, t, top_k=2, top_p=0.9)
    full = jax.nn.log_softmax(logits / t)
    assert set(tok) <= {0, 1}
    np.testing.assert_allclose(logp, np.asarray(full)[tok], rtol=0, atol=1e-6)


def test_greedy_is_argmax_with_untempered_logprob():
    logits = jax.random.normal(jax.random.key(3), (5, 11))
    keys = sampling.row_keys(jax.random.key(0), jnp.arange(5), jnp.arange(5))
    tok, logp = sampling.sample(logits, keys, 0.0, 3, 0.5)
    np.testing.assert_array_equal(np.asarray(tok), np.argmax(np.asarray(logits), -1))
    expect = jnp.take_along_axis(jax.nn.log_softmax(logits), tok[:, None], 1)[:, 0]
    np.testing.assert_allclose(np.asarray(logp), np.asarray(expect), atol=1e-6)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.6, 0, 1.0), (1.3, 3, 1.0), (1.0, 0, 0.7)])
def test_sampled_distribution_matches(temperature, top_k, top_p):
    logits = np.array([1.5, 0.2, -0.4, 0.9, 0.0, -1.2], np.float32)
    n = 20000
    tok, _ = _draw(logits, n, temperature, top_k, top_p, seed=7)
    probs = np.asarray(sampling.sampling_probs(logits[None], temperature, top_k, top_p))[0]
    support = probs > 0
    assert set(np.unique(tok)) <= set(np.flatnonzero(support))
    counts = np.bincount(tok, minlength=len(logits))[support]
    assert _chi2(counts, probs[support]) < CHI2_999[int(support.sum()) - 1]


def test_row_keys_depend_on_row_and_position_only():
    rng = jax.random.key(11)
    a = sampling.row_keys(rng, jnp.array([0, 1, 2]), jnp.array([5, 5, 9]))
    b = sampling.row_keys(rng, jnp.array([2]), jnp.array([9]))
    data = lambda k: np.asarray(jax.random.key_data(k))
    np.testing.assert_array_equal(data(a)[2], data(b)[0])
    assert len({tuple(x) for x in data(a)}) == 3
