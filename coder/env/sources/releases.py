"""Feature tasks from real release history: "implement what the next release added".

For a package on the index and one of its releases B (the one before it is A):
1. the sdists of A, B and up to `history` releases before A are fetched (coder.env.sources.pypi) and
   committed, oldest first, as a linear git history in a bare mirror `<repos>/pypi__<name>`
   (one commit per release, dated by its upload, so the same releases give the same shas);
2. the task's workspace is A's commit (and `env.history_depth - 1` earlier releases: the agent's
   `repo_history`); B's commit is in the mirror but unreachable from A, so no workspace holds it
   (coder.env.sources.repo), and the sdist cache is outside every sandbox;
3. the diff A -> B splits by path: test files (`tests/`, `test_*.py`, `conftest.py`, ...) make
   the hidden `test_patch`, applied only at scoring; the rest, less the changelog and the
   version files an sdist build writes, is the gold patch (`--solutions`);
4. the prompt is B's changelog section, stripped of markup and cut to `max_prompt_chars`
   (CursorBench-like: terse and underspecified; a cut says how many entries it left out);
5. B's test suite runs in the task's sandbox twice, with the scoring command
   (`coder.env.reward.pytest_invocation`): on A with B's tests, and on B. FAIL_TO_PASS = the
   tests that fail on A and pass on B, PASS_TO_PASS = those that pass on both; tests that fail
   on B here are left out. A pair with no FAIL_TO_PASS test makes no task;
6. `make_tasks --verify` then keeps the tasks whose gold patch scores 1 and whose unchanged
   workspace scores 0 through the scoring path itself (coder.env.sources.verify).

Splits: a package's tasks are all train or all held out (`split_of`, a hash of its name), so a
held-out repository's code is never trained on through another of its releases.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import re
import shlex
import shutil
import statistics
import tempfile

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from coder.data import corpus
from coder.env.runtime import installed
from coder.env.sources import pypi
from coder.env.sources import repo as repo_lib
from coder.env.scoring.score import apply_patch, junit_statuses, pytest_args, pytest_invocation
from coder.env.runtime.sandbox import Limits, Sandbox, SandboxError
from coder.env.tasks import DEFAULT_TEST_COMMAND, Task

TEST_PATH = re.compile(
    r"(^|/)(tests?|testing)/|(^|/)(test_[^/]*\.py|[^/]*_tests?\.py|conftest\.py)$"
)
CHANGELOG = re.compile(
    r"^(docs?/)?(changes|changelog|history|news|release[-_ ]?notes|versions)(\.(md|rst|txt))?$",
    re.I,
)
_DIRECT_VERSION = re.compile(r"\d+\.\d+")
_UNDERLINE = re.compile(r"^\s*([=\-~^*+#`])\1{2,}\s*$")
_REPORT = ".coder-release-statuses.xml"


@dataclasses.dataclass(frozen=True)
class Options:
    """How tasks are made. `environment`: the venv spec every task runs in (None: pytest pinned
    to this interpreter's version plus the package's declared runtime dependencies; {}: the host
    interpreter)."""

    history: int = 2  # earlier releases committed before A
    max_prompt_chars: int = 600
    environment: dict | None = None
    test_requirements: tuple = ()  # what the default environment installs to run tests
    timeout_s: float = 300.0
    heldout_percent: int = corpus.TASK_HELDOUT_PERCENT
    environments_dir: str = ""  # where task venvs are built ("" = the default cache)

    @property
    def limits(self) -> Limits:
        return Limits(timeout_s=self.timeout_s, cpu_s=int(self.timeout_s),
                      environments_dir=self.environments_dir)


def split_of(name: str, heldout_percent: int = corpus.TASK_HELDOUT_PERCENT) -> str:
    """'train' or 'heldout' for every task of package `name` (fixed per package)."""
    return corpus.task_module_split(f"pypi:{canonicalize_name(name)}", heldout_percent)


def is_test_path(path: str) -> bool:
    return bool(TEST_PATH.search(path))


def _version_token(version: str) -> re.Pattern:
    return re.compile(rf"(?<![\w.])v?{re.escape(version)}(?!\.?\d)")


def _headings(lines: list[str]) -> list[int]:
    """Indices of heading lines: `#` headings, underlined ones, and bare version lines."""
    out = []
    for i, line in enumerate(lines):
        text = line.strip()
        if not text or _UNDERLINE.match(line):
            continue
        underlined = i + 1 < len(lines) and _UNDERLINE.match(lines[i + 1])
        bare = re.match(r"^(version\s+|v)?\d+(\.\d+)+\S*(\s*[(\[\-:–—].*)?$", text, re.I)
        if text.startswith("#") or underlined or bare:
            out.append(i)
    return out


def changelog_section(tree: str, version: str) -> tuple[str, str] | None:
    """(changelog path, the text of `version`'s section) from the changelog files of a source
    tree, or None when no changelog has a heading naming `version`."""
    paths = []
    for dirpath, dirnames, filenames in os.walk(tree):
        rel_dir = os.path.relpath(dirpath, tree)
        dirnames[:] = [d for d in dirnames if rel_dir == "." and d in ("doc", "docs")]
        for fn in filenames:
            rel = os.path.normpath(os.path.join(rel_dir, fn))
            if CHANGELOG.match(rel):
                paths.append(rel)
    token = _version_token(version)
    for rel in sorted(paths, key=lambda p: (p.count("/"), p)):
        with open(os.path.join(tree, rel), encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
        heads = _headings(lines)
        start = next((i for i in heads if token.search(lines[i])), None)
        if start is None:  # a list of versions: "- 1.2.0: what changed" + indented lines
            item = next((i for i, ln in enumerate(lines)
                         if re.match(rf"^\s*[-*]\s+{token.pattern}\s*:", ln)), None)
            if item is None:
                continue
            end = next((i for i in range(item + 1, len(lines))
                        if lines[i].strip() and not lines[i][:1].isspace()), len(lines))
            first = lines[item].split(":", 1)[1].strip()
            rest = [ln.strip() for ln in lines[item + 1:end] if ln.strip()]
            return rel, "\n".join(f"- {ln}" for ln in [first, *rest] if ln)
        body = start + (2 if start + 1 < len(lines) and _UNDERLINE.match(lines[start + 1]) else 1)
        end = next((i for i in heads if i > start and _DIRECT_VERSION.search(lines[i])),
                   len(lines))
        return rel, "\n".join(lines[body:end]).strip()
    return None


def _plain(text: str) -> str:
    """Changelog markup (Markdown, reStructuredText) reduced to plain words."""
    text = re.sub(r"\[([^\]]+)\]\[[^\]]*\]", r"\1", text)  # [text][ref]
    text = re.sub(r"\[([^\]]+)\]\([^)]*\)", r"\1", text)  # [text](url)
    text = re.sub(r"`([^`<]+?)\s*<[^>]+>`_+", r"\1", text)  # `text <url>`_
    text = re.sub(r"\s*:(?:pr|issue|gh|ghpull|ghissue|bug|user):`[^`]*`", "", text)
    text = re.sub(r":[\w:]+:`~?([^`]+)`", r"`\1`", text)  # :func:`x`
    text = re.sub(r"``([^`]+)``", r"`\1`", text)
    text = re.sub(r"\s*\((?:#\d+|gh-\d+|issue\s*#?\d+)(?:,\s*#?\d+)*\)", "", text, flags=re.I)
    return re.sub(r"\s+", " ", text).strip()


def changelog_entries(section: str) -> list[str]:
    """The section's entries (bullets, continuation lines joined), as plain text; a section
    without bullets is one entry of its prose (a date line alone is dropped)."""
    entries, current = [], None
    for line in section.splitlines():
        m = re.match(r"^\s*(?:[-*+•]|\d+[.)])\s+(.*)$", line)
        if m:
            current = [m.group(1)]
            entries.append(current)
        elif line.strip() and current is not None and line[:1].isspace():
            current.append(line.strip())
        elif not line.strip():
            current = None
    out = [_plain(" ".join(e)) for e in entries]
    if not out:
        prose = [ln for ln in section.splitlines()
                 if ln.strip() and not re.fullmatch(r"[_*(]*[\w ,]*\d{4}[)_*]*", ln.strip())]
        out = [_plain(" ".join(prose))] if prose else []
    return [e for e in out if e]


def terse_prompt(name: str, old: str, new: str, entries: list[str], max_chars: int) -> tuple[str, int]:
    """(the prompt, entries left out): the changelog's entries under one line, as many as fit in
    `max_chars`, then how many were left out (the first entry is cut at a word if it alone does
    not fit)."""
    lines = [f"Bring {name} from {old} up to {new}. The release notes say:"]

    def tail(left):
        return [f"(and {left} more changes in the release)"] if left else []

    kept = 0
    for entry in entries:
        trial = lines + [f"- {entry}"] + tail(len(entries) - kept - 1)
        if len("\n".join(trial)) > max_chars:
            break
        lines.append(f"- {entry}")
        kept += 1
    if kept == 0 and entries:
        room = max_chars - len("\n".join(lines + tail(len(entries) - 1))) - 7
        lines.append("- " + entries[0][: max(room, 0)].rsplit(" ", 1)[0] + " ...")
        kept = 1
    left = len(entries) - kept
    return "\n".join(lines + tail(left)), left


def commit_env(release: pypi.Release) -> dict:
    date = (release.upload_time or "1970-01-01T00:00:00") + "+0000"
    who = {"GIT_AUTHOR_NAME": "package index", "GIT_AUTHOR_EMAIL": "releases@coder.invalid"}
    return {**who, "GIT_COMMITTER_NAME": who["GIT_AUTHOR_NAME"],
            "GIT_COMMITTER_EMAIL": who["GIT_AUTHOR_EMAIL"],
            "GIT_AUTHOR_DATE": date, "GIT_COMMITTER_DATE": date}


def mirror_path(repos: str, name: str) -> str:
    return os.path.join(repos, f"pypi__{name}")


def _ensure_mirror(repos: str, name: str) -> str:
    """The bare repository `<repos>/pypi__<name>`, created if missing (made beside it and
    renamed into place, so a concurrent creator never sees half a repository)."""
    dest = mirror_path(repos, name)
    if os.path.isdir(dest):
        return dest
    os.makedirs(repos, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=repos, prefix=f".pypi__{name}-")
    repo_lib.git("init", "-q", "--bare", tmp)
    try:
        os.rename(tmp, dest)
    except OSError:  # another process made it first
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def commit_tree(mirror: str, tree: str, message: str, parent: str = "", env=None,
                base: str = "", files: dict | None = None) -> str:
    """Commit a directory `tree` (or commit `base`'s tree with `files` {path: text} written
    over it) into the bare `mirror` with plumbing, so commits of different runs never stack on
    each other: the same tree, parent, message and dates give the same sha. The commit is kept
    reachable by the ref `refs/coder/<sha>`; no branch moves."""
    with tempfile.TemporaryDirectory() as tmp:
        index = os.path.join(tmp, "index")

        def git(*a, **k):
            return repo_lib.git(f"--git-dir={mirror}", *a, index=index, env=env, **k)

        if base:
            git("read-tree", base)
            for path, text in (files or {}).items():
                blob = git("hash-object", "-w", "--stdin", stdin=text).strip()
                git("update-index", "--add", "--cacheinfo", f"100644,{blob},{path}")
        else:
            repo_lib.git(f"--git-dir={mirror}", f"--work-tree={tree}", "add", "-A", "-f", ".",
                         cwd=tree, index=index)
        tree_sha = git("write-tree").strip()
        sha = git("commit-tree", tree_sha, *(["-p", parent] if parent else []),
                  "-m", message).strip()
        git("update-ref", f"refs/coder/{sha}", sha)
    return sha


def build_mirror(name: str, chain: list[pypi.Release], trees: dict, repos: str) -> dict:
    """Commit each release's source tree, oldest first, as a linear history into the bare
    repository `<repos>/pypi__<name>` (created if missing; earlier runs' commits are kept).
    {version: sha}."""
    mirror = _ensure_mirror(repos, name)
    shas, parent = {}, ""
    for rel in chain:
        parent = commit_tree(mirror, trees[rel.version],
                             f"{name} {rel.version}: the release's sdist ({rel.filename})",
                             parent=parent, env=commit_env(rel))
        shas[rel.version] = parent
    return shas


def _diff(mirror: str, a: str, b: str, paths: list[str]) -> str:
    if not paths:
        return ""
    return repo_lib.git(f"--git-dir={mirror}", "diff", "--no-renames", "--binary", a, b, "--",
                        *paths)


def environment_of(options: Options, tree: str) -> dict:
    if options.environment is not None:
        return options.environment
    reqs = list(options.test_requirements) or [f"pytest=={importlib.metadata.version('pytest')}"]
    for r in pypi.runtime_requirements(tree):
        try:
            req = Requirement(r)
        except InvalidRequirement:
            continue
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            reqs.append(str(req))
    return {"python": {"requirements": reqs}}


def test_command_of(tree: str) -> str:
    # A src layout is not importable from the workspace root; pytest's own `pythonpath` ini
    # option puts src/ first, as the project's installed copy would be.
    if os.path.isdir(os.path.join(tree, "src")):
        return DEFAULT_TEST_COMMAND + " -o pythonpath=src"
    return DEFAULT_TEST_COMMAND


def python_test_files(tree: str) -> list[str]:
    """The Python test files of a source tree (paths relative to it)."""
    out = []
    for dirpath, _, filenames in os.walk(tree):
        for fn in filenames:
            rel = os.path.relpath(os.path.join(dirpath, fn), tree)
            if fn.endswith(".py") and is_test_path(rel):
                out.append(rel)
    return sorted(out)


def added_lines(patch: str, min_chars: int = 24, limit: int = 5) -> list[str]:
    """The `limit` longest lines a unified diff adds (stripped, at least `min_chars`): text
    only the patched code has, what `readable_copies` looks for."""
    added = sorted({ln[1:].strip() for ln in patch.split("\n")
                    if ln.startswith("+") and not ln.startswith("+++")}, key=len, reverse=True)
    return [ln for ln in added if len(ln) >= min_chars][:limit]


def test_statuses(task: Task, patches: list[str], test_files: list[str], limits: Limits,
                  timeout_s: float) -> dict:
    """{node id: status} of the whole test suite in a sandbox of `task` with `patches` applied,
    run with the scoring command. RuntimeError when a patch does not apply or pytest crashed."""
    with Sandbox(task, limits=limits) as sb:
        for patch in patches:
            if patch and (err := apply_patch(sb, patch)):
                raise RuntimeError(f"patch does not apply: {err}")
        # A test file that cannot import on the old release (a new name) errors as a whole;
        # its tests then count as not passing there instead of stopping the run.
        args = [*pytest_args(task.test_command), "--continue-on-collection-errors"]
        res = sb.run(pytest_invocation(args, _REPORT), timeout_s=timeout_s)
        if res.timed_out or res.exit_code not in (0, 1):
            raise RuntimeError(f"pytest exit status {res.exit_code}"
                               f"{' (timed out)' if res.timed_out else ''}: "
                               f"{(res.stdout + res.stderr)[-600:]}")
        try:
            report = sb.read(_REPORT)
        except (FileNotFoundError, ValueError) as e:
            raise RuntimeError(f"no JUnit report (pytest exit status {res.exit_code}: a test "
                               f"ended the run): {(res.stdout + res.stderr)[-400:]}") from e
        return junit_statuses(report.encode(), test_files)


def readable_copies(task: Task, lines: list[str], limits: Limits | None = None) -> list[str]:
    """Files outside the workspace that a sandbox of `task` can read and that hold one of
    `lines` (text only the reference solution has: `added_lines`): an installed or vendored
    copy of the solution's code would hand it to the agent. Searched where such a copy lives:
    paths naming one of the workspace's top-level modules (`find`, ~1 s over the host's /usr)."""
    added = [ln for ln in lines if ln.strip()]
    with Sandbox(task, limits=limits) as sb:
        names = sorted(installed.workspace_modules(sb.list_files()))
        if not added or not names:
            return []
        paths = " -o ".join(f"-path {shlex.quote(f'*/{n}/*')} -o -name {shlex.quote(n + '.py')}"
                            for n in names)
        patterns = " ".join(f"-e {shlex.quote(ln)}" for ln in added)
        res = sb.run(
            "find / \\( -path /proc -o -path /sys -o -path /dev -o -path /workspace \\) -prune "
            f"-o -type f \\( {paths} \\) -print0 2>/dev/null | xargs -0 -r grep -lF {patterns}"
            " 2>/dev/null", timeout_s=300)
    return [p for p in res.stdout.split("\n") if p]


def pair_task(name: str, a: pypi.Release, b: pypi.Release, mirror: str, shas: dict,
              tree_b: str, options: Options) -> tuple[Task, str]:
    """(the task of B's changes over A, its gold patch); ValueError why when B makes none."""
    section = changelog_section(tree_b, b.version)
    if section is None:
        raise ValueError(f"no changelog section for {b.version}")
    changelog_path, text = section
    entries = changelog_entries(text)
    if not entries:
        raise ValueError(f"the changelog section of {b.version} ({changelog_path}) is empty")
    sha_a, sha_b = shas[a.version], shas[b.version]
    changed = repo_lib.git(f"--git-dir={mirror}", "diff", "--no-renames", "--name-only",
                           sha_a, sha_b).split("\n")
    changed = [p for p in changed if p]
    tests = [p for p in changed if is_test_path(p)]
    code = [p for p in changed if not is_test_path(p) and p != changelog_path]
    if not tests or not code:
        raise ValueError(f"{b.version} changes {'no tests' if not tests else 'only tests'}")
    test_patch, gold = _diff(mirror, sha_a, sha_b, tests), _diff(mirror, sha_a, sha_b, code)
    prompt, left_out = terse_prompt(name, a.version, b.version, entries, options.max_prompt_chars)
    stats = repo_lib.patch_stats(gold)
    task = Task(
        id=f"pypi-{name}-{b.version}",
        prompt=prompt,
        files={},
        tests={},
        test_command=test_command_of(tree_b),
        source="releases",
        repo=mirror,
        commit=sha_a,
        metadata={
            "source": "releases",
            "repo": f"pypi/{name}",
            "package": name,
            "from_version": a.version,
            "to_version": b.version,
            "to_commit": sha_b,
            "split": split_of(name, options.heldout_percent),
            "changelog": changelog_path,
            "changelog_entries": len(entries),
            "entries_left_out": left_out,
            "prompt_chars": len(prompt),
            "lines_added": stats["lines_added"],
            "lines_removed": stats["lines_removed"],
            "files_changed": stats["files"],
            "test_files_changed": tests,
        },
        environment=environment_of(options, tree_b),
        test_patch=test_patch,
    )
    return task, gold


def with_test_ids(task: Task, gold: str, tree_b: str, options: Options) -> Task:
    """`task` with FAIL_TO_PASS / PASS_TO_PASS from B's suite run on A and on B in the sandbox;
    ValueError when no test fails on A and passes on B."""
    test_files = python_test_files(tree_b)
    limits = options.limits
    try:
        before = test_statuses(task, [task.test_patch], test_files, limits, options.timeout_s)
        after = test_statuses(task, [task.test_patch, gold], test_files, limits, options.timeout_s)
    except (RuntimeError, SandboxError) as e:
        raise ValueError(f"running the tests: {e}") from e
    f2p = sorted(t for t, s in after.items() if s == "passed" and before.get(t) != "passed")
    p2p = sorted(t for t, s in after.items() if s == "passed" and before.get(t) == "passed")
    if not f2p:
        raise ValueError(f"no test fails on {task.metadata['from_version']} and passes on "
                         f"{task.metadata['to_version']} ({len(after)} tests ran)")
    leaks = readable_copies(task, added_lines(gold), limits)
    if leaks:
        raise ValueError(f"the next release is readable in the sandbox: {leaks[:3]}")
    meta = {**task.metadata, "tests_failing_on_new": sum(s == "failed" for s in after.values())}
    return dataclasses.replace(task, fail_to_pass=tuple(f2p), pass_to_pass=tuple(p2p),
                               metadata=meta)


def parse_spec(spec: str) -> tuple[str, str | None]:
    """"name" (the latest releases) or "name==B" (B's changes over the release before it)."""
    name, _, version = spec.partition("==")
    if not name.strip() or (_ and not version.strip()):
        raise ValueError(f"package {spec!r}: use NAME or NAME==VERSION")
    return canonicalize_name(name.strip()), (version.strip() or None)


def package_tasks(spec: str, repos: str, cache: str = "", pairs: int = 1,
                  options: Options = Options(), index: str = pypi.DEFAULT_INDEX,
                  log=lambda s: None) -> tuple[list[tuple[Task, str]], dict]:
    """(tasks with their gold patches, {dropped release: why}) of one package spec: NAME==B, or
    NAME for its latest `pairs` consecutive release pairs."""
    name, version = parse_spec(spec)
    found = pypi.releases(name, index)
    versions = [r.version for r in found]
    if version is not None:
        if version not in versions:
            raise ValueError(f"{name} has no final sdist release {version!r}: "
                             f"latest {versions[-5:]}")
        targets = [versions.index(version)]
    else:
        targets = list(range(max(1, len(found) - pairs), len(found)))
    if targets[0] < 1:
        raise ValueError(f"{name} {versions[targets[0]]} is its first release: nothing before it")
    chain = found[max(0, targets[0] - 1 - options.history): targets[-1] + 1]
    out, dropped = [], {}
    with tempfile.TemporaryDirectory(prefix=f"coder-releases-{name}-") as work:
        trees = {}
        for rel in chain:
            trees[rel.version] = pypi.unpack(pypi.fetch(rel, cache),
                                             os.path.join(work, rel.version))
        shas = build_mirror(name, chain, trees, repos)
        mirror = mirror_path(repos, name)
        for t in targets:
            a, b = found[t - 1], found[t]
            try:
                task, gold = pair_task(name, a, b, mirror, shas, trees[b.version], options)
                task = with_test_ids(task, gold, trees[b.version], options)
            except ValueError as e:
                dropped[f"{name}=={b.version}"] = str(e)
                log(f"[releases] {name} {a.version} -> {b.version}: dropped: {e}")
                continue
            log(f"[releases] {name} {a.version} -> {b.version}: {len(task.fail_to_pass)} "
                f"FAIL_TO_PASS, {len(task.pass_to_pass)} PASS_TO_PASS, "
                f"+{task.metadata['lines_added']}/-{task.metadata['lines_removed']} lines in "
                f"{len(task.metadata['files_changed'])} files, prompt "
                f"{task.metadata['prompt_chars']} chars")
            out.append((task, gold))
    return out, dropped


def statistics_of(pairs: list[tuple[Task, str]], attempted: int) -> dict:
    """The generated set's figures: tasks per package, verification rate (tasks / release pairs
    tried), median prompt characters, lines and files changed."""
    metas = [t.metadata for t, _ in pairs]
    per = {}
    for m in metas:
        per[m["package"]] = per.get(m["package"], 0) + 1

    def med(xs):
        return statistics.median(xs) if xs else 0

    return {
        "tasks": len(pairs),
        "pairs_tried": attempted,
        "verification_rate": len(pairs) / attempted if attempted else 0.0,
        "tasks_per_package": per,
        "median_prompt_chars": med([m["prompt_chars"] for m in metas]),
        "median_lines_changed": med([m["lines_added"] + m["lines_removed"] for m in metas]),
        "median_files_changed": med([len(m["files_changed"]) for m in metas]),
        "median_fail_to_pass": med([len(t.fail_to_pass) for t, _ in pairs]),
    }
