"""Rollouts/s of the toy tasks through the real sandbox: the concurrent actor against the group-by-
group loop, side by side in one run on the same weights (CPU, float32, a tiny random model).

    JAX_PLATFORMS=cpu python bench/rollouts.py [--tasks 8 --group 4 --max_turn_tokens 32
                                                --max_turns 2 --repeats 1]

Both modes run `coder.rl.actor.Actor.collect` on B = --tasks toy tasks x G = --group rollouts
with the same engine (`make_engine`: B x G slots) and episodes from `episode_factory` (a bwrap
sandbox per rollout, config.env's limits; the hidden tests score each rollout):
  group by group (`rl.concurrent=False`): task after task, a group's G rows decode together,
    tool calls and scoring run one after another in local sandboxes;
  concurrent (`rl.concurrent=True`): all B x G rollouts at once, one thread per rollout, rows
    decoding together in the engine while others wait on tools or scoring in env workers.
Each mode is warmed up first on other tasks (the env workers' start, and the engine's programs:
rounds until one compiles nothing), then timed on the same tasks with the same sampling keys
(best of --repeats); compilations during the timed runs are printed. A random model rarely writes a well-formed call,
so most rollouts are one turn of --max_turn_tokens tokens and a scoring run (the hidden tests in
the sandbox); the env time per rollout is printed beside the rates.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# jax is imported inside the functions: the env workers (spawned processes) re-import this file.


def setup(tasks: int, group: int, max_turn_tokens: int, max_turns: int, seed: int = 0):
    """(config, tokenizer, model, toy tasks) for the comparison."""
    from flax import nnx

    from coder.data import tokenizer as tokenizer_lib
    from coder.env import protocol, tasks as tasks_lib
    from coder.env.tools.registry import SPECS
    from coder.model import Transformer
    from configs import quickstart

    c = quickstart.get_config()
    pairs = tasks_lib.toy_tasks(3 * tasks, seed)
    texts = [protocol.render_system_prompt(SPECS)] * 4 + [t.prompt for t, _ in pairs]
    texts += [s["answer.py"] for _, s in pairs] + [protocol.render_tool_call("read_file", {"path": "answer.py"})] * 8
    tok = tokenizer_lib.train_tokenizer(texts, 512)
    c.model.vocab_size = tok.padded_vocab_size
    c.model.max_position_embeddings = 1024
    c.model.rope_scaling.original_max_position_embeddings = 1024
    c.rl.update(dict(tasks_per_step=tasks, group_size=group, max_turn_tokens=max_turn_tokens,
                     max_turns=max_turns, context_budget=1024, summary_reserve=128,
                     max_rollout_tokens=max_turns * max_turn_tokens, engine_slots=tasks * group))
    model = Transformer(c.model, rngs=nnx.Rngs(seed))
    return c, tok, model, [t for t, _ in pairs]


def compare(tasks: int = 8, group: int = 4, max_turn_tokens: int = 32, max_turns: int = 2,
            repeats: int = 2, seed: int = 0, verbose: bool = True) -> dict:
    """Rollouts/s of both modes and their ratio (concurrent / group by group)."""
    import jax

    from coder.rl import actor as actor_lib

    c, tok, model, all_tasks = setup(tasks, group, max_turn_tokens, max_turns, seed)
    engine = actor_lib.make_engine(model, c)
    make_episode = actor_lib.episode_factory(c)
    actors = {}
    for concurrent in (False, True):
        cfg = c.copy_and_resolve_references()
        cfg.rl.concurrent = concurrent
        actors[concurrent] = actor_lib.Actor(engine, tok, cfg, make_episode)
    warm, timed_tasks = all_tasks[:tasks], all_tasks[tasks:2 * tasks]
    key = jax.random.key(seed)
    out, compiles = {}, {False: 0, True: 0}
    try:
        for concurrent, actor in actors.items():  # start the workers, compile both modes' shapes
            for r in range(6):  # until a round compiles nothing (which shapes occur depends on timing)
                n = engine.num_compilations
                actor.collect((warm, timed_tasks)[r % 2], jax.random.fold_in(key, r + 1))
                if r and engine.num_compilations == n:
                    break
        best = {}
        for _ in range(repeats):
            for concurrent, actor in actors.items():
                n = engine.num_compilations
                t0 = time.perf_counter()
                groups = actor.collect(timed_tasks, key)
                dt = time.perf_counter() - t0
                compiles[concurrent] += engine.num_compilations - n
                if verbose and engine.num_compilations > n:
                    print(f"  (compiled while timing {'concurrent' if concurrent else 'group by group'}: "
                          f"{dict(engine.compilations)})")
                if dt < best.get(concurrent, (float("inf"),))[0]:
                    best[concurrent] = (dt, groups)
        for concurrent, (dt, groups) in best.items():
            m = actor_lib.rollout_metrics(groups)
            name = "concurrent" if concurrent else "group_by_group"
            out[name] = dict(rollouts_per_s=m["rollouts"] / dt, wall_s=dt, rollouts=m["rollouts"],
                             infra_failures=m["infra_failures"], tool_wait_s=m["tool_wait_s"],
                             score_time_s=m["score_time_s"], turns=m.get("turns", 0.0),
                             tool_calls=m.get("tool_calls", 0.0),
                             policy_tokens=m.get("tokens_per_rollout", 0.0), compilations=compiles[concurrent])
        same = all([g.tokens for g in a.generations] == [g.tokens for g in b.generations]
                   for ga, gb in zip(best[False][1], best[True][1]) for a, b in zip(ga, gb))
        out["ratio"] = out["concurrent"]["rollouts_per_s"] / out["group_by_group"]["rollouts_per_s"]
        out["same_tokens"] = same
    finally:
        for actor in actors.values():
            actor.close()
        engine.close()
    if verbose:
        print(f"rollouts: B={tasks} toy tasks x G={group}, max_turn_tokens {max_turn_tokens}, max_turns "
              f"{max_turns}, tools {tuple(c.rl.tools)}; quickstart model (random), float32, "
              f"{jax.device_count()} {jax.default_backend()} device(s), {os.cpu_count()} CPU(s)")
        for name in ("group_by_group", "concurrent"):
            r = out[name]
            print(f"  {name:15s} {r['rollouts_per_s']:7.2f} rollouts/s  ({r['rollouts']} in {r['wall_s']:.1f} s; "
                  f"per rollout: env tools {r['tool_wait_s']:.2f} s, scoring {r['score_time_s']:.2f} s, "
                  f"{r['turns']:.1f} turns, {r['tool_calls']:.1f} calls, {r['policy_tokens']:.0f} policy "
                  f"tokens; infra failures {r['infra_failures']}; compilations while timed {r['compilations']})")
        print(f"  ratio concurrent / group by group: {out['ratio']:.2f}x; same tokens in both modes: "
              f"{out['same_tokens']}")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--max_turn_tokens", type=int, default=32)
    ap.add_argument("--max_turns", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    return compare(args.tasks, args.group, args.max_turn_tokens, args.max_turns, args.repeats, args.seed)


if __name__ == "__main__":
    main()
