"""Test runners other than pytest (coder/env/scoring/runners.py): go test's JSON events, TAP, Django's
`runtests.py --verbosity 2` and sympy's `bin/test --verbose` output parsed into per-test
statuses (Django's and sympy's logs in tests/env/data/, also against the `swebench` package's
parsers where it is installed), and tasks with test ids scored through them in the sandbox (a
TAP and a `go test` stand-in written in bash, and node's own test runner where node is installed)."""

import os
import shutil
import subprocess

import pytest

from coder.env.scoring import runners
from coder.env.scoring.score import score, score_solution
from coder.env.runtime.sandbox import Sandbox
from coder.env.tasks import Task

NODE_TAP = """TAP version 13
# Subtest: adds
ok 1 - adds
  ---
  duration_ms: 0.7
  ...
# Subtest: group
    # Subtest: inner ok
    ok 1 - inner ok
    # Subtest: inner bad
    not ok 2 - inner bad
      ---
      error: |-
        ok 3 - not a test point: inside a YAML block
      ...
    1..2
not ok 2 - group
# Subtest: skipped
ok 3 - skipped # SKIP
not ok 4 - later # TODO not yet
1..4
# pass 2
"""

GO_JSON = "\n".join([
    '{"Action":"run","Package":"ex.com/m","Test":"TestA"}',
    '{"Action":"output","Package":"ex.com/m","Test":"TestA","Output":"=== RUN TestA\\n"}',
    '{"Action":"pass","Package":"ex.com/m","Test":"TestA","Elapsed":0}',
    '{"Action":"fail","Package":"ex.com/m","Test":"TestB/case_1","Elapsed":0}',
    '{"Action":"fail","Package":"ex.com/m","Test":"TestB","Elapsed":0}',
    '# ex.com/broken [build failed]',
    '{"Action":"pass","Package":"ex.com/n","Test":"TestA","Elapsed":0}',
    '{"Action":"skip","Package":"ex.com/n","Test":"TestC","Elapsed":0}',
    '{"Action":"fail","Package":"ex.com/m","Elapsed":0.01}',
])


def test_tap_and_go_outputs_parse_into_statuses():
    assert runners.parse_tap(NODE_TAP) == {
        "adds": "passed", "group > inner ok": "passed", "group > inner bad": "failed",
        "group": "failed", "skipped": "skipped", "later": "skipped"}
    assert runners.parse_go(GO_JSON) == {
        "ex.com/m::TestA": "passed", "ex.com/m::TestB/case_1": "failed", "ex.com/m::TestB": "failed",
        "ex.com/n::TestA": "passed", "ex.com/n::TestC": "skipped",
        "TestB/case_1": "failed", "TestB": "failed", "TestC": "skipped"}  # TestA is ambiguous
    assert runners.infer("go test ./...") == "go" and runners.infer("python -m pytest -q") == "pytest"
    assert runners.infer("node --test --test-reporter=tap") == "tap" and runners.infer("make") == ""
    assert runners.command("go", "go test -count=1 ./...") == "go test -json -count=1 ./..."
    assert runners.command("go", "go test -json ./...") == "go test -json ./..."
    assert runners.named_paths("bash ./run.sh --x=1 ../up /abs") == {"bash", "run.sh"}
    with pytest.raises(ValueError, match="test_format 'junit'"):
        Task.from_json({"id": "t", "prompt": "", "repo": "/r", "commit": "c", "test_format": "junit"})


DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")  # tests/env/data


def _log(name: str) -> str:
    with open(os.path.join(DATA, name)) as f:
        return f.read()


def test_django_runtests_output_parses_as_swebench_reads_it():
    ops, cmds = "migrations.test_operations", "migrations.test_commands"
    assert runners.parse("django", _log("django_runtests.log")) == {
        f"test_add_field ({ops}.OperationTests)": "passed",
        "Tests the AddField operation on TextField/BinaryField.": "passed",  # a docstring names it
        f"test_alter_field ({ops}.OperationTests)": "failed",
        f"test_rename_model ({ops}.OperationTests)": "failed",  # an ERROR
        f"test_postgres_only ({ops}.OperationTests)": "skipped",
        f"test_reference_field ({ops}.FieldOperationTests)": "passed",  # output, then a bare `ok`
        f"test_squash ({cmds}.SquashMigrationsTests.test_squash)": "passed",  # Django 4+'s form
        f"test_check ({cmds}.MakeMigrationsTests)": "passed",  # one of the interleavings
        "test_alter_field": "failed", "test_rename_model": "failed",  # the word after FAIL: / ERROR:
    }  # test_makemigrations_output ends its line with " ... " and output: absent, as in SWE-bench


def test_sympy_bin_test_output_parses_as_swebench_reads_it():
    assert runners.parse("sympy", _log("sympy_bin_test.log")) == {
        "test__aresame": "passed", "test_structure": "passed", "test_equality": "failed",
        "test_matches_basic": "failed", "test_printmethod": "passed", "test_latex_basic": "passed",
        "sympy/core/tests/test_basic.py:test_matches_basic": "failed",  # the failures' headers
        "sympy/core/tests/test_basic.py:test_equality": "failed",
    }  # a file's last test shares its line with `[OK]` / `[FAIL]`; `f` / `s` are not read
    with pytest.raises(ValueError, match="log formats are"):
        runners.parse("pytest", "")


@pytest.mark.parametrize("fmt, log", [("django", "django_runtests.log"), ("sympy", "sympy_bin_test.log")])
def test_django_and_sympy_statuses_agree_with_the_swebench_package(fmt, log, as_coder_statuses):
    parsers = pytest.importorskip("swebench.harness.log_parsers",
                                  reason="the swebench package is not installed (pip install -e .[swe])")
    theirs = parsers.PARSER_REGISTRY[f"parse_log_{fmt}"](_log(log), None)
    assert runners.parse(fmt, _log(log)) == as_coder_statuses(theirs)


def _repo(root, files: dict):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(root), "GIT_CONFIG_NOSYSTEM": "1",
           "GIT_AUTHOR_NAME": "a", "GIT_AUTHOR_EMAIL": "a@x", "GIT_COMMITTER_NAME": "a",
           "GIT_COMMITTER_EMAIL": "a@x"}
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
        if path.endswith((".sh", "/go")):
            (root / path).chmod(0o755)

    def git(*a):
        return subprocess.run(["git", *a], cwd=root, env=env, check=True, capture_output=True,
                              text=True).stdout.strip()

    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "start")
    return str(root), git("rev-parse", "HEAD")


TAP_RUNNER = """#!/bin/bash
echo "TAP version 13"
if [ "$(cat answer.txt)" = 42 ]; then echo "ok 1 - reads the answer"; else echo "not ok 1 - reads the answer"; bad=1; fi
echo "ok 2 - stays green"
exit ${bad:-0}
"""
GO_STANDIN = """#!/bin/bash
[ "$1 $2" = "test -json" ] || { echo "expected go test -json, got: $*"; exit 2; }
a=fail; [ "$(cat answer.txt)" = 42 ] && a=pass
echo '{"Action":"'$a'","Package":"ex.com/m","Test":"TestAnswer"}'
echo '{"Action":"pass","Package":"ex.com/m","Test":"TestOther"}'
[ $a = pass ]
"""


@pytest.mark.parametrize("fmt", ["tap", "go"])
def test_runner_tasks_score_by_their_ids(tmp_path, fmt):
    files = {"answer.txt": "41\n", "run.sh": TAP_RUNNER, "tools/go": GO_STANDIN}
    repo, sha = _repo(tmp_path, files)
    cmd, f2p, p2p = {"tap": ("bash run.sh", "reads the answer", "stays green"),
                     "go": ("tools/go test ./...", "ex.com/m::TestAnswer", "TestOther")}[fmt]
    task = Task("r", "fix it", {}, {}, test_command=cmd, repo=repo, commit=sha,
                fail_to_pass=(f2p,), pass_to_pass=(p2p,), test_format=fmt if fmt == "tap" else "")
    assert runners.format_of(task) == fmt
    start = score_solution(task, {})
    assert (start.reward, start.passed, start.total, start.not_passed) == (0.0, 1, 2, (f2p,)), start
    assert score_solution(task, {"answer.txt": "42\n"}).reward == 1.0
    with Sandbox(task) as sb:  # the agent edits the runner to print a pass: it is restored first
        sb.write("answer.txt", "7\n")
        forged = {"tap": "#!/bin/bash\necho 'ok 1 - reads the answer'; echo 'ok 2 - stays green'\n",
                  "go": "#!/bin/bash\necho '{\"Action\":\"pass\",\"Package\":\"ex.com/m\",\"Test\":"
                        "\"TestAnswer\"}'\necho '{\"Action\":\"pass\",\"Test\":\"TestOther\"}'\n"}[fmt]
        sb.write("tools/go" if fmt == "go" else "run.sh", forged)
        assert score(sb, task).reward == 0.0
    lying = Task(**{**task.__dict__, "test_command": "echo 'not ok 1 - reads the answer'",
                    "test_format": "tap"})
    s = score_solution(lying, {})
    assert s.reward == 0.0 and "exit status 0 disagrees" in s.error, s


@pytest.mark.parametrize("fmt, log", [("django", "django_runtests.log"), ("sympy", "sympy_bin_test.log")])
def test_django_and_sympy_ids_are_scored_not_infrastructure_errors(tmp_path, fmt, log):
    """A command that replays the runner's log (exit status 1, as the runner's on a failure): the
    ids are read from its output; a PASS_TO_PASS id that failed there gives 0, a passing one 1."""
    repo, sha = _repo(tmp_path, {"out.log": _log(log)})
    ok, bad = {"django": ("test_add_field (migrations.test_operations.OperationTests)",
                          "test_alter_field (migrations.test_operations.OperationTests)"),
               "sympy": ("test_structure", "test_equality")}[fmt]
    task = Task("r", "fix it", {}, {}, test_command="cat out.log; exit 1", repo=repo, commit=sha,
                fail_to_pass=(ok,), pass_to_pass=(bad,), test_format=fmt)
    s = score_solution(task, {}, mode="resolved")
    assert (s.infra_error, s.reward, s.passed, s.not_passed) == (None, 0.0, 1, (bad,)), s
    assert s.error == f"1 of 2 tests did not pass (failed: {bad})"
    fine = Task(**{**task.__dict__, "pass_to_pass": ()})
    assert score_solution(fine, {}, mode="resolved").reward == 1.0


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_node_test_runner_task(tmp_path):
    files = {"sum.js": "module.exports = (a, b) => a - b;\n",
             "test/sum.test.js": "const test = require('node:test');\nconst assert = require('node:assert');\n"
                                 "const sum = require('../sum.js');\n"
                                 "test('sums', () => assert.strictEqual(sum(2, 3), 5));\n"
                                 "test('zero', () => assert.strictEqual(sum(0, 0), 0));\n"}
    repo, sha = _repo(tmp_path, files)
    task = Task("node", "sum is broken", {}, {}, test_command="node --test --test-reporter=tap",
                repo=repo, commit=sha, fail_to_pass=("sums",), pass_to_pass=("zero",))
    assert score_solution(task, {}).reward == 0.0
    fixed = score_solution(task, {"sum.js": "module.exports = (a, b) => a + b;\n"})
    assert (fixed.reward, fixed.passed, fixed.total) == (1.0, 2, 2), fixed
