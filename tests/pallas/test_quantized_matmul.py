"""coder/pallas/quantized_matmul.py: the TPU grouped matmul over quantized expert weights,
beside its jnp reference in interpret mode (forward only: an engine's kernel)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coder.model.quantized import quantize
from coder.pallas import quantized_matmul as qmm


def inputs(m, k, n, sizes, fmt, group, seed=0):
    g = len(sizes)
    keys = jax.random.split(jax.random.key(seed), 2)
    x = jax.random.normal(keys[0], (m, k), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(keys[1], (g, k, n), jnp.float32)
    q = quantize(w, fmt, (-2,), group)
    return x, q.values, q.scale.astype(jnp.bfloat16), jnp.asarray(sizes, jnp.int32)


@pytest.mark.parametrize("fmt,group", [("int8", 0), ("int4", 32), ("float8_e4m3fn", 0)])
def test_the_kernel_equals_the_reference(fmt, group):
    # a group of more than a block, an empty one, one of a few rows; 40 rows past the groups
    x, values, scale, sizes = inputs(200, 256, 256, [150, 0, 10], fmt, group)
    got = qmm.gmm(x, values, scale, sizes, interpret=True)
    want = qmm.reference(x, values, scale, sizes)
    # the same bf16 weights, float32 accumulation in another order: within bf16's output rounding
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2)
    assert not np.asarray(got[int(sizes.sum()):], np.float32).any()


def test_mismatched_shapes_are_refused():
    x, values, scale, sizes = inputs(16, 256, 128, [8, 8], "int8", 0)
    with pytest.raises(ValueError, match="do not agree"):
        qmm.gmm(x[:, :128], values, scale, sizes, interpret=True)
