"""The one way every stage builds, restores and holds a model and its training state.

    model = build_model(config, mesh)              # the config's Transformer, created sharded
    report = load_into(model, path)                # its variables from a checkpoint, by name
    model = load_model(config, path, mesh)         # both, every variable required (eval, RL)
    state = init_state(model, tx, trainable, mesh) # TrainState at step 0
    state = restore_state(state, arrays, meta)     # a checkpoint's arrays and meta into it

Variables are matched by flat name ("layers.0.attn.wq", coder.train.flat.flat_name), so a
checkpoint written by a model without some module (fresh MTP heads) still loads: `load_into`
reports what it lacked. A name present on both sides with another shape is an error that names
the key to change. `path` may be a Hugging Face checkpoint directory too (coder.model.hf_import).
"""
from __future__ import annotations

import collections
import copy
import dataclasses
import logging
import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from coder.model import Transformer, hf_import, sharding
from coder.train import checkpoint as ckpt_lib
from coder.train.flat import flat_to_state, flat_to_tree, state_to_flat, tree_to_flat


def rules_of(config) -> tuple:
    """The logical-axis rules of config.mesh as a tuple of pairs."""
    return tuple(tuple(r) for r in config.mesh.rules)


def build_model(config, mesh=None, *, seed: int | None = None, model_fn=None) -> nnx.Module:
    """`Transformer(config.model)` (or `model_fn()`), created directly in its sharding on `mesh`
    (default: a mesh of config.mesh over all devices), initialised from `seed` (default config.seed)."""
    mesh = sharding.make_mesh(config.mesh) if mesh is None else mesh
    seed = int(config.seed) if seed is None else int(seed)
    if model_fn is not None:
        return sharding.create_sharded(model_fn, mesh, rules_of(config))
    graphdef, init = _transformer_init(config.model, mesh, rules_of(config))
    with sharding.activate(mesh, rules_of(config)):
        state = init(jnp.asarray(seed, jnp.int32))
    return nnx.merge(graphdef, state)


_INITS: collections.OrderedDict = collections.OrderedDict()
_MAX_INITS = 8


def _transformer_init(model_config, mesh, rules):
    """(graphdef, jitted `seed -> state` in its shardings) of one model config's Transformer.

    Compiled once per (config, mesh, rules) in a process: a run builds the same model several
    times (the trainer's, GRPO's reference, the MTP stage's fresh heads, a restore's target), and
    a jit of a fresh closure would compile its initialiser (seconds on CPU) every time. The seed
    is an argument, not a constant, so other seeds reuse the program too."""
    key = (model_config.to_json(sort_keys=True), mesh, rules)
    if key not in _INITS:
        frozen = copy.deepcopy(model_config)  # the caller may change its config afterwards

        def make(seed):
            return Transformer(frozen, rngs=nnx.Rngs(jax.random.key(seed)))  # = nnx.Rngs(int seed)

        _INITS[key] = sharding.sharded_init(make, mesh, rules, 0)
        if len(_INITS) > _MAX_INITS:
            _INITS.popitem(last=False)
    _INITS.move_to_end(key)
    return _INITS[key]


def abstract_flat(state) -> dict:
    """{flat name: ShapeDtypeStruct with the array's sharding} of an nnx.State or any pytree of
    arrays: the target a checkpoint is restored onto."""
    flat = state_to_flat(state) if isinstance(state, nnx.State) else tree_to_flat(state)
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in flat.items()}


def load_into(model: nnx.Module, path: str, *, require_all: bool = False) -> dict:
    """Every variable of `model` (params, router bias, ...) that the checkpoint at `path` holds,
    restored in place onto the model's shardings.

    Returns {"loaded", "missing" (kept their current value), "unexpected" (in the checkpoint,
    not in the model)}; with `require_all` a missing variable is a ValueError naming them.

    `path` may also be a Hugging Face DeepSeek-V3 / Kimi-K2 checkpoint directory (config.json +
    safetensors, local or gs://): coder.model.hf_import.import_into reads it into the model's
    shardings, each process only its own blocks. There a missing trunk tensor is always an error
    and a missing MTP module always starts fresh (transformers saves none), whatever
    `require_all`; embedding / output-head rows past the checkpoint's (added tokens) start at the
    mean of its rows. The report adds "fresh_mtp" and "vocab" (checkpoint rows, model rows).
    """
    if hf_import.is_hf_checkpoint(path):
        return hf_import.import_into(model, path)
    state = nnx.state(model)
    found, missing, unexpected = ckpt_lib.load_params(path, abstract_flat(state))
    if missing and require_all:
        raise ValueError(
            f"{path} lacks {len(missing)} of the model's variables, e.g. {missing[:3]}: the model "
            "config must match the checkpoint's"
        )
    flat = state_to_flat(state)
    flat.update(found)
    nnx.update(model, flat_to_state(state, flat))
    logging.info("loaded %d variables from %s", len(found), path)
    if missing:
        logging.info("not in %s (kept their initialisation): %d variables, e.g. %s", path,
                     len(missing), missing[:4])
    if unexpected:
        logging.warning("in %s but not in the model (ignored): %s", path, unexpected[:8])
    return {"loaded": sorted(found), "missing": missing, "unexpected": unexpected}


def load_model(config, path: str, mesh=None) -> nnx.Module:
    """The Transformer of config.model on `mesh` with every variable from the checkpoint `path`."""
    model = build_model(config, mesh)
    load_into(model, path, require_all=True)
    return model


def copy_model(model: nnx.Module) -> nnx.Module:
    """A module with its own copies of `model`'s arrays, in the same shardings: a frozen reference
    or an engine's weights (the trainer donates its arrays to each step, so sharing them would
    hand the holder deleted buffers)."""
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, jax.tree.map(jnp.copy, state))


@dataclasses.dataclass
class TrainState:
    """What a training step reads and writes, plus the host-side counters a checkpoint keeps.

    params: the trainable nnx.Param variables (the `trainable` filter); rest: every other model
    variable (router bias, frozen parameters); opt_state: the optimizer's state over `params`;
    key: the run's base RNG key (folded with the step inside the step); nonfinite_total /
    nonfinite_run: skipped (NaN/Inf) steps over the stage / in a row.
    """

    graphdef: nnx.GraphDef
    params: nnx.State
    rest: nnx.State
    opt_state: object
    step: int
    key: jax.Array
    nonfinite_total: int = 0
    nonfinite_run: int = 0

    @property
    def model(self) -> nnx.Module:
        """A module view of the current arrays (do not mutate: the next step donates them)."""
        return nnx.merge(self.graphdef, self.params, self.rest)

    def flat_model(self) -> dict:
        """{flat name: array} of every model variable."""
        return {**state_to_flat(self.params), **state_to_flat(self.rest)}

    def meta(self) -> dict:
        """The JSON part of a checkpoint: step, RNG key data, counters."""
        return {
            "step": self.step,
            "rng_key": jax.device_get(jax.random.key_data(self.key)).tolist(),
            "nonfinite_total": self.nonfinite_total,
            "nonfinite_run": self.nonfinite_run,
        }


def split_further(sh, shape, axes: tuple[str, ...]):
    """NamedSharding `sh` of an array of `shape` with mesh `axes` it does not use yet added to
    its first dimension they divide (ZeRO across those axes); `sh` itself when none does."""
    axes = tuple(a for a in axes if a not in _used_axes(sh.spec) and sh.mesh.shape[a] > 1)
    if not axes:
        return sh
    spec = list(sh.spec) + [None] * (len(shape) - len(sh.spec))
    extra = math.prod(sh.mesh.shape[a] for a in axes)
    for i, (n, entry) in enumerate(zip(shape, spec)):
        have = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        if n % (math.prod(sh.mesh.shape[a] for a in have) * extra) == 0:
            spec[i] = (*axes, *have)  # the new axes outermost: a DCN axis splits into slices
            return jax.sharding.NamedSharding(sh.mesh, jax.sharding.PartitionSpec(*spec),
                                              memory_kind=sh.memory_kind)
    return sh


def split_shardings(arrays, axes: tuple[str, ...]):
    """The sharding of every array (or ShapeDtypeStruct) of a tree, split further over mesh
    `axes` (`split_further`)."""
    return jax.tree.map(lambda x: split_further(x.sharding, x.shape, axes), arrays)


def _used_axes(spec) -> set[str]:
    out = set()
    for entry in spec:
        if entry is not None:
            out.update((entry,) if isinstance(entry, str) else entry)
    return out


def init_state(model: nnx.Module, tx, trainable, mesh, *, seed: int,
               optimizer_over: tuple[str, ...] = (), params_over: tuple[str, ...] = ()) -> TrainState:
    """Step-0 TrainState of `model`: its `trainable` params (split further over `params_over`
    mesh axes, train.params_over_data), the rest, and `tx`'s state sharded like the params, and
    further over `optimizer_over` mesh axes (opt_state_shardings)."""
    graphdef, params, rest = nnx.split(model, trainable, ...)
    if not jax.tree.leaves(params):
        raise ValueError(f"the trainable filter {trainable} selects no parameters")
    if params_over:
        params = jax.device_put(params, split_shardings(params, params_over))
    opt_state = jax.jit(tx.init, out_shardings=opt_state_shardings(tx, params, mesh, optimizer_over))(params)
    return TrainState(graphdef, params, rest, opt_state, 0, jax.random.key(int(seed)))


def restore_state(state: TrainState, arrays: dict, meta: dict) -> TrainState:
    """`state` with a checkpoint's arrays ({"model": flat, "opt_state": flat}) and meta."""
    flat = arrays["model"]
    return dataclasses.replace(
        state,
        params=flat_to_state(state.params, flat),
        rest=flat_to_state(state.rest, flat),
        opt_state=flat_to_tree(state.opt_state, arrays["opt_state"]),
        step=int(meta["step"]),
        key=jax.random.wrap_key_data(jnp.asarray(meta["rng_key"], jnp.uint32)),
        nonfinite_total=int(meta.get("nonfinite_total", 0)),
        nonfinite_run=int(meta.get("nonfinite_run", 0)),
    )


def opt_state_shardings(tx, params, mesh, over: tuple[str, ...] = ()):
    """Optimizer-state shardings for `tx.init(params)`: every moment shards like its parameter,
    counters and other non-parameter leaves are replicated. `params` may be abstract
    (ShapeDtypeStruct with shardings) or arrays. `over`: mesh axes (e.g. ("data",),
    train.optimizer_over_data) the moments are split over too (`split_further`).

    jit's own propagation does not do this: zeros_like(p) does not depend on p's values, so
    `jit(tx.init)` returns the moments unsharded (a 671B model's whole Adam state on each chip).
    """
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    abstract = jax.eval_shape(tx.init, params)
    param_sh = split_shardings(params, over)
    masked = lambda x: isinstance(x, optax.MaskedNode)
    return optax.tree_map_params(tx, lambda x, s: x if masked(x) else s, abstract, param_sh,
                                 transform_non_params=lambda _: replicated, is_leaf=masked)


def to_memory(tree, kind: str):
    """`tree`'s arrays moved to memory kind `kind` ("pinned_host": host RAM, "device": HBM),
    each keeping its sharding over the devices -> (the moved tree, bytes moved). What stays on
    the host frees its device memory for something else (an engine's KV cache while a colocated
    learner waits)."""
    moved = 0

    def put(x):
        nonlocal moved
        if not isinstance(x, jax.Array) or x.sharding.memory_kind == kind:
            return x
        moved += x.nbytes
        return jax.device_put(x, x.sharding.with_memory_kind(kind))

    out = jax.tree.map(put, tree)
    jax.block_until_ready(out)
    return out, moved
