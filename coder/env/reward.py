"""Test-based reward, hardened against the cheats a policy finds.

`score(sandbox, task)` after the agent is done (no agent process is alive any more):
1. every test or test-configuration file of the task is put back as the task shipped it, and
   the hidden tests are written over whatever is at their paths (symlinks and directories in
   the way are removed first, never followed);
2. files the agent added that change how tests run are deleted: conftest.py, pytest.ini,
   tox.ini, setup.cfg, pyproject.toml, sitecustomize/usercustomize, *.pth, byte-code caches,
   and any module or package named like a stdlib or installed module (a fake `pytest.py` or
   `unittest/` would otherwise be imported in place of the real one);
3. pytest runs with `python -I` (no current directory on sys.path, no PYTHON* variables), no
   plugin autoloading, no cache, and writes a JUnit XML report into a directory created for
   this run, at a random path, mounted only for it;
4. the reward is parsed from that report, counting only test cases of the hidden test files.
   No report (the process exited early, e.g. `os._exit(0)`), an exit status that disagrees with
   the report, pytest's "interrupted"/"no tests" statuses, or a timeout give 0. Skipped tests
   count as not passed, so skipping (e.g. raising SkipTest from the module) earns nothing.

Limit: the tests import the agent's code into the pytest process, so code written to subvert
that process from inside (forge this report format, monkey-patch `unittest.TestCase` asserts)
is not excluded by this layer; the random report path (only in that process's argv) and the
exit-status cross-check make such a cheat deliberate rather than accidental. Tests that drive
the code through a subprocess, or a review of the final diff, are the next layer.
"""

from __future__ import annotations

import dataclasses
import os
import pkgutil
import secrets
import shlex
import shutil
import site
import sys
import xml.etree.ElementTree as ET

from coder.env.sandbox import Sandbox, SandboxError

_CONTROL_FILES = {
    "conftest.py",
    "pytest.ini",
    "tox.ini",
    "setup.cfg",
    "pyproject.toml",
    "sitecustomize.py",
    "usercustomize.py",
    ".pytest.ini",
}
_MAX_REPORT_BYTES = 32 << 20


@dataclasses.dataclass(frozen=True)
class Score:
    reward: float
    passed: int
    total: int
    error: str | None = None  # why the agent's solution scored what it did (None = clean run)
    infra_error: str | None = None  # the harness failed: mask this rollout, do not score it
    output: str = ""  # tail of the test run's output, for logs
    not_passed: tuple = ()  # pytest node ids of hidden test cases that failed or were skipped


def _is_test_path(path: str) -> bool:
    name = os.path.basename(path)
    parts = path.replace("\\", "/").split("/")
    return (
        name.startswith("test_")
        or name.endswith("_test.py")
        or name in _CONTROL_FILES
        or any(p in ("tests", "test", "testing") for p in parts[:-1])
    )


def _protected_module_names() -> frozenset:
    names = set(sys.stdlib_module_names)
    dirs = [p for p in site.getsitepackages() if os.path.isdir(p)]
    names.update(m.name for m in pkgutil.iter_modules(dirs))
    names.update({"pytest", "_pytest", "py", "pluggy", "iniconfig", "packaging", "test"})
    return frozenset(names)


_PROTECTED = None


def _force_write(sb: Sandbox, path: str, text: str) -> None:
    """Write `path`, replacing any symlink or non-directory on the way instead of following it."""
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise ValueError(f"{path}: '..' in a task path")
    cur = sb.workspace
    for p in parts[:-1]:
        cur = os.path.join(cur, p)
        if os.path.islink(cur) or (os.path.exists(cur) and not os.path.isdir(cur)):
            os.unlink(cur)
    target = os.path.join(cur, parts[-1])
    if os.path.isdir(target) and not os.path.islink(target):
        shutil.rmtree(target)
    elif os.path.lexists(target):  # file, symlink, FIFO, socket: never followed or opened
        os.unlink(target)
    sb.write("/".join(parts), text)


def _clean_workspace(sb: Sandbox, task) -> None:
    global _PROTECTED
    if _PROTECTED is None:
        _PROTECTED = _protected_module_names()
    keep = set(task.files) | set(task.tests)
    for dirpath, dirnames, filenames in os.walk(sb.workspace, topdown=True):
        for d in list(dirnames):
            full = os.path.join(dirpath, d)
            rel = os.path.relpath(full, sb.workspace)
            shadows = d in _PROTECTED and not any(k.startswith(rel + "/") for k in keep)
            if d in ("__pycache__", ".pytest_cache") or shadows:
                if os.path.islink(full):
                    os.unlink(full)
                else:
                    shutil.rmtree(full)
                dirnames.remove(d)
        for name in filenames:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, sb.workspace)
            if rel in keep:
                continue
            stem, ext = os.path.splitext(name)
            if (
                name in _CONTROL_FILES
                or ext in (".pth", ".pyc")
                or (ext in (".py", ".so") and stem.split(".")[0] in _PROTECTED)
            ):
                os.unlink(full)


def pytest_args(test_command: str) -> list[str]:
    """The arguments after `pytest` in a task's test command; ValueError if it is not pytest."""
    argv = shlex.split(test_command)
    if argv[:1] in (["pytest"], ["py.test"]):
        return argv[1:]
    if (
        len(argv) >= 3
        and os.path.basename(argv[0]).startswith("python")
        and argv[1:3] == ["-m", "pytest"]
    ):
        return argv[3:]
    raise ValueError(f"unsupported test_command {test_command!r}: scoring needs pytest")


def _module_of(path: str) -> str:
    return path[:-3].replace("/", ".") if path.endswith(".py") else path.replace("/", ".")


def parse_junit(xml_bytes: bytes, test_files: list[str]) -> tuple[int, int, int, list[str]]:
    """(passed, failed_or_error, total, ids of the cases that did not pass) over the test cases
    of `test_files` (all if empty). Ids are pytest node ids: `test_m.py::Class::test_name`."""
    root = ET.fromstring(xml_bytes)
    mods = {_module_of(p): p for p in test_files}
    passed = bad = total = 0
    not_passed = []
    for case in root.iter("testcase"):
        cls = case.get("classname", "")
        mod = next((m for m in mods if cls == m or cls.startswith(m + ".")), None)
        if mods and mod is None:
            continue
        total += 1
        tags = {child.tag for child in case}
        if tags & {"failure", "error"}:
            bad += 1
        elif "skipped" not in tags:
            passed += 1
            continue
        if mod is not None:
            rest = cls[len(mod) :].lstrip(".")
            not_passed.append(
                "::".join(
                    [mods[mod]] + ([*rest.split(".")] if rest else []) + [case.get("name", "")]
                )
            )
    return passed, bad, total, not_passed


def score(sb: Sandbox, task, mode: str = "fraction", timeout_s: float = 300.0) -> Score:
    """Reward of the workspace as it is now; see the module docstring. mode: fraction | all."""
    if mode not in ("fraction", "all"):
        raise ValueError(f"reward mode {mode!r}: use 'fraction' or 'all'")
    try:
        args = pytest_args(task.test_command)
    except ValueError as e:
        return Score(0.0, 0, 0, infra_error=str(e))
    report_host = None
    try:
        for path, text in task.files.items():
            if _is_test_path(path):
                _force_write(sb, path, text)
        for path, text in task.tests.items():
            _force_write(sb, path, text)
        _clean_workspace(sb, task)
        token = secrets.token_hex(8)
        report_host = os.path.join(sb.dir, f"report-{token}")
        os.mkdir(report_host, 0o700)
        sb._chown(report_host)
        inner = f"/tmp/.r{token}"
        report = f"{inner}/{secrets.token_hex(8)}.xml"
        cmd = (
            "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python -I -B -m pytest -p no:cacheprovider "
            f"-o junit_family=xunit2 --junitxml={report} " + " ".join(shlex.quote(a) for a in args)
        )
        res = sb.run(cmd, timeout_s=timeout_s, binds=((report_host, inner, True),))
        output = (res.stdout + res.stderr)[-4000:]
        if res.timed_out:
            return Score(0.0, 0, 0, f"tests timed out after {timeout_s:g} s", output=output)
        files = os.listdir(report_host)
        report_file = os.path.join(report_host, os.path.basename(report))
        if files != [os.path.basename(report)] or os.path.islink(report_file):
            return Score(
                0.0,
                0,
                0,
                f"no test report (pytest exit status {res.exit_code}: "
                "the run ended early or was tampered with)",
                output=output,
            )
        if os.path.getsize(report_file) > _MAX_REPORT_BYTES:
            return Score(0.0, 0, 0, "test report too large", output=output)
        with open(report_file, "rb") as f:
            data = f.read()
        try:
            passed, bad, total, not_passed = parse_junit(
                data, sorted(os.path.normpath(p) for p in task.tests)
            )
        except ET.ParseError as e:
            return Score(0.0, 0, 0, f"unreadable test report: {e}", output=output)
    except SandboxError as e:
        return Score(0.0, 0, 0, infra_error=f"sandbox: {e}")
    except OSError as e:
        return Score(0.0, 0, 0, infra_error=f"scoring I/O: {e}")
    finally:
        if report_host:
            shutil.rmtree(report_host, ignore_errors=True)
    if res.exit_code not in (0, 1):
        return Score(
            0.0,
            passed,
            total,
            f"pytest exit status {res.exit_code} (interrupted, collection errors or no tests)",
            output=output,
        )
    if (res.exit_code == 0) != (bad == 0):
        return Score(
            0.0,
            passed,
            total,
            f"pytest exit status {res.exit_code} disagrees with its report",
            output=output,
        )
    if total == 0:
        return Score(0.0, 0, 0, "no tests of the task ran", output=output)
    if mode == "all":
        reward = 1.0 if passed == total else 0.0
    else:
        reward = passed / total
    err = None if passed == total else f"{total - passed} of {total} tests did not pass"
    return Score(reward, passed, total, err, output=output, not_passed=tuple(not_passed))


def score_solution(
    task, files: dict, limits=None, mode: str = "fraction", timeout_s: float = 300.0
) -> Score:
    """Score `files` written over the task's workspace in a fresh sandbox."""
    try:
        with Sandbox(task, limits=limits) as sb:
            for path, text in files.items():
                _force_write(sb, path, text)
            return score(sb, task, mode=mode, timeout_s=timeout_s)
    except SandboxError as e:
        return Score(0.0, 0, 0, infra_error=f"sandbox: {e}")
