"""The engine's prefix cache (Engine(prefix_cache_slots=k), coder/infer/scheduler.py): a finished
request's slot keeps its cache, and a later group whose prompt starts with those tokens prefills
only the rest. The math says nothing changes: the reused positions hold the keys and values a
fresh prefill computes from the same tokens and weights. So every reply must equal the one an
engine without the cache gives (tokens and expert ids exactly, logprobs to float tolerance: the
prefill splits the prompt at another point), and the counters show what was not prefilled.
"""
import jax
import numpy as np
import pytest
from flax import nnx

from coder.infer.engine import Engine, SamplingParams
from coder.model import Transformer
from tests.infer.engine_inputs import BATCH, LENS, MAX_LEN, tiny_cfg

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6)
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=6)


@pytest.fixture(scope="module")
def model_and_cfg():
    cfg = tiny_cfg()
    return cfg, Transformer(cfg, rngs=nnx.Rngs(0))


def engine_of(model, cfg, cached: int, **kw):
    return Engine(model, cfg, max_len=MAX_LEN, max_slots=4, batch_buckets=BATCH, len_buckets=LENS,
                  decode_steps=4, prefix_cache_slots=cached, **kw)


def conversation(engine, turns):
    """A multi-turn session as a stateless API serves it: each turn a new group whose prompt is
    the previous prompt + the reply + the turn's new tokens. Returns each turn's Generation."""
    prompt, out = [3, 17, 42, 5, 99, 7, 11], []
    for i, (new, params) in enumerate(turns):
        prompt = prompt + new
        g = engine.start_group(prompt, 1)
        gen = engine.generate(g, params, jax.random.key(i))[0]
        g.close()
        out.append(gen)
        prompt = prompt + gen.tokens
    return out


TURNS = [([], GREEDY), ([20, 21, 22], SAMPLED), ([30, 31], GREEDY), ([40], SAMPLED)]


def test_a_conversation_reuses_its_previous_turns_and_replies_as_without_the_cache(model_and_cfg):
    cfg, model = model_and_cfg
    plain, cached = engine_of(model, cfg, 0), engine_of(model, cfg, 2)
    want, got = conversation(plain, TURNS), conversation(cached, TURNS)
    for a, b in zip(want, got):
        assert a.tokens == b.tokens and a.finish_reason == b.finish_reason
        np.testing.assert_array_equal(a.expert_ids, b.expert_ids)
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=2e-5)
    p, c = plain.stats(), cached.stats()
    # turns 2-4 reuse everything before their new tokens: the previous prompt and reply
    assert (p["prefix_hits"], c["prefix_hits"]) == (0, 3)
    assert c["prefix_tokens"] == p["prefill_tokens"] - c["prefill_tokens"] > 0
    plain.close()
    cached.close()


def test_new_weights_flush_the_cache_and_full_slots_evict_it(model_and_cfg):
    """A cached prefix computed with older weights is never reused; a group that needs every
    slot evicts the cached ones (least recently used first) instead of waiting for them."""
    cfg, model = model_and_cfg
    engine = engine_of(model, cfg, 3)
    conversation(engine, TURNS[:1])
    engine.settle()  # the closed group's slot released (the engine thread does it)
    assert len(engine.sched.prefixes) == 1
    other = Transformer(cfg, rngs=nnx.Rngs(1))
    engine.set_weights(other)
    fresh = engine_of(other, cfg, 0)
    # the same first turn again: with the new weights, prefilled in full, as a fresh engine does
    got, want = conversation(engine, TURNS[:2]), conversation(fresh, TURNS[:2])
    assert [g.tokens for g in got] == [w.tokens for w in want]
    assert engine.stats()["prefix_hits"] == 1  # turn 2 reused turn 1 of the new weights only
    engine.settle()
    assert len(engine.sched.prefixes) == 2
    g = engine.start_group([1, 2, 3], 4)  # every slot: both cached prefixes are evicted
    assert len(engine.sched.prefixes) == 0
    g.close()
    engine.close()
    fresh.close()


def test_prefix_cache_slots_must_leave_a_slot_to_decode(model_and_cfg):
    cfg, model = model_and_cfg
    with pytest.raises(ValueError, match="prefix_cache_slots=4"):
        engine_of(model, cfg, 4)


def test_a_row_held_across_new_weights_is_never_cached(model_and_cfg):
    """In-flight updates: a row admitted under the old weights and released after new ones came
    holds keys and values of the old weights; its slot must not become a cached prefix, so the
    next group prefills in full and samples what a fresh engine of the new weights samples."""
    cfg, model = model_and_cfg
    engine = engine_of(model, cfg, 2)
    prompt = [3, 17, 42, 5, 99, 7, 11]
    g = engine.start_group(prompt, 1)
    first = engine.generate(g, GREEDY, jax.random.key(0))[0]
    other = Transformer(cfg, rngs=nnx.Rngs(1))
    engine.set_weights(other)
    engine.settle()  # the new weights are in (the row still holds its old cache)
    g.close()
    engine.settle()
    assert len(engine.sched.prefixes) == 0
    fresh = engine_of(other, cfg, 0)
    again = prompt + first.tokens + [20, 21]
    got = [engine.generate(h, GREEDY, jax.random.key(1))[0].tokens for h in [engine.start_group(again, 1)]]
    want = [fresh.generate(h, GREEDY, jax.random.key(1))[0].tokens for h in [fresh.start_group(again, 1)]]
    assert got == want and engine.stats()["prefix_hits"] == 0
    engine.close()
    fresh.close()


def test_each_row_counts_what_it_prefilled_and_what_it_reused(model_and_cfg):
    """Group.prefill_counts: the rows' counts add up to the engine's counters (a group's shared
    prompt counts in its first row, a cached prefix's tokens in the row that took them)."""
    cfg, model = model_and_cfg
    engine = engine_of(model, cfg, 2)
    prompt = [3, 17, 42, 5, 99, 7, 11]
    g = engine.start_group(prompt, 2)
    out = engine.generate(g, GREEDY, jax.random.key(0))
    counts = [g.prefill_counts(i) for i in range(2)]
    assert counts == [(len(prompt), 0), (0, 0)]
    g.release(0)  # row 0 is done: its slot becomes a cached prefix
    engine.settle()
    h = engine.start_group(prompt + out[0].tokens + [20, 21], 1)
    engine.generate(h, GREEDY, jax.random.key(1))
    prefilled, reused = h.prefill_counts(0)
    s = engine.stats()
    assert reused == s["prefix_tokens"] == len(prompt) + len(out[0].tokens)  # row 0's whole cache
    assert prefilled == 2  # the new tokens only
    assert prefilled + counts[0][0] + g.prefill_counts(1)[0] == s["prefill_tokens"]
    g.close()
    h.close()
    engine.close()


def test_a_full_pool_hands_the_cached_slot_itself_to_the_next_window(model_and_cfg):
    """Every slot held but the cached one (an RL engine: a slot per rollout): the group whose
    prompt matches the cached prefix takes that slot as it is instead of evicting it, and replies
    as without the cache."""
    cfg, model = model_and_cfg

    def run(engine):
        other = engine.start_group([9, 8, 7, 6], 3)  # holds 3 of the 4 slots throughout
        out = conversation(engine, TURNS[:3])
        other.close()
        return out

    plain = Engine(model, cfg, max_len=MAX_LEN, max_slots=4, batch_buckets=BATCH, len_buckets=LENS, decode_steps=4)
    cached = engine_of(model, cfg, 1)
    want, got = run(plain), run(cached)
    assert [a.tokens for a in want] == [b.tokens for b in got]
    for a, b in zip(want, got):
        np.testing.assert_array_equal(a.expert_ids, b.expert_ids)
    s = cached.stats()
    assert s["prefix_hits"] == 2 and s["prefix_tokens"] == plain.stats()["prefill_tokens"] - s["prefill_tokens"] > 0
    plain.close()
    cached.close()


def test_in_place_reuse_keeps_the_pool_as_small_as_the_rows(model_and_cfg):
    """prefix_in_place (the RL engine): each turn takes the previous turn's slot as it is, so one
    slot serves the whole conversation (a copy would hold two), with the same replies."""
    cfg, model = model_and_cfg
    plain, cached = engine_of(model, cfg, 0), engine_of(model, cfg, 2, prefix_in_place=True)
    want, got = conversation(plain, TURNS), conversation(cached, TURNS)
    assert [a.tokens for a in want] == [b.tokens for b in got]
    for a, b in zip(want, got):
        np.testing.assert_array_equal(a.expert_ids, b.expert_ids)
    s = cached.stats()
    assert s["prefix_hits"] == 3 and s["prefix_tokens"] == plain.stats()["prefill_tokens"] - s["prefill_tokens"]
    assert cached.sched.pool.high == 1 and cached.compilations["copy"] == 0
    plain.close()
    cached.close()
