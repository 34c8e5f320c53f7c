"""coder.pallas.grouped_matmul_gpu (Pallas Triton) against its jnp reference, forward and backward,
in the Pallas interpreter: groups that end inside a row tile, empty groups, rows past the groups,
widths that are not whole blocks; and the tile table's cover of the rows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coder.pallas import grouped_matmul_gpu as G

TILES = G.Tiles(block_m=16, block_n=16, block_k=16, interpret=True)


@pytest.mark.parametrize("sizes, k, n", [
    ((5, 0, 40, 19), 32, 48),  # a group inside one tile, an empty one, boundaries mid-tile
    ((16, 16, 16, 16), 24, 20),  # whole tiles; K and N padded to whole blocks
])
def test_forward_and_backward_equal_the_reference(sizes, k, n):
    m = sum(sizes) + 7  # 7 rows past the groups
    kx, kw, kd = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (m, k))
    w = jax.random.normal(kw, (len(sizes), k, n))
    dy = jax.random.normal(kd, (m, n))
    gs = jnp.asarray(sizes, jnp.int32)
    live = (jnp.arange(m) < sum(sizes))[:, None]

    def loss(f):  # the rows past the groups are unspecified: the loss reads the groups' rows only
        return lambda x, w: jnp.sum(jnp.where(live, f(x, w, gs) * dy, 0.0))

    mine = lambda x, w, gs: G.gmm(x, w, gs, TILES)  # noqa: E731
    y, y_ref = mine(x, w, gs), G.reference(x, w, gs)
    np.testing.assert_allclose(np.where(live, y, 0), y_ref, rtol=1e-5, atol=1e-4)
    (dx, dw), (dx_ref, dw_ref) = (jax.grad(loss(f), (0, 1))(x, w) for f in (mine, G.reference))
    np.testing.assert_allclose(np.where(live, dx, 0), dx_ref, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(dw, dw_ref, rtol=1e-5, atol=1e-4)
    if sizes[1] == 0:  # an empty group's weight gets no gradient
        assert not np.any(dw[1])


def test_tgmm_reads_only_the_groups_rows():
    """Rows past the groups hold NaN: tgmm's masked loads never read them into a weight's gradient."""
    sizes = (3, 20, 9)
    m = sum(sizes) + 5
    x = jax.random.normal(jax.random.key(1), (m, 32)).at[sum(sizes):].set(jnp.nan)
    dy = jax.random.normal(jax.random.key(2), (m, 16)).at[sum(sizes):].set(jnp.nan)
    dw = G.tgmm(x, dy, jnp.asarray(sizes, jnp.int32), TILES)
    start = np.cumsum((0,) + sizes)
    ref = np.stack([np.asarray(x[a:b]).T @ np.asarray(dy[a:b]) for a, b in zip(start[:-1], start[1:])])
    np.testing.assert_allclose(dw, ref, rtol=1e-5, atol=1e-4)


def test_tile_table_covers_each_groups_rows_once():
    sizes = np.array([5, 0, 40, 19, 0, 1], np.int32)
    m, bm = int(sizes.sum()) + 3, 16
    grp, start, end = (np.asarray(a) for a in G.tile_table(jnp.asarray(sizes), m, bm))
    assert grp.shape == (-(-m // bm) + len(sizes),)
    covered = np.full(m, -1)
    for g, a, b in zip(grp, start, end):
        assert 0 <= b - a <= bm
        assert np.all(covered[a:b] == -1)  # no row twice
        covered[a:b] = g
    bounds = np.cumsum(np.concatenate([[0], sizes]))
    expect = np.full(m, -1)
    for g in range(len(sizes)):
        expect[bounds[g]:bounds[g + 1]] = g
    np.testing.assert_array_equal(covered, expect)
    assert int(((end - start) > 0).sum()) == int(sum(-(-s // bm) for s in sizes))  # one program per tile


def test_batched_under_vmap_equals_the_reference():
    """train.reduce_grads_once vmaps the model over replicas: gmm batched (each replica its own
    group sizes) equals the reference per replica, forward and backward."""
    sizes = jnp.asarray([[5, 0, 27], [16, 16, 0]], jnp.int32)
    x = jax.random.normal(jax.random.key(4), (2, 40, 32))
    w = jax.random.normal(jax.random.key(5), (2, 3, 32, 16))
    live = (jnp.arange(40)[None, :] < sizes.sum(-1, keepdims=True))[..., None]

    def loss(f):
        return lambda x, w: jnp.sum(jnp.where(live, jax.vmap(f)(x, w, sizes), 0.0) ** 2)

    mine = lambda x, w, gs: G.gmm(x, w, gs, TILES)  # noqa: E731
    np.testing.assert_allclose(np.where(live, jax.vmap(mine)(x, w, sizes), 0), jax.vmap(G.reference)(x, w, sizes),
                               rtol=1e-5, atol=1e-4)
    (dx, dw), (dx_ref, dw_ref) = (jax.grad(loss(f), (0, 1))(x, w) for f in (mine, G.reference))
    np.testing.assert_allclose(np.where(live, dx, 0), dx_ref, rtol=1e-5, atol=1e-4)  # rows past the groups: unspecified
    np.testing.assert_allclose(dw, dw_ref, rtol=1e-5, atol=1e-4)
