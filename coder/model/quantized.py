"""A weight held in fewer bits than it is multiplied in: `Quantized(values, scale)`.

An engine serves some of its weights in this form (coder.infer.quantize says which, and in
which format); the model reads every weight through `coder.model.layers.weight` or, for the
routed experts, `expert_weight`, which call `dequantize` where the layer multiplies: inside
the compiled step, one layer at a time (under the layer scan, a layer's slice), so what the
engine holds on its devices is the narrow form only and XLA is free to fuse the dequantize
into the matmul's operand (it does on GPU and TPU; on CPU it writes the layer's wide copy into
a temporary).

Symmetric quantization, w ~= values * scale:

    per channel (group 0): scale has the weight's ndim, 1 on each contracting axis (the
        axes the layer sums over) and the weight's size on the others: one scale per output
        channel, amax over the inputs it multiplies / the format's largest value.
    grouped (group g > 0, one contracting axis a): scale's axis a has size n / g, one
        scale per g consecutive inputs of each output channel (Kimi K2.5's routed experts:
        INT4, g = 32, along the input dimension).

Formats: int8 (values round(w / scale) in [-127, 127]), int4 ([-7, 7], jnp.int4: 4 bits a
value on TPU and GPU), float8_e4m3fn (w / scale cast, |.| <= 448). The scale is stored in the
dtype the engine serves floating weights in (float32 until then).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

LARGEST = {"int8": 127.0, "int4": 7.0, "float8_e4m3fn": 448.0}  # the format's largest value used


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Quantized:
    """values: the weight's shape, in the format's dtype; scale: the weight's ndim (module
    docstring), floating."""

    values: jax.Array
    scale: jax.Array

    @property
    def shape(self):
        return self.values.shape

    @property
    def ndim(self) -> int:
        return self.values.ndim

    def dequantize(self, dtype) -> jax.Array:
        """The weight, `values * scale` rounded to `dtype`: the same bits outside and inside a
        compiled step (XLA may keep a fused bf16 product in float32, excess precision it is
        allowed by default; reduce_precision is the rounding it may not remove)."""
        v, s = self.values.astype(dtype), self.scale.astype(dtype)
        axis = grouped_axis(self.values.shape, self.scale.shape)
        if axis is None:
            w = v * s
        else:
            n, groups = v.shape[axis], s.shape[axis]
            split = v.shape[:axis] + (groups, n // groups) + v.shape[axis + 1:]
            w = (v.reshape(split) * jnp.expand_dims(s, axis + 1)).reshape(v.shape)
        info = jnp.finfo(dtype)
        return jax.lax.reduce_precision(w, exponent_bits=info.nexp, mantissa_bits=info.nmant)


def is_wide_float(dtype) -> bool:
    """Whether `dtype` is a full-precision float (16 bits or more), the kind a serving dtype
    casts; an 8-bit float is a quantized weight's values and keeps its dtype."""
    return jnp.issubdtype(dtype, jnp.floating) and jax.dtypes.itemsize_bits(dtype) >= 16


def grouped_axis(shape, scale_shape) -> int | None:
    """The axis a grouped scale splits into groups (its size neither 1 nor the weight's), or None."""
    axes = [a for a, (n, m) in enumerate(zip(shape, scale_shape)) if m not in (1, n)]
    if len(axes) > 1:
        raise ValueError(f"a scale {tuple(scale_shape)} of a weight {tuple(shape)} groups more than one axis")
    return axes[0] if axes else None


def quantize(w: jax.Array, dtype: str, contracting: tuple[int, ...], group: int = 0) -> Quantized:
    """`w` in `dtype` ("int8", "int4", "float8_e4m3fn") with per-channel scales over the
    `contracting` axes (negative: counted from the end, so a layer-stacked weight's leading axis
    is kept), or with `group` > 0 one scale per `group` inputs of the one contracting axis.
    The amax and the division run in float32; the scale is returned in float32."""
    if dtype not in LARGEST:
        raise ValueError(f"quantize: no format {dtype!r} (one of {sorted(LARGEST)})")
    wf = jnp.asarray(w).astype(jnp.float32)
    axes = tuple(a % wf.ndim for a in contracting)
    if group:
        if len(axes) != 1 or wf.shape[axes[0]] % group:
            raise ValueError(f"quantize: a group of {group} needs one contracting axis whose size it divides "
                             f"(weight {wf.shape}, contracting axes {contracting})")
        a = axes[0]
        split = wf.reshape(wf.shape[:a] + (wf.shape[a] // group, group) + wf.shape[a + 1:])
        amax = jnp.abs(split).max(axis=a + 1)
        scale = jnp.where(amax > 0, amax / LARGEST[dtype], 1.0)
        scaled = (split / jnp.expand_dims(scale, a + 1)).reshape(wf.shape)
    else:
        amax = jnp.abs(wf).max(axis=axes, keepdims=True)
        scale = jnp.where(amax > 0, amax / LARGEST[dtype], 1.0)
        scaled = wf / scale
    top = LARGEST[dtype]
    if dtype.startswith("int"):
        scaled = jnp.clip(jnp.round(scaled), -top, top)
    return Quantized(scaled.astype(jnp.dtype(dtype)), scale)


def as_dtype(w, dtype):
    """An expert weight as an array in `dtype`: a `Quantized` one dequantized as `value_of` does."""
    return w.dequantize(w.scale.dtype).astype(dtype) if isinstance(w, Quantized) else w.astype(dtype)


def operand(w, dtype):
    """An expert weight as the grouped matmul takes it: `Quantized` as it is (the TPU kernel reads
    the narrow form: coder.pallas.quantized_matmul), an array cast to `dtype`."""
    return w if isinstance(w, Quantized) else w.astype(dtype)


def spec_for(w, spec):
    """The PartitionSpec (tree) of weight `w` split as `spec` says: for a `Quantized` one, its
    values as `spec` and its scale the same, but whole along an axis it spans (size 1). A
    grouped axis splits with its values, so each shard keeps the scales of its own groups (a
    scale left whole there would pair a shard's rows with the wrong groups)."""
    if not isinstance(w, Quantized):
        return spec
    from jax.sharding import PartitionSpec

    entries = tuple(spec) + (None,) * (w.ndim - len(spec))
    scale = PartitionSpec(*(None if m == 1 and n != 1 else e for e, m, n in zip(entries, w.scale.shape, w.shape)))
    return Quantized(spec, scale)


def value_of(v, dtype=None):
    """A variable's value as a layer multiplies it, cast to `dtype` when given: the stored
    array, or for a weight the engine holds `Quantized` the weight it stands for in its scale's
    dtype (the engine's serving dtype: what a full-precision engine would hold)."""
    x = v.get_value()
    if isinstance(x, Quantized):
        x = x.dequantize(x.scale.dtype)
    return x if dtype is None else x.astype(dtype)
