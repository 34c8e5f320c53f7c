"""`--config.plan=True`: the config's whole chain compiled, not run, with the run's time and cost.

    python main.py --config=configs/composer_k2.py --config.plan=True --config.workdir=W

For every stage of `config.stages`, on the config that stage runs with (coder.stages.stage_config:
its overrides and derive, the architecture carried from stage to stage as a run carries it),
every program the runtime runs there is lowered over compile-only TPU devices (libtpu) in the
layout the runtime builds and compiled by XLA:TPU (coder.stages.compile does the lowering and
the analysis of one program):

  pretrain, longctx, sft   the trainer's step (`train_step`) at the stage's rows x seq_len;
  mtp                      the distillation step (`mtp_step`: trunk frozen, MTP modules trained);
  grpo                     the GRPO learner's step (`grpo_step`) at compile.grpo_batch rows of
                           rl.context_budget tokens (the longest row a generation fills), and
                           the rollout engine's prefill, one decode step and the slot copy
                           that shares a group's prompt with its rl.group_size rows
                           (`engine_prefill`, `engine_decode`, `engine_copy`) at its real slot
                           count (rl.engine_slots) over a full
                           cache of rl.context_budget tokens, with rl.speculative_k MTP drafts,
                           on the actor's own slice (compile.engine_topology, whose hosts must
                           be rl.topology.actor_processes) or, colocated, on the learner's chips
                           (coder.rl.actor.engine_mesh / engine_rules, as the actors build it);
                           then `engine_slots_fit`: the largest slot count whose decode program
                           fits, found by compiling (`largest_fitting_slots`);
  eval                     the agent eval's engine (the grpo stage's programs when it has the
                           same engine; else compiled).

The learner's stages run on `compile.topology` x `mesh.num_slices` (the pod the launcher
starts). Each program records XLA's own memory per chip (fits or does_not_fit), FLOPs, bytes,
collectives and the serial / perfect-overlap roofline step time (coder.train.aot.hardware).

From them, per stage: chips, step seconds (serial bound; the overlap bound beside it),
tokens/s, steps, wall-clock hours and chip-hours. For GRPO (`grpo_plan`): decode tokens/s per
actor slice, the learner's tokens/s, how many actor slices keep the learner fed, the oldest
token's staleness against grpo.max_staleness, the weight sync per version (anchor and delta) per
host against the learner's step, and the env workers. Written as {workdir}/plan/plan.json and
plan.md (schema: docs/scale/README.md, "Plans").

Assumptions the numbers rest on (each in plan.json's `assumptions`): decode steps are costed at
a full cache (every row attends to rl.context_budget tokens: an upper bound); a rollout holds
compile.rollout_tokens tokens (prompt, tool outputs and policy; 0 = rl.context_budget) of which
rl.max_rollout_tokens at most are sampled; a drafted token is accepted with probability
compile.draft_acceptance per depth; a delta version is DELTA_FRACTION of an anchor's bytes.
"""
from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
import os
import subprocess
import sys
import time

from coder import stages
from coder.model import count_params, sharding
from coder.rl.actor import engine_rules, serving_dtype
from coder.stages import compile as compile_stage
from coder.train.aot import hardware

# The largest bytes-per-version / full-bf16 ratio docs/rl.md (section 8, bench/weight_sync.py)
# measured for an XOR delta at an RL learning rate of 1e-6 (1.8-3.7% over the first steps): the
# store's delta versions are costed at this fraction of an anchor.
DELTA_FRACTION = 0.037

TRAIN_STAGES = ("pretrain", "longctx", "sft")


def _compile_now(program: str, compile_fn):
    """`run` of plan_stage without a store: compile `program` now."""
    return compile_fn()


def _gib(x: float) -> float:
    return round(x / 2**30, 2)


def _program(name: str, entry: dict) -> dict:
    """One program's row of the plan from a compile-stage entry (compile.analyse + status)."""
    mem = entry.get("memory") or {}
    over = entry.get("memory_overflow") or {}
    roof = entry.get("roofline") or {}
    return dict(
        name=name, status=entry.get("status", "compile_error"),
        gib_per_chip=_gib(mem.get("total_bytes", over.get("used_bytes", 0.0))),
        hbm_gib=_gib(mem.get("hbm_bytes", over.get("hbm_bytes", 0.0))),
        step_s_serial=roof.get("step_time_serial_s"), step_s_overlap=roof.get("step_time_lower_s"),
        bound=roof.get("bound"), mfu_lower=roof.get("mfu_lower"), mfu_upper=roof.get("mfu_upper"),
        flops_per_chip=(entry.get("cost") or {}).get("flops"),
        bytes_per_chip=(entry.get("cost") or {}).get("bytes_accessed"),
        collective_bytes_per_chip={k: v.get("wire_bytes") for k, v in (entry.get("collectives") or {}).items()
                                   if isinstance(v, dict)},
        compile_s=round(entry.get("compile_seconds", 0.0), 1),
        **({"error": entry["error"][:400]} if entry.get("error") else {}),
    )


def _compile_step(name: str, lower, config, mesh, topo, model_flops: float, rows_per_micro: int, seq: int) -> dict:
    """Lower + compile + analyse one training-like step; a failure is recorded, not raised."""

    t0 = time.perf_counter()
    try:
        lowered, sizes = lower(config, mesh)
        compiled = lowered.compile()
    except Exception as e:  # noqa: BLE001 (the plan reports a program that does not compile)
        logging.error("plan: %s failed to compile: %s", name, " ".join(str(e).split())[:500])
        entry = compile_stage._failure(e)
    else:
        entry = compile_stage.analyse(compiled, topo, params=sizes["params"], optimizer=sizes["optimizer"],
                                      batch=sizes["batch"], model_flops=model_flops,
                                      gmm_scale=compile_stage.gmm_scale(config, mesh, rows_per_micro, seq))
        entry["status"] = "fits" if entry["memory"]["fits"] else "does_not_fit"
    entry["compile_seconds"] = time.perf_counter() - t0
    logging.info("plan: %s: %s, compiled in %.0f s", name, entry.get("status"), entry["compile_seconds"])
    return entry


def _engine_config(config, slots: int):
    """`config` with the compile stage's engine shape set to what coder.rl.actor.make_engine builds:
    `slots` rows, a cache of rl.context_budget tokens, compile.engine_prefill_len tokens a chunk."""
    c = copy.deepcopy(config)
    c.compile.engine_batch = int(slots)
    c.compile.engine_max_len = int(c.rl.context_budget)
    return c


def engine_slots(config) -> int:
    """The engine's slot count as coder.rl.actor.make_engine sets it."""
    rl = config.rl
    return int(rl.engine_slots) or max(int(rl.tasks_per_step) * int(rl.group_size), int(rl.eval_samples))


def engine_layout(config, learner_mesh, learner_topo):
    """(mesh, topology) of the rollout engine as the runtime builds it, after checking that the
    configured actor slice is the one the run starts: ValueError naming the keys otherwise."""

    t, cc = config.rl.topology, config.compile
    if t.colocated or int(t.actors) == 0:
        if cc.engine_topology:
            raise ValueError(f"compile.engine_topology={cc.engine_topology!r}, but the engine runs in the learner's "
                             f"process (rl.topology.actors=0{', rl.topology.colocated=True' if t.colocated else ''}): "
                             "leave compile.engine_topology empty or set rl.topology.actors")
        return compile_stage.engine_target(config, learner_mesh, learner_topo)
    if not cc.engine_topology:
        raise ValueError(f"rl.topology.actors={t.actors} actors run on slices of their own: set "
                         "compile.engine_topology to an actor's slice (e.g. 'v5p-256') so the plan compiles "
                         "the engine there")
    etopo = hardware.parse_topology(cc.engine_topology, 1)
    hosts = max(1, etopo.num_chips // math.prod(etopo.chips_per_host_bounds))
    if hosts != int(t.actor_processes):
        raise ValueError(f"compile.engine_topology={cc.engine_topology!r} has {hosts} hosts but an actor is "
                         f"rl.topology.actor_processes={t.actor_processes} processes (one per host): make them agree")
    return compile_stage.engine_target(config, learner_mesh, learner_topo)


def compile_engine_at(config, mesh, topo, slots: int, programs=("prefill", "decode", "copy")) -> dict:
    """The engine's `programs` compiled at `slots` rows (compile.compile_engine's record; a
    program left out is not compiled)."""

    return compile_stage.compile_engine(_engine_config(config, slots), mesh, topo, programs=tuple(programs))


def _decode_bytes(entry: dict) -> tuple[bool, float] | None:
    """(fits, bytes per chip) of a decode entry; None when it failed for another reason."""
    d = entry.get("decode") or {}
    if d.get("memory"):
        return bool(d["memory"]["fits"]), float(d["memory"]["total_bytes"])
    if d.get("memory_overflow"):
        return False, float(d["memory_overflow"]["used_bytes"])
    return None


def largest_fitting_slots(config, mesh, topo, first: dict, slots: int, *, max_compiles: int = 4,
                          max_factor: int = 8, run=_compile_now) -> dict:
    """The largest engine slot count whose decode program fits the actor's chips, by compiling.

    Rows split over the engine's batch mesh axes only when they divide them (compile.lower_engine),
    so candidates are multiples of that count `g`. From the configured `slots` (`first`: its
    compiled record) and a second compile at half of it, the bytes per row give a first guess;
    then compiles walk up or down by `g` until a count fits and the next does not (at most
    `max_compiles` compiles; `bounded_by_compiles` says when the walk stopped short). The search
    stops at `max_factor` x `slots` (`capped`: that many fit, more were not tried: a small model
    on a large slice fits tens of thousands of rows, and compiling those shapes is slow).
    Returns {"slots", "fits_at", "does_not_fit_at", "compiles": [(slots, fits, GiB)], ...}.
    """

    axes = sharding.mesh_axes_of("batch", engine_rules(config))
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    g = math.prod(int(mesh.shape[a]) for a in axes) or 1
    tried: dict[int, tuple[bool, float]] = {}
    hbm = float(topo.chip.hbm_bytes)

    def probe(n: int):
        if n not in tried:
            res = _decode_bytes(run(f"engine_decode_at_{n}_slots",
                                    lambda: compile_engine_at(config, mesh, topo, n, programs=("decode",))))
            tried[n] = res if res is not None else (False, float("nan"))
            logging.info("plan: engine decode at %d slots: %s (%.1f GiB)", n,
                         "fits" if tried[n][0] else "does not fit", tried[n][1] / 2**30)
        return tried[n]

    base = _decode_bytes(first)
    if base is None:
        return dict(slots=None, error="the decode program did not compile at the configured slots")
    tried[slots] = base
    half = max(g, (slots // 2) // g * g)
    if half != slots:
        probe(half)
    pts = sorted((n, b) for n, (f, b) in tried.items() if math.isfinite(b))
    per_row = (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0]) if len(pts) > 1 and pts[-1][0] > pts[0][0] else 0
    if per_row > 0:
        guess = pts[-1][0] + int((hbm - pts[-1][1]) // per_row)
    else:
        guess = slots * 2
    cap = max(g, slots * max_factor // g * g)
    guess = min(cap, max(g, guess // g * g))
    n = guess
    budget = max_compiles - len(tried) + 1
    capped = False
    while budget > 0:
        fits, _ = probe(n)
        budget -= 1
        if fits:
            nxt = n + g
            if n >= cap:
                capped = True
                break
            if nxt in tried and not tried[nxt][0]:
                break
            n = nxt
        else:
            prev = n - g
            if prev < g or (prev in tried and tried[prev][0]):
                break
            n = prev
    fitting = [k for k, (f, _) in tried.items() if f]
    best = max(fitting) if fitting else 0
    closed = best and (best + g) in tried and not tried[best + g][0]
    return dict(slots=best, granularity=g, fits_at=best or None,
                does_not_fit_at=(best + g) if closed else None, capped=capped,
                bounded_by_compiles=not closed and not capped,
                bytes_per_row=per_row,
                compiles=[dict(slots=k, fits=f, gib_per_chip=_gib(b)) for k, (f, b) in sorted(tried.items())])


def expected_tokens_per_step(k: int, acceptance: float) -> float:
    """Tokens a row emits per decode step with `k` MTP drafts each accepted with probability
    `acceptance` given the previous one was: 1 + a + a^2 + ... + a^k (the verified token always)."""
    return sum(acceptance ** i for i in range(k + 1))


def grpo_plan(config, learner: dict, engine: dict, slots_fit: dict, learner_topo) -> dict:
    """The GRPO stage's throughput balance from its compiled programs (module docstring)."""

    rl, g, cc = config.rl, config.grpo, config.compile
    step_s = learner["step_s_serial"]
    rows, seq = learner["rows"], learner["seq_len"]
    k = int(rl.speculative_k)
    accept = float(cc.draft_acceptance)
    per_step = expected_tokens_per_step(k, accept)
    slots = engine["setup"]["rows"]
    dec, pre = engine.get("decode") or {}, engine.get("prefill") or {}
    dec_s = (dec.get("roofline") or {}).get("step_time_serial_s")
    pre_s = (pre.get("roofline") or {}).get("step_time_serial_s")
    rollouts = int(rl.tasks_per_step) * int(rl.group_size)
    context = int(cc.rollout_tokens) or int(rl.context_budget)
    policy = min(int(rl.max_rollout_tokens), context)
    out = dict(learner_step_s=step_s, learner_step_s_overlap=learner["step_s_overlap"],
               learner_tokens_per_s=rows * seq / step_s if step_s else None,
               rollouts_per_step=rollouts, rollout_tokens=context, rollout_policy_tokens=policy,
               engine_slots=slots, speculative_k=k, draft_acceptance=accept,
               tokens_per_decode_step_per_row=per_step, engine_slots_fit=slots_fit.get("slots"),
               engine_slots_search=slots_fit)
    if not (dec_s and pre_s and step_s):
        out["error"] = "a program did not compile: no throughput balance"
        return out
    decode_tps = slots * per_step / dec_s
    prefill_tps = slots * engine["setup"]["prefill_len"] / pre_s
    # one slice producing a learner step's rollouts: every row decodes its policy tokens and
    # prefills the rest of its context (prompt, tool outputs), decode and prefill in turns
    batch_s = rollouts * (policy / decode_tps + (context - policy) / prefill_tps)
    latency = policy / per_step * dec_s + (context - policy) / max(prefill_tps / slots, 1e-9)
    actors = int(rl.topology.actors) or 1
    overlapped = bool(rl.topology.asynchronous)  # else lockstep: the learner waits for the step's rollouts
    # async: enough slices that a learner step's rollouts arrive within its step; a token is as
    # many versions stale as learner steps passed since its row started (in-flight updates)
    needed = math.ceil(batch_s / step_s) if overlapped else actors
    oldest = math.ceil(latency / step_s) if overlapped else 0
    # weights: each learner host writes the serving bytes its chips own; each actor host reads
    # its chips' slices (compile_engine's record), both at the host's network bandwidth
    serving_bytes = count_params(config.model)["total"] * serving_dtype(config).itemsize
    per_host = min(math.prod(learner_topo.chips_per_host_bounds), learner_topo.num_chips)
    lhosts = max(1, learner_topo.num_chips // per_host)
    host_bw = learner_topo.chip.dcn_bandwidth * per_host
    write_anchor = serving_bytes / lhosts / host_bw
    colocated = engine.get("weights_from") == "on_device"
    read_anchor = 0.0 if colocated else float(engine.get("store_read_seconds_per_host", 0.0))
    anchor = max(write_anchor, read_anchor)
    every = int(rl.anchor_every)
    delta = anchor * DELTA_FRACTION
    out.update(
        decode_tokens_per_s_per_slice=decode_tps, decode_step_s=dec_s,
        decode_step_s_overlap=(dec.get("roofline") or {}).get("step_time_lower_s"),
        prefill_tokens_per_s_per_slice=prefill_tps, rollout_batch_s_per_slice=batch_s,
        actor_slices_per_learner=needed, actor_slices_configured=actors,
        rollout_latency_s=latency, oldest_token_staleness=oldest, max_staleness=int(g.max_staleness),
        staleness_ok=bool(oldest <= int(g.max_staleness)),
        sync_s_per_version=dict(anchor=anchor, delta=delta, mean=(anchor + (every - 1) * delta) / every,
                                learner_write_anchor_per_host=write_anchor, actor_read_anchor_per_host=read_anchor,
                                host_network_bytes_per_s=host_bw, delta_fraction=DELTA_FRACTION,
                                anchor_every=every, on_device=colocated),
        env_workers_per_actor=int(rl.env_workers),
        env_cpus_per_actor=int(rl.env_workers) * float(config.env.ray_num_cpus_per_worker),
        # async: the learner waits for rollouts when the configured actors produce fewer than it
        # trains; lockstep: rollouts, then the step
        step_s=max(step_s, batch_s / actors) if overlapped else step_s + batch_s / actors,
        overlapped=overlapped,
    )
    return out


def _stage_row(name: str, config, chips: int, programs: list[dict], step_s: float | None,
               step_s_overlap: float | None, tokens_per_step: float) -> dict:
    steps = int(config.train.steps)
    hours = steps * step_s / 3600 if step_s else None
    return dict(stage=name, chips=chips, step_s=step_s, step_s_overlap=step_s_overlap,
                tokens_per_step=tokens_per_step,
                tokens_per_s=tokens_per_step / step_s if step_s else None, steps=steps, hours=hours,
                chip_hours=chips * hours if hours is not None else None,
                fits=all(p["status"] == "fits" for p in programs), programs=programs)


def plan_stage(name: str, config, mesh, topo, engine_cache: dict, run=_compile_now) -> tuple[dict, dict | None]:
    """Compile stage `name`'s programs on `config` (the stage's own); returns (row, grpo part).
    `run(program, compile_fn)` compiles one program (ProgramStore.run: kept on disk as it ends)."""

    chips = topo.num_chips
    b, t, accum = int(config.data.batch_size), int(config.data.seq_len), int(config.train.grad_accum)
    if name in TRAIN_STAGES or name == "mtp":
        if name == "mtp":
            entry = run("mtp_step", lambda: _compile_step(
                "mtp_step", compile_stage.lower_mtp_step, config, mesh, topo,
                compile_stage.mtp_model_flops(config.model, b, t), b // accum, t))
        else:
            entry = run("train_step", lambda: _compile_step(
                "train_step", compile_stage.lower_train_step, config, mesh, topo,
                compile_stage.model_flops_per_step(config.model, b, t), b // accum, t))
        prog = _program("mtp_step" if name == "mtp" else "train_step", entry)
        prog.update(rows=b, seq_len=t, grad_accum=accum, remat=config.model.remat)
        return _stage_row(name, config, chips, [prog], prog["step_s_serial"], prog["step_s_overlap"], b * t), None
    if name in ("grpo", "eval"):
        emesh, etopo = engine_layout(config, mesh, topo)
        slots = engine_slots(config)
        key = (slots, int(config.rl.context_budget), int(config.rl.speculative_k), etopo.name,
               config.rl.engine_dtype, config.rl.engine_quantization, config.rl.engine_attention)
        engine = engine_cache.get(key)
        if engine is None:
            engine = run(f"engine_at_{slots}_slots", lambda: compile_engine_at(config, emesh, etopo, slots))
            engine_cache[key] = engine
        eprogs = []
        for p in ("prefill", "decode", "copy"):
            row = _program(f"engine_{p}", engine.get(p) or {"status": engine.get("status", "compile_error"),
                                                        "error": engine.get("error", "")})
            row.update(topology=etopo.name, chips=etopo.num_chips, rows=slots,
                       cache_tokens=int(config.rl.context_budget), speculative_k=int(config.rl.speculative_k))
            if p == "decode" and row["step_s_serial"]:
                row["ms_per_step"] = 1e3 * row["step_s_serial"]
            eprogs.append(row)
        if name == "eval":
            return _stage_row(name, config, etopo.num_chips, eprogs, None, None, 0), None
        rows, seq = compile_stage.grpo_shape(config)
        entry = run("grpo_step", lambda: compile_stage.compile_grpo(config, mesh, topo))
        gprog = _program("grpo_step", entry)
        gprog.update(rows=rows, seq_len=seq, grad_accum=accum, remat=config.model.remat)
        fit = largest_fitting_slots(config, emesh, etopo, engine, slots, run=run) if engine.get("decode") else {}
        gprog_plan = dict(gprog, rows=rows, seq_len=seq)
        part = grpo_plan(config, gprog_plan, engine, fit, topo)
        actors = 0 if config.rl.topology.colocated else int(config.rl.topology.actors)  # actor slices of their own
        row = _stage_row(name, config, chips + actors * etopo.num_chips, [gprog, *eprogs],
                         part.get("step_s"), gprog["step_s_overlap"], rows * seq)
        return row, part
    raise ValueError(f"plan: stage {name!r} has no programs to plan (the chain's stages: "
                     f"{', '.join(TRAIN_STAGES + ('mtp', 'grpo', 'eval'))})")


def run(config) -> dict:
    """Plan `config`'s chain (module docstring); writes {workdir}/plan/plan.{json,md}, returns the plan."""

    with hardware.without_persistent_cache():
        return _run(config)


def _run(config) -> dict:
    names = [n for n in stages.stage_names(config) if n not in stages.SERVICES and n != "compile"]
    topo = hardware.parse_topology(config.compile.topology, int(config.mesh.num_slices))
    devices = hardware.topology_devices(topo)
    chained = copy.deepcopy(config)
    commit = _commit()  # the code this plan compiles (read first: a long plan outlives commits)
    t0 = time.perf_counter()
    rows, grpo, engine_cache = [], None, {}
    out_dir = os.path.join(config.workdir, "plan")
    for name in names:
        c = stages.stage_config(name, chained)
        logging.info("plan: stage %s (grad_accum %d, remat %s) on %s", name, int(c.train.grad_accum),
                     c.model.remat, topo.name)
        stages.check_batch(c, len(devices), name)
        sharding.validate(c.model, c.mesh, len(devices))
        key = stage_key(name, c, topo.name, commit)
        done = read_stage(out_dir, name, key)
        if done is not None:  # planned by an earlier run of this config at this commit
            row, part = done["row"], done["grpo"]
            logging.info("plan: stage %s as planned before (%s)", name, stage_path(out_dir, name))
        else:
            mesh = sharding.make_mesh(c.mesh, devices)
            t1 = time.perf_counter()
            row, part = plan_stage(name, c, mesh, topo, engine_cache, ProgramStore(out_dir, name, key).run)
            row["plan_s"] = round(time.perf_counter() - t1, 1)
            write_stage(out_dir, name, key, row, part)
        rows.append(row)
        if part is not None:
            grpo = part
        logging.info("plan: %s: %s, step %s s, %s h (%.0f s of compiles)", name,
                     "fits" if row["fits"] else "DOES NOT FIT", _fmt(row["step_s"]), _fmt(row["hours"]), row["plan_s"])
        for key in stages.INHERITED_MODEL_KEYS:  # what the next stage takes from this one's checkpoint
            chained.model[key] = copy.deepcopy(c.model[key])
        # every finished stage is on disk: an interrupted plan keeps what it compiled
        plan = _plan(config, topo, rows, grpo, commit, t0, complete=name == names[-1])
        write(plan, out_dir)
    print(to_markdown(plan), flush=True)
    return plan


def _plan(config, topo, rows: list, grpo, commit: str, t0: float, *, complete: bool) -> dict:
    return dict(
        config=_config_name(), topology=hardware.describe(topo), stages=rows, grpo=grpo,
        total_hours=sum(r["hours"] or 0.0 for r in rows),
        total_chip_hours=sum(r["chip_hours"] or 0.0 for r in rows),
        fits=all(r["fits"] for r in rows), complete=complete,
        plan_seconds=round(time.perf_counter() - t0, 1), commit=commit,
        assumptions=dict(
            decode="each decode step costed at a full cache of rl.context_budget tokens per row",
            rollout_tokens="compile.rollout_tokens (0 = rl.context_budget) per rollout, of which "
                           "min(rl.max_rollout_tokens, that) are sampled",
            draft_acceptance="compile.draft_acceptance per draft depth",
            delta_fraction=f"a delta version is {DELTA_FRACTION} of an anchor (docs/rl.md section 8)",
            step_s="the serial roofline bound (compute + HBM + ICI + DCN, no overlap); step_s_overlap the "
                   "perfect-overlap bound",
        ),
    )


# The config sections a stage's programs and figures read (its own section's keys reach train /
# data through the stage's overrides): a change elsewhere does not plan the stage again.
KEY_SECTIONS = ("model", "mesh", "data", "train", "compile")
STAGE_SECTIONS = {"mtp": ("mtp",), "grpo": ("rl", "grpo", "env"), "eval": ("rl",)}


def stage_key(name: str, config, topology: str, commit: str) -> str:
    """What stage `name`'s plan depends on: its config's KEY_SECTIONS (+ STAGE_SECTIONS), the
    target and the code's commit (changes to coder/ or configs/ not committed give no key: such
    a plan is never reused)."""

    if not commit or _dirty():
        return ""
    parts = {k: config[k].to_dict() for k in KEY_SECTIONS + STAGE_SECTIONS.get(name, ())}
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(f"{name}|{text}|{topology}|{commit}".encode()).hexdigest()


def stage_path(out_dir: str, name: str) -> str:
    return os.path.join(out_dir, "stages", f"{name}.json")


def read_stage(out_dir: str, name: str, key: str) -> dict | None:
    """A stage planned before under the same `key` ({"row", "grpo"}), else None."""
    from etils import epath

    path = epath.Path(stage_path(out_dir, name))
    if not key or not path.exists():
        return None
    saved = json.loads(path.read_text())
    return saved if saved.get("key") == key else None


def write_stage(out_dir: str, name: str, key: str, row: dict, grpo: dict | None) -> None:
    from etils import epath

    path = epath.Path(stage_path(out_dir, name))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(key=key, row=row, grpo=grpo), indent=1, default=str))


class ProgramStore:
    """A stage's compiled programs on disk as each finishes (`W/plan/stages/NAME.programs.json`,
    under the stage's key): a plan interrupted inside a long stage (GRPO's learner step, engine
    and slot search are ~1-2 h of compiles on a small CPU) recompiles only the programs it had
    not finished. An empty key (uncommitted code) reuses nothing."""

    def __init__(self, out_dir: str, name: str, key: str):
        from etils import epath

        self.path = epath.Path(out_dir) / "stages" / f"{name}.programs.json"
        self.key = key
        saved = json.loads(self.path.read_text()) if key and self.path.exists() else {}
        self.entries = saved.get("programs", {}) if saved.get("key") == key else {}

    def run(self, program: str, compile_fn):
        """`compile_fn()`'s record for `program`, from disk when this key compiled it before."""
        if program in self.entries:
            logging.info("plan: %s as compiled before (%s)", program, self.path)
            return self.entries[program]
        entry = compile_fn()
        self.entries[program] = json.loads(json.dumps(entry, default=str))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(dict(key=self.key, programs=self.entries), indent=1, default=str))
        return self.entries[program]


def _dirty() -> bool:
    try:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        return bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "coder", "configs"],
                                   capture_output=True, text=True, cwd=root, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return True


def _fmt(x) -> str:
    if x is None:
        return "-"
    return f"{x:.3g}"


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__)), timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _config_name() -> str:
    return " ".join(a for a in sys.argv[1:] if a.startswith("--config")) or "(from code)"


def write(plan: dict, out_dir: str) -> str:
    """plan.json + plan.md in `out_dir` (local or any etils path); returns plan.json's path."""
    from etils import epath

    d = epath.Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    (d / "plan.json").write_text(json.dumps(plan, indent=1, default=str))
    (d / "plan.md").write_text(to_markdown(plan))
    return str(d / "plan.json")


def to_markdown(plan: dict) -> str:
    """The plan as one page: the stage table, each program, the GRPO balance."""
    hw = plan["topology"]
    lines = [f"# Plan: {plan['config']}", "",
             f"Learner: {hw['name']} ({hw['chips']} chips); commit {plan.get('commit') or '?'}; "
             f"planned in {plan['plan_seconds']:.0f} s; every program "
             f"{'fits' if plan['fits'] else '**does not fit** (below)'}."
             + ("" if plan.get("complete", True) else " **Incomplete: the stages below were planned, not the rest.**"),
             "",
             "| stage | chips | rows x seq | step s (serial / overlap) | tokens/s | steps | hours | chip-hours "
             "| fits |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in plan["stages"]:
        p0 = r["programs"][0]
        shape = f"{p0.get('rows', '-')} x {p0.get('seq_len', p0.get('cache_tokens', '-'))}"
        lines.append(f"| {r['stage']} | {r['chips']} | {shape} | {_fmt(r['step_s'])} / {_fmt(r['step_s_overlap'])} | "
                     f"{_fmt(r['tokens_per_s'])} | {r['steps']} | {_fmt(r['hours'])} | {_fmt(r['chip_hours'])} | "
                     f"{'yes' if r['fits'] else '**no**'} |")
    lines += ["", f"Total: {_fmt(plan['total_hours'])} hours, {_fmt(plan['total_chip_hours'])} chip-hours.", "",
              "## Programs", "",
              "| stage | program | status | GiB per chip (of HBM) | step s serial / overlap | bound | MFU "
              "| compile s |",
              "|---|---|---|---|---|---|---|---|"]
    for r in plan["stages"]:
        for p in r["programs"]:
            mfu = f"{100 * p['mfu_lower']:.1f}-{100 * p['mfu_upper']:.1f}%" if p.get("mfu_lower") is not None else "-"
            lines.append(f"| {r['stage']} | {p['name']}{' on ' + p['topology'] if p.get('topology') else ''} | "
                         f"{p['status']} | {p['gib_per_chip']} ({p['hbm_gib']}) | {_fmt(p['step_s_serial'])} / "
                         f"{_fmt(p['step_s_overlap'])} | {p.get('bound') or '-'} | {mfu} | {p['compile_s']} |")
    g = plan.get("grpo")
    if g:
        lines += ["", "## GRPO", "", "| | value |", "|---|---|"]
        for key in ("learner_step_s", "learner_tokens_per_s", "rollouts_per_step", "rollout_tokens",
                    "rollout_policy_tokens", "engine_slots", "engine_slots_fit", "speculative_k",
                    "draft_acceptance", "tokens_per_decode_step_per_row", "decode_step_s",
                    "decode_tokens_per_s_per_slice", "prefill_tokens_per_s_per_slice",
                    "rollout_batch_s_per_slice", "actor_slices_per_learner", "actor_slices_configured",
                    "rollout_latency_s", "oldest_token_staleness", "max_staleness", "staleness_ok",
                    "env_workers_per_actor", "env_cpus_per_actor", "step_s", "error"):
            if key in g:
                v = g[key]
                lines.append(f"| {key} | {_fmt(v) if isinstance(v, float) else v} |")
        s = g.get("sync_s_per_version")
        if s:
            lines.append(f"| weight sync s per version (anchor / delta / mean) | {_fmt(s['anchor'])} / "
                         f"{_fmt(s['delta'])} / {_fmt(s['mean'])} (learner write "
                         f"{_fmt(s['learner_write_anchor_per_host'])}, "
                         f"actor read {_fmt(s['actor_read_anchor_per_host'])} s per host at "
                         f"{s['host_network_bytes_per_s'] / 1e9:.3g} GB/s) |")
        fit = g.get("engine_slots_search") or {}
        if fit.get("compiles"):
            lines.append("| slot search (slots: fits, GiB) | " + ", ".join(
                f"{c['slots']}: {'fits' if c['fits'] else 'no'} {c['gib_per_chip']}" for c in fit["compiles"]) + " |")
    lines += ["", "## Assumptions", ""] + [f"- {k}: {v}" for k, v in plan["assumptions"].items()]
    return "\n".join(lines) + "\n"
