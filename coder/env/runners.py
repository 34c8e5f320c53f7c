"""Test runners other than pytest: how a task's test command reports each test, read into
{test id: "passed" | "failed" | "skipped"} for the FAIL_TO_PASS / PASS_TO_PASS rule.

Formats (`Task.test_format`; "" infers it from the command):
- "pytest": scored from its JUnit report (coder.env.reward); ids are pytest node ids.
- "go": `go test` with `-json` (added when the command lacks it): the test2json event stream,
  one JSON object a line; a test's last pass / fail / skip action decides. Ids are
  `<package>::<test>` (subtests `TestX/case`), and the bare test name too where no two
  packages share it (Multi-SWE-bench-style lists name tests alone).
- "tap": the Test Anything Protocol, what `node --test --test-reporter=tap` (and `npm test`
  running it, tape, prove, ...) print: `ok N - name`, `not ok N - name`, `# SKIP` / `# TODO`
  directives; subtests are indented under `# Subtest: name` and their ids join the names of
  their parents with " > " (`group > inner case`); YAML diagnostic blocks (`---` ... `...`)
  are skipped.
Any other command scores by its exit status, and only on a task without test ids.
"""

from __future__ import annotations

import json
import os
import re
import shlex

FORMATS = ("pytest", "go", "tap")


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


def parse(fmt: str, text: str) -> dict:
    if fmt == "go":
        return parse_go(text)
    if fmt == "tap":
        return parse_tap(text)
    raise ValueError(f"test format {fmt!r}: parsed formats are go and tap")
