"""The weight channel (coder/rl/weight_channel.py) between the learner, the store and an engine:
one serving dtype at both ends (`coder.rl.actor.serving_dtype`), the first version through the
same follower as every later one."""
import threading
import time

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from coder.rl import actor as actor_lib
from coder.rl import actor_worker, topology, weight_channel, weight_sync


def served_dtypes(engine) -> set:
    """The dtypes of the floating weights `engine` decodes with (after a decode call applied them)."""
    return {x.dtype for x in jax.tree.leaves(engine.weights.state) if jnp.issubdtype(x.dtype, jnp.floating)}


def test_a_one_process_actor_takes_every_version_in_the_serving_dtype(weight_path, caplog):
    """model.dtype bfloat16, float32 parameters, rl.engine_dtype "": the store holds bfloat16, and
    the actor's engine serves version 0 and every later version in bfloat16 (it once got version
    0 in bfloat16 and every later one cast back to float32, which set_weights refused: the
    poller retried forever)."""
    wp = weight_path
    wp.publish(0)
    _, stored = weight_sync.load(wp.url)
    assert {x.dtype for x in stored.values() if jnp.issubdtype(x.dtype, jnp.floating)} == {jnp.dtype("bfloat16")}
    worker = actor_worker.ActorWorker(wp.config, wp.tok, None, None, wp.url, mesh=wp.mesh)
    try:
        assert wp.decode(worker.engine) == [0, 0]
        assert served_dtypes(worker.engine) == {jnp.dtype("bfloat16")}
        wp.publish(1)
        worker.notify(1)
        until = time.monotonic() + 60
        while worker.version < 1:
            errors = [r.getMessage() + (f": {r.exc_info[1]}" if r.exc_info else "") for r in caplog.records
                      if r.levelname in ("ERROR", "WARNING")]
            assert time.monotonic() < until and not errors, f"the actor never applied version 1: {errors}"
            time.sleep(0.05)
        assert wp.decode(worker.engine) == [1, 1]
        assert served_dtypes(worker.engine) == {jnp.dtype("bfloat16")}
    finally:
        worker.close()


@pytest.mark.parametrize("engine_dtype, served", [("", "bfloat16"), ("float32", "float32")])
def test_an_engine_built_from_the_abstract_model_serves_in_the_serving_dtype(weight_path, engine_dtype, served):
    """An engine built without weights (colocated, or over several processes) serves in
    `serving_dtype`: rl.engine_dtype, "" = model.dtype, as configs/base.py says (it kept
    model.param_dtype, float32, for "")."""
    wp = weight_path
    wp.config.rl.engine_dtype = engine_dtype
    assert actor_lib.serving_dtype(wp.config) == jnp.dtype(served)
    wp.publish(0)
    engine = actor_lib.make_engine(nnx.eval_shape(actor_lib.model_fn(wp.config)), wp.config, mesh=wp.mesh)
    try:
        engine.load_weights(weight_channel.StoreLoad(wp.url, 0), 0)
        assert wp.decode(engine) == [0, 0]
        assert served_dtypes(engine) == {jnp.dtype(served)}
    finally:
        engine.close()


def test_a_quantizing_publisher_stores_the_engines_form_and_its_deltas(weight_path, tmp_path):
    """rl.engine_quantization="int8": the learner publishes the int8 values and scales the
    engines serve (coder.infer.quantize.to_flat's names), a one-process follower (ActorWorker)
    and an engine over the abstract model (StoreLoad, as over several processes) take them as
    they are and hold exactly what an engine quantizing the float version itself holds; the
    version moves fewer bytes than bf16's, and the next version's int8 values are a delta."""
    from coder.infer import quantize
    from coder.model import Transformer

    wp = weight_path
    float_url = str(tmp_path / "float")
    float_publisher = weight_channel.ModelPublisher(float_url, dtype=jnp.bfloat16)
    float_publisher.publish(Transformer(wp.config.model, rngs=nnx.Rngs(0)), 0)
    wp.config.rl.engine_quantization = "int8"
    wp.publish(0)
    _, stored = weight_sync.load(wp.url)
    assert quantize.holds_quantized(stored) and {stored[k].dtype for k in stored if k.endswith(".values")} == {
        jnp.dtype("int8")}
    int8_bytes, bf16_bytes = (sum(x.nbytes for x in weight_sync.load(u)[1].values()) for u in (wp.url, float_url))
    assert int8_bytes < 0.7 * bf16_bytes, (int8_bytes, bf16_bytes)
    own = actor_lib.make_engine(actor_lib.model_fn(wp.config)(), wp.config, mesh=wp.mesh)  # quantizes itself
    own_flat = quantize.to_flat(own.weights.state)
    own.close()
    worker = actor_worker.ActorWorker(wp.config, wp.tok, None, None, wp.url, mesh=wp.mesh)
    abstract = actor_lib.make_engine(nnx.eval_shape(actor_lib.model_fn(wp.config)), wp.config, mesh=wp.mesh)
    try:
        assert wp.decode(worker.engine) == [0, 0]
        abstract.load_weights(weight_channel.StoreLoad(wp.url, 0, quantized=True), 0)
        assert wp.decode(abstract) == [0, 0]
        for engine in (worker.engine, abstract):
            held = quantize.to_flat(engine.weights.state)
            assert held.keys() == own_flat.keys()
            assert all(bool((held[k] == own_flat[k]).all()) for k in held)
        # the same weights again (seed 0): every leaf a delta, of nothing
        info = wp.publisher.publish(Transformer(wp.config.model, rngs=nnx.Rngs(0)), 1)
        wp.deliver(1)
        # (a leaf whose delta is not smaller stays an anchor: measured 1 of 46 here, 7.6% of the raw bytes moved)
        assert info["delta_leaves"] > 10 * info["anchor_leaves"] and info["bytes"] < 0.1 * info["raw_bytes"], info
        _, again = weight_sync.load(wp.url, 1)
        assert all(bool((again[k] == stored[k]).all()) for k in stored)
    finally:
        worker.close()
        abstract.close()
    # INT4 experts travel two to a byte: an engine over the abstract model holds what one
    # quantizing the float weights itself holds
    wp.config.rl.engine_quantization = "int4_experts"
    url4 = str(tmp_path / "int4")
    topology.learner_weights(wp.config, url4).publish(Transformer(wp.config.model, rngs=nnx.Rngs(0)), 0)
    _, stored4 = weight_sync.load(url4)
    packed = [k for k in stored4 if k.endswith(".values")]
    assert packed and all(stored4[k].dtype == jnp.uint8 for k in packed)
    own = actor_lib.make_engine(actor_lib.model_fn(wp.config)(), wp.config, mesh=wp.mesh)
    abstract = actor_lib.make_engine(nnx.eval_shape(actor_lib.model_fn(wp.config)), wp.config, mesh=wp.mesh)
    try:
        abstract.load_weights(weight_channel.StoreLoad(url4, 0, quantized=True), 0)
        assert wp.decode(abstract) == [0, 0]
        want, held = quantize.to_flat(own.weights.state), quantize.to_flat(abstract.weights.state)
        assert held.keys() == want.keys() and all(bool((held[k] == want[k]).all()) for k in held)
        one = actor_worker.ActorWorker(wp.config, wp.tok, None, None, url4, mesh=wp.mesh)  # the host path
        try:
            held = quantize.to_flat(one.engine.weights.state)
            assert all(bool((held[k] == want[k]).all()) for k in held)
        finally:
            one.close()
    finally:
        own.close()
        abstract.close()
    wp.config.rl.engine_quantization = ""  # a full-precision engine's follower refuses the quantized store
    engine = actor_lib.make_engine(actor_lib.model_fn(wp.config)(), wp.config, mesh=wp.mesh)
    try:
        follower = weight_channel.EngineFollower(engine, wp.url, nnx.state(actor_lib.model_fn(wp.config)()))
        with pytest.raises(ValueError, match="holds quantized weights"):
            follower.poll()
    finally:
        engine.close()


def _run_group_error(worker, min_version: int, wait_s: float = 60.0) -> BaseException | None:
    """What `worker.run_group` raises for a group that needs weights >= `min_version` (the test
    fails when it still waits after `wait_s`)."""
    from tests import rl_toy

    out = {}

    def run():
        try:
            worker.run_group(actor_worker.Work(0, rl_toy.make_tasks(1, 0)[0][0], min_version=min_version))
        except BaseException as e:  # noqa: BLE001 - the test reads it
            out["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(wait_s)
    assert not thread.is_alive(), f"run_group still waits for version >= {min_version} after {wait_s:.0f} s"
    return out.get("error")


@pytest.mark.parametrize("damage", ["corrupt leaf", "missing parent"])
def test_an_actor_that_cannot_read_the_store_stops_the_run_naming_the_store_version_and_leaf(weight_path, damage):
    """A corrupt leaf, or a version whose parent never reached the store: once the actor's polls
    have failed for its timeout (rl.weight_timeout_s) the group waiting for that version, and
    every later group, raises an error naming the store, the version and the leaf (the poller
    used to log and retry forever, and run_group to wait without a deadline)."""
    wp = weight_path
    wp.publish(0)
    worker = actor_worker.ActorWorker(wp.config, wp.tok, None, None, wp.url, mesh=wp.mesh, timeout_s=2.0)
    try:
        if damage == "corrupt leaf":
            version = 1
            wp.publish(version, hold=True)
            leaf = wp.corrupt(version)
        else:  # version 2 is a delta on version 1, which the store never got
            version, leaf = 2, "for leaf "
            wp.publish(1, seed=0, hold=True)
            wp.publish(2, seed=0, hold=True)
        wp.deliver(version)
        worker.notify(version)
        err = _run_group_error(worker, version)
        assert isinstance(err, weight_channel.StoreUnreadable), err
        message = str(err)
        assert wp.url in message and f"version {version}" in message and leaf in message, message
        assert "rl.weight_timeout_s" in message, message
        # and every later group, whatever version it needs: never a rollout on the old weights
        assert str(_run_group_error(worker, 0)) == message
    finally:
        worker.close()


def test_an_actor_waiting_for_a_version_the_store_never_gets_stops_the_run(weight_path):
    """A group that needs a version the store does not hold (lost, never written) raises after
    rl.weight_timeout_s, naming the store, the version it needs and the one it holds (it used to
    wait forever)."""
    wp = weight_path
    wp.config.rl.weight_timeout_s = 1.0
    wp.publish(0)
    worker = actor_worker.ActorWorker(wp.config, wp.tok, None, None, wp.url, mesh=wp.mesh)
    try:
        err = _run_group_error(worker, 1)
        assert isinstance(err, TimeoutError), err
        message = str(err)
        assert wp.url in message and "version >= 1" in message and "holds version 0" in message, message
        assert "rl.weight_timeout_s=1" in message, message
    finally:
        worker.close()


def test_a_follower_reports_a_store_it_cannot_read_and_recovers(weight_path):
    """A server's follower (its thread): while the store's polls fail it keeps the version it
    holds and says so in `health()` (GET /health: status "degraded"), naming the store, the
    version and the leaf; a readable newer version clears it (every version an anchor: the deltas
    after a corrupt version chain through it)."""
    wp = weight_path
    wp.config.rl.anchor_every = 1
    wp.publish(0)
    engine = actor_lib.make_engine(nnx.eval_shape(actor_lib.model_fn(wp.config)), wp.config, mesh=wp.mesh)
    template = nnx.state(nnx.eval_shape(actor_lib.model_fn(wp.config)))
    follower = weight_channel.EngineFollower(engine, wp.url, template, timeout_s=30.0)
    try:
        assert follower.first() == 0 and follower.health() == {"version": 0, "store": wp.url}
        wp.publish(1, hold=True)
        leaf = wp.corrupt(1)
        wp.deliver(1)
        follower.start(0.05)
        until = time.monotonic() + 60
        while follower.health().get("failures", 0) < 2:
            assert time.monotonic() < until, follower.health()
            time.sleep(0.05)
        health = follower.health()
        assert health["version"] == 0 and health["failing_s"] >= 0, health
        assert "version 1" in health["error"] and leaf in health["error"], health
        wp.publish(2)
        while follower.health() != {"version": 2, "store": wp.url}:
            assert time.monotonic() < until, follower.health()
            time.sleep(0.05)
        assert wp.decode(engine) == [2, 2]
    finally:
        follower.close()
        engine.close()
