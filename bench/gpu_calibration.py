"""The GPU roofline against the one GPU measurement: the ~1B MoE step compiled for an H100 on a CPU.

    JAX_PLATFORMS=cpu python bench/gpu_calibration.py                # the three forms, ~3 min on 2 cores
    JAX_PLATFORMS=cpu python bench/gpu_calibration.py --forms kernel

bench/accelerator.py's ~1B MoE (configs/moe_1b.py: 12 layers, 64 experts top-6, d 1024, batch
8 x 2048) trained at 1689 ms a step on one H100 (docs/accelerator.md, run 2, 2026-11-28) while
coder.model.grouped_matmul's GPU form was `jax.lax.ragged_dot` (commit c08e5a7 replaced it by
the block-padded form, and commit 93ff0ae by coder/pallas/grouped_matmul_gpu.py's kernels). This
compiles that step with stage compile (coder/stages/compile.py, docs/scale/configs.py's
"moe_1b,h100") in each form:

  ragged_dot  the program that ran: `jax.lax.ragged_dot(x, w, group_sizes)` in place of
              `grouped_matmul` where the MoE calls it (coder.model.expert_ffn and
              coder.model.expert_dispatch; XLA rewrites a ragged dot into a dense product of
              every row with every expert), and the rest as it was then (`GLUE_THEN`);
  block       the block-padded einsum with the same glue (the code from c08e5a7 to 93ff0ae);
  kernel      the code as it is (the Triton grouped matmul, the pairs gathered in and out, the
              head's backward in bf16, the losses on the whole logits).

Each swap lasts the compile and is undone. GLUE_THEN is what the step around the expert matmul
was when the H100 ran it: the MoE's pairs masked in and summed back by a scatter-add
(expert_ffn.sorted_ffn with all_local=False), the output head differentiated by JAX's own
transpose (float32 x float32 backward matmuls), the losses on the logits sliced to the targets,
the flash kernels' 192-wide queries and keys padded to 256.
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


def _block(x, w, group_sizes, mask_rows: bool = True):
    """grouped_matmul's GPU form from c08e5a7 to 93ff0ae (zeros past the groups either way)."""
    from coder.model.grouped_matmul import block_grouped_matmul

    return block_grouped_matmul(x, w, group_sizes)


def _width_parts_then(width: int):
    """The flash kernels before bd51b42: q / k widths padded to a power of two (192 -> 256)."""
    return ((0, width),) if width & (width - 1) == 0 else None


def _head_then(h, w):
    """The output head before 93ff0ae: JAX's transpose of the float32-accumulating dot."""
    import jax.numpy as jnp

    return jnp.einsum("btd,dv->btv", h, w, preferred_element_type=jnp.float32)


def _next_token_loss_then(logits, batch, ce_sum=None):
    """coder.train.losses.next_token_loss before 93ff0ae: the logits sliced to the targets (the
    whole logits' cross-entropy, as then: `ce_sum` is the current signature's)."""
    import jax.numpy as jnp

    from coder.train import losses

    targets, weights = losses.shifted_targets(batch["tokens"], batch["segment_ids"], batch["loss_mask"], 1)
    total, count = losses.cross_entropy_sum(logits[:, :-1], targets, weights)
    return total / jnp.maximum(count, 1.0), count


def _mtp_loss_then(mtp_logits, batch, ce_sum=None):
    """coder.train.losses.mtp_loss before 93ff0ae (sliced logits, the whole logits' CE)."""
    import jax.numpy as jnp

    from coder.train import losses

    per_depth = []
    for k in range(mtp_logits.shape[0]):
        targets, weights = losses.shifted_targets(batch["tokens"], batch["segment_ids"], batch["loss_mask"], k + 2)
        total, count = losses.cross_entropy_sum(mtp_logits[k][:, :-(k + 2)], targets, weights)
        per_depth.append(total / jnp.maximum(count, 1.0))
    per_depth = jnp.stack(per_depth)
    return jnp.mean(per_depth), per_depth


FORMS = ("ragged_dot", "block", "kernel")


@contextlib.contextmanager
def expert_form(form: str):
    """The step as `form` (module docstring) while it is traced; "kernel": unchanged."""
    import functools

    from coder.model import expert_dispatch, expert_ffn, transformer
    from coder.pallas import flash_gpu
    from coder.train import losses

    if form not in FORMS:
        raise ValueError(f"form {form!r}: one of {FORMS}")
    if form == "kernel":
        yield
        return
    matmul = _ragged_dot if form == "ragged_dot" else _block
    masked = functools.partial(expert_ffn.sorted_ffn, all_local=False)
    swaps = [(expert_ffn, "grouped_matmul", matmul), (expert_dispatch, "grouped_matmul", matmul),
             (expert_ffn, "sorted_ffn", lambda *a, all_local=False, **kw: masked(*a, **kw)),
             (transformer, "head_logits", _head_then),
             (flash_gpu, "width_parts", _width_parts_then),
             (losses, "next_token_loss", _next_token_loss_then), (losses, "mtp_loss", _mtp_loss_then)]
    saved = [(m, name, getattr(m, name)) for m, name, _ in swaps]
    for m, name, new in swaps:
        setattr(m, name, new)
    try:
        yield
    finally:
        for m, name, old in saved:
            setattr(m, name, old)


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
    p.add_argument("--forms", default=",".join(FORMS), help="comma-separated: " + ", ".join(FORMS))
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
