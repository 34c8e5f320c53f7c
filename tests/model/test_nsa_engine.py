"""The nsa attention backend in cached calls: decode, chunked prefill, rewrites, engine, speculative.

Every cached result is compared with the full forward (MLA._nsa, impl "xla") of the same model.
Sizes: T = 150 tokens, not a multiple of d = 4, l = 8 or l' = 16; top-n selection covers
n * l' = 64 < T tokens and the window w = 24 < T, so selection excludes blocks and the window
slides. Cached calls come in two shapes, CHUNK tokens (chunks of any length up to it, the rest
padding) and 1 token, so the whole file compiles few programs."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tests.nsa_inputs import fast_compiles  # noqa: F401

from coder.infer.engine import Engine, SamplingParams
from coder.model import Transformer, init_cache
from configs.base import model_config

T, S = 150, 160  # sequence length, cache slots
V = 64
CHUNK = 37  # tokens per chunked cached call (rows write up to CHUNK, the rest is padding)


def nsa_cfg():
    """Dense FFNs (trunk and MTP block; MoE is not what these tests are about, and without it every
    compiled program is smaller), MLA with the nsa backend."""
    cfg = model_config()
    cfg.update({"vocab_size": V, "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16,
                "num_hidden_layers": 2, "num_attention_heads": 4, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
                "qk_rope_head_dim": 4, "v_head_dim": 8, "n_routed_experts": 4, "n_group": 1, "topk_group": 1,
                "num_experts_per_tok": 2, "first_k_dense_replace": 3, "num_mtp_layers": 1,
                "max_position_embeddings": S, "dtype": "float32", "attention_backend": "nsa",
                "initializer_range": 0.2})
    cfg.nsa.update({"compress_block": 8, "compress_stride": 4, "select_block": 16, "select_topk": 4, "window": 24})
    return cfg


@nnx.jit
def cached(model, tokens, positions, segment_ids, cache):
    logits, aux = model(tokens, positions, segment_ids, cache=cache)
    return logits, aux["cache"]


_fwd = nnx.jit(lambda m, t, s: m(t, jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), t.shape), s, mtp=False)[0])


def forward(model, rows):
    """Full forward (no cache) of 2 token rows (lists, up to S tokens) -> logits per row `[len, V]`.
    Always one shape, [2, S] with padding in segment 0, so it compiles once."""
    tokens, seg = np.zeros((2, S), np.int32), np.zeros((2, S), np.int32)
    for b, r in enumerate(rows):
        tokens[b, :len(r)], seg[b, :len(r)] = r, 1
    logits = np.asarray(_fwd(model, jnp.asarray(tokens), jnp.asarray(seg)))
    return [logits[b, :len(r)] for b, r in enumerate(rows)]


@pytest.fixture(scope="module")
def setup():
    cfg = nsa_cfg()
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    tok = np.random.default_rng(1).integers(1, V, (2, T)).astype(np.int32)
    return cfg, model, tok, np.stack(forward(model, list(tok)))


def run_chunks(model, cache, tok, spans, junk=None):
    """Cached calls over per-row spans: `spans` is a list of calls, each (T, [(start, n) per row]);
    row b writes tok[b, start:start+n] at those positions, the rest of the call is padding (segment
    0, at position 3 holding another token: it must write nothing). junk: tokens to write instead.
    Returns the cache and {(row, position): logits}."""
    src = tok if junk is None else junk
    out = {}
    for t, rows in spans:
        toks = np.full((2, t), 7, np.int32)
        pos = np.full((2, t), 3, np.int32)
        seg = np.zeros((2, t), np.int32)
        for b, (start, n) in enumerate(rows):
            toks[b, :n] = src[b, start:start + n]
            pos[b, :n] = np.arange(start, start + n)
            seg[b, :n] = 1
        logits, cache = cached(model, jnp.asarray(toks), jnp.asarray(pos), jnp.asarray(seg), cache)
        logits = np.asarray(logits)
        for b, (start, n) in enumerate(rows):
            for j in range(n):
                out[b, start + j] = logits[b, j]
    return cache, out


def check(out, full, atol=1e-4):
    keys = sorted(out)
    got = np.stack([out[k] for k in keys])
    want = np.stack([full[b, p] for b, p in keys])
    np.testing.assert_allclose(got, want, atol=atol, rtol=0)


_compress = nnx.jit(lambda nsa, c: nsa.compress(jnp.concatenate([c["latent"], c["rope"]], -1)[:, :, None],
                                                 c["latent"][:, :, None]))


def check_compressed(model, cache, upto):
    """Every compressed entry of a block ending before `upto` equals NSA.compress of the cache."""
    for layer, c in zip(model.layers, cache["layers"]):
        nsa = layer.self_attn.nsa
        k_cmp, v_cmp = _compress(nsa, {k: c[k] for k in ("latent", "rope")})
        n_done = (upto - nsa.cfg.compress_block) // nsa.cfg.compress_stride + 1
        np.testing.assert_allclose(c["k_cmp"][:, :n_done], k_cmp[:, :n_done], atol=1e-5)
        np.testing.assert_allclose(c["v_cmp"][:, :n_done], v_cmp[:, :n_done], atol=1e-5)


@pytest.mark.slow
def test_token_by_token_decode_matches_full_forward(setup):
    cfg, model, tok, full = setup
    spans = [(CHUNK, [(0, 16), (0, 11)])] + [(1, [(p, 1), (p - 5, 1)]) for p in range(16, T)]
    spans += [(1, [(T - 1, 0), (p, 1)]) for p in range(T - 5, T)]  # row 0 idles (padding) meanwhile
    cache, out = run_chunks(model, init_cache(cfg, 2, S, jnp.float32), tok, spans)
    assert len(out) == 2 * T
    check(out, full)
    check_compressed(model, cache, T)


def test_chunked_prefill_and_rewritten_tail_match_full_forward(setup):
    """Chunks of different sizes, each completing several compression blocks, rows at different
    offsets; then a tail of other tokens (its compressed blocks computed from them), rolled back
    and rewritten with the true tokens: the rewritten blocks are recomputed, never kept stale."""
    cfg, model, tok, full = setup
    a = CHUNK
    cache, out = run_chunks(model, init_cache(cfg, 2, S, jnp.float32), tok,
                            [(a, [(0, 37), (0, 30)]), (a, [(37, 26), (30, 26)]), (a, [(63, 37), (56, 37)])])
    check(out, full)
    check_compressed(model, cache, 93)
    junk = (tok * 5 + 3) % (V - 1) + 1
    cache, bad = run_chunks(model, cache, tok, [(a, [(100, 37), (93, 37)])], junk=junk)
    assert np.abs(bad[0, 120] - full[0, 120]).max() > 1e-2
    # roll back to 96 / 93 (at or before the junk's start) and write the true tokens to the end
    cache, out = run_chunks(model, cache, tok, [(a, [(96, 37), (93, 37)]), (a, [(133, 17), (130, 20)])])
    assert len(out) == 2 * (T - 93) - 3
    check(out, full)
    check_compressed(model, cache, T)


def test_decode_reads_only_compressed_selected_and_window(setup):
    """Query at position 149: l' = 16 blocks 8 and 9 are local (selected) and slots 126..149 the
    window; of blocks 0..7, restricted to slots < 126, exactly two are selected (the first block,
    forced, and the top-scored one). Perturbing the raw cache of one layer at a block's slots
    changes the output iff the block is selected; the compressed caches are read too."""
    cfg, model, tok, full = setup
    q = T - 1
    spans = [(CHUNK, [(0, 37)] * 2), (CHUNK, [(37, 37)] * 2), (CHUNK, [(74, 37)] * 2), (CHUNK, [(111, 26)] * 2),
             (CHUNK, [(137, 12)] * 2)]
    cache, _ = run_chunks(model, init_cache(cfg, 2, S, jnp.float32), tok, spans)
    step = lambda c: np.asarray(cached(model, jnp.asarray(tok[:, q:q + 1]), jnp.full((2, 1), q, jnp.int32),
                                       jnp.ones((2, 1), jnp.int32), c)[0])[:, 0]
    base = step(cache)
    np.testing.assert_allclose(base, full[:, q], atol=1e-4)
    lsel, win_lo = cfg.nsa.select_block, q - cfg.nsa.window + 1

    def perturbed(layer, lo, hi, keys=("latent", "rope")):
        layers = list(cache["layers"])
        layers[layer] = dict(layers[layer], **{k: layers[layer][k].at[:, lo:hi].add(1.0) for k in keys})
        return dict(cache, layers=layers)

    for layer in range(cfg.num_hidden_layers):
        changed = np.array([[not np.array_equal(out_b, base_b) for out_b, base_b in
                             zip(step(perturbed(layer, j * lsel, min((j + 1) * lsel, win_lo))), base)]
                            for j in range(8)])  # [block, row]
        assert changed[0].all(), (layer, changed)
        np.testing.assert_array_equal(changed[1:].sum(0), [1, 1])
        # the window and the compressed entries are read
        assert not np.array_equal(step(perturbed(layer, win_lo, q)), base)
        assert not np.array_equal(step(perturbed(layer, 0, 4, keys=("k_cmp", "v_cmp"))), base)


# ---------------------------------------------------------------------- engine
LENS = (32, S)  # capacity buckets: the caches (compressed ones too) grow from 32 to S slots


def draftable(model, scale):
    """MTP module 0 predicts with the trunk's embedding-to-head path (its block's outputs zeroed,
    eh_proj = [I; 0]) and the trunk's attention / FFN outputs are scaled by `scale`: a draft that
    is often but not always right (as tests/infer/test_engine.py's `draftable`)."""
    def mul(var, f):
        var.set_value(var.get_value() * f)

    def ffn_out(mlp):
        return [mlp.wd, mlp.shared.down_proj] if hasattr(mlp, "wd") else [mlp.down_proj]

    for layer in model.layers:
        for var in [layer.self_attn.o_proj] + ffn_out(layer.mlp):
            mul(var, scale)
    for mod in model.mtp:
        for var in [mod.block.self_attn.o_proj] + ffn_out(mod.block.mlp):
            mul(var, 0.0)
        d = mod.eh_proj.get_value().shape[1]
        mod.eh_proj.set_value(jnp.concatenate([jnp.eye(d), jnp.zeros((d, d))]).astype(mod.eh_proj.get_value().dtype))
    return model


@pytest.fixture(scope="module")
def engines():
    cfg = nsa_cfg()
    model = draftable(Transformer(cfg, rngs=nnx.Rngs(3)), 0.3)
    kw = {"max_len": S, "batch_buckets": (2,), "len_buckets": LENS}
    return model, Engine(model, cfg, **kw), Engine(model, cfg, speculative_k=1, **kw)


def logprobs(logits, seq, temperature):
    """log_softmax(logits / T)[next token] `[len-1]` from a full forward's logits `[len, V]`."""
    scaled = logits / temperature if temperature > 0 else logits
    logp = np.asarray(jax.nn.log_softmax(jnp.asarray(scaled[:-1]), -1))
    return logp[np.arange(len(seq) - 1), seq[1:]]


@pytest.mark.slow
def test_engine_greedy_and_sampled_logprobs_match_full_forward(engines):
    """Greedy tokens are the argmax of the full forward over the growing sequence (one forward
    of the final sequence: it is causal), recorded logprobs are the training forward's."""
    model, engine, _ = engines
    prompt = [3, 17, 42, 5, 9, 7, 8, 60, 33, 21, 2, 11]
    n_new = 110
    group = engine.start_group(prompt, 2)
    gens = engine.generate(group, SamplingParams(temperature=0.0, max_new_tokens=n_new), jax.random.key(0))
    assert gens[0].tokens == gens[1].tokens and len(gens[0].tokens) == n_new
    # multi-turn, sampled: an observation appended to row 1 (prefilled as a chunk), row 1 alone
    engine.append(group, 1, [1, 2, 3, 4, 5])
    t = 0.8
    more = engine.generate(group, SamplingParams(temperature=t, max_new_tokens=20), jax.random.key(1), rows=[1])[0]
    seqs = [group.tokens(0), group.tokens(1)]
    assert len(seqs[1]) == len(prompt) + n_new + 5 + 20 and seqs[1][-20:] == more.tokens
    logits = forward(model, seqs)
    p = len(prompt)
    for b in range(2):
        np.testing.assert_array_equal(logits[b][p - 1:p - 1 + n_new].argmax(-1), gens[b].tokens)
        np.testing.assert_allclose(gens[b].logprobs, logprobs(logits[b], seqs[b], 0.0)[p - 1:p - 1 + n_new],
                                   atol=1e-4, rtol=0)
    np.testing.assert_allclose(more.logprobs, logprobs(logits[1], seqs[1], t)[-20:], atol=1e-4, rtol=0)


@pytest.mark.slow
def test_speculative_greedy_identical_to_plain(engines):
    """One MTP draft per step; rejected drafts leave their slots (and the compressed blocks ending
    there) stale until rewritten: greedy output and logprobs stay those of plain decoding."""
    _, plain, spec = engines
    prompt = [3, 17, 22, 5, 9, 7, 8]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=130)
    ref = plain.generate(plain.start_group(prompt, 2), greedy, jax.random.key(0))[0]
    gens = spec.generate(spec.start_group(prompt, 2), greedy, jax.random.key(0))
    assert gens[0].tokens == gens[1].tokens == ref.tokens
    np.testing.assert_allclose(gens[0].logprobs, ref.logprobs, atol=1e-4)
    assert 0 < spec.counters.accepted < spec.counters.drafted  # both acceptance branches ran
