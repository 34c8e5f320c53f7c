"""The quantized weight form (coder/model/quantized.py): scales per output channel or per group,
the rounding error each format promises, the same bits inside and outside a compiled step, and
the sharding of a quantized state's scales."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from coder.model import sharding
from coder.model.quantized import Quantized, quantize, value_of


def weights(shape, seed=0):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32) * jnp.linspace(0.1, 3.0, shape[-1])


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_integer_formats_round_to_the_nearest_step_of_each_output_channel(dtype):
    w = weights((2, 64, 16))  # [layers, in, out]: the leading (stacked) axis keeps its own scales
    q = quantize(w, dtype, (-2,))
    assert q.values.dtype == jnp.dtype(dtype) and q.scale.shape == (2, 1, 16)
    top = {"int8": 127, "int4": 7}[dtype]
    np.testing.assert_allclose(q.scale, np.abs(w).max(axis=1, keepdims=True) / top, rtol=1e-6)
    assert int(jnp.abs(q.values.astype(jnp.int32)).max()) == top  # the channel's amax uses the whole range
    err = np.abs(np.asarray(q.dequantize(jnp.float32)) - np.asarray(w))
    assert (err <= np.asarray(q.scale) / 2 * (1 + 1e-5)).all()


def test_int4_groups_have_one_scale_per_32_inputs_of_each_expert_channel():
    w = weights((4, 64, 8))  # [experts, in, out]
    q = quantize(w, "int4", (-2,), group=32)
    assert q.scale.shape == (4, 2, 8)
    amax = np.abs(np.asarray(w)).reshape(4, 2, 32, 8).max(axis=2)
    np.testing.assert_allclose(q.scale, amax / 7, rtol=1e-6)
    back = np.asarray(q.dequantize(jnp.float32)).reshape(4, 2, 32, 8)
    err = np.abs(back - np.asarray(w).reshape(4, 2, 32, 8))
    assert (err <= np.asarray(q.scale)[:, :, None, :] / 2 * (1 + 1e-5)).all()
    # finer than one scale per channel, whose step is the larger amax's
    assert err.mean() < np.abs(np.asarray(quantize(w, "int4", (-2,)).dequantize(jnp.float32)) - np.asarray(w)).mean()


def test_fp8_keeps_three_mantissa_bits_of_every_value():
    w = weights((64, 16))
    q = quantize(w, "float8_e4m3fn", (-2,))
    back = np.asarray(q.dequantize(jnp.float32))
    # e4m3 normals: relative error <= 2^-4; subnormals (|w / scale| < 2^-6): absolute 2^-10 x scale
    bound = np.maximum(np.abs(np.asarray(w)) * 2.0 ** -4, np.asarray(q.scale) * 2.0 ** -10)
    assert (np.abs(back - np.asarray(w)) <= bound * (1 + 1e-5)).all()


def test_a_zero_channel_and_the_axes_a_scale_spans():
    w = jnp.zeros((8, 3, 4)).at[:, :, 1:].set(weights((8, 3, 3)))  # [heads, head_dim, out]; channel 0 all zero
    q = quantize(w, "int8", (-3, -2))
    assert q.scale.shape == (1, 1, 4) and float(q.scale[0, 0, 0]) == 1.0
    assert not np.asarray(q.values[..., 0]).any()
    with pytest.raises(ValueError, match="group of 32 needs one contracting axis"):
        quantize(weights((2, 40, 4)), "int4", (-2,), group=32)
    with pytest.raises(ValueError, match="no format 'int2'"):
        quantize(w, "int2", (-2,))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_dequantized_inside_a_compiled_matmul_as_outside(dtype):
    """A layer's dequantize fused into its matmul multiplies exactly the weight dequantized
    eagerly: here a float32 model on an engine serving `dtype` (value_of's cast). Without the
    rounding dequantize forces, XLA keeps the fused bf16 product in float32 and the two differ
    (measured on this CPU: not equal)."""
    w = weights((64, 32), 1)
    q = quantize(w, "int8", (-2,))
    q = Quantized(q.values, q.scale.astype(dtype))
    x = weights((8, 64), 2)
    layer = lambda x, q: x @ q.dequantize(dtype).astype(jnp.float32)
    np.testing.assert_array_equal(np.asarray(jax.jit(layer)(x, q)), np.asarray(layer(x, q)))


def test_value_of_reads_a_quantized_variable_in_its_serving_dtype_then_casts():
    q = quantize(weights((16, 4)), "int8", (-2,))
    q = Quantized(q.values, q.scale.astype(jnp.bfloat16))
    v = nnx.Param(q, logical_axes=("embed", "mlp"))
    np.testing.assert_array_equal(np.asarray(value_of(v, jnp.float32)),
                                  np.asarray(q.dequantize(jnp.bfloat16).astype(jnp.float32)))
    assert value_of(nnx.Param(jnp.ones((2,), jnp.bfloat16)), jnp.float32).dtype == jnp.float32


def test_a_quantized_scale_is_whole_where_it_spans_an_axis_and_split_with_its_groups():
    class Layer(nnx.Module):
        def __init__(self):
            self.dense = nnx.Param(jnp.zeros((16, 8)), logical_axes=("embed", "mlp"))
            self.experts = nnx.Param(jnp.zeros((4, 64, 8)), logical_axes=("exp", "embed", "exp_mlp"))

    state = nnx.state(Layer())
    state["dense"].set_value(quantize(weights((16, 8)), "int8", (-2,)))
    state["experts"].set_value(quantize(weights((4, 64, 8)), "int4", (-2,), group=32))
    rules = (("embed", "fsdp"), ("mlp", "tensor"), ("exp", "expert"), ("exp_mlp", "tensor"))
    specs = sharding.state_specs(state, rules)
    dense, experts = specs["dense"].get_value(), specs["experts"].get_value()
    assert dense.values == P("fsdp", "tensor") and dense.scale == P(None, "tensor")
    # a shard of 32 inputs keeps the one scale of its group (left whole, a shard's rows would
    # meet the first groups' scales: the MoE layer under expert x tensor split went wrong so)
    assert experts.values == P("expert", "fsdp", "tensor") and experts.scale == P("expert", "fsdp", "tensor")
