"""The recipe's RL engine with one config key varied, compiled for its actor slice:

    JAX_PLATFORMS=cpu python docs/scale/engine_variants.py [--recipe composer_k2]
        [--key rl.engine_quantization] [--values=,int8,int4_experts] [--name engine_quantization]
        [--context_budget 0] [--slots 0]

e.g. the engine's quantizations (`--key rl.engine_quantization --values=,int8_experts,int4_experts,int8`:
"" = the bf16 engine the recipe runs now) or its attention (`--key model.attention_backend
--values dense,nsa --name engine_nsa`). For each value the grpo stage's config
(coder.stages.stage_config) with the key set to it, its engine's decode program at
rl.engine_slots rows over a full rl.context_budget cache (coder.stages.plan.compile_engine_at,
the plan's own call, on the mesh coder.stages.plan.engine_layout builds) compiled by XLA:TPU
over compile-only devices; writes docs/scale/{recipe}/{name}.{json,md}: XLA's GiB
per chip, the weights' share of it, the serial roofline step time and decode tokens/s a slice
(rows x the expected tokens a step at acceptance 0.7, as the plan counts them), beside the
weights per chip by arithmetic (coder.rl.actor.engine_memory); in the json also the HBM bytes a
step and the JAX ops that move most of them (hlo_stats.traffic_by_source).
"""
import argparse
import copy
import importlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from coder import stages  # noqa: E402
from coder.model import sharding  # noqa: E402
from coder.rl import actor as actor_lib  # noqa: E402
from coder.stages import plan  # noqa: E402
from coder.train.aot import hardware  # noqa: E402

GIB = 2 ** 30


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="composer_k2")
    ap.add_argument("--key", default="rl.engine_quantization", help="the dotted config key varied")
    ap.add_argument("--values", default=",int8,int4_experts", help="comma-separated; strings, or ints where "
                    "the key holds an int")
    ap.add_argument("--name", default="engine_quantization", help="the report's file stem")
    ap.add_argument("--context_budget", type=int, default=0, help="0: the recipe's")
    ap.add_argument("--slots", type=int, default=0, help="0: the recipe's rl.engine_slots")
    args = ap.parse_args(argv)
    config = stages.stage_config("grpo", copy.deepcopy(importlib.import_module(f"configs.{args.recipe}").get_config()))
    if args.context_budget:
        config.rl.context_budget = args.context_budget
    topo = hardware.parse_topology(config.compile.topology, int(config.mesh.num_slices))
    mesh = sharding.make_mesh(config.mesh, hardware.topology_devices(topo))
    emesh, etopo = plan.engine_layout(config, mesh, topo)
    slots = args.slots or actor_lib.engine_slots(config)
    k = int(config.rl.speculative_k)
    tokens_a_step = sum(0.7 ** i for i in range(k + 1))  # the plan's expected tokens a row a step
    rows = []
    with hardware.without_persistent_cache():
        for value in args.values.split(","):
            c = copy.deepcopy(config)
            section, _, leaf = args.key.rpartition(".")
            holder = c
            for part in section.split(".") if section else ():
                holder = holder[part]
            if leaf not in holder:
                raise SystemExit(f"--key {args.key}: no such config key")
            holder[leaf] = type(holder[leaf])(value) if not isinstance(holder[leaf], str) else value
            t0 = time.perf_counter()
            entry = plan.compile_engine_at(c, emesh, etopo, slots, programs=("decode",))
            decode = entry.get("decode") or {}
            mem = decode.get("memory") or {}
            roof = decode.get("roofline") or {}
            step, cost = roof.get("step_time_serial_s"), decode.get("cost") or {}
            error = decode.get("error") or entry.get("error") or ""
            rows.append(dict(
                value=value or "(none)", status=decode.get("status", entry.get("status")),
                gib_per_chip=mem.get("total_bytes", 0) / GIB, params_gib=mem.get("params_bytes", 0) / GIB,
                hbm_gib=mem.get("hbm_bytes", 0) / GIB, hbm_bytes_a_step=cost.get("bytes_accessed"),
                flops_a_step=cost.get("flops"), top_traffic=cost.get("top_traffic"),
                weights_gib_arithmetic=actor_lib.engine_memory(c, dict(emesh.shape)).weights / GIB,
                step_ms_serial=1e3 * step if step else None,
                tokens_per_s=slots * tokens_a_step / step if step else None,
                compile_s=round(time.perf_counter() - t0, 1), error=error[:300]))
            print(json.dumps(rows[-1]), flush=True)
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), args.recipe)
    os.makedirs(out, exist_ok=True)
    head = dict(commit=plan._commit(), recipe=args.recipe, key=args.key, topology=etopo.name,
                layout=dict(emesh.shape), rows=slots,
                context_budget=int(config.rl.context_budget), speculative_k=k, how=" ".join(sys.argv))
    with open(os.path.join(out, f"{args.name}.json"), "w") as f:
        json.dump(dict(head, values=rows), f, indent=1)
    lines = [f"{args.recipe}'s RL engine decode, {slots} rows x {config.rl.context_budget} cache tokens, k = {k}, "
             f"on {etopo.name} {dict(emesh.shape)} (commit {head['commit']}):", "",
             f"| {args.key} | GiB / chip (XLA) | of it weights | weights by arithmetic | "
             "decode step ms (serial) | tokens/s a slice | status |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        ms = f"{r['step_ms_serial']:.1f}" if r["step_ms_serial"] else "-"
        tps = f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "-"
        lines.append(f"| {r['value']} | {r['gib_per_chip']:.1f} of {r['hbm_gib']:.1f} | {r['params_gib']:.1f} | "
                     f"{r['weights_gib_arithmetic']:.1f} | {ms} | {tps} | {r['status']} |")
    with open(os.path.join(out, f"{args.name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
