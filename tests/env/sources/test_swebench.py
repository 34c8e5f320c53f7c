"""Repository tasks (task format v2) and the SWE-bench importer, on a fixture repository built
here: a tiny package with two bugs (`add`, `mul`), a later commit with the fix and its tests."""

import dataclasses
import json
import os
import shutil
import subprocess
import tarfile

import pytest

from coder.env import check, make_tasks
from coder.env.sources import swebench
from coder.env.sources import repo as repo_lib
from coder.env.episode import Episode
from coder.env.protocol import render_tool_call as rc
from coder.env.scoring.score import score, score_solution
from coder.env.runtime.sandbox import Sandbox, SandboxError
from coder.env.tasks import Task, read_solutions, read_tasks

OPS_BUGGY = (
    "def add(a, b):\n    return a - b\n\n\n"
    "def mul(a, b):\n    return a + b\n\n\n"
    "def neg(x):\n    return -x\n"
)
OPS_FIXED = OPS_BUGGY.replace("return a - b", "return a + b").replace(
    "def mul(a, b):\n    return a + b", "def mul(a, b):\n    return a * b"
)
OPS_HALF = OPS_BUGGY.replace("return a - b", "return a + b")  # add fixed, mul still wrong
TEST_OPS = "from calc.ops import neg\n\n\ndef test_neg():\n    assert neg(2) == -2\n"
TEST_FIX = (
    "import pytest\n\nfrom calc.ops import add, mul\n\n\n"
    "def test_add():\n    assert add(2, 3) == 5\n\n\n"
    "class TestMul:\n"
    "    @pytest.mark.parametrize('a,b', [(2, 3)])\n"
    "    def test_mul(self, a, b):\n        assert mul(a, b) == 6\n"
)
F2P = ["tests/test_fix.py::test_add", "tests/test_fix.py::TestMul::test_mul[2-3]"]
P2P = ["tests/test_ops.py::test_neg"]


def _git(cwd, *args) -> str:
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(cwd),
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_AUTHOR_NAME": "a",
        "GIT_AUTHOR_EMAIL": "a@x",
        "GIT_COMMITTER_NAME": "a",
        "GIT_COMMITTER_EMAIL": "a@x",
        "GIT_AUTHOR_DATE": "2024-01-01T00:00:00Z",  # fixed: the same shas in every run, so the
        "GIT_COMMITTER_DATE": "2024-01-01T00:00:00Z",  # checkout cache is reused
    }
    return subprocess.run(
        ["git", "-c", "init.defaultBranch=main", *args],
        cwd=cwd, env=env, check=True, capture_output=True, text=True,
    ).stdout


def _commit(repo, files: dict, msg: str) -> str:
    for path, text in files.items():
        os.makedirs(os.path.dirname(os.path.join(repo, path)) or repo, exist_ok=True)
        with open(os.path.join(repo, path), "w") as f:
            f.write(text)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", msg)
    return _git(repo, "rev-parse", "HEAD").strip()


@pytest.fixture(scope="module")
def fixture(tmp_path_factory):
    """Mirrors dir with `acme__calc` (3 commits on main + a SWE-smith-style bug branch), an
    archive of it, and one instance in SWE-bench's exact JSON shape."""
    root = tmp_path_factory.mktemp("swe")
    repos = root / "repos"
    repo = repos / "acme__calc"
    repo.mkdir(parents=True)
    _git(repo, "init", "-q")
    _commit(
        repo,
        {
            "conftest.py": "",  # pytest puts the repository root on sys.path
            "calc/__init__.py": "",
            "calc/ops.py": OPS_BUGGY,
            "tests/test_ops.py": TEST_OPS,
            "colorsys.py": "GIVEN = 'the repository text'\n",  # an installed module's name
        },
        "calc",
    )
    base = _commit(repo, {"README": "calc\n"}, "readme")
    fix = _commit(repo, {"calc/ops.py": OPS_FIXED, "tests/test_fix.py": TEST_FIX}, "fix")
    gold = _git(repo, "diff", base, fix, "--", "calc")
    test_patch = _git(repo, "diff", base, fix, "--", "tests")
    smith_id = "acme__calc.1a2b3c4d.lm_rewrite__x1"
    _git(repo, "checkout", "-q", "-b", smith_id, base)
    _commit(repo, {"tests/test_fix.py": TEST_FIX}, "bug")  # SWE-smith: tests in the branch
    _git(repo, "checkout", "-q", "main")
    instance = {
        "repo": "acme/calc",
        "instance_id": "acme__calc-1",
        "base_commit": base,
        "patch": gold,
        "test_patch": test_patch,
        "problem_statement": "add() subtracts and mul() adds.",
        "hints_text": "",
        "created_at": "2024-01-01T00:00:00Z",
        "version": "1.0",
        "FAIL_TO_PASS": json.dumps(F2P),  # the released datasets' JSON strings
        "PASS_TO_PASS": json.dumps(P2P),
        "environment_setup_commit": base,
    }
    archives = root / "archives"
    archives.mkdir()
    with tarfile.open(archives / "acme__calc.tar.gz", "w:gz") as t:
        t.add(repo, arcname="acme__calc")
    unpacked = os.path.join(repo_lib.CACHE, "archives")
    before = set(os.listdir(unpacked)) if os.path.isdir(unpacked) else set()
    yield dict(
        root=root, repos=repos, archives=archives, base=base, fix=fix, gold=gold,
        instance=instance, smith_id=smith_id,
    )
    for name in set(os.listdir(unpacked)) - before if os.path.isdir(unpacked) else ():
        shutil.rmtree(os.path.join(unpacked, name), ignore_errors=True)  # this run's archives


def _import(fx, tmp_path, rows, repos=None, extra=()):
    inp, out, sols = tmp_path / "i.jsonl", tmp_path / "t.jsonl", tmp_path / "s.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["--source", "swebench", "--input", str(inp), "--repos", str(repos or fx["repos"]),
            "--out", str(out), "--solutions", str(sols), *extra]
    assert make_tasks.main(argv) == 0
    return read_tasks(out), read_solutions(sols)


@pytest.mark.slow
def test_import_gold_scores_one_empty_and_partial_do_not(fixture, tmp_path, capsys):
    (task,), sols = _import(fixture, tmp_path, [fixture["instance"]])
    assert task.repo == str(fixture["repos"] / "acme__calc") and task.commit == fixture["base"]
    assert task.fail_to_pass == tuple(F2P) and task.pass_to_pass == tuple(P2P)
    assert task.prompt == "add() subtracts and mul() adds." and task.source == "swebench"
    m = task.metadata
    assert (m["source"], m["repo"], m["files_changed"]) == (
        "swebench", "acme/calc", ["calc/ops.py"]
    )
    assert (m["lines_added"], m["lines_removed"]) == (2, 2) and m["version"] == "1.0"
    assert sols == {"acme__calc-1": fixture["gold"]}
    s = score_solution(task, sols[task.id], mode="resolved")
    assert (s.reward, s.passed, s.total, s.error) == (1.0, 3, 3, None), s.output
    s = score_solution(task, "", mode="resolved")
    assert (s.reward, s.passed, s.total) == (0.0, 1, 3)
    assert set(s.not_passed) == set(F2P)
    half = {"calc/ops.py": OPS_HALF}
    s = score_solution(task, half, mode="resolved")
    assert (s.reward, s.passed, s.not_passed) == (0.0, 2, (F2P[1],))
    assert score_solution(task, half, mode="fraction").reward == 0.5
    assert score_solution(task, "", mode="fraction").reward == 0.0  # P2P alone earns nothing
    broke_p2p = {"calc/ops.py": OPS_FIXED.replace("return -x", "return x")}
    assert score_solution(task, broke_p2p, mode="fraction").reward == 0.0
    check.main(["--tasks", str(tmp_path / "t.jsonl"), "--solutions", str(tmp_path / "s.jsonl"),
                "--workers", "1", "--mode", "resolved"])  # patch solutions through the CLI
    row = json.loads(capsys.readouterr().out)
    assert (row["id"], row["reward"], row["total"], row["error"]) == ("acme__calc-1", 1.0, 3, None)
    broken = dict(fixture["instance"], instance_id="acme__calc-2",  # a test that does not exist
                  FAIL_TO_PASS=json.dumps([*F2P, "tests/test_fix.py::test_gone"]))
    missing = "tests/test_missing.py"  # a test module whose import fails: pytest reports nothing
    crashing = dict(fixture["instance"], instance_id="acme__calc-3", FAIL_TO_PASS=[f"{missing}::test_x"],
                    PASS_TO_PASS=[], test_patch=f"diff --git a/{missing} b/{missing}\nnew file mode 100644\n"
                    f"--- /dev/null\n+++ b/{missing}\n@@ -0,0 +1,4 @@\n+import nope_missing\n+\n+\n+def test_x():\n")
    crashing["test_patch"] += "+    pass\n"
    crashing["test_patch"] = crashing["test_patch"].replace("+1,4 @@", "+1,5 @@")
    noop = dict(fixture["instance"], instance_id="acme__calc-4", FAIL_TO_PASS=P2P, PASS_TO_PASS=[])
    gone = dict(fixture["instance"], instance_id="acme__none-1", repo="acme/none")
    inp = tmp_path / "v.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in [fixture["instance"], broken, crashing, noop, gone]))
    assert make_tasks.main(["--source", "swebench", "--input", str(inp), "--repos",
                            str(fixture["repos"]), "--out", str(tmp_path / "v_t.jsonl"),
                            "--verify", "--workers", "1"]) == 1  # one of five kept
    assert [t.id for t in read_tasks(tmp_path / "v_t.jsonl")] == ["acme__calc-1"]
    err = capsys.readouterr().err
    assert ("dropped acme__calc-2: gold fails: the gold patch scores 0: 1 of 4 tests did not pass "
            "(absent from the report: tests/test_fix.py::test_gone)\n") in err
    assert "dropped acme__calc-3: no results: the gold patch scores 0: pytest exit status 2" in err
    assert "    | E   ModuleNotFoundError: No module named 'nope_missing'\n" in err  # the run's own output
    assert "dropped acme__calc-4: no-op passes: the unchanged workspace scores 1\n" in err
    assert "skipped row 4 (acme__none-1): no local mirror of 'acme/none'" in err
    assert err.split("\n")[-6:-2] == [  # then "wrote 1 swebench tasks to ..."
        "repository  rows  imported  verified  gold fails  no results  no apply  no-op passes  env/sandbox",
        "acme/calc      4         4         1           1           1         0             1            0",
        "acme/none      1         0         0           0           0         0             0            0",
        "total          5         4         1           1           1         0             1            0"]
    s = score_solution(task, "diff --git a/nope.py b/nope.py\n--- a/nope.py\n+++ b/nope.py\n"
                       "@@ -1 +1 @@\n-x\n+y\n")
    assert s.reward == 0.0 and "does not apply" in s.error and not s.infra_error


def test_agent_sees_neither_the_hidden_tests_nor_the_fix(fixture, tmp_path):
    (task,), _ = _import(fixture, tmp_path, [fixture["instance"]])
    repo = fixture["repos"] / "acme__calc"
    fixed_blob = _git(repo, "rev-parse", f"{fixture['fix']}:calc/ops.py").strip()
    test_blob = _git(repo, "rev-parse", f"{fixture['fix']}:tests/test_fix.py").strip()
    with Sandbox(task) as sb:
        assert not [p for p in sb.list_files() if "test_fix" in p]
        assert "tests/test_ops.py" in sb.list_files() and sb.read("calc/ops.py") == OPS_BUGGY
        r = sb.run(
            "git log --all --format=%H; echo ---; git status --short; echo ---; "
            f"git cat-file -e {fixture['fix']} && echo FIX-REACHABLE; "
            "git cat-file --batch-all-objects --batch-check='%(objectname)'; echo ---; "
            "find / -path /proc -prune -o -name test_fix.py -print 2>/dev/null; "
            "python -I -c 'import colorsys; print(colorsys.GIVEN)'"
        )
        log, status, objects, rest = r.stdout.split("---\n")
        assert log.split() == [fixture["base"]] and status == ""
        assert "FIX-REACHABLE" not in objects and objects.split()
        assert fixed_blob not in objects and test_blob not in objects
        assert rest.strip().splitlines() == ["the repository text"], r.stdout + r.stderr
        st = os.stat(os.path.join(sb.workspace, "calc", "ops.py"))
        assert st.st_uid == (sb.uid if os.geteuid() == 0 else os.getuid())
        sb.write("calc/ops.py", OPS_FIXED)
        assert sb.run("git diff --stat").stdout.strip().startswith("calc/ops.py")
        assert score(sb, task, mode="resolved").reward == 1.0
        assert os.path.isfile(os.path.join(sb.workspace, "tests", "test_fix.py"))  # at scoring


@pytest.mark.parametrize(
    "cheat",
    [
        "printf 'def test_add():\\n    pass\\n' > tests/test_fix.py",  # the hidden test's path
        "printf 'import os\\nos._exit(0)\\n' > conftest.py",  # a tracked control file
        "rm -rf tests && ln -s /tmp tests",  # the test directory swapped for a symlink
        "rm tests/test_ops.py && printf 'def test_neg():\\n    pass\\n' > tests/x.py",
    ],
)
def test_repository_cheats_score_zero(fixture, tmp_path, cheat):
    (task,), _ = _import(fixture, tmp_path, [fixture["instance"]])
    with Sandbox(task) as sb:
        sb.write("calc/ops.py", OPS_HALF.replace("return -x", "return x"))  # P2P broken too
        assert sb.run(cheat).exit_code == 0
        s = score(sb, task, mode="fraction")
        assert (s.reward, s.passed) == (0.0, 1), s.output
        assert s.not_passed == (F2P[1], P2P[0])


def test_snapshot_of_a_repository_workspace(fixture, tmp_path):
    """G rollouts start from one snapshot (coder.env.pool): the restored workspace is the
    checkout, .git included, still hiding the installed copies of the repository's modules."""
    (task,), _ = _import(fixture, tmp_path, [fixture["instance"]])
    with Sandbox(task) as sb:
        snap = sb.snapshot()
    with Sandbox(task, snapshot=snap) as sb:
        assert "calc/ops.py" not in sb.run("git status --short").stdout
        r = sb.run("git log --format=%H; python -I -c 'import colorsys; print(colorsys.GIVEN)'")
        assert r.stdout.split("\n")[:2] == [fixture["base"], "the repository text"], r.stderr


def test_episode_solves_a_repository_task(fixture, tmp_path):
    (task,), _ = _import(fixture, tmp_path, [fixture["instance"]])
    ep = Episode(len, reward_mode="resolved")
    assert ep.reset(task) == task.prompt
    obs, done, info = ep.step(rc("run_tests", {}) + rc("read_file", {"path": "calc/ops.py"}))
    assert not done and "return a - b" in obs and "1 passed" in obs  # the visible test only
    obs, done, _ = ep.step(
        rc("write_file", {"path": "calc/ops.py", "content": OPS_FIXED})
        + rc("shell", {"command": "git status --porcelain && git diff --stat | tail -1"})
    )
    # the rollout forks the prepared tree (another uid's, world-writable): git still works
    assert not done and " M calc/ops.py" in obs and "1 file changed" in obs, obs
    _, done, info = ep.step(rc("submit", {}))
    assert done and info["done_reason"] == "submit" and info["infra_error"] is None
    assert (info["reward"], info["passed"], info["total"]) == (1.0, 3, 3)


def test_archive_repository_and_swe_smith_rows(fixture, tmp_path):
    (task,), sols = _import(fixture, tmp_path, [fixture["instance"]], repos=fixture["archives"])
    assert task.repo.endswith("acme__calc.tar.gz") and task.commit == fixture["base"]
    assert score_solution(task, sols[task.id], mode="resolved").reward == 1.0
    import fsspec  # any fsspec URL of an archive (gs://...): the in-memory file system here

    with fsspec.open("memory://mirrors/acme__calc.tar.gz", "wb") as f:
        f.write((fixture["archives"] / "acme__calc.tar.gz").read_bytes())
    file_url = "file://" + str(fixture["repos"] / "acme__calc")
    for repo in ("memory://mirrors/acme__calc.tar.gz", file_url):
        t = dataclasses.replace(task, repo=repo)
        assert score_solution(t, sols[task.id], mode="resolved").reward == 1.0, repo
    bug = _git(fixture["repos"] / "acme__calc", "diff", fixture["fix"], fixture["base"], "--",
               "calc")
    smith = {
        "instance_id": fixture["smith_id"],
        "repo": "swesmith/acme__calc.1a2b3c4d",
        "patch": bug,  # SWE-smith's patch introduces the bug
        "FAIL_TO_PASS": F2P,
        "PASS_TO_PASS": P2P,
        "image_name": "swesmith.x86_64.acme__calc.1a2b3c4d",
        "problem_statement": "mul and add are wrong",
    }
    (task,), sols = _import(fixture, tmp_path, [smith])
    assert task.metadata["variant"] == "swe-smith" and task.metadata["image_name"]
    assert task.test_patch == "" and swebench.reverse_patch(sols[task.id]) == bug
    assert score_solution(task, sols[task.id], mode="resolved").reward == 1.0
    assert score_solution(task, "", mode="resolved").reward == 0.0
    (task,), sols = _import(fixture, tmp_path, [dict(smith, patch=fixture["gold"])])
    assert sols[task.id] == fixture["gold"]  # a `patch` that is already the fix is kept
    with pytest.raises(ValueError, match="in neither way"):
        nope = "diff --git a/none.py b/none.py\n--- a/none.py\n+++ b/none.py\n@@ -1 +1 @@\n-x\n+y\n"
        swebench.import_instances([dict(smith, patch=nope)], str(fixture["repos"]))


def test_swe_rebench_install_config_and_list_fields(fixture, tmp_path):
    cmd = "pytest --no-header -rA --tb=line --color=no -p no:cacheprovider -W ignore::UserWarning"
    row = dict(fixture["instance"], FAIL_TO_PASS=F2P, PASS_TO_PASS=P2P,  # lists (SWE-Gym)
               install_config=json.dumps({"python": "3.11", "test_cmd": cmd}),
               docker_image="swerebench/acme-calc", meta={"is_lite": False})
    (task,), sols = _import(fixture, tmp_path, [row])
    assert task.test_command == cmd and task.metadata["variant"] == "swe-rebench"
    assert task.metadata["install_config"]["python"] == "3.11" and task.metadata["docker_image"]
    assert score_solution(task, sols[task.id], mode="resolved").reward == 1.0


CLI_BUGGY = "def locate(expr):\n    return None\n"
CLI_FIXED = "def locate(expr):\n    return expr.split('(')[0]\n"
TEST_DATA = (
    "import os\n\nimport pytest\n\n"
    "DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'data.txt')\n\n\n"
    "@pytest.mark.parametrize('path', [DATA])\ndef test_data_path(path):\n    assert os.path.exists(path)\n"
)
TEST_LOCATE = (
    "import pytest\n\nfrom app.cli import locate\n\n\n"
    "@pytest.mark.parametrize('expr', ['create_app2(\"foo\", \"bar\")', 'create_app'])\n"
    "def test_locate(expr):\n    assert locate(expr) == expr.split('(')[0]\n"
)


def test_swebench_ids_cut_at_a_space_and_naming_testbed_resolve(tmp_path):
    """SWE-bench's released ids as its log parsers cut them (at the first space; an absolute path
    parameter under the images' /testbed, or reduced to its file name for pydicom's parser): the
    gold patch resolves and the unchanged workspace does not."""
    repo = tmp_path / "repos" / "acme__app"
    repo.mkdir(parents=True)
    _git(repo, "init", "-q")
    base = _commit(repo, {"conftest.py": "", "app/__init__.py": "", "app/cli.py": CLI_BUGGY,
                          "tests/data.txt": "x\n", "tests/test_data.py": TEST_DATA}, "app")
    fix = _commit(repo, {"app/cli.py": CLI_FIXED, "tests/test_locate.py": TEST_LOCATE}, "fix")
    f2p = ['tests/test_locate.py::test_locate[create_app2("foo",', "tests/test_locate.py::test_locate[create_app]"]
    row = {"repo": "acme/app", "instance_id": "acme__app-1", "base_commit": base,
           "patch": _git(repo, "diff", base, fix, "--", "app"), "problem_statement": "locate finds nothing",
           "test_patch": _git(repo, "diff", base, fix, "--", "tests"), "FAIL_TO_PASS": json.dumps(f2p),
           "PASS_TO_PASS": json.dumps(["tests/test_data.py::test_data_path[/testbed/tests/data.txt]"])}
    pydicom_style = dict(row, instance_id="acme__app-2", log_parser="parse_log_pydicom",
                         PASS_TO_PASS=json.dumps(["tests/test_data.py::test_data_path[/data.txt]"]))
    pairs = swebench.import_instances([row, pydicom_style], str(tmp_path / "repos"))
    assert [t.test_format for t, _ in pairs] == ["swebench-pytest", "swebench-pytest-options"]
    for task, gold in pairs:
        s = score_solution(task, gold, mode="resolved")
        assert (s.reward, s.passed, s.total) == (1.0, 3, 3), (task.id, s.error, s.output)
        s = score_solution(task, "", mode="resolved")
        assert (s.reward, s.not_passed) == (0.0, tuple(f2p)), s
        assert "failed: " in s.error
    # keyed as node ids (coder's own format) the cut id still resolves, by the rule's prefix
    # match, but the id naming /testbed names no test of the workspace
    exact = dataclasses.replace(pairs[0][0], test_format="pytest")
    s = score_solution(exact, pairs[0][1], mode="resolved")
    assert (s.reward, s.not_passed) == (0.0, tuple(json.loads(row["PASS_TO_PASS"]))), s
    assert s.error.startswith("1 of 3 tests did not pass (absent from the report: tests/test_data.py::"), s.error
    with pytest.raises(ValueError, match="log parser 'parse_log_rust' is not one coder reads"):
        swebench.import_instances([dict(row, log_parser="parse_log_rust")], str(tmp_path / "repos"))


def test_src_layout_imports_from_src(fixture, tmp_path):
    """A base commit with a top-level src/ gets `-o pythonpath=src` (the package imports from there
    only; no conftest puts it on sys.path); a root layout keeps its command."""
    repo = tmp_path / "repos" / "acme__srcapp"
    repo.mkdir(parents=True)
    _git(repo, "init", "-q")
    base = _commit(repo, {"src/app/__init__.py": "", "src/app/cli.py": CLI_BUGGY, "tests/test_data.py": TEST_DATA,
                          "tests/data.txt": "x\n"}, "app")
    fix = _commit(repo, {"src/app/cli.py": CLI_FIXED, "tests/test_locate.py": TEST_LOCATE}, "fix")
    row = {"repo": "acme/srcapp", "instance_id": "acme__srcapp-1", "base_commit": base, "problem_statement": "x",
           "patch": _git(repo, "diff", base, fix, "--", "src"),
           "test_patch": _git(repo, "diff", base, fix, "--", "tests"),
           "FAIL_TO_PASS": ["tests/test_locate.py::test_locate[create_app]"], "PASS_TO_PASS": []}
    (task, gold), = swebench.import_instances([row], str(tmp_path / "repos"))
    assert task.test_command == "python -m pytest -q -o pythonpath=src"
    assert score_solution(task, gold, mode="resolved").reward == 1.0
    bare = dataclasses.replace(task, test_command="python -m pytest -q")
    s = score_solution(bare, gold, mode="resolved")
    assert s.reward == 0.0 and "No module named 'app'" in s.output, s
    (own, _), = swebench.import_instances([row], str(tmp_path / "repos"), "pytest -o pythonpath=lib")
    assert own.test_command == "pytest -o pythonpath=lib"
    (root, _), = swebench.import_instances([fixture["instance"]], str(fixture["repos"]))
    assert root.test_command == "python -m pytest -q"


def test_django_and_sympy_instances_run_their_harness_commands():
    patch = "".join(f"diff --git a/{p} b/{p}\n--- a/{p}\n+++ b/{p}\n@@ -1 +1 @@\n-a\n+b\n" for p in (
        "tests/migrations/test_operations.py", "tests/migrations/fixtures/data.json", "tests/admin_docs/tests.py"))
    assert swebench.test_directives(patch, django=True) == ["migrations.test_operations", "admin_docs.tests"]
    row = {"repo": "django/django", "version": "3.0", "test_patch": patch}
    assert swebench.test_format_of(row, {}) == "django"
    assert swebench.runner_command(row, "django") == (
        "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1 "
        "migrations.test_operations admin_docs.tests")
    assert swebench.runner_command(dict(row, version="1.9"), "django").startswith("./tests/runtests.py --verbosity 2 m")
    sympy = {"repo": "sympy/sympy", "test_patch": patch.replace("tests/migrations", "sympy/core/tests")}
    assert swebench.test_format_of(sympy, {}) == "sympy"
    assert swebench.runner_command(sympy, "sympy") == (
        "PYTHONWARNINGS='ignore::UserWarning,ignore::SyntaxWarning' bin/test -C --verbose "
        "sympy/core/tests/test_operations.py tests/admin_docs/tests.py")
    assert swebench.test_format_of({"repo": "swesmith/django__django.4c8ad9f1"}, {}) == "django"
    assert swebench.test_format_of({"repo": "x/y"}, {"log_parser": "parse_log_sympy"}) == "sympy"


# Django's layout: the package at the root, its runner tests/runtests.py taking test labels
# (`utils_tests.test_text`) and printing unittest's verbose lines, the tests under tests/.
DJANGO_RUNTESTS = """#!/usr/bin/env python
import argparse, os, sys, unittest

parser = argparse.ArgumentParser()
parser.add_argument("labels", nargs="*")
parser.add_argument("--verbosity", type=int, default=1)
parser.add_argument("--settings")
parser.add_argument("--parallel", type=int)
args = parser.parse_args()
tests_dir = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(tests_dir), tests_dir]
print("Testing against Django installed in '%s'" % os.path.dirname(tests_dir), flush=True)
suite = unittest.defaultTestLoader.loadTestsFromNames(args.labels)
result = unittest.TextTestRunner(verbosity=args.verbosity).run(suite)
sys.exit(not result.wasSuccessful())
"""
DJANGO_TEST = """import unittest

from django.utils.text import capfirst


class CapfirstTests(unittest.TestCase):
    def test_capfirst(self):
        self.assertEqual(capfirst("hello"), "Hello")

    def test_empty(self):
        \"\"\"An empty string stays empty.\"\"\"
        self.assertEqual(capfirst(""), "")
"""
# sympy's layout: bin/test runs the test functions of the files it is given and reports them as
# sympy's runner does with --verbose (a file's last result shares its line with [OK] / [FAIL]).
SYMPY_BIN_TEST = """#!/usr/bin/env python
import importlib.util, os, sys, traceback

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, root)
files = [a for a in sys.argv[1:] if not a.startswith("-")]
print("=" * 29 + " test process starts " + "=" * 30)
failures, passed = [], 0
for path in files:
    spec = importlib.util.spec_from_file_location("t", os.path.join(root, path))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    tests = [v for k, v in vars(mod).items() if k.startswith("test_") and callable(v)]
    sys.stdout.write("%s[%d] " % (path, len(tests)))
    bad = False
    for f in tests:
        sys.stdout.write("\\n" + f.__name__ + " ")
        try:
            f()
            sys.stdout.write("ok")
            passed += 1
        except AssertionError:
            sys.stdout.write("F")
            failures.append((path, f.__name__, traceback.format_exc()))
            bad = True
        except Exception:
            sys.stdout.write("E")
            failures.append((path, f.__name__, traceback.format_exc()))
            bad = True
    sys.stdout.write(" " + ("[FAIL]" if bad else "[OK]").rjust(60) + "\\n\\n")
for path, name, tb in failures:
    print("_" * 80)
    print((" %s:%s " % (path, name)).center(80, "_"))
    print(tb)
print("= tests finished: %d passed, %d failed, in 0.01 seconds =" % (passed, len(failures)))
sys.exit(1 if failures else 0)
"""
SYMPY_TEST = """from sympy.core.basic import double


def test_double():
    assert double(2) == 4


def test_double_zero():
    assert double(0) == 0


def test_last_in_file():
    assert double(1) == 2
"""
STYLES = {
    "django": {
        "repo": "django/django", "version": "4.2",
        "base": {"django/__init__.py": "", "django/utils/__init__.py": "",
                 "django/utils/text.py": "def capfirst(x):\n    return x\n",
                 "tests/runtests.py": DJANGO_RUNTESTS, "tests/utils_tests/__init__.py": ""},
        "exe": "tests/runtests.py",
        "fix": {"django/utils/text.py": "def capfirst(x):\n    return x[:1].upper() + x[1:]\n",
                "tests/utils_tests/test_text.py": DJANGO_TEST},
        "gold": "django", "tests": "tests",
        "f2p": ["test_capfirst (utils_tests.test_text.CapfirstTests.test_capfirst)"],
        "p2p": ["An empty string stays empty."],  # a docstring's first line is the id
    },
    "sympy": {
        "repo": "sympy/sympy", "version": "1.12",
        "base": {"sympy/__init__.py": "", "sympy/core/__init__.py": "",
                 "sympy/core/basic.py": "def double(x):\n    return x + x if x else 1\n",
                 "sympy/core/tests/__init__.py": "", "bin/test": SYMPY_BIN_TEST},
        "exe": "bin/test",
        "fix": {"sympy/core/basic.py": "def double(x):\n    return x + x\n",
                "sympy/core/tests/test_basic.py": SYMPY_TEST},
        "gold": "sympy/core/basic.py", "tests": "sympy/core/tests",
        "f2p": ["test_double_zero"], "p2p": ["test_double"],
    },
}


@pytest.mark.parametrize("style", ["django", "sympy"])
def test_django_and_sympy_style_instances_resolve_end_to_end(tmp_path, style):
    """A fixture repository in Django's / sympy's layout, imported as SWE-bench rows of those
    repositories: the harness's command on the test_patch's directives, the ids read from its
    output, the gold patch resolving and the unchanged workspace not, through the sandbox."""
    st = STYLES[style]
    repo = tmp_path / "repos" / st["repo"].replace("/", "__")
    repo.mkdir(parents=True)
    _git(repo, "init", "-q")
    _commit(repo, st["base"], "base")
    os.chmod(repo / st["exe"], 0o755)
    base = _commit(repo, {}, "the runner is executable")
    fix = _commit(repo, st["fix"], "fix")
    row = {"repo": st["repo"], "instance_id": f"{style}-1", "base_commit": base, "version": st["version"],
           "problem_statement": "fix it", "patch": _git(repo, "diff", base, fix, "--", st["gold"]),
           "test_patch": _git(repo, "diff", base, fix, "--", st["tests"]),
           "FAIL_TO_PASS": json.dumps(st["f2p"]), "PASS_TO_PASS": json.dumps(st["p2p"])}
    (task, gold), = swebench.import_instances([row], str(tmp_path / "repos"))
    assert task.test_format == style and task.test_command.endswith(
        {"django": " utils_tests.test_text", "sympy": " bin/test -C --verbose sympy/core/tests/test_basic.py"}[style])
    s = score_solution(task, gold, mode="resolved")
    assert (s.infra_error, s.reward, s.passed, s.total) == (None, 1.0, 2, 2), (s.error, s.output)
    s = score_solution(task, "", mode="resolved")
    assert (s.infra_error, s.reward, s.not_passed) == (None, 0.0, tuple(st["f2p"])), (s.error, s.output)
    assert s.error == f"1 of 2 tests did not pass (failed: {st['f2p'][0]})"
    if style == "sympy":  # a file's last test shares its line with [OK]: SWE-bench's parser never reads it
        last = dataclasses.replace(task, pass_to_pass=("test_last_in_file",))
        assert score_solution(last, gold, mode="resolved").not_passed == ("test_last_in_file",)


def test_environments_by_repository_and_version(fixture, tmp_path):
    """`--environments` gives a task the spec of its `repo@version`, else of its `repo`; a bad
    spec is refused naming its key (building one is tests/env/runtime/test_environments.py's)."""
    by_version = {"python": {"requirements": ["attrs==23.2.0"]}}
    by_repo = {"python": {"requirements": ["attrs==22.1.0"], "no_index": True}}
    specs = tmp_path / "environments.json"
    specs.write_text(json.dumps({"acme/calc@1.0": by_version, "acme/calc": by_repo}))
    rows = [fixture["instance"], dict(fixture["instance"], instance_id="acme__calc-2", version="2.0")]
    tasks, _ = _import(fixture, tmp_path, rows, extra=("--environments", str(specs)))
    assert [t.environment["python"]["requirements"] for t in tasks] == [["attrs==23.2.0"],
                                                                       ["attrs==22.1.0"]]
    assert tasks[1].environment["python"]["no_index"] is True
    (plain,), _ = _import(fixture, tmp_path, rows[:1])
    assert plain.environment == {}
    with pytest.raises(ValueError, match=r"environments\['acme/calc'\]\.python lacks requirements"):
        swebench.import_instances(rows, str(fixture["repos"]), environment_specs={"acme/calc": {
            "python": {}}})


def test_environment_python_version_from_the_spec_else_the_row(fixture, tmp_path):
    """A spec's `python.version` is the task's (over the row's); a spec without one takes the
    Python a row's install_config names (SWE-rebench's "python"); a row without one, or a task
    without a spec, gets none; a malformed version is refused naming the key or the instance."""
    specs = tmp_path / "environments.json"
    specs.write_text(json.dumps({"acme/calc@1.0": {"python": {"requirements": [], "version": "3.9"}},
                                 "acme/calc": {"python": {"requirements": []}}}))
    rebench = json.dumps({"python": "3.10"})
    rows = [dict(fixture["instance"], install_config=rebench),
            dict(fixture["instance"], instance_id="acme__calc-2", version="2.0", install_config=rebench),
            dict(fixture["instance"], instance_id="acme__calc-3", version="2.0")]
    tasks, _ = _import(fixture, tmp_path, rows, extra=("--environments", str(specs)))
    assert [t.environment["python"].get("version") for t in tasks] == ["3.9", "3.10", None]
    (plain,), _ = _import(fixture, tmp_path, rows[1:2])
    assert plain.environment == {}  # no spec: the host's Python, whatever the row names
    with pytest.raises(ValueError, match=r"environments\['acme/calc'\]\.python\.version: 3\.9 must be"):
        swebench.import_instances(rows, str(fixture["repos"]), environment_specs={"acme/calc": {
            "python": {"requirements": [], "version": 3.9}}})
    with pytest.raises(ValueError, match=r"instance 'acme__calc-2': install_config's python: 3\.1 "):
        swebench.import_instances([dict(rows[1], install_config={"python": 3.10})],
                                  str(fixture["repos"]), environment_specs={"acme/calc": {
                                      "python": {"requirements": []}}})


def test_exit_status_scoring_setup_and_errors(fixture, tmp_path):
    (task,), _ = _import(fixture, tmp_path, [fixture["instance"]])
    cmd = "python -I -c 'import sys; sys.path.insert(0, \".\"); import calc.ops as o; " \
          "assert o.add(2, 3) == 5'"
    plain = Task(task.id, "p", {}, {}, test_command=cmd, repo=task.repo, commit=task.commit,
                 setup="echo built > built.txt")
    s = score_solution(plain, {"calc/ops.py": OPS_HALF})
    assert (s.reward, s.passed, s.total, s.infra_error) == (1.0, 1, 1, None)
    s = score_solution(plain, {})
    assert (s.reward, s.total) == (0.0, 1) and "exit status 1" in s.error
    with Sandbox(plain) as sb:
        assert sb.read("built.txt") == "built\n"
    no_ids = Task(task.id, "p", {}, {}, repo=task.repo, commit=task.commit,
                  test_patch=task.test_patch)  # pytest: the cases of test_patch's files count
    s = score_solution(no_ids, {"calc/ops.py": OPS_FIXED}, mode="all")
    assert (s.reward, s.passed, s.total) == (1.0, 2, 2), s.output
    assert score_solution(no_ids, {"calc/ops.py": OPS_HALF}).reward == 0.5
    with pytest.raises(SandboxError, match="setup failed"):
        Sandbox(Task("t/bad", "p", {}, {}, repo=task.repo, commit=task.commit, setup="exit 3"))
    with pytest.raises(SandboxError, match="t/nocommit"):
        Sandbox(Task("t/nocommit", "p", {}, {}, repo=task.repo, commit="f" * 40))
    s = score_solution(Task("x", "p", {}, {}, repo=task.repo, commit=task.commit,
                            fail_to_pass=("test_x (mod.Class)",)), {})
    assert s.infra_error and "pytest node ids" in s.infra_error
    bad = dict(fixture["instance"], instance_id="x", base_commit="0" * 40)
    with pytest.raises(ValueError, match="'x'.*not in"):
        swebench.import_instances([bad], str(fixture["repos"]))
    with pytest.raises(ValueError, match="no local mirror"):
        swebench.import_instances([dict(bad, repo="acme/none")], str(fixture["repos"]))


def test_patch_parsing_and_reversal(fixture):
    gold = fixture["gold"]
    assert repo_lib.patch_stats(gold) == {
        "files": ["calc/ops.py"], "lines_added": 2, "lines_removed": 2,
    }
    assert swebench.reverse_patch(swebench.reverse_patch(gold)) == gold
    created = "--- /dev/null\n+++ b/new.py\n@@ -0,0 +1,2 @@\n+a\n+--b\n"
    assert repo_lib.parse_patch(created) == [
        {"old": None, "new": "new.py", "added": 2, "removed": 0}
    ]


R2E_TEST_1 = (
    "import pytest\n\nfrom calc.ops import add, mul\n\n\n"
    "def test_add():\n    assert add(2, 3) == 5\n\n\n"
    "class TestMul:\n"
    "    @pytest.mark.parametrize('a,b', [(2, 3)])\n"
    "    def test_mul(self, a, b):\n        assert mul(a, b) == 6\n"
)
R2E_TEST_2 = (
    "from calc.ops import neg\n\n\ndef test_neg():\n    assert neg(2) == -2\n\n\n"
    "def test_known_failure():\n    assert neg(0) == 1\n"
)
R2E_OLD_LOG = (  # pytest -rA's summary at the old commit, as R2E-Gym's rows carry it
    "r2e_tests/test_1.py FF\nr2e_tests/test_2.py .F\n"
    "=========================== short test summary info ============================\n"
    "PASSED r2e_tests/test_2.py::test_neg\n"
    "FAILED r2e_tests/test_1.py::test_add - assert -1 == 5\n"
    "FAILED r2e_tests/test_1.py::TestMul::test_mul[2-3] - assert 5 == 6\n"
    "FAILED r2e_tests/test_2.py::test_known_failure - assert 0 == 1\n"
    "========================= 3 failed, 1 passed in 0.05s ==========================\n"
)


def _r2e_row(fx, new_hash=None):
    """One row in R2E-Gym's shape over the fixture's fix commit (JSON strings as released)."""
    new_hash = new_hash or fx["fix"]
    diffs = [
        {"header": {"file": {"path": "calc/ops.py"}}, "old_file_content": OPS_BUGGY,
         "new_file_content": OPS_FIXED},
        {"header": {"file": {"path": "tests/test_fix.py"}}, "old_file_content": "",
         "new_file_content": TEST_FIX},  # the commit's own test: not part of the fix
    ]
    new_log = R2E_OLD_LOG.replace("FAILED r2e_tests/test_1.py", "PASSED r2e_tests/test_1.py")
    return {
        "repo_name": "calc",  # R2E-Gym names no owner: the mirror is DIR/acme__calc
        "docker_image": f"namanjain12/calc_final:{new_hash}",
        "commit_hash": new_hash,
        "parsed_commit_content": json.dumps({
            "file_diffs": diffs, "old_commit_hash": fx["base"], "new_commit_hash": new_hash,
            "commit_message": "fix", "commit_date": "2024-01-01T00:00:00"}),
        "execution_result_content": json.dumps({
            "repo_name": "calc", "new_commit_hash": new_hash,
            "test_file_codes": [R2E_TEST_1, R2E_TEST_2],
            "test_file_names": ["test_1.py", "test_2.py"],
            "setup_res_code": 0, "setup_res_stdout": "", "setup_res_stderr": "",
            "old_commit_res_code": 1, "old_commit_res_stdout": R2E_OLD_LOG,
            "new_commit_res_code": 1, "new_commit_res_stdout": new_log}),
        "expected_output_json": json.dumps({
            "test_add": "PASSED", "TestMul.test_mul[2-3]": "PASSED",
            "\x1b[32mtest_neg\x1b[0m": "PASSED", "test_known_failure": "FAILED"}),
        "problem_statement": "[ISSUE]\nadd() subtracts and mul() adds.\n[/ISSUE]",
        "prompt": "the generating prompt, with the fix:\n" + fx["gold"],
        "num_non_test_lines": 4,
        "modified_files": ["calc/ops.py", "tests/test_fix.py"],
    }


@pytest.mark.slow
def test_r2e_gym_rows_import_with_the_split_from_their_logs(fixture, tmp_path, capsys):
    """An R2E-Gym row: the workspace is the parent commit, the hidden tests come from the row
    and stay out of reach until scoring, FAIL_TO_PASS / PASS_TO_PASS come from the old commit's
    log against the expected map (the test expected to fail is not counted), and the gold patch
    is the commit's non-test diff, from the mirror or, without the commit there, from the
    row's file texts."""
    (task,), sols = _import(fixture, tmp_path, [_r2e_row(fixture)])
    f2p = ("r2e_tests/test_1.py::test_add", "r2e_tests/test_1.py::TestMul::test_mul[2-3]")
    assert (task.fail_to_pass, task.pass_to_pass) == (f2p, ("r2e_tests/test_2.py::test_neg",))
    assert task.repo == str(fixture["repos"] / "acme__calc") and task.commit == fixture["base"]
    assert task.prompt == "add() subtracts and mul() adds."  # never the `prompt` column
    assert sorted(task.tests) == ["r2e_tests/test_1.py", "r2e_tests/test_2.py"]
    m = task.metadata
    assert (m["variant"], m["files_changed"], m["expected_failing"]) == ("r2e-gym", ["calc/ops.py"], 1)
    assert m["docker_image"].startswith("namanjain12/") and m["fix_commit"] == fixture["fix"]
    assert sols[task.id] == fixture["gold"]  # the mirror's diff, tests/test_fix.py left out
    s = score_solution(task, sols[task.id], mode="resolved")
    assert (s.reward, s.passed, s.total) == (1.0, 3, 3), s.output
    s = score_solution(task, "", mode="resolved")
    assert (s.reward, set(s.not_passed)) == (0.0, set(f2p))
    assert score_solution(task, {"calc/ops.py": OPS_HALF}, mode="fraction").reward == 0.5
    with Sandbox(task) as sb:
        r = sb.run("ls; find / -path /proc -prune -o -name 'test_1.py' -print 2>/dev/null; "
                   "grep -rl known_failure /workspace /tmp")
        assert "r2e_tests" not in r.stdout and "known_failure" not in r.stdout, r.stdout

    import pyarrow as pa  # Hugging Face's format, as R2E-Gym is released
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([_r2e_row(fixture)]), tmp_path / "rows.parquet")
    assert swebench.read_instances(str(tmp_path / "rows.parquet")) == [_r2e_row(fixture)]
    assert make_tasks.main(["--source", "swebench", "--input", str(tmp_path / "rows.parquet"),
                            "--repos", str(fixture["repos"]), "--out", str(tmp_path / "p.jsonl")]) == 0
    assert read_tasks(tmp_path / "p.jsonl") == [task]
    (text,), sols = _import(fixture, tmp_path, [_r2e_row(fixture, new_hash="e" * 40)])
    assert text.id == "r2e__calc-" + "e" * 12 and text.fail_to_pass == f2p
    assert score_solution(text, sols[text.id], mode="resolved").reward == 1.0, sols[text.id]
    assert "tests/test_fix.py" not in sols[text.id]

    specs = tmp_path / "environments.json"  # R2E-Gym's environments by repo_name
    specs.write_text(json.dumps({"calc": {"python": {"requirements": ["attrs==23.2.0"]}}}))
    (env_task,), _ = _import(fixture, tmp_path, [_r2e_row(fixture)],
                             extra=("--environments", str(specs)))
    assert env_task.environment["python"]["requirements"] == ["attrs==23.2.0"]

    row = _r2e_row(fixture)
    nothing = dict(row, expected_output_json=json.dumps({"test_neg": "PASSED"}))
    inp = tmp_path / "mixed.jsonl"  # a released set's unusable rows are skipped, named, exit 1
    inp.write_text(json.dumps(nothing) + "\n" + json.dumps(row) + "\n")
    assert make_tasks.main(["--source", "swebench", "--input", str(inp), "--repos",
                            str(fixture["repos"]), "--out", str(tmp_path / "m.jsonl")]) == 1
    assert read_tasks(tmp_path / "m.jsonl") == [task]
    assert "skipped row 0 (calc): R2E-Gym row 'r2e__calc-" in capsys.readouterr().err
    with pytest.raises(ValueError, match="no test is expected to pass that failed before"):
        swebench.import_instances([nothing], str(fixture["repos"]))
    result = json.loads(row["execution_result_content"])
    unknown = dict(row, execution_result_content=json.dumps(dict(result, old_commit_res_stdout="",
                                                                 new_commit_res_stdout="")))
    with pytest.raises(ValueError, match="'test_add' is in neither log's summary"):
        swebench.import_instances([unknown], str(fixture["repos"]))
    with pytest.raises(ValueError, match="no local mirror of 'none'"):
        swebench.import_instances([dict(row, repo_name="none")], str(fixture["repos"]))
    with pytest.raises(ValueError, match="parsed_commit_content is not JSON"):
        swebench.import_instances([dict(row, parsed_commit_content="{")], str(fixture["repos"]))


def test_r2e_gym_split_names_every_file_of_a_key_and_guesses_only_from_one_file():
    from coder.env.sources import r2egym

    old = ("==== short test summary info ====\n"
           "PASSED r2e_tests/test_1.py::test_same\nFAILED r2e_tests/test_2.py::test_same - x\n"
           "ERROR r2e_tests/test_2.py - ImportError: collection failed\n")
    new = old.replace("FAILED", "PASSED")
    f2p, p2p, other = r2egym.split_tests({"test_same": "PASSED", "test_gone": "ERROR"}, old, new,
                                         ["r2e_tests/test_1.py", "r2e_tests/test_2.py"], "row")
    assert (f2p, p2p, other) == (("r2e_tests/test_2.py::test_same",),
                                 ("r2e_tests/test_1.py::test_same",), 1)
    f2p, _, _ = r2egym.split_tests({"TestA.test_b": "PASSED"}, "", "", ["r2e_tests/test_1.py"], "row")
    assert f2p == ("r2e_tests/test_1.py::TestA::test_b",)  # no log: the one file's node id
    assert r2egym.issue_text("intro [ISSUE]\n body \n[/ISSUE] tail") == "body"
    assert r2egym.is_test_file("pkg/tests/x.py") and not r2egym.is_test_file("pkg/core.py")
