"""Prefill saved by the RL engine's prefix cache (coder.rl.actor.prefix_cache_slots) on chained
rollouts: `Actor.collect` of B = --tasks tasks x G = --group rollouts whose self-summary chains
run up to --summaries summaries, on one engine without the cache and one with it (built alike
otherwise, the same tasks and sampling keys), side by side in one run.

Every window of a chain starts with the system prompt and the task (the tools' schemas: some 650
tokens here), then the summary of the window before: without the cache each window prefills that
head again; with it, the window's row starts from the slot its previous window left (or any row
with the same head: another task's group shares the system prompt) and prefills only the rest.
A random model writes no tool call, so a window ends when its context is full: the large summary
reserve (budget - head - --room) leaves each window --room tokens of a turn, and the greedy
summary ends on `<|end|>` within the reserve (temperature 0: both engines must sample the same tokens, checked).

CPU, float32, a tiny random model (tests/infer/test_engine.tiny_cfg; the quickstart config's RL
and mesh sections), context budget --budget. Per engine: one warm-up pass (compiles its programs),
then the better of --repeats timed passes, each from an empty cache. Printed per rollout: prefill
tokens computed, tokens the cache saved (`Rollout.prefill_tokens` / `prefix_tokens_saved`, the
means `rollout_metrics` reports), summaries; and the wall time of the pass.

    JAX_PLATFORMS=cpu python bench/prefix_cache_rl.py [--tasks 2 --group 4 --summaries 4
        --budget 1536 --room 32 --concurrent 0 --repeats 2]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
from flax import nnx  # noqa: E402


class Episode:
    """An in-process episode: the tools answer "ok", the workspace scores 0."""

    done = False

    def __init__(self, tools):
        self.tools = tools

    def call(self, call):
        return "ok"

    def score(self):
        return 0.0, {}

    def close(self):
        pass


def setup(args):
    from coder.data import tokenizer as tokenizer_lib
    from coder.env import protocol
    from coder.env.tools import registry as env_tools
    from coder.env.tasks import Task
    from coder.model import Transformer
    from coder.rl import agent as agent_lib
    from configs import quickstart
    from tests.infer.test_engine import tiny_cfg

    texts = [protocol.render_system_prompt(env_tools.SPECS), agent_lib.SUMMARY_REQUEST,
             "def f():\n    return 0\n" * 10, "Make f() return 3. I will read the file first."]
    tok = tokenizer_lib.train_tokenizer(texts, 400)
    c = quickstart.get_config()
    m = tiny_cfg()
    m.vocab_size, m.max_position_embeddings = tok.padded_vocab_size, args.budget
    c.model = m
    tools = [t for t in env_tools.SPECS if t.name in ("read_file", "submit")]
    tasks = [Task(id=f"t{i}", prompt=f"Make f() return {i}.", files={}, tests={}) for i in range(args.tasks)]
    head = len(agent_lib.Agent(None, tok, c.rl).head_ids(tools, tasks[0].prompt))
    c.rl.update(dict(group_size=args.group, tasks_per_step=args.tasks, concurrent=bool(args.concurrent),
                     temperature=0.0, context_budget=args.budget, summary_reserve=args.budget - head - args.room,
                     max_turn_tokens=400,
                     max_turns=32, max_rollout_tokens=8000, max_summaries=args.summaries,
                     engine_slots=args.tasks * args.group, decode_steps=8))
    model = Transformer(c.model, rngs=nnx.Rngs(args.seed))
    return c, tok, model, tasks, tools


def measure(c, tok, model, tasks, tools, prefix_cache: int | None, repeats: int, seed: int) -> dict:
    from coder.rl import actor as actor_lib

    engine = actor_lib.make_engine(model, c, prefix_cache=prefix_cache)
    actor = actor_lib.Actor(engine, tok, c, lambda task: Episode(tools))
    key = jax.random.key(seed)

    def cold():  # no cached prefix left: closed groups released, then dropped
        engine.settle()
        with engine._lock:
            engine.sched.flush_prefixes()

    try:
        actor.collect(tasks, key)  # warm-up: compiles this engine's shapes
        best = None
        for _ in range(repeats):
            cold()
            before, n, programs = engine.stats(), engine.num_compilations, dict(engine.compilations)
            t0 = time.perf_counter()
            groups = actor.collect(tasks, key)
            dt = time.perf_counter() - t0
            engine.settle()
            after = engine.stats()
            if best is None or dt < best["wall_s"]:
                grew = {k: v - programs.get(k, 0) for k, v in engine.compilations.items() if v > programs.get(k, 0)}
                best = dict(wall_s=dt, groups=groups, compiled=engine.num_compilations - n, compiled_programs=grew,
                            pool_slots=engine.pool_store.slots,
                            engine_prefill=after["prefill_tokens"] - before["prefill_tokens"],
                            engine_saved=after["prefix_tokens"] - before["prefix_tokens"])
        best.update(actor_lib.rollout_metrics(best["groups"]), cache_slots=engine.sched.prefix_cache_slots)
        return best
    finally:
        actor.close()
        engine.close()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, default=2)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--summaries", type=int, default=4, help="rl.max_summaries")
    ap.add_argument("--budget", type=int, default=1536, help="rl.context_budget (and the model's positions)")
    ap.add_argument("--room", type=int, default=32, help="a window's turn tokens: rl.summary_reserve = "
                    "budget - system prompt and task - room")
    ap.add_argument("--concurrent", type=int, default=0, help="rl.concurrent")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    c, tok, model, tasks, tools = setup(args)
    out = {name: measure(c, tok, model, tasks, tools, pc, args.repeats, args.seed)
           for name, pc in (("without", 0), ("with", None))}
    same = all([g.tokens for g in a.generations] == [g.tokens for g in b.generations]
               for ga, gb in zip(out["without"]["groups"], out["with"]["groups"]) for a, b in zip(ga, gb))
    summaries = sorted(r.summaries for g in out["with"]["groups"] for r in g)
    print(f"prefix cache in RL: B={args.tasks} tasks x G={args.group}, up to {args.summaries} summaries "
          f"(rollouts' summaries {summaries}), budget {args.budget}, summary reserve {c.rl.summary_reserve}, "
          f"concurrent={bool(args.concurrent)}, tiny random model, float32, "
          f"{jax.device_count()} {jax.default_backend()} device(s), {os.cpu_count()} CPU(s)")
    print(f"  {'prefix cache':14s} {'slots':>5s} {'summaries':>9s} {'prefilled/rollout':>17s} "
          f"{'saved/rollout':>13s} {'saved %':>7s} {'engine prefill':>14s} {'pool':>4s} {'wall s':>7s} "
          f"{'compiled while timed':s}")
    for name, r in out.items():
        print(f"  {name:14s} {r['cache_slots']:5d} {r['summaries']:9.2f} {r['prefill_tokens']:17.1f} "
              f"{r['prefix_tokens_saved']:13.1f} {100 * r['prefix_saved_frac']:7.1f} {r['engine_prefill']:14d} "
              f"{r['pool_slots']:4d} {r['wall_s']:7.2f} {r['compiled']} {r['compiled_programs'] or ''}")
    w, wo = out["with"], out["without"]
    print(f"  same tokens with and without: {same}; prefill tokens computed with / without: "
          f"{w['engine_prefill'] / max(wo['engine_prefill'], 1):.3f}; wall time with / without: "
          f"{w['wall_s'] / wo['wall_s']:.3f}; every prompt token prefilled or saved: "
          f"{w['engine_prefill'] + w['engine_saved'] == wo['engine_prefill']}")
    return out


if __name__ == "__main__":
    main()
