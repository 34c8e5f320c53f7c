"""Test-based reward, hardened against the cheats a policy finds.

`score(sandbox, task)` after the agent is done (no agent process is alive any more):
1. every test or test-configuration file of the task is put back as the task shipped it, and
   the hidden tests are written over whatever is at their paths (symlinks and directories in
   the way are removed first, never followed);
2. files the agent added that change how tests run are deleted: conftest.py, pytest.ini,
   tox.ini, setup.cfg, pyproject.toml, sitecustomize/usercustomize, *.pth, byte-code caches,
   and any module or package named like a stdlib or installed module, or one the task's
   environment installs (a fake `pytest.py` or `unittest/` would otherwise be imported in place
   of the real one);
3. pytest runs with `python -I` (no current directory on sys.path, no PYTHON* variables) and
   the workspace appended to the end of sys.path (`_PYTEST`): the repository's packages import
   as they do for `python -m pytest` run in /workspace (the agent's `run_tests`), so scoring and
   the agent's own test runs agree, yet nothing in the workspace can shadow pytest, the standard
   library or an installed module (step 2 also deletes such files); no plugin autoloading, no
   cache, and writes a JUnit XML report into a directory created for this run, at a random
   path, mounted only for it;
4. the reward is parsed from that report, counting only test cases of the hidden test files.
   No report (the process exited early, e.g. `os._exit(0)`), an exit status that disagrees with
   the report, pytest's "interrupted"/"no tests" statuses, or a timeout give 0. On a task
   without ids skipped tests count as not passed, so skipping (e.g. raising SkipTest from the
   module) earns nothing.

Repository tasks (v2, `Task.repo`): step 1 puts back every tracked test / test-configuration
file of the task's commit and writes `test_patch`'s result over the files it touches (computed
from the pristine checkout, `coder.env.sources.repo.patched_files`: the agent never sees the patch);
the repository's tracked files are not "added by the agent" in step 2. With `fail_to_pass` /
`pass_to_pass` ids (pytest node ids, relative to the workspace root, named as the task's test
format names them: coder.env.scoring.runners, e.g. SWE-bench's ids cut at a space), pytest runs on their
files with `--rootdir=/workspace` and exactly those ids count, under SWE-bench's resolution rule
(coder.env.scoring.grading: an xfail passes, a skipped PASS_TO_PASS test is maintained, a skipped or
absent FAIL_TO_PASS test did not pass): reward modes below. The exit-status
cross-check then covers the whole report, since tests outside the ids may fail before and after
the fix. A v2 task with no ids and a test command that is not pytest scores by its exit status
(0 = pass: reward 1 of 1); that command runs as the task wrote it, so it is only as hard to
subvert as the files step 1 restores. With ids and a command of another runner (`go test`,
TAP from `node --test --test-reporter=tap`, Django's `runtests.py`, sympy's `bin/test`, ...:
`Task.test_format`'s log formats, coder.env.scoring.runners), its
whole output is written to a file in a directory mounted for that run only and parsed into
per-test statuses, and the ids count as for pytest. Step 1 also restores the tracked files the
test command names (a runner script such as `bash run_tests.sh`).

Reward modes (`REWARD_MODES`, a function of the counted outcomes): `fraction` = the fraction
of FAIL_TO_PASS ids that pass, 0 if any PASS_TO_PASS id broke (those pass before any change,
so counting them would pay for doing nothing); a v1 task's hidden tests all count as
FAIL_TO_PASS, so this is passed / total there. `all` = 1 iff every counted test passes: on a
task with ids that is SWE-bench's resolution rule (every FAIL_TO_PASS id passes and every
PASS_TO_PASS id is maintained), which `resolved` names; the two names are one rule.

Limit: the tests import the agent's code into the pytest process, so code written to subvert
that process from inside (forge this report format, monkey-patch `unittest.TestCase` asserts)
is not excluded by this layer, nor is code under test that calls `pytest.xfail` or skips a
PASS_TO_PASS test it broke (SWE-bench's rule counts both as fine); the random report path
(only in that process's argv) and the
exit-status cross-check make such a cheat deliberate rather than accidental. Tests that drive
the code through a subprocess, or a review of the final diff, are the next layer.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import pkgutil
import secrets
import shlex
import shutil
import site
import stat
import sys
import xml.etree.ElementTree as ET

from coder.env.scoring import grading, runners
from coder.env.sources import repo as repo_lib
from coder.env.runtime.installed import library_dirs_under
from coder.env.runtime.sandbox import WORKDIR, Sandbox, SandboxError, task_checkout

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


def _fraction(f2p_passed: int, f2p_total: int, p2p_passed: int, p2p_total: int) -> float:
    if p2p_passed < p2p_total:
        return 0.0
    return f2p_passed / f2p_total if f2p_total else 1.0


def _all_pass(f2p_passed: int, f2p_total: int, p2p_passed: int, p2p_total: int) -> float:
    return float(f2p_passed == f2p_total and p2p_passed == p2p_total)


def outcome(test_reward: float, broken_calls: int) -> tuple[float, bool]:
    """The broken-call rule, in the one place the house keeps it (docs/contracts.md, "Tool
    calls"): (outcome in [0, 1], correct) from the tests' score and the rollout's broken tool
    calls. A broken call makes the rollout a failure whatever the tests say: outcome 0, not
    correct. Both the env's text interface (coder.env.episode.Episode.score) and the RL agent's
    rollouts (coder.rl.agent) apply it."""
    if broken_calls > 0:
        return 0.0, False
    r = min(max(float(test_reward), 0.0), 1.0)
    return r, r >= 1.0


# mode -> reward(f2p_passed, f2p_total, p2p_passed, p2p_total); see the module docstring.
REWARD_MODES = {"fraction": _fraction, "all": _all_pass, "resolved": _all_pass}


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


def _no_symlink_on_the_way(sb: Sandbox, full: str) -> bool:
    """Whether no component of `full` below the workspace root is a symlink."""
    rel = os.path.relpath(full, sb.workspace)
    return os.path.realpath(full) == os.path.normpath(
        os.path.join(os.path.realpath(sb.workspace), rel)
    )


def _unchanged(sb: Sandbox, path: str, data: bytes) -> bool:
    """Whether the workspace holds exactly `data` at `path` as a regular file reached through no
    symlink (checked with lstat first, so nothing the agent left is followed or opened)."""
    full = os.path.join(sb.workspace, path)
    try:
        st = os.lstat(full)
    except OSError:
        return False
    if not stat.S_ISREG(st.st_mode) or st.st_size != len(data):
        return False
    if not _no_symlink_on_the_way(sb, full):
        return False
    with open(full, "rb") as f:
        return f.read() == data


def _force_remove(sb: Sandbox, path: str) -> None:
    """Delete `path` unless a symlink leads to it (then nothing is at that path to delete)."""
    full = os.path.join(sb.workspace, path)
    parent = os.path.dirname(full)
    if not _no_symlink_on_the_way(sb, parent) or not os.path.lexists(full):
        return
    if os.path.isdir(full) and not os.path.islink(full):
        shutil.rmtree(full)
    else:
        os.unlink(full)


def _restore_tests(sb: Sandbox, task) -> set:
    """Step 1: the task's test files as shipped, the hidden tests over them. Returns the paths
    that belong to the task (never deleted as the agent's additions)."""
    keep = set(task.files) | set(task.tests)
    for path, text in task.files.items():
        if _is_test_path(path):
            _force_write(sb, path, text)
    if getattr(task, "repo", ""):
        co = task_checkout(task, sb.limits.history_depth)  # the sandbox's own checkout
        keep |= co.tracked
        named = runners.named_paths(task.test_command)  # a runner script the command names
        for path in co.paths:
            if (_is_test_path(path) or path in named) and path not in task.files:
                data = co.read(path)
                if not _unchanged(sb, path, data):
                    _force_write(sb, path, data)
        if task.test_patch:
            try:
                patched = repo_lib.patched_files(co, task.test_patch)
            except repo_lib.RepoError as e:
                raise SandboxError(f"test_patch does not apply to {task.commit[:12]}: {e}")
            for path, data in patched.items():
                keep.add(path)
                if data is None:
                    _force_remove(sb, path)
                else:
                    _force_write(sb, path, data)
    for path, text in task.tests.items():
        _force_write(sb, path, text)
    return keep


@functools.lru_cache(maxsize=64)
def _environment_module_names(path: str) -> frozenset:
    """Top-level modules a task environment's venv installs: protected like the host's."""
    return frozenset(m.name for m in pkgutil.iter_modules(list(library_dirs_under(path))))


def _clean_workspace(sb: Sandbox, keep: set) -> None:
    global _PROTECTED
    if _PROTECTED is None:
        _PROTECTED = _protected_module_names()
    protected = _PROTECTED
    if getattr(sb, "environment", None) is not None:
        protected = protected | _environment_module_names(sb.environment.path)
    for dirpath, dirnames, filenames in os.walk(sb.workspace, topdown=True):
        if dirpath == sb.workspace and ".git" in dirnames:
            dirnames.remove(".git")  # pytest never looks inside; git's files are not modules
        for d in list(dirnames):
            full = os.path.join(dirpath, d)
            rel = os.path.relpath(full, sb.workspace)
            shadows = d in protected and not any(k.startswith(rel + "/") for k in keep)
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
                or (ext in (".py", ".so") and stem.split(".")[0] in protected)
            ):
                os.unlink(full)


def prepare(sb: Sandbox, task) -> None:
    """Steps 1 and 2 (module docstring) on the workspace as the agent left it: what `score`
    does before it runs the tests. Idempotent."""
    _clean_workspace(sb, _restore_tests(sb, task))


# the Task fields a verdict depends on (not its id, prompt, source or metadata)
_SCORING_FIELDS = ("files", "tests", "test_command", "language", "repo", "commit", "setup",
                   "fail_to_pass", "pass_to_pass", "test_patch", "environment", "test_format")


def scoring_digest(sb: Sandbox, task, mode: str, timeout_s: float) -> str:
    """sha256 (hex) of what `score` sees, on a workspace `prepare`d first: the task's scoring
    fields, `mode`, `timeout_s`, and the workspace's tree (every path, its kind, executable bit
    and contents or link target; of `.git` its refs, HEAD and index, not the object store, which
    only grows). Two workspaces with one digest get one verdict up to flaky tests
    (coder.env.scoring.verdicts); the sandbox's /tmp is private to each command, so the tree is all the
    state a test run can read. OSError when a file cannot be read."""
    h = hashlib.sha256()
    fields = {f: getattr(task, f, None) for f in _SCORING_FIELDS}
    h.update(json.dumps([fields, mode, float(timeout_s)], sort_keys=True, default=list).encode())
    root = sb.workspace
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        rel_dir = os.path.relpath(dirpath, root)
        if rel_dir == ".git":
            dirnames[:] = [d for d in dirnames if d != "objects"]
        for name in sorted(filenames) + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            full = os.path.join(dirpath, name)
            rel = os.path.normpath(os.path.join(rel_dir, name))
            st = os.lstat(full)
            if stat.S_ISLNK(st.st_mode):
                h.update(b"L\0" + rel.encode() + b"\0" + os.readlink(full).encode() + b"\0")
            elif stat.S_ISREG(st.st_mode):
                h.update(b"F\0" + rel.encode() + b"\0" + (b"x" if st.st_mode & 0o111 else b"-"))
                with open(full, "rb") as f:
                    h.update(hashlib.sha256(f.read()).digest())
            else:  # fifos, sockets: their presence is all a test could see
                h.update(b"O\0" + rel.encode() + b"\0")
        for d in dirnames:
            h.update(b"D\0" + os.path.normpath(os.path.join(rel_dir, d)).encode() + b"\0")
    return h.hexdigest()


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


def junit_results(xml_bytes: bytes) -> dict:
    """{(classname, name): (status, message)} of every case in a JUnit report: "passed",
    "failed" (a failure or an error), "skipped", or "xfailed" (pytest's `skipped
    type="pytest.xfail"`); the message is the outcome element's. A case listed twice keeps its
    worst outcome."""
    rank = {"passed": 0, "xfailed": 1, "skipped": 2, "failed": 3}
    out = {}
    for case in ET.fromstring(xml_bytes).iter("testcase"):
        status, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                status, message = "failed", child.get("message", "")
                break
            if child.tag == "skipped":
                xfail = child.get("type") == "pytest.xfail"
                status, message = "xfailed" if xfail else "skipped", child.get("message", "")
        key = (case.get("classname", ""), case.get("name", ""))
        if key not in out or rank[status] >= rank[out[key][0]]:
            out[key] = (status, message)
    return out


def junit_cases(xml_bytes: bytes) -> dict:
    """{(classname, name): status} of every case in a JUnit report (`junit_results`)."""
    return {k: status for k, (status, _) in junit_results(xml_bytes).items()}


def junit_nodes(results: dict, test_files) -> list[tuple[str, str, str]]:
    """[(pytest node id, status, message)] of the cases of `junit_results` that belong to
    `test_files` (workspace paths; a case's module is the longest that matches)."""
    mods = sorted(((_module_of(p), p) for p in test_files), key=lambda m: -len(m[0]))
    out = []
    for (cls, name), (status, message) in results.items():
        hit = next(((m, p) for m, p in mods if cls == m or cls.startswith(m + ".")), None)
        if hit is not None:
            rest = cls[len(hit[0]):].lstrip(".")
            out.append(("::".join([hit[1], *(rest.split(".") if rest else []), name]), status, message))
    return out


def junit_statuses(xml_bytes: bytes, test_files) -> dict:
    """{pytest node id: status} of the cases of a JUnit report that belong to `test_files`."""
    return {node: status for node, status, _ in junit_nodes(junit_results(xml_bytes), test_files)}


def _score_exit_status(sb: Sandbox, task, timeout_s: float) -> Score:
    """A v2 task with no test ids and a command that is not pytest: exit status 0 passes."""
    try:
        _clean_workspace(sb, _restore_tests(sb, task))
        res = sb.run(task.test_command, timeout_s=timeout_s)
    except SandboxError as e:
        return Score(0.0, 0, 0, infra_error=f"sandbox: {e}")
    except OSError as e:
        return Score(0.0, 0, 0, infra_error=f"scoring I/O: {e}")
    output = (res.stdout + res.stderr)[-4000:]
    if res.timed_out:
        return Score(0.0, 0, 1, f"tests timed out after {timeout_s:g} s", output=output)
    if res.exit_code != 0:
        return Score(0.0, 0, 1, f"test command exit status {res.exit_code}", output=output)
    return Score(1.0, 1, 1, output=output)


def _report_dir(sb: Sandbox) -> tuple[str, str]:
    """(host path, path inside) of a fresh directory at a random path for one scoring run's
    report, mounted only for that run; the caller removes it."""
    token = secrets.token_hex(8)
    host = os.path.join(sb.dir, f"report-{token}")
    os.mkdir(host, 0o700)
    sb._chown(host)
    return host, f"/tmp/.r{token}"


def _score_runner(sb: Sandbox, task, fmt: str, mode: str, timeout_s: float) -> Score:
    """A task with test ids whose command is another runner (a log format of coder.env.scoring.runners): its
    output goes to a file in a directory mounted for this run only, is parsed into per-test
    statuses, and the ids count as with pytest. An exit status of 0 beside a failed test, or
    output with no test result at all, scores 0."""
    report_host = None
    try:
        _clean_workspace(sb, _restore_tests(sb, task))
        report_host, inner = _report_dir(sb)
        out = f"{inner}/{secrets.token_hex(8)}.out"
        res = sb.run(f"{{ {runners.command(fmt, task.test_command)}\n}} > {out} 2>&1",
                     timeout_s=timeout_s, binds=((report_host, inner, True),))
        out_host = os.path.join(report_host, os.path.basename(out))
        if res.timed_out:
            return Score(0.0, 0, 0, f"tests timed out after {timeout_s:g} s")
        if not os.path.isfile(out_host) or os.path.islink(out_host):
            return Score(0.0, 0, 0, f"no test output (exit status {res.exit_code})")
        with open(out_host, "rb") as f:
            text = f.read(_MAX_REPORT_BYTES).decode("utf-8", "replace")
    except SandboxError as e:
        return Score(0.0, 0, 0, infra_error=f"sandbox: {e}")
    except OSError as e:
        return Score(0.0, 0, 0, infra_error=f"scoring I/O: {e}")
    finally:
        if report_host:
            shutil.rmtree(report_host, ignore_errors=True)
    output = text[-4000:]
    statuses = runners.parse(fmt, text)
    if not statuses:
        return Score(0.0, 0, 0, f"no {fmt} test results in the output (exit status "
                     f"{res.exit_code})", output=output)
    if res.exit_code == 0 and any(v == "failed" for v in statuses.values()):
        return Score(0.0, 0, 0, "exit status 0 disagrees with the failed tests in the output",
                     output=output)
    return _graded(grading.resolve(statuses, task.fail_to_pass, task.pass_to_pass), mode, output)


def _graded(res: grading.Resolution, mode: str, output: str) -> Score:
    """The Score of a run whose ids `res` resolved (coder.env.scoring.grading: SWE-bench's rule)."""
    total = res.f2p_total + res.p2p_total
    reward = REWARD_MODES[mode](res.f2p_passed, res.f2p_total, res.p2p_passed, res.p2p_total)
    err = None if not res.failures else (
        f"{len(res.failures)} of {total} tests did not pass ({res.describe()})")
    return Score(reward, res.f2p_passed + res.p2p_passed, total, err, output=output,
                 not_passed=res.not_passed)


# pytest's entry point with the workspace last on sys.path (module docstring, step 3)
_PYTEST = f"import sys; sys.path.append({WORKDIR!r}); import pytest; sys.exit(pytest.main())"


def pytest_invocation(args: list[str], junit_report: str) -> str:
    """The shell command scoring runs in the sandbox: pytest with `args`, isolated (`-I`, no
    plugin autoload, no cache), writing its JUnit report to `junit_report`. Task generators
    run the same command, so what they record is what scoring will see."""
    return (
        f"PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python -I -B -c {shlex.quote(_PYTEST)} "
        f"-p no:cacheprovider -o junit_family=xunit2 --junitxml={shlex.quote(junit_report)} "
        + " ".join(shlex.quote(a) for a in args)
    )


def score(sb: Sandbox, task, mode: str = "fraction", timeout_s: float = 300.0) -> Score:
    """Reward of the workspace as it is now; see the module docstring. mode: a key of
    REWARD_MODES (fraction | all | resolved)."""
    if mode not in REWARD_MODES:
        raise ValueError(f"reward mode {mode!r}: use one of {sorted(REWARD_MODES)}")
    ids = tuple(getattr(task, "fail_to_pass", ())) + tuple(getattr(task, "pass_to_pass", ()))
    v2 = bool(getattr(task, "repo", ""))
    fmt = runners.format_of(task) or "pytest"
    if fmt not in runners.FORMATS:
        return Score(0.0, 0, 0, infra_error=f"test_format {fmt!r}: use one of {list(runners.FORMATS)}")
    if not runners.FORMATS[fmt].junit and ids:
        return _score_runner(sb, task, fmt, mode, timeout_s)
    try:
        if not runners.FORMATS[fmt].junit:
            raise ValueError(f"test_format {fmt!r} scores test ids; this task has none")
        args = pytest_args(task.test_command)
    except ValueError as e:
        if v2 and not ids:
            return _score_exit_status(sb, task, timeout_s)
        return Score(0.0, 0, 0, infra_error=str(e))
    not_node_ids = [i for i in ids if "::" not in i]
    if not_node_ids:
        return Score(0.0, 0, 0, infra_error=f"test ids that are not pytest node ids: {not_node_ids[:3]} "
                     "(another runner's ids need its test_format: coder.env.scoring.runners)")
    if v2:
        args = [f"--rootdir={WORKDIR}", *args, *sorted({i.split("::", 1)[0] for i in ids})]
    report_host = None
    try:
        keep = _restore_tests(sb, task)
        _clean_workspace(sb, keep)
        report_host, inner = _report_dir(sb)
        report = f"{inner}/{secrets.token_hex(8)}.xml"
        res = sb.run(pytest_invocation(args, report), timeout_s=timeout_s,
                     binds=((report_host, inner, True),))
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
            if ids:
                results = junit_results(data)
                bad = sum(s == "failed" for s, _ in results.values())  # the whole run's, for the check
                files = sorted({i.split("::", 1)[0] for i in ids})
                statuses = runners.keyed(fmt, junit_nodes(results, files))
                resolution = grading.resolve(statuses, task.fail_to_pass, task.pass_to_pass)
                passed, total = resolution.f2p_passed + resolution.p2p_passed, len(ids)
            else:
                counted = set(task.tests)
                if v2 and task.test_patch:
                    counted |= {p for p in repo_lib.patch_stats(task.test_patch)["files"]
                                if p.endswith(".py")}
                passed, bad, total, not_passed = parse_junit(
                    data, sorted(os.path.normpath(p) for p in counted)
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
    if ids:
        return _graded(resolution, mode, output)
    reward = REWARD_MODES[mode](passed, total, 0, 0)
    err = None if passed == total else f"{total - passed} of {total} tests did not pass"
    return Score(reward, passed, total, err, output=output, not_passed=tuple(not_passed))


def apply_patch(sb: Sandbox, patch: str) -> str | None:
    """`git apply` a unified diff to the workspace, inside the sandbox (as its user, so new
    files are the agent's); None when it applied, else git's complaint."""
    if shutil.which("git") is None:  # the sandbox runs the host's /usr/bin
        raise SandboxError("git is not installed: patch solutions need it (apt-get install git)")
    token = secrets.token_hex(8)
    host = os.path.join(sb.dir, f"patch-{token}")
    os.mkdir(host, 0o700)
    try:
        with open(os.path.join(host, "p.diff"), "w", encoding="utf-8") as f:
            f.write(patch)
        sb._chown(host)
        sb._chown(os.path.join(host, "p.diff"))
        inner = f"/tmp/.p{token}"
        r = sb.run(
            f"git apply --whitespace=nowarn {inner}/p.diff", binds=((host, inner, False),)
        )
    finally:
        shutil.rmtree(host, ignore_errors=True)
    return None if r.exit_code == 0 else (r.stdout + r.stderr).strip()[-1000:] or "git apply failed"


def score_solution(
    task, solution, limits=None, mode: str = "fraction", timeout_s: float = 300.0
) -> Score:
    """Score a solution in a fresh sandbox of the task: {path: text} written over the workspace,
    or a unified diff (str) applied to it (one that does not apply scores 0)."""
    try:
        with Sandbox(task, limits=limits) as sb:
            if isinstance(solution, str):
                err = apply_patch(sb, solution) if solution.strip() else None
                if err:
                    return Score(0.0, 0, 0, f"patch does not apply: {err}")
            else:
                for path, text in solution.items():
                    _force_write(sb, path, text)
            return score(sb, task, mode=mode, timeout_s=timeout_s)
    except SandboxError as e:
        return Score(0.0, 0, 0, infra_error=f"sandbox: {e}")
