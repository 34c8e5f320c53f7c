"""report.md of stage `compile` (coder.stages.compile): the report's dict rendered as markdown,
the training step's sections, then the RL engine's and the GRPO learner's."""
from __future__ import annotations


def _gib(x: float) -> str:
    return f"{x / 2**30:.3g}"


def _count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def to_markdown(r: dict) -> str:
    """The report as a page for docs/scale/ (every number comes from the JSON beside it)."""
    hw = r["hardware"]
    title = f"{_count(r['setup']['params_total'])}-parameter model"
    lines = [f"# {title} training step on {hw['name']} ({hw['chips']} chips)", ""]
    lines.append(f"Status: **{r['status']}**" + (f" — {r['error']}" if r.get("error") else ""))
    lines.append("")
    lines.append(f"Regenerate: `{r['command']}`")
    lines += ["", "## Setup", "", "| key | value |", "|---|---|"]
    for k, v in r["setup"].items():
        lines.append(f"| {k} | {v} |")
    if "memory_overflow" in r:
        o = r["memory_overflow"]
        lines += ["", "## Memory per chip", "",
                  f"XLA:TPU stopped compiling: the step needs {_gib(o['used_bytes'])} GiB of "
                  f"{_gib(o['hbm_bytes'])} GiB HBM ({100 * o['fraction_of_hbm']:.0f}%)."]
    if "memory" in r:
        m = r["memory"]
        lines += ["", "## Memory per chip (GiB)", "", "| part | GiB |", "|---|---|"]
        for key, label in [("params_bytes", "parameters"), ("optimizer_bytes", "optimizer state"),
                           ("batch_bytes", "batch"),
                           ("activations_temp_bytes", "activations / temporaries (XLA temp)"),
                           ("generated_code_bytes", "generated code"),
                           ("total_bytes", "**total**"), ("hbm_bytes", "HBM")]:
            lines.append(f"| {label} | {_gib(m[key])} |")
        host = sum(m["host_bytes"].values())
        lines.append(f"| host memory (offloaded) | {_gib(host)} |")
        lines += ["", f"{100 * m['fraction_of_hbm']:.1f}% of HBM: "
                  f"{'fits' if m['fits'] else 'does not fit'}."]
        c = r["cost"]
        lines += ["", "## Cost per chip per step", "", "| | value |", "|---|---|",
                  f"| FLOPs (loop-corrected) | {c['flops']:.4g} |",
                  f"| bytes accessed (loop-corrected) | {c['bytes_accessed']:.4g} |"]
        if c.get("source") != "hlo":  # XLA:GPU compiled without a GPU has no cost analysis
            lines += [f"| FLOPs (XLA cost_analysis, loop bodies once) | {c['xla_flops']:.4g} |",
                      f"| bytes accessed (XLA cost_analysis) | {c['xla_bytes_accessed']:.4g} |"]
        lines += ["", "## Collectives per step (per chip)", "",
                  "| kind | in HLO | executed | result GiB | wire GiB |", "|---|---|---|---|---|"]
        for k, v in r["collectives"].items():
            lines.append(f"| {k} | {v['count']} | {v['executed']:.0f} | {_gib(v['bytes'])} | "
                         f"{_gib(v['wire_bytes'])} |")
        f = r["roofline"]
        lines += ["", "## Roofline", "", "| | value |", "|---|---|"]
        for k in ("compute_s", "hbm_s", "ici_s", "dcn_s", "step_time_lower_s",
                  "step_time_serial_s"):
            lines.append(f"| {k} | {f[k]:.4g} |")
        lines += [f"| bound | {f['bound']} |", f"| model FLOPs per step | {f['model_flops']:.4g} |",
                  f"| MFU (perfect overlap) | {100 * f['mfu_upper']:.1f}% |",
                  f"| MFU (no overlap) | {100 * f['mfu_lower']:.1f}% |",
                  f"| compiled FLOPs / model FLOPs | {f['hlo_to_model_flops']:.2f} |"]
        if c.get("top_traffic"):
            lines += ["", "## HBM traffic by source op (XLA-visible, per chip per step)", "",
                      "| source op | GiB | share of bytes accessed |", "|---|---|---|"]
            lines += [f"| `{src}` | {_gib(b)} | {100 * b / c['bytes_accessed']:.1f}% |"
                      for src, b in c["top_traffic"]]
    if r.get("engine"):
        lines += engine_markdown(r["engine"])
    if r.get("grpo"):
        lines += grpo_markdown(r["grpo"])
    if r.get("colocated"):
        lines += colocated_markdown(r["colocated"])
    if r.get("advice"):
        lines += ["", "## What would make it fit / run faster", ""]
        lines += [f"- {a}" for a in r["advice"]]
    chip = hw["chip"]
    if "nvlink_bandwidth" in chip:  # a GPU target (coder.train.aot.hardware.GpuChip)
        lines += gpu_markdown(r)
        return "\n".join(lines)
    lines += ["", "## Hardware figures used", "",
              f"{chip['name']}: {chip['peak_bf16_flops']:.3g} bf16 FLOP/s, "
              f"{_gib(chip['hbm_bytes'])} GiB HBM at {chip['hbm_bandwidth']:.3g} B/s, ICI "
              f"{chip['ici_bandwidth']:.3g} B/s, DCN {chip['dcn_bandwidth']:.3g} B/s per chip"
              + (f" (assumed: {', '.join(chip['assumed'])})" if chip["assumed"] else "")
              + "; sources in coder/train/aot/hardware.py.", ""]
    return "\n".join(lines)


def gpu_markdown(r: dict) -> list[str]:
    """A GPU target's closing sections: the kernels, the roofline at measured rates, the figures."""
    hw, chip = r["hardware"], r["hardware"]["chip"]
    lines = []
    c = r.get("cost") or {}
    if c.get("source") == "hlo":
        lines += ["", "## FLOPs by source (per GPU per step)", "", "XLA:GPU compiled without a GPU gives no cost "
                  "analysis: FLOPs and bytes are counted off the optimized HLO (coder/train/aot/gpu_stats.py).", "",
                  "| part | FLOPs |", "|---|---|", f"| XLA matmuls | {c['matmul_flops']:.4g} |"]
        lines += [f"| kernel `{k}` | {f:.4g} |" for k, f in c["kernel_flops"].items()]
        if c["uncounted_kernels"]:
            calls = ", ".join(f"`{k}` x{n:.0f}" for k, n in c["uncounted_kernels"].items())
            lines += ["", f"Kernels not counted (calls per step): {calls}"]
    if r.get("roofline_measured"):
        f = r["roofline_measured"]
        kernels = ", ".join(f"`{k}` {v / 1e12:.1f} TFLOP/s" for k, v in f["kernel_flops_per_s"].items())
        lines += ["", "## Roofline at measured rates", "",
                  f"Matmuls at {f['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s, HBM at {f['hbm_bytes_per_s'] / 1e12:.2f} "
                  f"TB/s, kernels: {kernels} (coder/train/aot/hardware.py MEASURED).", "", "| | value |", "|---|---|"]
        lines += [f"| {k} | {f[k]:.4g} |" for k in ("compute_s", "hbm_s", "ici_s", "dcn_s", "step_time_lower_s",
                                                    "step_time_serial_s")]
        lines += [f"| MFU (perfect overlap) | {100 * f['mfu_upper']:.1f}% |",
                  f"| MFU (no overlap) | {100 * f['mfu_lower']:.1f}% |"]
    lines += ["", "## Hardware figures used", "",
              f"{hw['name']}: {hw['nodes']} node(s) x {hw['gpus_per_node']} {chip['device_kind']}; per GPU "
              f"{chip['peak_bf16_flops']:.3g} bf16 FLOP/s ({chip['peak_fp8_flops']:.3g} fp8), "
              f"{_gib(chip['hbm_bytes'])} GiB HBM at {chip['hbm_bandwidth']:.3g} B/s, of which JAX's allocator "
              f"preallocates {100 * chip['pool_fraction']:.0f}% ({_gib(chip['pool_bytes'])} GiB: the fit check's "
              f"limit), NVLink {chip['nvlink_bandwidth']:.3g} B/s (the roofline's ici), InfiniBand "
              f"{chip['ib_bandwidth']:.3g} B/s (its dcn), one direction; sources in coder/train/aot/hardware.py.", ""]
    return lines


# a delta version's bytes over a full version's, at an RL learning rate (docs/rl.md's table of
# bench/weight_sync.py: 2.7-3.7% at lr 1e-6)
DELTA_SHARE = (0.03, 0.04)


def engine_markdown(e: dict) -> list[str]:
    """The engine section of report.md: one column per program."""
    lines = ["", "## RL engine: prefill and decode programs", ""]
    if "setup" not in e:
        return lines + [f"Status: **{e['status']}** — {e.get('error', '')}"]
    st = e["setup"]
    lines.append(f"{st['rows']} rows, {st['cache_slots']} cache slots, prefill chunks of {st['prefill_len']} "
                 f"tokens, speculative_k={st['speculative_k']}; rows split over mesh axes "
                 f"{st['rows_split_over'] or 'none (replicated)'}.")
    if "topology" in e:
        if e.get("weights_from") == "on_device":
            weights = (f"each version reaches it by an on-device reshard of the learner's arrays, "
                       f"{_gib(e['reshard_bytes_per_host'])} GiB per host (no weight store, no host hop).")
        else:
            weights = (f"each host reads {_gib(e['store_read_bytes_per_host'])} GiB of a version written in "
                       f"full from the weight store (its chips' slices)")
            if "store_read_seconds_per_host" in e:
                s = e["store_read_seconds_per_host"]
                weights += (f": {s:.1f} s at the host's {e['host_network_bytes_per_s'] / 1e9:.0f} GB/s of "
                            f"data-centre network; a delta version, {DELTA_SHARE[0] * 100:.0f}-{DELTA_SHARE[1]:.0%} of "
                            f"those bytes at an RL learning rate (docs/rl.md, bench/weight_sync.py), "
                            f"{DELTA_SHARE[0] * s:.2f}-{DELTA_SHARE[1] * s:.2f} s")
            weights += "."
        lines.append(f"On {e['topology']} ({e['chips']} chips, {e['hosts']} hosts), mesh "
                     f"{', '.join(f'{a} {n}' for a, n in e['mesh'].items() if n > 1) or 'one chip'}; {weights}")
    progs = [p for p in ("prefill", "decode") if p in e]
    lines += ["", "| | " + " | ".join(progs) + " |", "|---|" + "---|" * len(progs)]

    def row(label, fn):
        vals = []
        for p in progs:
            try:
                vals.append(fn(e[p]))
            except (KeyError, TypeError):
                vals.append("-")
        lines.append(f"| {label} | " + " | ".join(vals) + " |")

    row("status", lambda x: f"**{x['status']}**")
    row("weights GiB per chip", lambda x: _gib(x["memory"]["params_bytes"]))
    row("cache + logits GiB per chip", lambda x: _gib(x["memory"]["batch_bytes"]))
    row("temporaries GiB per chip", lambda x: _gib(x["memory"]["activations_temp_bytes"]))
    row("total GiB per chip (HBM)", lambda x: f"{_gib(x['memory']['total_bytes'])} ({_gib(x['memory']['hbm_bytes'])})")
    row("needs GiB (XLA stopped)", lambda x: _gib(x["memory_overflow"]["used_bytes"]))
    row("FLOPs per chip", lambda x: f"{x['cost']['flops']:.4g}")
    row("bytes accessed per chip", lambda x: f"{x['cost']['bytes_accessed']:.4g}")
    row("collectives (executed)", lambda x: ", ".join(
        f"{k} {v['executed']:.0f}" for k, v in x["collectives"].items() if v["executed"]) or "none")
    row("step s (overlap-serial)", lambda x: f"{x['roofline']['step_time_lower_s']:.3g}-"
        f"{x['roofline']['step_time_serial_s']:.3g}")
    row("bound", lambda x: x["roofline"]["bound"])
    row("tokens/s, slice (upper)", lambda x: f"{x['tokens_per_s_upper']:.4g}")
    row("compile s", lambda x: f"{x['compile_seconds']:.0f}")
    return lines


def colocated_markdown(c: dict) -> list[str]:
    """The colocated section of report.md (compile.colocated_memory's entry)."""
    return ["", "## Colocated RL on this slice (rl.topology.colocated)", "",
            "Learner and engine take turns on these chips (coder/rl/colocated.py); GiB per chip:", "",
            "| phase | what is on device | GiB |", "|---|---|---|",
            f"| engine | the engine's larger program {_gib(c['engine_program_bytes'])} + learner parameters "
            f"{_gib(c['learner_params_bytes'])} + reference {_gib(c['reference_bytes'])} + optimizer "
            f"{_gib(c['optimizer_on_device_bytes'])}"
            + (" (offloaded to host)" if c["offload_optimizer"] else "")
            + f" | {_gib(c['engine_phase_bytes'])} |",
            f"| learner | the GRPO step + reference {_gib(c['reference_bytes'])} (the engine released its "
            f"memory) | {_gib(c['learner_phase_bytes'])} |",
            "", f"Both phases {'fit' if c['fits'] else 'do not fit'} in {_gib(c['hbm_bytes'])} GiB."]


def grpo_markdown(g: dict) -> list[str]:
    """The GRPO learner section of report.md (compile_grpo's entry)."""
    lines = ["", "## RL learner: GRPO step", ""]
    st = g.get("setup")
    if st:
        lines.append(f"{st['rows']} rows x {st['seq_len']} tokens, grad_accum={st['grad_accum']}, "
                     f"{st['moe_layers']} MoE layers x top-{st['top_k']} expert ids in the batch, "
                     f"router replay {'on' if st['router_replay'] else 'off'}, "
                     f"max_staleness={st['max_staleness']}; no MTP (the GRPO loss trains the "
                     "policy head only); reference logprobs are an input.")
        lines.append("")
    lines.append(f"Status: **{g['status']}**" + (f" — {g['error']}" if g.get("error") else ""))
    if "memory_overflow" in g:
        o = g["memory_overflow"]
        lines += ["", f"XLA:TPU stopped compiling: the step needs {_gib(o['used_bytes'])} GiB of "
                  f"{_gib(o['hbm_bytes'])} GiB HBM ({100 * o['fraction_of_hbm']:.0f}%)."]
    if "memory" in g:
        m, c, f = g["memory"], g["cost"], g["roofline"]
        executed = ", ".join(f"{k} {v['executed']:.0f}" for k, v in g["collectives"].items()
                             if v["executed"]) or "none"
        lines += ["", "| | value |", "|---|---|",
                  f"| parameters GiB per chip | {_gib(m['params_bytes'])} |",
                  f"| optimizer state GiB per chip | {_gib(m['optimizer_bytes'])} |",
                  f"| batch GiB per chip | {_gib(m['batch_bytes'])} |",
                  f"| temporaries GiB per chip | {_gib(m['activations_temp_bytes'])} |",
                  f"| total / HBM GiB per chip | {_gib(m['total_bytes'])} / {_gib(m['hbm_bytes'])} "
                  f"({100 * m['fraction_of_hbm']:.1f}%) |",
                  f"| FLOPs per chip (loop-corrected) | {c['flops']:.4g} |",
                  f"| compiled FLOPs / model FLOPs | {f['hlo_to_model_flops']:.2f} |",
                  f"| collectives (executed) | {executed} |",
                  f"| step s (overlap-serial) | {f['step_time_lower_s']:.3g}-{f['step_time_serial_s']:.3g} |",
                  f"| MFU | {100 * f['mfu_lower']:.1f}-{100 * f['mfu_upper']:.1f}% |",
                  f"| bound | {f['bound']} |"]
    lines += ["", f"Compile: {g.get('compile_seconds', 0):.0f} s."]
    return lines
