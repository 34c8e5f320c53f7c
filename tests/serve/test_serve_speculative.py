"""Stage serve with speculative decoding (`serve.speculative_k`): the OpenAI-compatible server over
an engine that drafts with the MTP modules serves exactly what plain decoding serves.

The engine's own tests of its speculative path (tests/infer/test_engine.py:
test_speculative_greedy_identical_and_same_logprobs, test_speculative_sampling_distribution_is_exact)
are repeated here through HTTP and the `openai` client: two servers over one tiny model with 2 MTP
modules, one plain (k = 0), one drafting k = 2 tokens per step. The model is test_engine's
`draftable` one (a near-bigram trunk whose MTP modules predict with its bigram part), so drafts
are accepted often but not always and both branches of the acceptance rule run:
- greedy: the same replies, finish reasons, usage and logprobs as the plain server (n = 1 and 2,
  and a stop token mid-reply);
- streaming: the chunks concatenate to the non-streamed text (greedy, seeded sampling, a stop
  string), with the same finish reason and usage;
- sampled: tokens 1-3 of 2048 served choices at T = 0.9, top_k 12, against the main model's exact
  marginals (chi-squared at 0.999), for both servers;
- start-up: `serve.speculative_k` beyond model.num_mtp_layers (0 included) or beyond the MTP
  modules the checkpoint holds stops the stage, naming the key.
"""
import inspect
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from coder.data import tokenizer as tokenizer_lib
from coder.infer import sampling
from coder.infer.engine import Engine
from coder.model import Transformer
from coder.serve import trajectory_log
from coder.serve.server import Server
from tests.infer.engine_inputs import chi2_ok, draftable
from tests.infer.engine_inputs import tiny_cfg as engine_cfg
from tests.serve.greeter import start_uvicorn

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

# the served tests share two engines whose programs compile once per module (~20 s, the first
# test pays): the full suite only, as tests/serve/test_serve.py
slow = pytest.mark.slow

K = 2
MAX_LEN = 64
SLOTS = 64  # the distribution test's n = 64 choices fill the pool
USERS = ["Hello there, how are you?", "Wrap this text for me.", "What is the width?"]


def make_tokenizer():
    """The smallest tokenizer coder trains (384 pieces: byte fallback + the chat tokens)."""
    return tokenizer_lib.train_tokenizer([inspect.getsource(textwrap)], 384)


def tiny_cfg(tok):
    cfg = engine_cfg()
    cfg.update(dict(vocab_size=tok.padded_vocab_size, num_mtp_layers=K, max_position_embeddings=MAX_LEN))
    return cfg


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """{"plain": ..., "spec": ...}: each a dict of engine, server, log dir and openai client."""
    tok = make_tokenizer()
    cfg = tiny_cfg(tok)
    model = draftable(Transformer(cfg, rngs=nnx.Rngs(2)))
    out = {}
    for name, k in (("plain", 0), ("spec", K)):
        # few compiled shapes: prefill one prompt at a time (batch bucket 1); the pool takes its
        # 64 slots at once (a first group of 64 rows), so every decode call has one shape
        engine = Engine(model, cfg, max_len=MAX_LEN, max_slots=SLOTS, decode_steps=4, speculative_k=k,
                        batch_buckets=(1, SLOTS), len_buckets=(MAX_LEN,))
        engine.start_group([tok.bos_id], SLOTS).close()
        log_dir = str(tmp_path_factory.mktemp(f"log_{name}"))
        server = Server(engine, tok, model_name="tiny", log=trajectory_log.TrajectoryLog(log_dir, flush_seconds=3600),
                        max_tokens=16)
        uv, url = start_uvicorn(server.app)
        client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=120)
        out[name] = dict(engine=engine, server=server, uv=uv, client=client, log=log_dir)
    out["tok"], out["model"], out["cfg"] = tok, model, cfg
    yield out
    for name in ("plain", "spec"):
        s = out[name]
        s["uv"].should_exit = True
        s["server"].close()
        s["engine"].close()


def _ask(s, user, **kw):
    return s["client"].chat.completions.create(model="tiny", messages=[{"role": "user", "content": user}], **kw)


def _same_reply(a, b, logprobs=True):
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert [c.finish_reason for c in a.choices] == [c.finish_reason for c in b.choices]
    assert a.usage.completion_tokens == b.usage.completion_tokens
    assert a.usage.prompt_tokens == b.usage.prompt_tokens
    if logprobs:
        for ca, cb in zip(a.choices, b.choices):
            np.testing.assert_allclose([t.logprob for t in ca.logprobs.content],
                                       [t.logprob for t in cb.logprobs.content], atol=1e-5)


@slow
def test_greedy_replies_identical_to_plain_decoding(servers, monkeypatch):
    """temperature 0: the speculative server's replies, finish reasons, usage and logprobs are the
    plain server's, for n = 1 and 2 and with a stop token mid-reply."""
    plain, spec = servers["plain"], servers["spec"]
    engine = spec["engine"]
    drafted, accepted = engine.counters.drafted, engine.counters.accepted
    for i, user in enumerate(USERS):
        kw = dict(temperature=0, max_tokens=24, logprobs=True, n=1 + i % 2)
        a, b = _ask(plain, user, **kw), _ask(spec, user, **kw)
        _same_reply(a, b)
        for c in b.choices:
            assert c.finish_reason in ("stop", "length")
            if c.finish_reason == "length":
                assert len(c.logprobs.content) == 24
        assert b.usage.completion_tokens == sum(len(c.logprobs.content) for c in b.choices)
    assert 0 < engine.counters.accepted - accepted < engine.counters.drafted - drafted  # both acceptance branches ran

    # a stop token in the middle of the reply (the plain server's 10th greedy token, no other
    # stop ids): both stop at its first occurrence (the speculative engine cuts a step's k + 1
    # tokens after it)
    for s in (plain, spec):
        monkeypatch.setattr(s["server"], "stop_ids", ())
    stop_id = _greedy_token(plain, USERS[0], position=9)
    for s in (plain, spec):
        monkeypatch.setattr(s["server"], "stop_ids", (stop_id,))
    a, b = (_ask(s, USERS[0], temperature=0, max_tokens=24, logprobs=True) for s in (plain, spec))
    _same_reply(a, b)
    assert b.choices[0].finish_reason == "stop" and b.usage.completion_tokens <= 10


def _greedy_token(s, user, position):
    """The id of the plain server's greedy token at `position` (from its trajectory log)."""
    r = _ask(s, user, temperature=0, max_tokens=position + 1)
    s["server"].log.flush()
    (rec,) = [x for x in trajectory_log.read_completions(s["log"]) if x["completion_id"] == r.id]
    return int(rec["completion_ids"][position])


def _streamed(s, user, **kw):
    chunks = list(_ask(s, user, stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    return text, finals, chunks[-1].usage


@slow
def test_streaming_unchanged(servers):
    """Streamed chunks of the speculative server concatenate to its non-streamed reply (and, greedy,
    to the plain server's), with one finish reason and the same usage: greedy, seeded sampling
    (a row's tokens depend only on the request's seed), and a stop string."""
    plain, spec = servers["plain"], servers["spec"]
    greedy = _ask(plain, USERS[1], temperature=0, max_tokens=20)
    content = greedy.choices[0].message.content
    stop = content[6:8]
    cases = [dict(temperature=0, max_tokens=20), dict(temperature=1.0, seed=7, max_tokens=20),
             dict(temperature=0, max_tokens=20, stop=[stop])]
    for kw in cases:
        whole = _ask(spec, USERS[1], **kw)
        text, finals, usage = _streamed(spec, USERS[1], **kw)
        assert text == whole.choices[0].message.content, kw
        assert finals == [whole.choices[0].finish_reason], kw
        assert usage.completion_tokens == whole.usage.completion_tokens, kw
        if kw["temperature"] == 0:
            _same_reply(_ask(plain, USERS[1], **kw), whole, logprobs=False)
    cut = _ask(spec, USERS[1], **cases[2])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].message.content == content[:content.index(stop)]


@nnx.jit
def _logits(model, tokens):
    pos = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    logits, _ = model(tokens, pos, jnp.ones(tokens.shape, jnp.int32))
    return logits


def _exact_marginals(model, prompt, t, top_k):
    """The main model's marginals of tokens 1, 2 and 3 after `prompt` under temperature t and top-k
    filtering: p1, sum_a p1(a) p2(.|a), sum_{a,b} p1(a) p2(b|a) p3(.|a,b), from two forwards over
    the continuations (a, b) inside the top-k supports."""
    n_p = len(prompt)
    probs = lambda x: np.asarray(sampling.sampling_probs(x, t, top_k, 1.0), np.float64)
    rows = top_k * top_k

    def forward(pairs):
        toks = np.zeros((rows, n_p + 2), np.int32)
        toks[:, :n_p] = prompt
        if pairs:
            toks[:len(pairs), n_p:] = pairs
        return _logits(model, jnp.asarray(toks))

    logits = forward([])
    p1 = probs(logits[:1, n_p - 1])[0]
    s1 = np.nonzero(p1)[0]
    logits = forward([[a, 0] for a in s1])
    p2 = probs(logits[:len(s1), n_p])  # [a in s1, V]
    pairs = [(i, a, b) for i, a in enumerate(s1) for b in np.nonzero(p2[i])[0]]
    logits = forward([[a, b] for _, a, b in pairs])
    p3 = probs(logits[:len(pairs), n_p + 1])  # [(a, b), V]
    w = np.array([p1[a] * p2[i, b] for i, a, b in pairs])
    return [p1, p1[s1] @ p2, w @ p3]


@slow
def test_sampled_distribution_is_exact(servers, monkeypatch):
    """Tokens 1-3 of 2048 choices served at T = 0.9, top_k 12 (32 requests of n = 64, seeds
    0..31), with and without drafting, against the main model's exact marginals."""
    t, top_k = 0.9, 12
    user = USERS[2]
    prompt = servers["plain"]["server"].parse({"messages": [{"role": "user", "content": user}]}, {}).prompt_ids
    exact = _exact_marginals(servers["model"], prompt, t, top_k)
    v = servers["cfg"].vocab_size
    for name in ("spec", "plain"):
        s = servers[name]
        monkeypatch.setattr(s["server"], "stop_ids", ())  # every choice samples its 3 tokens
        engine = s["engine"]
        drafted, accepted = engine.counters.drafted, engine.counters.accepted
        ids = {_ask(s, user, temperature=t, max_tokens=3, n=64, seed=g, extra_body={"top_k": top_k}).id
               for g in range(32)}
        s["server"].log.flush()
        samples = np.array([r["completion_ids"] for r in trajectory_log.read_completions(s["log"])
                            if r["completion_id"] in ids])
        assert samples.shape == (2048, 3)
        for pos in range(3):
            stat, bound = chi2_ok(np.bincount(samples[:, pos], minlength=v), exact[pos])
            assert stat < bound, (name, pos, stat, bound)
        if name == "spec":
            rate = (engine.counters.accepted - accepted) / (engine.counters.drafted - drafted)
            assert 0.3 < rate < 0.99, rate


# ---------------------------------------------------------------------- start-up checks
def _serve_config(**serve):
    from coder import stages
    from configs import quickstart

    c = quickstart.get_config()
    c.stage = "serve"
    c.serve.update(serve)
    return stages, c


def test_speculative_k_beyond_the_mtp_modules_stops_the_stage():
    from coder.stages import serve as serve_stage

    stages, c = _serve_config(speculative_k=1)
    assert stages.validate(c, n_devices=8, check_tools=False) == ["serve"]  # quickstart: 1 MTP module
    c.serve.speculative_k = 2
    with pytest.raises(ValueError, match=r"serve\.speculative_k=2.*model\.num_mtp_layers=1"):
        stages.validate(c, n_devices=8, check_tools=False)
    c.serve.speculative_k, c.model.num_mtp_layers = 1, 0
    with pytest.raises(ValueError, match=r"serve\.speculative_k=1.*no MTP modules"):
        stages.validate(c, n_devices=8, check_tools=False)
    c.serve.speculative_k = -1
    with pytest.raises(ValueError, match=r"serve\.speculative_k=-1"):
        serve_stage.check(c)
    c.serve.speculative_k = 0  # off: no MTP modules needed
    serve_stage.check(c)


def test_speculative_k_reaches_the_engine_and_needs_trained_mtp_modules(tmp_path, monkeypatch):
    """build_engine hands serve.speculative_k to the engine; a checkpoint whose MTP modules start
    fresh (a Hugging Face one: load_into reports them in `fresh_mtp`) stops it, naming the key."""
    from coder import stages
    from coder.stages import serve as serve_stage
    from coder.train import checkpoint as ckpt_lib

    tok = make_tokenizer()
    tok.save(str(tmp_path / "tok.model"))
    _, c = _serve_config(speculative_k=1, max_slots=2, log_store="none")
    c.model.update(tiny_cfg(tok).to_dict())
    c.workdir, c.data.tokenizer = str(tmp_path / "run"), str(tmp_path / "tok.model")
    c = stages.stage_config("serve", c)
    engine, *_ = serve_stage.build_engine(c, "")
    assert engine.spec_k == 1
    engine.close()

    # a checkpoint without MTP weights (stand-ins for reading one: only the report matters)
    monkeypatch.setattr(serve_stage, "inherit_model_config", lambda config, path: config)
    monkeypatch.setattr(ckpt_lib, "stage_tokenizer", lambda config, path, agent_text=None: tok)
    monkeypatch.setattr(serve_stage, "load_into", lambda model, path, require_all=False: {"fresh_mtp": [0, 1]})
    with pytest.raises(ValueError, match=r"serve\.speculative_k=1 .*module\(s\) \[0\]"):
        serve_stage.build_engine(c, "/hf/checkpoint")
    serve_stage.check_drafts(c, {"fresh_mtp": [1]}, "/hf/checkpoint")  # module 1 is not drafted with
    c.serve.speculative_k = 0
    serve_stage.check_drafts(c, {"fresh_mtp": [0, 1]}, "/hf/checkpoint")  # off: nothing drafts
