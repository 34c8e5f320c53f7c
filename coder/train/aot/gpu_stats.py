"""A step compiled by XLA:GPU without a GPU, read off its optimized HLO: FLOPs, HBM bytes, the
Triton kernels' costs and the collectives split between NVLink (inside a node) and InfiniBand
(between nodes).

XLA:GPU's deviceless compile (coder.train.aot.hardware.gpu_devices) gives no cost analysis
(`compiled.cost_analysis()` is None), so everything here is counted from the HLO text with
coder.train.aot.hlo_stats's walk (loop trip counts, each computation's runs per step):

  matmul FLOPs   2 x output elements x contracted elements of every dot and convolution, fused
                 or not (XLA:GPU wraps its GEMMs in Triton fusions or cuBLAS calls, the dot stays
                 inside), times its computation's runs; elementwise FLOPs are not counted (the
                 roofline's compute time is the tensor cores');
  HBM bytes      every top-level instruction reads its operands and writes its result
                 (`hlo_stats.instruction_traffic`), times its runs; a fusion's internals stay on
                 chip; a kernel's re-reads beyond one read of each operand are added where they
                 miss the L2 (`flash_cost`);
  kernels        coder's Pallas-Triton flash attention (coder.pallas.flash_gpu) and grouped
                 matmuls (coder.pallas.grouped_matmul_gpu) from their operand shapes
                 (`flash_cost`, `gmm_cost`); any other Triton / Mosaic-GPU call is listed,
                 uncounted, under `uncounted_kernels`;
  collectives    per kind as hlo_stats counts them; one whose replica groups (or permute pairs)
                 hold devices of two nodes (device id // GPUs per node; the mesh takes the
                 devices in id order) is filed under `dcn`, the InfiniBand part of the roofline.
"""
from __future__ import annotations

import math
import re
from collections import defaultdict

import numpy as np

from coder.train.aot import hlo_stats
from coder.train.aot.hlo_stats import HloModule, Instr

# ============================================================================= kernels

_TRITON = re.compile(r'custom_call_target="(__gpu\$xla\.gpu\.triton|mosaic_gpu[\w$.]*)"')
_KERNEL_NAME = re.compile(r'\bname = "([^"]+)"')
_OP_NAME = re.compile(r'op_name="[^"]*?(\w+)/pallas_call"')
# matmul widths per visited (query, key) pair of each flash kernel in units of (q width, v width):
# forward Q K^T and P V; dq recomputes Q K^T, dP = dO V^T, dQ = dS K; dkv recomputes Q K^T and
# does dV = P^T dO, dP = dO V^T, dK = dS^T Q
FLASH_WIDTHS = {"flash_fwd_at_positions": (1, 1), "flash_dq_at_positions": (2, 1), "flash_dkv_at_positions": (2, 2)}


def kernel_name(ins: Instr) -> str | None:
    """The Pallas kernel's name of a Triton / Mosaic-GPU custom call, else None."""
    m = _TRITON.search(ins.attrs) if ins.opcode == "custom-call" else None
    if m is None:
        return None
    name = _KERNEL_NAME.search(ins.attrs) or _OP_NAME.search(ins.attrs)
    return name.group(1) if name else m.group(1)


def flash_visited(kind: str, tq: int, s: int, tiles=None) -> float:
    """The fraction of its [tq, s] (query, key) pairs a flash kernel computes: whole tiles of
    coder.pallas.flash_gpu.Tiles, causal skipping by position, the queries a device holds in
    zigzag order when they are a share of the row (tq < s, coder.model.attention_kernels'
    context parallelism; the busiest share), the row in order otherwise."""
    from coder.model.context_parallel import zigzag_positions
    from coder.pallas.flash_gpu import Tiles

    t = tiles or Tiles()
    n = s // tq
    pos = zigzag_positions(s, n) if n > 1 else np.arange(s)
    pos = pos.reshape(n, tq)
    if kind == "flash_dkv_at_positions":  # key blocks; a query block is visited if its last position reaches it
        bq, bk = t.block_q_bwd, t.block_k_bwd
        last = pos.reshape(n, tq // bq, bq).max(-1)  # [shard, query block]
        starts = np.arange(s // bk) * bk
        visited = (last[:, :, None] >= starts[None, None, :]).sum((1, 2))
        return float(visited.max() * bq * bk) / (tq * s)
    bq, bk = (t.block_q, t.block_k) if kind == "flash_fwd_at_positions" else (t.block_q_bwd, t.block_k_bwd)
    last = pos.reshape(n, tq // bq, bq).max(-1)
    visited = np.minimum(last // bk + 1, s // bk).sum(-1)
    return float(visited.max() * bq * bk) / (tq * s)


def flash_cost(kind: str, q: tuple, k: tuple, v: tuple, itemsize: int = 2, tiles=None,
               l2_bytes: float = 0.0, whole: bool = False) -> tuple[float, float]:
    """(matmul FLOPs, HBM bytes beyond one read of each operand) of one flash kernel call.

    q `[B, Tq, H, wq]`, k `[B, S, H, wq]`, v `[B, S, H, wv]` as the kernel receives them (q and k
    in power-of-two column parts, MLA's 192 as 128 + 64; other widths padded to a power of two,
    so the padding's FLOPs count, as the GPU does them). FLOPs: 2 x B x H x visited pairs x (FLASH_WIDTHS in q / v widths). Bytes: the forward
    and dq kernels stream the key and value tiles once per query tile, dkv the query, dO
    (v's width), lse and delta once per key tile, over the visited fraction. The grid walks one
    (row, head)'s tiles consecutively, so the SMs' concurrent programs stream the same keys and
    values: while one (row, head)'s streamed operands fit the GPU's L2 (`l2_bytes`; 50 MiB on an
    H100: 2k-32k tokens at MLA's widths) the re-reads are L2 hits, not HBM traffic (0 here).
    `whole`: a ring attention's whole block (every key visible, coder.model.context_parallel)."""
    from coder.pallas.flash_gpu import Tiles

    t = tiles or Tiles()
    b, tq, h, wq = q
    s, wv = k[1], v[-1]
    frac = 1.0 if whole else flash_visited(kind, tq, s, t)
    mq, mv = FLASH_WIDTHS[kind]
    flops = 2.0 * b * h * tq * s * frac * (mq * wq + mv * wv)
    if kind == "flash_dkv_at_positions":
        streamed = tq * ((wq + wv) * itemsize + 8)  # one (row, head)'s q, dO and float32 lse, delta
        tiles_n = s // t.block_k_bwd
    else:
        streamed = s * (wq + wv) * itemsize  # one (row, head)'s k, v
        tiles_n = tq // (t.block_q if kind == "flash_fwd_at_positions" else t.block_q_bwd)
    if streamed <= l2_bytes:
        return flops, 0.0
    return flops, max(tiles_n - 1, 0) * frac * b * h * streamed


# coder.pallas.grouped_matmul_gpu's kernels: (operand index of the rows [M, K], of the weight
# [G, K, N] or cotangent [M, N]) and the rows a program multiplies at once (Tiles' defaults:
# the forward's row tile, tgmm's row chunk)
GMM_KERNELS = {"grouped_matmul_gpu": (3, 4), "tgmm_gpu": (2, 3)}


def gmm_cost(name: str, x: tuple, other: tuple, groups: int, gmm_scale: float = 1.0) -> tuple[float, float]:
    """(matmul FLOPs, HBM bytes beyond one read of each operand) of one grouped matmul call.

    x `[M, K]`; other `[G, K, N]` (grouped_matmul_gpu: w) or `[M, N]` (tgmm_gpu: dy). FLOPs:
    2 x K x N x the rows it multiplies, the routed ones (`gmm_scale` of M: the all-gather or
    ragged dispatch's buffer holds more rows than pairs) plus half a tile of rows per group (the
    last tile of a group is multiplied whole, its rows past the group masked). Bytes: none beyond
    one read: the programs in flight share a row tile and their group's weight (forward) or a
    group's rows (tgmm), which the L2 serves after the first read (the kernels' grid orders)."""
    from coder.pallas.grouped_matmul_gpu import Tiles

    t = Tiles()
    m, k = x
    n = other[-1]
    rows_at_once = t.block_m if name == "grouped_matmul_gpu" else t.block_k
    return 2.0 * k * n * (m * gmm_scale + groups * rows_at_once / 2), 0.0


def _kernel_cost(name: str, ins: Instr, shapes: dict[str, str], l2_bytes: float,
                 gmm_scale: float = 1.0) -> tuple[float, float] | None:
    if name in GMM_KERNELS:
        ops = [hlo_stats.arrays(shapes.get(o, "")) for o in ins.operands]
        ix, io = GMM_KERNELS[name]
        if len(ops) <= io or not (len(ops[ix]) == 1 and len(ops[io]) == 1):
            return None
        other = ops[io][0][1]
        # the groups: the weight's leading axis, or tgmm's first operand (each group's first row)
        groups = other[0] if len(other) == 3 else (ops[0][0][1][0] if ops[0] and ops[0][0][1] else 0)
        return gmm_cost(name, ops[ix][0][1], other, groups, gmm_scale)
    if name not in FLASH_WIDTHS:
        return None
    ops = [hlo_stats.arrays(shapes.get(o, "")) for o in ins.operands[:3]]
    if len(ops) < 3 or not all(len(a) == 1 and len(a[0][1]) == 4 for a in ops):
        return None
    (dt, q), (_, k), (_, v) = (a[0] for a in ops)
    from coder.model.context_parallel import FULL_BLOCK_SCOPE

    return flash_cost(name, q, k, v, int(hlo_stats._DTYPE_BYTES[dt]), l2_bytes=l2_bytes,
                      whole=FULL_BLOCK_SCOPE in ins.attrs)


# ============================================================================= the step's cost

def step_cost(module: HloModule, runs: dict[str, float], l2_bytes: float = 0.0, gmm_scale: float = 1.0) -> dict:
    """FLOPs and HBM bytes of one step (module docstring), from each computation's `runs`, on a
    GPU of `l2_bytes` of L2 (`flash_cost`), the grouped matmuls at `gmm_scale` of their rows
    routed (`gmm_cost`):

      matmul_flops, kernel_flops (by kernel name), flops (their sum), bytes_accessed,
      kernel_bytes (the kernels' re-reads, in bytes_accessed), uncounted_kernels (name -> calls
      per step of Triton / Mosaic-GPU kernels whose cost is not known here).
    """
    per = hlo_stats.per_computation_costs(module)
    matmul = sum(runs.get(c, 0.0) * f for c, (f, _) in per.items())
    traffic = sum(runs.get(c, 0.0) * b for c, (_, b) in per.items())
    kernel_flops: dict[str, float] = defaultdict(float)
    kernel_bytes = 0.0
    uncounted: dict[str, float] = defaultdict(float)
    for comp, instrs in module.computations.items():
        r = runs.get(comp, 0.0)
        if not r:
            continue
        shapes = {i.name: i.shape for i in instrs}
        for ins in instrs:
            name = kernel_name(ins)
            if name is None:
                continue
            cost = _kernel_cost(name, ins, shapes, l2_bytes, gmm_scale)
            if cost is None:
                uncounted[name] += r
                continue
            kernel_flops[name] += r * cost[0]
            kernel_bytes += r * cost[1]
    return dict(matmul_flops=matmul, kernel_flops=dict(kernel_flops), flops=matmul + sum(kernel_flops.values()),
                bytes_accessed=traffic + kernel_bytes, kernel_bytes=kernel_bytes, uncounted_kernels=dict(uncounted))


# ============================================================================= collectives

_GROUPS = re.compile(r"replica_groups=\{((?:\{[\d,\s]*\},?\s*)*)\}")
_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")


def device_groups(attrs: str, num_devices: int) -> list[list[int]]:
    """The device groups of a collective: replica_groups in its explicit ({{0,1},{2,3}}) or iota
    ([2,4]<=[4,2]T(1,0)) form, a permute's source-target pairs, or every device ({})."""
    m = _PAIRS.search(attrs)
    if m:
        return [[int(x) for x in p.split(",")] for p in re.findall(r"\{(\d+,\d+)\}", m.group(1))]
    m = _IOTA.search(attrs)
    if m:
        shape = [int(x) for x in m.group(1).split(",")]
        ids = np.arange(math.prod(int(x) for x in m.group(2).split(","))).reshape(
            [int(x) for x in m.group(2).split(",")])
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        return ids.reshape(-1, shape[-1]).tolist()
    m = _GROUPS.search(attrs)
    if m and m.group(1).strip():
        return [[int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([\d,\s]*)\}", m.group(1))]
    return [list(range(num_devices))]


def crosses_nodes(attrs: str, num_devices: int, gpus_per_node: int) -> bool:
    """Whether any group of the collective holds devices of two nodes."""
    return any(len({d // gpus_per_node for d in g}) > 1 for g in device_groups(attrs, num_devices))


def collective_stats(module: HloModule, runs: dict[str, float], num_devices: int,
                     gpus_per_node: int) -> dict[str, dict[str, float]]:
    """`hlo_stats.collective_stats` for GPU nodes: per kind `count` in the HLO, `executed` per
    step, result `bytes` and `wire_bytes` sent per device (ring estimate, hlo_stats.wire_bytes);
    collectives whose groups span nodes are summed under `dcn` (InfiniBand), the others under
    their kind (NVLink)."""
    skip = hlo_stats._fused_collective_bodies(module)
    stats = {k: dict(count=0, executed=0.0, bytes=0.0, wire_bytes=0.0) for k in hlo_stats.KINDS}
    for comp, instrs in module.computations.items():
        r = runs.get(comp, 0.0)
        if comp in skip or r == 0:
            continue
        for ins in instrs:
            c = hlo_stats._collective(module, ins, num_devices, 1)
            if c is None:
                continue
            kind, size, n = c
            s = stats["dcn" if crosses_nodes(ins.attrs, num_devices, gpus_per_node) else kind]
            s["count"] += 1
            s["executed"] += r
            s["bytes"] += r * size
            s["wire_bytes"] += r * hlo_stats.wire_bytes(kind, size, n)
    return stats


# ============================================================================= the roofline at measured rates

def roofline_at_rates(chip, num_chips: int, cost: dict, collectives: dict, model_flops: float, *,
                      matmul_flops_per_s: float, kernel_flops_per_s: dict[str, float],
                      hbm_bytes_per_s: float | None = None) -> dict:
    """coder.train.aot.hardware.roofline with measured rates in place of the chip's peaks: the
    XLA matmuls at `matmul_flops_per_s`, each kernel at its own rate (`kernel_flops_per_s` by
    name; a kernel without one at the matmul rate), HBM at `hbm_bytes_per_s` (the chip's figure
    when None), collectives at the chip's NVLink / InfiniBand figures. MFU stays model FLOPs
    over the chip's peak x the step time, so it reads against `roofline`'s."""
    compute = cost["matmul_flops"] / matmul_flops_per_s + sum(
        f / kernel_flops_per_s.get(k, matmul_flops_per_s) for k, f in cost["kernel_flops"].items())
    ici_wire = sum(v["wire_bytes"] for k, v in collectives.items() if k != "dcn")
    dcn_wire = collectives.get("dcn", {}).get("wire_bytes", 0.0)
    parts = dict(compute_s=compute, hbm_s=cost["bytes_accessed"] / (hbm_bytes_per_s or chip.hbm_bandwidth),
                 ici_s=ici_wire / chip.ici_bandwidth, dcn_s=dcn_wire / chip.dcn_bandwidth)
    lower, serial = max(parts.values()), sum(parts.values())
    peak_total = num_chips * chip.peak_bf16_flops
    return dict(**parts, step_time_lower_s=lower, step_time_serial_s=serial,
                bound=max(parts, key=parts.get).removesuffix("_s"), model_flops=model_flops,
                mfu_upper=model_flops / (peak_total * lower) if lower else 0.0,
                mfu_lower=model_flops / (peak_total * serial) if serial else 0.0,
                matmul_flops_per_s=matmul_flops_per_s, kernel_flops_per_s=dict(kernel_flops_per_s),
                hbm_bytes_per_s=hbm_bytes_per_s or chip.hbm_bandwidth)


def measured_rates(chip_name: str) -> dict | None:
    """`roofline_at_rates`' keywords from coder.train.aot.hardware.MEASURED (None for a chip
    never measured): the matmul rate, and one rate for the three flash kernels, their compiled
    FLOPs at the measured shape (`flash_cost`, widths padded as the kernel pads them) over the
    measured forward + backward time."""
    from coder.train.aot.hardware import MEASURED

    m = MEASURED.get(chip_name)
    if m is None:
        return None
    f = m["flash"]
    wq, wv = 1 << (f["dq"] - 1).bit_length(), 1 << (f["dv"] - 1).bit_length()
    q = (f["batch"], f["seq"], f["heads"], wq)
    v = (f["batch"], f["seq"], f["heads"], wv)
    flops = sum(flash_cost(kind, q, q, v)[0] for kind in FLASH_WIDTHS)
    rate = flops / f["seconds"]
    return dict(matmul_flops_per_s=m["matmul_flops_per_s"], kernel_flops_per_s={k: rate for k in FLASH_WIDTHS})
