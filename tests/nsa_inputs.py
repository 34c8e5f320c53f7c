"""Shared by the NSA test modules (tests/pallas/test_nsa_*.py, tests/model/test_nsa_*.py): the
fixture that turns XLA's backend optimizations off for a module, and the inputs they draw."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coder.pallas.nsa import reference


@pytest.fixture(autouse=True, scope="module")
def fast_compiles():
    """The NSA tests check what small programs compute, not how fast they run, and XLA's backend
    optimizations are most of their compile time: off while a module of them runs (every
    NSA test module imports this fixture), restored after."""
    flag = "jax_disable_most_optimizations"
    before = jax.config.values[flag]
    jax.config.update(flag, True)
    yield
    jax.config.update(flag, before)


def packed_segments(b, t, docs, pad, seed):
    """[B,T] segment ids: `docs` documents of random lengths per row, then `pad` padding tokens."""
    rng = np.random.default_rng(seed)
    out = np.zeros((b, t), np.int32)
    for i in range(b):
        cuts = np.sort(rng.choice(np.arange(1, t - pad), docs - 1, replace=False)) if docs > 1 else []
        bounds = [0, *cuts, t - pad]
        for d in range(docs):
            out[i, bounds[d]:bounds[d + 1]] = d + 1
    return jnp.asarray(out)


def normal(shape, seed):
    """Standard-normal float32 array from numpy's generator (eager jax.random compiles once per shape)."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32))


def make_inputs(b, t, h, g, dk, dv, cfg, seed=0):
    """Standard-normal q, k, v, compressed k/v and gates in (0, 1), float32."""
    rng = np.random.default_rng(seed)
    nc = reference.num_compressed(t, cfg)
    draw = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32))
    x = {"q": draw(b, t, h, dk), "k": draw(b, t, g, dk), "v": draw(b, t, g, dv),
         "k_cmp": draw(b, nc, g, dk), "v_cmp": draw(b, nc, g, dv)}
    return x | {"gates": jnp.asarray(1 / (1 + np.exp(-rng.standard_normal((b, t, h, 3), np.float32))))}
