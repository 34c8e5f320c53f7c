"""The diagnostics tool in a sandbox: mypy's type errors and unresolved names, jedi's definitions
and references across files, and clear errors for bad arguments and a missing checker."""

import dataclasses

import pytest

from coder.env import protocol
from coder.env.tools import diagnostics, registry as tools
from coder.env.runtime.sandbox import Limits, Sandbox
from coder.env.tasks import Task

UTIL = "def scale(x: int, k: int) -> int:\n    return x * k\n"
MAIN = (
    "from pkg.util import scale\n"
    "\n"
    "\n"
    "def run() -> int:\n"
    "    n: int = 'three'\n"  # planted type error: line 5
    "    return scale(n, missing_factor)\n"  # planted unresolved name: line 6
    "\n"
    "\n"
    "TOTAL = scale(2, 3)\n"  # line 9
)
FILES = {
    "pkg/__init__.py": "",
    "pkg/util.py": UTIL,
    "pkg/main.py": MAIN,
    "pkg/other.py": "import pkg.util\n\nVALUE = pkg.util.scale(1, 1)\n",
    # a second `run`, and a local called `scale` that a lookup by name must not count as a def
    "pkg/jobs.py": "def run():\n    scale = 2\n    return scale\n\n\nrun()\n",
    # two same-named test helpers: mypy stops ("Duplicate module named") without package bases
    "tests/a/conftest.py": "A = 1\n",
    "tests/b/conftest.py": "B = 2\n",
}
TASK = Task("diag", "p", FILES, {})


@pytest.fixture(scope="module")
def ctx():
    with Sandbox(TASK, limits=Limits(timeout_s=30)) as sb:
        yield tools.ToolContext(sb, TASK, max_output_chars=4000, command_timeout_s=30)


def call(ctx, **args):
    return tools.call(ctx, "diagnostics", args)


def test_check_reports_the_planted_type_error_and_unresolved_name(ctx):
    out = call(ctx, action="check")
    lines = out.splitlines()
    assert any(ln.startswith("pkg/main.py:5:") and "[assignment]" in ln for ln in lines), out
    assert any(
        ln.startswith("pkg/main.py:6:") and '"missing_factor" is not defined' in ln for ln in lines
    ), out
    assert "Found 2 errors in 1 file" in out  # nothing else: the conftests and util are clean
    assert call(ctx, action="check", path="pkg/util.py").startswith("Success: no issues found")
    assert sorted(ctx.sandbox.list_files()) == sorted(FILES)  # no cache left in the workspace


def test_definition_finds_the_def_in_another_file(ctx):
    want = "pkg/util.py:1:5: def scale(x: int, k: int) -> int:"
    by_column = call(ctx, action="definition", path="pkg/main.py", line=9, column=10)
    assert by_column.splitlines()[1:] == [want]
    by_symbol = call(ctx, action="definition", path="pkg/other.py", line=3, symbol="scale")
    assert by_symbol.splitlines()[1:] == [want]
    assert call(ctx, action="definition", symbol="scale").splitlines()[1:] == [want]
    dotted = call(ctx, action="definition", path="pkg/other.py", line=3, symbol="pkg.util.scale")
    assert dotted.splitlines()[1:] == [want]


def test_references_lists_every_use(ctx, monkeypatch):
    out = call(ctx, action="references", path="pkg/util.py", line=1, symbol="scale")
    rows = out.splitlines()
    assert rows[0] == "5 references to scale:", out
    places = {r.split(": ")[0] for r in rows[1:]}
    assert places == {
        "pkg/main.py:1:22",  # the import
        "pkg/main.py:6:12",
        "pkg/main.py:9:9",
        "pkg/other.py:3:18",  # through the module attribute
        "pkg/util.py:1:5",  # the def itself
    }, out
    assert "pkg/util.py:1:5: def scale(x: int, k: int) -> int: (definition)" in rows
    # a bare name with two definitions: one block of references per definition
    blocks = call(ctx, action="references", symbol="run").split("\n\n")
    assert [b.splitlines()[0] for b in blocks] == [
        "2 references to run defined at pkg/jobs.py:1:5:",
        "1 reference to run defined at pkg/main.py:4:5:",
    ], blocks
    assert blocks[0].splitlines()[2] == "pkg/jobs.py:6:1: run()"
    # past MAX_LOCATIONS the rest are counted, not listed (the answer must fit the output cap)
    monkeypatch.setattr(diagnostics, "MAX_LOCATIONS", 2)
    rows = call(ctx, action="references", symbol="scale").splitlines()
    assert rows[0] == "5 references to scale:" and len(rows) == 4, rows
    assert rows[3] == "[... 3 more not listed]"


def test_bad_arguments_and_a_missing_checker_are_clear_errors(ctx, monkeypatch):
    # the schema refuses what it can, as a broken call
    (bad,) = protocol.parse_tool_calls(
        protocol.render_tool_call("diagnostics", {"action": "hover"}), tools.SPECS
    )
    assert isinstance(bad, protocol.BrokenToolCall) and "action must be one of" in bad.reason
    cases = {
        "needs path, line and column": dict(action="definition", path="pkg/main.py", line=9),
        "takes path and line together": dict(action="references", path="pkg/main.py", symbol="x"),
        "outside the workspace": dict(action="definition", path="../../etc/passwd", line=1, column=1),
        "does not occur on line 2": dict(action="definition", path="pkg/util.py", line=2, symbol="zz"),
        "has 2 lines; line 7 is past the end": dict(
            action="definition", path="pkg/util.py", line=7, column=1
        ),
        "no definition named 'nowhere'": dict(action="definition", symbol="nowhere"),
        "is not a Python name": dict(action="references", symbol="scale("),
        "Cannot read file": dict(action="check", path="nope.py"),
        "unknown action 'hover'": dict(action="hover"),
    }
    for said, args in cases.items():
        out = diagnostics.diagnostics(ctx, args)
        assert out.startswith("error: ") and said in out, (args, out)
    fast = dataclasses.replace(ctx, command_timeout_s=0.01)
    assert "timed out after 0.01 s" in call(fast, action="check")
    monkeypatch.setattr(diagnostics, "CHECKER", "mypy_not_installed")
    monkeypatch.setattr(diagnostics, "NAVIGATOR", "jedi_not_installed")
    out = call(ctx, action="check")
    assert out.startswith("error: the type checker mypy_not_installed is not installed"), out
    out = call(ctx, action="references", symbol="scale")
    assert out.startswith("error: jedi_not_installed is not installed"), out


def test_a_src_layout_resolves_its_packages():
    """src/lib imported as `lib`: mypy (MYPYPATH=src) and jedi (src on its path) both find it;
    without them the check reports lib as missing and the definition is not found."""
    files = {
        "src/lib/__init__.py": "",
        "src/lib/b.py": "def helper(x: int) -> int:\n    return x\n",
        "src/lib/a.py": "from lib.b import helper\n\nY: str = helper(1)\n",
        "tests/test_a.py": "from lib.b import helper\n\n\ndef test_h():\n    assert helper(2) == 2\n",
    }
    task = Task("src", "p", files, {})
    with Sandbox(task, limits=Limits(timeout_s=30)) as sb:
        ctx = tools.ToolContext(sb, task, command_timeout_s=30)
        out = call(ctx, action="check")
        assert out.splitlines()[0].startswith("src/lib/a.py:3:") and "[assignment]" in out, out
        assert "Found 1 error in 1 file" in out, out  # `lib` resolved: no import-not-found
        out = call(ctx, action="definition", path="tests/test_a.py", line=5, symbol="helper")
        assert out.splitlines()[1:] == ["src/lib/b.py:1:5: def helper(x: int) -> int:"], out
