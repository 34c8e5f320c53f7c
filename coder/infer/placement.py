"""Where an engine's arrays live: the `Engine.placement` part of coder.infer.engine.

Weights shard by the training rules (`coder.model.sharding`: tensor / expert / fsdp axes) on
the engine's mesh, cast to the serving dtype; the slot pool's rows split over the mesh's batch
axes when they divide the slot count; host inputs of a device call are replicated over the mesh
(over several processes a numpy input has no device of its own) and outputs read back on the
host. No mesh: one device, the first local one.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from coder.model import sharding
from coder.model.quantized import is_wide_float


class Placement:
    def __init__(self, mesh=None, rules=(), dtype=None, *, spans_processes: bool = False):
        self.mesh = mesh
        self.rules = tuple(tuple(r) for r in (rules or ()))
        self.dtype = None if dtype in (None, "") else jnp.dtype(dtype)  # the serving dtype of floating weights
        self.spans_processes = bool(spans_processes)

    # ---------------------------------------------------------------- weights
    def serving(self, x) -> jax.ShapeDtypeStruct:
        """The shape and dtype the engine serves leaf `x` in: floating leaves in `dtype` (when set)."""
        cast = self.casts(x.dtype)
        return jax.ShapeDtypeStruct(x.shape, self.dtype if cast else x.dtype)

    def casts(self, dtype) -> bool:
        """Whether a leaf of `dtype` is served in `dtype`: floating leaves of 16 bits or more (an
        8-bit float is a quantized weight's values: coder.model.quantized)."""
        return self.dtype is not None and is_wide_float(dtype)

    def weight_shardings(self, state):
        """The engine's sharding of every leaf of `state` (a tree like it)."""
        if self.mesh is None:
            dev = SingleDeviceSharding(jax.local_devices()[0])
            return jax.tree.map(lambda _: dev, state)
        return sharding.state_shardings(state, self.mesh, self.rules)

    def place(self, state, shardings):
        """The engine's own copy of `state`: cast to the serving dtype, on `shardings`. Always
        fresh buffers: a trainer donates its arrays to each step."""
        def put(x, sh):
            spans = isinstance(x, jax.Array) and not x.is_fully_addressable and x.sharding != sh
            if spans and not self.spans_processes:
                x = multihost_utils.process_allgather(x, tiled=True)  # a learner over several hosts
            if self.casts(x.dtype):
                x = x.astype(self.dtype)
            if spans and self.spans_processes:  # every process is in this call: reshard on device
                return jax.jit(_identity, out_shardings=sh)(x)
            if not sh.is_fully_addressable and (not isinstance(x, jax.Array) or x.is_fully_addressable):
                x = np.asarray(x)  # the same host value on every process: each places its devices' part
                return jax.make_array_from_callback(x.shape, sh, lambda i, x=x: x[i])
            return jax.device_put(x, sh)
        return _fresh_copy(jax.tree.map(put, state, shardings))

    # ---------------------------------------------------------------- the slot pool
    def store_sharding(self, slots: int):
        """`leaf -> sharding` of a pool of `slots` slots: rows over the batch axes when they divide it."""
        if self.mesh is None:
            sh = SingleDeviceSharding(jax.local_devices()[0])
            return lambda leaf: sh
        axes = sharding.mesh_axes_of("batch", self.rules)
        axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
        n = int(np.prod([self.mesh.shape[a] for a in axes])) if axes else 1
        split = axes if axes and slots % n == 0 else None
        return lambda leaf: NamedSharding(self.mesh, PartitionSpec(split, *([None] * (leaf.ndim - 1))))

    @staticmethod
    def rows_split(store_sharding) -> bool:
        """Whether `store_sharding` splits a pool's rows over several devices."""
        sh = store_sharding(jax.ShapeDtypeStruct((1,), jnp.int32))
        return isinstance(sh, NamedSharding) and sh.spec and sh.spec[0] is not None and \
            math.prod(sh.mesh.shape[a] for a in ((sh.spec[0],) if isinstance(sh.spec[0], str) else sh.spec[0])) > 1

    def pool_split(self, slots: int) -> bool:
        """Whether a pool of `slots` splits its rows over several devices (then prefill runs
        aligned to the pool, programs.prefill_pool)."""
        return self.rows_split(self.store_sharding(slots))

    # ---------------------------------------------------------------- device calls
    def replicated(self, tree):
        """Host inputs as arrays replicated over the mesh when it spans processes; as they are on one."""
        if not self.spans_processes:
            return tree
        rep = NamedSharding(self.mesh, PartitionSpec())
        return jax.tree.map(lambda x: jax.make_array_from_callback(np.shape(x), rep, lambda i, x=np.asarray(x): x[i]),
                            tree)

    @staticmethod
    def host(x) -> np.ndarray:
        """A program's output on the host (over several processes: gathered, every process calls)."""
        if x.is_fully_addressable:
            return np.asarray(x)
        if x.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    def run(self, fn, *args):
        """`fn(*args)` under the mesh's sharding rules."""
        if self.mesh is None:
            return fn(*args)
        with sharding.activate(self.mesh, self.rules):
            return fn(*args)


def _identity(x):
    return x


@jax.jit
def _fresh_copy(tree):
    return jax.tree.map(jnp.copy, tree)
