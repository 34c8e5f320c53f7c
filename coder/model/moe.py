"""DeepSeek-V3 mixture of experts: the MoE layer (routed + shared experts) and the bias update
of a model's MoE layers.

    y = sum_j g_j FFN_{ids_j}(x) + sum_shared FFN_shared(x)
`MoE` composes the router (coder.model.routing: sigmoid scores, the aux-loss-free selection
bias, top-k over groups), the routed experts on one device (coder.model.expert_ffn: dropless
grouped matmuls, coder.model.grouped_matmul, or a capacity buffer) and, under any mesh
(`coder.model.sharding.activate`), the expert-parallel dispatch in a shard_map
(coder.model.expert_dispatch). `moe_layers` lists a model's MoE modules in forward order;
`update_router_bias` applies the aux-loss-free balancing step, b += rate * sign(mean load -
load), to their biases.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from coder.model import sharding
from coder.model.config import routing_errors
from coder.model.expert_dispatch import expert_parallel_ffn
from coder.model.expert_ffn import local_experts_ffn
from coder.model.layers import MLP, dtype_of, param, weight
from coder.model.routing import RouterBias, load_fraction, route


class MoE(nnx.Module):
    """Routed + shared experts. x `[B,T,D]` -> (y `[B,T,D]`, stats)."""

    def __init__(self, cfg, rngs: nnx.Rngs):
        d, f, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts
        errors = routing_errors(cfg)
        if errors:
            raise ValueError("; ".join(errors))
        self.cfg = cfg
        self.router = param(rngs, (d, e), ("embed", None), cfg, float32_compute=True)
        self.bias = RouterBias(jnp.zeros((e,), jnp.float32), logical_axes=(None,))
        self.wg = param(rngs, (e, d, f), ("exp", "embed", "exp_mlp"), cfg)
        self.wu = param(rngs, (e, d, f), ("exp", "embed", "exp_mlp"), cfg)
        self.wd = param(rngs, (e, f, d), ("exp", "exp_mlp", "embed"), cfg)
        self.shared = MLP(cfg, f * cfg.n_shared_experts, rngs, axis="mlp",
                          data_parallel=bool(getattr(cfg, "moe_shared_data_parallel", False))
                          ) if cfg.n_shared_experts else None
        self.dtype = dtype_of(cfg.dtype)

    def __call__(self, x, valid, expert_ids=None):
        """x `[B,T,D]`, valid `[B,T]` bool (non-padding), expert_ids `[B,T,k]` to replay.

        stats: load `[E]`, expert_ids `[B,T,k]` int32 (the ids used: the replayed ones when
        given), router_ids `[B,T,k]` int32 (this router's own top-k on x: equal to expert_ids
        without replay; with replay, the choice replay overrode, one top-k over `[N, E]` scores
        already computed, dead code unless read), z (mean logsumexp(router logits)^2), and with
        model.moe_capacity_factor > 0 (or a bounded ragged_all_to_all buffer,
        model.moe_a2a_buffer_factor > 0) `dropped` (fraction of pairs over capacity / buffer).
        """
        b, t, d = x.shape
        cfg = self.cfg
        x = x.astype(self.dtype)
        logits = jnp.einsum("btd,de->bte", x.astype(jnp.float32), weight(self.router, jnp.float32))
        logits = sharding.constrain(logits, ("batch", "res_seq", None))
        weights, ids = route(logits, self.bias[...], cfg, expert_ids)  # [B, T, k]
        validf = valid.astype(jnp.float32)
        z = (jax.nn.logsumexp(logits, axis=-1) ** 2 * validf).sum() / jnp.maximum(validf.sum(), 1.0)
        own = ids if expert_ids is None else route(logits, self.bias[...], cfg)[1]
        stats = dict(load=load_fraction(ids, valid, cfg.n_routed_experts),
                     expert_ids=ids, router_ids=own, z=z)
        ctx = sharding.current()
        # under any mesh the experts run in a shard_map, also when they are not split: the TPU
        # grouped matmul is a Mosaic kernel, which XLA cannot partition by itself
        distributed = ctx is not None
        cf = float(getattr(cfg, "moe_capacity_factor", 0.0))
        dispatch = getattr(cfg, "moe_dispatch", "auto")
        buffer_factor = float(getattr(cfg, "moe_a2a_buffer_factor", 0.0))
        if distributed:
            y, dropped = expert_parallel_ffn(x, ids, weights,
                                              self.wg.get_value(), self.wu.get_value(), self.wd.get_value(), *ctx,
                                              capacity_factor=cf, dispatch=dispatch,
                                              buffer_factor=buffer_factor)
        else:
            y, dropped = local_experts_ffn(x.reshape(b * t, d), ids.reshape(b * t, -1),
                                           weights.reshape(b * t, -1), self.wg.get_value(),
                                           self.wu.get_value(), self.wd.get_value(), 0, cf, cfg.n_routed_experts)
            y = y.reshape(b, t, d)
        # a bounded ragged_all_to_all buffer can drop pairs too (zero on the all-gather path)
        truncating = distributed and buffer_factor > 0 and dispatch != "all_gather"
        if cf > 0 or truncating:  # fraction of the valid tokens' (token, expert) pairs dropped
            stats["dropped"] = (dropped.reshape(b, t) * validf).sum() / jnp.maximum(
                validf.sum() * ids.shape[-1], 1.0)
        if self.shared is not None:
            y = y + self.shared(x)
        return y, stats


def moe_layers(model) -> list[MoE]:
    """The MoE modules of a model in forward order (trunk, then MTP modules). With
    model.scan_layers the stacked layers are one MoE whose variables are `[layers, ...]`."""
    out = []
    stack = getattr(model, "moe_stack", None)
    blocks = list(model.layers) + ([stack] if stack is not None else []) + list(getattr(model, "mtp", []))
    for layer in blocks:
        mlp = layer.block.mlp if hasattr(layer, "block") else layer.mlp
        if isinstance(mlp, MoE):
            out.append(mlp)
    return out


def _rows(moe: MoE) -> int:
    """Layers one MoE module holds: 1, or the stack's length."""
    return moe.bias.shape[0] if moe.bias.ndim == 2 else 1


def update_router_bias(model, router_load, rate: float, mtp_router_load=None) -> None:
    """b += rate * sign(mean_load - load) for every trunk MoE layer (and MTP layer if given).

    router_load `[moe_layers, E]` as in aux["router_load"]; mtp_router_load
    `[num_mtp_layers, E]` as in aux["mtp_router_load"]. Updates in place, outside the gradient.
    """
    layers = moe_layers(model)
    n_mtp = sum(1 for m in getattr(model, "mtp", []) if isinstance(m.block.mlp, MoE))
    trunk = layers[: len(layers) - n_mtp]
    n_trunk = sum(_rows(m) for m in trunk)
    if router_load.shape[0] != n_trunk:
        raise ValueError(f"router_load has {router_load.shape[0]} rows, the model {n_trunk} MoE layers")
    modules, loads, row = list(trunk), [], 0
    for moe in trunk:
        n = _rows(moe)
        loads.append(router_load[row] if moe.bias.ndim == 1 else router_load[row:row + n])
        row += n
    if mtp_router_load is not None:
        modules += layers[len(trunk):len(trunk) + mtp_router_load.shape[0]]
        loads += [mtp_router_load[i] for i in range(mtp_router_load.shape[0])]
    for moe, load in zip(modules, loads, strict=True):
        load = jnp.asarray(load, jnp.float32)
        moe.bias[...] = moe.bias[...] + rate * jnp.sign(load.mean(-1, keepdims=True) - load)
