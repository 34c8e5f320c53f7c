"""Rows offloaded to host memory (Engine(offload_idle_rows=True)): more agents than slots, each
waiting on a tool between turns. A waiting row's slot state moves to host memory when another
group or a returning row needs the slot, and comes back before the row decodes again. The state
comes back bit for bit, so every turn must equal the turn an engine with a slot per agent gives
(tokens and expert ids exactly, logprobs to float tolerance: other decode batches)."""
import jax
import numpy as np
import pytest
from flax import nnx

from coder.infer.engine import Engine, SamplingParams
from coder.model import Transformer
from tests.infer.engine_inputs import BATCH, LENS, MAX_LEN, tiny_cfg

PARAMS = SamplingParams(temperature=1.0, top_k=20, max_new_tokens=5)
PROMPTS = [[3, 17, 42, 5], [9, 8, 7, 6, 5, 4], [11, 12]]  # three agents
OBS = [[20, 21, 22], [30], [40, 41]]  # each turn's tool output


@pytest.fixture(scope="module")
def model_and_cfg():
    cfg = tiny_cfg()
    return cfg, Transformer(cfg, rngs=nnx.Rngs(0))


def engine_of(model, cfg, slots: int, **kw):
    return Engine(model, cfg, max_len=MAX_LEN, max_slots=slots, batch_buckets=BATCH, len_buckets=LENS,
                  decode_steps=4, **kw)


def agents(engine, turns: int = 3):
    """Three agents taking turns: each opens its group (a row), then per turn appends its tool
    output and decodes; the groups stay open throughout, as rollouts waiting on tools do."""
    groups, out = [], [[] for _ in PROMPTS]
    for a, prompt in enumerate(PROMPTS):
        groups.append(engine.start_group(prompt, 1))
        out[a].append(engine.generate(groups[a], PARAMS, jax.random.key(10 * a))[0])
    for t in range(1, turns):
        for a, g in enumerate(groups):
            engine.append(g, 0, OBS[a])
            out[a].append(engine.generate(g, PARAMS, jax.random.key(10 * a + t))[0])
    return groups, out


def test_more_agents_than_slots_decode_as_with_a_slot_each(model_and_cfg):
    cfg, model = model_and_cfg
    roomy, tight = engine_of(model, cfg, 4), engine_of(model, cfg, 2, offload_idle_rows=True)
    try:
        _, want = agents(roomy)
        groups, got = agents(tight)
        for a in range(len(PROMPTS)):
            for w, g in zip(want[a], got[a]):
                assert w.tokens == g.tokens and w.finish_reason == g.finish_reason
                np.testing.assert_array_equal(w.expert_ids, g.expert_ids)
                np.testing.assert_allclose(w.logprobs, g.logprobs, rtol=0, atol=2e-5)
        s = tight.stats()
        # the third agent's opening and each of the 6 later turns of an agent found both slots
        # held by idle agents: 7 moves out (the longest idle first), 6 back
        assert (s["offloads"], s["swap_ins"]) == (7, 6) and s["offloaded_bytes"] > 0
        assert s["rows_offloaded_now"] == 1  # three rows, two slots
        assert roomy.stats()["prefill_tokens"] == s["prefill_tokens"]  # nothing prefilled again
        offloaded = next(g for g in groups if g.rows[0].slot < 0)
        with pytest.raises(RuntimeError, match="offloaded"):
            offloaded.cache
        for g in groups:  # closing an offloaded row drops its host copy
            g.close()
        assert tight.stats()["rows_offloaded_now"] == 0
    finally:
        roomy.close()
        tight.close()


def test_without_offload_the_third_agent_waits_for_a_slot(model_and_cfg):
    cfg, model = model_and_cfg
    engine = engine_of(model, cfg, 2, admission_timeout_s=1.0)
    try:
        with pytest.raises(RuntimeError, match="waited 1 s for a slot"):
            agents(engine, turns=1)
    finally:
        engine.close()


def test_the_rl_config_turns_it_on(model_and_cfg):
    from coder.rl import actor as actor_lib
    from configs import base

    cfg, model = model_and_cfg
    config = base.get_config()
    config.model = cfg
    config.rl.update(dict(context_budget=MAX_LEN, engine_slots=2, offload_idle_rows=True))
    engine = actor_lib.make_engine(model, config)
    try:
        assert engine.offload_idle_rows and engine.sched.pool.max_slots == 2
    finally:
        engine.close()
