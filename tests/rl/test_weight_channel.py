"""The weight channel (coder/rl/weight_channel.py) between the learner, the store and an engine:
one serving dtype at both ends (`coder.rl.actor.serving_dtype`), the first version through the
same follower as every later one."""
import time

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from coder.rl import actor as actor_lib
from coder.rl import actor_learner, weight_channel, weight_sync


def served_dtypes(engine) -> set:
    """The dtypes of the floating weights `engine` decodes with (after a decode call applied them)."""
    return {x.dtype for x in jax.tree.leaves(engine._state) if jnp.issubdtype(x.dtype, jnp.floating)}


def test_a_one_process_actor_takes_every_version_in_the_serving_dtype(weight_path, caplog):
    """model.dtype bfloat16, float32 parameters, rl.engine_dtype "": the store holds bfloat16, and
    the actor's engine serves version 0 and every later version in bfloat16 (it once got version
    0 in bfloat16 and every later one cast back to float32, which set_weights refused: the
    poller retried forever)."""
    wp = weight_path
    wp.publish(0)
    _, stored = weight_sync.load(wp.url)
    assert {x.dtype for x in stored.values() if jnp.issubdtype(x.dtype, jnp.floating)} == {jnp.dtype("bfloat16")}
    worker = actor_learner.ActorWorker(wp.config, wp.tok, None, None, wp.url, mesh=wp.mesh)
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
