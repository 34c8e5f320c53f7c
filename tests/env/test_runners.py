"""Test runners other than pytest (coder/env/runners.py): go test's JSON events and TAP parsed
into per-test statuses, and tasks with test ids scored through them in the sandbox (a TAP and a
`go test` stand-in written in bash, and node's own test runner where node is installed)."""

import shutil
import subprocess

import pytest

from coder.env import runners
from coder.env.reward import score, score_solution
from coder.env.sandbox import Sandbox
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


def _repo(root, files: dict):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(root), "GIT_CONFIG_NOSYSTEM": "1",
           "GIT_AUTHOR_NAME": "a", "GIT_AUTHOR_EMAIL": "a@x", "GIT_COMMITTER_NAME": "a",
           "GIT_COMMITTER_EMAIL": "a@x"}
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
        if path.endswith((".sh", "/go")):
            (root / path).chmod(0o755)
    git = lambda *a: subprocess.run(["git", *a], cwd=root, env=env, check=True,
                                    capture_output=True, text=True).stdout.strip()
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
