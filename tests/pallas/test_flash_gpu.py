"""coder.pallas.flash_gpu (Pallas Triton) against its XLA reference, forward and backward, in the
Pallas interpreter: whole rows and a device's zigzag share of the queries; and its errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coder.model.context_parallel import zigzag_positions
from coder.pallas import flash_gpu

B, S, H, DQ, DV = 2, 256, 2, 192, 128  # MLA's widths: queries and keys 192 (padded to 256), values 128
SCALE = DQ ** -0.5


def _keys(seed=0):
    kk, kv = jax.random.split(jax.random.key(seed))
    seg = np.ones((B, S), np.int32)
    seg[0, 100:230], seg[0, 230:] = 2, 0  # two documents and a padded tail
    seg[1, 130:] = 3  # a document boundary inside a tile
    return jax.random.normal(kk, (B, S, H, DQ)), jax.random.normal(kv, (B, S, H, DV)), jnp.asarray(seg)


def _compare(q, k, v, pos, q_seg, kv_seg, tol):
    w = jax.random.normal(jax.random.key(9), q.shape[:3] + (v.shape[-1],))
    tiles = flash_gpu.Tiles(interpret=True)
    mine = lambda q, k, v: flash_gpu.flash_attention(q, k, v, pos, q_seg, kv_seg, SCALE, tiles)
    ref = lambda q, k, v: flash_gpu.reference(q, k, v, pos, q_seg, kv_seg, SCALE)
    out = lambda f: jax.value_and_grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32) * w), (0, 1, 2))(q, k, v)
    (loss, go), (loss_ref, gr) = out(mine), out(ref)
    np.testing.assert_allclose(mine(q, k, v), ref(q, k, v), atol=tol, rtol=tol)
    np.testing.assert_allclose(loss, loss_ref, rtol=tol)
    for name, a, b in zip("qkv", go, gr):
        np.testing.assert_allclose(a, b, atol=tol * float(jnp.max(jnp.abs(b))), err_msg=f"d{name}")


def test_whole_rows_equal_the_reference():
    k, v, seg = _keys()
    q = jax.random.normal(jax.random.key(1), (B, S, H, DQ))
    pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    _compare(q, k, v, pos, seg, seg, tol=2e-5)


@pytest.mark.parametrize("shard", [0, 1, 3])
def test_a_zigzag_share_of_the_queries_equals_the_reference(shard):
    """Shard `shard` of 4: its queries are two half-chunks far apart (positions s and 2n-1-s of
    2n), against all S keys. Shard 0's first half sees only the first key tiles, so the dK/dV
    kernel skips it for the others; a wrong skip or a wrong position would show in dK, dV."""
    n = 4
    k, v, seg = _keys()
    pos = jnp.asarray(zigzag_positions(S, n).reshape(n, S // n)[shard], jnp.int32)
    pos = jnp.broadcast_to(pos, (B, S // n))
    q = jax.random.normal(jax.random.key(2 + shard), (B, S // n, H, DQ))
    _compare(q, k, v, pos, jnp.take_along_axis(seg, pos, 1), seg, tol=2e-5)


def test_queries_at_an_offset_between_key_tiles_equal_the_reference():
    """64 queries at positions [16, 80): each query tile straddles a key-tile boundary, so a
    key tile is seen by the end of a query tile and not by its start (the dK/dV kernel must not
    skip it)."""
    k, v, seg = _keys()
    pos = jnp.broadcast_to(jnp.arange(16, 80, dtype=jnp.int32), (B, 64))
    q = jax.random.normal(jax.random.key(5), (B, 64, H, DQ))
    _compare(q, k, v, pos, jnp.take_along_axis(seg, pos, 1), seg, tol=2e-5)


def test_bf16_operands_stay_within_bf16_rounding():
    k, v, seg = _keys()
    q = jax.random.normal(jax.random.key(4), (B, S, H, DQ))
    q, k, v = (a.astype(jnp.bfloat16) for a in (q, k, v))
    pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    _compare(q, k, v, pos, seg, seg, tol=3e-2)


def test_rows_that_are_not_whole_tiles_are_refused():
    k, v, seg = _keys()
    q = jnp.zeros((B, 100, H, DQ))
    pos = jnp.zeros((B, 100), jnp.int32)
    with pytest.raises(ValueError, match="100 queries are not whole tiles"):
        flash_gpu.flash_attention(q, k, v, pos, pos, seg, SCALE, flash_gpu.Tiles(interpret=True))


def test_shared_prefix_rows_equal_the_reference():
    """A prompt (segment 1) and three continuations (segments 2-4) that each see it through
    q_prefix = 1, one of them crossing a tile boundary; the prompt's own queries have no prefix."""
    k, v, _ = _keys()
    seg = np.zeros((B, S), np.int32)
    pre = np.zeros((B, S), np.int32)
    seg[:, :90], seg[:, 90:170], seg[:, 170:220], seg[:, 220:250] = 1, 2, 3, 4
    pre[:, 90:250] = 1
    seg, pre = jnp.asarray(seg), jnp.asarray(pre)
    q = jax.random.normal(jax.random.key(6), (B, S, H, DQ))
    pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    w = jax.random.normal(jax.random.key(9), (B, S, H, DV))
    tiles = flash_gpu.Tiles(interpret=True)
    mine = lambda q, k, v: flash_gpu.flash_attention(q, k, v, pos, seg, seg, SCALE, tiles, q_prefix=pre)
    ref = lambda q, k, v: flash_gpu.reference(q, k, v, pos, seg, seg, SCALE, q_prefix=pre)
    np.testing.assert_allclose(mine(q, k, v), ref(q, k, v), atol=2e-5)
    without = flash_gpu.reference(q, k, v, pos, seg, seg, SCALE)
    assert float(jnp.max(jnp.abs(ref(q, k, v) - without))) > 0.1  # the prefix term matters here
    g, g_ref = (jax.grad(lambda *a: jnp.sum(f(*a) * w), (0, 1, 2))(q, k, v) for f in (mine, ref))
    for name, a, b in zip("qkv", g, g_ref):
        np.testing.assert_allclose(a, b, atol=2e-5 * float(jnp.max(jnp.abs(b))), err_msg=f"d{name}")
