"""Stage `compile`: ahead-of-time compile the real training step for a real TPU topology.

    python main.py --config=configs/kimi_k2_1t.py --config.stage=compile \
        --config.compile.topology=v5p-512 --config.mesh.num_slices=1

runs on any machine with the `tpu` extra (libtpu): libtpu describes the target slice's chips as
compile-only devices (coder.train.hardware), the step is lowered over a mesh of those devices
with abstract (never allocated) parameters, optimizer state and batch, XLA's TPU compiler
compiles it, and the stage writes report.json and report.md to `compile.report_dir` (default
`{workdir}/compile`):

  memory      per-chip bytes of parameters, optimizer state, batch, activations/temporaries
              (XLA's memory_analysis) and the total against the chip's HBM -> fits or not;
  cost        FLOPs and bytes accessed per step per chip (XLA's cost_analysis, corrected for
              loop trip counts, see below);
  collectives count and bytes by kind (all-reduce, all-gather, reduce-scatter, all-to-all,
              collective-permute, and DCN transfers between slices) in the compiled HLO;
  roofline    step time bounds from the chip's published peak FLOP/s, HBM and ICI/DCN
              bandwidths (coder.train.hardware) and the MFU they imply.

Loops: XLA's cost analysis counts a while loop's body once, whatever its trip count. The
report therefore walks the compiled HLO's call graph, takes each loop's trip count (libtpu's
`known_trip_count`, or the `i < N` bound of the loop condition), and adds (trips - 1) times
each loop body's matmul FLOPs and operand/result bytes to XLA's totals. Collectives are counted
both as they appear in the HLO (`count`) and as executed per step (`executed`, `bytes`).

A configuration that does not fit or does not compile is reported as such (the report says
why and what to change) instead of raising, so a sweep over topologies finishes.

The step compiled is the trainer's own (coder.train.trainer.Trainer._step, with the pretraining
loss), with the optimizer moments sharded like their parameters. `compile.offload_optimizer`
keeps them in pinned host memory between steps (moved in and out around the update). The
inference engine's prefill/decode steps are not compiled here yet.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from collections import defaultdict

# ============================================================================= HLO text parsing

_DTYPE_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4,
    "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3b11fnuz": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1,
    "f8e4m3": 1, "f8e3m4": 1, "f4e2m1fn": 0.5, "f8e8m0fnu": 1,
}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = (.*?) ([a-z][a-z0-9\-]*)\((.*)$")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+) .*\{\s*$")
_CALLEE = re.compile(r"\b(calls|to_apply|body|condition|true_computation|false_computation)"
                     r"=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


@dataclasses.dataclass
class Instr:
    name: str
    shape: str  # result type text, e.g. "bf16[8,128]{1,0}" or a tuple "(f32[], s32[])"
    opcode: str
    args: str  # the raw operand list, e.g. "%a, %b" or "8" for a constant
    attrs: str  # everything after the operand list

    @property
    def operands(self) -> list[str]:
        return re.findall(r"%([\w.\-]+)", self.args)


@dataclasses.dataclass
class HloModule:
    computations: dict[str, list[Instr]]  # in the order printed (callees before callers)
    entry: str


def arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """The (dtype, dims) of every array in a result type (one, or several for a tuple)."""
    out = []
    for dt, dims in _ARRAY.findall(shape):
        if dt in _DTYPE_BYTES:
            out.append((dt, tuple(int(d) for d in dims.split(",") if d)))
    return out


def nbytes(shape: str) -> float:
    """Bytes of all arrays in a result type (tuples summed)."""
    return sum(_DTYPE_BYTES[dt] * math.prod(dims) for dt, dims in arrays(shape))


def _split_operands(rest: str) -> tuple[str, str]:
    """'a, b), attr=...' -> ('a, b', 'attr=...'): the operand list ends at the matching ')'."""
    depth = 1
    for i, ch in enumerate(rest):
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
            if depth == 0:
                return rest[:i], rest[i + 1:]
    return rest, ""


def parse_hlo(text: str) -> HloModule:
    """Computations and instructions of an HLO module's text (compiled.as_text())."""
    comps: dict[str, list[Instr]] = {}
    entry, current = "", None
    for line in text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m and " = " not in line:
                current = m.group(2)
                comps[current] = []
                if m.group(1):
                    entry = current
            continue
        if line.startswith("}"):
            current = None
            continue
        m = _INSTR.match(line)
        if m:
            args, attrs = _split_operands(m.group(4))
            comps[current].append(Instr(m.group(1), m.group(2), m.group(3), args, attrs))
    if not entry and comps:
        entry = list(comps)[-1]
    return HloModule(comps, entry)


def callees(ins: Instr) -> list[tuple[str, str]]:
    """(role, computation) pairs an instruction calls: body, condition, calls, to_apply, ..."""
    out = [(role, name) for role, name in _CALLEE.findall(ins.attrs)]
    for group in _BRANCHES.findall(ins.attrs):
        out += [("branch", n.strip().lstrip("%")) for n in group.split(",") if n.strip()]
    return out


def trip_count(module: HloModule, ins: Instr) -> int | None:
    """Trip count of a `while`: libtpu's known_trip_count, else N of an `i < N` condition.

    JAX's scan and fori_loop count from 0 in steps of 1, which is what the `i < N` reading
    assumes; anything else returns None (the report then lists the loop as unknown).
    """
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.attrs)
    if m:
        return int(m.group(1))
    cond = dict(callees(ins)).get("condition")
    body = module.computations.get(cond, [])
    consts = {i.name: i.args.strip() for i in body if i.opcode == "constant"}
    for i in body:
        if i.opcode == "compare" and "direction=LT" in i.attrs and len(i.operands) == 2:
            bound = consts.get(i.operands[1])
            if bound is not None and re.fullmatch(r"-?\d+", bound):
                return int(bound)
    return None


def multiplicities(module: HloModule, loops: bool = True) -> tuple[dict[str, float], list[str]]:
    """How many times each computation runs per execution of the entry, and unknown loops.

    Computations are printed callees-first, so walking them in reverse visits every caller
    before its callees. A while body/condition runs trip-count times per execution of its
    caller (with `loops=False`: once, which is how XLA's cost analysis counts it).
    """
    mult: dict[str, float] = defaultdict(float)
    mult[module.entry] = 1.0
    unknown = []
    for comp in reversed(list(module.computations)):
        if mult[comp] == 0:
            continue
        for ins in module.computations[comp]:
            calls = callees(ins)
            if not calls:
                continue
            trips = 1
            if ins.opcode == "while" and loops:
                t = trip_count(module, ins)
                if t is None:
                    unknown.append(ins.name)
                trips = 1 if t is None else t
            for role, callee in calls:
                if callee in module.computations:
                    mult[callee] += mult[comp] * (trips if role in ("body", "condition") else 1)
    return dict(mult), unknown


# ============================================================================= HLO statistics

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute", "dcn")
_OPCODE_KIND = {
    "all-reduce": "all-reduce", "all-reduce-start": "all-reduce",
    "all-gather": "all-gather", "all-gather-start": "all-gather",
    "reduce-scatter": "reduce-scatter",
    "all-to-all": "all-to-all", "ragged-all-to-all": "all-to-all",
    "collective-permute": "collective-permute", "collective-permute-start": "collective-permute",
}


def group_size(attrs: str, num_devices: int) -> int:
    """Devices per replica group of a collective, from any of HLO's three spellings."""
    m = re.search(r"replica_groups=\{\{([^}]*)\}", attrs)
    if m:
        return len([x for x in m.group(1).split(",") if x.strip()])
    m = re.search(r"replica_groups=\[([\d,]+)\]<=", attrs)  # iota form [groups, size]<=[n]
    if m:
        return int(m.group(1).split(",")[-1])
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)  # mesh form
    if m:
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", m.group(1)))
        return math.prod(int(sizes[a]) for a in re.findall(r"'(\w+)'", m.group(2)))
    return num_devices  # replica_groups={} : every device


def wire_bytes(kind: str, size: float, n: int) -> float:
    """Bytes one device sends for a collective of result `size` over `n` devices (ring).

    all-gather / all-to-all move (n-1)/n of the result, all-reduce twice that (reduce-scatter
    then all-gather), reduce-scatter (n-1) times its (scattered) result, a permute its result.
    """
    if n <= 1:
        return 0.0
    if kind in ("all-gather", "all-to-all"):
        return size * (n - 1) / n
    if kind in ("all-reduce", "dcn"):
        return 2 * size * (n - 1) / n
    if kind == "reduce-scatter":
        return size * (n - 1)
    return size


def _collective(module: HloModule, ins: Instr, num_devices: int, num_slices: int):
    """(kind, result bytes, group size) if `ins` is a collective, else None."""
    kind = _OPCODE_KIND.get(ins.opcode)
    if kind:
        sizes = [_DTYPE_BYTES[dt] * math.prod(d) for dt, d in arrays(ins.shape)]
        # async -start ops return (operand, result, context...): the result is the largest
        return kind, max(sizes, default=0.0), group_size(ins.attrs, num_devices)
    if ins.opcode == "fusion":  # TPU fuses some collectives, e.g. %all-reduce-scatter
        called = dict(callees(ins)).get("calls", "")
        if called.startswith(("all-reduce-scatter", "reduce-scatter")):
            inner = [i for i in module.computations.get(called, []) if i.opcode in _OPCODE_KIND]
            n = group_size(inner[0].attrs, num_devices) if inner else num_devices
            return "reduce-scatter", nbytes(ins.shape), n
    if ins.opcode == "send" and "_xla_megascale" in ins.attrs:  # cross-slice (DCN) transfer
        data = arrays(ins.shape)[:1]  # send returns (data, context, token)
        return "dcn", sum(_DTYPE_BYTES[dt] * math.prod(d) for dt, d in data), num_slices
    return None


def _fused_collective_bodies(module: HloModule) -> set[str]:
    """Computations inside collective fusions: their inner ops are counted via the fusion."""
    out = set()
    for instrs in module.computations.values():
        for ins in instrs:
            if ins.opcode == "fusion":
                called = dict(callees(ins)).get("calls", "")
                if called.startswith(("all-reduce-scatter", "reduce-scatter")):
                    out.add(called)
    return out


def collective_stats(module: HloModule, mult: dict[str, float], num_devices: int,
                     num_slices: int = 1) -> dict[str, dict[str, float]]:
    """Per kind: `count` in the HLO, `executed` per step, result `bytes` and `wire_bytes`
    (sent per device, ring estimate) per step. DCN = transfers between slices."""
    skip = _fused_collective_bodies(module)
    stats = {k: dict(count=0, executed=0.0, bytes=0.0, wire_bytes=0.0) for k in KINDS}
    for comp, instrs in module.computations.items():
        if comp in skip or mult.get(comp, 0) == 0:
            continue
        for ins in instrs:
            c = _collective(module, ins, num_devices, num_slices)
            if c is None:
                continue
            kind, size, n = c
            s = stats[kind]
            s["count"] += 1
            s["executed"] += mult[comp]
            s["bytes"] += mult[comp] * size
            s["wire_bytes"] += mult[comp] * wire_bytes(kind, size, n)
    return stats


def dot_flops(module: HloModule, ins: Instr, shapes: dict[str, str]) -> float:
    """FLOPs of one dot / convolution: 2 * output elements * contracted elements."""
    out = arrays(ins.shape)
    if not out:
        return 0.0
    n_out = math.prod(out[0][1])
    if ins.opcode == "dot":
        lhs = arrays(shapes.get(ins.operands[0], "")) if ins.operands else []
        m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.attrs)
        if not lhs or not m:
            return 0.0
        dims = lhs[0][1]
        k = math.prod(dims[int(d)] for d in m.group(1).split(",") if d)
        return 2.0 * n_out * k
    if ins.opcode == "convolution":
        rhs = arrays(shapes.get(ins.operands[1], "")) if len(ins.operands) > 1 else []
        m = re.search(r"dim_labels=\w*_(\w+)->", ins.attrs)
        if not rhs or not m:
            return 0.0
        labels, dims = m.group(1), rhs[0][1]
        # kernel: 'i' input features, 'o' output features, digits spatial window dims
        k = math.prod(d for lab, d in zip(labels, dims) if lab != "o")
        return 2.0 * n_out * k
    return 0.0


_NO_TRAFFIC = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "while",
               "call", "conditional", "after-all", "partition-id", "replica-id", "copy-done",
               "all-reduce-done", "all-gather-done", "collective-permute-done", "send-done",
               "recv-done", "opt-barrier"}


_SLICING = ("dynamic-slice", "slice", "gather")


def _param_index(ins: Instr) -> int:
    return int(ins.args.strip() or 0)


def _fusion_access(instrs: list[Instr]) -> tuple[dict[int, float], float | None]:
    """Bytes a fused computation reads of each parameter, and writes (None = its result).

    A parameter only sliced inside the fusion (dynamic-slice of one layer of a stacked weight)
    is read for the slices' size; the buffer of an in-place dynamic-update-slice is not read,
    and only the update is written.
    """
    shapes = {i.name: i.shape for i in instrs}
    users: dict[str, list[tuple[Instr, int]]] = defaultdict(list)
    for i in instrs:
        for pos, o in enumerate(i.operands):
            users[o].append((i, pos))
    reads: dict[int, float] = {}
    for i in instrs:
        if i.opcode != "parameter":
            continue
        us = users.get(i.name, [])
        if us and all(u.opcode in _SLICING and pos == 0 for u, pos in us):
            reads[_param_index(i)] = sum(nbytes(u.shape) for u, _ in us)
        elif us and all(u.opcode == "dynamic-update-slice" and pos == 0 for u, pos in us):
            reads[_param_index(i)] = 0.0
        else:
            reads[_param_index(i)] = nbytes(i.shape)
    root = instrs[-1] if instrs else None
    written = None
    if root is not None and root.opcode == "dynamic-update-slice" and len(root.operands) > 1:
        written = nbytes(shapes.get(root.operands[1], ""))
    return reads, written


def per_computation_costs(module: HloModule) -> dict[str, tuple[float, float]]:
    """(matmul FLOPs, HBM bytes) of each computation's own instructions, run once.

    Bytes: each top-level instruction of a non-fused computation reads its operands and writes
    its result (a fusion is one instruction: its internals stay on chip), with slices read for
    their size and in-place updates written for the update's size, as XLA's cost analysis
    does. Matmul FLOPs count dots and convolutions wherever they sit, fused or not.
    """
    fused = {}
    for instrs in module.computations.values():
        for ins in instrs:
            if ins.opcode == "fusion":
                for role, c in callees(ins):
                    if role == "calls" and c in module.computations:
                        fused[c] = None
    for c in fused:
        fused[c] = _fusion_access(module.computations[c])
    out = {}
    for comp, instrs in module.computations.items():
        shapes = {i.name: i.shape for i in instrs}
        flops = sum(dot_flops(module, i, shapes) for i in instrs
                    if i.opcode in ("dot", "convolution"))
        traffic = 0.0
        if comp not in fused:
            for i in instrs:
                if i.opcode in _NO_TRAFFIC:
                    continue
                operand_bytes = [nbytes(shapes.get(o, "")) for o in i.operands]
                written = nbytes(i.shape)
                if i.opcode == "fusion" and dict(callees(i)).get("calls") in fused:
                    reads, w = fused[dict(callees(i))["calls"]]
                    operand_bytes = [min(b, reads.get(k, b)) for k, b in enumerate(operand_bytes)]
                    written = written if w is None else w
                elif i.opcode in _SLICING:
                    operand_bytes = [written] + operand_bytes[1:]
                elif i.opcode == "dynamic-update-slice" and len(operand_bytes) > 1:
                    written, operand_bytes = operand_bytes[1], operand_bytes[1:]
                traffic += written + sum(operand_bytes)
        out[comp] = (flops, traffic)
    return out


def loop_corrected_cost(module: HloModule, xla_flops: float,
                        xla_bytes: float) -> tuple[float, float]:
    """XLA's per-step FLOPs and bytes, plus each computation's own matmul FLOPs and bytes times
    the runs XLA's cost analysis misses: it counts a loop body once, not once per trip."""
    runs, _ = multiplicities(module, loops=True)
    counted, _ = multiplicities(module, loops=False)
    flops, traffic = xla_flops, xla_bytes
    for comp, (f, b) in per_computation_costs(module).items():
        extra = runs.get(comp, 0.0) - counted.get(comp, 0.0)
        if extra > 0:
            flops += extra * f
            traffic += extra * b
    return flops, traffic


# ============================================================================= report

def bytes_per_chip(tree) -> float:
    """Bytes one device holds of a pytree of sharded jax.ShapeDtypeStruct / arrays.

    The largest shard is what the busiest device holds (shards are equal unless a dimension
    does not divide the mesh, in which case XLA pads it).
    """
    import jax

    total = 0.0
    for leaf in jax.tree.leaves(tree):
        shape = tuple(leaf.shape)
        sharding = getattr(leaf, "sharding", None)
        if sharding is not None:
            shape = sharding.shard_shape(shape)
        total += math.prod(shape) * leaf.dtype.itemsize
    return total


def memory_report(mem, hbm_bytes: int, *, params: float, optimizer: float,
                  batch: float) -> dict:
    """Per-chip bytes from XLA's CompiledMemoryStats, split into the parts a reader acts on."""
    args = float(mem.argument_size_in_bytes)
    out = float(mem.output_size_in_bytes)
    alias = float(mem.alias_size_in_bytes)
    temp = float(mem.temp_size_in_bytes)
    code = float(mem.generated_code_size_in_bytes)
    live = args + out - alias + temp + code  # donated outputs reuse their inputs' buffers
    peak = float(getattr(mem, "peak_memory_in_bytes", 0) or 0)
    total = max(live, peak)
    return dict(
        params_bytes=params, optimizer_bytes=optimizer, batch_bytes=batch,
        activations_temp_bytes=temp, arguments_bytes=args, outputs_bytes=out,
        alias_bytes=alias, generated_code_bytes=code, peak_bytes=peak, total_bytes=total,
        hbm_bytes=float(hbm_bytes), fraction_of_hbm=total / hbm_bytes,
        fits=bool(total <= hbm_bytes),
        host_bytes=dict(arguments=float(mem.host_argument_size_in_bytes),
                        outputs=float(mem.host_output_size_in_bytes),
                        temp=float(mem.host_temp_size_in_bytes)),
    )


def model_flops_per_step(model_cfg, active: int, batch: int, seq: int) -> float:
    """Training FLOPs of one step without recompute: 6 N_active per token + causal attention.

    active: matmul parameters per token (`active_params`). Attention per layer and sequence:
    (2 QK^T + 2 PV) x T^2/2 (causal) x heads x head dims forward, times 3 for forward +
    backward (PaLM appendix B). Trunk and MTP blocks both count: the step runs both.
    """
    layers = model_cfg.num_hidden_layers + model_cfg.num_mtp_layers
    head = model_cfg.qk_nope_head_dim + model_cfg.qk_rope_head_dim + model_cfg.v_head_dim
    attn = 3 * layers * batch * seq * seq * model_cfg.num_attention_heads * head
    return 6.0 * active * batch * seq + attn


def analyse(compiled, topo, *, params: float, optimizer: float, batch: float,
            model_flops: float) -> dict:
    """Memory, cost, collectives and roofline of a compiled step for topology `topo`."""
    from coder.train import hardware

    text = compiled.as_text()
    module = parse_hlo(text)
    runs, unknown = multiplicities(module)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    xla_flops = float(cost.get("flops", 0.0))
    xla_bytes = float(cost.get("bytes accessed", 0.0))
    flops, traffic = loop_corrected_cost(module, xla_flops, xla_bytes)
    colls = collective_stats(module, runs, topo.num_chips, topo.num_slices)
    mem = memory_report(compiled.memory_analysis(), topo.chip.hbm_bytes, params=params,
                        optimizer=optimizer, batch=batch)
    return dict(
        memory=mem,
        cost=dict(xla_flops=xla_flops, xla_bytes_accessed=xla_bytes, flops=flops,
                  bytes_accessed=traffic, loops_with_unknown_trip_count=unknown,
                  hlo_instructions=sum(len(v) for v in module.computations.values())),
        collectives=colls,
        roofline=hardware.roofline(topo.chip, topo.num_chips, flops, traffic, colls, model_flops),
    )


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
                  f"| bytes accessed (loop-corrected) | {c['bytes_accessed']:.4g} |",
                  f"| FLOPs (XLA cost_analysis, loop bodies once) | {c['xla_flops']:.4g} |",
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
    if r.get("advice"):
        lines += ["", "## What would make it fit / run faster", ""]
        lines += [f"- {a}" for a in r["advice"]]
    chip = hw["chip"]
    lines += ["", "## Hardware figures used", "",
              f"{chip['name']}: {chip['peak_bf16_flops']:.3g} bf16 FLOP/s, "
              f"{_gib(chip['hbm_bytes'])} GiB HBM at {chip['hbm_bandwidth']:.3g} B/s, ICI "
              f"{chip['ici_bandwidth']:.3g} B/s, DCN {chip['dcn_bandwidth']:.3g} B/s per chip"
              + (f" (assumed: {', '.join(chip['assumed'])})" if chip["assumed"] else "")
              + "; sources in coder/train/hardware.py.", ""]
    return "\n".join(lines)


def write_report(report: dict, out_dir: str) -> str:
    """report.json + report.md in `out_dir`; returns the JSON path."""
    import os

    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "report.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1, sort_keys=False, default=str)
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write(to_markdown(report))
    return path


# ============================================================================= the training step

def _with_shardings(tree, shardings):
    import jax

    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        tree, shardings)


def _memory_kind(shardings, kind: str):
    import jax

    return jax.tree.map(lambda s: s.with_memory_kind(kind), shardings)


def _step_trainer(config, graphdef, loss_fn, trainable):
    """A Trainer holding only what its `_step` reads, without building or allocating a model.

    The compiled function is the trainer's own step, so what runs on the pod is what the report
    measured. (Trainer.__init__ creates the model on the local devices, which a 1T model can't.)
    """
    import jax
    from flax import nnx  # noqa: F401  (the trainable filter is an nnx filter)

    from coder.train.optim import lr_schedule, make_optimizer
    from coder.train.trainer import Trainer

    tr = Trainer.__new__(Trainer)
    tr.config = config
    tr.loss_fn = loss_fn
    tr.trainable = trainable
    tr.grad_accum = int(config.train.grad_accum)
    tr.bias_rate = float(config.model.bias_update_rate)
    tr.tx = make_optimizer(config.train)
    tr._schedule = lr_schedule(config.train)
    tr._graphdef = graphdef
    tr.key = jax.random.key(int(config.seed))
    return tr


def lower_train_step(config, mesh):
    """Lower the trainer's step over `mesh` with abstract state; returns (lowered, sizes).

    sizes: per-chip bytes of params (+ non-trained variables), optimizer state and batch.
    """
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    from coder.model import Transformer, sharding
    from coder.train.losses import lm_loss_fn

    rules = tuple(tuple(r) for r in config.mesh.rules)
    abstract = nnx.eval_shape(lambda: Transformer(config.model, rngs=nnx.Rngs(int(config.seed))))
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
    p_sh = sharding.state_shardings(params, mesh, rules)
    r_sh = sharding.state_shardings(rest, mesh, rules)
    params, rest = _with_shardings(params, p_sh), _with_shardings(rest, r_sh)

    tr = _step_trainer(config, graphdef, lm_loss_fn(config.train), nnx.Param)
    # Optimizer moments are sharded like their parameters; counters are replicated. (Left to
    # XLA, jit(tx.init) returns unsharded zeros: no sharding flows into constants, and the
    # moments of a 671B model land whole on each chip.)
    opt = jax.eval_shape(tr.tx.init, params)
    replicated = NamedSharding(mesh, PartitionSpec())
    masked = lambda x: isinstance(x, optax.MaskedNode)
    o_sh = optax.tree_map_params(tr.tx, lambda x, s: x if masked(x) else s, opt, p_sh,
                                 transform_non_params=lambda _: replicated, is_leaf=masked)
    opt = _with_shardings(opt, o_sh)

    b, t = int(config.data.batch_size), int(config.data.seq_len)
    batch_axes = sharding.mesh_axes_of("batch", rules)
    b_sh = NamedSharding(mesh, PartitionSpec(batch_axes or None, None))
    batch = {k: jax.ShapeDtypeStruct((b, t), dt, sharding=b_sh) for k, dt in (
        ("tokens", jnp.int32), ("positions", jnp.int32), ("segment_ids", jnp.int32),
        ("loss_mask", jnp.float32))}
    step = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, PartitionSpec()))

    fn = tr._step
    if config.compile.offload_optimizer:
        # optimizer state lives in host memory between steps: in, update on device, back out
        host_sh, dev_sh = _memory_kind(o_sh, "pinned_host"), _memory_kind(o_sh, "device")
        opt = _with_shardings(opt, host_sh)
        o_sh = host_sh

        def fn(params, rest, opt_host, step, batch):
            opt_dev = jax.device_put(opt_host, dev_sh)
            new_p, new_r, new_o, metrics = tr._step(params, rest, opt_dev, step, batch)
            return new_p, new_r, jax.device_put(new_o, host_sh), metrics

    jitted = jax.jit(fn, out_shardings=(p_sh, r_sh, o_sh, None), donate_argnums=(0, 1, 2))
    with sharding.activate(mesh, rules):
        lowered = jitted.lower(params, rest, opt, step, batch)
    sizes = dict(params=bytes_per_chip(params) + bytes_per_chip(rest),
                 optimizer=0.0 if config.compile.offload_optimizer else bytes_per_chip(opt),
                 batch=bytes_per_chip(batch))
    return lowered, sizes


def active_params(model_cfg) -> int:
    """Matmul parameters one token touches in a training step: trunk + MTP modules, routed
    experts at top-k / n_routed, without the input embedding (a lookup, not a matmul)."""
    from coder.model import count_params

    c = count_params(model_cfg)
    frac = model_cfg.num_experts_per_tok / model_cfg.n_routed_experts
    mtp_moe = model_cfg.num_mtp_layers and model_cfg.num_hidden_layers >= model_cfg.first_k_dense_replace
    mtp_routed = (3 * model_cfg.n_routed_experts * model_cfg.hidden_size
                  * model_cfg.moe_intermediate_size * model_cfg.num_mtp_layers) if mtp_moe else 0
    mtp_active = c.get("mtp", 0) - mtp_routed * (1 - frac)
    embed = model_cfg.vocab_size * model_cfg.hidden_size * (0 if model_cfg.tie_word_embeddings else 1)
    return int(c["active"] + mtp_active - embed)


_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def hbm_overflow(message: str) -> tuple[float, float] | None:
    """(used, capacity) bytes from XLA:TPU's out-of-memory compile error, else None.

    e.g. "Ran out of memory in memory space hbm. Used 120.53G of 95.74G hbm." or "the total
    memory required for HLO temporaries (4.97T) exceeds available HBM (95.74G)" (temporaries
    only: the lower bound XLA found before giving up).
    """
    for pattern in (r"Used ([\d.]+)([KMGT]?) of ([\d.]+)([KMGT]?) hbm",
                    r"required for HLO temporaries \(([\d.]+)([KMGT]?)\) exceeds available "
                    r"HBM \(([\d.]+)([KMGT]?)\)"):
        m = re.search(pattern, message)
        if m:
            return (float(m.group(1)) * _UNITS[m.group(2)],
                    float(m.group(3)) * _UNITS[m.group(4)])
    return None


def advice(report: dict, config) -> list[str]:
    """What to change when the step does not fit, or where its time goes (from the numbers)."""
    out = []
    m = report.get("memory")
    if m is None:
        o = report.get("memory_overflow")
        if o:
            out.append(f"XLA needs {_gib(o['used_bytes'])} GiB of the chip's "
                       f"{_gib(o['hbm_bytes'])} GiB HBM ({100 * o['fraction_of_hbm']:.0f}%)")
            if not config.compile.offload_optimizer:
                out.append("compile.offload_optimizer=True moves the Adam moments to host memory")
            if config.model.remat != "full":
                out.append("model.remat=full keeps only block inputs for the backward pass")
            out.append("more chips (fsdp x expert) divide the parameters and optimizer state; "
                       "a larger mesh.sequence (or mesh.tensor) divides a long row's activations")
        return out
    mesh = report["setup"]["mesh"]
    if not m["fits"]:
        over = m["total_bytes"] - m["hbm_bytes"]
        out.append(f"over HBM by {_gib(over)} GiB per chip")
        if m["optimizer_bytes"] > over and not config.compile.offload_optimizer:
            out.append("compile.offload_optimizer=True moves the optimizer state "
                       f"({_gib(m['optimizer_bytes'])} GiB per chip) to host memory")
        if m["activations_temp_bytes"] > over and config.model.remat != "full":
            out.append(f"model.remat=full (now {config.model.remat!r}) recomputes activations "
                       "in the backward pass instead of keeping them")
        if int(config.train.grad_accum) * 2 <= int(config.data.batch_size):
            out.append("a larger train.grad_accum shrinks the activations of each micro-batch")
        out.append(f"more chips: the parameters + optimizer state ({_gib(m['params_bytes'] + m['optimizer_bytes'])} "
                   f"GiB per chip on mesh {mesh}) shrink in proportion to the fsdp x expert size")
    f = report["roofline"]
    out.append(f"roofline: the step is {f['bound']}-bound ({f['step_time_lower_s']:.3g} s with "
               f"perfect overlap, {f['step_time_serial_s']:.3g} s without)")
    return out


def run(config, stage_dir: str, init_from: str = "") -> str:
    """Stage `compile`: write the report for config.compile.topology; returns init_from.

    No checkpoint is read or written (the step is compiled from shapes only), so a following
    stage starts from the same `init_from` as this one.
    """
    import logging
    import sys
    import time
    import traceback

    from coder.model import count_params, sharding
    from coder.train import hardware

    topo = hardware.parse_topology(config.compile.topology, int(config.mesh.num_slices))
    out_dir = config.compile.report_dir or stage_dir
    devices = hardware.topology_devices(topo)
    sizes = dict(zip(sharding.AXES, sharding.mesh_shape(config.mesh, len(devices))))
    active = active_params(config.model)
    counts = count_params(config.model)
    b, t = int(config.data.batch_size), int(config.data.seq_len)
    report = dict(
        config=f"{_count(counts['total'])}-parameter model",
        command=" ".join(["python", "main.py", *sys.argv[1:]]) if sys.argv[0].endswith("main.py")
        else "see docs/scale/regenerate.sh",
        hardware=hardware.describe(topo),
        setup=dict(
            mesh=sizes, num_slices=topo.num_slices, batch=b, seq_len=t, tokens_per_step=b * t,
            grad_accum=int(config.train.grad_accum), remat=config.model.remat,
            optimizer=config.train.optimizer, offload_optimizer=bool(config.compile.offload_optimizer),
            dtype=config.model.dtype, param_dtype=config.model.param_dtype,
            params_total=counts["total"], params_mtp=counts.get("mtp", 0),
            params_active_matmul=active, attention_backend=config.model.attention_backend,
        ),
    )
    t0 = time.perf_counter()
    try:
        sharding.validate(config.model, config.mesh, len(devices))
        mesh = hardware.topology_mesh(config.mesh, devices, topo.num_slices)
        lowered, part_sizes = lower_train_step(config, mesh)
        compiled = lowered.compile()
    except Exception as e:
        logging.error("compile for %s failed:\n%s", topo.name, traceback.format_exc())
        msg = " ".join(str(e).split())
        oom = hbm_overflow(msg)
        report.update(status="does_not_fit" if oom else "compile_error",
                      error=msg[:2000] or type(e).__name__,
                      compile_seconds=time.perf_counter() - t0)
        if oom:
            report["memory_overflow"] = dict(used_bytes=oom[0], hbm_bytes=oom[1],
                                             fraction_of_hbm=oom[0] / oom[1])
    else:
        report["compile_seconds"] = time.perf_counter() - t0
        report.update(analyse(compiled, topo, params=part_sizes["params"],
                              optimizer=part_sizes["optimizer"], batch=part_sizes["batch"],
                              model_flops=model_flops_per_step(config.model, active, b, t)))
        report["status"] = "fits" if report["memory"]["fits"] else "does_not_fit"
    report["advice"] = advice(report, config)
    path = write_report(report, out_dir)
    logging.info("compile report (%s): %s", report["status"], path)
    if report.get("memory"):
        m = report["memory"]
        logging.info("%s: %.2f / %.2f GiB per chip, %s-bound, MFU %.1f-%.1f%%", topo.name,
                     m["total_bytes"] / 2**30, m["hbm_bytes"] / 2**30, report["roofline"]["bound"],
                     100 * report["roofline"]["mfu_lower"], 100 * report["roofline"]["mfu_upper"])
    return init_from
