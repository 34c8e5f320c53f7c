"""bench/accelerator.py --dry-run: the accelerator check's every part runs on CPU at tiny sizes
(kernels in the Pallas interpreter, a one-layer model, a few engine steps), in a subprocess as a
user runs it, and reports each part with measured rows and exit code 0.

Slow: nearly all of its ~90-120 s on 2 busy cores is compiling (~10 programs: the NSA layer on
the interpreted kernels and on XLA, the attention kernel and reference, the trainer's init and
step, the engine's prefill / decode programs for 3 engines)."""
import json
import os
import subprocess
import sys

import pytest

from tests import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARTS = ("nsa", "attention", "moe", "train", "engine")


@pytest.mark.slow
def test_dry_run_reports_every_part():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    # one CPU device, as a user's run (conftest asks for 8); compiled as the suite is
    env["XLA_FLAGS"] = xla_flags.one_device(env.get("XLA_FLAGS", ""))
    env.pop("PYTHONPATH", None)  # the script puts the repository root on sys.path itself
    p = subprocess.run([sys.executable, "bench/accelerator.py", "--dry-run"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600, check=False)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-6000:]
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("SUMMARY ")]
    assert len(lines) == 1 and p.stdout.rstrip().endswith(lines[0]), out[-3000:]
    summary = json.loads(lines[0][len("SUMMARY "):])
    assert summary["dry_run"] and summary["exit_code"] == 0
    assert set(summary["parts"]) == set(PARTS)
    for name in PARTS:
        part = summary["parts"][name]
        assert part["status"] == "ok", (name, part)
        assert part["rows"] and not any("error" in r for r in part["rows"]), (name, part["rows"])
        assert f"[{name}] ok" in p.stdout
    # the kernels agreed with their XLA references (forward and every gradient)
    for name in ("nsa", "attention"):
        assert all(r["close"] for r in summary["parts"][name]["rows"]), summary["parts"][name]
    moe = summary["parts"]["moe"]["rows"]  # every form of grouped_matmul, each against a float32 truth
    assert [r["form"] for r in moe] == ["ragged_dot", "block", "megablox"] and all(r["close"] for r in moe), moe
    (train,) = summary["parts"]["train"]["rows"]
    assert train["tokens_per_s"] > 0 and train["mfu"] is None  # CPU: no published peak, MFU n/a
    assert train["loss_last"] < train["loss_first"]  # the same batch again: the step learns
    decode = [r for r in summary["parts"]["engine"]["rows"] if r["kind"] == "decode"]
    assert [r["batch"] for r in decode] == [1, 8]
    assert all(r["tokens_per_s"] > 0 and r["recompiles"] == 0 for r in decode)
    (mtp,) = [r for r in summary["parts"]["engine"]["rows"] if r["kind"] == "mtp"]
    assert mtp["k"] == 1 and mtp["tokens_per_s"] > 0 and 0.0 <= mtp["accept"] <= 1.0


def _bench():
    import importlib.util

    spec = importlib.util.spec_from_file_location("accelerator_bench", os.path.join(ROOT, "bench", "accelerator.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_training_step_is_printed_beside_its_committed_compiled_estimate():
    """Part train's step on an H100 has a committed compiled report (docs/scale/moe_1b_h100, the
    same model and 8 x 2048 batch): its serial bounds come beside the measured time; another
    batch or a device without a report gets none; the pool fraction is set before JAX starts."""
    bench = _bench()
    with open(os.path.join(ROOT, "docs", "scale", "moe_1b_h100", "report.json")) as f:
        report = json.load(f)
    est = bench.compiled_estimate("NVIDIA H100 80GB HBM3", 8, 2048)
    assert est["report"] == "docs/scale/moe_1b_h100"
    assert est["serial_ms"] == report["roofline"]["step_time_serial_s"] * 1e3
    assert est["measured_rates_serial_ms"] == report["roofline_measured"]["step_time_serial_s"] * 1e3
    assert bench.compiled_estimate("NVIDIA H100 80GB HBM3", 16, 2048) is None
    assert bench.compiled_estimate("TPU v5 lite", 8, 2048) is None
    assert bench.MEM_FRACTION == os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"]
