"""How a task's test command reports each test, read into {test id: status} for the
FAIL_TO_PASS / PASS_TO_PASS rule (coder.env.scoring.grading), with one registry of formats, `FORMATS`.

Statuses: "passed", "failed" (an error too), "skipped", "xfailed" (an expected failure that
failed: it counts as passing, as in SWE-bench's harness).

A format (`Task.test_format`; "" infers pytest, go or tap from the command) is of one of two kinds:
- a JUnit format is scored from pytest's JUnit report (coder.env.scoring.score), and its `key` names each
  case the way the task's ids name it, from (node id, status, the report's message);
- a log format parses the command's whole output (stdout and stderr together), `parse`.

JUnit formats:
- "pytest": pytest node ids as they are (coder's own generated tasks).
- SWE-bench's (`swebench-*`): SWE-bench's harness reads the outcomes from the short summary of
  `pytest -rA` (`PASSED <node id>`, `FAILED <node id> - <message>`, `XFAIL <node id> - <reason>`;
  skips are summarised by file and line, never by id; an XPASS line is not read), so the
  FAIL_TO_PASS / PASS_TO_PASS lists it released hold the ids as its repository's log parser cut
  them out of those lines, in the images' working directory /testbed. These formats key a case as
  that parser would have read its line, with the workspace's path (coder.env.runtime.sandbox.WORKDIR)
  written as /testbed; cases sharing a key keep the one printed last (the summary prints passes,
  xfails, then failures). Checked against the `swebench` package (5.0.2) on one pytest run in
  tests/env/scoring/test_grading.py.
  - "swebench-pytest" (its parse_log_pytest: astroid, flask, marshmallow, pvlib, pytest, pyvista,
    sqlfluff, xarray, and the repositories SWE-Gym, SWE-rebench and SWE-smith add): the node id
    up to its first whitespace, e.g. `tests/test_cli.py::test_locate_app[cliapp.factory-create_app2("foo",`.
  - "swebench-pytest-options" (parse_log_pytest_options: pydicom, requests, pylint): the same,
    then a parameter that is an absolute path written as "/" and its last component.
  - "swebench-pytest-v2" (parse_log_pytest_v2: astropy, scikit-learn, sphinx): the whole id,
    runs of whitespace as one space, `[<digits>m` and control characters removed; a failure's id
    ends at its first " - ", an xfail's is followed by " - <reason>" (JUnit's message; for an
    imperative `pytest.xfail` JUnit drops the summary's "reason: " prefix).
  - "swebench-matplotlib": `MouseButton.LEFT` / `.RIGHT` written 1 / 3, then as swebench-pytest.
  - "swebench-seaborn": as swebench-pytest for passes and failures; xfails are not read.
  Not modelled: an XPASS reads as a pass in JUnit (SWE-bench does not read its line, so the test
  is absent there), and a passing test whose teardown errors is one failed case in JUnit.
Log formats:
- "go": `go test` with `-json` (added when the command lacks it): the test2json event stream,
  one JSON object a line; a test's last pass / fail / skip action decides. Ids are
  `<package>::<test>` (subtests `TestX/case`), and the bare test name too where no two
  packages share it (Multi-SWE-bench-style lists name tests alone).
- "tap": the Test Anything Protocol, what `node --test --test-reporter=tap` (and `npm test`
  running it, tape, prove, ...) print: `ok N - name`, `not ok N - name`, `# SKIP` / `# TODO`
  directives; subtests are indented under `# Subtest: name` and their ids join the names of
  their parents with " > " (`group > inner case`); YAML diagnostic blocks (`---` ... `...`)
  are skipped.
- "django": Django's `tests/runtests.py --verbosity 2`, unittest's verbose lines
  `test_x (module.Class) ... ok` / `... FAIL` / `... ERROR` / `... skipped 'why'`, read as SWE-bench's
  parse_log_django reads them: the id is the text before " ... " on the line that holds the
  outcome (a test with a docstring prints its first line there, and that line is the id the
  dataset lists), a bare `ok` line passes the last test started, `FAIL: name` / `ERROR: name`
  headers fail the word after them, and its three known interleavings of output and `ok` pass.
- "sympy": sympy's `bin/test -C --verbose`: under each file, `test_name ok` / `F` / `E` lines (ids
  are bare test names; a name in several files keeps its last line), and each failure's header
  `____ path/test_file.py:test_name ____` fails `path/test_file.py:test_name`; SWE-bench's
  parse_log_sympy. Expected failures (`f`) and skips (`s`) are not read.
Any other command scores by its exit status, and only on a task without test ids.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
from collections.abc import Callable

from coder.env.runtime.sandbox import WORKDIR

IMAGE_WORKDIR = "/testbed"  # the repository's path in SWE-bench-family images


@dataclasses.dataclass(frozen=True)
class Format:
    """One way a test command reports its tests: `key` (JUnit formats) or `parse` (log formats)."""

    name: str
    key: Callable[[str, str, str], str | None] | None = None  # (node id, status, message) -> id
    parse: Callable[[str], dict] | None = None  # whole output -> {id: status}

    @property
    def junit(self) -> bool:
        return self.key is not None


FORMATS: dict[str, Format] = {}


def junit_format(name: str):
    """Register `fn(node_id, status, message) -> id | None` as JUnit format `name`."""
    def register(fn):
        FORMATS[name] = Format(name, key=fn)
        return fn
    return register


def log_format(name: str):
    """Register `fn(output) -> {id: status}` as log format `name`."""
    def register(fn):
        FORMATS[name] = Format(name, parse=fn)
        return fn
    return register


def infer(test_command: str) -> str:
    """The format a command's output is in, from the command itself ("" when unknown)."""
    try:
        argv = shlex.split(test_command)
    except ValueError:
        return ""
    if not argv:
        return ""
    head = os.path.basename(argv[0])
    if head in ("pytest", "py.test") or (head.startswith("python") and argv[1:3] == ["-m", "pytest"]):
        return "pytest"
    if head == "go" and argv[1:2] == ["test"]:
        return "go"
    if any(a in ("--test-reporter=tap", "--tap") for a in argv) or argv[-2:] == [
            "--test-reporter", "tap"]:
        return "tap"
    return ""


def format_of(task) -> str:
    """The task's test format: its `test_format`, else what its command infers."""
    explicit = getattr(task, "test_format", "")
    return explicit or infer(task.test_command)


def named_paths(test_command: str) -> frozenset:
    """Workspace-relative paths the command names (`bash run.sh`, `tools/go test`): scoring
    restores the tracked ones, so an edited runner script cannot print passes."""
    try:
        argv = shlex.split(test_command)
    except ValueError:
        return frozenset()
    out = set()
    for a in argv:
        if a.startswith("-") or "=" in a or a.startswith("/"):
            continue
        p = os.path.normpath(a[2:] if a.startswith("./") else a)
        if not p.startswith(".."):
            out.add(p)
    return frozenset(out)


def command(fmt: str, test_command: str) -> str:
    """The command to run for `fmt`: `go test` gets `-json` when it lacks it."""
    if fmt == "go":
        argv = shlex.split(test_command)
        if "-json" not in argv:
            i = argv.index("test") + 1
            argv = argv[:i] + ["-json"] + argv[i:]
        return " ".join(shlex.quote(a) for a in argv)
    return test_command


@log_format("go")
def parse_go(text: str) -> dict:
    """{id: status} from `go test -json` output (non-JSON lines, e.g. build errors, skipped)."""
    last = {}
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            ev = json.loads(line)
        except json.JSONDecodeError:
            continue
        action, test = ev.get("Action"), ev.get("Test")
        if test and action in ("pass", "fail", "skip"):
            last[(ev.get("Package", ""), test)] = {"pass": "passed", "fail": "failed",
                                                    "skip": "skipped"}[action]
    out = {f"{pkg}::{test}": status for (pkg, test), status in last.items()}
    names = {}
    for (pkg, test), status in last.items():
        names.setdefault(test, []).append(status)
    out.update({test: s[0] for test, s in names.items() if len(s) == 1 and test not in out})
    return out


_TAP_POINT = re.compile(r"^(\s*)(not ok|ok)\b\s*\d*\s*(?:-\s*)?(.*?)\s*(?:#\s*(SKIP|TODO)\b.*)?$",
                        re.I)
_TAP_SUBTEST = re.compile(r"^(\s*)#\s*Subtest:\s*(.*?)\s*$")


@log_format("tap")
def parse_tap(text: str, indent: int = 4) -> dict:
    """{id: status} from TAP output; nested subtests (indented by `indent` spaces a level) are
    named `parent > child`. A TODO test counts as skipped whatever its outcome."""
    parents: list[str] = []
    out, in_yaml = {}, False
    for line in text.splitlines():
        if in_yaml or line.strip() == "---":  # a test point's YAML diagnostics: not TAP lines
            in_yaml = line.strip() != "..."
            continue
        m = _TAP_SUBTEST.match(line)
        if m:
            level = len(m.group(1).expandtabs()) // indent
            parents = parents[:level] + [m.group(2)]
            continue
        m = _TAP_POINT.match(line)
        if not m or line.strip().startswith("#"):
            continue
        level = len(m.group(1).expandtabs()) // indent
        name = m.group(3).replace("\\#", "#")
        tid = " > ".join(parents[:level] + [name])
        if m.group(4):
            out[tid] = "skipped"
        else:
            out[tid] = "passed" if m.group(2).lower() == "ok" else "failed"
        parents = parents[:level]
    return out


# ---- JUnit formats: a pytest case as the task's ids name it ----

@junit_format("pytest")
def key_pytest(node_id: str, status: str, message: str) -> str:
    return node_id


_WORKDIR_PATH = re.compile(rf"(?<![\w.]){re.escape(WORKDIR)}(?![\w.-])")


def in_image(node_id: str) -> str:
    """`node_id` as the same test's id in an image whose repository is at /testbed."""
    return _WORKDIR_PATH.sub(IMAGE_WORKDIR, node_id)


def _summary_line(node_id: str, status: str, message: str) -> str:
    """The line `pytest -rA` prints for a case in its short test summary."""
    word = {"passed": "PASSED", "failed": "FAILED", "xfailed": "XFAIL", "skipped": "SKIPPED"}[status]
    return f"{word} {node_id}" + (f" - {message}" if message and status in ("failed", "xfailed") else "")


def _first_token(line: str) -> str | None:
    """parse_log_pytest's read of one summary line: the word after the status."""
    if line.startswith("FAILED"):
        line = line.replace(" - ", " ")
    words = line.split()
    return words[1] if len(words) > 1 else None


@junit_format("swebench-pytest")
def key_swebench_pytest(node_id: str, status: str, message: str) -> str | None:
    if status == "skipped":  # summarised as `SKIPPED [n] file:line`, never by id
        return None
    return _first_token(_summary_line(in_image(node_id), status, message))


_OPTION = re.compile(r"(.*?)\[(.*)\]")


@junit_format("swebench-pytest-options")
def key_swebench_pytest_options(node_id: str, status: str, message: str) -> str | None:
    name = key_swebench_pytest(node_id, status, message)
    m = _OPTION.search(name) if name else None
    if not m:
        return name
    main, option = m.groups()
    if option.startswith("/") and not option.startswith("//") and "*" not in option:
        option = "/" + option.split("/")[-1]
    return f"{main}[{option}]"


_ESCAPE = re.compile(r"\[(\d+)m")
_CONTROL = str.maketrans("", "", "".join(chr(c) for c in range(1, 32)))


@junit_format("swebench-pytest-v2")
def key_swebench_pytest_v2(node_id: str, status: str, message: str) -> str | None:
    if status == "skipped":
        return None
    line = _ESCAPE.sub("", _summary_line(in_image(node_id), status, message)).translate(_CONTROL)
    if status == "failed":
        line = line.split(" - ", 1)[0]
    words = line.split()
    return " ".join(words[1:]) if len(words) > 1 else None


@junit_format("swebench-matplotlib")
def key_swebench_matplotlib(node_id: str, status: str, message: str) -> str | None:
    node_id = node_id.replace("MouseButton.LEFT", "1").replace("MouseButton.RIGHT", "3")
    return key_swebench_pytest(node_id, status, message)


@junit_format("swebench-seaborn")
def key_swebench_seaborn(node_id: str, status: str, message: str) -> str | None:
    if status not in ("passed", "failed"):
        return None
    words = _summary_line(in_image(node_id), status, message).split()
    return words[1] if len(words) > 1 else None


# The order of the short test summary (passes, xfails, failures; skips carry no id there): where
# two cases share a key, the later one is what the harness's parser kept.
SUMMARY_ORDER = {"skipped": 0, "passed": 1, "xfailed": 2, "failed": 3}


def keyed(fmt: str, cases) -> dict:
    """{id in format `fmt`: status} of `cases`, (node id, status, message) triples of a JUnit
    report; cases whose key is None are left out."""
    key = FORMATS[fmt].key
    out = {}
    for node_id, status, message in sorted(cases, key=lambda c: SUMMARY_ORDER[c[1]]):
        k = key(node_id, status, message)
        if k is not None:
            out[k] = status
    return out


# ---- Log formats: Django's and sympy's runners, as SWE-bench's harness reads them ----

_DJANGO_PASS = (" ... ok", " ... OK", " ...  OK")
# the three ways SWE-bench saw Django's output land between a test's " ... " and its "ok"
_DJANGO_INTERLEAVED = [re.compile(p, re.M) for p in (
    r"^(.*?)\s\.\.\.\sTesting\ against\ Django\ installed\ in\ ((?s:.*?))\ silenced\)\.\nok$",
    r"^(.*?)\s\.\.\.\sInternal\ Server\ Error:\ \/(.*)\/\nok$",
    r"^(.*?)\s\.\.\.\sSystem check identified no issues \(0 silenced\)\nok$",
)]


@log_format("django")
def parse_django(text: str) -> dict:
    out, started = {}, None
    for line in text.split("\n"):
        line = line.strip()
        if "--version is equivalent to version" in line:  # a docstring that spans lines
            out["--version is equivalent to version"] = "passed"
        if " ... " in line:
            started = line.split(" ... ")[0]
        for suffix in _DJANGO_PASS:
            if line.endswith(suffix):
                if line.startswith("Applying sites.0002_alter_domain_unique...test_no_migrations"):
                    line = line.split("...", 1)[-1].strip()  # a migration's output before the id
                out[line.rsplit(suffix, 1)[0]] = "passed"
                break
        if " ... skipped" in line:
            out[line.split(" ... skipped")[0]] = "skipped"
        for suffix in (" ... FAIL", " ... ERROR"):
            if line.endswith(suffix):
                out[line.split(suffix)[0]] = "failed"
        if line.startswith(("FAIL:", "ERROR:")) and len(line.split()) > 1:
            out[line.split()[1].strip()] = "failed"
        if line.startswith("ok") and started is not None:  # output between " ... " and "ok"
            out[started] = "passed"
    for pattern in _DJANGO_INTERLEAVED:
        for m in pattern.finditer(text):
            out[m.group(1)] = "passed"
    return out


_SYMPY_FAILURE = re.compile(r"(_*) (.*)\.py:(.*) (_*)")


@log_format("sympy")
def parse_sympy(text: str) -> dict:
    out = {f"{path}.py:{name}": "failed" for _, path, name, _ in _SYMPY_FAILURE.findall(text)}
    for line in text.split("\n"):
        line = line.strip()
        if not line.startswith("test_"):
            continue
        for suffix, status in ((" E", "failed"), (" F", "failed"), (" ok", "passed")):
            if line.endswith(suffix):
                out[line.split()[0]] = status
    return out


def parse(fmt: str, text: str) -> dict:
    """{id: status} of a log format's output; ValueError naming the log formats."""
    f = FORMATS.get(fmt)
    if f is None or f.parse is None:
        raise ValueError(f"test format {fmt!r}: log formats are "
                         f"{sorted(n for n, x in FORMATS.items() if x.parse)}")
    return f.parse(text)
