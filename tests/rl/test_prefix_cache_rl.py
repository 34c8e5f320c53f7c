"""The RL engine's prefix cache (coder.rl.actor.prefix_cache_slots, make_engine): a self-summary
chain's next window starts with the system prompt and task its previous window's row holds, and
a new task group with the system prompt the rows before it held. With the cache those tokens are
not prefilled again; nothing else may change: a tiny random model at temperature 0 samples the
same tokens, and each rollout counts the prefill it computed and the tokens the cache saved
(`Rollout.prefill_tokens`, `prefix_tokens_saved`; the means in `rollout_metrics`). New weights
invalidate every cached prefix: the next step's first group prefills its prompt in full.

A random model writes no tool call, so a window ends when its context is full: the large
summary reserve leaves a window a few dozen tokens of a turn and room for the summary, and the
greedy summary ends on `<|end|>` within it. The chains here have 1 to 3 summaries.
"""
import jax
import pytest
from flax import nnx

from coder.data import tokenizer as tokenizer_lib
from coder.env import protocol
from coder.env.tools import registry as env_tools
from coder.env.tasks import Task
from coder.model import Transformer
from coder.rl import actor as actor_lib
from coder.rl import agent as agent_lib
from configs import quickstart
from tests.infer.engine_inputs import tiny_cfg

# three engines roll out chains of a random model (the module fixtures: ~100 s on the slower 2-core machines)
pytestmark = pytest.mark.slow

TOOLS = [t for t in env_tools.SPECS if t.name in ("read_file", "submit")]
TASKS = [Task(id=f"t{i}", prompt=f"Make f() return {i}.", files={}, tests={}) for i in range(2)]


class Episode:
    tools, done = TOOLS, False

    def call(self, call):
        return "ok"

    def score(self):
        return 0.0, {}

    def close(self):
        pass


@pytest.fixture(scope="module")
def setup():
    texts = [protocol.render_system_prompt(env_tools.SPECS), agent_lib.SUMMARY_REQUEST,
             "def f():\n    return 0\n" * 10, "Make f() return 3. I will read the file first."]
    tok = tokenizer_lib.train_tokenizer(texts, 400)
    c = quickstart.get_config()
    m = tiny_cfg()
    m.vocab_size, m.max_position_embeddings = tok.padded_vocab_size, 1024
    c.model = m
    c.rl.update(dict(group_size=2, tasks_per_step=2, concurrent=False, temperature=0.0, context_budget=1024,
                     summary_reserve=360, max_turn_tokens=400, max_turns=16, max_rollout_tokens=4000,
                     max_summaries=4, engine_slots=4, decode_steps=8))
    models = [Transformer(c.model, rngs=nnx.Rngs(s)) for s in (0, 1)]
    return c, tok, models


def steps(setup, prefix_cache, concurrent=False):
    """Two steps of rollouts, new weights between them: ([B][G] rollouts, engine stats) per step."""
    c, tok, models = setup
    c = c.copy_and_resolve_references()
    c.rl.concurrent = concurrent
    engine = actor_lib.make_engine(models[0], c, prefix_cache=prefix_cache)
    actor = actor_lib.Actor(engine, tok, c, lambda task: Episode())
    out = []
    for i, model in enumerate(models):
        if i:
            engine.set_weights(model)
        before = engine.stats()
        groups = actor.collect(TASKS, jax.random.key(i))
        engine.settle()
        after = engine.stats()
        out.append((groups, {k: after[k] - before[k] for k in ("prefill_tokens", "prefix_tokens")},
                    len(engine.sched.prefixes)))
    engine.close()
    return out


@pytest.fixture(scope="module")
def plain(setup):
    return steps(setup, 0)


def tokens(groups):
    return [[[g.tokens for g in r.generations] for r in group] for group in groups]


def flat(groups):
    return [r for g in groups for r in g]


@pytest.fixture(scope="module")
def cached(setup):
    return steps(setup, None)


def head_len(setup):
    return len(agent_lib.Agent(None, setup[1], setup[0].rl).head_ids(TOOLS, TASKS[0].prompt))


@pytest.mark.parametrize("concurrent", [False, True])
def test_the_prefix_cache_saves_prefill_and_changes_no_token(setup, plain, cached, concurrent):
    cached = steps(setup, None, True) if concurrent else cached
    assert actor_lib.prefix_cache_slots(setup[0]) == 3  # -1: every engine slot but one
    for step, ((want, want_stats, _), (got, got_stats, _)) in enumerate(zip(plain, cached)):
        assert tokens(got) == tokens(want)
        if step == 0:  # chains of the first weights (the second's rollouts mostly end at once)
            assert [[r.summaries for r in g] for g in got] == [[1, 1], [3, 3]]
        # every prompt token is prefilled or taken from the cache: the same total as without it
        assert got_stats["prefill_tokens"] + got_stats["prefix_tokens"] == want_stats["prefill_tokens"]
        assert want_stats["prefix_tokens"] == 0
        # step 0's chains reuse their windows' heads; group by group, t1's group reuses the system
        # prompt t0's rows left (concurrent: both groups start at once, before any row is left)
        assert got_stats["prefix_tokens"] > 0 or (step == 1 and concurrent)
        # the rollouts' counts add up to the engine's
        assert sum(r.prefill_tokens for r in flat(got)) == got_stats["prefill_tokens"]
        assert sum(r.prefix_tokens_saved for r in flat(got)) == got_stats["prefix_tokens"]
        assert sum(r.prefill_tokens for r in flat(want)) == want_stats["prefill_tokens"]
        m = actor_lib.rollout_metrics(got)
        assert m["prefix_tokens_saved"] == got_stats["prefix_tokens"] / 4 and 0 <= m["prefix_saved_frac"] < 1
        # a chained window reuses at least the system prompt and task of its previous one
        head = head_len(setup)
        chained = [r for r in flat(got) if r.summaries]
        assert all(r.prefix_tokens_saved >= head - 8 for r in chained)


def test_new_weights_invalidate_every_cached_prefix(setup, plain, cached):
    """Step 1 ends with cached prefixes of the first weights (the same system prompt the next
    step's first group starts with); after set_weights none is reused: that group prefills its
    prompt in full, and every token is the one an engine without the cache samples."""
    (_, _, left), (groups, _, _) = cached
    assert left > 0
    first = groups[0][0]
    assert first.prefix_tokens_saved == 0 and first.prefill_tokens >= head_len(setup)
    assert tokens(groups) == tokens(plain[1][0])
