"""coder/report.py: the run report of a workdir (Markdown + PNG figures), as main.py writes it at
the end of a run (coder.stages.write_report) and `python -m coder.report WORKDIR` renders it.

The fake run's metrics are written with the stages' own writer (coder.train.metrics.MetricsWriter)
and its agent-eval reports in coder.rl.eval's layout, so a format change on either side breaks
these tests; the stage table is checked against the console summary of the same rows
(coder.stages.summarize / _print_summary)."""
import io
import json
import os
import re
import uuid

import fsspec
import pytest

from coder import report

PNG = b"\x89PNG\r\n\x1a\n"

# stage -> [(step, record)] of the fake run: an LM stage with its held-out loss before / after,
# MTP with its held-out record, GRPO with rollout metrics and staleness, eval's single record
RUN = {
    "pretrain": [(0, {"heldout_loss": 7.5})]
    + [(s, {"loss": v, "grad_norm": 1.0 / s, "lr": 1e-3, "tokens_per_s": 1000.0 + s, "mfu": 0.1})
       for s, v in ((1, 9.5), (2, 8.0), (3, 7.0), (4, 6.25))]
    + [(4, {"heldout_loss": 6.0})],
    "mtp": [(s, {"loss": v, "accept": a, "accept_1": a, "grad_norm": 0.5, "lr": 1e-3, "tokens_per_s": 900.0})
            for s, v, a in ((1, 1.5, 0.6), (2, 0.5, 0.7), (3, 0.25, 0.8))]
    + [(3, {"heldout/accept": 0.75, "heldout/accept_1": 0.75, "heldout/kl": 0.2, "loss": 0.2})],
    "grpo": [(s, {"loss": v, "reward": r, "pass_rate": p, "grad_norm": 0.01, "staleness_mean": 0.5,
                  "staleness_max": 1, "tokens_per_s": 50.0})
             for s, v, r, p in ((1, 0.5, -0.2, 0.0), (2, 0.25, 0.1, 0.5), (3, 0.125, 0.4, 0.75))],
    "eval": [(3, {"loss": 5.5, "perplexity": 244.7, "pass@1": 0.75, "regressed": False})],
}
EVALS = {"grpo": [(0, 0.25), (3, 0.75)], "eval": [(3, 0.75)]}  # stage -> [(step, pass@1)]

# what each stage's table row must say: the console summary's numbers (checked against it too)
EXPECTED = {"pretrain": ["loss 9.5 -> 6.25", "held-out 7.5 -> 6"],
            "grpo": ["loss 0.5 -> 0.125", "reward -0.2 -> 0.4", "pass@1 0.25 -> 0.75"]}


def _write_eval(stage_dir: str, step: int, pass1: float):
    """An agent-eval report as coder.rl.eval.run_agent_eval writes it (4 tasks, 2 samples each)."""
    from coder.rl import eval as eval_lib

    correct = round(pass1 * 8)
    counts = [(2, min(2, max(0, correct - 2 * i))) for i in range(4)]
    summary = eval_lib.summarize(counts, (1, 2))
    assert summary["pass@1"] == pytest.approx(pass1)
    os.makedirs(os.path.join(stage_dir, "agent_eval"), exist_ok=True)
    with open(os.path.join(stage_dir, "agent_eval", f"step_{step:08d}.json"), "w") as f:
        json.dump({"step": step, "summary": summary, "num_tasks": 4, "samples": 2, "infra_failures": 0,
                   "regressed": False, "previous_step": None,
                   "tasks": [{"id": f"t{i}", "n": n, "correct": c, "mean_test_reward": c / n, "infra_failures": 0}
                             for i, (n, c) in enumerate(counts)], "time_s": 1.0}, f, indent=1)


def _fake_run(workdir, stages=tuple(RUN)) -> str:
    from coder.train.metrics import MetricsWriter

    for stage in stages:
        stage_dir = os.path.join(workdir, stage)
        writer = MetricsWriter(stage_dir, stage, tensorboard=False)
        for step, record in RUN[stage]:
            writer.write(step, record)
        writer.close()
        for step, pass1 in EVALS.get(stage, []):
            _write_eval(stage_dir, step, pass1)
    return str(workdir)


def _table_row(markdown: str, stage: str) -> str:
    """The stage table's row of `stage` (the agent-eval table's rows say `| stage | step N |`)."""
    (row,) = [ln for ln in markdown.splitlines()
              if ln.startswith(f"| {stage} | ") and not ln.startswith(f"| {stage} | step ")]
    return row


def _is_png(data: bytes) -> bool:
    from matplotlib import image

    return data[:8] == PNG and len(data) > 5000 and image.imread(io.BytesIO(data), format="png").shape[0] > 100


def test_main_job_report_shows_the_console_summary(tmp_path, capsys, caplog, monkeypatch):
    """The end of a main.py run: the summary rows as printed, then the report, its path last."""
    from coder import stages

    workdir = _fake_run(tmp_path / "run")
    rows = [stages.summarize(s, os.path.join(workdir, s), 12.5 + i, f"{workdir}/{s}/checkpoints")
            for i, s in enumerate(RUN)]
    stages._print_summary(rows)
    path = stages.write_report(workdir, rows)
    console = capsys.readouterr().out
    assert path == f"{workdir}/report/report.md"
    assert console.rstrip().splitlines()[-1] == f"report: {path}"
    md = open(path).read()
    for stage, parts in EXPECTED.items():
        row = _table_row(md, stage)
        for part in parts:
            assert part in console, (part, console)
            assert part in row, (part, row)
    assert "| 4 | 12.5s |" in _table_row(md, "pretrain") and f"`{workdir}/grpo/checkpoints`" in md
    # agent evals: grpo before / after, and the eval stage's
    assert "| grpo | step 0 | 0.25 |" in md and "| grpo | step 3 | 0.75 |" in md and "| eval | step 3 | 0.75 |" in md
    # a figure per stage with curves (eval's single record has none), valid PNGs, linked
    for stage in ("pretrain", "mtp", "grpo"):
        assert f"![{stage}]({stage}.png)" in md
        assert _is_png(open(os.path.join(workdir, "report", f"{stage}.png"), "rb").read())
    assert not os.path.exists(os.path.join(workdir, "report", "eval.png")) and "![eval]" not in md
    assert "| `heldout/accept_1` | 0.75 | 3 |" in md and "| `accept_1` | 0.8 | 3 |" in md  # each key's last value
    # rendering again without the rows keeps the numbers main.py printed (stages.json)
    kept = report.stage_table({}, report.read_stage_rows(f"{workdir}/report"))
    assert [r["stage"] for r in kept] == list(RUN)
    assert [report.format_measures(r["measures"]) for r in kept] == [report.format_measures(report.measures_of(r))
                                                                      for r in rows]

    # a report that cannot be rendered does not fail the finished run: a warning names the reason
    def broken(*a, **k):
        raise RuntimeError("disk full")

    caplog.set_level("INFO")
    with monkeypatch.context() as m:
        m.setattr(report, "write_report", broken)
        assert stages.write_report(workdir, rows) is None
    assert "disk full" in caplog.text and "report:" not in capsys.readouterr().out
    # a run without metrics (compile only) has no report and says so quietly
    assert stages.write_report(str(tmp_path / "empty"), []) is None
    assert "no run report" in caplog.text


def test_cli_on_a_run_main_py_never_summarized(tmp_path, capsys):
    """`python -m coder.report WORKDIR --out DIR` on a run without stages.json: loss and reward
    first -> last from the metrics, no wall time; only the keys a stage logged are drawn."""
    workdir = _fake_run(tmp_path / "run", ("pretrain", "grpo"))
    out = str(tmp_path / "elsewhere")
    capsys.readouterr()
    assert report.main([workdir, "--out", out]) == 0
    assert capsys.readouterr().out.strip() == f"{out}/report.md"
    md = open(f"{out}/report.md").read()
    assert "| pretrain | loss 9.5 -> 6.25 | 4 | - | - |" in md
    assert "| grpo | loss 0.5 -> 0.125, reward -0.2 -> 0.4 | 3 | - | - |" in md
    assert sorted(os.listdir(out)) == ["grpo.png", "pretrain.png", "report.md", "stages.json"]

    titles = [t for t, _ in report.panels(report.read_metrics(f"{workdir}/pretrain"))]
    assert titles == ["loss", "grad norm", "learning rate", "tokens/s", "MFU"]
    grpo = dict(report.panels(report.read_metrics(f"{workdir}/grpo"), report.read_agent_evals(f"{workdir}/grpo")))
    assert set(grpo["staleness (versions)"]) == {"staleness_mean", "staleness_max"}
    assert grpo[report.EVAL_PANEL]["pass@1"] == ([0, 3], [0.25, 0.75])
    assert grpo["reward"]["reward"] == ([1, 2, 3], [-0.2, 0.1, 0.4])
    assert "MTP acceptance" not in grpo and "MFU" not in grpo


def test_mtp_panels():
    """Per-depth acceptance replaces the mean over depths; the held-out record is its own series."""
    records = [dict(step=s, **r) for s, r in RUN["mtp"]]
    mtp = dict(report.panels(records))
    assert set(mtp["MTP acceptance"]) == {"accept_1", "heldout/accept_1"}
    assert mtp["loss"] == {"loss": ([1, 2, 3], [1.5, 0.5, 0.25])}  # the held-out record's `loss` is not training's


def test_memory_filesystem_workdir(tmp_path):
    """fsspec throughout: a memory:// workdir (as gs://) is read and its report written there."""
    local = _fake_run(tmp_path / "run", ("pretrain", "grpo"))
    url = f"memory://report-test-{uuid.uuid4().hex}/run"
    fs = fsspec.filesystem("memory")
    try:
        for stage in ("pretrain", "grpo"):
            fs.pipe(f"{url}/{stage}/metrics.jsonl", open(f"{local}/{stage}/metrics.jsonl", "rb").read())
        fs.pipe(f"{url}/grpo/agent_eval/step_00000003.json",
                open(f"{local}/grpo/agent_eval/step_00000003.json", "rb").read())
        path = report.write_report(url, rows=[{"stage": "grpo", "measures": {"reward": [-0.2, 0.4]},
                                               "steps": 3, "seconds": 7.0, "checkpoint": "gs://b/ckpt"}])
        assert path == f"{url}/report/report.md"
        md = fs.cat_file(path).decode()
        assert "| grpo | reward -0.2 -> 0.4 | 3 | 7.0s | `gs://b/ckpt` |" in md
        assert "| pretrain | loss 9.5 -> 6.25 | 4 | - | - |" in md
        assert "| grpo | step 3 | 0.75 |" in md
        assert _is_png(fs.cat_file(f"{url}/report/pretrain.png")) and _is_png(fs.cat_file(f"{url}/report/grpo.png"))
    finally:
        fs.rm(url.rsplit("/", 1)[0], recursive=True)


def test_missing_metrics_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "run" / "pretrain").mkdir(parents=True)  # a stage directory without metrics.jsonl
    for workdir in (str(tmp_path / "run"), str(tmp_path / "nowhere")):
        with pytest.raises(report.NoMetricsError, match=re.escape(f"no metrics in {workdir}: no {workdir}/<stage>/metrics.jsonl")):
            report.write_report(workdir)
        assert report.main([workdir]) == 1
        assert f"error: no metrics in {workdir}" in capsys.readouterr().err
    assert not (tmp_path / "run" / "report").exists()


def test_stage_order_follows_the_stage_table():
    from coder import stages

    assert report.STAGE_ORDER == tuple(stages.STAGES)
