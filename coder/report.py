"""The run report: one Markdown page with PNG figures of a run's stages, for a person to open.

    python -m coder.report WORKDIR [--out DIR]      # default DIR: WORKDIR/report

main.py writes it at the end of every run (coder.stages.run, process 0) and prints its path as
the last line of the final summary; this command renders it again for any run, finished or not,
local or `gs://` (every read and write goes through fsspec). `{DIR}/report.md` holds:
  - the stage table: what each stage improved (start -> end), steps, wall time and checkpoint,
    the console's final summary as main.py printed it (its rows, coder.stages.summarize, are
    kept in `{DIR}/stages.json`, so a re-render shows the same numbers); a stage main.py never
    summarized (a run killed before its end) gets loss and reward first -> last from its
    metrics (`fallback_row`) and "-" for the time;
  - the agent-eval results (`{stage}/agent_eval/step_*.json` and realtime's
    `{stage}/cycles/*/agent_eval/step_*.json`, coder.rl.eval's reports): pass@k, tasks, infra
    failures, regression flag, per evaluated step;
  - per stage, `{stage}.png`: small multiples of the curves the stage logged (PANELS: loss,
    reward, pass rate, grad norm, lr, tokens/s, MFU, MTP acceptance, staleness, and the held-out
    pass@k of its agent evals), only keys present; and the last value of every key it logged.

Reads `{WORKDIR}/{stage}/metrics.jsonl` (coder.train.metrics.MetricsWriter: one JSON object per
logged step, at least `step`). Figures are drawn with matplotlib's Agg canvas (no pyplot, no
global backend); matplotlib is imported only when drawing.
"""
from __future__ import annotations

import argparse
import datetime
import io
import json
import math
import re
import sys

import fsspec

REPORT = "report.md"
STAGES_FILE = "stages.json"  # the console summary rows of the stages, as main.py printed them

# The order of coder.stages.STAGES (a library module does not import the stages; a test checks the
# two agree): stages a report finds without a stages.json are listed in this order.
STAGE_ORDER = ("pretrain", "longctx", "mtp", "sft", "grpo", "eval", "compile", "serve", "realtime")

# The figure panels: (title, regular expression a key must match in full). A panel is drawn when
# the stage logged at least one finite value of a matching key; each matching key is one series.
PANELS = (
    ("loss", r"(heldout/)?loss|heldout_loss"),
    ("reward", r"reward"),
    ("pass rate", r"pass_rate|(baseline|candidate)_pass@1"),
    ("grad norm", r"grad_norm"),
    ("learning rate", r"lr"),
    ("tokens/s", r"(engine_)?tokens_per_s"),
    ("MFU", r"mfu"),
    ("MTP acceptance", r"(\w+/)?(mtp_)?accept(_\d+)?"),
    ("staleness (versions)", r"staleness_(mean|max)|version_lag"),
)
EVAL_PANEL = "held-out pass@k (agent eval)"


class NoMetricsError(FileNotFoundError):
    """A workdir without any `{stage}/metrics.jsonl`."""


# ============================================================================ reading

def _join(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *parts])


def parse_metrics(text: str) -> list[dict]:
    """The records of one metrics.jsonl's text (one JSON object per line), in file order.

    Blank lines and a line that is not JSON (a record cut short by a killed process) are skipped.
    """
    records = []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def read_metrics(stage_dir: str) -> list[dict]:
    """The records of `{stage_dir}/metrics.jsonl` (a local path or fsspec URL); [] when absent."""
    fs, path = fsspec.core.url_to_fs(_join(stage_dir, "metrics.jsonl"))
    if not fs.exists(path):
        return []
    return parse_metrics(fs.cat_file(path).decode())


def first_last(records: list[dict], key: str) -> tuple[dict | None, dict | None]:
    """The first and the last record that has `key` ((None, None) when none has it)."""
    first = last = None
    for record in records:
        if key in record:
            first = record if first is None else first
            last = record
    return first, last


def _number(v) -> float | None:
    """v as a float when it is a finite number (not a bool), else None."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def find_stages(workdir: str) -> list[str]:
    """Names of the stage directories of `workdir` that hold a metrics.jsonl, in STAGE_ORDER
    (unknown names after, sorted)."""
    fs, root = fsspec.core.url_to_fs(workdir)
    found = {p.rstrip("/").split("/")[-2] for p in fs.glob(_join(root, "*", "metrics.jsonl"))}
    rank = {s: i for i, s in enumerate(STAGE_ORDER)}
    return sorted(found, key=lambda s: (rank.get(s, len(rank)), s))


def read_agent_evals(stage_dir: str) -> list[dict]:
    """The agent-eval reports of a stage (coder.rl.eval: `agent_eval/step_*.json`, and realtime's
    `cycles/{cycle}/agent_eval/step_*.json`), each with `cycle` added (None outside realtime),
    sorted by (cycle, step)."""
    fs, root = fsspec.core.url_to_fs(stage_dir)
    out = []
    for pattern in (_join(root, "agent_eval", "step_*.json"), _join(root, "cycles", "*", "agent_eval", "step_*.json")):
        for p in fs.glob(pattern):
            try:
                report = json.loads(fs.cat_file(p).decode())
            except json.JSONDecodeError:
                continue
            parts = p.rstrip("/").split("/")
            in_cycle = len(parts) > 4 and parts[-4] == "cycles" and parts[-3].isdigit()
            report["cycle"] = int(parts[-3]) if in_cycle else None
            out.append(report)
    return sorted(out, key=lambda r: (-1 if r["cycle"] is None else r["cycle"], int(r.get("step", 0))))


def read_stage_rows(out: str) -> list[dict]:
    """The summary rows kept in `{out}/stages.json` by an earlier write_report ([] when none)."""
    fs, path = fsspec.core.url_to_fs(_join(out, STAGES_FILE))
    if not fs.exists(path):
        return []
    try:
        return [r for r in json.loads(fs.cat_file(path).decode()) if isinstance(r, dict) and "stage" in r]
    except (json.JSONDecodeError, TypeError):
        return []


def merge_rows(old: list[dict], new: list[dict]) -> list[dict]:
    """`old` summary rows replaced by the `new` row of the same stage (in place), new stages
    appended."""
    rows = {r["stage"]: r for r in old}
    rows.update({r["stage"]: r for r in new})
    return list(rows.values())


# ============================================================================ tables

def measures_of(row: dict) -> dict:
    """{label: (start, end)} of a console summary row (coder.stages.summarize): its "measures",
    or, from a row of the older format, {"loss": (loss_start, loss_end)}."""
    if "measures" in row:
        return {k: tuple(v) for k, v in (row["measures"] or {}).items()}
    if row.get("loss_end") is not None:
        return {"loss": (row.get("loss_start"), row["loss_end"])}
    return {}


def fallback_row(stage: str, records: list[dict]) -> dict:
    """A summary row for a stage main.py never summarized (a run killed before its end, or
    written before reports existed): loss and reward at the first and the last record that has
    them (first_last; start None when one record has it), steps = the largest step logged."""
    measures = {}
    for key in ("loss", "reward"):
        first, last = first_last([r for r in records if _number(r.get(key)) is not None], key)
        if last is not None:
            measures[key] = (None if first is last else first[key], last[key])
    steps = max((r["step"] for r in records if _number(r.get("step")) is not None), default=None)
    return {"stage": stage, "measures": measures, "steps": steps, "seconds": None, "checkpoint": ""}


def stage_table(metrics: dict[str, list[dict]], rows: list[dict]) -> list[dict]:
    """The stage table's rows: {"stage", "measures" ({label: (start, end)}), "steps", "seconds",
    "checkpoint"}, one per stage.

    metrics: {stage: its records}; rows: the console summary's rows (coder.stages.summarize, as
    main.py printed them), which give their stages' numbers as they are. Stages in `rows` come
    first in their order, then the other stages of `metrics` with a fallback_row.
    """
    measured = {r["stage"]: r for r in rows}
    order = [r["stage"] for r in rows] + [s for s in metrics if s not in measured]
    table = []
    for stage in order:
        row = measured.get(stage) or fallback_row(stage, metrics.get(stage, []))
        table.append({"stage": stage, "measures": measures_of(row), "steps": row.get("steps"),
                      "seconds": row.get("seconds"), "checkpoint": row.get("checkpoint") or ""})
    return table


def format_measures(measures: dict) -> str:
    """`label start -> end, ...` as the console summary prints it ("-" when empty)."""
    def num(v):
        return "nan" if v is None or _number(v) is None else f"{v:.4g}"

    return ", ".join(f"{label} {num(b)}" if a is None else f"{label} {num(a)} -> {num(b)}"
                     for label, (a, b) in measures.items()) or "-"


def _cell(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.4g}" if math.isfinite(v) else str(v)
    return str(v).replace("|", "\\|")


def _md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines


def last_values(records: list[dict]) -> dict:
    """{key: (step, value)} of each key's last record (keys in the order first logged)."""
    out = {}
    for r in records:
        for k, v in r.items():
            if k != "step":
                out[k] = (r.get("step"), v)
    return out


def _pass_keys(evals: list[dict]) -> list[str]:
    keys = {k for e in evals for k in e.get("summary", {}) if k.startswith("pass@")}
    return sorted(keys, key=lambda k: int(k[5:]) if k[5:].isdigit() else 10**9)


# ============================================================================ figures

def panels(records: list[dict], evals: list[dict] = ()) -> list[tuple[str, dict]]:
    """The panels of a stage's figure: [(title, {series name: ([steps], [values])})], PANELS'
    order, only panels with a value; then EVAL_PANEL (pass@k per evaluated step) when the stage
    has agent evals outside realtime's cycles.

    A key's series takes the records that have it as a finite number. A record holding held-out
    keys (`heldout/...`, stage mtp's last) is left out of the other keys' series: it repeats its
    held-out loss as `loss` for the console summary. MTP acceptance: per-depth keys (`accept_1`,
    ...) replace the mean over depths (`accept`) of the same prefix when both are logged.
    """
    out = []
    for title, pattern in PANELS:
        rx = re.compile(pattern)
        series: dict[str, tuple[list, list]] = {}
        for r in records:
            heldout_record = any(k.startswith("heldout/") for k in r)
            for k, v in r.items():
                if k == "step" or not rx.fullmatch(k):
                    continue
                if heldout_record and not k.startswith("heldout/"):
                    continue
                v = _number(v)
                if v is None or _number(r.get("step")) is None:
                    continue
                xs, ys = series.setdefault(k, ([], []))
                xs.append(r["step"])
                ys.append(v)
        for k in list(series):  # per-depth acceptance replaces the depths' mean
            m = re.fullmatch(r"(.*)accept", k)
            if m and any(re.fullmatch(re.escape(m.group(1)) + r"accept_\d+", o) for o in series):
                del series[k]
        if series:
            out.append((title, dict(sorted(series.items()))))
    flat = [e for e in evals if e.get("cycle") is None]
    if flat:
        series = {}
        for k in _pass_keys(flat):
            pts = [(e["step"], _number(e["summary"].get(k))) for e in flat]
            pts = [(s, v) for s, v in pts if v is not None]
            if pts:
                series[k] = ([s for s, _ in pts], [v for _, v in pts])
        if series:
            out.append((EVAL_PANEL, series))
    return out


def plot_stage(stage: str, stage_panels: list[tuple[str, dict]], ncols: int = 3) -> bytes:
    """A PNG (bytes) of a stage's panels as small multiples, `ncols` per row, x = step."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # heavy: matplotlib (figures only)
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    n = len(stage_panels)
    ncols = max(1, min(ncols, n))
    nrows = math.ceil(n / ncols)
    width, height = 4.2 * ncols, 2.9 * nrows
    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    # fixed margins in inches (a constrained layout costs as much as drawing the figure)
    fig.subplots_adjust(left=0.7 / width, right=1 - 0.15 / width, top=1 - 0.55 / height,
                        bottom=0.45 / height, wspace=0.3, hspace=0.3 + 0.1 * nrows)
    fig.suptitle(f"stage {stage}", fontsize=12)
    for i, (title, series) in enumerate(stage_panels):
        ax = fig.add_subplot(nrows, ncols, i + 1)
        values = []
        for name, (xs, ys) in series.items():
            ax.plot(xs, ys, marker="o" if len(xs) <= 30 else None, markersize=3, linewidth=1.2, label=name)
            values += ys
        if values and min(values) > 0 and max(values) / min(values) > 1e3:
            ax.set_yscale("log")  # e.g. a grad norm that collapses by orders of magnitude
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if len(series) > 1:
            ax.legend(fontsize=7)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


# ============================================================================ the page

def render_markdown(workdir: str, table: list[dict], evals: dict[str, list[dict]],
                    metrics: dict[str, list[dict]], figures: dict[str, str]) -> str:
    """The report's Markdown.

    table: stage_table's rows; evals: {stage: read_agent_evals}; metrics: {stage: records};
    figures: {stage: figure file name relative to the report}.
    """
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"# Run report: `{workdir}`", "",
             f"Written {now}; render again with `python -m coder.report {workdir}`.", "",
             "## Stages", ""]
    lines += _md_table(
        ["stage", "start -> end", "steps", "wall time", "checkpoint"],
        [[r["stage"], format_measures(r["measures"]), _cell(r["steps"]),
          "-" if r["seconds"] is None else f"{r['seconds']:.1f}s",
          f"`{r['checkpoint']}`" if r["checkpoint"] else "-"] for r in table])
    lines.append("")
    all_evals = [(s, e) for s, es in evals.items() for e in es]
    if all_evals:
        keys = _pass_keys([e for _, e in all_evals])
        lines += ["## Agent eval (held-out tasks)", ""]
        rows = []
        for stage, e in all_evals:
            at = f"step {e.get('step')}" if e["cycle"] is None else f"cycle {e['cycle']} step {e.get('step')}"
            rows.append([stage, at] + [_cell(_number(e["summary"].get(k))) for k in keys]
                        + [_cell(e.get("num_tasks")), _cell(e.get("samples")), _cell(e.get("infra_failures")),
                           _cell(e.get("regressed"))])
        lines += _md_table(["stage", "at", *keys, "tasks", "samples / task", "infra failures", "regressed"], rows)
        lines.append("")
        with_cats = [(s, e) for s, e in all_evals if e.get("categories")]
        if with_cats:  # the suite's breakdown: pass@k and best-of-K per task category
            ks = [k[5:] for k in keys]
            lines += ["### By task category", ""]
            rows = [[stage, f"step {e.get('step')}", cat, _cell(c.get("num_tasks"))]
                    + [_cell(_number(c.get(f"pass@{k}"))) for k in ks]
                    + [_cell(_number(c.get(f"best_of_{k}"))) for k in ks]
                    for stage, e in with_cats for cat, c in sorted(e["categories"].items())]
            lines += _md_table(["stage", "at", "category", "tasks", *[f"pass@{k}" for k in ks],
                                *[f"best of {k}" for k in ks]], rows)
            lines.append("")
    lines += ["## Curves", ""]
    for stage, records in metrics.items():
        lines += [f"### {stage}", ""]
        if stage in figures:
            lines += [f"![{stage}]({figures[stage]})", ""]
        else:
            lines += [f"{len(records)} record{'s' if len(records) != 1 else ''}: no curve to draw "
                      "(values below).", ""]
        latest = last_values(records)
        if latest:
            lines += ["<details><summary>last value of every key</summary>", ""]
            lines += _md_table(["key", "value", "step"],
                               [[f"`{k}`", _cell(v), _cell(step)] for k, (step, v) in latest.items()])
            lines += ["", "</details>", ""]
    return "\n".join(lines) + "\n"


def write_report(workdir: str, out: str = "", rows: list[dict] | None = None) -> str:
    """Render the report of the run in `workdir` (a local path or fsspec URL) into `out` (default
    `{workdir}/report`); returns the path of report.md (`out`/report.md as given).

    rows: the console summary's rows of this run (coder.stages.summarize), shown as they are;
    merged into `{out}/stages.json` with those of earlier runs (a stage's newest row wins).
    NoMetricsError (naming the path) when no stage of `workdir` has a metrics.jsonl.
    """
    out = out or _join(workdir, "report")
    fs, _ = fsspec.core.url_to_fs(workdir)
    fs.invalidate_cache()  # listings cached by an earlier call (gcsfs) miss files written since
    stages = find_stages(workdir)
    if not stages:
        raise NoMetricsError(f"no metrics in {workdir}: no {_join(workdir, '<stage>', 'metrics.jsonl')} "
                             "(each stage of main.py writes one; is this a run's workdir?)")
    stored = merge_rows(read_stage_rows(out), rows or [])
    metrics = {s: read_metrics(_join(workdir, s)) for s in stages}
    table = stage_table(metrics, stored)
    metrics = {r["stage"]: metrics[r["stage"]] for r in table if r["stage"] in metrics}  # the table's order
    evals = {s: ev for s in metrics if (ev := read_agent_evals(_join(workdir, s)))}
    out_fs, out_root = fsspec.core.url_to_fs(out)
    out_fs.makedirs(out_root, exist_ok=True)
    figures = {}
    for stage, records in metrics.items():
        stage_panels = panels(records, evals.get(stage, []))
        if any(len(xs) > 1 for _, series in stage_panels for xs, _ in series.values()):
            name = f"{stage}.png"
            with out_fs.open(_join(out_root, name), "wb") as f:
                f.write(plot_stage(stage, stage_panels))
            figures[stage] = name
    with out_fs.open(_join(out_root, STAGES_FILE), "w") as f:
        json.dump(stored, f, indent=1, default=str)
    with out_fs.open(_join(out_root, REPORT), "w") as f:
        f.write(render_markdown(workdir, table, evals, metrics, figures))
    return _join(out, REPORT)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m coder.report",
                                description="Write a run's report (Markdown + PNG figures).")
    p.add_argument("workdir", help="the run's workdir (local path or gs://...)")
    p.add_argument("--out", default="", help="folder for report.md and the figures (default WORKDIR/report)")
    args = p.parse_args(argv)
    try:
        path = write_report(args.workdir, args.out)
    except NoMetricsError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    print(path, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
