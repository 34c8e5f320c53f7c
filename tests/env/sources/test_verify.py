"""make_tasks --verify's drops and table (coder/env/sources/verify.py) as functions of the two scores;
the same through the sandbox and the CLI is tests/env/sources/test_swebench.py's."""

from coder.env.sources import verify
from coder.env.scoring.score import Score
from coder.env.tasks import Task

RESOLVED = Score(1.0, 3, 3)


def test_each_drop_names_its_cause():
    absent = Score(0.0, 2, 3, "1 of 3 tests did not pass (absent from the report: t.py::test_gone)",
                   not_passed=("t.py::test_gone",))
    assert str(verify.why_dropped(absent, None)) == (
        "gold fails: the gold patch scores 0: 1 of 3 tests did not pass (absent from the report: t.py::test_gone)")
    output = "".join(f"line {i}\n" for i in range(30)) + "E   ModuleNotFoundError: No module named 'numpy'\n"
    crashed = Score(0.0, 0, 0, "no test report (pytest exit status 4: the run ended early or was tampered with)",
                    output=output)
    drop = verify.why_dropped(crashed, None)
    assert drop.reason == "no results" and drop.detail.endswith(
        "the test run's output ends:\n" + "".join(f"    | line {i}\n" for i in range(16, 30))
        + "    | E   ModuleNotFoundError: No module named 'numpy'")
    assert verify.why_dropped(Score(0.0, 0, 0, "no tests of the task ran"), None).detail.endswith("    | (no output)")
    assert verify.why_dropped(Score(0.0, 0, 0, "patch does not apply: x"), None) == verify.Drop(
        "no apply", "patch does not apply: x")
    assert verify.why_dropped(Score(0.0, 0, 0, infra_error="sandbox: no python3.9 found"), None) == verify.Drop(
        "env/sandbox", "the gold patch's run: sandbox: no python3.9 found")
    assert verify.why_dropped(RESOLVED, None) is None and verify.why_dropped(RESOLVED, Score(0.0, 1, 3)) is None
    assert str(verify.why_dropped(RESOLVED, Score(0.5, 2, 3, "1 of 3 tests did not pass (failed: t.py::b)"))) == (
        "no-op passes: the unchanged workspace scores 0.5: 1 of 3 tests did not pass (failed: t.py::b)")
    assert verify.why_dropped(RESOLVED, Score(0.0, 0, 0, infra_error="sandbox: x")).reason == "env/sandbox"
    assert set(verify.REASONS) == {"gold fails", "no results", "no apply", "no-op passes", "env/sandbox"}


def test_table_per_repository():
    def task(i, repo):
        return Task(f"t{i}", "", {}, {}, repo="/r", commit="c", metadata={"repo": repo})

    tasks = [task(0, "pvlib/pvlib-python"), task(1, "pvlib/pvlib-python"), task(2, "pvlib/pvlib-python"),
             task(3, "pydicom/pydicom")]
    dropped = {"t1": verify.Drop("gold fails", "x"), "t3": verify.Drop("env/sandbox", "y")}
    rows = {"pvlib/pvlib-python": 4, "pydicom/pydicom": 1, "sqlfluff/sqlfluff": 2}  # 3 rows did not import
    assert verify.table(tasks, dropped, rows).split("\n") == [
        "repository          rows  imported  verified  gold fails  no results  no apply  no-op passes  env/sandbox",
        "pvlib/pvlib-python     4         3         2           1           0         0             0            0",
        "pydicom/pydicom        1         1         0           0           0         0             0            1",
        "sqlfluff/sqlfluff      2         0         0           0           0         0             0            0",
        "total                  7         4         2           1           0         0             0            1",
    ]
    assert verify.table(tasks[:1], {}).split("\n")[0].startswith("repository          imported  verified")
