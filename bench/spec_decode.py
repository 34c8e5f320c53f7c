"""Speculative decoding with the self-distilled MTP modules, measured side by side in one run.

Trains the quickstart model with 2 MTP layers (pretrain on the bundled stdlib corpus, then the
`mtp` self-distillation stage, coder/stages/mtp.py), or reuses the checkpoints of `--workdir`
(the trainers resume, so a finished stage does not train again). Then, on the same weights:

1. decode tokens/s and tokens emitted per main-model step of coder's Engine with
   speculative_k = 0 (plain), 1 and 2, at temperature 0 (greedy) and 1, over held-out stdlib
   prompts; and whether greedy output is token-for-token identical to plain decoding;
2. acceptance per depth in the k = 2 runs, from the accepted-draft count of every step (the
   depth-2 rate is conditional on depth 1 being accepted: only then is it examined), beside the
   mtp stage's held-out alpha_d = sum min(p_main, p_mtp_d) (heldout/accept_d in
   {workdir}/mtp/metrics.jsonl), which is the expected acceptance at temperature 1;
3. the server in the loop (`--parts serve`): stage serve's Server (coder.stages.serve.build, so
   the engine comes from `serve.speculative_k`) without and with speculative decoding, both up at
   once on loopback ports, driven by 1 and 8 concurrent streaming `openai` clients (a separate
   process: they do not share the servers' GIL), each sending --serve_requests chat requests (the
   held-out prompts' text as the user turn) one after another. Per (temperature, clients, k):
   completion tokens/s over the round's wall time (the better of --serve_rounds rounds, plain and
   speculative rounds alternating, after warm-up rounds of each that compile their buckets),
   tokens emitted per row per step, draft acceptance (both over the timed rounds), at
   temperature 0 whether every reply's text equals the plain server's, and the programs compiled
   during the timed rounds (0: none timed).
4. (`--parts grpo --grpo_init CKPT`) draft acceptance through GRPO with and without the MTP
   refresh (grpo.mtp_weight): `grpo_refresh_bench`.

    JAX_PLATFORMS=cpu python bench/spec_decode.py [--workdir /tmp/spec_bench --pretrain_steps 100
        --mtp_steps 100 --prompts 4 --prompt_len 64 --new_tokens 64 --parts engine,serve
        --serve_k 2 --serve_clients 1,8 --serve_temps 0,1]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np


def build_config(args):
    """configs/quickstart.py with 2 MTP layers, the bench's step counts and (by default) a model
    large enough that decoding one row is memory-bound on a CPU: --hidden 768 x --layers 8 dense
    layers, ~90M float32 parameters (~370 MB), so reading the weights bounds a step and a
    verify forward of k + 1 tokens costs about one of a single token."""
    from configs import quickstart

    c = quickstart.get_config()
    c.workdir = args.workdir
    c.model.num_mtp_layers = 2
    if args.hidden:
        heads = max(4, args.hidden // 96)
        c.model.update(dict(hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                            first_k_dense_replace=args.layers, num_attention_heads=heads, kv_lora_rank=args.hidden // 4,
                            qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64))
        c.data.batch_size = 4
        c.data.seq_len = 128
        c.model.max_position_embeddings = 256
    c.train.steps = args.pretrain_steps
    c.train.ckpt_every = args.pretrain_steps
    c.mtp.steps = args.mtp_steps
    c.mtp.eval_batches = args.eval_batches
    c.mesh.rules = tuple(tuple(r) for r in c.mesh.rules)
    return c


def train(c):
    """Pretrain, then mtp; returns the mtp checkpoint directory."""
    from coder import stages

    pre = stages.run_one("pretrain", c, os.path.join(c.workdir, "pretrain"))
    return stages.run_one("mtp", c, os.path.join(c.workdir, "mtp"), pre)


def heldout_prompts(c, ckpt: str, n: int, length: int) -> list:
    """n prompts of `length` tokens from held-out stdlib documents (the first tokens of a document),
    encoded with the tokenizer of the checkpoint `ckpt`."""
    from coder.data.pretrain import make_pretrain_iterator
    from coder.train.checkpoint import stage_tokenizer

    tok = stage_tokenizer(c, ckpt)
    it = make_pretrain_iterator(c, tok, "heldout", num_epochs=None)
    prompts = []
    try:
        for batch in it:
            toks, seg = np.asarray(batch["tokens"]), np.asarray(batch["segment_ids"])
            for b in range(toks.shape[0]):
                # each document (segment) of the row long enough gives its first tokens
                for s in np.unique(seg[b][seg[b] > 0]):
                    idx = np.nonzero(seg[b] == s)[0]
                    if len(idx) >= length:
                        prompts.append([int(t) for t in toks[b, idx[:length]]])
                    if len(prompts) >= n:
                        return prompts
    finally:
        it.close()
    if not prompts:
        raise ValueError(f"no held-out document of {length} tokens; lower --prompt_len")
    return prompts


def run_engine(model, cfg, k, prompts, temperature, new_tokens, seed, decode_steps):
    """Decode every prompt (batch 1) with speculative_k = k; returns the figures and tokens."""
    from coder.infer.engine import Engine, SamplingParams

    engine = Engine(model, cfg, max_len=len(prompts[0]) + new_tokens + 8, batch_buckets=(1,), max_slots=1,
                    speculative_k=k, decode_steps=decode_steps)
    params = SamplingParams(temperature=temperature, max_new_tokens=new_tokens)

    def decode(p, rng):
        group = engine.start_group(p, 1)
        t0 = time.perf_counter()
        gen = engine.generate(group, params, rng)[0]
        dt = time.perf_counter() - t0
        group.close()
        return gen, dt

    # warm up: compile the prefill and decode programs on every prompt (a different rng, so
    # the timed pass does not replay it; any compile left in the timed pass is reported)
    for p in prompts:
        decode(p, jax.random.key(seed + 1000))
    engine.counters.decode_steps = engine.counters.drafted = engine.counters.accepted = 0
    engine.counters.accepted_by_depth[:] = 0
    compiled = engine.num_compilations
    rng = jax.random.key(seed + 1)
    outs, elapsed, emitted = [], 0.0, 0
    for p in prompts:
        rng, sub = jax.random.split(rng)
        gen, dt = decode(p, sub)
        elapsed += dt
        emitted += len(gen.tokens)
        outs.append(list(gen.tokens))
    steps = engine.counters.decode_steps
    # depth d is examined only when drafts 1..d-1 were accepted: conditional rate per depth
    examined = [steps] + [int(a) for a in engine.counters.accepted_by_depth]
    return {
        "tok_s": emitted / elapsed,
        "compiles": engine.num_compilations - compiled,
        "tokens": emitted,
        "steps": steps,
        "per_step": emitted / max(steps, 1),
        "drafted": engine.counters.drafted,
        "accepted": engine.counters.accepted,
        "accept_rate": engine.counters.accepted / engine.counters.drafted if engine.counters.drafted else float("nan"),
        "acc_per_step": engine.counters.accepted / max(steps, 1),
        "depth": [examined[d] / max(examined[d - 1], 1) for d in range(1, k + 1)],
    }, outs


def serve_client_main(spec_path: str) -> None:
    """One round of clients (this is a separate process): `clients` asyncio tasks of one
    AsyncOpenAI, each sending `requests` streamed chat requests one after another; prints the
    round's wall time, completion tokens and reply texts (in request order) as one JSON line."""
    import asyncio

    import openai

    with open(spec_path) as f:
        spec = json.load(f)
    texts, clients, requests = spec["texts"], spec["clients"], spec["requests"]

    async def client(c, i):
        out = []
        for j in range(requests):
            n = i * requests + j
            stream = await c.chat.completions.create(
                model="coder", messages=[{"role": "user", "content": texts[n % len(texts)]}],
                max_tokens=spec["max_tokens"], temperature=spec["temperature"], seed=spec["seed"] + n,
                stream=True, stream_options={"include_usage": True})
            text, tokens = [], 0
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    text.append(chunk.choices[0].delta.content)
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            out.append(("".join(text), tokens))
        return out

    async def run():
        c = openai.AsyncOpenAI(base_url=spec["url"] + "/v1", api_key="bench", max_retries=0, timeout=3600)
        t0 = time.perf_counter()
        results = [r for rs in await asyncio.gather(*(client(c, i) for i in range(clients))) for r in rs]
        return results, time.perf_counter() - t0

    results, wall = asyncio.run(run())
    print(json.dumps(dict(wall=wall, tokens=sum(r[1] for r in results), texts=[r[0] for r in results])))


def serve_round(url, texts, clients, requests, max_tokens, temperature, seed) -> dict:
    """Runs `serve_client_main` in another process against the server at `url`."""
    import subprocess
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(dict(url=url, texts=texts, clients=clients, requests=requests, max_tokens=max_tokens,
                       temperature=temperature, seed=seed), f)
    try:
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--serve_client", f.name],
                             capture_output=True, text=True, check=True)
    finally:
        os.unlink(f.name)
    return json.loads(out.stdout.strip().splitlines()[-1])


def serve_bench(c, ckpt, texts, args) -> dict:
    """Part 3 of the module docstring; returns {(temperature, clients, k): figures}."""
    import copy

    from bench.serve import start_uvicorn  # the serving bench's loopback server
    from coder import stages
    from coder.stages import serve as serve_stage

    clients = [int(x) for x in args.serve_clients.split(",")]
    temps = [float(x) for x in args.serve_temps.split(",")]
    ks = [0, args.serve_k]
    servers = {}
    for k in ks:  # both servers up at once: their rounds alternate
        sc = copy.deepcopy(c)
        sc.stage = "serve"
        sc.serve.update(dict(speculative_k=k, max_slots=max(clients), decode_steps=args.serve_decode_steps,
                             log_store="none", max_tokens=args.new_tokens))
        server = serve_stage.build(stages.stage_config("serve", sc), ckpt)
        uv, url = start_uvicorn(server.app)
        servers[k] = dict(server=server, engine=server.engine, uv=uv, url=url)
    print(f"\nserver in the loop: stage serve's Server (serve.speculative_k = {ks[0]} and {ks[1]}, both up, "
          f"serve.decode_steps {args.serve_decode_steps}), C concurrent streaming openai clients in another "
          f"process on loopback, each sending {args.serve_requests} requests of up to {args.new_tokens} tokens "
          f"one after another; the better of {args.serve_rounds} rounds")
    print(f"{'T':>3} {'clients':>7} {'k':>3} {'tok/s':>8} {'x plain':>8} {'tok/row-step':>13} {'accept':>7} "
          f"{'tokens':>7} {'greedy==plain':>14} {'compiles':>8}")
    results = {}
    for n in clients:  # the engines' pools only grow: the batch-1 rows run before the batch-8 ones
        for temp in temps:
            seed = args.seed + int(100 * temp) + 1000 * n
            run = lambda k: serve_round(servers[k]["url"], texts, n, args.serve_requests,  # noqa: E731
                                        args.new_tokens, temp, seed)
            for k in ks:  # warm-up rounds compile this concurrency's buckets (until one compiles nothing)
                for _ in range(4):
                    compiled = servers[k]["engine"].num_compilations
                    run(k)
                    if servers[k]["engine"].num_compilations == compiled:
                        break
            before = {k: dict(servers[k]["engine"].stats()) for k in ks}
            compiled = {k: servers[k]["engine"].num_compilations for k in ks}
            best = {}
            for _ in range(args.serve_rounds):
                for k in ks:
                    r = run(k)
                    if k not in best or r["tokens"] / r["wall"] > best[k]["tokens"] / best[k]["wall"]:
                        best[k] = r
            for k in ks:
                after = servers[k]["engine"].stats()
                d = {key: after[key] - before[k][key] for key in ("emitted", "row_steps")}
                drafted = after.get("drafted", 0) - before[k].get("drafted", 0)
                accepted = after.get("accepted", 0) - before[k].get("accepted", 0)
                tok_s = best[k]["tokens"] / best[k]["wall"]
                same = "-" if temp > 0 or k == 0 else str(best[k]["texts"] == best[0]["texts"])
                results[(temp, n, k)] = dict(tok_s=tok_s, accept=accepted / drafted if drafted else float("nan"),
                                             per_row_step=d["emitted"] / max(d["row_steps"], 1),
                                             compiles=servers[k]["engine"].num_compilations - compiled[k])
                base = results[(temp, n, 0)]["tok_s"]
                print(f"{temp:>3g} {n:>7} {k:>3} {tok_s:>8.1f} {tok_s / base:>8.2f} "
                      f"{results[(temp, n, k)]['per_row_step']:>13.3f} {results[(temp, n, k)]['accept']:>7.3f} "
                      f"{best[k]['tokens']:>7} {same:>14} {results[(temp, n, k)]['compiles']:>8}", flush=True)
    for s in servers.values():
        s["uv"].should_exit = True
        s["server"].close()
        s["engine"].close()
    return results


def heldout_accept(workdir):
    """The last heldout/accept_d, agree_d, kl_d of {workdir}/mtp/metrics.jsonl."""
    rec = {}
    with open(os.path.join(workdir, "mtp", "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if any(k.startswith("heldout/") for k in r):
                rec = r
    return rec


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", default="/tmp/spec_bench")
    ap.add_argument("--pretrain_steps", type=int, default=100)
    ap.add_argument("--mtp_steps", type=int, default=100)
    ap.add_argument("--eval_batches", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt_len", type=int, default=64)
    ap.add_argument("--new_tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--decode_steps", type=int, default=32, help="decode steps per host call")
    ap.add_argument("--hidden", type=int, default=768, help="model width (0: the quickstart model as is)")
    ap.add_argument("--layers", type=int, default=8, help="dense trunk layers (with --hidden)")
    ap.add_argument("--parts", default="engine,serve", help="engine (parts 1-2), serve (part 3)")
    ap.add_argument("--serve_k", type=int, default=2, help="serve.speculative_k of the speculative server")
    ap.add_argument("--serve_clients", default="1,8", help="concurrent clients (comma-separated)")
    ap.add_argument("--serve_temps", default="0,1", help="temperatures of the served requests")
    ap.add_argument("--serve_requests", type=int, default=2, help="requests per client, one after another")
    ap.add_argument("--serve_rounds", type=int, default=3, help="timed rounds per server (the better counts)")
    ap.add_argument("--serve_decode_steps", type=int, default=8, help="serve.decode_steps")
    ap.add_argument("--serve_client", default="", help=argparse.SUPPRESS)  # internal: one round of clients
    ap.add_argument("--grpo_init", default="", help="part 4 (--parts grpo): the checkpoint GRPO starts from, e.g. "
                    "a quickstart run's {workdir}/sft/checkpoints")
    ap.add_argument("--grpo_steps", type=int, default=4, help="part 4: GRPO steps of each run")
    args = ap.parse_args()
    if args.serve_client:
        return serve_client_main(args.serve_client)
    parts = set(args.parts.split(","))
    if "grpo" in parts:
        grpo_refresh_bench(args)
        parts.discard("grpo")
        if not parts:
            return

    c = build_config(args)
    t0 = time.perf_counter()
    ckpt = train(c)
    print(f"trained/loaded in {time.perf_counter() - t0:.0f}s: {ckpt}")
    from coder.train.state import load_model

    model = load_model(c, ckpt)
    prompts = heldout_prompts(c, ckpt, args.prompts, args.prompt_len)
    from coder.model import count_params

    n = count_params(c.model)
    print(f"model: {n['total'] / 1e6:.1f}M trunk + {n['mtp'] / 1e6:.1f}M MTP parameters, "
          f"{4 * (n['total'] + n['mtp']) / 2**20:.0f} MB float32")
    print(f"{len(prompts)} held-out prompts x {args.prompt_len} tokens, {args.new_tokens} new tokens each, "
          f"batch 1, {jax.device_count()} device(s), backend {jax.default_backend()}")

    if "engine" in parts:
        engine_bench(c, model, prompts, args)
    if "serve" in parts:
        from coder.train.checkpoint import stage_tokenizer

        tok = stage_tokenizer(c, ckpt)
        serve_bench(c, ckpt, [tok.decode(p) for p in prompts], args)


def grpo_refresh_bench(args) -> dict:
    """Part 4: draft acceptance through GRPO with and without the MTP refresh (grpo.mtp_weight).

    Two runs of stage grpo on configs/quickstart.py's toy tasks from the same checkpoint
    (`--grpo_init`), the same seed and tasks, differing only in grpo.mtp_weight (0 vs the
    config's), with the rollout engine drafting one token per step with the MTP module
    (rl.speculative_k=1): each step's `engine_accept_depth1` is the acceptance of drafts on the
    policy's own rollouts with the weights of that step (the engine verifies every draft against
    the current policy), i.e. what speculative decoding gets as GRPO moves the policy."""
    from configs import quickstart

    from coder import stages

    if not args.grpo_init:
        raise SystemExit("--parts grpo needs --grpo_init (e.g. a quickstart run's sft/checkpoints)")
    out = {}
    for label, weight in (("no refresh", 0.0), ("refresh", None)):
        c = quickstart.get_config()
        c = stages.inherit_model_config(c, args.grpo_init)
        if weight is not None:
            c.grpo.mtp_weight = weight
        c.grpo.steps, c.grpo.eval_at_start = args.grpo_steps, False
        c.rl.speculative_k, c.rl.eval_num_tasks = 1, 0
        stage_dir = os.path.join(args.workdir, "grpo_refresh", label.replace(" ", "_"))
        if os.path.exists(stage_dir):
            import shutil

            shutil.rmtree(stage_dir)  # a fresh run each time: a resumed stage would skip its steps
        t0 = time.perf_counter()
        stages.run_one("grpo", c, stage_dir, args.grpo_init)
        with open(os.path.join(stage_dir, "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f if line.strip()]
        out[label] = dict(weight=float(c.grpo.mtp_weight), seconds=time.perf_counter() - t0,
                          accept=[r.get("engine_accept_depth1") for r in records],
                          mtp_accept=[r.get("mtp_accept_1") for r in records])
    print(f"\nPart 4: draft acceptance (depth 1) of the rollout engine per GRPO step, from {args.grpo_init}")
    print(f"{'run':<12} {'grpo.mtp_weight':>15}  per step")
    for label, r in out.items():
        steps = " ".join("-" if a is None else f"{a:.3f}" for a in r["accept"])
        print(f"{label:<12} {r['weight']:>15.2f}  {steps}")
    return out


def engine_bench(c, model, prompts, args):
    """Parts 1 and 2 of the module docstring."""
    results = {}
    for temp in (0.0, 1.0):
        base = None
        print(f"\ntemperature {temp:g}")
        print(f"{'k':>3} {'tok/s':>8} {'x plain':>8} {'tok/step':>9} {'acc/step':>9} {'accept':>7} "
              f"{'steps':>6} {'tokens':>7} {'greedy==plain':>14} {'compiles':>8}")
        for k in (0, 1, 2):
            r, outs = run_engine(model, c.model, k, prompts, temp, args.new_tokens, args.seed, args.decode_steps)
            if k == 0:
                base, base_outs = r, outs
            same = "-" if temp > 0 or k == 0 else str(outs == base_outs)
            results[(temp, k)] = r
            print(f"{k:>3} {r['tok_s']:>8.1f} {r['tok_s'] / base['tok_s']:>8.2f} {r['per_step']:>9.3f} "
                  f"{r['acc_per_step']:>9.3f} {r['accept_rate']:>7.3f} {r['steps']:>6} {r['tokens']:>7} "
                  f"{same:>14} {r['compiles']:>8}")

    rec = heldout_accept(args.workdir)
    print("\nacceptance per depth (engine, k=2 runs: P(draft d accepted | drafts < d accepted);\n"
          "alpha_d: mtp stage held-out sum min(p_main, p_mtp_d), the expected rate at T=1)")
    print(f"{'depth':>5} {'engine T=0':>11} {'engine T=1':>11} {'alpha_d':>8} {'agree_d':>8} {'kl_d':>7}")
    for d in (1, 2):
        # from the k = 2 runs; depth 2 conditional on depth 1 accepted
        eng = [results[(temp, 2)]["depth"][d - 1] for temp in (0.0, 1.0)]
        print(f"{d:>5} {eng[0]:>11.3f} {eng[1]:>11.3f} {rec.get(f'heldout/accept_{d}', float('nan')):>8.3f} "
              f"{rec.get(f'heldout/agree_{d}', float('nan')):>8.3f} {rec.get(f'heldout/kl_{d}', float('nan')):>7.3f}")
    print("DeepSeek-V3 (paper): 85-90% acceptance of the second token (depth 1), 1.8x tokens/s")


if __name__ == "__main__":
    main()
