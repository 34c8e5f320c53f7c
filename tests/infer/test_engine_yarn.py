"""The engine past the model's training length, with YaRN (issue 56, "the engine above 32k", at toy
scale): chunked prefill and multi-step decode, plain and MTP-speculative, against the model's own
full forward (no cache) over the whole sequence.

The tiny model of test_engine.py, its FFNs dense (the programs compile in half the time; the
engine's MoE routing is test_engine.py's), "trained" at ORIG = 64 positions and extended by YaRN
factor 4 to MAX_LEN = 256 (what stage longctx's config does: coder/stages/lm.py longctx_config),
the engine's max_len 256. Its length buckets (64, 128) make the prefill chunk 128 tokens (the
largest bucket, Engine._prefill) and the cache capacity 128 or 256, so the file compiles few
programs. One two-turn conversation, all greedy:

    prompt      150 tokens, positions   0..149: two prefill chunks, 128 (0..127) + 22 (128..149)
    turn 1       40 tokens, positions 150..189: the first drawn from the prefill's held logits
    observation  26 tokens, positions 190..215: one prefill chunk
    turn 2       38 tokens, positions 216..253

The weights are engine_inputs.draftable's (trunk attention / FFN outputs x 0.03, MTP = the bigram
part), so MTP drafts are accepted often but not always (16 of 62 here); YaRN still moves the
logprob of a token at positions >= 128 by 0.11 nats on average (measured against the same weights
with rope_scaling.type="none"), 4 orders of magnitude above the tolerance. The test fails (checked
by hand) when the cached attention drops YaRN's softmax-scale correction, when a prefill chunk's
positions restart at 0, or when decode positions stop at 2 x ORIG - 1.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from coder.infer.engine import Engine, SamplingParams
from coder.model import Transformer
from coder.model.rope import rope_frequencies, softmax_scale
from tests.infer.engine_inputs import draftable, forward, tiny_cfg

ORIG, FACTOR = 64, 4
MAX_LEN = ORIG * FACTOR  # 256
LENS = (64, 128)  # prefill chunk: 128 tokens
PROMPT, TURN1, OBS, TURN2 = 150, 40, 26, 38
# f32 on CPU; measured max |engine - full forward| logprob in each phase (the token drawn from the
# prompt's prefill, turn-1 decode, the token drawn after the observation's chunk, turn-2 decode):
# plain 2.4e-7, 1.5e-6, 1.2e-7, 1.7e-6; speculative (k=1) 2.4e-7, 1.4e-6, 4.8e-7, 1.2e-6.
TOL = 1e-5


def yarn_cfg():
    cfg = tiny_cfg()
    cfg.first_k_dense_replace = 3  # the trunk's 2 layers and the MTP module's block: dense FFNs
    cfg.max_position_embeddings = MAX_LEN
    cfg.rope_scaling.update({"type": "yarn", "factor": float(FACTOR), "original_max_position_embeddings": ORIG})
    return cfg


def full_forward(model, seq):
    """The training forward over the whole sequence (padded to MAX_LEN, padding in segment 0):
    log_softmax of its logits `[len, V]`."""
    n = len(seq)
    tokens = np.zeros((1, MAX_LEN), np.int32)
    tokens[0, :n] = seq
    logits, _ = forward(model, jnp.asarray(tokens), jnp.asarray((np.arange(MAX_LEN) < n)[None], jnp.int32))
    return np.asarray(jax.nn.log_softmax(logits[0, :n], axis=-1))


def converse(engine, prompt, obs):
    """The two-turn greedy conversation of the module docstring -> (group, turn 1, turn 2)."""
    group = engine.start_group(prompt, 1)
    first = engine.generate(group, SamplingParams(temperature=0.0, max_new_tokens=TURN1), jax.random.key(0))[0]
    engine.append(group, 0, obs)
    second = engine.generate(group, SamplingParams(temperature=0.0, max_new_tokens=TURN2), jax.random.key(1))[0]
    assert [len(first.tokens), len(second.tokens)] == [TURN1, TURN2]
    assert group.tokens(0) == prompt + first.tokens + obs + second.tokens
    return group, first, second


def phase_diffs(logp, seq, first, second):
    """max |recorded - full forward| logprob per phase (module docstring: the token drawn from the
    prompt's prefill, turn 1's decode, the token after the observation's chunk, turn 2's decode),
    logp `[len(seq), V]`. Greedy tokens must be the full forward's argmax."""
    ref = logp[np.arange(len(seq) - 1), seq[1:]]  # [len-1]: logprob of token i+1 after tokens 0..i
    out = []
    for gen, start in [(first, PROMPT), (second, PROMPT + TURN1 + OBS)]:
        at = np.arange(start - 1, start - 1 + len(gen.tokens))  # the positions whose logits drew them
        np.testing.assert_array_equal(logp[at].argmax(-1), gen.tokens)
        diff = np.abs(np.asarray(gen.logprobs) - ref[at])
        out += [float(diff[0]), float(diff[1:].max())]
    return out


@pytest.fixture(scope="module")
def conversation():
    """The plain engine's conversation and the full forward over it: (cfg, model, prompt, obs,
    group, turn 1, turn 2, log_softmax `[254, V]`)."""
    cfg = yarn_cfg()
    model = draftable(Transformer(cfg, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(56)
    prompt = rng.integers(1, cfg.vocab_size, PROMPT).tolist()
    obs = rng.integers(1, cfg.vocab_size, OBS).tolist()
    engine = Engine(model, cfg, max_len=MAX_LEN, batch_buckets=(1,), len_buckets=LENS)
    group, first, second = converse(engine, prompt, obs)
    return cfg, model, prompt, obs, group, first, second, full_forward(model, group.tokens(0))


def test_chunked_prefill_and_decode_past_yarn_training_length_match_full_forward(conversation):
    cfg, _model, _prompt, _obs, group, first, second, logp = conversation
    # YaRN is on: some rotary frequencies interpolated, the softmax scale corrected
    plain = yarn_cfg()
    plain.rope_scaling.type = "none"
    (inv_yarn, _), (inv_plain, _) = rope_frequencies(cfg), rope_frequencies(plain)
    assert (inv_yarn < inv_plain * 0.99).any() and softmax_scale(cfg) > softmax_scale(plain) * 1.2
    # the prompt went in two chunks (each prefill call records one chunk of routing), the
    # observation in one, and the row reached position 2 x ORIG + 125
    chunks = [c.shape[0] for c in group.rows[0].expert_chunks]
    assert chunks[:2] == [128, PROMPT - 128] and OBS in chunks[2:]
    seq = group.tokens(0)
    assert len(seq) == PROMPT + TURN1 + OBS + TURN2 == 2 * ORIG + 126
    diffs = phase_diffs(logp, seq, first, second)
    assert max(diffs) < TOL, diffs


def test_speculative_greedy_past_yarn_training_length_equals_plain(conversation):
    """speculative_k=1 (the model's one MTP module drafts): the same greedy tokens as plain
    decoding, the same logprobs as the full forward, drafts both accepted and rejected."""
    cfg, model, prompt, obs, _group, plain_first, plain_second, logp = conversation
    spec = Engine(model, cfg, max_len=MAX_LEN, batch_buckets=(1,), len_buckets=LENS, speculative_k=1)
    group, first, second = converse(spec, prompt, obs)
    assert (first.tokens, second.tokens) == (plain_first.tokens, plain_second.tokens)
    diffs = phase_diffs(logp, group.tokens(0), first, second)
    assert max(diffs) < TOL, diffs
    assert 0 < spec.counters.accepted < spec.counters.drafted, (spec.counters.accepted, spec.counters.drafted)


def test_blockwise_cached_attention_in_the_engine_equals_the_full_forward(conversation, monkeypatch):
    """A cache longer than attention.CACHED_ATTENTION_BLOCK (here 32: the 256-slot cache in 8
    blocks) goes block by block with an online softmax (what a 256k cache does at 4096): the
    same greedy tokens, the same logprobs as the full forward."""
    from coder.model import attention

    cfg, model, prompt, obs, _group, plain_first, plain_second, logp = conversation
    monkeypatch.setattr(attention, "CACHED_ATTENTION_BLOCK", 32)
    engine = Engine(model, cfg, max_len=MAX_LEN, batch_buckets=(1,), len_buckets=LENS)
    group, first, second = converse(engine, prompt, obs)
    assert (first.tokens, second.tokens) == (plain_first.tokens, plain_second.tokens)
    diffs = phase_diffs(logp, group.tokens(0), first, second)
    assert max(diffs) < TOL, diffs
