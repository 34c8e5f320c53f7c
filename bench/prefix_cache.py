"""Time to first token with and without the engine's prefix cache (Engine(prefix_cache_slots=k),
serve.prefix_cache_slots), side by side in one run, on the two shapes the cache is for:

  session  an agent session as a stateless API serves it: turn t's prompt is turn t-1's prompt +
           its reply + a tool's output (--obs tokens); --turns turns. Without the cache every
           turn prefills the whole conversation again; with it, only the reply's last token and
           the new output.
  files    a many-files prompt: the same --context tokens (files) followed by --questions
           different questions of 32 tokens each, one request after another.

Time to first token = start_group (admission, the prompt's prefill) + the first decode call, one
token (greedy).

`--parts server` runs the same two shapes through stage serve's HTTP server (coder.serve.server,
uvicorn on a local port, the `openai` client, a tokenizer trained on a few stdlib modules): a
chat session whose turn t sends turn t-1's messages + the assistant's reply (its text, as a
client sends it back) + a new user message of about --obs tokens, and a many-files chat (one
user message of about --context tokens of files, then a question). Time to first token is the
request's wall time with max_tokens=1 (chat rendering, tokenizing, prefill, one token, JSON).
Through text, the cache reuses only what renders to the same ids: the reply re-tokenized from its
text may differ from the ids the engine sampled, and the counts of prefilled and reused tokens
show how much that costs. CPU, float32, the quickstart model's shape with random weights at 2048 positions
(its longctx length; --model k=v overrides). One warm-up pass per engine and shape compiles its
buckets; the better of two timed passes is reported, each starting with no cached prefix. The
two engines are built alike except for prefix_cache_slots, and the same requests go to both;
replies are checked equal (greedy tokens).

    JAX_PLATFORMS=cpu python bench/prefix_cache.py [--turns 6 --obs 192 --context 1536 --questions 4]
        [--parts engine,server]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np
from flax import nnx


def build(args, cached: int, vocab_size: int | None = None):
    from coder.infer.engine import Engine
    from coder.model import Transformer
    from configs import quickstart

    cfg = quickstart.get_config().model
    cfg.dtype = "float32"
    for kv in args.model:
        k, v = kv.split("=")
        cfg[k] = type(cfg[k])(v)
    if vocab_size:
        cfg.vocab_size = int(vocab_size)
    max_len = int(cfg.max_position_embeddings)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    return Engine(model, cfg, max_len=max_len, max_slots=4, decode_steps=1, prefix_cache_slots=cached), max_len


def first_token(engine, prompt) -> tuple[float, list]:
    from coder.infer.engine import SamplingParams

    t0 = time.perf_counter()
    g = engine.start_group(prompt, 1)
    gen = engine.generate(g, SamplingParams(temperature=0.0, max_new_tokens=1), jax.random.key(0))[0]
    seconds = time.perf_counter() - t0
    g.close()
    return seconds, gen.tokens


def cold(engine) -> None:
    """No cached prefix left: closed groups released (the engine thread), then dropped."""
    engine.settle()
    with engine._lock:
        engine.sched.flush_prefixes()


def session(engine, args, vocab: int) -> tuple[list, list]:
    rng = np.random.default_rng(1)
    prompt, times, replies = list(rng.integers(1, vocab, args.obs)), [], []
    for _ in range(args.turns):
        s, reply = first_token(engine, prompt)
        times.append(s)
        replies.append(reply)
        prompt = prompt + reply + list(rng.integers(1, vocab, args.obs))
    return times, replies


def files(engine, args, vocab: int) -> tuple[list, list]:
    rng = np.random.default_rng(2)
    context = list(rng.integers(1, vocab, args.context))
    times, replies = [], []
    for _ in range(args.questions):
        s, reply = first_token(engine, context + list(rng.integers(1, vocab, 32)))
        times.append(s)
        replies.append(reply)
    return times, replies


# --- through the HTTP server -------------------------------------------------------------------
WORDS = ("parse the file and return a list of names sorted by length then fix the failing test in "
         "module config loader path value error because index raised when empty").split()


def _text(rng, tok, tokens: int) -> str:
    """Random words of about `tokens` tokens under `tok`."""
    words = []
    while len(tok.encode(" ".join(words), allow_special=False)) < tokens:
        words += list(rng.choice(WORDS, 16))
    return " ".join(words)


def _ask(client, messages) -> tuple[float, str]:
    t0 = time.perf_counter()
    r = client.chat.completions.create(model="coder", messages=messages, max_tokens=1, temperature=0)
    return time.perf_counter() - t0, r.choices[0].message.content or ""


def server_session(client, tok, args) -> tuple[list, list]:
    rng = np.random.default_rng(1)
    messages = [{"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": _text(rng, tok, args.obs)}]
    times, replies = [], []
    for _ in range(args.turns):
        s, reply = _ask(client, messages)
        times.append(s)
        replies.append(reply)
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": _text(rng, tok, args.obs)}]
    return times, replies


def server_files(client, tok, args) -> tuple[list, list]:
    rng = np.random.default_rng(2)
    context = _text(rng, tok, args.context)
    times, replies = [], []
    for _ in range(args.questions):
        s, reply = _ask(client, [{"role": "user", "content": context + "\n\nQuestion: " + _text(rng, tok, 32)}])
        times.append(s)
        replies.append(reply)
    return times, replies


def server_part(args) -> dict:
    import openai

    from bench.serve import start_uvicorn, tokenizer
    from coder.serve.server import Server

    tok = tokenizer()
    results = {}
    for name, cached in (("no cache", 0), ("prefix cache", 2)):
        engine, _ = build(args, cached, tok.padded_vocab_size)
        server = Server(engine, tok, model_name="coder", max_tokens=1)
        uv, url = start_uvicorn(server.app)
        client = openai.OpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=600)
        try:
            for shape, fn in (("session", server_session), ("files", server_files)):
                runs = []
                for _ in range(3):  # a warm-up pass, then two timed ones, each from no cached prefix
                    cold(engine)
                    runs.append(fn(client, tok, args))
                results[name, shape] = min(runs[1:], key=lambda r: sum(r[0]))
            stats = engine.stats()
            results[name, "prefilled"] = (stats["prefill_tokens"], stats["prefix_tokens"])
        finally:
            uv.should_exit = True
            server.close()
            engine.close()
    return results


def report(results: dict, where: str) -> None:
    for shape in ("session", "files"):
        (a, ra), (b, rb) = results["no cache", shape], results["prefix cache", shape]
        assert ra == rb, f"{where} {shape}: the replies differ with the cache"
        print(f"\n{where}, {shape}: time to first token, ms per request (no cache / prefix cache / ratio)")
        for i, (x, y) in enumerate(zip(a, b)):
            print(f"  request {i + 1}: {1e3 * x:8.1f} {1e3 * y:8.1f}   {x / y:5.2f}x")
        print(f"  total    : {1e3 * sum(a):8.1f} {1e3 * sum(b):8.1f}   {sum(a) / sum(b):5.2f}x")
    for name in ("no cache", "prefix cache"):
        prefilled, reused = results[name, "prefilled"]
        print(f"{where}, {name}: {prefilled} tokens prefilled, {reused} reused from cached prefixes (all passes)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--obs", type=int, default=192)
    ap.add_argument("--context", type=int, default=1536)
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--model", nargs="*", default=["max_position_embeddings=2048"])
    ap.add_argument("--parts", default="engine,server", help="engine (token ids) and/or server (HTTP)")
    args = ap.parse_args()
    parts = args.parts.split(",")
    if set(parts) - {"engine", "server"}:
        raise SystemExit(f"--parts {args.parts}: engine and/or server")
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}; session: {args.turns} turns of +{args.obs} tokens; "
          f"files: {args.context}-token context + 32-token question x {args.questions}")
    if "engine" in parts:
        report(engine_part(args), "engine")
    if "server" in parts:
        report(server_part(args), "server")


def engine_part(args) -> dict:
    results = {}
    for name, cached in (("no cache", 0), ("prefix cache", 2)):
        engine, max_len = build(args, cached)
        if (args.turns + 1) * (args.obs + 1) > max_len or args.context + 32 > max_len:
            raise SystemExit(f"the prompts outgrow the model's {max_len} positions: lower --turns/--obs/--context")
        vocab = int(engine.cfg.vocab_size)
        for shape, fn in (("session", session), ("files", files)):
            runs = []
            for _ in range(3):  # a warm-up pass (compiles the buckets), then two timed ones
                cold(engine)  # each pass starts with no cached prefix, as a new session does
                runs.append(fn(engine, args, vocab))
            best = min(runs[1:], key=lambda r: sum(r[0]))
            results[name, shape] = best
        stats = engine.stats()
        results[name, "prefilled"] = (stats["prefill_tokens"], stats["prefix_tokens"])
        engine.close()
    return results


if __name__ == "__main__":
    main()
