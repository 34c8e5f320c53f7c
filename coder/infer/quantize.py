"""Which weights an engine serves quantized, and in which format (the weight form itself:
coder.model.quantized). The learner keeps its float32 / bfloat16 masters; an engine built with
a `Quantization` quantizes every state it is given (its first weights, set_weights,
load_weights) on its devices, so the in-process, colocated and weight-store paths all serve
the same narrow form, and GRPO's truncated importance sampling (grpo.tis_cap) corrects for
the gap, which bench/agreement.py measures per mode.

    int8          every matmul weight int8, one scale per output channel (TPU v5p / H100 int8)
    fp8           every matmul weight float8_e4m3fn, one scale per output channel (H100 / B200)
    int8_experts  the routed experts int8, one scale per output channel; the others as served
    int4_experts  the routed experts INT4, one scale per 32 inputs (Kimi K2.5's released form);
                  the other weights in the serving dtype

On TPU the routed experts are read in their narrow form by coder.pallas.quantized_matmul
(dequantized tile by tile in VMEM); the other matmul weights are dequantized by XLA inside the
layer's step, which writes them to HBM first (docs/scale/composer_k2/engine_quantization.md
measures what each mode costs a decode step).

Weight-only: activations and the KV cache stay in the serving dtype. Never quantized: the
embedding table (a lookup in float32), the router (float32 logits: a flipped top-k is a
routing mismatch), norms and biases, NSA's small compression and gate weights.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from coder.model.quantized import Quantized, is_wide_float, quantize
from coder.train import flat as flat_lib


@dataclasses.dataclass(frozen=True)
class Format:
    dtype: str  # "int8", "int4" or "float8_e4m3fn"
    group: int = 0  # 0: one scale per output channel; g: one per g inputs


@dataclasses.dataclass(frozen=True)
class Quantization:
    name: str
    dense: Format | None  # the matmul weights outside the routed experts
    experts: Format | None  # the routed experts' gate / up / down


MODES = {q.name: q for q in (
    Quantization("int8", Format("int8"), Format("int8")),
    Quantization("fp8", Format("float8_e4m3fn"), Format("float8_e4m3fn")),
    Quantization("int8_experts", None, Format("int8")),
    Quantization("int4_experts", None, Format("int4", 32)),
)}

# a weight's name -> the axes its layer sums over (counted from the end: a layer-stacked
# weight's leading axis is kept); the einsums of coder/model/{layers,attention,transformer}.py
DENSE = {"gate_proj": (-2,), "up_proj": (-2,), "down_proj": (-2,),  # [in, out]
         "q_a_proj": (-2,), "kv_a_proj": (-2,), "lm_head": (-2,), "eh_proj": (-2,),
         "q_proj": (-3,), "q_b_proj": (-3,), "kv_b_proj": (-3,),  # [in, heads, head_dim]
         "o_proj": (-3, -2)}  # [heads, head_dim, out]
EXPERTS = {"wg": (-2,), "wu": (-2,), "wd": (-2,)}  # [experts, in, out]


def quantization(name: str | Quantization | None) -> Quantization | None:
    """The mode named `name` ("" or None: full precision)."""
    if name is None or isinstance(name, Quantization):
        return name
    if name == "":
        return None
    if name not in MODES:
        raise ValueError(f"quantization {name!r}: one of {sorted(MODES)} (or '' for none)")
    return MODES[name]


def _rule(q: Quantization, name: str):
    """(Format, contracting axes) for the weight called `name`, or None (kept as it is)."""
    if name in EXPERTS and q.experts is not None:
        return q.experts, EXPERTS[name]
    if name in DENSE and q.dense is not None:
        return q.dense, DENSE[name]
    return None


def quantize_state(state: nnx.State, q: Quantization | None) -> nnx.State:
    """`state` with the weights `q` names in their quantized form (jit it to run on device);
    leaves already quantized, and every other leaf, as they are."""
    if q is None:
        return state
    leaves = []
    for path, var in nnx.to_flat_state(state):
        x, rule = var.get_value(), _rule(q, str(path[-1]))
        if rule is not None and not isinstance(x, Quantized) and jnp.issubdtype(x.dtype, jnp.floating):
            fmt, axes = rule
            qx = quantize(x, fmt.dtype, axes, fmt.group)
            var = var.replace(Quantized(qx.values, qx.scale.astype(x.dtype)))
        leaves.append((path, var))
    return nnx.from_flat_state(leaves)


def dequantize_state(state: nnx.State) -> nnx.State:
    """Every quantized weight as the float it stands for, in its scale's dtype: the weights a
    full-precision reference engine serves to reproduce a quantized one bit for bit."""
    leaves = []
    for path, var in nnx.to_flat_state(state):
        x = var.get_value()
        leaves.append((path, var.replace(x.dequantize(x.scale.dtype)) if isinstance(x, Quantized) else var))
    return nnx.from_flat_state(leaves)


def to_flat(state: nnx.State, template: nnx.State | None = None) -> dict:
    """{flat name: leaf} of a served state (arrays, shapes, or the shardings of its leaves, with
    `template` the served state they belong to), a quantized weight as two leaves
    `{name}.values` and `{name}.scale`: the weight store's names
    (coder.rl.weight_channel.ModelPublisher). INT4 values travel packed, two to a byte along
    their last axis (uint8 `[..., n / 2]`; a sharding is the values')."""
    held = flat_lib.state_to_flat(state if template is None else template)
    out = {}
    for name, x in flat_lib.state_to_flat(state).items():
        like = held[name]
        if isinstance(like, Quantized):
            int4 = jnp.dtype(like.values.dtype) == jnp.int4
            out[f"{name}.values"] = _pack_int4(x.values) if int4 and template is None else x.values
            out[f"{name}.scale"] = x.scale
        else:
            out[name] = x
    return out


def flat_shapes(state: nnx.State) -> dict:
    """`to_flat`'s {name: ShapeDtypeStruct} of a served state (arrays or shapes), computing nothing."""
    return to_flat(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state))


def from_flat(template: nnx.State, flat: dict) -> nnx.State:
    """Inverse of `to_flat` in `template`'s structure (a served state: arrays or shapes)."""
    leaves = []
    for path, var in nnx.to_flat_state(template):
        name, like = flat_lib.flat_name(path), var.get_value()
        if isinstance(like, Quantized):
            values = flat[f"{name}.values"]
            if jnp.dtype(like.values.dtype) == jnp.int4:
                values = _unpack_int4(values)
            x = Quantized(values, flat[f"{name}.scale"])
        else:
            x = flat[name]
        leaves.append((path, var.replace(x)))
    return nnx.from_flat_state(leaves)


def _pack_int4(v):
    """int4 `[..., n]` (n even) -> uint8 `[..., n / 2]`: value 2i in the low nibble, 2i+1 in the high."""
    if isinstance(v, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(v.shape[:-1] + (v.shape[-1] // 2,), jnp.uint8, sharding=v.sharding)
    if v.shape[-1] % 2:
        raise ValueError(f"int4 values of shape {v.shape}: packing two to a byte needs an even last axis")
    u = jnp.asarray(v).astype(jnp.int8).astype(jnp.uint8) & 0xF
    return u[..., 0::2] | (u[..., 1::2] << 4)


def _unpack_int4(p):
    """Inverse of `_pack_int4`."""
    p = jnp.asarray(p)
    nibbles = jnp.stack([p & 0xF, p >> 4], axis=-1).astype(jnp.int8)  # [..., n / 2, 2]
    signed = jnp.where(nibbles > 7, nibbles - 16, nibbles)
    return signed.reshape(p.shape[:-1] + (2 * p.shape[-1],)).astype(jnp.int4)


def holds_quantized(names) -> bool:
    """Whether flat `names` (to_flat's) hold a quantized weight (a `.values` with its `.scale`)."""
    names = set(names)
    return any(n.endswith(".values") and n[: -len(".values")] + ".scale" in names for n in names)


def bytes_per_device(state) -> int:
    """The bytes the largest device's shards of `state`'s arrays take (int4: half a byte a value)."""
    per = {}
    for x in jax.tree.leaves(state):
        bits = jax.dtypes.itemsize_bits(x.dtype)
        for shard in x.addressable_shards:
            per[shard.device] = per.get(shard.device, 0) + shard.data.size * bits
    return (max(per.values()) + 7) // 8 if per else 0


def abstract_served(state, q: Quantization | None, dtype) -> nnx.State:
    """The shapes and dtypes of `state` (arrays or shapes) once an engine serves it in `dtype`
    under `q` (no device needed: the engine's memory arithmetic and the plan)."""
    return jax.eval_shape(lambda s: quantize_state(_cast(s, dtype), q), state)


def _cast(state, dtype):
    if dtype is None:
        return state
    return jax.tree.map(lambda x: x.astype(dtype) if is_wide_float(x.dtype) else x, state)
