"""Mesh, logical axis rules, and sharding helpers.

The model names every parameter axis and key activation axis with a *logical* name (`batch`,
`seq`, `embed`, `heads`, `exp`, `mlp`, `vocab`, ...). `config.mesh.rules` maps each logical name
to mesh axes (or None = replicated). One mesh with the named axes
    (data, fsdp, expert, tensor, sequence)
holds every device; the product of the sizes equals the device count (-1 = the rest).

Axes are `AxisType.Auto`: the XLA partitioner propagates shardings from the parameter shardings
and the activation constraints (`constrain`), as in MaxText. Expert parallelism uses an explicit
`shard_map` in `coder.model.expert_dispatch`.

Activation constraints are applied only inside `activate(mesh, rules)`; outside it (tests on one
device, tracing for shapes) `constrain` is the identity, so the model code is free of parallelism.
"""
from __future__ import annotations

import contextlib
import math
import threading
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from coder.model.config import routing_errors
from coder.model.quantized import spec_for

AXES = ("data", "fsdp", "expert", "tensor", "sequence")


# ----------------------------------------------------------------------------- mesh
def mesh_shape(mesh_cfg, n_devices: int) -> tuple[int, ...]:
    """Sizes of AXES with -1 resolved to the remaining devices."""
    sizes = [int(mesh_cfg[a]) for a in AXES]
    if sum(s == -1 for s in sizes) > 1:
        raise ValueError(f"mesh: at most one of {AXES} may be -1, got {dict(zip(AXES, sizes))}")
    known = math.prod(s for s in sizes if s != -1)
    if any(s == 0 or s < -1 for s in sizes):
        raise ValueError(f"mesh: sizes must be positive or -1, got {dict(zip(AXES, sizes))}")
    if -1 in sizes:
        if n_devices % known:
            raise ValueError(
                f"mesh: fixed axes multiply to {known}, which does not divide the {n_devices} "
                f"devices; change mesh.{'/'.join(a for a, s in zip(AXES, sizes) if s != 1 and s != -1)}")
        sizes[sizes.index(-1)] = n_devices // known
    if math.prod(sizes) != n_devices:
        raise ValueError(
            f"mesh: {dict(zip(AXES, sizes))} needs {math.prod(sizes)} devices but {n_devices} are "
            f"available; change mesh.data/fsdp/expert/tensor/sequence (or set one to -1)")
    return tuple(sizes)


def make_mesh(mesh_cfg, devices=None) -> Mesh:
    """A Mesh over `devices` (default: all) with Auto axis types (see module docstring).

    On TPU (real chips or libtpu's compile-only ones) mesh_utils orders the devices so each mesh
    axis follows torus links, and with mesh.num_slices > 1 the slice (DCN) dimension is the
    outermost split of `data` (or `fsdp` when data does not divide): only data-parallel
    gradient reductions cross slices. Elsewhere devices are taken in order (slice-major).
    """
    devices = jax.devices() if devices is None else list(devices)
    shape = mesh_shape(mesh_cfg, len(devices))
    slices = int(mesh_cfg.num_slices)
    if devices[0].platform == "tpu":
        dev = _tpu_device_mesh(shape, devices, slices)
    else:
        if slices > 1:
            if shape[0] % slices:
                raise ValueError(f"mesh.data={shape[0]} must be a multiple of mesh.num_slices={slices}")
            devices = sorted(devices, key=lambda d: (getattr(d, "slice_index", 0), d.id))
        dev = np.asarray(devices).reshape(shape)
    return Mesh(dev, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def batch_row_shares(mesh: Mesh, rules) -> int:
    """Into how many parts the processes split a batch's rows: the process count when each
    process feeds rows of its own (the batch mesh axes span the processes), 1 when every process
    feeds the whole batch (they do not: e.g. data = fsdp = 1, the devices split the weights only).
    Raises when processes would share some rows but not others."""
    axes = mesh_axes_of("batch", rules)
    size = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
    spec = jax.sharding.PartitionSpec(axes if axes else None)
    rows: dict[int, set] = {}
    for device, (index,) in jax.sharding.NamedSharding(mesh, spec).devices_indices_map((size,)).items():
        rows.setdefault(device.process_index, set()).update(range(*index.indices(size)))
    sets = list(rows.values())
    if all(r == sets[0] for r in sets):
        return 1
    if sum(map(len, sets)) == size and len({len(r) for r in sets}) == 1:
        return len(sets)
    raise ValueError(f"the batch mesh axes {axes} split a batch's rows over the {len(sets)} processes "
                     "unevenly (some rows on several processes, others on one): lay the processes out "
                     "along data / fsdp")


def data_shard(config) -> tuple[int, int]:
    """(shard index, shard count) of the training data this process reads: its own shard when the
    processes split a batch's rows (`batch_row_shares`), else the whole stream (shard 0 of 1),
    as every other process reads it."""
    shares = batch_row_shares(make_mesh(config.mesh), config.mesh.rules) if jax.process_count() > 1 else 1
    return (jax.process_index(), shares) if shares > 1 else (0, 1)


def _tpu_device_mesh(shape, devices, num_slices: int) -> np.ndarray:
    from jax.experimental import mesh_utils

    if num_slices == 1:
        return mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    dcn = [1] * len(shape)
    for axis in ("data", "fsdp"):
        i = AXES.index(axis)
        if shape[i] % num_slices == 0:
            dcn[i] = num_slices
            break
    else:
        raise ValueError(f"mesh.num_slices={num_slices} must divide mesh.data or "
                         f"mesh.fsdp (mesh {dict(zip(AXES, shape))})")
    ici = [s // d for s, d in zip(shape, dcn)]
    return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, allow_split_physical_axes=True)


def rules_dict(rules) -> dict[str, Any]:
    """{logical name: mesh axes}. `res_seq` (the residual stream's sequence axis) defaults to the
    `seq` rule when a table does not name it."""
    out = {name: target for name, target in rules}
    if "res_seq" not in out and "seq" in out:
        out["res_seq"] = out["seq"]
    return out


def validate(model_cfg, mesh_cfg, n_devices: int) -> dict[str, int]:
    """Check the model divides the mesh; raise ValueError naming the config keys to change."""
    sizes = dict(zip(AXES, mesh_shape(mesh_cfg, n_devices)))
    rules = rules_dict(mesh_cfg.rules)
    errors = []

    def size_of(logical):
        target = rules.get(logical)
        if target is None:
            return 1
        targets = (target,) if isinstance(target, str) else tuple(target)
        return math.prod(sizes[t] for t in targets)

    checks = [
        ("heads", model_cfg.num_attention_heads, "model.num_attention_heads"),
        ("exp", model_cfg.n_routed_experts, "model.n_routed_experts"),
        ("mlp", model_cfg.intermediate_size, "model.intermediate_size"),
        ("exp_mlp", model_cfg.moe_intermediate_size, "model.moe_intermediate_size"),
        ("vocab", model_cfg.vocab_size, "model.vocab_size"),
        ("embed", model_cfg.hidden_size, "model.hidden_size"),
    ]
    for logical, dim, key in checks:
        n = size_of(logical)
        if dim % n:
            errors.append(f"{key}={dim} is not divisible by the mesh axes of '{logical}' "
                          f"({rules.get(logical)} = {n}); change {key} or mesh.{rules.get(logical)}")
    if model_cfg.n_routed_experts % max(1, model_cfg.n_group):
        errors.append(f"model.n_routed_experts={model_cfg.n_routed_experts} is not divisible by "
                      f"model.n_group={model_cfg.n_group}")
    if model_cfg.topk_group > model_cfg.n_group:
        errors.append(f"model.topk_group={model_cfg.topk_group} > model.n_group={model_cfg.n_group}")
    errors += routing_errors(model_cfg)  # route() must find k allowed experts
    if errors:
        raise ValueError("; ".join(errors))
    return sizes


# ----------------------------------------------------------------------------- rules
def logical_to_spec(axes, rules) -> PartitionSpec:
    """PartitionSpec for logical `axes` under `rules`; a mesh axis is used at most once."""
    rules = rules_dict(rules.items() if isinstance(rules, dict) else rules)
    used: set[str] = set()
    out = []
    for name in axes:
        target = rules.get(name) if name is not None else None
        if target is None:
            out.append(None)
            continue
        targets = (target,) if isinstance(target, str) else tuple(target)
        targets = tuple(t for t in targets if t not in used)
        used.update(targets)
        out.append(None if not targets else targets[0] if len(targets) == 1 else targets)
    return PartitionSpec(*out)


def mesh_axes_of(logical: str, rules) -> tuple[str, ...]:
    rules = rules_dict(rules.items() if isinstance(rules, dict) else rules)
    target = rules.get(logical)
    if target is None:
        return ()
    return (target,) if isinstance(target, str) else tuple(target)


def without_axis(rules, axis: str) -> tuple:
    """`rules` with mesh `axis` dropped from every target: the rules of code that runs under
    `jax.vmap(..., spmd_axis_name=axis)`, where the vmapped dimension owns that axis."""
    out = []
    for name, target in rules_dict(rules.items() if isinstance(rules, dict) else rules).items():
        targets = () if target is None else (target,) if isinstance(target, str) else tuple(target)
        kept = tuple(t for t in targets if t != axis)
        out.append((name, None if not kept else kept[0] if len(kept) == 1 else kept))
    return tuple(out)


def data_parallel_attention(rules) -> tuple:
    """`rules` for an inference engine laid out as DeepSeek-V3 serves: rows (`batch`) split over
    the mesh axes that split the experts too, every other logical axis but `exp` off those axes.

    Each chip then holds its own rows' KV cache and runs attention, the dense layers and the
    head for them with replicated weights; the MoE layers send each chip's routed tokens to their
    experts' chips and back (coder.model.expert_dispatch: ragged_all_to_all on TPU / GPU). Under
    the training rules MLA's latent cache `[rows, slots, kv_lora_rank]` has no head axis to split,
    so with rows over no axis every chip held every row's cache (2.2 GB per 32k DeepSeek-V3 row).
    The price: the non-expert weights are whole on every chip (docs/scale has the figures)."""
    table = rules_dict(rules.items() if isinstance(rules, dict) else rules)
    exp_axes = mesh_axes_of("exp", rules)
    out = []
    for name, target in table.items():
        targets = () if target is None else (target,) if isinstance(target, str) else tuple(target)
        if name == "batch":
            targets += tuple(a for a in exp_axes if a not in targets)
        elif name != "exp":
            targets = tuple(t for t in targets if t not in exp_axes)
        out.append((name, None if not targets else targets[0] if len(targets) == 1 else targets))
    return tuple(out)


# ----------------------------------------------------------------------------- context
_CTX = threading.local()


@contextlib.contextmanager
def activate(mesh: Mesh, rules):
    """Within this block (while tracing), activations get sharding constraints from `rules`."""
    prev = getattr(_CTX, "value", None)
    _CTX.value = (mesh, rules_dict(rules))
    try:
        with jax.set_mesh(mesh):
            yield
    finally:
        _CTX.value = prev


@contextlib.contextmanager
def replica_vmap(axis: str):
    """Tracing code that runs under `jax.vmap(..., spmd_axis_name=axis)` inside an `activate`
    block: the rules stop naming `axis` (the vmapped dimension owns it)."""
    prev = current()
    if prev is None:
        raise RuntimeError("sharding.replica_vmap outside sharding.activate")
    _CTX.value = (prev[0], rules_dict(without_axis(prev[1], axis)))
    try:
        yield
    finally:
        _CTX.value = prev


def current():
    """(mesh, rules) when inside `activate`, else None."""
    return getattr(_CTX, "value", None)


def target_device():
    """The first device of the program being traced: the active mesh's (stage `compile`
    activates a mesh of TPU devices on a CPU host), else the default backend's."""
    ctx = current()
    return ctx[0].devices.flat[0] if ctx is not None else jax.devices()[0]


def target_platform() -> str | None:
    """The platform of the program being traced (`target_device`) when tracing can decide for
    it: "cpu" or "tpu"; None for GPUs (CUDA or ROCm is decided where the program is lowered).
    A test that lowers a CPU-traced program for another platform sets this to return None."""
    platform = target_device().platform
    return platform if platform in ("cpu", "tpu") else None


def targets_cpu() -> bool:
    """Whether the program being traced runs on CPU (`target_platform`)."""
    return target_platform() == "cpu"


def platform_dependent(*args, **branches):
    """`jax.lax.platform_dependent(*args, **branches)` (branches keyed cpu / tpu / cuda / rocm /
    default), with the branch chosen while tracing when `target_platform` knows the platform.
    `jax.lax.platform_dependent` traces every branch (and differentiates, batches and transposes
    each under the model's vmap and grad): the TPU kernels' branches cost ~0.3 s per layer
    (attention) and ~10% of a small MoE model's stage process (megablox's group metadata) in
    CPU programs that never run them, and the CPU forms as much again in stage `compile`'s
    TPU programs (lowered for TPU from a CPU host: the mesh's devices say which)."""
    platform = target_platform()
    if platform is None:
        return jax.lax.platform_dependent(*args, **branches)
    return branches.get(platform, branches["default"])(*args)


def constrain(x, axes):
    """Constrain activation `x` to the sharding of its logical `axes` (identity outside activate)."""
    ctx = current()
    if ctx is None or x.ndim != len(axes):
        return x
    mesh, rules = ctx
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_spec(axes, rules)))


# ----------------------------------------------------------------------------- params
def _var_spec(v, rules) -> PartitionSpec:
    axes = v.get_metadata().get("logical_axes") if isinstance(v, nnx.Variable) else None
    if axes is None:
        return PartitionSpec()
    return logical_to_spec(axes, rules)


def state_specs(state, rules):
    """PartitionSpec per variable of an nnx State (same tree structure, Variables kept). A
    quantized weight's values split as the weight would; its scale along the same axes except
    where it spans an axis whole or in groups (there it is whole: it is small)."""
    def spec(v):
        s = _var_spec(v, rules)
        return v.replace(spec_for(v.get_value(), s) if isinstance(v, nnx.Variable) else s)
    return jax.tree.map(spec, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def param_specs(model, rules) -> dict[str, PartitionSpec]:
    """Flat {'path/to/param': PartitionSpec} of every variable of `model` (golden tests)."""
    out = {}
    for path, v in nnx.to_flat_state(nnx.state(model)):
        out["/".join(str(p) for p in path)] = _var_spec(v, rules)
    return out


def state_shardings(state, mesh: Mesh, rules):
    specs = state_specs(state, rules)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def sharded_init(make_model, mesh: Mesh, rules, *example_args):
    """(graphdef, jitted `*args -> state`) that creates `make_model(*args)` directly in its
    shardings (call it inside `activate(mesh, rules)`); `example_args` give the abstract init its
    shapes. No device ever holds the whole model."""
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: make_model(*example_args)))
    shardings = state_shardings(abstract, mesh, rules)
    return graphdef, jax.jit(lambda *args: nnx.state(make_model(*args)), out_shardings=shardings)


def create_sharded(make_model, mesh: Mesh, rules):
    """Build `make_model()` directly sharded: abstract init, then a jit with out_shardings."""
    graphdef, init = sharded_init(make_model, mesh, rules)
    with activate(mesh, rules):
        state = init()
    return nnx.merge(graphdef, state)


def shard_model(model, mesh: Mesh, rules):
    """Move an existing model's variables to their shardings (in place); returns the model."""
    graphdef, state = nnx.split(model)
    state = jax.device_put(state, state_shardings(state, mesh, rules))
    nnx.update(model, state)
    return model
