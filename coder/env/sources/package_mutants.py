"""Bug tasks by mutation in any package with a test suite: the stdlib generator's operators
(coder.env.sources.mutate) over a release from the package index, one or several bugs across files.

For a package release (its sdist, coder.env.sources.pypi):
1. the release is committed into the bare mirror `<repos>/pypi__<name>` (coder.env.sources.releases);
   its test suite runs once in the sandbox with the scoring command: the tests that pass there
   are the candidates;
2. a task draws `mutations` source files (not tests) and one mutation in each (flipped
   comparison, off-by-one, wrong variable, dropped statement, swapped arguments: only code in
   functions), and commits the mutated tree as a root commit of its own: the workspace's
   history holds no unmutated copy to `git diff` against;
3. the suite runs on the mutant: FAIL_TO_PASS = the candidates that no longer pass, PASS_TO_PASS
   = those that still do; a mutant that breaks nothing (equivalent), or whose package does not
   import, makes no task;
4. the reference solution is the original files ({path: text}); a task whose original code is
   readable anywhere in its sandbox (an installed or vendored copy of the same release) is
   dropped (`releases.readable_copies`).
The prompt is a terse bug report: the number of failing tests, one of them by name, and (for
one bug) the function it is in; a multi-file task names only the tests.
"""

from __future__ import annotations

import dataclasses
import os
import random
import tempfile

from coder.env.scoring import grading
from coder.env.sources import mutate, pypi, releases
from coder.env.runtime.sandbox import SandboxError
from coder.env.tasks import Task, content_id

_REPORTS = (
    "{n} tests of {name} fail since a recent change, for example {test}. The bug is around "
    "`{func}` in {file}. Fix it without changing the tests.",
    "Bug report: {test} fails ({n} failing tests in all). Something in `{func}` ({file}) "
    "broke. Please fix the code, not the tests.",
)
_MULTI_REPORTS = (
    "After a bad merge {n} tests of {name} fail, for example {test}. Several places in the "
    "code are wrong. Find and fix them; do not change the tests.",
    "{test} and {more} other tests fail on this checkout of {name}. Fix the code so the test "
    "suite passes again; leave the tests alone.",
)


def source_files(tree: str) -> list[str]:
    """The package's own Python sources in a source tree: not tests, not packaging or docs."""
    out = []
    for dirpath, dirnames, filenames in os.walk(tree):
        rel_dir = os.path.relpath(dirpath, tree)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".")
                             and not (rel_dir == "." and d in ("doc", "docs", "examples")))
        for fn in sorted(filenames):
            rel = os.path.normpath(os.path.join(rel_dir, fn))
            if (fn.endswith(".py") and "/" in rel and not releases.is_test_path(rel)
                    and fn not in ("setup.py", "conftest.py", "noxfile.py")):
                out.append(rel)
    return out


def _read(tree: str, path: str) -> str:
    with open(os.path.join(tree, path), encoding="utf-8") as f:
        return f.read()


def _prompt(rng: random.Random, name: str, sites: list, f2p: list) -> str:
    test = f2p[0]
    if len(sites) == 1:
        path, m = sites[0]
        return rng.choice(_REPORTS).format(n=len(f2p), name=name, test=test, func=m.function,
                                           file=path)
    return rng.choice(_MULTI_REPORTS).format(n=len(f2p), name=name, test=test,
                                             more=len(f2p) - 1)


def mutant_tasks(spec: str, repos: str, n: int, seed: int = 0, mutations: int = 1,
                 cache: str = "", options: releases.Options = releases.Options(),
                 index: str = pypi.DEFAULT_INDEX, tries: int = 0,
                 log=lambda s: None) -> tuple[list[tuple[Task, dict]], dict]:
    """(up to `n` verified tasks with their reference files, {rejected candidate: why}) from
    package spec NAME (its latest release) or NAME==VERSION, each with `mutations` bugs in as
    many files. At most `tries` candidates are run (default 4 n)."""
    if mutations < 1:
        raise ValueError(f"mutations={mutations}: at least 1")
    name, version = releases.parse_spec(spec)
    found = pypi.releases(name, index)
    rel = found[-1] if version is None else next((r for r in found if r.version == version), None)
    if rel is None:
        raise ValueError(f"{name} has no final sdist release {version!r}")
    rng = random.Random(f"{seed}/{name}/{rel.version}")
    out, rejected = [], {}
    with tempfile.TemporaryDirectory(prefix=f"coder-mutants-{name}-") as work:
        tree = pypi.unpack(pypi.fetch(rel, cache), os.path.join(work, rel.version))
        sha = releases.build_mirror(name, [rel], {rel.version: tree}, repos)[rel.version]
        mirror = releases.mirror_path(repos, name)
        sources = source_files(tree)
        if len(sources) < mutations:
            raise ValueError(f"{name} {rel.version}: {len(sources)} source files, "
                             f"{mutations} mutations asked")
        tests = releases.python_test_files(tree)
        base = Task(id=f"pypi-{name}-{rel.version}-original", prompt="", files={}, tests={},
                    test_command=releases.test_command_of(tree), source="mutants", repo=mirror,
                    commit=sha, environment=releases.environment_of(options, tree))
        try:
            original = releases.test_statuses(base, [], tests, options.limits, options.timeout_s)
        except (RuntimeError, SandboxError) as e:
            raise ValueError(f"{name} {rel.version}: its tests do not run here: {e}") from e
        passing = {t for t, s in original.items() if s == "passed"}
        if not passing:
            raise ValueError(f"{name} {rel.version}: no test passes on the release itself")
        log(f"[mutants] {name} {rel.version}: {len(passing)} of {len(original)} tests pass "
            f"on the release; {len(sources)} source files")
        seen = set()
        for attempt in range(tries or 4 * n):
            if len(out) >= n:
                break
            files = rng.sample(sources, mutations)
            sites = []
            for path in files:
                muts = mutate.mutations(_read(tree, path), rng, limit=1)
                if muts:
                    sites.append((path, muts[0]))
            if len(sites) < mutations:
                continue
            mutated = {path: m.source for path, m in sites}
            key = content_id(name, *[mutated[p] for p in sorted(mutated)])
            if key in seen:
                continue
            seen.add(key)
            where = ", ".join(f"{m.op} in {p}:{m.function}" for p, m in sites)
            commit = releases.commit_tree(
                mirror, "", f"{name} {rel.version}", base=sha, files=mutated,
                env=releases.commit_env(rel))
            task = dataclasses.replace(
                base, id=f"pypi-{name}-{rel.version}-mutant-{key}", commit=commit)
            try:
                statuses = releases.test_statuses(task, [], tests, options.limits,
                                                  options.timeout_s)
            except (RuntimeError, SandboxError) as e:
                rejected[where] = f"the suite did not run: {str(e)[:200]}"
                continue
            f2p = sorted(t for t in passing if statuses.get(t) not in grading.PASSING)
            if not f2p:
                rejected[where] = "equivalent: every test still passes"
                continue
            reference = {path: _read(tree, path) for path in mutated}
            # What only the original has: its lines the mutations changed.
            changed = [ln.strip() for p in reference for ln in reference[p].splitlines()
                       if ln.strip() and ln not in set(mutated[p].splitlines())]
            leaks = releases.readable_copies(
                task, [ln for ln in changed if len(ln) >= 8], options.limits)
            if leaks:
                rejected[where] = f"the original is readable in the sandbox: {leaks[:3]}"
                continue
            task = dataclasses.replace(
                task,
                prompt=_prompt(rng, name, sites, f2p),
                fail_to_pass=tuple(f2p),
                pass_to_pass=tuple(sorted(passing - set(f2p))),
                metadata={
                    "source": "mutants",
                    "repo": f"pypi/{name}",
                    "package": name,
                    "version": rel.version,
                    "split": releases.split_of(name, options.heldout_percent),
                    "mutations": [{"file": p, "op": m.op, "function": m.function}
                                  for p, m in sites],
                    "files_changed": sorted(mutated),
                },
            )
            task = dataclasses.replace(task, metadata={**task.metadata,
                                                       "prompt_chars": len(task.prompt)})
            log(f"[mutants] {task.id}: {where}: {len(f2p)} FAIL_TO_PASS")
            out.append((task, reference))
    return out, rejected
