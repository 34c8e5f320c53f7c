"""Rebuild the table of docs/scale/README.md and every report.md from the report.json files.

    python docs/scale/summarize.py docs/scale

Rewrites the part of README.md between the TABLE markers (everything else is prose), and each
report.md from its report.json with coder.stages.compile.to_markdown, so the pages follow the
current report format without recompiling.
"""
import glob
import json
import os
import sys

BEGIN, END = "<!-- TABLE BEGIN -->", "<!-- TABLE END -->"


def row(path: str) -> str:
    with open(path) as f:
        r = json.load(f)
    name = os.path.basename(os.path.dirname(path))
    hw, s = r["hardware"], r["setup"]
    mesh = "x".join(f"{k}{v}" for k, v in s["mesh"].items() if v > 1) or "1"
    cells = [f"[{name}]({name}/report.md)", f"{hw['name']} ({hw['chips']})", f"{s['seq_len']}",
             mesh, s["remat"], f"{s['moe_capacity_factor']:g}" if s.get("moe_capacity_factor") else "dropless",
             "yes" if s["offload_optimizer"] else "no", f"**{r['status']}**"]
    gib = 2**30
    if "memory" in r:
        m, f = r["memory"], r["roofline"]
        cells += [f"{m['total_bytes'] / gib:.1f} / {m['hbm_bytes'] / gib:.1f}",
                  f"{f['step_time_lower_s']:.3g}-{f['step_time_serial_s']:.3g}",
                  f"{100 * f['mfu_lower']:.1f}-{100 * f['mfu_upper']:.1f}%", f["bound"]]
    elif "memory_overflow" in r:
        o = r["memory_overflow"]
        cells += [f"needs {o['used_bytes'] / gib:.1f} / {o['hbm_bytes'] / gib:.1f}", "-", "-", "-"]
    else:
        cells += ["-", "-", "-", "-"]
    cells.append(f"{r.get('compile_seconds', 0):.0f}")
    return "| " + " | ".join(cells) + " |"


def table(root: str) -> str:
    head = ("| report | slice (chips) | seq | mesh | remat | expert capacity | opt. offload | status "
            "| GiB per chip (used / HBM) | step s (overlap-serial) | MFU | bound | compile s |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = [row(p) for p in sorted(glob.glob(os.path.join(root, "*", "report.json")))]
    return "\n".join([head, *rows])


def main(root: str):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(root))))
    from coder.stages.compile import to_markdown

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
