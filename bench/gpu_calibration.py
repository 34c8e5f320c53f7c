"""The GPU roofline against the one GPU measurement: the ~1B MoE step compiled for an H100 on a CPU.

    JAX_PLATFORMS=cpu python bench/gpu_calibration.py                # both forms, ~10 min on 2 cores
    JAX_PLATFORMS=cpu python bench/gpu_calibration.py --forms block

bench/accelerator.py's ~1B MoE (configs/moe_1b.py: 12 layers, 64 experts top-6, d 1024, batch
8 x 2048) trained at 1689 ms a step on one H100 (docs/accelerator.md, run 2, 2026-11-28) while
coder.model.grouped_matmul's GPU form was `jax.lax.ragged_dot` (commit c08e5a7 replaced it by
the block-padded form). This compiles that step with stage compile (coder/stages/compile.py,
docs/scale/configs.py's "moe_1b,h100") for each form of the expert matmul:

  ragged_dot  the form that ran: `jax.lax.ragged_dot(x, w, group_sizes)` in place of
              `grouped_matmul` where the MoE calls it (coder.model.expert_ffn and
              coder.model.expert_dispatch, swapped for the compile and restored; XLA rewrites a
              ragged dot into a dense product of every row with every expert);
  block       the code as it is (the block-padded einsum on GPU).

and prints, per form, the memory against the pool JAX preallocates, the compiled FLOPs and HBM
bytes, the roofline's serial bound and MFU at the H100's peak rates and at its measured rates
(coder.train.aot.hardware.MEASURED: the bf16 matmul and the flash kernels; HBM at the data
sheet's 3.35 TB/s, never measured), and the ops the HBM bytes go to. Exit code 1 when the
ragged_dot form's serial bound at the measured rates is more than TOLERANCE off the measured
step (or a compile failed), 0 otherwise. The reports go to --out (default: a temporary folder).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# the step measured on one H100 with the ragged_dot form: docs/accelerator_logs/h100-2026-11-28-run2.log
# (its SUMMARY line, part train, step_ms)
MEASURED_STEP_S = 1.6891357929999913
TOLERANCE = 0.10  # the calibration holds when the serial bound is within 10% of the measured step


def _ragged_dot(x, w, group_sizes, mask_rows: bool = True):
    """grouped_matmul's GPU form until commit c08e5a7 (mask_rows: ragged_dot gives zeros there)."""
    import jax

    return jax.lax.ragged_dot(x, w, group_sizes)


@contextlib.contextmanager
def expert_form(form: str):
    """The MoE's grouped matmul as `form` ("block": unchanged) while the step is traced."""
    from coder.model import expert_dispatch, expert_ffn

    if form == "block":
        yield
        return
    saved = expert_ffn.grouped_matmul, expert_dispatch.grouped_matmul
    expert_ffn.grouped_matmul = expert_dispatch.grouped_matmul = _ragged_dot
    try:
        yield
    finally:
        expert_ffn.grouped_matmul, expert_dispatch.grouped_matmul = saved


def scale_config(arg: str):
    """docs/scale/configs.py's get_config(arg)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("scale_configs", ROOT / "docs" / "scale" / "configs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg)


def compile_form(form: str, out: str, topology: str = "h100") -> dict:
    """Stage compile's report of the moe_1b step on `topology` with the expert matmul as `form`."""
    from coder.stages import compile as C

    c = scale_config(f"moe_1b,{topology}")
    c.compile.report_dir = os.path.join(out, f"moe_1b_{topology}_{form}")
    with expert_form(form):
        C.run(c, os.path.join(out, f"stage_{form}"))
    with open(os.path.join(c.compile.report_dir, "report.json")) as f:
        return json.load(f)


def summary(form: str, r: dict) -> dict:
    """The figures of one form's report that the table prints."""
    row = dict(form=form, status=r["status"])
    if "memory" not in r:
        return dict(row, error=r.get("error", ""))
    m, c, f, g = r["memory"], r["cost"], r["roofline"], r.get("roofline_measured", {})
    return dict(row, gb=m["total_bytes"] / 1e9, pool_gb=m["hbm_bytes"] / 1e9,
                args_temp_gb=(m["arguments_bytes"] + m["activations_temp_bytes"]) / 1e9,
                tflop=c["flops"] / 1e12, matmul_tflop=c["matmul_flops"] / 1e12,
                kernel_tflop=sum(c["kernel_flops"].values()) / 1e12, hbm_tb=c["bytes_accessed"] / 1e12,
                model_tflop=f["model_flops"] / 1e12, serial_ms=f["step_time_serial_s"] * 1e3,
                mfu_lower=f["mfu_lower"], mfu_upper=f["mfu_upper"],
                measured_serial_ms=g.get("step_time_serial_s", 0.0) * 1e3, measured_mfu_lower=g.get("mfu_lower"),
                measured_parts_ms={k: g[k] * 1e3 for k in ("compute_s", "hbm_s")} if g else {},
                top_traffic=c["top_traffic"][:6], uncounted=c["uncounted_kernels"])


def print_table(rows: list[dict]):
    print("form       | status       | GB / pool   | args+temp GB | TFLOP (matmul+kernels) | HBM TB | "
          "serial ms (MFU) at peak | serial ms (MFU) at measured rates")
    for s in rows:
        if "gb" not in s:
            print(f"{s['form']:10} | {s['status']:12} | {s.get('error', '')[:200]}")
            continue
        print(f"{s['form']:10} | {s['status']:12} | {s['gb']:5.1f} / {s['pool_gb']:4.1f} | {s['args_temp_gb']:12.1f} | "
              f"{s['tflop']:7.1f} ({s['matmul_tflop']:.1f}+{s['kernel_tflop']:.1f}) | {s['hbm_tb']:6.3f} | "
              f"{s['serial_ms']:8.1f} ({s['mfu_lower']:.1%}) | {s['measured_serial_ms']:8.1f} "
              f"({s['measured_mfu_lower']:.1%}) compute {s['measured_parts_ms']['compute_s']:.0f} + "
              f"hbm {s['measured_parts_ms']['hbm_s']:.0f}")
    for s in rows:
        if "gb" in s:
            print(f"\n{s['form']}: HBM bytes by source op (model FLOPs {s['model_tflop']:.2f} T per step)")
            for src, b in s["top_traffic"]:
                print(f"  {b / 1e9:8.1f} GB  {src}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--forms", default="ragged_dot,block", help="comma-separated: ragged_dot, block")
    p.add_argument("--out", default="", help="where the reports go (default: a temporary folder)")
    args = p.parse_args(argv)
    from coder.train.aot import hardware

    if not hardware.gpu_compile_available():
        print(hardware.gpu_compile_help())
        return 1
    out = args.out or tempfile.mkdtemp(prefix="coder-gpu-calibration-")
    rows = [summary(form, compile_form(form, out)) for form in args.forms.split(",")]
    print_table(rows)
    print(f"\nreports in {out}")
    code = 0 if all("gb" in s for s in rows) else 1
    for s in rows:
        if s["form"] == "ragged_dot" and "gb" in s:
            off = s["measured_serial_ms"] / (MEASURED_STEP_S * 1e3) - 1
            ok = abs(off) <= TOLERANCE
            print(f"calibration: ragged_dot serial bound at the H100's measured rates {s['measured_serial_ms']:.0f} ms "
                  f"vs the measured step {MEASURED_STEP_S * 1e3:.0f} ms: {off:+.1%} "
                  f"({'within' if ok else 'outside'} {TOLERANCE:.0%})")
            code = code or (0 if ok else 1)
    print("SUMMARY " + json.dumps(dict(rows=rows, measured_step_s=MEASURED_STEP_S), default=str))
    return code


if __name__ == "__main__":
    sys.exit(main())
