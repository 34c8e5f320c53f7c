"""coder.model.attention's cached-call attention: the blockwise (online-softmax) form a long
cache takes equals the one-pass softmax, forward, on the absorbed MLA shapes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coder.model import attention


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 2e-6), (jnp.bfloat16, 2e-2)])
def test_blockwise_cached_attention_equals_one_softmax(dtype, tol):
    b, t, h, r, dr, s = 3, 5, 4, 16, 8, 96
    ks = jax.random.split(jax.random.key(0), 4)
    q_abs = jax.random.normal(ks[0], (b, t, h, r), dtype)
    q_rope = jax.random.normal(ks[1], (b, t, h, dr), dtype)
    c_all = jax.random.normal(ks[2], (b, s, r), dtype)
    r_all = jax.random.normal(ks[3], (b, s, dr), dtype)
    # row 0 decodes deep in the cache, row 1 a prefill chunk crossing a block edge, row 2 sees
    # only the first block's first slots (every later block wholly masked)
    positions = jnp.asarray([[91, 92, 93, 94, 95], [28, 29, 30, 31, 32], [0, 1, 2, 3, 4]], jnp.int32)
    one = attention.cached_attention(q_abs, q_rope, c_all, r_all, positions, 0.3, block=s)
    blocks = attention.cached_attention(q_abs, q_rope, c_all, r_all, positions, 0.3, block=32)
    assert blocks.shape == one.shape == (b, t, h, r) and blocks.dtype == dtype
    np.testing.assert_allclose(np.asarray(blocks, np.float32), np.asarray(one, np.float32), atol=tol, rtol=tol)
    # and both are softmax attention over the visible slots, by hand for one query
    sc = (np.einsum("hr,sr->hs", np.asarray(q_abs[1, 2], np.float32), np.asarray(c_all[1], np.float32))
          + np.einsum("hd,sd->hs", np.asarray(q_rope[1, 2], np.float32), np.asarray(r_all[1], np.float32))) * 0.3
    sc[:, 31:] = -np.inf
    p = np.exp(sc - sc.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = p @ np.asarray(c_all[1], np.float32)
    np.testing.assert_allclose(np.asarray(blocks[1, 2], np.float32), want, atol=10 * tol, rtol=10 * tol)
