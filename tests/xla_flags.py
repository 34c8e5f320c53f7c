"""XLA:CPU flags for every process the suite runs (pytest's, and the main.py runs, jax.distributed
jobs and Ray workers the tests start).

The suite compiles hundreds of small programs and runs most of them a few times, so XLA's compile
time is most of its time (measured: 67% of four in-process modules' wall time was XLA's backend
compile, 23% tracing and lowering). Three flags cut it (none allows fast math):
- LLVM at -O0 for the generated code (a tiny model's train step: 16 s to compile at the default
  level, 8-10 s at -O0; its steps run 2x slower, which these few-step tests do not feel);
- the classic elemental emitters instead of XLA:CPU's MLIR fusion emitters: backend compile
  time of test_trainer's cast-params test 14.5 -> 8.3 s, of test_engine's speculative test
  14.8 -> 8.5 s and of test_grpo's MTP-refresh test 19.8 -> 8.2 s (2026-11-27, jax 0.10.2);
- LLVM code generation in one piece (`parallel_codegen_split_count=1`) rather than split over a
  thread pool, which on 2 cores shared by two xdist workers only adds overhead: the quickstart
  model's value_and_grad compiled in 0.68-0.70 s of CPU instead of 0.85-1.20 s, and
  tests/model/test_nsa_engine.py + tests/infer/test_engine.py took 60-65 s of CPU instead of
  71-74 s (2026-11-27).
And one flag for the run time: Eigen's matmuls single-threaded (`multi_thread_eigen=false`);
its thread pool on 2 cores shared by two xdist workers only contends (5 steps of that model:
0.60 s of CPU, 0.77 s threaded). The last two flags change the last bits of some results (the
model's gradient digest differs), so the learning tests' margins were checked under them.
At the whole suite's level those two were within run-to-run noise (docs/test_durations.md:
1445 s with them, 1388 s and 1528 s without).
"""
import re
from importlib import metadata


def _jaxlib_version() -> tuple:
    """The installed jaxlib's (major, minor, patch), read without importing jax (these flags must
    be set before XLA starts); () when jaxlib is not installed."""
    try:
        return tuple(int(p) for p in re.findall(r"\d+", metadata.version("jaxlib"))[:3])
    except metadata.PackageNotFoundError:
        return ()


# jaxlib 0.12's XLA no longer has the classic emitters' switch, and an unknown flag in XLA_FLAGS
# is fatal there (every process aborts at start-up): it is set for older jaxlibs only
COMPILE_FLAGS = tuple(f for f in (
    "--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false",
    "--xla_cpu_parallel_codegen_split_count=1", "--xla_cpu_multi_thread_eigen=false")
    if "fusion_emitters" not in f or _jaxlib_version() < (0, 12))
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def merged(flags: str, devices: int | None = None) -> str:
    """`flags` (an XLA_FLAGS value) with the suite's compile flags added where `flags` does not
    set them itself (a user's own choice is kept), and `devices` fake CPU devices when given
    (replacing any device count in `flags`)."""
    out = [f for f in flags.split() if devices is None or not f.startswith(DEVICE_COUNT_FLAG)]
    if devices is not None:
        out.append(f"{DEVICE_COUNT_FLAG}={devices}")
    for flag in COMPILE_FLAGS:
        if not any(f.split("=")[0] == flag.split("=")[0] for f in out):
            out.append(flag)
    return " ".join(out)


def one_device(flags: str) -> str:
    """`flags` for a process that sees one CPU device, as a user's single-host run does."""
    return " ".join(f for f in merged(flags).split() if not f.startswith(DEVICE_COUNT_FLAG))
