"""TPU chips and slice topologies: the published figures the compile report's roofline uses.

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
"""
from __future__ import annotations

import contextlib
import dataclasses
import re

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
    """"v5p-512" (Cloud accelerator type) or "v5p:4x8x8" / "v6e:16x16" (explicit shape).

    Raises ValueError naming the accepted forms when `spec` is not one of them.
    """
    spec = spec.strip()
    if num_slices < 1:
        raise ValueError(f"mesh.num_slices={num_slices}: must be >= 1")
    m = re.fullmatch(r"(v4|v5e|v5p|v6e)[-:](.+)", spec)
    if not m:
        raise ValueError(f"compile.topology={spec!r}: expected e.g. 'v5e-4', 'v5p-512', "
                         f"'v6e-256' or 'v5p:4x8x8' (chips: {sorted(CHIPS)})")
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
    (AOT), which is what `stage=compile` does. Needs the `tpu` extra (libtpu).
    """
    import os

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


@contextlib.contextmanager
def without_persistent_cache():
    """Compiles for compile-only devices stay out of JAX's persistent compilation cache
    (JAX_COMPILATION_CACHE_DIR): an executable without a client cannot be loaded back from it,
    so every later read would warn and compile again."""
    import jax
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
