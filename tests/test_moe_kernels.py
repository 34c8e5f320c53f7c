"""coder.model.moe's TPU paths, run on CPU: the megablox grouped matmul in Pallas interpret mode,
and the ragged_all_to_all expert-parallel dispatch (XLA:CPU has no ragged-all-to-all, so
`emulated_ragged_all_to_all` stands in for it inside the shard_map)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coder.model import moe as moe_lib
from coder.model.moe import megablox_grouped_matmul


def _check_grads(f, f_ref, *args, rtol=1e-5, atol=1e-4):
    loss = lambda fn: jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a) ** 2), tuple(range(len(args)))))
    for a, b in zip(loss(f)(*args), loss(f_ref)(*args), strict=True):
        assert np.isfinite(np.asarray(a)).all()
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)


@pytest.mark.parametrize("sizes,tiling", [
    ([3, 0, 70, 5], (16, 16, 8)),  # empty group, groups across 16-row tiles, 22 rows past the last
    ([40, 40, 0, 20], (32, 16, 8)),  # an empty last-but-one group, every row in a group
    ([0, 0, 0, 0], None),  # nothing routed here: every row past the last group
    ([10, 20, 0, 0], None),  # default tiling: one 112-row tile, 4 rows of padding added
])
def test_megablox_grouped_matmul_equals_ragged_dot(sizes, tiling):
    """Values and gradients w.r.t. x and w of the megablox kernels (interpret mode) equal
    jax.lax.ragged_dot's. Interpret mode fills uninitialised output with NaN, so rows past the
    last group (forward output and dx) check the masking."""
    x = jax.random.normal(jax.random.key(0), (100, 16))
    w = jax.random.normal(jax.random.key(1), (4, 16, 8))
    gs = jnp.asarray(sizes, jnp.int32)
    f = lambda x, w: megablox_grouped_matmul(x, w, gs, interpret=True, tiling=tiling)
    f_ref = lambda x, w: jax.lax.ragged_dot(x, w, gs)
    np.testing.assert_allclose(jax.jit(f)(x, w), f_ref(x, w), atol=1e-5)
    _check_grads(f, f_ref, x, w)


def test_gmm_tiling_divides_shapes():
    assert moe_lib.gmm_tiling(100, 16, 8) == (112, 16, 8)
    assert moe_lib.gmm_tiling(4096, 7168, 2048) == (512, 512, 512)
    assert moe_lib.gmm_tiling(4096, 384, 640) == (512, 128, 128)


def test_sorted_ffn_with_megablox_equals_ragged_dot(monkeypatch):
    """The dropless FFN with megablox as its grouped matmul (interpret mode) against ragged_dot:
    pairs of non-local experts sort past the last group (expert parallelism's layout)."""
    k = jax.random.split(jax.random.key(0), 6)
    x = jax.random.normal(k[0], (24, 16))
    ids = jax.random.randint(k[1], (24, 2), 0, 8).at[:, 0].set(jnp.arange(24) % 3)  # expert 3: none
    w = jax.random.uniform(k[2], (24, 2))
    wg, wu = jax.random.normal(k[3], (4, 16, 8)), jax.random.normal(k[4], (4, 16, 8))
    wd = jax.random.normal(k[5], (4, 8, 16))
    ffn = lambda x, wg, wu, wd: moe_lib.sorted_ffn(x, ids, w, wg, wu, wd, first_expert=2)
    mb = functools.partial(megablox_grouped_matmul, interpret=True, tiling=(16, 16, 8))
    run = lambda: jax.jit(jax.value_and_grad(lambda *a: jnp.sum(ffn(*a) ** 2), (0, 1, 2, 3)))(x, wg, wu, wd)
    with monkeypatch.context() as m:
        m.setattr(moe_lib, "grouped_matmul", jax.lax.ragged_dot)
        want = run()
    monkeypatch.setattr(moe_lib, "grouped_matmul", mb)
    got = run()
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert np.isfinite(np.asarray(a)).all()
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-3)


def test_grouped_matmul_lowers_megablox_for_tpu():
    """grouped_matmul picks megablox (a Mosaic custom call) when lowered for TPU, from this CPU
    host (as stage compile does), forward and backward; the CPU program has none."""
    x = jnp.ones((64, 256), jnp.bfloat16)
    w = jnp.ones((4, 256, 128), jnp.bfloat16)
    gs = jnp.array([10, 0, 30, 4], jnp.int32)
    loss = lambda x, w: jnp.sum(moe_lib.grouped_matmul(x, w, gs).astype(jnp.float32) ** 2)
    step = jax.jit(jax.grad(loss, (0, 1)))
    tpu = step.trace(x, w).lower(lowering_platforms=("tpu",)).as_text()
    assert tpu.count("tpu_custom_call") == 3  # gmm forward, gmm for dx, tgmm for dw
    assert "@tgmm" in tpu
    assert "tpu_custom_call" not in step.trace(x, w).lower().as_text()
