"""The RL engine's memory estimate and its start-up refusal (coder.rl.actor.engine_memory,
check_engine_memory, make_engine).

The estimate is arithmetic on abstract shapes; it is checked against the arrays a real engine
places on the test's 8 CPU devices (weights sharded over expert x tensor, the cache pool split
over the data axis). CPU devices report no memory limit, so the refusals are shown with the
limit given (or `device_bytes_limit` replaced), set from the estimate itself.
"""
import jax
import pytest

from coder.rl import actor as actor_lib


def per_device_bytes(tree) -> int:
    """Bytes the busiest device holds of a tree of placed arrays."""
    leaves = jax.tree.leaves(tree)
    devices = {s.device for x in leaves for s in x.addressable_shards}
    return max(sum(s.data.nbytes for x in leaves for s in x.addressable_shards if s.device == d) for d in devices)


def test_estimate_equals_the_arrays_a_built_engine_places(quickstart_grpo):
    c = quickstart_grpo
    c.rl.engine_mesh.update({"expert": 2, "tensor": 2})
    c.rl.engine_dtype = "bfloat16"
    mesh = actor_lib.engine_mesh(c, jax.devices())
    assert dict(mesh.shape) == actor_lib.engine_mesh_shape(c, 8) == {"data": 2, "fsdp": 1, "expert": 2,
                                                                     "tensor": 2, "sequence": 1}
    mem = actor_lib.engine_memory(c, dict(mesh.shape))
    assert (mem.capacity, mem.batch_shards) == (1024, 2)  # rl.context_budget's bucket; rows over data
    engine = actor_lib.make_engine(actor_lib.model_fn(c)(), c, mesh=mesh)
    try:
        assert per_device_bytes(engine.weights.state) == mem.weights
        for rows in (1, 3, 4):  # a pool of 1 slot is replicated; 3 rows take the bucket of 4, split in 2
            engine.pool_store.fit(mem.pool_slots(rows), mem.capacity)  # the device call of the engine's _fit_pool
            assert per_device_bytes(engine.pool_store.store) == mem.per_device(rows) - mem.weights, rows
    finally:
        engine.close()
    assert mem.per_device(1) == mem.weights + mem.slot and mem.per_device(4) == mem.weights + 2 * mem.slot
    # the weights shrink with the model-parallel sizes, and the slot with a narrower cache dtype
    c.rl.engine_dtype = "float32"
    wide = actor_lib.engine_memory(c, dict(mesh.shape))
    assert wide.weights > mem.weights and wide.slot > mem.slot
    whole = actor_lib.engine_memory(c, {"data": 8, "fsdp": 1, "expert": 1, "tensor": 1, "sequence": 1})
    assert whole.weights > wide.weights and whole.batch_shards == 8


def test_the_estimate_counts_a_quantized_engine_at_its_formats_width(quickstart_grpo):
    """rl.engine_quantization="int4_experts": the routed experts take half a byte a value plus a
    bf16 scale per 32, on the same 8-device layout; the estimate is what the engine holds."""
    c = quickstart_grpo
    c.rl.engine_mesh.update({"expert": 2, "tensor": 2})
    c.rl.engine_dtype = "bfloat16"
    full = actor_lib.engine_memory(c, actor_lib.engine_mesh_shape(c, 8))
    c.rl.engine_quantization = "int4_experts"
    mesh = actor_lib.engine_mesh(c, jax.devices())
    mem = actor_lib.engine_memory(c, dict(mesh.shape))
    assert mem.weights < full.weights and mem.slot == full.slot
    model = actor_lib.model_fn(c)()
    engine = actor_lib.make_engine(model, c, mesh=mesh)
    try:
        assert engine.weights.bytes_per_device == mem.weights
        # the experts split over expert x tensor reach the shard_map quantized, each shard with
        # the scales of its own groups: what a full-precision engine on the same mesh samples
        # from the weights they stand for, bit for bit (with the down projection's group scales
        # left whole, a tensor shard's rows met the first groups' scales: log-probs off by 5.8e-3)
        from flax import nnx

        from coder.infer import quantize
        from coder.infer.engine import SamplingParams

        c.rl.engine_quantization = ""
        ref = actor_lib.make_engine(nnx.merge(nnx.graphdef(model), quantize.dequantize_state(
            jax.device_get(engine.weights.state))), c, mesh=mesh)
        try:
            out = []
            for e in (engine, ref):
                group = e.start_group([5, 6, 7, 8, 9], 2)
                out.append([(g.tokens, g.logprobs) for g in e.generate(
                    group, SamplingParams(temperature=1.0, max_new_tokens=6), jax.random.key(3))])
                group.close()
            assert out[0] == out[1]
        finally:
            ref.close()
    finally:
        engine.close()


def test_one_row_at_the_context_budget_beyond_the_limit_is_refused(quickstart_grpo):
    c = quickstart_grpo
    shape = actor_lib.engine_mesh_shape(c, 8)
    mem = actor_lib.engine_memory(c, shape)
    with pytest.raises(ValueError, match=r"rl\.context_budget=1024: the RL engine .* even one row at the budget "
                                         r"needs .* lower rl\.context_budget, .*rl\.engine_mesh=.*rl\.engine_dtype=''"):
        actor_lib.check_engine_memory(c, shape, mem.per_device(1) - 1)
    c.rl.context_budget = 512  # half the cache per slot: one row fits, and 32 rows (4 per device) too
    actor_lib.check_engine_memory(c, shape, mem.weights + 4 * actor_lib.engine_memory(c, shape).slot)


def test_engine_slots_beyond_the_limit_are_refused_naming_the_most_that_fit(quickstart_grpo):
    c = quickstart_grpo
    shape = actor_lib.engine_mesh_shape(c, 8)
    mem = actor_lib.engine_memory(c, shape)
    assert actor_lib.engine_slots(c) == 32 and mem.batch_shards == 8
    # room for 2 slots per device: a pool of 16 (2 per device) fits, 17..32 rows take a pool of 32
    limit = mem.weights + 2 * mem.slot
    assert mem.max_rows(limit, 32) == 16
    with pytest.raises(ValueError, match=r"rl\.engine_slots=0 \(32 rows; 0 = the larger of rl\.tasks_per_step x "
                                         r"rl\.group_size and rl\.eval_samples\).* set rl\.engine_slots <= 16, "
                                         r"the most rows that fit by this estimate"):
        actor_lib.check_engine_memory(c, shape, limit)
    c.rl.engine_slots = 16
    actor_lib.check_engine_memory(c, shape, limit)
    c.rl.engine_slots = 12  # 12 rows take a pool of 16: still 2 per device
    actor_lib.check_engine_memory(c, shape, limit)
    c.rl.engine_slots = 3  # 3 rows take a pool of 4, which does not split over 8 devices: replicated
    with pytest.raises(ValueError, match=r"rl\.engine_slots=3 \(3 rows.* set rl\.engine_slots <= 2,"):
        actor_lib.check_engine_memory(c, shape, limit)


def test_devices_without_a_memory_limit_check_nothing(quickstart_grpo):
    c = quickstart_grpo
    assert actor_lib.device_bytes_limit(jax.devices()) is None  # CPU devices report no bytes_limit
    c.rl.engine_slots = 10 ** 6
    actor_lib.check_engine_memory(c, actor_lib.engine_mesh_shape(c, 8), None)
    actor_lib.check_engine_devices(c, jax.devices())


def test_make_engine_refuses_before_placing_anything(quickstart_grpo, monkeypatch):
    """Where a Ray actor builds its engine (on its own slice, which the learner's start-up check
    cannot see): make_engine checks the mesh it is given against its devices' limit."""
    c = quickstart_grpo
    mesh = actor_lib.engine_mesh(c, jax.devices())
    mem = actor_lib.engine_memory(c, dict(mesh.shape))
    seen = []
    monkeypatch.setattr(actor_lib, "device_bytes_limit", lambda devices: seen.append(len(list(devices))) or
                        mem.per_device(1) - 1)
    with pytest.raises(ValueError, match=r"rl\.context_budget=1024: .*mesh of \{'data': 8"):
        actor_lib.make_engine(None, c, mesh=mesh)  # refused before the Engine would read the model
    assert seen == [8]
