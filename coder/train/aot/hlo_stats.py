"""Reading a compiled XLA module: its HLO text parsed into computations, loop trip counts,
matmul FLOPs and bytes per computation, and the collectives it runs (count and bytes by kind).

Used by stage `compile` (coder/stages/compile.py) to report what a training step does on a TPU
slice; pure Python over the HLO text (no JAX needed).

Loops: XLA's cost analysis counts a while loop's body once, whatever its trip count. The
report therefore walks the compiled HLO's call graph, takes each loop's trip count (libtpu's
`known_trip_count`, or the `i < N` bound of the loop condition), and adds (trips - 1) times
each loop body's matmul FLOPs and operand/result bytes to XLA's totals. Collectives are counted
both as they appear in the HLO (`count`) and as executed per step (`executed`, `bytes`).

Three spellings the walk must read right (each has a hand-written HLO test,
tests/train/test_hlo_stats.py):
- work behind `called_computations={...}` (collectives XLA:TPU offloads to the SparseCore): the
  callee runs once per run of its caller, and its collectives count; its HBM bytes are the
  wrapper's operands and result (the callee's own instructions are not charged again);
- a loop whose first iteration XLA peeled: the counter enters at 1 (the init tuple's constant),
  so `i < N` runs N - 1 trips, not N;
- buffers outside HBM (a layout's memory space `S(n)`, n != 0: host memory S(5), on-chip S(1)):
  a host-offload slice or update moves its slice, not the host-resident buffer, through HBM;
  the `async-start` / `async-done` around it are bookkeeping (their tuples repeat the buffer),
  the wrapped computation's instruction carries the traffic.
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict

import numpy as np

# ============================================================================= HLO text parsing

_DTYPE_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4,
    "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3b11fnuz": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1,
    "f8e4m3": 1, "f8e3m4": 1, "f4e2m1fn": 0.5, "f8e8m0fnu": 1,
}
# dtype[dims] and its layout, e.g. "bf16[8,128]{1,0:T(8,128)S(5)}" (the layout may name a memory space)
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\](\{[^}]*\})?")
_MEMORY_SPACE = re.compile(r"S\((\d+)\)")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = (.*?) ([a-z][a-z0-9\-]*)\((.*)$", re.S)
# a computation's last line: "}", or "}, execution_thread=..." (SparseCore computations of v5p /
# v6e); a Mosaic kernel's backend_config lines may start with "}" too, but never look like this
_END = re.compile(r"^\}(,\s*execution_thread=\S+)?\s*$")
_INSTR_START = re.compile(r"^\s+(?:ROOT\s+)?%?[\w.\-]+ = ")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+) .*\{\s*$")
_CALLEE = re.compile(r"\b(calls|to_apply|body|condition|true_computation|false_computation)"
                     r"=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_CALLED = re.compile(r"called_computations=\{([^}]*)\}")  # e.g. collectives offloaded to the SparseCore


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
    for dt, dims, _ in _ARRAY.findall(shape):
        if dt in _DTYPE_BYTES:
            out.append((dt, tuple(int(d) for d in dims.split(",") if d)))
    return out


def nbytes(shape: str) -> float:
    """Bytes of all arrays in a result type (tuples summed)."""
    return sum(_DTYPE_BYTES[dt] * math.prod(dims) for dt, dims in arrays(shape))


def hbm_bytes(shape: str) -> float:
    """Bytes of the arrays of a result type that live in HBM: those whose layout names no
    memory space other than 0 (`{1,0:T(8,128)S(5)}` is host memory, S(1) on-chip memory)."""
    total = 0.0
    for dt, dims, layout in _ARRAY.findall(shape):
        m = _MEMORY_SPACE.search(layout)
        if dt in _DTYPE_BYTES and (m is None or m.group(1) == "0"):
            total += _DTYPE_BYTES[dt] * math.prod(int(d) for d in dims.split(",") if d)
    return total


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
    entry, current, pending = "", None, []

    def flush():
        # an instruction may span lines: a Mosaic kernel's backend_config holds its serialized
        # module, whose lines may even start with "}" (they are not the computation's end)
        if pending:
            m = _INSTR.match("\n".join(pending))
            if m:
                args, attrs = _split_operands(m.group(4))
                comps[current].append(Instr(m.group(1), m.group(2), m.group(3), args, attrs))
            pending.clear()

    for line in text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m and " = " not in line:
                current = m.group(2)
                comps[current] = []
                if m.group(1):
                    entry = current
            continue
        if _END.match(line):
            flush()
            current = None
        elif _INSTR_START.match(line):
            flush()
            pending.append(line)
        elif pending:
            pending.append(line)
    flush()
    if not entry and comps:
        entry = list(comps)[-1]
    return HloModule(comps, entry)


def callees(ins: Instr) -> list[tuple[str, str]]:
    """(role, computation) pairs an instruction calls: body, condition, calls, to_apply, ..."""
    out = [(role, name) for role, name in _CALLEE.findall(ins.attrs)]
    for group in _BRANCHES.findall(ins.attrs):
        out += [("branch", n.strip().lstrip("%")) for n in group.split(",") if n.strip()]
    for group in _CALLED.findall(ins.attrs):
        out += [("called", n.strip().lstrip("%")) for n in group.split(",") if n.strip()]
    return out


def trip_count(module: HloModule, ins: Instr, caller: list[Instr] = ()) -> int | None:
    """Trip count of a `while`: libtpu's known_trip_count, else N - start of an `i < N`
    condition, `start` the counter's constant in the loop's init tuple (in `caller`, the
    while's computation): 0 for JAX's scan and fori_loop, 1 where XLA peeled the first
    iteration out of the loop. Steps of 1 are assumed; a condition of another form returns
    None (the report then lists the loop as unknown).
    """
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.attrs)
    if m:
        return int(m.group(1))
    cond = dict(callees(ins)).get("condition")
    body = module.computations.get(cond, [])
    by_name = {i.name: i for i in body}
    consts = {i.name: i.args.strip() for i in body if i.opcode == "constant"}
    for i in body:
        if i.opcode == "compare" and "direction=LT" in i.attrs and len(i.operands) == 2:
            bound = consts.get(i.operands[1])
            if bound is not None and re.fullmatch(r"-?\d+", bound):
                return int(bound) - _counter_start(by_name.get(i.operands[0]), ins, caller)
    return None


def _counter_start(counter: Instr | None, loop: Instr, caller) -> int:
    """The constant a loop counter (`get-tuple-element(param), index=k` in the condition)
    enters the loop with: operand k of the while's init tuple in `caller`; 0 when not a
    constant there (JAX's loops start at 0)."""
    m = re.search(r"index=(\d+)", counter.attrs) if counter is not None and \
        counter.opcode == "get-tuple-element" else None
    instrs = {i.name: i for i in caller}
    init = instrs.get(loop.operands[0]) if m and loop.operands else None
    if init is None or init.opcode != "tuple" or int(m.group(1)) >= len(init.operands):
        return 0
    start = instrs.get(init.operands[int(m.group(1))])
    if start is not None and start.opcode == "constant" and re.fullmatch(r"-?\d+", start.args.strip()):
        return int(start.args.strip())
    return 0


def multiplicities(module: HloModule, loops: bool = True) -> tuple[dict[str, float], list[str]]:
    """How many times each computation runs per execution of the entry, and unknown loops.

    Computations are printed callees-first, so walking them in reverse visits every caller
    before its callees. A while body/condition runs trip-count times per execution of its
    caller (with `loops=False`: once, which is how XLA's cost analysis counts it). A
    conditional runs one of its k branches: each counts 1/k (the devices of an SPMD program
    taking different branches of equal cost, as ring attention's hops do; counted whole, a
    two-way branch was counted twice).
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
                t = trip_count(module, ins, module.computations[comp])
                if t is None:
                    unknown.append(ins.name)
                trips = 1 if t is None else t
            branches = sum(role == "branch" for role, _ in calls)
            for role, callee in calls:
                if callee in module.computations:
                    share = trips if role in ("body", "condition") else 1 / branches if role == "branch" else 1
                    mult[callee] += mult[comp] * share
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
        lhs = arrays(shapes.get(ins.operands[0], "")) if ins.operands else []
        rhs = arrays(shapes.get(ins.operands[1], "")) if len(ins.operands) > 1 else []
        m = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", ins.attrs)
        if not lhs or not rhs or not m:
            return 0.0
        in_labels, labels, out_labels = m.groups()
        # kernel: 'i' input features, 'o' output features, digits spatial window dims. Only the
        # taps of a window that land on a real input element multiply anything: XLA:TPU writes
        # a batched matmul's gradients as convolutions whose window spans the batch over an
        # lhs-dilated input (one tap per output) or a zero-padded one (e.g. `pad=3_3` around
        # one element with a window of 4: one tap per output)
        window = _window_fields(ins.attrs)
        k = 1.0
        for lab, d in zip(labels, rhs[0][1]):
            if lab == "i":
                k *= d
            elif lab.isdigit():
                s = int(lab)
                field = lambda name, default: (window.get(name) or [default] * (s + 1))[s]
                n_in = lhs[0][1][in_labels.index(lab)]
                n_o = out[0][1][out_labels.index(lab)]
                lo = (window.get("pad") or [(0, 0)] * (s + 1))[s][0]
                k *= _mean_taps(n_in, n_o, d, field("stride", 1), lo, field("lhs_dilate", 1),
                                field("rhs_dilate", 1))
        return 2.0 * n_out * k
    return 0.0


def _mean_taps(n_in: int, n_out: int, size: int, stride: int, pad_lo: int, lhs_dilate: int,
               rhs_dilate: int) -> float:
    """Window taps per output position that land on an input element (not padding, not a hole
    of lhs dilation), averaged over the outputs of one spatial dimension."""
    span = (n_in - 1) * lhs_dilate + 1
    o = np.arange(n_out)[:, None] * stride
    idx = o + np.arange(size)[None, :] * rhs_dilate - pad_lo
    hits = (idx >= 0) & (idx < span) & (idx % lhs_dilate == 0)
    return float(hits.sum()) / max(n_out, 1)


def _window_fields(attrs: str) -> dict[str, list[int]]:
    """A convolution's window attribute, e.g. "window={size=264 stride=263 lhs_dilate=264}"
    -> {"size": [264], "stride": [263], "lhs_dilate": [264]} (one entry per spatial dim;
    "pad=0_0x3_3" -> {"pad": [(0, 0), (3, 3)]})."""
    m = re.search(r"window=\{([^}]*)\}", attrs)
    if not m:
        return {}
    out = {}
    for field in m.group(1).split():
        key, _, val = field.partition("=")
        if key == "pad" and re.fullmatch(r"[\d_x-]+", val):  # low_high per dim: "0_0x3_3"
            out[key] = [tuple(int(v) for v in p.split("_")) for p in val.split("x")]
        elif re.fullmatch(r"[\dx]+", val):
            out[key] = [int(v) for v in val.split("x")]
    return out


_NO_TRAFFIC = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "while",
               "call", "conditional", "after-all", "partition-id", "replica-id", "copy-done",
               "all-reduce-done", "all-gather-done", "collective-permute-done", "send-done",
               "recv-done", "opt-barrier", "async-start", "async-update", "async-done"}


_SLICING = ("dynamic-slice", "slice", "gather")
# ops that update their operand 0 in place (XLA shares its buffer with the result; where it
# cannot, copy insertion puts an explicit copy before them, counted as such): the operand index
# of the update, which is all they write. A KV cache's per-token scatter reads and writes the
# tokens, not the cache (counted whole, a 256k engine's decode read 4.4 TB a step it never moves).
_IN_PLACE = {"dynamic-update-slice": 1, "scatter": 2}


def _param_index(ins: Instr) -> int:
    return int(ins.args.strip() or 0)


def _fusion_access(instrs: list[Instr], computations: dict | None = None,
                   memo: dict | None = None) -> tuple[dict[int, float], float | None]:
    """Bytes a fused computation reads of each parameter, and writes (None = its result).

    A parameter only sliced inside the fusion (dynamic-slice of one layer of a stacked weight)
    is read for the slices' size, also where the slice sits in a fusion nested inside
    (`computations`: the module's, to look into them; XLA:TPU nests a dot's sliced operand so:
    the blockwise cached attention's 4096-slot block of a 256k cache read the whole cache per
    block); the buffer of an in-place dynamic-update-slice or scatter (_IN_PLACE) is not read,
    and only the update is written.
    """
    memo = {} if memo is None else memo
    shapes = {i.name: i.shape for i in instrs}
    users: dict[str, list[tuple[Instr, int]]] = defaultdict(list)
    for i in instrs:
        for pos, o in enumerate(i.operands):
            users[o].append((i, pos))

    def use_bytes(u: Instr, pos: int, full: float) -> float:
        if u.opcode in _SLICING and pos == 0:
            return nbytes(u.shape)
        if u.opcode in _IN_PLACE and pos == 0:
            return 0.0
        callee = dict(callees(u)).get("calls") if u.opcode == "fusion" else None
        if computations is not None and callee in computations:
            if callee not in memo:
                memo[callee] = _fusion_access(computations[callee], computations, memo)
            return memo[callee][0].get(pos, full)
        return full

    reads: dict[int, float] = {}
    for i in instrs:
        if i.opcode != "parameter":
            continue
        us = users.get(i.name, [])
        full = hbm_bytes(i.shape)
        if not full:  # a host-resident (or on-chip) buffer: no HBM read
            reads[_param_index(i)] = 0.0
        elif us:
            reads[_param_index(i)] = min(full, sum(use_bytes(u, pos, full) for u, pos in us))
        else:
            reads[_param_index(i)] = full
    root = instrs[-1] if instrs else None
    written = None
    if root is not None and root.opcode in _IN_PLACE and len(root.operands) > _IN_PLACE[root.opcode]:
        written = nbytes(shapes.get(root.operands[_IN_PLACE[root.opcode]], "")) if hbm_bytes(root.shape) else 0.0
    return reads, written


def _fused_access(module: HloModule) -> dict[str, tuple[dict[int, float], float | None]]:
    """`_fusion_access` of every computation a fusion calls."""
    fused: dict = {}
    for instrs in module.computations.values():
        for ins in instrs:
            if ins.opcode == "fusion":
                for role, c in callees(ins):
                    if role == "calls" and c in module.computations and c not in fused:
                        fused[c] = _fusion_access(module.computations[c], module.computations, fused)
    return fused


def _wrapped(module: HloModule) -> set[str]:
    """Computations behind `called_computations=` (module docstring): their wrapper's operands
    and result are their HBM traffic."""
    return {c for instrs in module.computations.values() for ins in instrs
            for role, c in callees(ins) if role == "called"}


def instruction_traffic(module: HloModule):
    """Yields (computation, instruction, HBM bytes of one run) for every top-level instruction
    of the non-fused computations: it reads its operands and writes its result (a fusion is one
    instruction: its internals stay on chip), with slices read for their size and in-place
    updates written for the update's size, as XLA's cost analysis does; arrays outside HBM
    (host memory, `hbm_bytes`) move nothing through it. A kernel that states its cost
    (`estimated_cost`) moves the bytes it states."""
    fused = _fused_access(module)
    skip = set(fused) | _wrapped(module)
    for comp, instrs in module.computations.items():
        if comp in skip:
            continue
        shapes = {i.name: i.shape for i in instrs}
        for i in instrs:
            if i.opcode in _NO_TRAFFIC:
                continue
            operand_bytes = [hbm_bytes(shapes.get(o, "")) for o in i.operands]
            written = hbm_bytes(i.shape)
            if i.opcode == "custom-call" and (stated := _stated_cost(i)) is not None:
                operand_bytes, written = [], stated[1]
            elif i.opcode == "fusion" and dict(callees(i)).get("calls") in fused:
                reads, w = fused[dict(callees(i))["calls"]]
                operand_bytes = [min(b, reads.get(k, b)) for k, b in enumerate(operand_bytes)]
                written = written if w is None else w
            elif i.opcode in _SLICING and operand_bytes:  # the slice is read, from HBM or not
                operand_bytes = [nbytes(i.shape) if operand_bytes[0] else 0.0] + operand_bytes[1:]
            elif i.opcode in _IN_PLACE and len(operand_bytes) > _IN_PLACE[i.opcode]:
                # the update is written in place, into HBM or into a host-resident buffer
                written = nbytes(shapes.get(i.operands[_IN_PLACE[i.opcode]], "")) if written else 0.0
                operand_bytes = operand_bytes[1:]
            yield comp, i, written + sum(operand_bytes)


def per_computation_costs(module: HloModule) -> dict[str, tuple[float, float]]:
    """(matmul FLOPs, HBM bytes) of each computation's own instructions, run once: bytes as
    `instruction_traffic`; matmul FLOPs count dots and convolutions wherever they sit, fused or
    not."""
    out = {}
    for comp, instrs in module.computations.items():
        shapes = {i.name: i.shape for i in instrs}
        flops = sum(dot_flops(module, i, shapes) for i in instrs if i.opcode in ("dot", "convolution"))
        out[comp] = (flops, 0.0)
    for comp, _, b in instruction_traffic(module):
        out[comp] = (out[comp][0], out[comp][1] + b)
    return out


_WRAPPER = re.compile(r"(?:vmap|jvp|transpose)\(")
# op_name path components that say where code ran, not what it is
_WHERE = re.compile(r"^(?:jit\(\w*step\w*\)|while|body|closed_call|cond|branch_\d+_fun|shard_map|checkpoint|"
                    r"rematted_computation|)$")


def source_op(ins: Instr) -> str:
    """What JAX op an HLO instruction came from, from its op_name metadata: "forward" or
    "backward" (a transpose), "(remat)" when recomputed, and the op with its enclosing named
    function or einsum spec (e.g. "backward: bthd,hde->bte/dot_general"); else its opcode."""
    m = re.search(r'op_name="([^"]*)"', ins.attrs)
    if not m:
        return ins.opcode
    name = m.group(1)
    phase = ("backward" if "transpose(" in name else "forward") + (
        " (remat)" if "rematted_computation" in name else "")
    kept = []
    for part in name.split("/"):
        n = 0
        while m := _WRAPPER.match(part):  # vmap(jvp(f)) -> f
            part, n = part[m.end():], n + 1
        part = part[: len(part) - n] if n else part
        if not _WHERE.match(part):
            kept.append(part)
    return f"{phase}: " + "/".join(kept[-2:])


def traffic_by_source(module: HloModule, runs: dict[str, float], top: int = 12) -> list[tuple[str, float]]:
    """HBM bytes per step of the XLA-visible instructions (`instruction_traffic` x runs), summed
    per `source_op`, largest first: what the HBM time of a step is spent on."""
    totals: dict[str, float] = defaultdict(float)
    for comp, ins, b in instruction_traffic(module):
        totals[source_op(ins)] += runs.get(comp, 0.0) * b
    return sorted(totals.items(), key=lambda kv: -kv[1])[:top]


_SPLASH = re.compile(r"splash_mh?q?a_(fwd|dq|dkv)")
# matmul widths per (query, key) pair of each splash kernel, in units of (dq, dv): the forward
# Q K^T and P V; dq recomputes Q K^T, dP = dO V^T, dQ = dS K; dkv recomputes Q K^T and does
# dV = P^T dO, dP = dO V^T, dK = dS^T Q; the fused backward (dkv returning dq too) adds dQ = dS K
_SPLASH_WIDTHS = {"fwd": (1, 1), "dq": (2, 1), "dkv": (2, 2), "fused": (3, 2)}


def splash_cost(ins: Instr, shapes: dict[str, str]) -> tuple[float, float]:
    """(matmul FLOPs, HBM bytes XLA does not see) of one splash attention kernel call.

    Pallas kernels are opaque custom calls to XLA's cost analysis (their FLOPs count as zero;
    their operands are read once). Operands q `[.., Tq, dq]`, k `[.., S, dq]`, v `[.., S, dv]`
    (leading dims: rows x heads). The kernels here are causal (coder.model.attention_kernels):
    key blocks past a query block's last position are skipped; the busiest device's share
    of the pairs is `visited_fraction` (queries split over S / Tq shards in zigzag order: ~1/2).
    Bytes: the kernel streams K and V once per query block (Q and dO once per key block for
    dkv), read again beyond the one read XLA counts. A ring attention's whole blocks (every key
    visible; coder.model.context_parallel's FULL_BLOCK_SCOPE in the op's name) visit every pair.
    """
    from coder.model.attention_kernels import block_len, visited_fraction
    from coder.model.context_parallel import FULL_BLOCK_SCOPE

    kind = _SPLASH.search(ins.name).group(1)
    if kind == "dkv" and sum(len(d) >= 3 for _, d in arrays(ins.shape)) >= 3:
        kind = "fused"  # dq, dk and dv out of one kernel
    floats = [arrays(shapes.get(o, "")) for o in ins.operands]
    floats = [(dt, d) for a in floats for dt, d in a if dt in ("bf16", "f32", "f16") and len(d) >= 3]
    if len(floats) < 3:
        return 0.0, 0.0
    (qt, q), (kt, k), (vt, v) = floats[:3]
    lead, tq, dq = math.prod(q[:-2]), q[-2], q[-1]
    s, dv = k[-2], v[-1]
    try:
        frac = 1.0 if FULL_BLOCK_SCOPE in ins.attrs else visited_fraction(tq, s)
    except ValueError:  # lengths no kernel block divides: not one of coder's kernels
        frac = 1.0
    wq, wv = _SPLASH_WIDTHS[kind]
    flops = 2.0 * lead * tq * s * (wq * dq + wv * dv) * frac
    q_bytes = math.prod(q) * _DTYPE_BYTES[qt]
    kv_bytes = math.prod(k) * _DTYPE_BYTES[kt] + math.prod(v) * _DTYPE_BYTES[vt]
    try:
        if kind in ("dkv", "fused"):  # Q and dO (v's width) per key block
            rereads = (s // block_len(s) - 1) * (q_bytes + q_bytes * dv / dq)
        else:
            rereads = (tq // block_len(tq) - 1) * kv_bytes
    except ValueError:
        rereads = 0.0
    return flops, rereads * frac


_MEGABLOX = re.compile(r"^t?gmm(\.\d+)?$")


def megablox_flops(ins: Instr, shapes: dict[str, str]) -> float:
    """2 m k n of one megablox call, as its cost estimate states it (every row of its input):
    gmm x `[m, k]` -> `[m, n]`; tgmm x `[m, k]`, dy `[m, n]` -> `[G, k, n]`."""
    mats = [d for o in ins.operands for _, d in arrays(shapes.get(o, "")) if len(d) == 2]
    out = arrays(ins.shape)
    if not mats or not out:
        return 0.0
    m, k = mats[0]
    return 2.0 * m * k * out[0][1][-1]


_ESTIMATE = re.compile(r'cost_estimate\W*\{([^}]*)\}')


def estimated_cost(ins: Instr) -> tuple[float, float] | None:
    """(FLOPs, bytes) of a Pallas kernel's own `pl.CostEstimate` (in its backend_config), or
    None where it states none."""
    m = _ESTIMATE.search(ins.attrs)
    if m is None:
        return None
    field = lambda key: re.search(key + r'\W*:\W*([0-9.eE+]+)', m.group(1))  # a number, or one in quotes
    flops, nbytes = field("flops"), field("bytes_accessed")
    return float(flops.group(1)) if flops else 0.0, float(nbytes.group(1)) if nbytes else 0.0


def _stated_cost(ins: Instr) -> tuple[float, float] | None:
    """`estimated_cost` of a kernel that `kernel_costs` counts by its estimate: not splash
    (counted from its shapes) nor megablox (its estimate scaled by the routed rows)."""
    if _SPLASH.search(ins.name) or _MEGABLOX.match(ins.name):
        return None
    return estimated_cost(ins)


def kernel_costs(module: HloModule, gmm_scale: float = 1.0) -> dict[str, tuple[float, float, float]]:
    """Per computation, run once: (FLOPs of its Pallas kernel calls, bytes XLA's cost analysis
    does not see, FLOPs XLA's cost analysis does count for them).

    splash attention (`splash_cost`): counted by XLA as zero. megablox (gmm / tgmm): XLA counts
    its cost estimate, 2 m k n over every row of its input; the kernel's grid only visits the
    row tiles of its groups, so its FLOPs are the estimate x gmm_scale, the fraction of rows
    the routing fills (coder.model.expert_dispatch.grouped_rows_fraction). Any other kernel
    with a cost estimate (coder's NSA kernels, coder/pallas/nsa/tpu.py): its FLOPs as it
    states them, which XLA counts (measured: XLA:TPU's FLOPs for NSA's six kernels at 256
    tokens were their estimates' sum plus 0.6%); its bytes are `instruction_traffic`'s."""
    out = {}
    for comp, instrs in module.computations.items():
        shapes = {i.name: i.shape for i in instrs}
        f = b = seen = 0.0
        for i in instrs:
            if i.opcode != "custom-call":
                continue
            if _SPLASH.search(i.name):
                df, db = splash_cost(i, shapes)
                f, b = f + df, b + db
            elif _MEGABLOX.match(i.name):
                est = megablox_flops(i, shapes)
                f, seen = f + gmm_scale * est, seen + est
            elif (stated := _stated_cost(i)) is not None:
                f, seen = f + stated[0], seen + stated[0]
        if f or b or seen:
            out[comp] = (f, b, seen)
    return out


def loop_corrected_cost(module: HloModule, xla_flops: float, xla_bytes: float,
                        gmm_scale: float = 1.0) -> tuple[float, float]:
    """XLA's per-step FLOPs and bytes, plus each computation's own matmul FLOPs and bytes times
    the runs XLA's cost analysis misses (it counts a loop body once, not once per trip), with
    the Pallas kernels' FLOPs and bytes put in for every run in place of what XLA counted of
    them (`kernel_costs`)."""
    runs, _ = multiplicities(module, loops=True)
    counted, _ = multiplicities(module, loops=False)
    flops, traffic = xla_flops, xla_bytes
    for comp, (f, b) in per_computation_costs(module).items():
        extra = runs.get(comp, 0.0) - counted.get(comp, 0.0)
        if extra > 0:
            flops += extra * f
            traffic += extra * b
    for comp, (f, b, seen) in kernel_costs(module, gmm_scale).items():
        flops += runs.get(comp, 0.0) * f - counted.get(comp, 0.0) * seen
        traffic += runs.get(comp, 0.0) * b
    return flops, traffic
