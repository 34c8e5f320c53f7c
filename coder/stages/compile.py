"""Stage `compile`: ahead-of-time compile the real training step for a real TPU topology.

    python main.py --config=configs/kimi_k2_1t.py --config.stage=compile \
        --config.compile.topology=v5p-512 --config.mesh.num_slices=1

runs on any machine with the `tpu` extra (libtpu): libtpu describes the target slice's chips as
compile-only devices (coder.train.aot.hardware), the step is lowered over a mesh of those devices
with abstract (never allocated) parameters, optimizer state and batch, XLA's TPU compiler
compiles it, and the stage writes report.json and report.md to `compile.report_dir` (default
`{workdir}/compile`):

  memory      per-chip bytes of parameters, optimizer state, batch, activations/temporaries
              (XLA's memory_analysis) and the total against the chip's HBM -> fits or not;
  cost        FLOPs and bytes accessed per step per chip (XLA's cost_analysis, corrected for
              loop trip counts, see below);
  collectives count and bytes by kind (all-reduce, all-gather, reduce-scatter, all-to-all,
              collective-permute, and DCN transfers between slices) in the compiled HLO;
  roofline    step time bounds from the chip's published peak FLOP/s, HBM and ICI/DCN
              bandwidths (coder.train.aot.hardware) and the MFU they imply.

Loops: XLA's cost analysis counts a while loop's body once; coder.train.aot.hlo_stats walks the
compiled HLO and adds (trips - 1) x each loop body's matmul FLOPs and bytes (see there).

A configuration that does not fit or does not compile is reported as such (the report says
why and what to change) instead of raising, so a sweep over topologies finishes.

The step compiled is the trainer's own (coder.train.trainer.make_train_step, with the pretraining
loss), with the optimizer moments sharded like their parameters
(coder.train.state.opt_state_shardings). `train.offload_optimizer` keeps them in pinned host
memory between steps (moved in and out around the update), as the trainer does. With
`compile.engine` the RL engine's prefill and decode programs are compiled beside it on the same
mesh (`lower_engine`), and with `compile.grpo` the GRPO learner's step (`lower_grpo_step`): the
same trainer step with coder.rl.grpo.grpo_loss_fn as coder.rl.learner.Learner configures it
(router replay, staleness mask) on the GRPO batch (behaviour / reference logprobs, staleness, advantages, the engine's
expert ids), `compile.grpo_batch` x `compile.grpo_seq_len` tokens; its model FLOPs leave out
the MTP modules, which the GRPO loss does not run.

GPU targets (`compile.topology` = "h100", "h100-8", "h100-8x32": GPUs per node x nodes; h200,
b200; coder.train.aot.hardware) compile through XLA:GPU on compile-only devices of jax's CUDA
plugin (the `gpu-compile` extra; the stage names what to install when it is missing), with CUB's
radix sort off (`hardware.compiler_options`). XLA:GPU states no cost analysis there, so
`analyse_gpu` counts FLOPs and bytes off the optimized HLO (coder.train.aot.gpu_stats: the
matmuls, coder's Triton flash kernels from their shapes), puts collectives inside a node at
NVLink and across nodes at InfiniBand, fits the step against the memory JAX preallocates (75%
of HBM), and adds the roofline at the rates measured on an H100 where there are some.

report.md is rendered from the report by coder.stages.compile_report.
"""
from __future__ import annotations

import json
import logging
import math
import re
import sys
import time
import traceback
from typing import Any, NamedTuple

import fsspec
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from coder.infer.engine import Engine
from coder.model import Transformer, count_params, expert_dispatch, sharding
from coder.rl import grpo
from coder.rl.actor import engine_mesh, engine_rules, serving_dtype
from coder.rl.learner import check_shared_prefix
from coder.stages import check_batch
from coder.stages.compile_report import _count, _gib, to_markdown
from coder.train import metrics
from coder.train.aot import gpu_stats, hardware
from coder.train.aot.hlo_stats import (  # noqa: F401  (re-exported: the report's building blocks)
    collective_stats,
    group_size,
    loop_corrected_cost,
    multiplicities,
    parse_hlo,
    traffic_by_source,
)
from coder.train.balancing import router_balancing
from coder.train.distill import MTP_PARAMS, distill_loss_fn
from coder.train.losses import lm_loss_fn
from coder.train.optim import lr_schedule, make_optimizer
from coder.train.state import opt_state_shardings, split_shardings
from coder.train.trainer import StepOptions, batch_spec, make_train_step, offloaded_optimizer

# ============================================================================= report

def bytes_per_chip(tree) -> float:
    """Bytes one device holds of a pytree of sharded jax.ShapeDtypeStruct / arrays.

    The largest shard is what the busiest device holds (shards are equal unless a dimension
    does not divide the mesh, in which case XLA pads it).
    """

    total = 0.0
    for leaf in jax.tree.leaves(tree):
        shape = tuple(leaf.shape)
        sharding = getattr(leaf, "sharding", None)
        if sharding is not None:
            shape = sharding.shard_shape(shape)
        total += math.prod(shape) * jax.dtypes.itemsize_bits(leaf.dtype) / 8  # int4: half a byte
    return total


def memory_report(mem, hbm_bytes: int, *, params: float, optimizer: float,
                  batch: float) -> dict:
    """Per-chip bytes from XLA's CompiledMemoryStats, split into the parts a reader acts on."""
    args = float(mem.argument_size_in_bytes)
    out = float(mem.output_size_in_bytes)
    alias = float(mem.alias_size_in_bytes)
    temp = float(mem.temp_size_in_bytes)
    code = float(mem.generated_code_size_in_bytes)
    live = args + out - alias + temp + code  # donated outputs reuse their inputs' buffers
    peak = float(getattr(mem, "peak_memory_in_bytes", 0) or 0)
    total = max(live, peak)
    return dict(
        params_bytes=params, optimizer_bytes=optimizer, batch_bytes=batch,
        activations_temp_bytes=temp, arguments_bytes=args, outputs_bytes=out,
        alias_bytes=alias, generated_code_bytes=code, peak_bytes=peak, total_bytes=total,
        hbm_bytes=float(hbm_bytes), fraction_of_hbm=total / hbm_bytes,
        fits=bool(total <= hbm_bytes),
        host_bytes=dict(arguments=float(mem.host_argument_size_in_bytes),
                        outputs=float(mem.host_output_size_in_bytes),
                        temp=float(mem.host_temp_size_in_bytes)),
    )


def model_flops_per_step(model_cfg, batch: int, seq: int) -> float:
    """Model FLOPs of one training step: batch x seq tokens x 6 N + 3 A per token
    (coder.train.metrics.model_flops_per_token, the definition the training log's MFU uses)."""

    return batch * seq * metrics.model_flops_per_token(model_cfg, seq)


def gmm_scale(config, mesh, b: int, t: int) -> float:
    """The fraction of the TPU grouped matmuls' rows a balanced routing fills when the MoE layers
    see `[b, t]` tokens (coder.model.expert_dispatch.grouped_rows_fraction); 1 without routed experts."""

    if not int(config.model.n_routed_experts):
        return 1.0
    return expert_dispatch.grouped_rows_fraction(config.model, mesh, tuple(tuple(r) for r in config.mesh.rules), b, t)


def analyse(compiled, topo, *, params: float, optimizer: float, batch: float,
            model_flops: float, gmm_scale: float = 1.0) -> dict:
    """Memory, cost, collectives and roofline of a compiled step for topology `topo`.

    gmm_scale: the fraction of the grouped matmul kernels' rows the routing fills
    (`grouped_rows_fraction`; coder.train.aot.hlo_stats.kernel_costs)."""

    text = compiled.as_text()
    module = parse_hlo(text)
    runs, unknown = multiplicities(module)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    if cost is None:  # XLA:GPU compiled without a GPU states no cost: read it off the HLO
        return analyse_gpu(compiled, module, topo, params=params, optimizer=optimizer, batch=batch,
                           model_flops=model_flops, gmm_scale=gmm_scale)
    xla_flops = float(cost.get("flops", 0.0))
    xla_bytes = float(cost.get("bytes accessed", 0.0))
    flops, traffic = loop_corrected_cost(module, xla_flops, xla_bytes, gmm_scale)
    colls = collective_stats(module, runs, topo.num_chips, topo.num_slices)
    mem = memory_report(compiled.memory_analysis(), topo.chip.hbm_bytes, params=params,
                        optimizer=optimizer, batch=batch)
    return dict(
        memory=mem,
        cost=dict(xla_flops=xla_flops, xla_bytes_accessed=xla_bytes, flops=flops, gmm_scale=gmm_scale,
                  bytes_accessed=traffic, loops_with_unknown_trip_count=unknown,
                  top_traffic=traffic_by_source(module, runs),
                  hlo_instructions=sum(len(v) for v in module.computations.values())),
        collectives=colls,
        roofline=hardware.roofline(topo.chip, topo.num_chips, flops, traffic, colls, model_flops),
    )


def analyse_gpu(compiled, module, topo, *, params: float, optimizer: float, batch: float,
                model_flops: float, gmm_scale: float = 1.0) -> dict:
    """`analyse` of a step XLA:GPU compiled for a GPU topology (coder.train.aot.hardware.GpuTopology),
    whose `cost_analysis()` is None: FLOPs and bytes counted off the optimized HLO
    (coder.train.aot.gpu_stats.step_cost: the matmuls, the flash and grouped matmul kernels from
    their shapes, the latter at the routed rows' fraction `gmm_scale`, HBM
    traffic per instruction, loop trips), collectives inside a node at NVLink and across nodes
    at InfiniBand (gpu_stats.collective_stats), the fit against the memory JAX's allocator
    preallocates (the chip's pool_bytes, 75% of HBM), not the whole HBM. Where the chip has
    measured rates (hardware.MEASURED) `roofline_measured` is the roofline at them."""

    runs, unknown = multiplicities(module)
    chip = topo.chip
    cost = gpu_stats.step_cost(module, runs, chip.l2_bytes, gmm_scale)
    colls = gpu_stats.collective_stats(module, runs, topo.num_chips, topo.gpus_per_node)
    mem = memory_report(compiled.memory_analysis(), chip.pool_bytes, params=params, optimizer=optimizer,
                        batch=batch)
    mem.update(device_hbm_bytes=float(chip.hbm_bytes), pool_fraction=chip.pool_fraction)
    out = dict(
        memory=mem,
        cost=dict(xla_flops=0.0, xla_bytes_accessed=0.0, flops=cost["flops"], gmm_scale=gmm_scale,
                  bytes_accessed=cost["bytes_accessed"], matmul_flops=cost["matmul_flops"],
                  kernel_flops=cost["kernel_flops"], kernel_bytes=cost["kernel_bytes"],
                  uncounted_kernels=cost["uncounted_kernels"], loops_with_unknown_trip_count=unknown,
                  top_traffic=traffic_by_source(module, runs),
                  hlo_instructions=sum(len(v) for v in module.computations.values()), source="hlo"),
        collectives=colls,
        roofline=hardware.roofline(chip, topo.num_chips, cost["flops"], cost["bytes_accessed"], colls, model_flops),
    )
    rates = gpu_stats.measured_rates(chip.name)
    if rates:
        out["roofline_measured"] = gpu_stats.roofline_at_rates(chip, topo.num_chips, cost, colls, model_flops,
                                                               **rates)
    return out


def write_report(report: dict, out_dir: str) -> str:
    """report.json + report.md in `out_dir` (a local path or fsspec URL, gs://...); returns the
    JSON path."""
    fs, root = fsspec.core.url_to_fs(out_dir)
    fs.makedirs(root, exist_ok=True)
    with fs.open(f"{root.rstrip('/')}/report.json", "w") as f:
        json.dump(report, f, indent=1, sort_keys=False, default=str)
    with fs.open(f"{root.rstrip('/')}/report.md", "w") as f:
        f.write(to_markdown(report))
    return f"{out_dir.rstrip('/')}/report.json"


# ============================================================================= the training step

def _with_shardings(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        tree, shardings)


class AbstractState(NamedTuple):
    """The trainer's model state over a mesh, never allocated: `nnx.split(model, nnx.Param, ...)`
    as jax.ShapeDtypeStruct leaves carrying their NamedShardings (p_sh / r_sh: those shardings)."""

    graphdef: Any
    params: Any
    rest: Any
    p_sh: Any
    r_sh: Any


def abstract_state(config, mesh, trainable=None) -> AbstractState:
    """The model of `config.model` split and sharded by `config.mesh.rules` over `mesh`, abstract;
    `params` are the `trainable` parameters (default every nnx.Param; the mtp stage's
    coder.train.distill.MTP_PARAMS), `rest` everything else, as the trainer splits them."""


    rules = tuple(tuple(r) for r in config.mesh.rules)
    abstract = nnx.eval_shape(lambda: Transformer(config.model, rngs=nnx.Rngs(int(config.seed))))
    graphdef, params, rest = nnx.split(abstract, nnx.Param if trainable is None else trainable, ...)
    # train.params_over_data splits the parameters further, as coder.train.state.init_state
    p_sh = split_shardings(_with_shardings(params, sharding.state_shardings(params, mesh, rules)),
                           StepOptions.from_config(config).gather_params)
    r_sh = sharding.state_shardings(rest, mesh, rules)
    return AbstractState(graphdef, _with_shardings(params, p_sh), _with_shardings(rest, r_sh), p_sh, r_sh)


def _rows(mesh, rules, shape: tuple, dtype, name: str = ""):
    """An abstract batch leaf `name` placed as the trainer's device_batch places it: its rows
    over the "batch" mesh axes (coder.train.trainer.batch_spec: axis 1 of the expert ids, and
    their tokens over the "seq" axes too)."""


    spec = batch_spec(name, shape, sharding.mesh_axes_of("batch", rules), sharding.mesh_axes_of("seq", rules),
                      lambda a: math.prod(mesh.shape[n] for n in a))
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, PartitionSpec(*spec)))


def _lower_step(config, mesh, state: AbstractState, loss_fn, batch: dict, trainable=None):
    """The trainer's step (coder.train.trainer.make_train_step) with `loss_fn`, the optimizer of
    config.train (moments sharded like their parameters, or offloaded to host memory with
    train.offload_optimizer: coder.train.trainer.offloaded_optimizer), lowered over `mesh` on
    `state` and the abstract `batch`.

    Returns (lowered, sizes): per-chip bytes of params (+ non-trained variables), optimizer
    state (0 when offloaded) and batch.
    """


    rules = tuple(tuple(r) for r in config.mesh.rules)
    params, rest, p_sh, r_sh = state.params, state.rest, state.p_sh, state.r_sh
    tx = make_optimizer(config.train)
    options = StepOptions.from_config(config)
    step_fn = make_train_step(state.graphdef, loss_fn, tx, key=jax.random.key(int(config.seed)), options=options,
                              trainable=nnx.Param if trainable is None else trainable,
                              schedule=lr_schedule(config.train), post_update=router_balancing(config.model))
    o_sh = opt_state_shardings(tx, params, mesh, options.optimizer_over)
    opt = _with_shardings(jax.eval_shape(tx.init, params), o_sh)
    step = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, PartitionSpec()))

    fn = step_fn
    if options.offload_optimizer:
        fn, o_sh = offloaded_optimizer(step_fn, o_sh)
        opt = _with_shardings(opt, o_sh)

    jitted = jax.jit(fn, out_shardings=(p_sh, r_sh, o_sh, None), donate_argnums=(0, 1, 2))
    with sharding.activate(mesh, rules):
        lowered = jitted.lower(params, rest, opt, step, batch)
    sizes = dict(params=bytes_per_chip(params) + bytes_per_chip(rest),
                 optimizer=0.0 if options.offload_optimizer else bytes_per_chip(opt),
                 batch=bytes_per_chip(batch))
    return lowered, sizes


def lower_train_step(config, mesh, *, loss_fn=None, trainable=None):
    """Lower the trainer's step over `mesh` with abstract state; returns (lowered, sizes).

    The pretraining loss by default (coder.train.losses.lm_loss_fn: pretrain, longctx and sft,
    whose loss_mask marks the assistant's tokens); the mtp stage passes its distillation loss and
    `trainable` (`lower_mtp_step`). batch: tokens, positions, segment_ids int32, loss_mask
    float32 `[data.batch_size, data.seq_len]`; sizes as `_lower_step`.
    """


    rules = tuple(tuple(r) for r in config.mesh.rules)
    b, t = int(config.data.batch_size), int(config.data.seq_len)
    batch = {k: _rows(mesh, rules, (b, t), dt) for k, dt in (
        ("tokens", jnp.int32), ("positions", jnp.int32), ("segment_ids", jnp.int32),
        ("loss_mask", jnp.float32))}
    state = abstract_state(config, mesh, trainable)
    return _lower_step(config, mesh, state, loss_fn or lm_loss_fn(config.train), batch, trainable)


def lower_mtp_step(config, mesh):
    """Lower the mtp stage's step (coder.stages.mtp: the trunk frozen, only the MTP modules
    trained, on coder.train.distill's loss) over `mesh`; returns (lowered, sizes) as
    `lower_train_step`: the optimizer state covers the MTP modules alone."""

    return lower_train_step(config, mesh, loss_fn=distill_loss_fn(float(config.mtp.ce_weight)),
                            trainable=MTP_PARAMS)


def mtp_model_flops(model_cfg, batch: int, seq: int) -> float:
    """Model FLOPs of one mtp-stage step: the frozen trunk's forward (2 N + A per token, no
    MTP modules) plus the MTP modules trained (6 N + 3 A of the trunk-and-modules count minus
    the trunk's), batch x seq tokens (coder.train.metrics.model_flops_per_token)."""

    trunk_fwd = metrics.model_flops_per_token(model_cfg, seq, training=False, mtp_modules=0)
    full = metrics.model_flops_per_token(model_cfg, seq)
    trunk = metrics.model_flops_per_token(model_cfg, seq, mtp_modules=0)
    return batch * seq * (trunk_fwd + full - trunk)


# ============================================================================= the GRPO learner step

def grpo_shape(config) -> tuple[int, int]:
    """(rows, sequence) of the compiled GRPO batch: compile.grpo_batch (0 = data.batch_size) and
    compile.grpo_seq_len (0 = rl.context_budget, the longest generation a row can hold, the
    learner's largest seq_bucket; data.seq_len when that is unset; grpo.shared_prefix_len, the
    packed rows' length, before those when set)."""
    cc = config.compile
    rows = int(cc.grpo_batch) or int(config.data.batch_size)
    shared = int(config.grpo.get("shared_prefix_len", 0))
    seq = int(cc.grpo_seq_len) or shared or int(config.rl.context_budget) or int(config.data.seq_len)
    return rows, seq


def routing_shape(state: AbstractState, mesh, rules, b: int, t: int) -> tuple[int, int]:
    """(moe_layers, top_k) of aux["expert_ids"] `[moe_layers, B, T, top_k]` of the model's
    forward (traced abstractly: the model's own count, dense-first layers and stacking included)."""


    tok = _rows(mesh, rules, (b, t), jnp.int32)

    def ids(params, rest, tok):
        return nnx.merge(state.graphdef, params, rest)(tok, tok, tok, mtp=False)[1]["expert_ids"]

    with sharding.activate(mesh, rules):
        shape = jax.eval_shape(ids, state.params, state.rest, tok).shape
    return int(shape[0]), int(shape[-1])


def lower_grpo_step(config, mesh):
    """Lower the GRPO learner's step over `mesh` with abstract state; returns (lowered, sizes, setup).

    The trainer's step (`_lower_step`, shared with `lower_train_step`) with
    `coder.rl.grpo.loss_fn_from_config`'s loss on the batch coder.rl.learner.Learner.batch feeds it, rows x
    seq from `grpo_shape`: tokens, positions, segment_ids int32, loss_mask, behaviour_logp,
    ref_logp float32, staleness int32 `[B, T]`; advantages float32 `[B]` (`[B, T]` and a
    prefix_segment int32 `[B, T]` with grpo.shared_prefix_len); for a model with MoE
    layers the engine's expert_ids int32 `[moe_layers, B, T, top_k]` (rows on axis 1), which the
    loss replays with grpo.router_replay and otherwise measures routing_mismatch against. The
    reference logprobs are an input: the learner computes them with a separate forward.
    setup: rows, seq_len, grad_accum, moe_layers, top_k, router_replay, max_staleness.
    """

    rules = tuple(tuple(r) for r in config.mesh.rules)
    state = abstract_state(config, mesh)
    b, t = grpo_shape(config)
    batch = {k: _rows(mesh, rules, (b, t), dt) for k, dt in (
        ("tokens", jnp.int32), ("positions", jnp.int32), ("segment_ids", jnp.int32),
        ("loss_mask", jnp.float32), ("behaviour_logp", jnp.float32), ("ref_logp", jnp.float32),
        ("staleness", jnp.int32)) if k != "ref_logp" or float(config.grpo.kl_coef) > 0}

    shared = check_shared_prefix(config)  # rows packed with a group's prompt once: per-token advantages
    batch["advantages"] = _rows(mesh, rules, (b, t) if shared else (b,), jnp.float32)
    if shared:
        batch["prefix_segment"] = _rows(mesh, rules, (b, t), jnp.int32)
    layers, k = routing_shape(state, mesh, rules, b, t)
    if layers:
        batch["expert_ids"] = _rows(mesh, rules, (layers, b, t, k), jnp.int32, "expert_ids")

    lowered, sizes = _lower_step(config, mesh, state, grpo.loss_fn_from_config(config), batch)
    setup = dict(rows=b, seq_len=t, tokens_per_step=b * t, grad_accum=int(config.train.grad_accum),
                 moe_layers=layers, top_k=k, router_replay=bool(config.grpo.router_replay and layers),
                 max_staleness=int(config.grpo.max_staleness))
    return lowered, sizes, setup


def grpo_model_flops(model_cfg, rows: int, seq: int, mtp_modules: int = 0) -> float:
    """Model FLOPs of one GRPO step: rows x seq tokens x (6 N + 3 A) of the trunk and
    `mtp_modules` MTP modules (coder.train.metrics.model_flops_per_token): the policy loss runs
    the trunk alone; the MTP refresh (grpo.mtp_weight > 0) adds every MTP module."""

    return rows * seq * metrics.model_flops_per_token(model_cfg, seq, mtp_modules=mtp_modules)


def _failure(e: Exception) -> dict:
    """A report entry for a failed lowering / compilation: does_not_fit (with memory_overflow)
    when XLA:TPU ran out of HBM, else compile_error; the message whitespace-collapsed."""
    msg = " ".join(str(e).split())
    oom = hbm_overflow(msg)
    entry = dict(status="does_not_fit" if oom else "compile_error", error=msg[:2000] or type(e).__name__)
    if oom:
        entry["memory_overflow"] = dict(used_bytes=oom[0], hbm_bytes=oom[1],
                                        fraction_of_hbm=oom[0] / oom[1])
    return entry


def compile_grpo(config, mesh, topo, hlo_dir: str = "") -> dict:
    """Compile and analyse the GRPO learner's step (`lower_grpo_step`) like the training step;
    a failure is recorded, not raised. Model FLOPs: `grpo_model_flops`. `hlo_dir`: where the
    compiled HLO goes (grpo_step.hlo.txt; "" = not saved)."""


    t0 = time.perf_counter()
    setup = None
    try:
        lowered, sizes, setup = lower_grpo_step(config, mesh)
        compiled = lowered.compile(compiler_options=hardware.compiler_options(topo))  # None on TPU
    except Exception as e:  # noqa: BLE001 (a report, not a crash, is the point of this stage)
        logging.error("compiling the GRPO step failed:\n%s", traceback.format_exc())
        out = _failure(e)
    else:
        out = analyse(compiled, topo, params=sizes["params"], optimizer=sizes["optimizer"],
                      batch=sizes["batch"],
                      model_flops=grpo_model_flops(config.model, setup["rows"], setup["seq_len"],
                                                   int(config.model.num_mtp_layers) if config.grpo.mtp_weight else 0),
                      gmm_scale=gmm_scale(config, mesh, setup["rows"] // int(config.train.grad_accum),
                                          setup["seq_len"]))
        out["status"] = "fits" if out["memory"]["fits"] else "does_not_fit"
        if hlo_dir:
            out["hlo_file"] = _save_hlo(compiled, hlo_dir, "grpo_step")
    if setup is not None:
        out["setup"] = setup
    out["compile_seconds"] = time.perf_counter() - t0
    return out


def lower_engine(config, mesh) -> tuple[dict, dict]:
    """Lower the RL engine's prefill, decode and group-copy programs over `mesh` with abstract weights.

    Returns ({"prefill": Lowered, "decode": Lowered, "copy": Lowered}, setup). Weights shard by the same rules
    as training; every store leaf (cache `[rows, slots, ...]`, logits, hidden) splits its rows
    over the batch mesh axes when they divide the rows, else is replicated.
    """


    rules = engine_rules(config)
    cc, rl = config.compile, config.rl
    rows = int(cc.engine_batch or rl.group_size)
    slots = int(cc.engine_max_len or rl.context_budget)
    prefill = int(cc.engine_prefill_len or min(2048, slots))
    model_cfg = config.model.copy_and_resolve_references()
    with model_cfg.unlocked():  # a training layout (whole-weight gathers for a few tokens per row)
        model_cfg.moe_shared_data_parallel = False
    abstract = nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(int(config.seed))))
    engine = Engine(abstract, model_cfg, max_len=slots, speculative_k=int(rl.speculative_k),
                    dtype=serving_dtype(config), quantization=rl.engine_quantization)
    state_sh = sharding.state_shardings(engine.weights.state, mesh, rules)  # the served form (quantized)
    axes = sharding.mesh_axes_of("batch", rules)
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    n = math.prod(mesh.shape[a] for a in axes)
    split = axes if axes and rows % n == 0 else None

    def store_sharding(leaf):
        return NamedSharding(mesh, PartitionSpec(split, *([None] * (leaf.ndim - 1))))

    with sharding.activate(mesh, rules):
        out = engine.lower(rows, slots, prefill, state_shardings=state_sh, store_sharding=store_sharding,
                           copy_rows=int(rl.group_size))
    per_chip = dict(params=bytes_per_chip(out["state"]), cache=bytes_per_chip(out["store"]))
    setup = dict(rows=rows, cache_slots=slots, prefill_len=prefill, speculative_k=int(rl.speculative_k),
                 rows_split_over=list(split or ()), **{f"{k}_bytes_per_chip": v for k, v in per_chip.items()})
    return {"prefill": out["prefill"], "decode": out["decode"], "copy": out["copy"]}, setup


def engine_model_flops(model_cfg, setup: dict) -> dict:
    """{"prefill", "decode"}: model FLOPs of one call of each engine program (lower_engine's
    setup: rows, prefill_len, cache_slots, speculative_k): forward-only model FLOPs per token
    (2 N + A, coder.train.metrics.model_flops_per_token with training=False) x the tokens it
    feeds, through the trunk and the speculative_k MTP modules the engine keeps current.
    prefill: rows x prefill_len tokens, a chunk from position 0 (causal attention within it);
    decode: rows x (speculative_k + 1) tokens, each attending to a full cache of cache_slots
    tokens. The drafts' own MTP passes are not counted.
    """

    rows, k = setup["rows"], setup["speculative_k"]
    prefill = metrics.model_flops_per_token(model_cfg, setup["prefill_len"], training=False, mtp_modules=k)
    decode = metrics.model_flops_per_token(model_cfg, k + 1, training=False, mtp_modules=k,
                                           context=setup["cache_slots"])
    return dict(prefill=rows * setup["prefill_len"] * prefill, decode=rows * (k + 1) * decode)


def engine_target(config, mesh, topo):
    """(mesh, topology) the engine is compiled for, with the engine's own mesh over its chips
    (coder.rl.actor.engine_mesh: expert / tensor / sequence as configured, rows over the rest), as
    the runtime builds it: the learner's slice (a colocated run, rl.topology.colocated: one engine over the
    learner job's devices), or `compile.engine_topology`'s slice (an RL actor's, rl.topology.actor_processes
    hosts)."""

    if not config.compile.engine_topology:
        return engine_mesh(config, list(mesh.devices.flat)), topo
    etopo = hardware.parse_topology(config.compile.engine_topology, 1)
    return engine_mesh(config, hardware.topology_devices(etopo)), etopo


def colocated_memory(config, engine: dict, grpo: dict) -> dict | None:
    """Per-chip device memory of a colocated run on the learner's slice (coder/rl/colocated.py),
    phase by phase, from the compiled programs (None unless all of them compiled):

      engine phase   the engine's larger program (weights, KV caches, temporaries) + what the
                     learner keeps on device meanwhile: its parameters, the frozen reference copy
                     (grpo.kl_coef > 0) and, unless rl.topology.offload_optimizer, the optimizer state
      learner phase  the GRPO step + the reference copy (the engine freed its memory at the
                     phase's end: Engine.settle(release=True))
    """
    progs = [engine.get(p) for p in ("prefill", "decode")]
    if not grpo.get("memory") or not all(p and p.get("memory") for p in progs):
        return None
    g = grpo["memory"]
    reference = g["params_bytes"] if float(config.grpo.kl_coef) > 0 else 0.0
    optimizer = 0.0 if config.rl.topology.offload_optimizer else g["optimizer_bytes"]
    engine_bytes = max(p["memory"]["total_bytes"] for p in progs)
    phases = dict(engine=engine_bytes + g["params_bytes"] + reference + optimizer,
                  learner=g["total_bytes"] + reference)
    hbm = g["hbm_bytes"]
    return dict(engine_phase_bytes=phases["engine"], learner_phase_bytes=phases["learner"],
                engine_program_bytes=engine_bytes, learner_params_bytes=g["params_bytes"],
                reference_bytes=reference, optimizer_on_device_bytes=optimizer,
                offload_optimizer=bool(config.rl.topology.offload_optimizer), hbm_bytes=hbm,
                fits=bool(max(phases.values()) <= hbm))


def compile_engine(config, mesh, topo, programs: tuple = ("prefill", "decode")) -> dict:
    """Compile and analyse the engine's programs; a failure is recorded per program.

    Model FLOPs of a program: `engine_model_flops`. The record names the engine's slice and mesh,
    and how each version reaches it: from the weight store, the bytes each host of it reads for a
    version written in full (an anchor: its chips' slices of the serving weights; a delta
    version is a fraction of it) and the seconds that takes at the host's data-centre network
    bandwidth (its chips' DCN figure in coder/train/aot/hardware.py); colocated (rl.topology.colocated,
    the learner's slice), the bytes per host of the on-device reshard of the learner's arrays (no
    store, no host hop).
    """


    t0 = time.perf_counter()
    try:
        lowered, setup = lower_engine(config, mesh)
    except Exception as e:  # noqa: BLE001 (a report, not a crash, is the point of this stage)
        logging.error("lowering the engine failed:\n%s", traceback.format_exc())
        return dict(status="compile_error", error=" ".join(str(e).split())[:2000])
    chips_per_host = math.prod(topo.chips_per_host_bounds)
    version_bytes = setup["params_bytes_per_chip"] * min(chips_per_host, topo.num_chips)
    out = dict(setup=setup, topology=topo.name, chips=topo.num_chips, hosts=max(1, topo.num_chips // chips_per_host),
               mesh={a: int(n) for a, n in mesh.shape.items()})
    if config.rl.topology.colocated and not config.compile.engine_topology:
        # the learner's arrays resharded chip to chip (coder.rl.weight_channel.OnDevice): no store
        out.update(weights_from="on_device", reshard_bytes_per_host=version_bytes)
    else:
        # a host reads its chips' slices over its data-centre network (the store: GCS or a
        # file system behind it), at most its chips' DCN bandwidth
        host_bw = topo.chip.dcn_bandwidth * min(chips_per_host, topo.num_chips)
        out.update(weights_from="store", store_read_bytes_per_host=version_bytes,
                   host_network_bytes_per_s=host_bw, store_read_seconds_per_host=version_bytes / host_bw)
    k = setup["speculative_k"]
    tokens = dict(prefill=setup["rows"] * setup["prefill_len"], decode=setup["rows"] * (k + 1))
    model_flops = engine_model_flops(config.model, setup)
    for name, low in lowered.items():
        if name not in programs:
            continue
        t1 = time.perf_counter()
        try:
            compiled = low.compile(compiler_options=hardware.compiler_options(topo))  # None on TPU
        except Exception as e:  # noqa: BLE001
            logging.error("compiling the engine's %s failed:\n%s", name, traceback.format_exc())
            entry = _failure(e)
        else:
            shape = (setup["rows"], setup["prefill_len"] if name == "prefill" else k + 1)
            entry = analyse(compiled, topo, params=setup["params_bytes_per_chip"], optimizer=0.0,
                            batch=setup["cache_bytes_per_chip"],
                            model_flops=model_flops.get(name, 0.0), gmm_scale=gmm_scale(config, mesh, *shape))
            if name == "copy":  # the serving weights stay on the chips beside it (it does not take them)
                mem = entry["memory"]
                mem["resident_params_bytes"] = setup["params_bytes_per_chip"]
                mem["total_bytes"] += setup["params_bytes_per_chip"]
                mem["fraction_of_hbm"] = mem["total_bytes"] / mem["hbm_bytes"]
                mem["fits"] = mem["total_bytes"] <= mem["hbm_bytes"]
            entry["status"] = "fits" if entry["memory"]["fits"] else "does_not_fit"
            lower_s = entry["roofline"]["step_time_lower_s"]
            entry["tokens_per_s_upper"] = tokens.get(name, 0) / lower_s if lower_s else 0.0
        entry["compile_seconds"] = time.perf_counter() - t1
        out[name] = entry
        logging.info("engine %s (%d rows, cache %d, k=%d) on %s: %s, %.1f GiB a chip, compiled in %.0f s", name,
                     setup["rows"], setup["cache_slots"], k, topo.name, entry.get("status"),
                     (entry.get("memory") or entry.get("memory_overflow") or {}).get(
                         "total_bytes", (entry.get("memory_overflow") or {}).get("used_bytes", 0.0)) / 2**30,
                     entry["compile_seconds"])
    out["compile_seconds"] = time.perf_counter() - t0
    return out


def _save_hlo(compiled, directory: str, name: str) -> str:
    """The compiled HLO as text beside the run (tens of MB at full size: not in the report);
    `directory` a local path or fsspec URL, as write_report's."""
    fs, root = fsspec.core.url_to_fs(directory)
    fs.makedirs(root, exist_ok=True)
    with fs.open(f"{root.rstrip('/')}/{name}.hlo.txt", "w") as f:
        f.write(compiled.as_text())
    return f"{directory.rstrip('/')}/{name}.hlo.txt"


def active_params(model_cfg) -> int:
    """N of a training step (coder.train.metrics.active_matmul_params): the matmul weights one
    token multiplies by, trunk + output head + MTP modules (with their use of the shared head),
    routed experts at top-k / n_routed, without the input embedding (a lookup, not a matmul)."""

    return int(round(metrics.active_matmul_params(model_cfg)))


_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def hbm_overflow(message: str) -> tuple[float, float] | None:
    """(used, capacity) bytes from XLA:TPU's out-of-memory compile error, else None.

    e.g. "Ran out of memory in memory space hbm. Used 120.53G of 95.74G hbm." or "the total
    memory required for HLO temporaries (4.97T) exceeds available HBM (95.74G)" (temporaries
    only: the lower bound XLA found before giving up).
    """
    for pattern in (r"Used ([\d.]+)([KMGT]?) of ([\d.]+)([KMGT]?) hbm",
                    r"required for HLO temporaries \(([\d.]+)([KMGT]?)\) exceeds available "
                    r"HBM \(([\d.]+)([KMGT]?)\)"):
        m = re.search(pattern, message)
        if m:
            return (float(m.group(1)) * _UNITS[m.group(2)],
                    float(m.group(3)) * _UNITS[m.group(4)])
    return None


def advice(report: dict, config) -> list[str]:
    """What to change when the step does not fit, or where its time goes (from the numbers)."""
    out = []
    m = report.get("memory")
    if m is None:
        o = report.get("memory_overflow")
        if o:
            out.append(f"XLA needs {_gib(o['used_bytes'])} GiB of the chip's "
                       f"{_gib(o['hbm_bytes'])} GiB HBM ({100 * o['fraction_of_hbm']:.0f}%)")
            if not config.train.offload_optimizer:
                out.append("train.offload_optimizer=True moves the Adam moments to host memory")
            if config.model.remat != "full":
                out.append("model.remat=full keeps only block inputs for the backward pass")
            out.append("more chips (fsdp x expert) divide the parameters and optimizer state; "
                       "a larger mesh.sequence (or mesh.tensor) divides a long row's activations")
        return out
    mesh = report["setup"]["mesh"]
    if not m["fits"]:
        over = m["total_bytes"] - m["hbm_bytes"]
        out.append(f"over HBM by {_gib(over)} GiB per chip")
        if m["optimizer_bytes"] > over and not config.train.offload_optimizer:
            out.append("train.offload_optimizer=True moves the optimizer state "
                       f"({_gib(m['optimizer_bytes'])} GiB per chip) to host memory")
        if m["activations_temp_bytes"] > over and config.model.remat != "full":
            out.append(f"model.remat=full (now {config.model.remat!r}) recomputes activations "
                       "in the backward pass instead of keeping them")
        if int(config.train.grad_accum) * 2 <= int(config.data.batch_size):
            out.append("a larger train.grad_accum shrinks the activations of each micro-batch")
        out.append(f"more chips: the parameters + optimizer state ({_gib(m['params_bytes'] + m['optimizer_bytes'])} "
                   f"GiB per chip on mesh {mesh}) shrink in proportion to the fsdp x expert size")
    f = report["roofline"]
    out.append(f"roofline: the step is {f['bound']}-bound ({f['step_time_lower_s']:.3g} s with "
               f"perfect overlap, {f['step_time_serial_s']:.3g} s without)")
    return out


def run(config, stage_dir: str, init_from: str = "") -> str:
    """Stage `compile`: write the report for config.compile.topology; returns init_from.

    No checkpoint is read or written (the step is compiled from shapes only), so a following
    stage starts from the same `init_from` as this one.
    """

    with hardware.without_persistent_cache():
        return _run(config, stage_dir, init_from)


def _run(config, stage_dir: str, init_from: str) -> str:

    topo = hardware.parse_topology(config.compile.topology, int(config.mesh.num_slices))
    out_dir = config.compile.report_dir or stage_dir
    devices = hardware.topology_devices(topo)
    check_batch(config, len(devices), "compile")  # the target's devices (validate skips compile)
    sizes = dict(zip(sharding.AXES, sharding.mesh_shape(config.mesh, len(devices))))
    active = active_params(config.model)
    counts = count_params(config.model)
    b, t = int(config.data.batch_size), int(config.data.seq_len)
    report = dict(
        config=f"{_count(counts['total'])}-parameter model",
        command=" ".join(["python", "main.py", *sys.argv[1:]]) if sys.argv[0].endswith("main.py")
        else "see docs/scale/regenerate.sh",
        hardware=hardware.describe(topo),
        setup=dict(
            mesh=sizes, num_slices=topo.num_slices, batch=b, seq_len=t, tokens_per_step=b * t,
            grad_accum=int(config.train.grad_accum), remat=config.model.remat,
            optimizer=config.train.optimizer, offload_optimizer=bool(config.train.offload_optimizer),
            dtype=config.model.dtype, param_dtype=config.model.param_dtype,
            params_total=counts["total"], params_mtp=counts.get("mtp", 0),
            params_active_matmul=active, attention_backend=config.model.attention_backend,
            moe_capacity_factor=float(config.model.moe_capacity_factor),
            moe_dispatch=config.model.moe_dispatch,
            moe_a2a_buffer_factor=float(config.model.moe_a2a_buffer_factor),
            grad_accum_dtype=config.train.grad_accum_dtype,
            optimizer_over_data=bool(config.train.optimizer_over_data),
            params_over_data=bool(config.train.params_over_data),
            reduce_grads_once=bool(config.train.reduce_grads_once),
            cast_params_once=bool(config.train.cast_params_once),
        ),
    )
    t0 = time.perf_counter()
    try:
        sharding.validate(config.model, config.mesh, len(devices))
        mesh = sharding.make_mesh(config.mesh, devices)  # topo.num_slices is mesh.num_slices
        lowered, part_sizes = lower_train_step(config, mesh)
        compiled = lowered.compile(compiler_options=hardware.compiler_options(topo))  # None on TPU
    except Exception as e:
        logging.error("compile for %s failed:\n%s", topo.name, traceback.format_exc())
        report.update(_failure(e), compile_seconds=time.perf_counter() - t0)
    else:
        report["compile_seconds"] = time.perf_counter() - t0
        report["hlo_file"] = _save_hlo(compiled, stage_dir, "train_step")
        report.update(analyse(compiled, topo, params=part_sizes["params"],
                              optimizer=part_sizes["optimizer"], batch=part_sizes["batch"],
                              model_flops=model_flops_per_step(config.model, b, t),
                              gmm_scale=gmm_scale(config, mesh, b // int(config.train.grad_accum), t)))
        report["status"] = "fits" if report["memory"]["fits"] else "does_not_fit"
    report["advice"] = advice(report, config)
    if config.compile.engine and report["status"] != "compile_error":
        report["engine"] = compile_engine(config, *engine_target(config, mesh, topo))
    if config.compile.grpo and report["status"] != "compile_error":
        report["grpo"] = compile_grpo(config, mesh, topo, hlo_dir=stage_dir)
    if report.get("engine") and report.get("grpo") and not config.compile.engine_topology:
        report["colocated"] = colocated_memory(config, report["engine"], report["grpo"])
    path = write_report(report, out_dir)
    logging.info("compile report (%s): %s", report["status"], path)
    if report.get("memory"):
        m = report["memory"]
        logging.info("%s: %.2f / %.2f GiB per chip, %s-bound, MFU %.1f-%.1f%%", topo.name,
                     m["total_bytes"] / 2**30, m["hbm_bytes"] / 2**30, report["roofline"]["bound"],
                     100 * report["roofline"]["mfu_lower"], 100 * report["roofline"]["mfu_upper"])
    g = report.get("grpo") or {}
    if g.get("memory"):
        logging.info("%s GRPO step (%s): %.2f / %.2f GiB per chip, %s-bound, MFU %.1f-%.1f%%", topo.name,
                     g["status"], g["memory"]["total_bytes"] / 2**30, g["memory"]["hbm_bytes"] / 2**30,
                     g["roofline"]["bound"], 100 * g["roofline"]["mfu_lower"], 100 * g["roofline"]["mfu_upper"])
    elif g:
        logging.info("%s GRPO step: %s", topo.name, g["status"])
    return init_from
