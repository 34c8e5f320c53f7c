"""Write generated tasks: `python -m coder.env.make_tasks --source stdlib|toy --n N --seed S
--out F.jsonl [--split train|heldout] [--solutions S.jsonl]`, import SWE-bench-style
instances: `python -m coder.env.make_tasks --source swebench --input I.jsonl --repos DIR
--out T.jsonl [--solutions S.jsonl] [--test-command CMD] [--setup CMD] [--environments E.json]
[--verify]`, or make feature tasks from packages' release history: `python -m
coder.env.make_tasks --source releases --packages NAME[==VERSION],... --repos DIR --out T.jsonl
[--pairs N] [--history K] [--max-prompt-chars C] [--host-python] [--split S] [--verify]`, or bug
tasks by mutation in packages' releases: `python -m coder.env.make_tasks --source mutants
--packages NAME[==VERSION],... --repos DIR --n N [--mutations M] [--seed S] --out T.jsonl`.

stdlib: verified bug-fix tasks from the installed standard library (coder.env.sources.mutate; each
mutant is checked in the sandbox, so this takes a few seconds per task). toy: one-line fixes
(coder.env.tasks.toy_tasks). swebench: repository tasks (task format v2) from SWE-bench,
SWE-Gym, SWE-rebench or SWE-smith instances over local mirrors `DIR/owner__name`
(coder.env.sources.swebench; `--verify` drops the tasks whose gold patch does not score 1, or whose
unchanged workspace does not score 0, in this machine's sandbox, each with its cause, and ends
with a table per repository: rows, imported, verified, dropped by reason; coder.env.sources.verify).
releases: "implement what the next release added" (coder.env.sources.releases): sdists from the package
index, committed as a git history in `DIR/pypi__NAME`, FAIL_TO_PASS / PASS_TO_PASS from the
next release's tests run in the sandbox, a terse prompt from its changelog; the set's figures
(tasks per package, verification rate, medians of prompt characters and lines and files
changed) are printed as one JSON line. mutants: N tasks per package, each with M bugs in as many
of its source files (coder.env.sources.package_mutants; FAIL_TO_PASS the release's passing tests the
bugs break). harbor: Harbor task directories (`DIR...`; Terminal-Bench 2.0's form) whose
environment is a prebuilt image copied as an OCI layout under `--images`, the workspace its working
directory committed under `--repos` (coder.env.sources.harbor; a Dockerfile-only task is skipped with its
reason). `--solutions` also writes
the reference solutions (files, or the gold patches as {"id", "patch"}), the input of
`python -m coder.env.check` and of `coder.env.transcripts`.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from typing import Callable, NamedTuple

import fsspec

from coder.env.sources import harbor, mutate, package_mutants, pypi, releases, swebench, verify
from coder.env.tasks import DEFAULT_TEST_COMMAND, toy_tasks, write_solutions, write_tasks


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m coder.env.make_tasks")
    p.add_argument("--source", choices=tuple(SOURCES), required=True)
    p.add_argument("--n", type=int, help="number of tasks (stdlib, toy; mutants: per package)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="Task JSONL to write")
    p.add_argument(
        "--split",
        choices=("train", "heldout"),
        default=None,
        help="stdlib (default train), releases (default both): modules / packages of this split "
        "only (no module or package is in both)",
    )
    p.add_argument("--modules", default="", help="stdlib: comma-separated modules to draw from")
    p.add_argument("--max-per-module", type=int, default=3, help="stdlib: tasks per module")
    p.add_argument("--solutions", default="", help="also write reference solutions here")
    p.add_argument("--input", default="", help="swebench: instances, JSONL or .parquet")
    p.add_argument("--repos", default="",
                   help="swebench: directory of mirrors owner__name; releases: where to write them")
    p.add_argument("--test-command", default=DEFAULT_TEST_COMMAND,
                   help="swebench: the pytest command of every pytest task (Django and sympy tasks "
                   "run their harness's)")
    p.add_argument("--setup", default="", help="swebench: setup command of every task")
    p.add_argument("--setup-network", action="store_true",
                   help="swebench --verify: setup commands run with the host's network (env.setup_network)")
    p.add_argument(
        "--environments",
        default="",
        help="swebench: JSON file {'owner/name[@version]': environment spec} (Task.environment)",
    )
    p.add_argument(
        "--verify",
        action="store_true",
        help="swebench: keep only tasks whose gold patch scores 1 and unchanged workspace 0 here",
    )
    p.add_argument("--workers", type=int, default=4, help="--verify: sandbox workers")
    p.add_argument("--packages", default="",
                   help="releases: comma-separated NAME (latest --pairs releases) or NAME==VERSION")
    p.add_argument("--pairs", type=int, default=1, help="releases: release pairs per NAME")
    p.add_argument("--history", type=int, default=2,
                   help="releases: earlier releases committed before each task's start")
    p.add_argument("--max-prompt-chars", type=int, default=600, help="releases: prompt length cap")
    p.add_argument("--host-python", action="store_true",
                   help="releases: run tasks with the host interpreter's packages, no venv")
    p.add_argument("--test-requirements", default="",
                   help="releases, mutants: comma-separated requirements that run the tests in "
                   "each task's venv (default: pytest pinned to this interpreter's version)")
    p.add_argument("--index-url", default=pypi.DEFAULT_INDEX,
                   help="releases: the package index's JSON API root")
    p.add_argument("--sdist-cache", default="", help="releases, mutants: sdist cache directory")
    p.add_argument("--mutations", type=int, default=1,
                   help="mutants: bugs per task, each in another source file")
    p.add_argument("dirs", nargs="*", help="harbor: task directories, or directories of them")
    p.add_argument("--images", default="", help="harbor: directory of OCI layouts (skopeo copy)")
    args = p.parse_args(argv)
    source = SOURCES[args.source]
    missing = [flag for flag in source.needs if getattr(args, _dest(flag)) in (None, "", [])]
    if missing:
        p.error(f"--source {args.source} needs {' and '.join(missing)}")
    pairs, expected = source.read(args)
    write_tasks(args.out, [t for t, _ in pairs])
    if args.solutions:
        write_solutions(args.solutions, {t.id: files for t, files in pairs})
    print(f"wrote {len(pairs)} {args.source} tasks to {args.out}", file=sys.stderr)
    return 0 if len(pairs) == expected else 1  # fewer: rows, directories or tasks were skipped


def _dest(flag: str) -> str:
    return "dirs" if flag == "DIR..." else flag[2:].replace("-", "_")


# --- the sources: each reads its flags and returns (task, solution) pairs and how many it meant to
def _log(s: str) -> None:
    print(s, file=sys.stderr, flush=True)


def _verified(pairs, args, rows_per=None, **kw):
    """--verify: the pairs whose gold scores 1 and unchanged workspace 0 here; each drop's cause
    and the table per repository on stderr."""
    if not args.verify:
        return pairs
    imported = [t for t, _ in pairs]
    pairs, dropped = verify.verify(pairs, workers=args.workers, **kw)
    for tid, why in dropped.items():
        _log(f"dropped {tid}: {why}")
    _log(verify.table(imported, dropped, rows_per) if rows_per is not None else verify.table(imported, dropped))
    return pairs


def _skipped(skipped: dict) -> None:
    for where, why in skipped.items():
        _log(f"skipped {where}: {why}")


def _swebench(args):
    specs = {}
    if args.environments:
        with fsspec.open(args.environments, "r", encoding="utf-8") as f:
            specs = json.load(f)
    rows, skipped = swebench.read_instances(args.input), {}
    pairs = swebench.import_instances(rows, args.repos, args.test_command, args.setup, specs, skipped=skipped)
    _skipped(skipped)
    rows_per = collections.Counter(swebench.row_repo(r) for r in rows)
    return _verified(pairs, args, rows_per, setup_network=args.setup_network), len(rows)


def _harbor(args):
    skipped, tried = {}, harbor.task_dirs(args.dirs)
    pairs = harbor.import_dirs(tried, args.images, args.repos, skipped, solutions=bool(args.verify or args.solutions))
    _skipped(skipped)
    timeout = max([float(t.metadata.get("verifier_timeout_sec") or 600) for t, _ in pairs] or [600])
    return _verified(pairs, args, timeout_s=timeout), len(tried)


def _packages(args, mutants: bool):
    options = releases.Options(
        history=args.history, max_prompt_chars=args.max_prompt_chars,
        environment={} if args.host_python else None,
        test_requirements=tuple(r for r in args.test_requirements.split(",") if r),
    )
    pairs, tried, wanted = [], 0, 0
    for spec in [s.strip() for s in args.packages.split(",") if s.strip()]:
        name, _ = releases.parse_spec(spec)
        if args.split and releases.split_of(name) != args.split:
            _log(f"[releases] {name}: skipped, its tasks are in split {releases.split_of(name)!r} "
                 f"(--split {args.split})")
            continue
        if mutants:
            made, dropped = package_mutants.mutant_tasks(
                spec, args.repos, args.n, seed=args.seed, mutations=args.mutations,
                cache=args.sdist_cache, options=options, index=args.index_url, log=_log)
            wanted += args.n
        else:
            made, dropped = releases.package_tasks(
                spec, args.repos, cache=args.sdist_cache, pairs=args.pairs,
                options=options, index=args.index_url, log=_log)
        pairs += made
        tried += len(made) + len(dropped)
    pairs = _verified(pairs, args)
    if not mutants:
        print(json.dumps(releases.statistics_of(pairs, tried)), file=sys.stderr)
    return pairs, wanted or max(len(pairs), 1)  # releases: whatever the history made, not none


def _stdlib(args):
    mods = [m for m in args.modules.split(",") if m] or None
    pairs = mutate.stdlib_tasks(args.n, args.seed, split=args.split or "train", modules=mods,
                                max_per_module=args.max_per_module, log=_log)
    return pairs, args.n


class Source(NamedTuple):
    needs: tuple  # the flags it cannot run without
    read: Callable  # args -> (pairs, the number of tasks it meant to make)


SOURCES = {
    "stdlib": Source(("--n",), _stdlib),
    "toy": Source(("--n",), lambda args: (toy_tasks(args.n, args.seed), args.n)),
    "swebench": Source(("--input", "--repos"), _swebench),
    "harbor": Source(("DIR...", "--repos"), _harbor),
    "releases": Source(("--packages", "--repos"), lambda args: _packages(args, mutants=False)),
    "mutants": Source(("--packages", "--repos", "--n"), lambda args: _packages(args, mutants=True)),
}


if __name__ == "__main__":
    sys.exit(main())
