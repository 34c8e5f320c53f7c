"""Engine: cache vs recomputation, logprobs vs the training forward, groups, multi-turn, buckets."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from coder.infer import sampling
from coder.infer.engine import Engine, SamplingParams
from coder.infer.reference import NoCacheDecoder
from coder.model import Transformer
from tests.infer.engine_inputs import BATCH, LENS, MAX_LEN, chi2_ok, draftable, forward, tiny_cfg

@pytest.fixture(scope="module")
def setup():
    cfg = tiny_cfg()
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    engine = Engine(model, cfg, max_len=MAX_LEN, batch_buckets=BATCH, len_buckets=LENS)
    return cfg, model, engine


def forward_logprobs(model, seq, temperature):
    """Training-style forward over the whole sequence (padded to MAX_LEN, padding in segment 0):
    log_softmax(logits / T) of each next token `[len-1]` and the routing `[len, moe_layers, top_k]`."""
    n = len(seq)
    tokens = np.zeros((1, MAX_LEN), np.int32)
    tokens[0, :n] = seq
    logits, experts = forward(model, jnp.asarray(tokens), jnp.asarray((np.arange(MAX_LEN) < n)[None], jnp.int32))
    logits = logits[0, :n]
    scaled = logits / temperature if temperature > 0 else logits
    logp = jax.nn.log_softmax(scaled, axis=-1)
    nxt = jnp.asarray(seq[1:])
    return (np.asarray(jnp.take_along_axis(logp[:-1], nxt[:, None], 1)[:, 0]),
            np.asarray(experts[:, 0, :n]).transpose(1, 0, 2))


def check_row_against_forward(model, group, row, gens_by_offset, temperature):
    """Every recorded logprob of `row` equals the training forward's, within 1e-4.

    gens_by_offset: (index of the generation's first token in the row, Generation[, its
    temperature if not `temperature`])."""
    seq = group.tokens(row)
    for start, gen, *temp in gens_by_offset:
        ref_logp, ref_experts = forward_logprobs(model, seq, temp[0] if temp else temperature)
        n = len(gen.tokens)
        assert seq[start:start + n] == gen.tokens
        np.testing.assert_allclose(gen.logprobs, ref_logp[start - 1:start - 1 + n], atol=1e-4, rtol=0)
    np.testing.assert_array_equal(group.expert_ids(row), ref_experts)


@pytest.mark.slow
def test_greedy_with_and_without_cache(setup):
    cfg, model, engine = setup
    prompt = [3, 17, 42, 5, 99, 7, 8, 120, 33]
    params = SamplingParams(temperature=0.0, max_new_tokens=20)
    group = engine.start_group(prompt, 2)
    gens = engine.generate(group, params, jax.random.key(0))
    ref = NoCacheDecoder(model, max_len=MAX_LEN, len_buckets=LENS).generate(
        prompt, params, jax.random.key(0))
    assert gens[0].tokens == ref.tokens == gens[1].tokens
    assert len(ref.tokens) == 20 and gens[0].finish_reason == "length"
    np.testing.assert_allclose(gens[0].logprobs, ref.logprobs, atol=1e-5)
    np.testing.assert_array_equal(gens[0].expert_ids, ref.expert_ids)
    assert gens[0].expert_ids.shape == (20, cfg.num_hidden_layers - cfg.first_k_dense_replace,
                                        cfg.num_experts_per_tok)


@pytest.mark.slow
def test_sampled_logprobs_match_training_forward_group_and_multiturn(setup):
    """Shared-prefix group, top-p, two turns with appended observations, rows decoded apart."""
    _, model, engine = setup
    t = 0.8
    params = SamplingParams(temperature=t, top_p=0.95, max_new_tokens=7)
    prompt = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
    group = engine.start_group(prompt, 3)
    gens1 = engine.generate(group, params, jax.random.key(1))
    # rows sample differently from one shared prefix
    assert len({tuple(g.tokens) for g in gens1}) == 3
    starts1 = [len(prompt)] * 3
    obs = {0: [200, 201, 202], 2: [210, 211, 212, 213, 214, 215, 216, 217, 218, 219, 220, 221, 222,
                                   223, 224, 225, 226, 227]}  # the second crosses a length bucket
    for r, ids in obs.items():
        engine.append(group, r, ids)
    before = engine.counters.prefill_tokens
    gens2 = engine.generate(group, params, jax.random.key(2))  # rows 0 and 2 are unfinished again
    assert engine.counters.prefill_tokens - before == 3 + 18  # only the observations were prefilled
    assert len(gens2) == 2
    gens3 = engine.generate(group, params, jax.random.key(3), rows=[1])  # row 1 continues alone
    for r, g2 in zip([0, 2], gens2):
        check_row_against_forward(model, group, r, [(starts1[r], gens1[r]),
                                                    (starts1[r] + 7 + len(obs[r]), g2)], t)
    check_row_against_forward(model, group, 1, [(starts1[1], gens1[1]), (starts1[1] + 7, gens3[0])], t)


def test_prompt_prefilled_once_for_group(setup):
    _, _, engine = setup
    before = engine.counters.prefill_tokens
    prompt = list(range(30, 50))
    group = engine.start_group(prompt, 4)
    assert engine.counters.prefill_tokens - before == len(prompt)
    leaves = jax.tree.leaves(group.cache)
    for leaf in leaves:
        leaf = np.asarray(leaf)
        assert leaf.shape[0] == 4
        np.testing.assert_array_equal(leaf[1:], np.broadcast_to(leaf[:1], leaf[1:].shape))
    assert all(group.length(r) == len(prompt) for r in range(4))


def test_rows_do_not_depend_on_batch_companions(setup):
    _, _, engine = setup
    params = SamplingParams(temperature=1.0, top_k=20, max_new_tokens=6)
    prompt = [5, 6, 7, 8, 9]
    together = engine.generate(engine.start_group(prompt, 3), params, jax.random.key(4))
    alone = engine.generate(engine.start_group(prompt, 3), params, jax.random.key(4), rows=[2])
    assert alone[0].tokens == together[2].tokens
    np.testing.assert_allclose(alone[0].logprobs, together[2].logprobs, atol=1e-5)


def test_stop_length_and_max_len(setup):
    _, _, engine = setup
    prompt = [3, 17, 42, 5, 99, 7, 8, 120, 33]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=10)
    tokens = engine.generate(engine.start_group(prompt, 1), greedy, jax.random.key(0))[0].tokens
    stop = tokens[3]
    first = tokens.index(stop)
    gen = engine.generate(engine.start_group(prompt, 1),
                          SamplingParams(temperature=0.0, max_new_tokens=10, stop_token_ids=(stop,)),
                          jax.random.key(0))[0]
    assert gen.finish_reason == "stop" and gen.tokens == tokens[:first + 1]
    # the stop token stays in the cache: continuing gives the rest of the greedy sequence
    group = engine.start_group(prompt, 1)
    engine.generate(group, SamplingParams(temperature=0.0, max_new_tokens=10, stop_token_ids=(stop,)),
                    jax.random.key(0))
    rest = engine.generate(group, SamplingParams(temperature=0.0, max_new_tokens=10 - first - 1),
                           jax.random.key(0), rows=[0])[0]
    assert rest.tokens == tokens[first + 1:] and rest.finish_reason == "length"
    # max_len: a long prompt leaves room for MAX_LEN - len(prompt) tokens
    long_prompt = list(range(1, 60))
    group = engine.start_group(long_prompt, 2)
    gens = engine.generate(group, SamplingParams(temperature=1.0, max_new_tokens=50), jax.random.key(5))
    assert [g.finish_reason for g in gens] == ["max_len", "max_len"]
    assert [len(g.tokens) for g in gens] == [MAX_LEN - 59] * 2
    assert engine.generate(group, SamplingParams(), jax.random.key(6), rows=[0])[0].tokens == []
    with pytest.raises(ValueError, match="max_len"):
        engine.append(group, 0, [1])


def test_no_recompilation_per_request(setup):
    _, _, engine = setup
    params = SamplingParams(temperature=1.0, max_new_tokens=4)

    def request(plen, n, seed):
        group = engine.start_group(list(range(1, plen + 1)), n)
        engine.generate(group, params, jax.random.key(seed))
        engine.append(group, 0, [7, 8, 9])
        engine.generate(group, params, jax.random.key(seed + 1), rows=[0])

    request(20, 3, 0)  # warm up: the longest request, 2-4 rows, crosses from 32 to 64 slots
    request(5, 3, 1)  # and the shortest, which stays within 32 slots
    before = engine.num_compilations
    for plen, n, seed in [(6, 4, 10), (19, 3, 20), (12, 4, 30), (20, 2, 40)]:
        request(plen, n, seed)
    assert engine.num_compilations == before, engine.compilations


def test_set_weights_between_decode_steps(setup):
    cfg, model, _engine0 = setup
    other = Transformer(cfg, rngs=nnx.Rngs(1))
    engine = Engine(model, cfg, max_len=MAX_LEN, batch_buckets=BATCH, len_buckets=LENS)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=3)
    prompt = [3, 17, 42, 5, 99, 7, 8, 120, 33]
    # the new weights are used from the next step; no recompilation for a same-shaped state
    engine.set_weights(nnx.state(other))
    group = engine.start_group(prompt, 1)
    swapped = engine.generate(group, greedy, jax.random.key(0))[0]
    compiled = engine.num_compilations
    ref = NoCacheDecoder(other, max_len=MAX_LEN, len_buckets=LENS).generate(prompt, greedy, jax.random.key(0))
    assert swapped.tokens == ref.tokens and swapped.policy_version == [1, 1, 1]
    # in flight: tokens sampled from logits computed before the swap keep the old version
    group.close()  # its slot returns to the pool: the next group decodes at the same pool size
    group = engine.start_group(prompt, 1)
    first = engine.generate(group, greedy, jax.random.key(0))[0]
    engine.set_weights(nnx.state(model), version=7)
    second = engine.generate(group, greedy, jax.random.key(0), rows=[0])[0]
    assert first.policy_version == [1, 1, 1] and second.policy_version == [1, 7, 7]
    assert engine.num_compilations == compiled
    with pytest.raises(ValueError, match="structure"):
        engine.set_weights(nnx.State({"embed": nnx.Param(jnp.zeros((3, 3)))}))


# ---------------------------------------------------------------------- speculative decoding
SPEC_LENS = (16, 32)


@pytest.fixture(scope="module")
def spec_setup():
    cfg = tiny_cfg()
    cfg.vocab_size, cfg.num_mtp_layers = 32, 2  # a small vocabulary: exact marginals are cheap
    model = draftable(Transformer(cfg, rngs=nnx.Rngs(2)))
    kw = {"max_len": 32, "batch_buckets": (4, 64), "len_buckets": SPEC_LENS}
    return cfg, model, Engine(model, cfg, **kw), Engine(model, cfg, speculative_k=2, **kw)


@pytest.mark.slow
def test_speculative_greedy_identical_and_same_logprobs(spec_setup):
    """Two drafts per step (depths 1 and 2; k = 1 runs the same code with one depth)."""
    _cfg, model, plain, spec = spec_setup
    prompt = [3, 17, 22, 5, 9, 7, 8]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=20)
    ref = plain.generate(plain.start_group(prompt, 1), greedy, jax.random.key(0))[0]
    spec.counters.accepted = spec.counters.drafted = 0
    group = spec.start_group(prompt, 2)
    gens = spec.generate(group, greedy, jax.random.key(0))
    assert gens[0].tokens == gens[1].tokens == ref.tokens
    np.testing.assert_allclose(gens[0].logprobs, ref.logprobs, atol=1e-5)
    np.testing.assert_array_equal(gens[0].expert_ids, ref.expert_ids)
    assert 0 < spec.counters.accepted < spec.counters.drafted  # both acceptance branches ran
    # multi-turn, sampled: recorded logprobs and routing match the training forward
    spec.append(group, 1, [1, 2, 3])
    params = SamplingParams(temperature=0.9, max_new_tokens=6)
    more = spec.generate(group, params, jax.random.key(1), rows=[1])[0]
    check_row_against_forward(model, group, 1, [(len(prompt), gens[1], 0.0), (len(prompt) + 23, more)], 0.9)


@pytest.mark.slow
def test_speculative_sampling_distribution_is_exact(spec_setup):
    """Tokens 1-3 after a prompt, drawn 2048 times with and without 2-token drafting, against the
    exact marginals sum_{a,b} p(a) p(b|a) p(c|a,b) of the main model (top-k filtered)."""
    cfg, model, plain, spec = spec_setup
    t, top_k = 0.9, 12
    prompt = [4, 9, 1, 30, 12]
    n_p = len(prompt)
    v = cfg.vocab_size
    # exact marginals from one batched forward over every continuation (a, b)
    ab = np.array([[a, b] for a in range(v) for b in range(v)], np.int32)
    seqs = np.concatenate([np.tile(prompt, (v * v, 1)), ab], axis=1)
    tokens = np.zeros((v * v, MAX_LEN), np.int32)
    tokens[:, :n_p + 2] = seqs
    seg = jnp.asarray(np.broadcast_to(np.arange(MAX_LEN) < n_p + 2, tokens.shape), jnp.int32)
    logits, _ = forward(model, jnp.asarray(tokens), seg)
    probs = lambda x: np.asarray(sampling.sampling_probs(x, t, top_k, 1.0), np.float64)
    p1 = probs(logits[:1, n_p - 1])[0]
    p2 = probs(logits[::v, n_p])  # [a, b]
    p3 = probs(logits[:, n_p + 1]).reshape(v, v, v)  # [a, b, c]
    exact = [p1, p1 @ p2, np.einsum("a,ab,abc->c", p1, p2, p3)]

    params = SamplingParams(temperature=t, top_k=top_k, max_new_tokens=3)
    for engine in (spec, plain):
        engine.counters.accepted = engine.counters.drafted = 0
        samples = []
        for g in range(32):
            gens = engine.generate(engine.start_group(prompt, 64), params, jax.random.fold_in(jax.random.key(9), g))
            samples += [gen.tokens for gen in gens]
        samples = np.array(samples)
        assert samples.shape == (2048, 3)
        for pos in range(3):
            stat, bound = chi2_ok(np.bincount(samples[:, pos], minlength=v), exact[pos])
            assert stat < bound, (engine.spec_k, pos, stat, bound)
    assert 0.3 < spec.counters.accepted / spec.counters.drafted < 0.99


@pytest.mark.parametrize("make_key", [lambda: jax.random.key(3), lambda: jax.random.PRNGKey(5)],
                         ids=["typed", "raw"])
def test_row_keys_are_fold_in_of_each_row(make_key):
    """A generate call's per-row sampling keys are fold_in(rng, row), whatever the row count
    (the rows are padded to a power of two for the jitted program, the padding's keys dropped)."""
    from coder.infer.engine import _row_key_data

    rng = make_key()
    for n in (1, 3, 8, 13):
        rows = (np.arange(n, dtype=np.uint32) * 5 + 2)[::-1].copy()
        want = np.stack([np.asarray(jax.random.key_data(jax.random.fold_in(rng, int(r))))
                         if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key)
                         else np.asarray(jax.random.fold_in(rng, int(r))) for r in rows])
        got = _row_key_data(rng, rows)
        assert got.dtype == np.uint32 and got.shape == want.shape, (n, got.shape)
        np.testing.assert_array_equal(got, want, err_msg=f"{n} rows")
