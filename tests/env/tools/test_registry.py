"""Agent tools in a sandbox, and BM25 search."""

import os
import subprocess

import pytest

from coder.env.tools import search, registry as tools
from coder.env.runtime.sandbox import Limits, Sandbox
from coder.env.tasks import Task

CODE = (
    "import os\n\n\ndef parse_header(line):\n    key, _, value = line.partition(':')\n"
    "    return key.strip(), value.strip()\n\n\ndef add(a, b):\n    return a + b\n"
)
TEST = "from mod import add\n\n\ndef test_add():\n    assert add(1, 2) == 3\n"
TASK = Task("t", "p", {"mod.py": CODE, "test_mod.py": TEST}, {"test_mod.py": TEST})


@pytest.fixture(scope="module")
def ctx():
    with Sandbox(TASK, limits=Limits(timeout_s=30)) as sb:
        yield tools.ToolContext(sb, TASK, max_output_chars=2000, command_timeout_s=30)


def call(ctx, name, **args):
    return tools.call(ctx, name, args)


def test_read_file_numbers_lines_and_ranges(ctx):
    out = call(ctx, "read_file", path="mod.py", start_line=4, end_line=5)
    assert out == "4\tdef parse_header(line):\n5\t    key, _, value = line.partition(':')"
    assert call(ctx, "read_file", path="mod.py").splitlines()[9] == "10\t    return a + b"
    assert "error" in call(ctx, "read_file", path="nope.py")
    assert "past the end" in call(ctx, "read_file", path="mod.py", start_line=99)
    assert "outside the workspace" in call(ctx, "read_file", path="../../etc/passwd")


def test_write_and_edit_file(ctx):
    assert (
        call(ctx, "write_file", path="new/x.py", content="a = 1\na = 1\nb = 2\n")
        == "wrote 18 bytes to new/x.py"
    )
    assert ctx.sandbox.run("cat new/x.py").stdout == "a = 1\na = 1\nb = 2\n"  # visible inside
    out = call(ctx, "edit_file", path="new/x.py", old="a = 1\n", new="a = 3\n")
    assert "occurs 2 times" in out and "[1, 2]" in out
    assert "not found" in call(ctx, "edit_file", path="new/x.py", old="c = 1", new="c = 2")
    assert "whitespace" in call(ctx, "edit_file", path="new/x.py", old="  b = 2", new="b = 3")
    assert "identical" in call(ctx, "edit_file", path="new/x.py", old="b = 2", new="b = 2")
    assert (
        call(ctx, "edit_file", path="new/x.py", old="b = 2", new="b = 5")
        == "edited new/x.py at line 3"
    )
    assert ctx.sandbox.read("new/x.py") == "a = 1\na = 1\nb = 5\n"


def test_shell_grep_lint_tests(ctx):
    out = call(ctx, "shell", command="echo hi; echo err >&2; (exit 3)")
    assert out == "exit code: 3\nhi\n[stderr]\nerr"
    assert "mod.py:4:def parse_header" in call(ctx, "grep", pattern="def parse_", path=".")
    assert call(ctx, "grep", pattern="zzz_nothing") == "no matches"
    assert call(ctx, "grep", pattern="(unclosed").startswith("error")
    lint = call(ctx, "lint", path="mod.py")
    assert "F401" in lint and "os" in lint  # unused import found by ruff in the sandbox
    assert "1 passed" in call(ctx, "run_tests")
    assert "(timed out)" in call(ctx, "shell", command="sleep 5", timeout_s=1)


def test_shell_is_one_persistent_session(ctx):
    call(ctx, "shell", command="cd /tmp; export SEEN=1; sleep 60 &")
    out = call(ctx, "shell", command='pwd; echo "seen=$SEEN"; jobs')
    assert out.startswith("exit code: 0\n/tmp\nseen=1\n") and "sleep 60" in out
    out = call(ctx, "shell", command="exit 7")
    assert out.startswith("exit code: 7") and "next call starts a new one" in out
    out = call(ctx, "shell", command="pwd")
    assert out.startswith("exit code: 0\n/workspace") and "new shell session" in out
    # the other tools run in fresh processes: the shell's state does not reach them
    call(ctx, "shell", command="export PYTEST_ADDOPTS=--co; cd /tmp")
    assert "1 passed" in call(ctx, "run_tests")


def test_grep_is_confined_to_the_workspace(ctx):
    ctx.sandbox.run("ln -sfn /usr sneaky")
    for path in ("/usr", "/etc/passwd", "..", "sub/../../tmp", "sneaky", "sneaky/lib"):
        out = call(ctx, "grep", pattern="root", path=path)
        assert out.startswith("error:") and "workspace" in out, (path, out)
    assert call(ctx, "grep", pattern="def parse_", path="/workspace/mod.py").startswith("4:def")
    assert call(ctx, "grep", pattern="def parse_", path="./mod.py").startswith("4:def")
    ctx.sandbox.remove("sneaky")


def test_think_runs_nothing(ctx):
    before = ctx.sandbox.snapshot()
    assert call(ctx, "think", thought="rm -rf / would be bad; read mod.py first") == "noted"
    assert ctx.sandbox.snapshot() == before


def test_ask_user_answers_from_the_hidden_specification(ctx):
    """The simulated user: the task's specification when the prompt left it out, else "go ahead"."""
    assert "go ahead without asking" in call(ctx, "ask_user", question="Which value?")
    vague = tools.ToolContext(ctx.sandbox, Task("v", "vague", {}, {}, metadata={
        "underspecified": True, "specification": "Make `f()` in answer.py return 7."}), command_timeout_s=30)
    assert tools.call(vague, "ask_user", {"question": "Which value?"}) == (
        "The user answers: Make `f()` in answer.py return 7.")


def test_output_is_capped_with_a_note(ctx):
    out = call(ctx, "shell", command="seq 1 100000")
    assert len(out) < 2100 and "characters cut" in out
    assert out.rstrip().endswith("100000")  # the tail is kept


def test_search_ranks_the_relevant_chunk(ctx):
    out = call(ctx, "search", query="parse an http header line")
    assert out.startswith("mod.py:1-10 (score") and "def parse_header" in out
    assert out.index("def parse_header") < out.find("test_mod.py:") or "test_mod.py:" not in out
    ctx.sandbox.write(".git/hooks/pre-commit.sample", "parse an http header line " * 50)
    out = call(ctx, "search", query="parse an http header line")
    assert ".git/" not in out and out.startswith("mod.py:1-10")  # git's own files are not code


def _git(cwd, *args) -> str:
    env = {"PATH": os.environ["PATH"], "HOME": str(cwd), "GIT_CONFIG_NOSYSTEM": "1",
           "GIT_AUTHOR_NAME": "a", "GIT_AUTHOR_EMAIL": "a@x", "GIT_COMMITTER_NAME": "a",
           "GIT_COMMITTER_EMAIL": "a@x", "GIT_AUTHOR_DATE": "2024-01-01T00:00:00Z",
           "GIT_COMMITTER_DATE": "2024-01-01T00:00:00Z"}  # fixed: the same shas every run
    return subprocess.run(["git", "-c", "init.defaultBranch=main", *args], cwd=cwd, env=env,
                          check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture(scope="module")
def history(tmp_path_factory):
    """A repository of five commits; the task sits at the fourth, the fifth holds its fix
    (on main, a branch and a tag of the source: none may reach the workspace)."""
    src = tmp_path_factory.mktemp("history")
    _git(src, "init", "-q")
    shas = []
    for i, line in enumerate(["a = 1", "b = 2", "c = 3", "d = 4", "FIXED = 5"]):
        with open(src / "m.py", "a") as f:
            f.write(line + "\n")
        _git(src, "add", "m.py")
        _git(src, "commit", "-qm", f"commit {i + 1}: {line}")
        shas.append(_git(src, "rev-parse", "HEAD"))
    _git(src, "branch", "fix")
    _git(src, "tag", "v-fixed")
    return src, shas


def test_repo_history_log_show_blame_up_to_the_task_commit(history):
    src, shas = history
    task = Task("h", "p", {}, {}, repo=str(src), commit=shas[3])
    with Sandbox(task, limits=Limits(timeout_s=30, history_depth=3)) as sb:
        ctx = tools.ToolContext(sb, task, max_output_chars=4000, command_timeout_s=30)
        log = call(ctx, "repo_history", action="log")
        assert [line.split(" ", 1)[1] for line in log.splitlines()[:3]] == [
            "commit 4: d = 4", "commit 3: c = 3", "commit 2: b = 2"]
        assert "shallow history" in log and "commit 1" not in log  # depth 3: commits 2..4
        assert len(call(ctx, "repo_history", action="log", max_count=1).splitlines()) == 2
        show = call(ctx, "repo_history", action="show", commit=shas[2][:10])
        assert "commit 3: c = 3" in show and "+c = 3" in show and "shallow" not in show
        blame = call(ctx, "repo_history", action="blame", path="m.py", start=3, end=4)
        assert blame.splitlines()[0].startswith(shas[2][:7]) and blame.splitlines()[1].startswith(shas[3][:7])
        assert "c = 3" in blame and "d = 4" in blame and "b = 2" not in blame
        edge = call(ctx, "repo_history", action="blame", path="m.py", end=1)
        assert edge.startswith("^") and "may be older" in edge  # line 1 predates the copied history
        assert call(ctx, "repo_history", action="blame", path="../x").startswith("error:")
        # the fix (commit 5) is nowhere: not by sha, branch or tag, not through --all, no object
        for ref in (shas[4], "fix", "v-fixed", "main"):
            assert call(ctx, "repo_history", action="show", commit=ref).startswith("error: no commit")
        cmd = (f"git log --all --oneline; git cat-file -e {shas[4]} || echo absent;"
               f" grep -rl {shas[4]} .git || echo unreferenced; git tag; git branch -a")
        out = call(ctx, "shell", command=cmd)
        assert "FIXED" not in out and "absent" in out and "unreferenced" in out and "v-fixed" not in out
        assert "commit 4" in out and "fix" not in out.replace("FIXED", "")
    one = Task("h1", "p", {}, {}, repo=str(src), commit=shas[3])  # the default depth: one commit
    with Sandbox(one, limits=Limits(timeout_s=30)) as sb:
        ctx = tools.ToolContext(sb, one, max_output_chars=4000, command_timeout_s=30)
        log = call(ctx, "repo_history", action="log")
        assert log.splitlines()[0].endswith("commit 4: d = 4") and "shallow history" in log
        out = call(ctx, "repo_history", action="show", commit="HEAD~1")
        assert out.startswith("error: no commit 'HEAD~1'") and "history is shallow" in out


def test_repo_history_without_a_repository_says_so(ctx):
    assert call(ctx, "repo_history", action="log") == (
        "no git history: this task's workspace is not a git repository")
    with pytest.raises(ValueError, match="env.history_depth=0"):
        Limits(history_depth=0)


def test_tokenize_and_bm25():
    assert search.tokenize("parseHTTPHeader snake_case2") == [
        "parsehttpheader",
        "parse",
        "http",
        "header",
        "snake_case2",
        "snake",
        "case",
        "2",
    ]
    files = {
        "a.py": "def load_config(path):\n    return open(path).read()\n",
        "b.py": "def add(a, b):\n    return a + b\n",
        "c.py": "def config_value(cfg, key):\n    return cfg[key]\n",
    }
    hits = search.search(files, "load the config file", k=3)
    assert hits[0][1].path == "a.py" and all(s > 0 for s, _ in hits)
    assert search.search(files, "quantum chromodynamics") == []


def test_bm25_index_is_cached_per_file_content(monkeypatch):
    """A second search over the same files tokenizes nothing; after an edit only the edited file
    is chunked again, and the ranking is the one a fresh index gives."""
    files = {f"m{i}.py": f"def f{i}(x):\n    return x + {i}\n" for i in range(5)}
    files["cfg.py"] = "def load_config(path):\n    return open(path).read()\n"
    search.search(files, "load config")
    chunked = []
    real = search.chunk_file
    monkeypatch.setattr(search, "chunk_file", lambda path, *a: chunked.append(path) or real(path, *a))
    first = search.search(files, "load config")
    assert chunked == []
    edited = dict(files, **{"m3.py": "def load_configuration(p):\n    return p\n"})
    again = search.search(edited, "load config")
    assert chunked == ["m3.py"]
    search._FILES.clear()
    search._INDEXES.clear()
    assert search.search(edited, "load config") == again and first[0][1].path == "cfg.py"


def test_chunking_covers_every_line():
    text = "\n".join(f"line {i}" for i in range(1, 101))
    chunks = search.chunk_file("x.txt", text, chunk_lines=40)
    covered = {i for c in chunks for i in range(c.start, c.end + 1)}
    assert covered == set(range(1, 101)) and all(c.end - c.start < 40 for c in chunks)


def test_each_tool_is_defined_once_and_its_overlap_rules_come_from_it():
    """One registry: every spec has its function and flags in one Tool; may_overlap reads them."""
    names = [t.spec.name for t in tools.TOOLS]
    assert names == [s.name for s in tools.SPECS] and set(names) == set(tools.FUNCTIONS)
    assert tools.EXCLUSIVE == {"write_file", "edit_file", "shell", "memory_write"}
    assert tools.HOST_SIDE == {"read_file", "write_file", "edit_file", "search", "semantic_search"}
    assert tools.RUNS_AGENT_CODE == {"run_tests", "shell", "diagnostics"}
    assert tools.may_overlap("read_file", "grep") and tools.may_overlap("run_tests", "lint")
    assert not tools.may_overlap("read_file", "run_tests")  # a host-side path check beside the agent's code
    assert not tools.may_overlap("shell", "think") and not tools.may_overlap("grep", "edit_file")
