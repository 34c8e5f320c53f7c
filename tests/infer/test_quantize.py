"""Quantized engines (coder/infer/quantize.py): an engine holding its weights in int8, fp8 or
INT4 experts samples the same tokens, log-probs and expert ids, bit for bit, as a
full-precision engine given the weights those stand for; it holds fewer bytes; new weights
reach it full precision by set_weights and load_weights and are quantized there."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from coder.infer import quantize
from coder.infer.engine import Engine, SamplingParams
from coder.model import Transformer
from coder.model.quantized import Quantized
from coder.train import flat as flat_lib
from tests.infer.engine_inputs import BATCH, LENS, MAX_LEN, tiny_cfg

PROMPT = [3, 17, 42, 5, 99, 7, 8, 120, 33]


@pytest.fixture(scope="module")
def model():
    cfg = tiny_cfg()
    return cfg, Transformer(cfg, rngs=nnx.Rngs(0))


def engine(model, cfg, dtype, quantization=None):
    return Engine(model, cfg, max_len=MAX_LEN, batch_buckets=BATCH, len_buckets=LENS, dtype=dtype,
                  quantization=quantization)


def sample(e, seed=1, n=4):
    group = e.start_group(PROMPT, n)
    gens = e.generate(group, SamplingParams(temperature=1.0, max_new_tokens=16), jax.random.key(seed))
    out = [(g.tokens, g.logprobs, np.asarray(g.expert_ids)) for g in gens]
    group.close()
    return out


def reference(q_engine, model, cfg, dtype):
    """A full-precision engine over the weights `q_engine`'s quantized ones stand for."""
    state = quantize.dequantize_state(q_engine.weights.state)
    return engine(nnx.merge(nnx.graphdef(model), state), cfg, dtype)


def assert_same(a, b):
    for (ta, la, ea), (tb, lb, eb) in zip(a, b):
        assert ta == tb and la == lb
        np.testing.assert_array_equal(ea, eb)


@pytest.mark.parametrize("mode,dtype", [("int8", "bfloat16"), ("fp8", "float32"), ("int4_experts", "bfloat16")])
def test_a_quantized_engine_samples_what_its_dequantized_weights_sample(model, mode, dtype):
    cfg, m = model
    q = engine(m, cfg, dtype, mode)
    ref = reference(q, m, cfg, dtype)
    full = engine(m, cfg, dtype)
    try:
        held = nnx.to_flat_state(q.weights.state)
        names = {str(p[-1]) for p, v in held if isinstance(v.get_value(), Quantized)}
        named = set(quantize.EXPERTS) | (set() if mode == "int4_experts" else set(quantize.DENSE))
        assert names == named & {str(p[-1]) for p, _ in held}
        assert_same(sample(q), sample(ref))
        # the bytes the served form takes: each weight's values at its format's width, plus scales
        assert q.weights.bytes_per_device < full.weights.bytes_per_device
        expected = sum((x.size * jax.dtypes.itemsize_bits(x.dtype) + 7) // 8 for x in jax.tree.leaves(
            quantize.abstract_served(nnx.state(m), quantize.quantization(mode), jnp.dtype(dtype))))
        assert q.weights.bytes_per_device == expected
    finally:
        for e in (q, ref, full):
            e.close()


def test_new_weights_are_quantized_by_set_weights_and_load_weights(model):
    cfg, m = model
    q = engine(m, cfg, "float32", "int8")
    try:
        other = Transformer(cfg, rngs=nnx.Rngs(7))
        # a partial state: one MLP's gate; the rest keeps the held (quantized) form
        gate = nnx.state(other.layers[0].mlp)["gate_proj"]
        before = q.weights.state
        q.set_weights(nnx.State({"layers": {0: {"mlp": {"gate_proj": gate}}}}), version=1)
        sample(q, n=1)  # applies the pending weights
        after = q.weights.state
        held = after["layers"][0]["mlp"]["gate_proj"].get_value()
        assert isinstance(held, Quantized) and held.values.dtype == jnp.int8
        want = quantize.quantize_state(nnx.State({"gate_proj": gate}), quantize.MODES["int8"])
        np.testing.assert_array_equal(held.values, want["gate_proj"].get_value().values)
        untouched = lambda s: s["layers"][1]["mlp"]["wg"].get_value().values
        np.testing.assert_array_equal(untouched(after), untouched(before))
        # a whole state by a loader (the weight store's path): full-precision leaves by flat name
        flat = flat_lib.state_to_flat(nnx.state(other))
        q.load_weights(lambda shardings: {k: jax.device_put(flat[k], sh) for k, sh in shardings.items()}, version=2)
        got = sample(q)
        ref = engine(nnx.merge(nnx.graphdef(m), quantize.dequantize_state(q.weights.state)), cfg, "float32")
        try:
            assert_same(got, sample(ref))
        finally:
            ref.close()
    finally:
        q.close()


def test_an_unknown_mode_is_refused_by_name(model):
    cfg, m = model
    with pytest.raises(ValueError, match="quantization 'int3': one of"):
        engine(m, cfg, "float32", "int3")


def test_int4_values_travel_two_to_a_byte_and_come_back():
    """quantize.to_flat packs INT4 values along their last axis (the weight store's form) and
    from_flat unpacks them: every value of the format, abstract shapes too."""
    values = jnp.asarray(np.arange(-8, 8).repeat(3).reshape(3, 16), jnp.int4)
    state = nnx.State({"wg": nnx.Param(Quantized(values, jnp.ones((3, 1), jnp.bfloat16)))})
    flat = quantize.to_flat(state)
    assert flat["wg.values"].dtype == jnp.uint8 and flat["wg.values"].shape == (3, 8)
    back = quantize.from_flat(state, flat)["wg"].get_value().values
    assert back.dtype == jnp.int4
    np.testing.assert_array_equal(np.asarray(back, np.int8), np.asarray(values, np.int8))
    shapes = quantize.flat_shapes(state)
    assert (shapes["wg.values"].shape, shapes["wg.values"].dtype) == ((3, 8), jnp.uint8)
