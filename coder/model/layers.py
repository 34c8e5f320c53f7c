"""Small building blocks: parameters with logical axis names, RMSNorm, SwiGLU MLP.

Every parameter is an `nnx.Param` carrying `logical_axes` metadata (one name or None per
array axis); `coder.model.sharding` maps those names to mesh axes through the config's rules.
The model itself never mentions a mesh axis.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from coder.model.quantized import value_of
from coder.model.sharding import constrain


def dtype_of(name) -> jnp.dtype:
    return jnp.dtype(name)


def next_key(stream: nnx.RngStream) -> jax.Array:
    """The key `stream()` returns (fold_in(key, count), then count + 1), bit for bit.

    Why not `stream()`: flax's RngStream.__call__ stores the count with an indexed set
    (`count[...] += 1`), whose sharding comparison asks a tracer for `.sharding`; the error JAX
    builds for that walks the whole jaxpr traced so far, once per parameter: O(parameters^2)
    when a model is built under a trace (nnx.eval_shape, a jitted init). DeepSeek-V3's abstract
    model took 14 s of which 0.3 s was building it. A plain `set_value` stores the same count."""
    count = stream.count.get_value()
    key = jax.random.fold_in(stream.key.get_value(), count)
    stream.count.set_value(count + 1)
    return key


def param(rngs: nnx.Rngs | None, shape, axes, cfg, init: str = "normal", float32_compute: bool = False) -> nnx.Param:
    """A parameter of `shape` with logical `axes`; "normal" draws N(0, initializer_range^2).

    float32_compute: the model uses it in float32 whatever model.dtype (the router's logits,
    the embedding lookup); train.cast_params_once leaves such parameters in param_dtype."""
    assert len(shape) == len(axes), (shape, axes)
    pdt = dtype_of(cfg.param_dtype)
    if init == "ones":
        value = jnp.ones(shape, pdt)
    elif init == "zeros":
        value = jnp.zeros(shape, pdt)
    else:
        value = cfg.initializer_range * jax.random.normal(next_key(rngs.params), shape, pdt)
    meta = {"float32_compute": True} if float32_compute else {}
    return nnx.Param(value, logical_axes=tuple(axes), **meta)


def weight(v: nnx.Variable, dtype=None, whole: bool = False) -> jnp.ndarray:
    """A parameter's value as its layer multiplies it: cast to `dtype` (on the stored shard, so
    the gather moves `dtype`), then whole along `embed` (the FSDP dimension) and split along its
    other axes as the rules say, or whole on every device (`whole`: a data-parallel layer).
    Left implicit, XLA may instead move the activations to the weight's FSDP split (it did when
    tokens and `embed` split over the same mesh axis). A weight an engine holds quantized
    (coder.model.quantized) is dequantized here, on the stored shard, into `dtype`."""
    w = value_of(v, dtype)
    axes = v.get_metadata().get("logical_axes")
    if not axes:
        return w
    axes = tuple(axes)[len(axes) - w.ndim:]  # inside the layer scan: a slice of a stacked variable
    return constrain(w, tuple(None if whole or a == "embed" else a for a in axes))


class RMSNorm(nnx.Module):
    """y = w * x / sqrt(mean(x^2) + eps), statistics in float32 (as HF DeepseekV3RMSNorm)."""

    def __init__(self, dim: int, cfg, eps: float | None = None):
        self.weight = param(None, (dim,), (None,), cfg, init="ones")
        self.eps = float(cfg.rms_norm_eps if eps is None else eps)

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.weight[...].astype(x.dtype) * xf.astype(x.dtype)


class MLP(nnx.Module):
    """SwiGLU: down(silu(x @ gate) * (x @ up)). x `[B, T, D]` -> `[B, T, D]`.

    Tensor-parallel by default: the hidden units split as the rules of `axis` say, the tokens
    as `seq`. data_parallel: on the residual stream's own tokens (`res_seq`), the weights (stored
    split as the rules say) gathered whole at use; model.moe_shared_data_parallel picks it for a
    MoE layer's shared experts, whose weights are a few times smaller than a sequence shard's
    hidden states (Kimi K2 at 32k: 88 MB per layer against 470 MB gathered and 470 MB
    reduce-scattered per chip, forward and again in the backward pass).
    """

    def __init__(self, cfg, hidden: int, rngs: nnx.Rngs, axis: str = "mlp", data_parallel: bool = False):
        d = cfg.hidden_size
        self.gate_proj = param(rngs, (d, hidden), ("embed", axis), cfg)
        self.up_proj = param(rngs, (d, hidden), ("embed", axis), cfg)
        self.down_proj = param(rngs, (hidden, d), (axis, "embed"), cfg)
        self.dtype = dtype_of(cfg.dtype)
        self.axis = axis
        self.data_parallel = data_parallel

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        dt, whole = self.dtype, self.data_parallel
        x = x.astype(dt)
        if whole:
            x = constrain(x, ("batch", "res_seq", None))
        g = x @ weight(self.gate_proj, dt, whole)
        u = x @ weight(self.up_proj, dt, whole)
        h = constrain(jax.nn.silu(g) * u, ("batch", "res_seq", None) if whole else ("batch", "seq", self.axis))
        return h @ weight(self.down_proj, dt, whole)
