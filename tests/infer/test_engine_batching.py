"""Continuous batching, the multi-step decode loop, concurrent callers, and the engine on a mesh.

Rows of different groups and requests decode in the same batches; each must get exactly what it
gets alone (same tokens, same logprobs, greedy and sampled with a fixed key per row).
"""
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from coder.infer import programs
from coder.infer.engine import Engine, SamplingParams
from coder.model import Transformer, sharding
from configs.base import get_config
from tests.infer.engine_inputs import BATCH, LENS, MAX_LEN, tiny_cfg


@pytest.fixture(scope="module")
def model_and_cfg():
    cfg = tiny_cfg()
    return cfg, Transformer(cfg, rngs=nnx.Rngs(0))


def make_engine(model, cfg, **kw):
    kw = dict(max_len=MAX_LEN, batch_buckets=BATCH, len_buckets=LENS, **kw)
    return Engine(model, cfg, **kw)


PROMPTS = [[3, 17, 42, 5, 99, 7], [8, 120, 33, 1, 2], [50, 51, 52, 53, 54, 55, 56, 57], [9, 9, 4]]
PARAMS = [SamplingParams(temperature=0.0, max_new_tokens=20),
          SamplingParams(temperature=1.0, max_new_tokens=7),
          SamplingParams(temperature=0.7, top_k=20, max_new_tokens=25),
          SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=3)]


def alone(model, cfg, i):
    """Request i on a fresh engine, by itself."""
    engine = make_engine(model, cfg, decode_steps=4)
    g = engine.start_group(PROMPTS[i], 1)
    out = engine.generate(g, PARAMS[i], jax.random.key(100 + i))[0]
    engine.close()
    return out


@pytest.mark.slow
def test_concurrent_rows_equal_rows_alone_and_join_and_leave(model_and_cfg):
    """Four requests of different lengths and settings from four threads, started at different
    times: rows join mid-flight and leave as they finish; each equals its own run alone."""
    cfg, model = model_and_cfg
    ref = [alone(model, cfg, i) for i in range(4)]
    engine = make_engine(model, cfg, decode_steps=4)
    results = [None] * 4

    def run(i):
        time.sleep(0.05 * i)
        g = engine.start_group(PROMPTS[i], 1)
        results[i] = engine.generate(g, PARAMS[i], jax.random.key(100 + i))[0]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    streamed = []
    g = engine.start_group(PROMPTS[2], 1)
    again = engine.generate(g, PARAMS[2], jax.random.key(102), on_tokens=lambda row, t, lp: streamed.append(t))[0]
    assert len(streamed) > 1 and sum(streamed, []) == again.tokens == ref[2].tokens  # streamed per call
    for i in range(4):
        assert results[i].tokens == ref[i].tokens, i
        np.testing.assert_allclose(results[i].logprobs, ref[i].logprobs, atol=1e-5, rtol=0)
        np.testing.assert_array_equal(results[i].expert_ids, ref[i].expert_ids)
        assert results[i].expert_ids.dtype == np.uint8
    # rows shared decode calls: fewer steps than decoding them one after another
    assert engine.stats()["rows_per_step"] > 1.0
    engine.close()


def test_row_waiting_on_a_tool_does_not_block_others(model_and_cfg):
    """Row A holds its slot while its 'tool' runs; row B decodes to the end meanwhile; A then
    resumes with only the observation prefilled."""
    cfg, model = model_and_cfg
    engine = make_engine(model, cfg, decode_steps=4)
    ga, gb = engine.start_group(PROMPTS[0], 1), engine.start_group(PROMPTS[1], 1)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=5)
    engine.generate(ga, greedy, jax.random.key(0))
    b_finished = threading.Event()
    b_done_during_tool = []

    def agent_a():  # A's tool runs until B has finished decoding (or gives up after 120 s)
        b_done_during_tool.append(b_finished.wait(timeout=120))

    t = threading.Thread(target=agent_a)
    t.start()
    engine.generate(gb, SamplingParams(temperature=0.0, max_new_tokens=30), jax.random.key(1))
    b_finished.set()
    t.join()
    assert b_done_during_tool == [True]
    before = engine.counters.prefill_tokens
    engine.append(ga, 0, [1, 2, 3])
    more = engine.generate(ga, greedy, jax.random.key(0))[0]
    assert engine.counters.prefill_tokens - before == 3 and len(more.tokens) == 5
    engine.close()


def test_multi_step_loop_stops_on_the_stop_token_on_device(model_and_cfg):
    """One decode call of 16 steps: a row stops right after its stop token, another at its budget,
    and the loop ends when both have (fewer steps than asked)."""
    cfg, model = model_and_cfg
    engine = make_engine(model, cfg, decode_steps=16)
    g = engine.start_group(PROMPTS[2], 1)
    free = engine.generate(g, SamplingParams(temperature=0.0, max_new_tokens=12), jax.random.key(0))[0].tokens
    stop = free[4]
    first = free.index(stop)
    graphdef, state = nnx.split(model)
    store = programs.empty_store(cfg, 2, 32, jnp.float32, 0)
    p = PROMPTS[2]
    tokens = np.zeros((2, 16), np.int32)
    tokens[:, :len(p)] = p
    seg = (np.arange(16) < len(p)).astype(np.int32)[None].repeat(2, 0)
    pos = np.arange(16, dtype=np.int32)[None].repeat(2, 0)
    store, _ = jax.jit(lambda *a: programs.prefill(graphdef, *a, spec_k=0, experts_dtype=jnp.uint8))(
        state, store, np.arange(2, dtype=np.int32), tokens, pos, seg, np.full((2,), len(p) - 1, np.int32))
    key = np.asarray(jax.random.key_data(jax.random.fold_in(jax.random.key(0), 0)))
    rows = programs.SlotInputs(
        length=np.full((2,), len(p), np.int32), active=np.ones((2,), bool), budget=np.array([12, 3], np.int32),
        rng=np.stack([key, key]), temperature=np.zeros((2,), np.float32), top_k=np.zeros((2,), np.int32),
        top_p=np.ones((2,), np.float32), stops=np.array([[stop] + [-1] * 7, [-1] * 8], np.int32))
    _, out = jax.jit(lambda *a: programs.decode(graphdef, *a, num_steps=16, experts_dtype=jnp.uint8))(
        state, store, rows, np.int32(1))
    assert out.count.tolist() == [first + 1, 3]
    assert out.tokens[0, :first + 1].tolist() == free[:first + 1]
    assert bool(out.stopped[0]) and not bool(out.stopped[1])
    assert int(out.steps) == first + 1 < 16


def test_a_streaming_caller_cancels_its_row_and_the_others_go_on(model_and_cfg):
    """on_tokens returning True cancels that row after the call's tokens (finish_reason
    "cancelled", a prefix of its uncancelled tokens); the other row of the same generate decodes
    to its budget; the cancelled row keeps its cache and a later generate continues it."""
    cfg, model = model_and_cfg
    greedy = SamplingParams(temperature=0.0, max_new_tokens=20)
    engine = make_engine(model, cfg, decode_steps=4)
    g = engine.start_group(PROMPTS[0], 2)
    full = engine.generate(g, greedy, jax.random.key(0), rows=[0])[0].tokens
    calls = []

    def on_tokens(row, tokens, logprobs):
        calls.append((row, len(tokens)))
        return row == 1 and sum(n for r, n in calls if r == 1) >= 6

    before = engine.stats()["decode_steps"]
    out = engine.generate(g, greedy, jax.random.key(0), rows=[1], on_tokens=on_tokens)[0]
    assert out.finish_reason == "cancelled"
    assert 6 <= len(out.tokens) < 20 and out.tokens == full[:len(out.tokens)]
    assert engine.stats()["decode_steps"] - before < 20  # it left the batch: no decode to the budget
    rest = engine.generate(g, SamplingParams(temperature=0.0, max_new_tokens=20 - len(out.tokens)),
                           jax.random.key(0), rows=[1])[0]
    assert rest.finish_reason == "length" and out.tokens + rest.tokens == full
    g.close()
    # two rows in one call: only the cancelled one stops early
    g = engine.start_group(PROMPTS[0], 2)
    both = engine.generate(g, greedy, jax.random.key(0), on_tokens=lambda row, t, lp: row == 0)
    assert both[0].finish_reason == "cancelled" and 0 < len(both[0].tokens) <= 4
    assert both[1].finish_reason == "length" and both[1].tokens == full
    g.close()
    engine.close()


def test_all_slots_held_is_an_error_not_a_hang(model_and_cfg):
    cfg, model = model_and_cfg
    engine = make_engine(model, cfg, max_slots=2, admission_timeout_s=1.0)
    held = engine.start_group(PROMPTS[0], 2)
    with pytest.raises(RuntimeError, match="are held by open groups"):
        engine.start_group(PROMPTS[1], 1)
    held.release(1)  # one row done: its slot alone comes back
    one = engine.start_group(PROMPTS[1], 1)
    assert len(engine.generate(one, PARAMS[0], jax.random.key(0))[0].tokens) == 20
    assert len(engine.generate(held, PARAMS[1], jax.random.key(0), rows=[0])[0].tokens) == 7
    one.close()
    engine.admission_timeout_s = 60.0
    closer = threading.Timer(0.3, held.close)  # another agent finishes: its slots come back
    closer.start()
    g = engine.start_group(PROMPTS[1], 2)  # waits for them
    closer.join()
    assert len(engine.generate(g, PARAMS[0], jax.random.key(0))) == 2
    engine.close()


@pytest.mark.slow
def test_sharded_engine_equals_single_device(model_and_cfg):
    """8 fake devices, tensor=2, expert=2, data=2: weights sharded by the training rules, slots
    over data; same tokens and logprobs as the single-device engine; bf16 serving weights run."""
    cfg, model = model_and_cfg
    mcfg = get_config().mesh
    mcfg.update(dict(data=2, fsdp=1, expert=2, tensor=2))
    mesh = sharding.make_mesh(mcfg)
    params = SamplingParams(temperature=1.0, max_new_tokens=10)
    out = {}
    for name, kw in (("single", {}), ("mesh", dict(mesh=mesh, rules=mcfg.rules))):
        engine = make_engine(model, cfg, decode_steps=4, **kw)
        g = engine.start_group(PROMPTS[0], 4)
        out[name] = engine.generate(g, params, jax.random.key(3))
        if name == "mesh":
            experts = [v.get_value() for _, v in nnx.to_flat_state(engine.weights.state)
                       if v.get_metadata().get("logical_axes", (None,))[0] == "exp"]
            assert experts and all(len(x.sharding.device_set) == 8 and not x.sharding.is_fully_replicated
                                   for x in experts)
            engine.set_weights(nnx.state(model), version=5)  # in flight, sharded
            more = engine.generate(g, params, jax.random.key(4))
            assert all(v == 5 for m in more for v in m.policy_version[1:])
        engine.close()
    for a, b in zip(out["single"], out["mesh"]):
        assert a.tokens == b.tokens
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4, rtol=0)
    bf16 = make_engine(model, cfg, decode_steps=4, mesh=mesh, rules=mcfg.rules, dtype="bfloat16")
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(bf16.weights.state) if jnp.issubdtype(x.dtype, jnp.floating))
    gens = bf16.generate(bf16.start_group(PROMPTS[0], 2), params, jax.random.key(3))
    assert all(len(g.tokens) == 10 for g in gens)
    bf16.close()


@pytest.mark.slow
def test_data_parallel_attention_engine_equals_single_device(model_and_cfg):
    """rl.engine_attention="data_parallel" on 8 fake devices (expert=4 x data=2): each device
    holds one of the 8 rows' KV cache and the non-expert weights whole, the experts stay split,
    and the rows decode to the single-device engine's tokens and logprobs (greedy and sampled)."""
    cfg, model = model_and_cfg
    mcfg = get_config().mesh
    mcfg.update(dict(data=2, fsdp=1, expert=4, tensor=1))
    mesh = sharding.make_mesh(mcfg)
    rules = sharding.data_parallel_attention(mcfg.rules)
    assert sharding.mesh_axes_of("batch", rules) == ("data", "fsdp", "expert")
    assert sharding.mesh_axes_of("exp", rules) == ("expert",)
    out = {}
    for name, kw in (("single", {}), ("dp", dict(mesh=mesh, rules=rules))):
        engine = make_engine(model, cfg, decode_steps=4, max_slots=8, **kw)
        out[name] = []
        for params in (PARAMS[0], SamplingParams(temperature=1.0, max_new_tokens=10)):
            g = engine.start_group(PROMPTS[0], 8)
            out[name] += engine.generate(g, params, jax.random.key(3))
            g.close()
        # a pool split over devices prefills aligned to itself (programs.prefill_pool: no row's
        # cache gathered), one on one device picks its rows (programs.prefill)
        assert (engine.compilations["prefill_pool"] > 0) == (name == "dp"), engine.compilations
        assert (engine.compilations["prefill"] > 0) == (name == "single"), engine.compilations
        if name == "dp":
            caches = jax.tree.leaves(engine.pool_store.store.cache)
            assert caches and all(c.addressable_shards[0].data.shape[0] == c.shape[0] // 8
                                  for c in caches)  # one row per device
            flat = [(v.get_metadata().get("logical_axes", (None,)), v.get_value())
                    for _, v in nnx.to_flat_state(engine.weights.state)]
            assert all(x.sharding.is_fully_replicated for axes, x in flat if "exp" not in axes)
            assert all(not x.sharding.is_fully_replicated for axes, x in flat if axes[:1] == ("exp",))
        engine.close()
    for a, b in zip(out["single"], out["dp"]):
        assert a.tokens == b.tokens
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4, rtol=0)
        np.testing.assert_array_equal(a.expert_ids, b.expert_ids)
