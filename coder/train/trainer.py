"""The training loop every stage shares: one jit-compiled optimizer step over the mesh.

A stage builds a `Trainer` with its loss function, the filter of parameters it trains and its
post-update hook, then calls `fit(iterator)` (the LM stages, and GRPO, whose `GrpoRun` is the
iterator that turns finished rollout groups into batches):

    trainer = Trainer(config, stage_dir, loss_fn, trainable=nnx.Param, init_from=prev_ckpt,
                      data_iterator=it, post_update=balancing.router_balancing(config.model))
    trainer.fit(it, steps=config.train.steps)
    trainer.close()

`loss_fn(model, batch, rng) -> (loss, metrics)`:
  * `model` is the nnx module, rebuilt inside the jit from the current state;
  * `batch` is one micro-batch: a dict of arrays `[micro_batch, seq]` (docs/contracts.md),
    except `expert_ids` `[layers, micro_batch, seq, top_k]`;
  * `rng` is a key derived from (config.seed, step, micro-batch index): resumed runs draw the
    same randomness;
  * `loss` is a float32 scalar; `metrics` a dict of scalars with one optional special key:
      `weight`      the micro-batch's share of the step (e.g. its number of target tokens).
                    The step minimises sum_i weight_i * loss_i / sum_i weight_i over
                    micro-batches, so with weight = target count and loss = mean over targets,
                    accumulation equals the big batch exactly. Default 1 per micro-batch.
      `metric_weight` the weight of the micro-batch's averaged metrics, when they are means over
                    other units than the loss's (GRPO: means over its loss tokens, while
                    its loss is a sum over a constant); default `weight`.
    Every other metric is reduced over micro-batches (`reduce_metrics`): one named `*_max` by
    max, `*_tokens` (a count) by sum, the rest averaged with those weights, so a metric does not
    depend on how the step's rows are packed into micro-batches; what is not a
    scalar (the MoE's `router_load` `[moe_layers, n_routed_experts]`) must be consumed by the
    step's post-update hook (coder.train.balancing.router_balancing: the aux-loss-free bias
    update after the optimizer step, and the expert load imbalance it logs).

What the step does (`make_train_step`, one pure function): micro-batch loop (lax.scan) of value_and_grad over
the `trainable` parameters, weighted average, global-norm clipping and the optimizer update;
when the loss or the gradient norm is NaN/Inf the update is skipped (params, optimizer state
and the other variables unchanged), counted, and `config.train.max_nonfinite_steps` skipped steps in a
row stop the run with a RuntimeError. How it trades memory for communication (StepOptions):
gradient accumulation dtype, per-replica reduction, a compute-dtype copy of the parameters,
ZeRO over `data`, and the optimizer state in host memory between steps (`offloaded_optimizer`).

State and checkpoints: trainable params, the other model variables (router bias), optimizer
state, step, RNG key, each process's data-iterator state and the stage's tokenizer are saved by
coder.train.checkpoint into `{stage_dir}/checkpoints/{step}` (layout in docs/contracts.md). On
construction the latest checkpoint in stage_dir is restored (exact resume: every process gets
back its own data position; a checkpoint of another model config is an error naming the
variables); otherwise params come from `init_from` (a checkpoint directory; parameters the
checkpoint lacks, e.g. fresh MTP modules, keep their initialisation and are logged), otherwise
from the initialiser.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from coder.data.tokenizer import fingerprint, to_record
from coder.model import sharding
from coder.train import checkpoint as ckpt_lib
from coder.train import flat as flat_lib
from coder.train import hooks as hooks_lib
from coder.train import metrics as metrics_lib
from coder.train import state as state_lib
from coder.train.aot.hardware import CHIPS
from coder.train.optim import lr_schedule, make_optimizer

# Arrays whose batch axis is not the first one (router replay ids are [layers, B, T, top_k]).
BATCH_AXIS = {"expert_ids": 1, "mtp_expert_ids": 1}
# The token axis of the batch leaves large enough to split over the "seq" mesh axes too: the
# engine's expert ids `[moe_layers, B, T, top_k]` are ~1000x a row's token ids (60 layers x 8
# experts of Kimi K2: 128 rows of 256k tokens are 128 GiB of int32 split over rows alone).
SEQ_AXIS = {"expert_ids": 2, "mtp_expert_ids": 2}


def batch_spec(name: str, shape: tuple, batch_axes, seq_axes, axis_size) -> tuple:
    """The PartitionSpec entries of batch leaf `name` of `shape`: its rows (BATCH_AXIS) over
    `batch_axes`, and for SEQ_AXIS leaves its tokens over `seq_axes` when they divide them
    (`axis_size(axes) -> devices`); None elsewhere."""
    spec = [None] * len(shape)
    spec[BATCH_AXIS.get(name, 0)] = batch_axes or None
    ax = SEQ_AXIS.get(name)
    if ax is not None and seq_axes and shape[ax] % axis_size(seq_axes) == 0:
        spec[ax] = seq_axes
    return tuple(spec)


def split_microbatches(batch: dict, accum: int) -> dict:
    """`[B, ...]` arrays -> `[accum, B/accum, ...]` (batch axis per BATCH_AXIS).

    Micro-batch j takes rows j, j+accum, j+2*accum, ...: with rows sharded in contiguous blocks
    over the data axis, every device keeps contributing to every micro-batch.
    """
    out = {}
    for name, x in batch.items():
        ax = BATCH_AXIS.get(name, 0)
        b = x.shape[ax]
        x = x.reshape(x.shape[:ax] + (b // accum, accum) + x.shape[ax + 1:])
        out[name] = jnp.moveaxis(x, ax + 1, 0)
    return out


def _weighted_mean(ws, xs):
    """ws `[A]`, xs `[A, ...]` -> sum_i ws_i xs_i / sum ws (0 when every weight is 0)."""
    total = jnp.sum(ws)
    return jnp.tensordot(ws, xs.astype(jnp.float32), axes=1) / jnp.where(total > 0, total, 1.0)


def reduce_metrics(metrics: dict, ws) -> dict:
    """The step's metrics from the micro-batches' (`[A, ...]` each, weights `ws` `[A]`): `*_max`
    the max, `*_tokens` the sum, the rest the mean weighted by `metric_weight` when the loss_fn
    gives it (popped), else by `ws` (module docstring)."""
    metrics = dict(metrics)
    mw = metrics.pop("metric_weight", None)
    mw = ws if mw is None else jnp.asarray(mw, jnp.float32)

    def reduce(name, x):
        if name.endswith("_max"):
            return jnp.max(x, axis=0)
        if name.endswith("_tokens"):
            return jnp.sum(x.astype(jnp.float32), axis=0)
        return _weighted_mean(mw, x)

    return {k: reduce(k, v) for k, v in metrics.items()}


def _weighted_loss(loss_fn, graphdef, params, rest, batch, rng):
    """loss_fn on the module rebuilt from (graphdef, params, rest) -> (loss, (metrics, weight))."""
    model = nnx.merge(graphdef, params, rest)
    loss, metrics = loss_fn(model, batch, rng)
    metrics = dict(metrics)
    weight = jnp.asarray(metrics.pop("weight", 1.0), jnp.float32)
    return jnp.asarray(loss, jnp.float32), (metrics, weight)


def _split_rows(mb: dict, n: int) -> tuple[dict, dict]:
    """Micro-batch arrays `[b, ...]` -> `[n, b/n, ...]` on their batch axis (BATCH_AXIS), and the
    axis of `n` per array (vmap's in_axes). Rows are sharded over `data` in contiguous blocks
    and micro-batch j holds rows j, j+accum, ... (split_microbatches), so block r of a
    micro-batch lives on replica r: the reshape moves no data."""
    out, axes = {}, {}
    for name, x in mb.items():
        ax = BATCH_AXIS.get(name, 0)
        out[name] = x.reshape(x.shape[:ax] + (n, x.shape[ax] // n) + x.shape[ax + 1:])
        axes[name] = ax
    return out, axes


def _replicas(axis: str | None):
    """(mesh, rules, size) of mesh `axis` in the active sharding context, or None when the step
    runs without one, `axis` is None or of size 1 (nothing to reduce across)."""
    ctx = sharding.current()
    if axis is None or ctx is None:
        return None
    mesh, rules = ctx
    n = int(mesh.shape.get(axis, 1))
    return (mesh, rules, n) if n > 1 else None


def compute_copy(params, dtype):
    """`params` (an nnx.State) with every matrix the model multiplies in `dtype` cast to it: the
    parameters of ndim >= 2 not marked `float32_compute` (coder.model.layers.param); vectors
    (norm scales) and float32-compute ones (router, embedding table) keep their dtype."""
    def cast(v):
        if v.ndim < 2 or v.get_metadata().get("float32_compute", False) or v.dtype == dtype:
            return v
        return v.replace(v[...].astype(dtype))

    return jax.tree.map(cast, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _gathered_to_rules(params, mesh, rules, split_axes: tuple[str, ...]):
    """`params`, split further over `split_axes` than their logical axes' `rules` say
    (state.split_further), gathered to the rules' shardings. Each leaf is pinned to its split
    sharding first, so a cast before this (compute_copy) runs on the shards and the gather
    moves the cast dtype: left to sharding propagation, XLA:TPU gathered the float32
    parameters across DCN and cast after."""
    specs = sharding.state_specs(params, rules)

    def gather(x, spec):
        full = jax.sharding.NamedSharding(mesh, spec)
        x = jax.lax.with_sharding_constraint(x, state_lib.split_further(full, x.shape, split_axes))
        return jax.lax.with_sharding_constraint(x, full)

    return jax.tree.map(gather, params, specs)


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """How the step trades memory for communication, decoded once from the config
    (`from_config`) by the trainer and stage `compile` alike.

    grad_accum: micro-batches per step (train.grad_accum).
    accum_dtype: dtype of the micro-batch gradient sum (train.grad_accum_dtype).
    replica_axis: mesh axis whose gradients are summed per replica and reduced once per step
      (train.reduce_grads_once: "data"; `_replica_grads`).
    compute_dtype: the dtype the multiplied matrices are cast to once per step
      (train.cast_params_once: model.dtype; `compute_copy`).
    gather_params: mesh axes the parameters are split over beyond their rules and gathered once
      per step (train.params_over_data: ("data",); `_gathered_to_rules`).
    optimizer_over: mesh axes the optimizer moments are split over beyond their parameter's
      sharding (train.optimizer_over_data, or with the parameters by train.params_over_data).
    offload_optimizer: the optimizer state waits in pinned host memory between steps
      (train.offload_optimizer; `offloaded_optimizer`).
    """

    grad_accum: int = 1
    accum_dtype: Any = jnp.float32
    replica_axis: str | None = None
    compute_dtype: Any = None
    gather_params: tuple[str, ...] = ()
    optimizer_over: tuple[str, ...] = ()
    offload_optimizer: bool = False

    @classmethod
    def from_config(cls, config) -> "StepOptions":
        tc = config.train
        if int(tc.grad_accum) < 1:
            raise ValueError(f"train.grad_accum={tc.grad_accum} must be >= 1")
        if str(tc.grad_accum_dtype) not in ("float32", "bfloat16"):
            raise ValueError(f"train.grad_accum_dtype={tc.grad_accum_dtype!r}: choose 'float32' or 'bfloat16'")
        over_data = ("data",) if tc.params_over_data else ()
        return cls(grad_accum=int(tc.grad_accum), accum_dtype=jnp.dtype(str(tc.grad_accum_dtype)),
                   replica_axis="data" if tc.reduce_grads_once else None,
                   compute_dtype=jnp.dtype(config.model.dtype) if tc.cast_params_once else None,
                   gather_params=over_data,
                   optimizer_over=("data",) if tc.optimizer_over_data else over_data,
                   offload_optimizer=bool(tc.offload_optimizer))


def _accumulate(micro_grad, weighted, zeros, micro: dict, step_key, accum: int):
    """sum_i weighted(w_i, grad_i) over the micro-batches (one lax.scan) -> (grad_sum, losses,
    metrics, weights), the last three stacked over micro-batches `[accum, ...]`."""
    def body(grad_sum, xs):
        mb, i = xs
        (loss, (metrics, w)), g = micro_grad(mb, jax.random.fold_in(step_key, i))
        grad_sum = jax.tree.map(lambda s, x: s + weighted(w, x).astype(s.dtype), grad_sum, g)
        return grad_sum, (loss, metrics, w)

    grad_sum, (losses, metrics, ws) = jax.lax.scan(body, zeros, (micro, jnp.arange(accum)))
    return grad_sum, losses, metrics, ws


def _local_grads(grad_fn, wparams, rest, params, micro, step_key, opts: StepOptions):
    """The micro-batch loop left to the partitioner: every micro-batch's gradient is reduced
    over the data-parallel replicas inside the loop. -> (grad_sum, losses `[A]`, metrics, ws `[A]`)."""
    zeros = jax.tree.map(lambda p: jnp.zeros_like(p, dtype=opts.accum_dtype), params)
    return _accumulate(lambda mb, rng: grad_fn(wparams, rest, mb, rng), lambda w, g: w * g, zeros, micro,
                       step_key, opts.grad_accum)


def _replica_grads(grad_fn, wparams, rest, params, micro, step_key, opts: StepOptions, replicas):
    """train.reduce_grads_once: each replica's rows of a micro-batch go through a `jax.vmap` over
    the replica axis (`spmd_axis_name`; inside it the model's rules do not name the axis), the
    gradient sum keeps a leading replica dimension `[replicas, ...]` split over the axis (each
    device holds what it held before), and one reduction over the axis follows the loop: once
    per step where the partitioner reduces every micro-batch (across DCN between slices). Equal
    to `_local_grads` up to float rounding; the loss_fn's rng is split per replica.
    -> (grad_sum, losses `[A * n]`, metrics, ws `[A * n]`)."""
    mesh, rules, n = replicas
    axis = opts.replica_axis
    name = next(iter(micro))
    rows = micro[name].shape[BATCH_AXIS.get(name, 0) + 1]
    if rows % n:
        raise ValueError(f"train.reduce_grads_once: a micro-batch of {rows} rows does not split over "
                         f"mesh.{axis}={n}: make data.batch_size / train.grad_accum a multiple of {n}")

    def micro_grad(mb, rng):
        mb, axes = _split_rows(mb, n)
        with sharding.replica_vmap(axis):
            f = jax.vmap(grad_fn, in_axes=(None, None, axes, 0), spmd_axis_name=axis)
            return f(wparams, rest, mb, jax.random.split(rng, n))

    def weighted(w, g):  # w [n], g [n, ...]
        return w.reshape(w.shape + (1,) * (g.ndim - 1)) * g

    def replica_zeros(p, spec):
        if axis in jax.tree.leaves(tuple(spec)):
            raise ValueError(f"train.reduce_grads_once: parameter sharded over mesh.{axis} ({spec}); the "
                             f"per-replica gradient sum needs parameters whole on each replica (drop "
                             f"{axis!r} from the parameter rules)")
        z = jnp.zeros((n,) + p.shape, opts.accum_dtype)
        return jax.lax.with_sharding_constraint(
            z, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(axis, *spec)))

    zeros = jax.tree.map(replica_zeros, params, sharding.state_specs(params, rules))
    grad_sum, losses, metrics, ws = _accumulate(micro_grad, weighted, zeros, micro, step_key, opts.grad_accum)
    flat = lambda x: x.reshape((-1,) + x.shape[2:])  # [accum, n, ...] -> [accum * n, ...]
    # the one reduction over replicas, in the accumulator's dtype (it crosses DCN between slices)
    return jax.tree.map(lambda g: g.sum(0), grad_sum), flat(losses), jax.tree.map(flat, metrics), flat(ws)


def make_train_step(graphdef, loss_fn: Callable, tx, *, key, options: StepOptions = StepOptions(),
                    trainable=nnx.Param, schedule: Callable | None = None,
                    post_update: Callable | None = None) -> Callable:
    """The optimizer step every stage runs, as a pure function (the trainer jits it; stage
    `compile` lowers the same function for a TPU slice):

        step(params, rest, opt_state, step, batch) -> (params, rest, opt_state, metrics)

    params / rest: `nnx.split(model, trainable, ...)` of the model built from `graphdef`;
    batch: dict of `[grad_accum * micro_batch, ...]` arrays (BATCH_AXIS for the exceptions);
    key: the run's base key, folded with the step and the micro-batch index.
    Micro-batch grads (`_local_grads`, or `_replica_grads` with options.replica_axis) are summed
    in options.accum_dtype, averaged with the loss_fn's `weight`s in float32, clipped and
    applied by `tx`; a non-finite loss or gradient norm keeps params, optimizer state and the
    other variables (metrics["skipped"] = 1).

    options.compute_dtype: the matrices the model multiplies in that dtype are cast once per
    step, before the micro-batch loop (`compute_copy`), and the gradients are taken w.r.t. the
    copy: FSDP gathers, the weight-gradient reductions and the gradient sum move that dtype,
    where a cast inside the loop made XLA convert every micro-batch's weight gradients to
    float32 and back. Costs a copy of those parameters in that dtype for the step.

    options.gather_params: the copy the loop differentiates is gathered from the parameters'
    further split (ZeRO over `data`, i.e. across slices) to the rules' shardings once per step,
    in compute_dtype when it is set, so the gather across DCN moves bf16 where ZeRO-1
    (optimizer_over_data alone) gathers the float32 parameters after the update. The
    gradients are reduce-scattered back to the parameters' split for the update.

    post_update(model, metrics) -> metrics: runs after the optimizer update on the module of
    the new parameters and the other variables, which it may update in place (aux-loss-free
    router balancing: coder.train.balancing.router_balancing); it takes the metrics it
    consumes (`router_load`) and may add its own. Every metric left must be a scalar.
    """
    grad_fn = jax.value_and_grad(functools.partial(_weighted_loss, loss_fn, graphdef), has_aux=True)
    opts = options

    def train_step(params, rest, opt_state, step, batch):
        step_key = jax.random.fold_in(key, step)
        micro = split_microbatches(batch, opts.grad_accum)
        wparams = params if opts.compute_dtype is None else compute_copy(params, opts.compute_dtype)
        if opts.gather_params and sharding.current() is not None:
            wparams = _gathered_to_rules(wparams, *sharding.current(), opts.gather_params)
        replicas = _replicas(opts.replica_axis)
        if replicas is None:
            grad_sum, losses, metrics, ws = _local_grads(grad_fn, wparams, rest, params, micro, step_key, opts)
        else:
            grad_sum, losses, metrics, ws = _replica_grads(grad_fn, wparams, rest, params, micro, step_key,
                                                           opts, replicas)
        total_w = jnp.sum(ws)
        grads = jax.tree.map(lambda g, p: (g.astype(jnp.float32) / jnp.where(total_w > 0, total_w, 1.0)
                                           ).astype(p.dtype), grad_sum, params)
        loss = _weighted_mean(ws, losses)
        metrics = reduce_metrics(metrics, ws)
        grad_norm = optax.tree.norm(grads)
        ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

        def keep_if_bad(new, old):
            return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)

        updates, new_opt = tx.update(grads, opt_state, params)
        new_params = keep_if_bad(optax.apply_updates(params, updates), params)
        new_opt = keep_if_bad(new_opt, opt_state)
        new_rest = rest
        if post_update is not None:
            model = nnx.merge(graphdef, new_params, rest)
            metrics = post_update(model, metrics)
            new_rest = keep_if_bad(nnx.split(model, trainable, ...)[2], rest)
        wide = {k: v.shape for k, v in metrics.items() if jnp.ndim(v)}
        if wide:
            raise ValueError(f"the loss_fn's metrics {wide} are not scalars: a post_update hook consumes "
                             "them (router_load: coder.train.balancing.router_balancing)")
        out = {**metrics, "loss": loss, "grad_norm": grad_norm, "skipped": (~ok).astype(jnp.int32)}
        if schedule is not None:
            out["lr"] = schedule(step)
        return new_params, new_rest, new_opt, out

    return train_step


def offloaded_optimizer(step_fn: Callable, opt_shardings) -> tuple[Callable, Any]:
    """`step_fn` (make_train_step's) taking and returning the optimizer state in pinned host
    memory (train.offload_optimizer): the step moves it to the devices for the update and back,
    so it holds HBM only around the update, not through the forward and backward passes
    (XLA schedules the copies). `opt_shardings`: the state's device shardings.

    Returns (the step, the state's host shardings: its place between steps)."""
    host = jax.tree.map(lambda s: s.with_memory_kind("pinned_host"), opt_shardings)
    device = jax.tree.map(lambda s: s.with_memory_kind("device"), opt_shardings)

    def step(params, rest, opt_state, step_, batch):
        opt_state = jax.device_put(opt_state, device)
        params, rest, opt_state, metrics = step_fn(params, rest, opt_state, step_, batch)
        return params, rest, jax.device_put(opt_state, host), metrics

    return step, host


class Trainer:
    """Model, optimizer, checkpoints and the jit-compiled step of one stage (module docstring).

    Args:
      config: the full run config (train, model, mesh, seed sections are read here).
      stage_dir: `{workdir}/{stage}`; checkpoints go to `{stage_dir}/checkpoints`, metrics to
        `{stage_dir}/metrics.jsonl` and `{stage_dir}/tb/`.
      loss_fn: `loss_fn(model, batch, rng) -> (loss, metrics)` (module docstring).
      trainable: nnx filter of the parameters that get gradients and optimizer state (default
        every nnx.Param; e.g. coder.train.distill.MTP_PARAMS for the MTP heads only).
      init_from: checkpoint directory to take the model's variables from when stage_dir has no
        checkpoint yet (fresh optimizer; missing / unexpected names are logged).
      data_iterator: an iterator with `get_state()` / `set_state(state)`; its position is saved
        in each checkpoint and restored here. `fit` uses it when no iterator is passed.
      model_fn: `() -> nnx.Module`; default `Transformer(config.model, rngs=nnx.Rngs(seed))`.
      stage: name used in logs (default: basename of stage_dir).
      tokenizer: the tokenizer the batches were encoded with (coder.data.tokenizer); written
        into every checkpoint, and a resumed checkpoint must have the same one.
    """

    def __init__(
        self,
        config,
        stage_dir: str,
        loss_fn: Callable,
        *,
        trainable=nnx.Param,
        init_from: str = "",
        data_iterator=None,
        model_fn: Callable[[], nnx.Module] | None = None,
        stage: str | None = None,
        tokenizer=None,
        post_update: Callable | None = None,
    ):
        self.config = config
        self.stage_dir = ckpt_lib.absolute(stage_dir)
        self.stage = stage or os.path.basename(self.stage_dir.rstrip("/"))
        self.loss_fn = loss_fn
        self.trainable = trainable
        self.data_iterator = data_iterator
        self.tokenizer = tokenizer  # saved in every checkpoint (see save)
        self._tokenizer_record = None
        tc = config.train
        self.options = StepOptions.from_config(config)
        self.grad_accum = self.options.grad_accum
        self.max_nonfinite = int(tc.max_nonfinite_steps)

        self.mesh = sharding.make_mesh(config.mesh)
        self.rules = state_lib.rules_of(config)
        self._default_model = model_fn is None
        model = state_lib.build_model(config, self.mesh, model_fn=model_fn)
        self.ckpt = ckpt_lib.Checkpointer(
            os.path.join(self.stage_dir, "checkpoints"), keep=int(tc.keep_checkpoints)
        )
        latest = self.ckpt.latest_step()
        self.init_report = None
        if latest is None and init_from:
            self.init_report = state_lib.load_into(model, init_from)
        self.tx = make_optimizer(tc)
        self._schedule = lr_schedule(tc)
        try:
            self.state = state_lib.init_state(model, self.tx, trainable, self.mesh, seed=int(config.seed),
                                              optimizer_over=self.options.optimizer_over,
                                              params_over=self.options.gather_params)
        except ValueError as e:
            raise ValueError(f"stage {self.stage}: {e}") from None
        self._saved_step = None
        if latest is not None:
            self._restore(latest)

        shard_of = lambda t: jax.tree.map(lambda x: x.sharding, t)
        st = self.state
        self._step = make_train_step(st.graphdef, loss_fn, self.tx, key=st.key, options=self.options,
                                     trainable=trainable, schedule=self._schedule, post_update=post_update)
        step_fn, opt_sh = self._step, shard_of(st.opt_state)
        if self.options.offload_optimizer:
            step_fn, opt_sh = offloaded_optimizer(step_fn, opt_sh)
            st.opt_state = jax.device_put(st.opt_state, opt_sh)
        self._jit_step = jax.jit(
            step_fn,
            out_shardings=(shard_of(st.params), shard_of(st.rest), opt_sh, None),
            donate_argnums=(0, 1, 2),
        )
        self._jit_eval = jax.jit(self._eval)
        self.writer = metrics_lib.MetricsWriter(self.stage_dir, self.stage,
                                                resume_step=st.step if latest is not None else None)
        self._preemption = hooks_lib.Preemption()  # a SIGTERM seen stays seen across fits
        self._peak_flops = None
        n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(st.params))
        logging.info(
            "[%s] process %d/%d, %d devices, mesh %s, %d trainable params, step %d",
            self.stage, jax.process_index(), jax.process_count(), jax.device_count(),
            dict(self.mesh.shape), n_params, st.step,
        )

    # ------------------------------------------------------------------ state access
    params = property(lambda self: self.state.params,
                      lambda self, v: setattr(self.state, "params", v))
    rest = property(lambda self: self.state.rest, lambda self, v: setattr(self.state, "rest", v))
    opt_state = property(lambda self: self.state.opt_state,
                         lambda self, v: setattr(self.state, "opt_state", v))
    step = property(lambda self: self.state.step)
    nonfinite_total = property(lambda self: self.state.nonfinite_total)
    nonfinite_run = property(lambda self: self.state.nonfinite_run)

    @property
    def model(self) -> nnx.Module:
        """The current model (a fresh module view of the trainer's arrays; do not mutate)."""
        return self.state.model

    @property
    def checkpoint_dir(self) -> str:
        return self.ckpt.directory

    # ------------------------------------------------------------------ checkpoints
    def save(self, force: bool = False):
        """Checkpoint the current step (async). No-op when this step is already saved.

        Every process saves its own data-iterator position; the tokenizer (when the trainer has
        one) travels with every checkpoint (coder.train.checkpoint's layout)."""
        st = self.state
        if self._saved_step == st.step:
            return
        data_state = None
        if self.data_iterator is not None and hasattr(self.data_iterator, "get_state"):
            data_state = self.data_iterator.get_state()
        if self.tokenizer is not None and self._tokenizer_record is None:
            self._tokenizer_record = to_record(self.tokenizer)
        self.ckpt.save(
            st.step,
            arrays={"model": st.flat_model(), "opt_state": flat_lib.tree_to_flat(st.opt_state)},
            meta={**st.meta(), "stage": self.stage},
            data_state=data_state,
            config=json.loads(self.config.to_json_best_effort()),
            tokenizer=self._tokenizer_record,
            force=force,
        )
        self._saved_step = st.step

    def _restore(self, step: int):
        """This stage's checkpoint `step`: arrays, counters, this process's data position. A
        checkpoint of another model config, or with another tokenizer than the trainer's, is a
        ValueError naming the difference and the directory."""
        st = self.state
        try:
            restored = self.ckpt.restore(
                step, {"model": {**state_lib.abstract_flat(st.params), **state_lib.abstract_flat(st.rest)},
                       "opt_state": state_lib.abstract_flat(st.opt_state)},
                data=self.data_iterator is not None,
            )
        except ValueError as e:  # another model config: the message names the variables
            raise ValueError(f"stage {self.stage}: {e}") from None
        if self.tokenizer is not None and restored.tokenizer is not None:
            mine, saved = fingerprint(self.tokenizer), restored.tokenizer.get("sha256")
            if mine != saved:
                raise ValueError(
                    f"[{self.stage}] the checkpoint {self.ckpt.directory}/{step} was written with "
                    f"tokenizer sha256 {str(saved)[:16]} ({restored.tokenizer.get('source')}), this "
                    f"trainer has sha256 {mine[:16]}: resume with the checkpoint's tokenizer "
                    "(coder.train.checkpoint.stage_tokenizer) or delete the checkpoint directory"
                )
        self.state = state_lib.restore_state(st, restored.arrays, restored.meta)
        self._saved_step = self.state.step
        if restored.data_state is not None and self.data_iterator is not None:
            self.data_iterator.set_state(restored.data_state)
        logging.info("[%s] resumed from %s/%d", self.stage, self.ckpt.directory, step)

    # ------------------------------------------------------------------ the step
    def _eval(self, params, rest, batch):
        loss, (metrics, weight) = _weighted_loss(self.loss_fn, self.state.graphdef, params, rest,
                                                 batch, jax.random.key(0))
        scalars = {k: v for k, v in metrics.items() if not jnp.ndim(v)}  # not router_load
        return {**scalars, "loss": loss, "weight": weight}

    # ------------------------------------------------------------------ public API
    def batch_row_shares(self) -> int:
        """Into how many parts the processes split a batch's rows (coder.model.sharding.batch_row_shares)."""
        return sharding.batch_row_shares(self.mesh, self.rules)

    def device_batch(self, batch: dict) -> dict:
        """Host-local numpy batch -> global jax arrays sharded over the batch mesh axes: each
        process's own rows, or the whole batch where every process feeds it (`batch_row_shares`)."""
        axes = sharding.mesh_axes_of("batch", self.rules)
        seq = sharding.mesh_axes_of("seq", self.rules)
        out = {}
        for name, x in batch.items():
            if not isinstance(x, (np.ndarray, jax.Array)):
                continue
            spec = batch_spec(name, x.shape, axes, seq, lambda a: math.prod(self.mesh.shape[n] for n in a))
            sh = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec(*spec))
            if isinstance(x, jax.Array):
                out[name] = jax.device_put(x, sh)
            else:
                out[name] = jax.make_array_from_process_local_data(sh, x)
        return out

    def train_step(self, batch: dict) -> dict:
        """One optimizer step on `batch` (dict of `[B, ...]` host arrays). Returns metrics.

        Metrics are jax scalars (loss, grad_norm, lr, skipped, load_imbalance when MoE, and the
        loss_fn's own). A skipped (non-finite) step still advances `step`; max_nonfinite_steps
        skipped steps in a row raise RuntimeError.
        """
        rows = next(iter(batch.values())).shape[0]
        if rows % self.grad_accum:
            raise ValueError(
                f"batch of {rows} rows does not split into train.grad_accum={self.grad_accum} "
                "micro-batches: make data.batch_size a multiple of train.grad_accum"
            )
        batch = self.device_batch(batch)
        st = self.state
        with sharding.activate(self.mesh, self.rules):
            st.params, st.rest, st.opt_state, metrics = self._jit_step(
                st.params, st.rest, st.opt_state, jnp.asarray(st.step, jnp.int32), batch
            )
        st.step += 1
        if int(metrics["skipped"]):
            st.nonfinite_total += 1
            st.nonfinite_run += 1
            logging.warning(
                "[%s] step %d: non-finite loss or gradient, update skipped (%d in a row)",
                self.stage, st.step, st.nonfinite_run,
            )
            if st.nonfinite_run >= self.max_nonfinite:
                self.save(force=True)
                self.ckpt.wait()
                raise RuntimeError(
                    f"[{self.stage}] {st.nonfinite_run} non-finite steps in a row at step "
                    f"{st.step} (train.max_nonfinite_steps={self.max_nonfinite}): lower "
                    "train.lr, check the data, or raise train.max_nonfinite_steps"
                )
        else:
            st.nonfinite_run = 0
        return metrics

    def eval_step(self, batch: dict) -> dict:
        """loss_fn on `batch` without an update; returns its metrics plus loss and weight."""
        batch = self.device_batch(batch)
        with sharding.activate(self.mesh, self.rules):
            return self._jit_eval(self.state.params, self.state.rest, batch)

    def log(self, metrics: dict, *, total_steps: int | None = None, eta_s=None) -> dict:
        """Write `metrics` (scalars) for the current step to metrics.jsonl / TensorBoard / console."""
        scalars = {}
        for k, v in metrics.items():
            v = np.asarray(v)
            if v.ndim == 0:
                scalars[k] = v.item()
        scalars.setdefault("skipped_steps", self.state.nonfinite_total)
        return self.writer.write(self.step, scalars, total_steps=total_steps, eta_s=eta_s)

    def peak_flops(self) -> float:
        """Aggregate peak FLOP/s: config per-device peak, the TPU table, or a measured matmul."""
        if self._peak_flops is None:
            per_device = float(self.config.train.peak_flops)
            if per_device <= 0:
                kind = jax.devices()[0].device_kind
                per_device = next((c.peak_bf16_flops for c in CHIPS.values() if c.device_kind == kind), 0.0)
            if per_device > 0:
                self._peak_flops = per_device * jax.device_count()
            else:
                n = 512 if jax.devices()[0].platform == "cpu" else 4096
                self._peak_flops = metrics_lib.measure_peak_flops(n) * jax.process_count()
        return self._peak_flops

    def _flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs per trained token (coder.train.metrics.model_flops_per_token, the one
        definition stage `compile` reports too): 6 N + 3 A at this row length."""
        params = None
        if not self._default_model:  # a custom model: count its own matmul weights
            params = nnx.state(self.state.model, nnx.Param)
        return metrics_lib.model_flops_per_token(self.config.model, seq_len, params=params)

    def fit(self, iterator=None, steps: int | None = None, *, after_step: Callable | None = None,
            hooks: Sequence[hooks_lib.Hook] = ()) -> int:
        """Train until `steps` (default config.train.steps); returns the final step.

        The loop every training stage shares (LM stages and GRPO's learner): the step, then the
        hooks whose cadence is due (`fit_hooks`, coder.train.hooks): the log line every
        train.log_every steps, a checkpoint every train.ckpt_every steps and at the end; SIGTERM:
        finish the current step, save, raise Preempted (exit code 0).

        `iterator` yields batches (any iterator: a data pipeline, or a generator that collects
        rollouts). `after_step(trainer, metrics) -> dict | None` runs after every step (e.g. GRPO
        hands the new weights to its engine, runs the agent eval); `hooks` run after it, each on
        its cadence (`Hook(fn, every=N)`: `fn(trainer, info)` at steps N, 2N, ...). The scalars
        they return join that step's log record.
        """
        it = self.data_iterator if iterator is None else iterator
        steps = int(self.config.train.steps if steps is None else steps)
        hooks = self.fit_hooks(after_step, hooks)
        with hooks_lib.running(hooks, self):
            while self.step < steps:
                try:
                    batch = next(it)
                except StopIteration:
                    logging.warning("[%s] data exhausted at step %d", self.stage, self.step)
                    break
                metrics = self.train_step(batch)
                info = hooks_lib.StepInfo(self.step, steps, metrics, batch, it)
                for hook in hooks:
                    hook.observe(self, info)
                    if hook.due(info):
                        info.record.update(hook(self, info) or {})
        return self.step

    def fit_hooks(self, after_step: Callable | None = None, hooks=()) -> list[hooks_lib.Hook]:
        """`fit`'s hooks in the order they run after a step: the caller's (`after_step`, then
        `hooks`), whose scalars join the log line, then the trainer's own: the log line,
        preemption, the checkpoint cadence (coder.train.hooks)."""
        tc = self.config.train
        caller = ([hooks_lib.after_step(after_step)] if after_step is not None else []) + list(hooks)
        own = [hooks_lib.MetricsLog(tc.log_every), self._preemption, hooks_lib.Checkpoint(every=tc.ckpt_every)]
        return caller + own

    def close(self):
        """Wait for pending checkpoint writes and close the writers."""
        self.ckpt.close()
        self.writer.close()

