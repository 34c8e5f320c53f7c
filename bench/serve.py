"""Serving throughput: the OpenAI-compatible server under 1, 8 and 32 concurrent clients, against
the engine's offline throughput in the same run (CPU, float32, the quickstart model's shape with
random weights, a small tokenizer trained on a few stdlib modules).

For each concurrency C (--clients):
  a. server: C concurrent clients (asyncio tasks of the `openai` AsyncOpenAI client, streaming,
     in a separate process so they do not share the server's GIL) each send --requests requests
     one after another to coder.serve.server.Server (uvicorn on a local port in this process;
     the trajectory log on, to a temporary directory). Reported: requests/s, completion
     tokens/s, time to first token (mean and p90: from sending the request to the first chunk
     with content), latency per request;
  b. offline: the same prompts and sampling straight into the engine from C threads
     (start_group + generate, as the server's pool threads do): no HTTP, no chat rendering, no
     JSON, no log. requests/s and tokens/s.
  server / offline tokens/s is the cost of the HTTP layer at that concurrency.
Every request samples at T = 1 up to --new_tokens tokens (random weights rarely end a turn).
One warm-up round per concurrency compiles its buckets; the better of the next two is reported
(the CPU may be shared with other jobs).

    JAX_PLATFORMS=cpu python bench/serve.py [--clients 1,8,32 --requests 4 --new_tokens 64]
"""
from __future__ import annotations

import argparse
import inspect
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np
from flax import nnx


def tokenizer():
    import asyncio.base_events
    import collections
    import json.decoder
    import json.encoder
    import pathlib
    import textwrap

    from coder.data.tokenizer import train_tokenizer

    mods = (json.decoder, json.encoder, collections, textwrap, pathlib, asyncio.base_events)
    return train_tokenizer([inspect.getsource(m) for m in mods], 2048)


def start_uvicorn(app):
    import socket

    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.01)
    return server, f"http://127.0.0.1:{sock.getsockname()[1]}"


def prompts(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    words = "parse the file and return a list of names sorted by length then fix the failing test".split()
    return [" ".join(rng.choice(words, 24)) for _ in range(n)]


def server_round(url: str, clients: int, requests: int, new_tokens: int, seed: int) -> dict:
    """Runs `client_main` in another process (the clients must not share the server's GIL)."""
    import json
    import subprocess

    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--client", url, "--clients", str(clients),
                          "--requests", str(requests), "--new_tokens", str(new_tokens), "--seed", str(seed)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def client_main(url: str, clients: int, requests: int, new_tokens: int, seed: int) -> None:
    """C concurrent clients (asyncio tasks of one AsyncOpenAI), each sending `requests` streamed
    requests one after another; prints the round's figures as one JSON line."""
    import asyncio
    import json

    import openai

    texts = prompts(clients * requests, seed)

    async def client(c, i):
        out = []
        for j in range(requests):
            t0 = time.perf_counter()
            first, tokens = None, 0
            stream = await c.chat.completions.create(
                model="coder", messages=[{"role": "user", "content": texts[i * requests + j]}], max_tokens=new_tokens,
                temperature=1.0, stream=True, stream_options={"include_usage": True})
            async for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.perf_counter() - t0
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            out.append((first if first is not None else time.perf_counter() - t0, time.perf_counter() - t0, tokens))
        return out

    async def run():
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=600)
        t0 = time.perf_counter()
        results = [r for rs in await asyncio.gather(*(client(c, i) for i in range(clients))) for r in rs]
        return results, time.perf_counter() - t0

    results, wall = asyncio.run(run())
    ttft = np.array([r[0] for r in results])
    print(json.dumps(dict(requests_per_s=len(results) / wall, tokens_per_s=sum(r[2] for r in results) / wall,
                          ttft_mean=float(ttft.mean()), ttft_p90=float(np.percentile(ttft, 90)),
                          latency=float(np.mean([r[1] for r in results])), wall=wall)))


def offline_round(engine, tok, clients: int, requests: int, new_tokens: int, seed: int) -> dict:
    from coder.infer.engine import SamplingParams

    ids = [[tok.special_id("user")] + tok.encode(t, allow_special=False) + [tok.end_id] + tok.generation_prefix()
           for t in prompts(clients * requests, seed)]
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, stop_token_ids=(tok.end_id, tok.eos_id))
    key = jax.random.key(seed)

    def client(i):
        n = 0
        for j in range(requests):
            k = i * requests + j
            group = engine.start_group(ids[k], 1)
            try:
                n += len(engine.generate(group, params, jax.random.fold_in(key, k))[0].tokens)
            finally:
                group.close()
        return n

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as ex:
        tokens = sum(ex.map(client, range(clients)))
    wall = time.perf_counter() - t0
    return dict(requests_per_s=clients * requests / wall, tokens_per_s=tokens / wall, wall=wall)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--clients", default="1,8,32")
    p.add_argument("--requests", type=int, default=4, help="requests per client, one after another")
    p.add_argument("--new_tokens", type=int, default=64)
    p.add_argument("--decode_steps", type=int, default=8)
    p.add_argument("--client", default="", help=argparse.SUPPRESS)  # internal: run the clients against URL
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.client:
        return client_main(args.client, int(args.clients), args.requests, args.new_tokens, args.seed)
    clients = [int(x) for x in args.clients.split(",")]

    from coder.infer.engine import Engine
    from coder.model import Transformer
    from coder.serve.server import Server
    from coder.serve.trajectory_log import TrajectoryLog
    from configs import quickstart

    tok = tokenizer()
    cfg = quickstart.get_config().model
    cfg.vocab_size = tok.padded_vocab_size
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    engine = Engine(model, cfg, max_len=int(cfg.max_position_embeddings), max_slots=max(clients),
                    decode_steps=args.decode_steps)
    with tempfile.TemporaryDirectory() as log_dir:
        server = Server(engine, tok, model_name="coder", log=TrajectoryLog(log_dir, flush_seconds=30.0),
                        max_tokens=args.new_tokens)
        uv, url = start_uvicorn(server.app)
        print(f"model: quickstart shape (hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, vocab "
              f"{cfg.vocab_size}), random weights, float32, {jax.devices()[0].platform}; up to "
              f"{args.new_tokens} new tokens per request at T = 1, decode_steps {args.decode_steps}")
        print(f"{'clients':>7} | {'server req/s':>12} {'tok/s':>8} {'TTFT mean':>9} {'TTFT p90':>9} {'latency':>8} | "
              f"{'offline req/s':>13} {'tok/s':>8} | {'server/offline tok/s':>20}")
        for c in clients:
            # a warm-up round of each compiles this concurrency's buckets; then the better of two
            rounds = [(server_round(url, c, args.requests, args.new_tokens, seed=100 * r + c),
                       offline_round(engine, tok, c, args.requests, args.new_tokens, seed=100 * r + c))
                      for r in range(3)][1:]
            s = max((r[0] for r in rounds), key=lambda x: x["tokens_per_s"])
            o = max((r[1] for r in rounds), key=lambda x: x["tokens_per_s"])
            print(f"{c:>7} | {s['requests_per_s']:>12.2f} {s['tokens_per_s']:>8.0f} {s['ttft_mean'] * 1e3:>7.0f}ms "
                  f"{s['ttft_p90'] * 1e3:>7.0f}ms {s['latency']:>7.2f}s | {o['requests_per_s']:>13.2f} "
                  f"{o['tokens_per_s']:>8.0f} | {s['tokens_per_s'] / o['tokens_per_s']:>20.2f}", flush=True)
        uv.should_exit = True
        server.close()
        engine.close()


if __name__ == "__main__":
    main()
