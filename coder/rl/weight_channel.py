"""The weight channel: a learner's model into the weight store (coder/rl/weight_sync.py), and
the store's newest version into an engine, for every producer and consumer of weights (the RL
learner and actors, stage realtime and the servers that follow it).

    ModelPublisher(url, dtype=bf16).publish(model, v)   # every process writes its own slices
    ModelPublisher(url, dtype=bf16, quantization="int8")  # the engines' quantized form instead
    StoreLoad(url, version)                             # an Engine.load_weights loader: each
                                                        # process reads its own devices' slices
    EngineFollower(engine, url, template).poll()        # new versions -> an engine, in flight
    stage_on_device(model, v); OnDevice(v)              # colocated: no store; every process
                                                        # stages its learner's arrays, and the
                                                        # engine's loader reshards them on device
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time

import numpy as np

from coder.rl import weight_sync
from coder.train.flat import flat_to_state, state_to_flat


class StoreUnreadable(RuntimeError):
    """An engine's follower could not read the weight store for its timeout (EngineFollower)."""


class ModelPublisher:
    """The learner's side of the weight channel (grpo's learner, realtime): each version of a
    model's variables, floating ones cast on device to the serving `dtype` (None keeps them), to
    the store. Every process writes the slices its own devices hold (`local_slices`): no leaf is
    gathered, and a process's host memory holds its shards only. Every process of the job calls
    `publish` for every version (a version is complete when all their parts are written).

    With a `quantization` (coder.infer.quantize: the engines' rl.engine_quantization) the
    weights it names are quantized on the learner's devices and published in that form
    (`quantize.to_flat`: `{name}.values` and `{name}.scale`), and an engine of that quantization
    loads it as is; INT4 values travel two to a byte. Measured on a toy MoE (hidden 256, 16
    experts, its embedding and attention a large share): a version of 8.28 MB in bf16 is 4.35
    MB in int8, 5.15 MB in int8_experts and 3.75 MB in int4_experts.

    Args:
      url: the store.
      dtype: the serving dtype (e.g. bfloat16), or None.
      quantization: a coder.infer.quantize mode name ("" / None: full precision).
      anchor_every: as WeightPublisher's.
    """

    def __init__(self, url: str, *, dtype=None, quantization=None, anchor_every: int = 10):
        import jax  # heavy: jax (this module loads without it)

        from coder.infer import quantize  # jax too

        self.url, self.dtype = url, dtype
        self.quantization = quantize.quantization(quantization)
        self._quantize = jax.jit(lambda s: quantize.quantize_state(s, self.quantization))
        self.writer = weight_sync.WeightPublisher(url, shard=(jax.process_index(), jax.process_count()),
                                      anchor_every=anchor_every)

    def publish(self, model, version: int) -> dict:
        """Writes `model`'s variables (an nnx module or state) as `version`; returns
        WeightPublisher.publish's record, its "seconds" including the copies to host."""
        import jax  # heavy: jax (this module loads without it)
        from flax import nnx

        from coder.infer import quantize  # jax too

        t0 = time.perf_counter()
        state = model if isinstance(model, nnx.State) else nnx.state(model)
        if self.quantization is not None:
            state = self._quantize(jax.tree.map(self._cast, state))
        flat = {}
        for name, x in quantize.to_flat(state).items():
            x = self._cast(x)
            flat[name] = x if isinstance(x, jax.Array) else np.asarray(x)
        mine = weight_sync.local_slices(flat)
        copied = time.perf_counter() - t0
        info = self.writer.publish(int(version), mine)
        info["seconds"] += copied
        return info

    def _cast(self, x):
        """A floating leaf of 16 bits or more in the serving dtype (an 8-bit float is a quantized
        weight's values)."""
        from coder.model.quantized import is_wide_float  # jax too

        return x.astype(self.dtype) if self.dtype is not None and is_wide_float(x.dtype) else x

    def gc(self, keep_from: int) -> dict | None:
        """`gc(url, keep_from)` from process 0 (None on the others)."""
        import jax  # heavy: jax (this module loads without it)

        return weight_sync.gc(self.url, keep_from) if jax.process_index() == 0 else None


_SHARDED_READERS: dict = {}  # (url, leaves, shardings) -> this process's WeightReader


@dataclasses.dataclass(frozen=True)
class StoreLoad:
    """A picklable weight loader for `Engine.load_weights`: every process of an engine calls it
    with its shardings and reads only its own devices' slices of `version` (default: the newest
    complete one). The process keeps one reader per (url, shardings), so the next version costs
    its deltas. `quantized`: the store holds a quantizing publisher's form (ServedWeights.load
    then asks for those leaves)."""

    url: str
    version: int | None = None
    quantized: bool = False

    def __call__(self, shardings: dict) -> dict:
        key = (self.url, tuple(sorted(shardings.items(), key=lambda kv: kv[0])))
        reader = _SHARDED_READERS.get(key)
        if reader is None:
            reader = _SHARDED_READERS[key] = weight_sync.WeightReader(self.url, shardings=shardings)
        try:
            out = reader.load(self.version)[1]
        except weight_sync.WeightStoreError as e:  # in the engine's thread: the engine stops, naming it
            raise StoreUnreadable(f"the weight store {self.url}: {e}") from e
        _SHARDED_READS.setdefault(self.url, []).append((int(reader.last_read["version"]),
                                                         int(reader.last_read["bytes"])))
        return out


_SHARDED_READS: dict = {}  # url -> [(version, bytes of this process's own slices)] its StoreLoads read

_STAGED: dict = {}  # this process's learner state on device, staged for a colocated engine: version -> flat


def stage_on_device(model, version: int) -> None:
    """Colocated mode: `model`'s variables (the learner's arrays, whatever processes they span)
    as `version`, for this process's part of the engine's next `OnDevice(version)` load. Nothing
    is copied here; the newest staged version replaces the older one. Every process of the job
    stages every version (the load runs on all of them)."""
    from flax import nnx

    state = model if isinstance(model, nnx.State) else nnx.state(model)
    _STAGED.clear()
    _STAGED[int(version)] = state_to_flat(state)


@dataclasses.dataclass(frozen=True)
class OnDevice:
    """A picklable weight loader for `Engine.load_weights` in colocated mode: every process of the
    engine gives its staged learner arrays of `version` (`stage_on_device`), and the engine
    reshards them on device into its own shardings and dtype. No host copy, no store.

    The learner's next step donates those arrays, so the engine must have applied the load
    before it (`Engine.settle()` waits for that)."""

    version: int

    def __call__(self, shardings: dict) -> dict:
        import jax  # heavy: jax (this module loads without it)

        flat = _STAGED.get(self.version)
        if flat is None:
            raise RuntimeError(f"process {jax.process_index()}: the engine loads version {self.version} on "
                               f"device, but this process staged {sorted(_STAGED) or 'none'} "
                               "(weight_channel.stage_on_device after every learner step, on every process)")
        return {name: flat[name] for name in shardings}


class EngineFollower:
    """The reading end of the weight channel, one for every consumer (the RL actors, the server,
    realtime's server): polls the store and gives each new version to an engine, between two of
    its decode calls (in flight: rows keep their caches).

    One process: `WeightReader.poll()` (the deltas since the held version) -> `set_weights`,
    floating leaves in the engine's serving dtype (`engine.dtype`; an engine without one keeps
    `template`'s dtypes), the others in `template`'s. An engine over several processes:
    `load_weights(StoreLoad(url, version))`, so each process reads its own devices' slices (the
    engine casts them to its dtype on device).

        follower = EngineFollower(engine, url, nnx.state(model), timeout_s=600)
        follower.first()                # an engine built without weights: the first version
        follower.poll()                 # -> the version applied, or None when nothing is new
        follower.try_poll()             # the same, a failing store tolerated for timeout_s
        follower.start(poll_seconds)    # or try_poll in a thread until close()
        follower.health()               # the version held, and while the store fails, why

    An unreadable store (a corrupt leaf, a version whose chain is broken, a store that cannot be
    listed) is never a silent wait: `try_poll` counts the failed polls in a row and, once they
    have failed for `timeout_s`, raises `StoreUnreadable` naming the store, the version the engine
    holds and the last error (which names the version read and, for a corrupt or missing leaf,
    the leaf). The RL actors stop on it (coder/rl/actor_worker.py); a server's thread keeps
    serving the version it holds, logs it, and `health()` (its GET /health) reports it.
    """

    def __init__(self, engine, url: str, template, *, verify: bool = True, timeout_s: float = 600.0):
        from jax import numpy as jnp

        self.engine, self.url, self.template = engine, url, template
        self.reader = weight_sync.WeightReader(url, verify=verify)
        serving = engine.dtype
        self._dtypes = {k: serving if serving is not None and jnp.issubdtype(v.dtype, jnp.floating) else v.dtype
                        for k, v in state_to_flat(template).items()}  # leaf -> the engine's dtype
        self.version: int | None = None
        self._start_version = None  # bytes_read counts the versions after it
        self.last_read: dict = {}  # the reader's record of that version (bytes, seconds, ...)
        self._polled_bytes = 0  # bytes the polls read (one process)
        self.timeout_s = float(timeout_s)
        self.failures = 0  # polls failed in a row
        self.last_error = ""  # the last failed poll's error
        self._failing_since = 0.0  # time.monotonic() of the first of them
        self._stop = threading.Event()
        self._thread = None

    def first(self) -> int:
        """Gives an engine built without weights (from the abstract model) the store's newest
        version, by `try_poll` as every later one: waits up to `timeout_s` for a complete version
        (TimeoutError naming the store; StoreUnreadable when the store fails). Returns it;
        `bytes_read` counts the versions after it."""
        deadline = time.monotonic() + self.timeout_s
        while (version := self.try_poll()) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no complete version in the weight store {self.url} after {self.timeout_s:.0f} s")
            time.sleep(0.1)
        self._start_version, self._polled_bytes = version, 0
        return version

    def try_poll(self) -> int | None:
        """`poll()`, a failure logged and counted (None) instead of raised, until the polls have
        failed for `timeout_s` in a row: then StoreUnreadable (class docstring). A poll that
        succeeds clears the count."""
        try:
            version = self.poll()
        except Exception as e:  # noqa: BLE001 - the store's, the engine's: counted, named, bounded
            now = time.monotonic()
            if not self.failures:
                self._failing_since = now
            self.failures += 1
            self.last_error = f"{type(e).__name__}: {e}"
            failing = now - self._failing_since
            if failing >= self.timeout_s:
                raise StoreUnreadable(f"the weight store {self.url} has been unreadable for {failing:.0f} s "
                                      f"({self.failures} polls in a row failed; the engine holds version "
                                      f"{self.version}); the last: {self.last_error}") from e
            if self.failures & (self.failures - 1) == 0:  # the 1st, 2nd, 4th, 8th, ... of a spell
                logging.warning("polling the weight store %s failed (%d in a row, for %.0f s of at most %.0f): %s",
                                self.url, self.failures, failing, self.timeout_s, self.last_error)
            return None
        if self.failures:
            logging.info("the weight store %s is readable again after %d failed polls", self.url, self.failures)
        self.failures, self.last_error = 0, ""
        return version

    def health(self) -> dict:
        """{"version": held, "store": url}, and while the store's polls fail, "failures" (in a
        row), "failing_s" and "error" (the last poll's: it names the version read and the leaf)."""
        out = {"version": self.version, "store": self.url}
        if self.failures:
            out.update(failures=self.failures, failing_s=round(time.monotonic() - self._failing_since, 1),
                       error=self.last_error)
        return out

    def poll(self) -> int | None:
        """Gives the engine the store's newest version when it is new; returns it (else None).
        Raises ValueError when the store holds another model."""

        if getattr(self.engine, "processes", 1) > 1:
            version = weight_sync.latest_version(self.url)
            if version is None or version == self.version:
                return None
            quantized = self.engine.weights.quantization is not None  # the same rl.engine_quantization as the publisher
            self.engine.load_weights(StoreLoad(self.url, version, quantized), version)
            self.version, self.last_read = version, {"version": version, "from": "each process's slices"}
            logging.info("weight version %d from %s: read by every process of the engine", version, self.url)
            return version
        got = self.reader.poll()
        if got is None:
            return None
        version, flat = got
        state = self._state(version, flat)
        self.engine.set_weights(state, version)
        self.version, self.last_read = version, dict(self.reader.last_read)
        self._polled_bytes += int(self.last_read.get("bytes", 0))
        logging.info("weight version %d from %s (%s)", version, self.url, self.last_read)
        return version

    def _state(self, version: int, flat: dict):
        """The nnx.State of a version the store gave whole: full precision in `template`'s
        structure, or a quantizing publisher's form in the engine's served one."""
        from coder.infer import quantize  # jax too

        if quantize.holds_quantized(flat):
            if self.engine.weights.quantization is None:
                raise ValueError(f"weight store {self.url} version {version} holds quantized weights (its publisher's "
                                 "rl.engine_quantization), but this engine serves them full precision")
            template = self.engine.weights.state
            dtypes = {k: v.dtype for k, v in quantize.flat_shapes(template).items()}
            build = quantize.from_flat
        else:
            template, dtypes, build = self.template, self._dtypes, flat_to_state
        missing = sorted(set(dtypes) - set(flat))
        if missing:
            raise ValueError(f"weight store {self.url} version {version} lacks {len(missing)} of the model's "
                             f"variables, e.g. {missing[:3]}: it holds another model")
        return build(template, {k: np.asarray(flat[k]).astype(dt, copy=False) for k, dt in dtypes.items()})

    @property
    def bytes_read(self) -> int:
        """Bytes this process read from the store for the versions it followed since it was
        built: on several processes, its own devices' slices (counted once the engine loaded
        them, at its next call)."""
        if getattr(self.engine, "processes", 1) > 1:
            start = -1 if self._start_version is None else self._start_version
            return sum(b for v, b in _SHARDED_READS.get(self.url, []) if v > start)
        return self._polled_bytes

    def _loop(self, poll_seconds: float):
        reported = False  # this spell of failures was logged as an error
        while not self._stop.is_set():
            try:
                self.try_poll()
                reported = reported and self.failures > 0
            except StoreUnreadable as e:  # a server: it keeps serving what it holds, and says so
                if not reported:
                    logging.error("%s: still serving version %s (health: degraded)", e, self.version)
                reported = True
            self._stop.wait(poll_seconds)

    def start(self, poll_seconds: float = 10.0) -> None:
        """`try_poll` every `poll_seconds` in a daemon thread until `close()` (a server's)."""
        self._thread = threading.Thread(target=self._loop, args=(float(poll_seconds),), name="weight-follower",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
