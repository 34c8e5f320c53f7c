"""R2E-Gym rows -> task format v2 (read by `python -m coder.env.make_tasks --source swebench`,
which hands every row carrying R2E-Gym's `repo_name` and `commit_hash` to `to_task`).

An R2E-Gym row (R2E-Gym-Lite / -Subset / -V1 on Hugging Face; fields checked against
R2E-Gym's own `ExecutionResult` and `ParsedCommit` models, 2026-11) names no FAIL_TO_PASS list
and ships its tests inside a Docker image. What it does ship, and how each becomes a task:
- `repo_name` (no owner: "aiohttp") -> the local mirror, `DIR/aiohttp` or the one
  `DIR/<owner>__aiohttp` (coder.env.sources.swebench.mirror_path);
- `parsed_commit_content` (JSON: `old_commit_hash`, `new_commit_hash`, `file_diffs` with each
  file's whole text before and after) -> the workspace is `old_commit_hash` (the image's
  `/testbed` is that commit too); the gold patch is the commit's diff of its non-test files
  (R2E-Gym's own test-file rule, `is_test_file`), taken from the mirror when it holds the new
  commit, else written from the file texts;
- `execution_result_content` (JSON: `test_file_names`, `test_file_codes`, and the pytest `-rA`
  logs of those tests at the old and the new commit) -> the hidden tests, written to
  `r2e_tests/<name>` at scoring only (the image keeps them at `/r2e_tests`, outside the
  repository, for the same reason); their node ids are read from the logs' summary lines;
- `expected_output_json` ({"Class.test": "PASSED" | "FAILED" | "ERROR"}, keys as R2E-Gym's log
  parser writes them: the node id without its file, "::" joined by ".", some with ANSI colour
  codes) -> FAIL_TO_PASS: the tests expected to pass that did not pass in the old commit's log;
  PASS_TO_PASS: those that passed there too. R2E-Gym has no such split (its reward is 1 iff the
  whole status map equals the expected one); this is SWE-bench's resolution rule over the same
  evidence. Tests expected to fail are not counted (their number is in the metadata);
- `problem_statement` -> the prompt (the body of its `[ISSUE]` block when it has one). Never
  `prompt`: that column is the prompt that *generated* the statement and holds the fix;
- `docker_image`, `num_non_test_lines`, `num_non_test_files`, `modified_files`,
  `relevant_files` -> metadata.

The environment: the image's `/testbed/.venv` is an editable install of `/testbed`, which the
sandbox's `/workspace` does not replace, so the image itself cannot score the agent's
workspace; tasks get a Python environment by `--environments` keyed by `repo_name` (or run on
the host's interpreter), and `make_tasks --verify` keeps those whose gold patch scores 1 and
whose unchanged workspace scores 0 there.
"""

from __future__ import annotations

import difflib
import json
import re

from coder.env.sources import repo as repo_lib
from coder.env.tasks import DEFAULT_TEST_COMMAND, Task

TESTS_DIR = "r2e_tests"  # where the hidden tests go in the workspace (the image: /r2e_tests)
_ANSI = re.compile(r"\x1b\[[0-9;]*m|\r")
_STATUSES = ("PASSED", "FAILED", "ERROR")
_SUMMARY = "short test summary info"


def is_row(row: dict) -> bool:
    """Whether `row` is an R2E-Gym row (SWE-bench's rows carry `repo` and `instance_id`)."""
    return "repo_name" in row and "commit_hash" in row and "repo" not in row


def _json(row: dict, key: str, where: str) -> dict:
    value = row.get(key)
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: {key} is not JSON: {e}") from e
    if not isinstance(value, dict):
        raise ValueError(f"{where}: {key} must be a JSON object, got {type(value).__name__}")
    return value


def test_key(name: str) -> str:
    """A test's key as R2E-Gym's expected map writes it: colour codes and pytest's ` - reason`
    suffix stripped (applied to both sides before they are compared)."""
    return _ANSI.sub("", name).split(" - ")[0].strip()


def summary_node_ids(log: str) -> dict:
    """{node id: "PASSED" | "FAILED" | "ERROR"} from the summary block of a pytest `-rA` log
    (lines such as `PASSED r2e_tests/test_1.py::TestX::test_y`); {} without one."""
    text = _ANSI.sub("", log or "")
    if _SUMMARY not in text:
        return {}
    out = {}
    for line in text.split(_SUMMARY, 1)[1].splitlines():
        words = line.strip().split(None, 1)
        if len(words) == 2 and words[0] in _STATUSES and "::" in words[1]:
            out[words[1].split(" - ")[0].strip()] = words[0]
    return out


def _key_of(node: str) -> str:
    return test_key(".".join(node.split("::")[1:]))


def issue_text(problem_statement: str) -> str:
    """The task's prompt: the body of the statement's `[ISSUE]` block, else all of it."""
    m = re.search(r"\[ISSUE\](.*)\[/ISSUE\]", problem_statement, re.DOTALL)
    return (m.group(1) if m else problem_statement).strip()


def is_test_file(path: str) -> bool:
    """R2E-Gym's rule (`FileDiff.is_test_file`): which of a commit's files are tests."""
    parts = path.split("/")
    return (path.endswith("_test.py") or parts[-1].startswith("test_")
            or any(p in ("tests", "Tests", "test", "Test") for p in parts[:-1]))


def _file_path(diff: dict, where: str) -> str:
    header = diff.get("header") or {}
    path = (header.get("file") or {}).get("path") if isinstance(header, dict) else None
    if not isinstance(path, str) or not path:
        raise ValueError(f"{where}: a file diff without header.file.path")
    return path


def _text_patch(path: str, old: str, new: str) -> str:
    """git's unified diff of one file from its two texts ("" = absent)."""
    a = old.splitlines(keepends=True)
    b = new.splitlines(keepends=True)
    head = [f"diff --git a/{path} b/{path}\n"]
    if not old:
        head.append("new file mode 100644\n")
    elif not new:
        head.append("deleted file mode 100644\n")
    body = []
    for line in difflib.unified_diff(a, b, "/dev/null" if not old else f"a/{path}",
                                     "/dev/null" if not new else f"b/{path}", n=3):
        if line.startswith(("---", "+++")):
            body.append(line.rstrip("\n").rstrip() + "\n")  # difflib adds a trailing space
        elif line.endswith("\n"):
            body.append(line)
        else:
            body.append(line + "\n\\ No newline at end of file\n")
    return "".join(head + body) if body else ""


def gold_patch(commit: dict, mirror: str, base: str, where: str) -> tuple[str, list[str]]:
    """(the fix: the commit's diff of its non-test files from `base`, the old commit's resolved
    sha, the paths it changes)."""
    diffs = commit.get("file_diffs")
    if not isinstance(diffs, list):
        raise ValueError(f"{where}: parsed_commit_content has no file_diffs list")
    fixes = {_file_path(d, where): d for d in diffs if not d.get("is_binary_file")}
    fixes = {p: d for p, d in fixes.items() if not is_test_file(p)}
    paths = sorted(fixes)
    if not paths:
        raise ValueError(f"{where}: the commit changes no non-test text file")
    try:
        new = repo_lib.resolve(mirror, commit["new_commit_hash"])
        patch = repo_lib.git("diff", "--no-renames", "--binary", base, new, "--", *paths,
                             cwd=repo_lib.source(mirror)[0])
    except (repo_lib.RepoError, KeyError):
        patch = "".join(_text_patch(p, fixes[p].get("old_file_content") or "",
                                    fixes[p].get("new_file_content") or "") for p in paths)
    if not patch.strip():
        raise ValueError(f"{where}: the commit's non-test files {paths[:5]} do not change")
    return patch, paths


def hidden_tests(result: dict, where: str) -> dict:
    """{workspace path under r2e_tests/: test file text} of `execution_result_content`."""
    names, codes = result.get("test_file_names"), result.get("test_file_codes")
    if not isinstance(names, list) or not isinstance(codes, list) or len(names) != len(codes):
        raise ValueError(f"{where}: execution_result_content needs test_file_names and "
                         "test_file_codes, lists of one length")
    if not names:
        raise ValueError(f"{where}: execution_result_content lists no test files")
    out = {}
    for name, code in zip(names, codes):
        if not isinstance(name, str) or not isinstance(code, str) or ".." in name.split("/"):
            raise ValueError(f"{where}: bad test file {name!r}")
        name = name.lstrip("/")
        if name.split("/")[0] != TESTS_DIR:
            name = f"{TESTS_DIR}/{name}"
        out[name] = code
    return out


def split_tests(expected: dict, old_log: str, new_log: str, files: list[str],
                where: str) -> tuple[tuple, tuple, int]:
    """(FAIL_TO_PASS node ids, PASS_TO_PASS node ids, tests expected not to pass) from the
    expected status map and the two logs. The node ids of an expected key are those of the logs'
    summaries that the key names (R2E-Gym's keys drop the file: a name in two files is one key,
    and both count), or the one test file's when there is only one; each is FAIL_TO_PASS unless
    it passed in the old commit's log."""
    old = summary_node_ids(old_log)
    nodes_of: dict = {}
    for node in [*old, *summary_node_ids(new_log)]:
        nodes_of.setdefault(_key_of(node), set()).add(node)
    f2p, p2p, other = [], [], 0
    for raw_key, status in expected.items():
        key = test_key(raw_key)
        if status != "PASSED":
            other += 1
            continue
        nodes = sorted(nodes_of.get(key, ()))
        if not nodes and len(files) == 1 and "[" not in key:
            nodes = ["::".join([files[0], *key.split(".")])]
        if not nodes:
            raise ValueError(f"{where}: test {key!r} is in neither log's summary, and there are "
                             f"{len(files)} test files to guess from")
        for node in nodes:
            (p2p if old.get(node) == "PASSED" else f2p).append(node)
    if not f2p:
        raise ValueError(f"{where}: no test is expected to pass that failed before the fix "
                         f"({len(p2p)} pass before and after)")
    return tuple(f2p), tuple(p2p), other


def to_task(row: dict, mirror: str, test_command: str = DEFAULT_TEST_COMMAND, setup: str = "",
            environment: dict | None = None) -> tuple[Task, str]:
    """(the task, its gold patch) of one R2E-Gym row whose repository is at `mirror`;
    ValueError naming the row and the field."""
    name, new_hash = row.get("repo_name"), row.get("commit_hash")
    if not isinstance(name, str) or not name or not isinstance(new_hash, str) or not new_hash:
        raise ValueError(f"an R2E-Gym row needs repo_name and commit_hash: keys {sorted(row)[:12]}")
    tid = row.get("instance_id") or f"r2e__{name}-{new_hash[:12]}"
    where = f"R2E-Gym row {tid!r}"
    if not isinstance(row.get("problem_statement"), str) or not row["problem_statement"].strip():
        raise ValueError(f"{where}: problem_statement missing")
    commit = _json(row, "parsed_commit_content", where)
    result = _json(row, "execution_result_content", where)
    expected = _json(row, "expected_output_json", where)
    if not isinstance(commit.get("old_commit_hash"), str):
        raise ValueError(f"{where}: parsed_commit_content has no old_commit_hash")
    try:
        base = repo_lib.resolve(mirror, commit["old_commit_hash"])
    except repo_lib.RepoError as e:
        raise ValueError(f"{where}: commit {commit['old_commit_hash']!r} not in {mirror}: {e}") from e
    gold, paths = gold_patch(commit, mirror, base, where)
    tests = hidden_tests(result, where)
    f2p, p2p, expected_failing = split_tests(
        expected, result.get("old_commit_res_stdout") or "",
        result.get("new_commit_res_stdout") or "", sorted(tests), where)
    stats = repo_lib.patch_stats(gold)
    meta = {
        "source": "swebench",
        "variant": "r2e-gym",
        "repo": name,
        "instance_id": tid,
        "base_commit": base,
        "fix_commit": commit.get("new_commit_hash", new_hash),
        "lines_added": stats["lines_added"],
        "lines_removed": stats["lines_removed"],
        "files_changed": paths,
        "expected_failing": expected_failing,
    }
    for key in ("docker_image", "num_non_test_lines", "num_non_test_files", "modified_files",
                "relevant_files"):
        if row.get(key) not in (None, "", []):
            meta[key] = row[key]
    task = Task(
        id=tid, prompt=issue_text(row["problem_statement"]), files={}, tests=tests,
        test_command=test_command, source="swebench", repo=mirror, commit=base, setup=setup,
        fail_to_pass=f2p, pass_to_pass=p2p, metadata=meta, environment=environment or {},
    )
    return task, gold
