"""TPU chips and slice topologies, GPUs and their nodes: the published figures the compile report's
roofline uses.

Every figure is per chip, from Google Cloud's TPU system-architecture pages (retrieved 2026):
  v4   https://cloud.google.com/tpu/docs/v4   "275 teraflops (bf16)", "32 GiB, 1200 GBps"
  v5e  https://cloud.google.com/tpu/docs/v5e  "197 TFLOPs", "16 GB, 819 GBps",
       "bidirectional ICI bandwidth (per chip) 400 GBps", "2 x 100 Gbps NIC" per 8-chip host
  v5p  https://cloud.google.com/tpu/docs/v5p  "459 TFLOPs", "95 GB, 2765 GBps",
       "bidirectional ICI bandwidth per chip 1200 GBps", "DCN bandwidth per chip 50 Gbps"
  v6e  https://cloud.google.com/tpu/docs/v6e  "918 TFLOPs", "32 GB", "1638 GBps",
       "bidirectional ICI bandwidth (per chip) 800 GBps", 8 chips per host
Not on those pages (marked `*_assumed` below, and printed as such in the reports):
  v4 ICI: 6 links x 45 GB/s per direction (the JAX scaling book's TPU table,
  https://jax-ml.github.io/scaling-book/tpus) = 540 GB/s bidirectional per chip.
  v4 and v6e DCN per chip: v4 hosts have a 200 Gbps NIC for 4 chips (50 Gbps per chip, as v5p);
  v6e is taken at v5e's 25 Gbps per chip (6.4 Tbps per 256-chip pod) as a lower bound.

HBM "GB" on those pages is used as GiB for v4/v5p ("GiB" in the v4/v5p tables) and as 10^9
bytes for v5e/v6e, as printed; the difference only moves the fit margin by ~7%.

A chip is one JAX device on every generation here: v4 and v5p run their two TensorCores as one
"megacore" device, so peak FLOP/s and HBM are per device too.

GPUs (`GPU_CHIPS`, `GpuTopology`): `compile.topology` = "h100" (one GPU), "h100-8" (one node of
8 GPUs; "h100-N" for N <= 8), "h100-8x32" (32 nodes of 8 GPUs: GPUs per node x nodes); h200 and
b200 alike. XLA:GPU compiles for them without a GPU: jax's CUDA plugin (the `gpu-compile` extra:
jax-cuda12-plugin and jax-cuda12-pjrt matching jaxlib, no NVIDIA libraries) builds compile-only
devices from a GpuTargetConfigProto (the CUDA device properties XLA compiles against: SMs,
shared memory per block, L2, compute capability), vendored from XLA in gpu_specs/ (each file
names its source). Figures per GPU, SXM parts, NVIDIA's pages (retrieved 2026; their tensor
FLOP/s are "with sparsity": the dense figures here are half):
  h100  https://www.nvidia.com/en-us/data-center/h100/  H100 SXM: "BF16 Tensor Core 1,979
        teraFLOPS*", "FP8 Tensor Core 3,958 teraFLOPS*", "80GB", "3.35TB/s", "NVLink: 900GB/s"
  h200  https://www.nvidia.com/en-us/data-center/h200/  H200 SXM: "BF16 Tensor Core 1,979
        TFLOPS*", "FP8 Tensor Core 3,958 TFLOPS*", "141GB", "4.8TB/s", "NVLink: 900GB/s"
  b200  https://www.nvidia.com/en-us/data-center/hgx/  HGX B200 (8 GPUs): "FP16/BF16 Tensor
        Core 36 PFLOPS*", "FP8 Tensor Core 72 PFLOPS*", "64TB/s" HBM bandwidth, "NVLink 1.8TB/s"
        per GPU -> per GPU 2.25 / 4.5 PFLOP/s dense, 8 TB/s
HBM capacity is the device memory CUDA reports, the target config's `device_memory_size`
(84942979072 B for an H100 "80GB"). JAX's allocator preallocates 75% of it and runs out there
(https://docs.jax.dev/en/latest/gpu_memory_allocation.html: "JAX will preallocate 75% of the
total GPU memory", XLA_PYTHON_CLIENT_MEM_FRACTION changes it): the fit check is against that
pool (63.7 GB on an H100). NVLink is counted per direction (900 GB/s is both directions of 18
links: a GPU sends 450 GB/s while it receives 450; a ring's wire bytes are what it sends), as
the collectives' `ici` part; between nodes each GPU has its own 400 Gb/s InfiniBand NIC
(ConnectX-7, one per GPU in DGX H100 / H200 / B200:
https://docs.nvidia.com/dgx/dgxh100-user-guide/introduction-to-dgxh100.html, .../dgxb200-user-
guide/introduction-to-dgxb200.html): 50 GB/s per direction, the `dcn` part.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import re
from importlib.metadata import version

GB = 10**9
GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str  # generation as the user names it: v4, v5e, v5p, v6e
    topology_prefix: str  # libtpu's name in "prefix:AxB[xC]" topology strings
    device_kind: str  # jax Device.device_kind of the compile-only devices
    hbm_bytes: int  # HBM capacity per chip
    peak_bf16_flops: float  # dense bf16 matmul FLOP/s per chip
    hbm_bandwidth: float  # bytes/s per chip
    ici_bandwidth: float  # bytes/s per chip, bidirectional, summed over its ICI links
    dcn_bandwidth: float  # bytes/s per chip across slices (data-centre network)
    torus_dims: int  # 2 (v5e, v6e) or 3 (v4, v5p)
    chip_config: str  # libtpu chip config: "megacore" (two TensorCores, one device) | "default"
    cores_per_chip: int  # TensorCores per chip; "v5p-N" / "v4-N" count cores, v5e/v6e count chips
    assumed: tuple[str, ...] = ()  # fields not on the published pages (see module docstring)


CHIPS: dict[str, Chip] = {
    "v4": Chip("v4", "v4", "TPU v4", 32 * GiB, 275e12, 1200 * GB, 540 * GB, 50e9 / 8, 3,
               "megacore", 2, assumed=("ici_bandwidth", "dcn_bandwidth")),
    "v5e": Chip("v5e", "v5e", "TPU v5 lite", 16 * GB, 197e12, 819 * GB, 400 * GB, 25e9 / 8, 2,
                "default", 1),
    "v5p": Chip("v5p", "v5", "TPU v5", 95 * GiB, 459e12, 2765 * GB, 1200 * GB, 50e9 / 8, 3,
                "megacore", 2),
    "v6e": Chip("v6e", "v6e", "TPU v6 lite", 32 * GB, 918e12, 1638 * GB, 800 * GB, 25e9 / 8, 2,
                "default", 1, assumed=("dcn_bandwidth",)),
}

# Slice shapes by chip count. 2D generations (v5e, v6e: 4 chips per host in a 2x2 block, up to
# 16x16); 3D generations (v4, v5p: 2x2x1 chips per host, cubes of 4x4x4 beyond 64 chips).
_SHAPES_2D = {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8),
              128: (8, 16), 256: (16, 16)}
_SHAPES_3D = {4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4), 64: (4, 4, 4),
              128: (4, 4, 8), 256: (4, 8, 8), 512: (8, 8, 8), 1024: (8, 8, 16),
              2048: (8, 16, 16), 4096: (16, 16, 16), 6144: (16, 16, 24)}


@dataclasses.dataclass(frozen=True)
class Topology:
    chip: Chip
    shape: tuple[int, ...]  # chips per slice along each torus dimension
    num_slices: int  # slices joined over DCN

    @property
    def chips_per_slice(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def num_chips(self) -> int:
        return self.chips_per_slice * self.num_slices

    @property
    def libtpu_name(self) -> str:
        """e.g. "v5:4x8x8" (what jax.experimental.topologies.get_topology_desc takes)."""
        return f"{self.chip.topology_prefix}:{'x'.join(map(str, self.shape))}"

    @property
    def name(self) -> str:
        """Cloud's accelerator type, e.g. "v5p-512" (cores for v4/v5p, chips for v5e/v6e)."""
        base = f"{self.chip.name}-{self.chips_per_slice * self.chip.cores_per_chip}"
        return base if self.num_slices == 1 else f"{self.num_slices}x{base}"

    @property
    def chips_per_host_bounds(self) -> tuple[int, int, int]:
        """Chips per host along each dimension: a 2x2 block (single-chip slices: 1x1)."""
        if self.chips_per_slice == 1:
            return (1, 1, 1)
        return (2, 2, 1)


def parse_topology(spec: str, num_slices: int = 1) -> Topology:
    """"v5p-512" (Cloud accelerator type) or "v5p:4x8x8" / "v6e:16x16" (explicit shape); a GPU
    target ("h100", "h100-8", "h100-8x32": `parse_gpu_topology`) gives a GpuTopology.

    Raises ValueError naming the accepted forms when `spec` is not one of them.
    """
    spec = spec.strip()
    if _GPU_SPEC.fullmatch(spec):
        return parse_gpu_topology(spec, num_slices)
    if num_slices < 1:
        raise ValueError(f"mesh.num_slices={num_slices}: must be >= 1")
    m = re.fullmatch(r"(v4|v5e|v5p|v6e)[-:](.+)", spec)
    if not m:
        raise ValueError(f"compile.topology={spec!r}: expected e.g. 'v5e-4', 'v5p-512', "
                         f"'v6e-256' or 'v5p:4x8x8' (chips: {sorted(CHIPS)}), or a GPU target: "
                         f"'h100', 'h100-8', 'h100-8x32' (GPUs: {sorted(GPU_CHIPS)})")
    chip = CHIPS[m.group(1)]
    rest = m.group(2)
    table = _SHAPES_3D if chip.torus_dims == 3 else _SHAPES_2D
    if "x" in rest:
        shape = tuple(int(s) for s in rest.split("x"))
        if len(shape) != chip.torus_dims:
            raise ValueError(f"compile.topology={spec!r}: {chip.name} slices have "
                             f"{chip.torus_dims} dimensions")
    else:
        units = int(rest)
        if units % chip.cores_per_chip:
            raise ValueError(f"compile.topology={spec!r}: {chip.name}-N counts TensorCores "
                             f"({chip.cores_per_chip} per chip)")
        chips = units // chip.cores_per_chip
        if chips not in table:
            sizes = sorted(c * chip.cores_per_chip for c in table)
            raise ValueError(f"compile.topology={spec!r}: no standard {chip.name} slice of "
                             f"{units}; known sizes {sizes}, or give a shape like "
                             f"'{chip.name}:{'x'.join(map(str, next(iter(table.values()))))}'")
        shape = table[chips]
    return Topology(chip, shape, int(num_slices))


def topology_devices(topo: Topology) -> list:
    """Compile-only TPU devices of `topo` from libtpu, on any host (no TPU needed).

    jax.devices() stays the CPU backend: these devices can only be used to lower and compile
    (AOT), which is what `stage=compile` does. Needs the `tpu` extra (libtpu). A GpuTopology's
    devices come from the CUDA plugin (`gpu_devices`).
    """
    if isinstance(topo, GpuTopology):
        return gpu_devices(topo)

    from jax.experimental import topologies

    # libtpu takes a machine-wide lock (/tmp/libtpu_lockfile) so that two processes never
    # drive the same chips; compile-only devices drive none, so several compiles may run at once
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        desc = topologies.get_topology_desc(
            topology_name=topo.libtpu_name,
            platform="tpu",
            chip_config_name=topo.chip.chip_config,
            chips_per_host_bounds=topo.chips_per_host_bounds,
            num_slices=topo.num_slices,
        )
    except RuntimeError as e:  # libtpu missing: say how to get it
        raise RuntimeError(f"cannot build TPU topology {topo.libtpu_name}: {e}. Install the "
                           f"tpu extra: pip install -e '.[tpu]'") from e
    devices = list(desc.devices)
    if len(devices) != topo.num_chips:
        raise RuntimeError(f"libtpu gave {len(devices)} devices for {topo.name}, expected "
                           f"{topo.num_chips}")
    return devices


# ============================================================================= GPUs

@dataclasses.dataclass(frozen=True)
class GpuChip:
    """One NVIDIA GPU as a compile target (figures and sources: the module docstring)."""

    name: str  # as compile.topology names it: h100, h200, b200
    device_kind: str  # jax Device.device_kind of its compile-only devices (the target config's name)
    target_config: str  # its GpuTargetConfigProto, a file of gpu_specs/
    hbm_bytes: int  # device memory as CUDA reports it (the target config's device_memory_size)
    peak_bf16_flops: float  # dense bf16 tensor-core FLOP/s
    peak_fp8_flops: float  # dense fp8 tensor-core FLOP/s
    hbm_bandwidth: float  # bytes/s
    nvlink_bandwidth: float  # bytes/s a GPU sends over NVLink (one direction) inside its node
    ib_bandwidth: float  # bytes/s a GPU sends over its InfiniBand NIC to other nodes (one direction)
    l2_bytes: int  # L2 cache (the target config's l2_cache_size)
    pool_fraction: float = 0.75  # of hbm_bytes, what JAX's allocator preallocates and can use
    gpus_per_node: int = 8  # GPUs behind one NVLink switch (HGX / DGX boards)
    assumed: tuple[str, ...] = ()

    @property
    def pool_bytes(self) -> float:
        """The device memory a JAX process can allocate: the fit check's limit."""
        return self.hbm_bytes * self.pool_fraction

    @property
    def ici_bandwidth(self) -> float:  # the roofline's in-slice part: NVLink inside a node
        return self.nvlink_bandwidth

    @property
    def dcn_bandwidth(self) -> float:  # the roofline's between-slices part: InfiniBand between nodes
        return self.ib_bandwidth


GPU_CHIPS: dict[str, GpuChip] = {
    "h100": GpuChip("h100", "NVIDIA H100 80GB HBM3", "h100_sxm.txtpb", 84942979072, 989.5e12, 1979e12,
                    3.35e12, 450 * GB, 50 * GB, 52428800),
    "h200": GpuChip("h200", "NVIDIA H200 141GB HBM3e", "h200.txtpb", 151397597184, 989.5e12, 1979e12,
                    4.8e12, 450 * GB, 50 * GB, 52428800),
    "b200": GpuChip("b200", "NVIDIA B200", "b200.txtpb", 191514411008, 2.25e15, 4.5e15, 8e12, 900 * GB, 50 * GB,
                    132644864),
}

# Rates measured on one H100 SXM (docs/accelerator.md, run 2, 2026-11-28; jax 0.11.2): a bf16 8192^3
# matmul (coder.train.metrics.measure_peak_flops) at 773.9 TFLOP/s, and coder's MLA flash kernels
# forward + backward (bench/accelerator.py part attention: batch 1, T=4096, 16 heads, q/k 192 and
# v 128 wide, bf16, one document) in 3.918 ms. HBM bandwidth was not measured: a roofline at these
# rates takes the data sheet's (coder.train.aot.gpu_stats.measured_rates).
MEASURED = {
    "h100": dict(matmul_flops_per_s=773.88e12,
                 flash=dict(batch=1, seq=4096, heads=16, dq=192, dv=128, seconds=3.9175e-3)),
}

_GPU_SPEC = re.compile(r"(h100|h200|b200)(?:-(\d+)(?:x(\d+))?)?")


@dataclasses.dataclass(frozen=True)
class GpuTopology:
    """`nodes` nodes of `gpus_per_node` GPUs each: NVLink inside a node, InfiniBand between."""

    chip: GpuChip
    gpus_per_node: int
    nodes: int

    num_slices = 1  # mesh.num_slices: the nodes are not TPU slices (their devices are in one mesh order)

    @property
    def num_chips(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def chips_per_slice(self) -> int:
        return self.num_chips

    @property
    def chips_per_host_bounds(self) -> tuple[int, int, int]:
        """GPUs per host (one host per node)."""
        return (self.gpus_per_node, 1, 1)

    @property
    def name(self) -> str:
        """As compile.topology spells it: "h100", "h100-8", "h100-8x32"."""
        if self.nodes > 1:
            return f"{self.chip.name}-{self.gpus_per_node}x{self.nodes}"
        return self.chip.name if self.gpus_per_node == 1 else f"{self.chip.name}-{self.gpus_per_node}"

    @property
    def topology_arg(self) -> str:
        """The CUDA plugin's `topology`: partitions x hosts x devices per host."""
        return f"1x{self.nodes}x{self.gpus_per_node}"


def parse_gpu_topology(spec: str, num_slices: int = 1) -> GpuTopology:
    """"h100" (one GPU), "h100-N" (one node of N <= gpus_per_node GPUs), "h100-8x32" (32 nodes
    of 8); h200 and b200 alike. mesh.num_slices must be 1: nodes are part of the spelling."""
    m = _GPU_SPEC.fullmatch(spec.strip())
    if not m:
        raise ValueError(f"compile.topology={spec!r}: a GPU target is e.g. 'h100', 'h100-8' or 'h100-8x32' "
                         f"(GPUs per node x nodes; GPUs: {sorted(GPU_CHIPS)})")
    chip = GPU_CHIPS[m.group(1)]
    per_node, nodes = int(m.group(2) or 1), int(m.group(3) or 1)
    if not 1 <= per_node <= chip.gpus_per_node or nodes < 1:
        raise ValueError(f"compile.topology={spec!r}: a {chip.name} node holds 1 to {chip.gpus_per_node} GPUs "
                         f"(several nodes: '{chip.name}-{chip.gpus_per_node}xN')")
    if num_slices != 1:
        raise ValueError(f"compile.topology={spec!r} with mesh.num_slices={num_slices}: GPU nodes are given "
                         f"in the topology ('{chip.name}-{chip.gpus_per_node}x{num_slices}'), mesh.num_slices stays 1")
    return GpuTopology(chip, per_node, nodes)


def gpu_compile_help() -> str:
    """What to install to compile for GPU targets, with the installed jaxlib's version."""
    v = version("jaxlib")
    return (f"compiling for a GPU target needs jax's CUDA plugin matching jaxlib {v} (no NVIDIA libraries, no GPU): "
            f"pip install -e '.[gpu-compile]', or pip install --no-deps jax-cuda12-plugin=={v} jax-cuda12-pjrt=={v}")


def gpu_compile_available() -> bool:
    """Whether jax's CUDA plugin (the `gpu-compile` extra) is installed."""
    try:  # find_spec imports the parent: no jax_plugins namespace at all raises
        return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:
        return False


def target_config(chip: GpuChip) -> str:
    """The chip's GpuTargetConfigProto in text form (gpu_specs/)."""
    with open(os.path.join(os.path.dirname(__file__), "gpu_specs", chip.target_config)) as f:
        return f.read()


def gpu_devices(topo: GpuTopology) -> list:
    """Compile-only CUDA devices of `topo` from jax's CUDA plugin, on any host (no GPU needed):
    device ids node-major (node = id // gpus_per_node). Raises RuntimeError naming what to
    install when the plugin is missing."""
    from jax.experimental import topologies

    if not gpu_compile_available():
        raise RuntimeError(f"cannot build GPU topology {topo.name}: {gpu_compile_help()}")
    try:
        desc = topologies.get_topology_desc(platform="cuda", topology_name="", target_config=target_config(topo.chip),
                                            topology=topo.topology_arg)
    except (NotImplementedError, RuntimeError) as e:  # a plugin that does not load
        raise RuntimeError(f"cannot build GPU topology {topo.name}: {e}. {gpu_compile_help()}") from e
    devices = sorted(desc.devices, key=lambda d: d.id)
    if len(devices) != topo.num_chips:
        raise RuntimeError(f"the CUDA plugin gave {len(devices)} devices for {topo.name}, expected {topo.num_chips}")
    return devices


def compiler_options(topo) -> dict | None:
    """XLA options a compile for `topo` needs (None: none, every TPU topology).

    A GPU target compiled without a GPU: CUB's radix sort off (XLA:GPU's own sort kernels
    instead), since sizing CUB's scratch buffer loads the CUDA runtime, which a host without
    NVIDIA libraries lacks ("Error loading CUDA libraries" compiling the ~1B MoE's routing
    sorts, 98,304 pairs; the small sorts of a tiny model stay under CUB's threshold). A real
    GPU's step sorts with CUB there: its sort time is not what the report counts."""
    return {"xla_gpu_enable_cub_radix_sort": False} if isinstance(topo, GpuTopology) else None


def describe_gpu(topo: GpuTopology) -> dict:
    """`describe` of a GPU topology: its nodes and the chip's figures (NVLink as `ici_bandwidth`,
    InfiniBand as `dcn_bandwidth`, the allocator's pool beside HBM)."""
    chip = dataclasses.asdict(topo.chip)
    chip.update(ici_bandwidth=topo.chip.ici_bandwidth, dcn_bandwidth=topo.chip.dcn_bandwidth,
                pool_bytes=topo.chip.pool_bytes)
    return dict(name=topo.name, platform="cuda", topology=topo.topology_arg, num_slices=1, nodes=topo.nodes,
                gpus_per_node=topo.gpus_per_node, chips=topo.num_chips, chips_per_slice=topo.num_chips, chip=chip)


@contextlib.contextmanager
def without_persistent_cache():
    """Compiles for compile-only devices stay out of JAX's persistent compilation cache
    (JAX_COMPILATION_CACHE_DIR): an executable without a client cannot be loaded back from it,
    so every later read would warn and compile again."""
    import jax  # heavy: jax (this module loads without it)
    from jax.experimental.compilation_cache import compilation_cache

    # JAX decides once per process whether the cache is in use: reset that decision both ways
    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", enabled)
        compilation_cache.reset_cache()


def describe(topo) -> dict:
    """The topology and its chip's figures, as the report records them."""
    if isinstance(topo, GpuTopology):
        return describe_gpu(topo)
    chip = dataclasses.asdict(topo.chip)
    return dict(name=topo.name, libtpu_name=topo.libtpu_name, num_slices=topo.num_slices,
                chips=topo.num_chips, chips_per_slice=topo.chips_per_slice, chip=chip)


def roofline(chip, num_chips: int, flops: float, bytes_accessed: float,
             collectives: dict, model_flops: float) -> dict:
    """Step-time bounds per chip from the chip's published peaks (CHIPS above).

    compute = FLOPs / peak; hbm = bytes / HBM bandwidth; ici = wire bytes of the in-slice
    collectives / the chip's total ICI bandwidth (optimistic: every link busy); dcn = wire bytes
    between slices / the chip's DCN share. `lower` assumes perfect overlap (max of the four),
    `serial` none (their sum): the real step lies between. MFU = model FLOPs (the caller's, from
    coder.train.metrics.model_flops_per_token: 6 N + 3 A per trained token, 2 N + A per
    inference token; no remat recompute) / (chips x peak x step time).
    """
    ici_wire = sum(v["wire_bytes"] for k, v in collectives.items() if k != "dcn")
    dcn_wire = collectives.get("dcn", {}).get("wire_bytes", 0.0)
    parts = dict(compute_s=flops / chip.peak_bf16_flops,
                 hbm_s=bytes_accessed / chip.hbm_bandwidth,
                 ici_s=ici_wire / chip.ici_bandwidth,
                 dcn_s=dcn_wire / chip.dcn_bandwidth)
    lower, serial = max(parts.values()), sum(parts.values())
    peak_total = num_chips * chip.peak_bf16_flops
    return dict(
        **parts, step_time_lower_s=lower, step_time_serial_s=serial,
        bound=max(parts, key=parts.get).removesuffix("_s"),
        model_flops=model_flops,
        mfu_upper=model_flops / (peak_total * lower) if lower else 0.0,
        mfu_lower=model_flops / (peak_total * serial) if serial else 0.0,
        hlo_to_model_flops=flops * num_chips / model_flops if model_flops else 0.0,
    )
