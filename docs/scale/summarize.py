"""Rebuild the table of docs/scale/README.md and every report.md from the report.json files.

    python docs/scale/summarize.py docs/scale

Rewrites the part of README.md between the TABLE markers (everything else is prose), and each
report.md from its report.json with coder.stages.compile_report.to_markdown, so the pages follow the
current report format without recompiling.
"""
import glob
import json
import os
import sys

BEGIN, END = "<!-- TABLE BEGIN -->", "<!-- TABLE END -->"


def _moe(s: dict) -> str:
    if s.get("moe_capacity_factor"):
        return f"capacity {s['moe_capacity_factor']:g}"
    buf = s.get("moe_a2a_buffer_factor")
    return "dropless" + (f" (a2a buffer {buf:g}x)" if buf else "")


def _optimizer(s: dict) -> str:
    if s["offload_optimizer"]:
        return "host"
    if s.get("params_over_data"):  # the float32 parameters too
        return "over slices (+ params)"
    return "over slices" if s.get("optimizer_over_data") else "chip"


def bounds(f: dict) -> str:
    """What bounds the step: each roofline part's share of the serial (no overlap) time."""
    parts = {k[:-2]: f[k] for k in ("compute_s", "hbm_s", "ici_s", "dcn_s") if f.get(k)}
    total = sum(parts.values()) or 1.0
    return ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]))


def _cells(r: dict) -> list[str]:
    gib = 2**30
    if "memory" in r and not r["memory"]["fits"]:  # no step to time: XLA's memory figure only
        m = r["memory"]
        return [f"**{r['status']}**", f"{m['total_bytes'] / gib:.1f} / {m['hbm_bytes'] / gib:.1f}",
                "-", "-", "-", "-"]
    if "memory" in r:
        m, f = r["memory"], r["roofline"]
        return [f"**{r['status']}**", f"{m['total_bytes'] / gib:.1f} / {m['hbm_bytes'] / gib:.1f}",
                f"{f['step_time_lower_s']:.3g}-{f['step_time_serial_s']:.3g}",
                f"{100 * f['mfu_lower']:.1f}-{100 * f['mfu_upper']:.1f}%",
                f"{f['hlo_to_model_flops']:.2f}", bounds(f)]
    if "memory_overflow" in r:
        o = r["memory_overflow"]
        return [f"**{r['status']}**", f"needs {o['used_bytes'] / gib:.1f} / {o['hbm_bytes'] / gib:.1f}",
                "-", "-", "-", "-"]
    return [f"**{r.get('status', '-')}**", "-", "-", "-", "-", "-"]


def rows(path: str) -> list[str]:
    """The training step's row of a report, and its GRPO step's when compiled."""
    with open(path) as f:
        r = json.load(f)
    name = os.path.basename(os.path.dirname(path))
    hw, s = r["hardware"], r["setup"]
    mesh = "x".join(f"{k}{v}" for k, v in s["mesh"].items() if v > 1) or "1"
    head = [f"{hw['name']} ({hw['chips']})", mesh, s["remat"], _moe(s), _optimizer(s)]
    tokens = f"{s['batch']} x {s['seq_len']}"
    out = [[f"[{name}]({name}/report.md)", "pretrain", tokens, *head, *_cells(r),
            f"{r.get('compile_seconds', 0):.0f}"]]
    g = r.get("grpo")
    if g and "setup" in g:
        gs = g["setup"]
        out.append([f"[{name}]({name}/report.md)", "GRPO", f"{gs['rows']} x {gs['seq_len']}", *head,
                    *_cells(g), f"{g.get('compile_seconds', 0):.0f}"])
    return ["| " + " | ".join(c) + " |" for c in out]


def table(root: str) -> str:
    head = ("| report | step | rows x seq | slice (chips) | mesh | remat | MoE | Adam moments | status "
            "| GiB per chip (used / HBM) | step s (overlap-serial) | MFU (serial-overlap) "
            "| compiled / model FLOPs | what bounds the step (share of serial time) | compile s |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    body = [line for p in sorted(glob.glob(os.path.join(root, "*", "report.json"))) for line in rows(p)]
    return "\n".join([head, *body])


def main(root: str):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(root))))
    from coder.stages.compile_report import to_markdown

    for report in glob.glob(os.path.join(root, "*", "report.json")):
        with open(report) as f:
            page = to_markdown(json.load(f))
        with open(os.path.join(os.path.dirname(report), "report.md"), "w") as f:
            f.write(page)
    path = os.path.join(root, "README.md")
    with open(path) as f:
        text = f.read()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    with open(path, "w") as f:
        f.write(text[:start] + "\n" + table(root) + "\n" + text[end:])


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__)))
