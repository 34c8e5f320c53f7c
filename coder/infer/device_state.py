"""What an engine holds on its devices: the weights it serves (`ServedWeights`, the engine's
`weights` part) and the slot pool's store (`DeviceStore`, its `pool_store` part), each with the
rules that keep it one shape per compiled program (coder.infer.engine)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from coder.infer import programs, quantize
from coder.train import flat as flat_lib
from coder.infer.placement import Placement


class ServedWeights:
    """The engine's weights (`state`, an nnx.State on `shardings`, in the serving dtype and, with
    a `quantization` (coder.infer.quantize), the weights it names in their quantized form) and
    their signature (tree structure, shapes and dtypes: a new state must keep it, or every
    program would recompile). Built from an abstract model (nnx.eval_shape) it holds shapes
    only until the first `load` sets real weights.

    Every state it is given is full precision (a set_weights state may also carry leaves of the
    held quantized form): it is cast and placed by the placement, then quantized on the
    devices. A loader is asked for the full-precision leaves (`float_shardings`, names of
    `float_template`)."""

    def __init__(self, graphdef, state, placement: Placement, quantization=None):
        self.graphdef, self.placement = graphdef, placement
        self.quantization = quantize.quantization(quantization)
        self.float_template = jax.tree.map(placement.serving, state)
        self.float_shardings = placement.weight_shardings(state)
        served = jax.eval_shape(lambda s: quantize.quantize_state(s, self.quantization), self.float_template)
        self.shardings = placement.weight_shardings(served)
        self._quantize = jax.jit(lambda s: quantize.quantize_state(s, self.quantization),
                                 out_shardings=self.shardings)
        # an abstract model holds its parameter dtype: its weights come later, in the serving dtype
        self.state = self.served(state) if not is_abstract(state) else served
        self.signature = signature(self.state)

    def served(self, state) -> nnx.State:
        """A whole `state` as the engine serves it: cast, placed and quantized."""
        if self.quantization is None:
            return self.placement.place(state, self.shardings)
        return self._quantize(self.placement.place(state, self.placement.weight_shardings(state)))

    @property
    def abstract(self) -> bool:
        return is_abstract(self.state)

    @property
    def bytes_per_device(self) -> int:
        """Bytes the served weights take on the most loaded device (int4: half a byte a value)."""
        self.require()
        return quantize.bytes_per_device(self.state)

    def require(self) -> None:
        if self.abstract:
            raise RuntimeError("the engine was built from an abstract model and has no weights yet: "
                               "load_weights first")

    def merged(self, state, base) -> nnx.State:
        """`state` (possibly partial) over `base` (the held or pending state), placed: a whole new
        state of the engine's signature (set_weights)."""
        model = nnx.merge(self.graphdef, base)
        nnx.update(model, state)
        if is_abstract(nnx.state(model)):
            raise RuntimeError("set_weights: the engine holds no weights for some variables (built from an "
                               "abstract model, or released by settle(release=True)): give a whole state, or "
                               "load_weights")
        new = self.served(nnx.state(model))
        if signature(new) != self.signature:
            raise ValueError("set_weights: the new state's structure, shapes or dtypes differ from "
                             "the engine's model (that would recompile every program)")
        return new

    def load(self, loader) -> None:
        """Weights that `loader(shardings) -> {flat name: jax.Array}` reads (load_weights; every
        process reads its own part), cast to the held dtypes. A loader whose `quantized` is true
        gives the served form itself (coder.infer.quantize.to_flat's names: a weight store a
        quantizing publisher wrote); any other gives full-precision leaves, quantized here."""
        if getattr(loader, "quantized", False):
            if self.quantization is None:
                raise ValueError("load_weights: the loader gives quantized weights, but this engine serves them "
                                 "full precision (built without a quantization)")
            template, shardings = self.state, quantize.to_flat(self.shardings, self.state)
            to_state = lambda flat: self.placement.place(  # noqa: E731
                quantize.from_flat(template, flat), self.shardings)
        else:
            template, shardings = self.float_template, flat_lib.state_to_flat(self.float_shardings)
            to_state = lambda flat: self.served(flat_lib.flat_to_state(template, flat))  # noqa: E731
        flat = loader(shardings)
        missing = set(shardings) - set(flat)
        if missing:
            raise ValueError(f"load_weights: the loader gave no {sorted(missing)[:5]} ({len(missing)} leaves)")
        held = quantize.flat_shapes(template)  # the store's dtype (e.g. bf16) -> the engine's, on device
        new = to_state({k: flat[k] if flat[k].dtype == held[k].dtype else flat[k].astype(held[k].dtype) for k in held})
        if self.abstract:  # built from an abstract model: the first weights set the signature
            self.signature = signature(new)
        elif signature(new) != self.signature:
            raise ValueError("load_weights: the loaded state's shapes or dtypes differ from the engine's model")
        self.state = new

    def release(self) -> None:
        """Drop the device buffers (settle(release=True)); the structure, shapes and shardings stay."""
        self.state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.state)


class DeviceStore:
    """The slot pool on the devices (`store`, a programs.Store of `slots` slots and `capacity`
    positions, None until the first `fit`), sharded by `placement.store_sharding`."""

    def __init__(self, cfg, cache_dtype, spec_k: int, placement: Placement, counted):
        self.cfg, self.cache_dtype, self.spec_k, self.placement = cfg, cache_dtype, int(spec_k), placement
        self._counted = counted  # the engine's trace counter: (name, fn) -> fn
        self.store = None
        self.slots = self.capacity = 0
        self._resize_fns = {}  # (slots, capacity) -> jitted programs.resize to that shape

    def target(self, slots: int, capacity: int):
        """The abstract store of that shape, with its shardings."""
        target = jax.eval_shape(lambda: programs.empty_store(self.cfg, slots, capacity, self.cache_dtype,
                                                             self.spec_k))
        sh = self.placement.store_sharding(slots)
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh(x)), target)

    def fit(self, slots: int, capacity: int) -> None:
        """A store of `slots` slots and `capacity` positions: new (zeros), or the old one resized."""
        target = self.target(slots, capacity)
        out_shardings = jax.tree.map(lambda t: t.sharding, target)
        if self.store is None:
            zeros = lambda: jax.tree.map(lambda t: jnp.zeros(t.shape, t.dtype), target)
            self.store = jax.jit(zeros, out_shardings=out_shardings)()
        else:
            if (slots, capacity) not in self._resize_fns:
                fn = self._counted("resize", lambda store, target=target: programs.resize(store, target))
                self._resize_fns[slots, capacity] = jax.jit(fn, out_shardings=out_shardings)
            self.store = self.placement.run(self._resize_fns[slots, capacity], self.store)
        self.slots, self.capacity = slots, capacity

    def release(self) -> None:
        self.store, self.slots, self.capacity = None, 0, 0


def signature(state):
    return jax.tree.structure(state), tuple((x.shape, x.dtype) for x in jax.tree.leaves(state))


def is_abstract(state) -> bool:
    return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(state))
