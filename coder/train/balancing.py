"""Aux-loss-free MoE load balancing as the trainer's post-update hook (DeepSeek-V3, sec. 2.1.2).

After each optimizer step every MoE layer's expert-selection bias moves by
`model.bias_update_rate * sign(mean load - load)` (coder.model.moe.update_router_bias), from the
step's routed load `[moe_layers, n_routed_experts]` that the loss passes through as the metric
`router_load` (and `mtp_router_load` for the MTP modules). The stages hand this hook to their
Trainer; the trainer itself knows nothing of MoE.
"""
from __future__ import annotations

from typing import Callable

from coder.model import moe
from coder.train import metrics as metrics_lib


def router_balancing(model_cfg) -> Callable:
    """`post_update(model, metrics) -> metrics` for coder.train.trainer.make_train_step: takes
    `router_load` / `mtp_router_load` out of the step's metrics, updates the router biases in
    place and logs `load_imbalance` (max / mean load of the worst layer: 1 = balanced). A model
    without MoE layers passes an empty `[0, E]` load: taken out, nothing updated."""
    rate = float(model_cfg.bias_update_rate)

    def post_update(model, metrics: dict) -> dict:
        metrics = dict(metrics)
        load, mtp_load = metrics.pop("router_load", None), metrics.pop("mtp_router_load", None)
        if load is not None and load.shape[0] > 0:
            moe.update_router_bias(model, load, rate, mtp_load)
            metrics["load_imbalance"] = metrics_lib.load_imbalance(load)
        return metrics

    return post_update
