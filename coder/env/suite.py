"""A CursorBench-like held-out suite: `python -m coder.env.suite --tasks T1.jsonl,T2.jsonl
--out SUITE.jsonl [--noisy N] [--seed S]`.

CursorBench's tasks are what users ask in practice: whole repositories, terse and
underspecified prompts (a median of 390 characters for 181 changed lines), multi-file
features, and bug reports that come with a log full of things that do not matter
(../shared/seeds/002). The suite is made from generated task files:
- held-out repositories only: a task whose `metadata.split` is not "heldout" is left out (the
  release and mutant generators split by package, coder.env.sources.releases.split_of; the stdlib
  generator by module), so no suite repository is a training repository;
- categories (`metadata.category`): "feature" (release tasks: implement what the next release
  added, from its release notes), "bug" (mutants, stdlib bugs, SWE-bench-style instances), and
  "noisy-context": a copy of a bug task whose prompt is a one-line report and a CI log in which
  the failing test's line sits among unrelated warnings, retries and progress output;
- the agent eval (coder.rl.eval) reports pass@k and best-of-K for each category beside the
  totals (`rl.eval_tasks` = the suite file, local or `gs://`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys

from coder.env.tasks import Task, read_tasks, write_tasks

CATEGORIES = ("feature", "bug", "noisy-context")
_BUG_SOURCES = {"mutants", "stdlib", "swebench"}

_NOISE = (
    "{t} WARNING urllib3.connectionpool: Retrying (Retry(total=4, connect=None, read=None)) "
    "after connection broken by 'ReadTimeoutError': /simple/{pkg}/",
    "{t} DEBUG asyncio: Using selector: EpollSelector",
    "{t} INFO  collecting ... {n} items",
    "/usr/lib/python3/dist-packages/{pkg}/__init__.py:{n}: DeprecationWarning: pkg_resources "
    "is deprecated as an API",
    "{t} WARNING py.warnings: ResourceWarning: unclosed file <_io.TextIOWrapper name={n}>",
    "npm WARN deprecated {pkg}@{n}.0.1: this version is no longer supported",
    "{t} INFO  cache hit for layer sha256:{h}",
    "Downloading {pkg}-{n}.2.0-py3-none-any.whl ({n}.4 kB)",
    "{t} WARNING matplotlib.font_manager: findfont: Font family 'Helvetica' not found.",
    "  warnings.warn(\"The default value of `n_init` will change\", FutureWarning)",
    "{t} INFO  worker {n} heartbeat ok",
    "PytestUnraisableExceptionWarning: Exception ignored in: <socket.socket fd={n}>",
)
_PACKAGES = ("requests", "numpy", "setuptools", "jinja2", "lodash", "botocore", "pillow")


def category_of(task) -> str:
    """A task's suite category: its `metadata.category`, else what its source makes it."""
    meta = getattr(task, "metadata", {}) or {}
    if meta.get("category"):
        return str(meta["category"])
    source = meta.get("source") or getattr(task, "source", "")
    if source == "releases":
        return "feature"
    if source in _BUG_SOURCES:
        return "bug"
    return source or "other"


def noisy_log(rng: random.Random, failing: str, lines: int = 120) -> str:
    """A CI log of `lines` lines: unrelated warnings, retries and progress, with the line
    pytest prints for the failing test `failing` somewhere past the first third."""
    out = []
    for i in range(lines):
        t = f"2026-11-{rng.randint(1, 28):02d}T{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:" \
            f"{rng.randint(0, 59):02d}Z"
        out.append(rng.choice(_NOISE).format(t=t, n=rng.randint(2, 999), pkg=rng.choice(_PACKAGES),
                                             h=f"{rng.getrandbits(64):016x}"))
    at = rng.randint(lines // 3, lines - 5)
    out[at:at] = [f"FAILED {failing} - AssertionError", "=" * 20 + " short test summary info " +
                  "=" * 20]
    return "\n".join(out)


def noisy_variant(task: Task, rng: random.Random) -> Task:
    """A copy of bug task `task` whose prompt is a one-line report and a noisy CI log (the
    failing test named only inside it)."""
    if not task.fail_to_pass:
        raise ValueError(f"task {task.id!r}: a noisy-context variant needs FAIL_TO_PASS ids")
    failing = rng.choice(list(task.fail_to_pass))
    prompt = ("CI went red on main after the last merge, log below. Fix whatever broke.\n"
              f"```\n{noisy_log(rng, failing)}\n```")
    meta = {**task.metadata, "category": "noisy-context", "prompt_chars": len(prompt),
            "noisy_of": task.id}
    return dataclasses.replace(task, id=f"{task.id}-noisy", prompt=prompt, metadata=meta)


def build_suite(tasks: list[Task], noisy: int = 0, seed: int = 0) -> tuple[list[Task], dict]:
    """(the suite, {task id: why it was left out}): held-out tasks with their category set,
    plus `noisy` noisy-context variants of held-out bug tasks."""
    rng = random.Random(seed)
    kept, left_out = [], {}
    for t in tasks:
        split = (t.metadata or {}).get("split")
        if split != "heldout":
            left_out[t.id] = f"split {split!r}: the suite holds held-out repositories only"
            continue
        kept.append(dataclasses.replace(t, metadata={**t.metadata, "category": category_of(t)}))
    bugs = [t for t in kept if t.metadata["category"] == "bug" and t.fail_to_pass]
    if noisy > len(bugs):
        raise ValueError(f"--noisy {noisy}: only {len(bugs)} held-out bug tasks with "
                         "FAIL_TO_PASS ids to make them from")
    kept += [noisy_variant(t, rng) for t in rng.sample(bugs, noisy)]
    return kept, left_out


def suite_statistics(suite: list[Task]) -> dict:
    """Per category: tasks, median prompt characters, median lines and files changed."""
    out = {}
    for cat in sorted({t.metadata["category"] for t in suite}):
        ts = [t for t in suite if t.metadata["category"] == cat]
        lines = [t.metadata.get("lines_added", 0) + t.metadata.get("lines_removed", 0) for t in ts
                 if "lines_added" in t.metadata]
        files = [len(t.metadata.get("files_changed", ())) for t in ts]
        out[cat] = {"tasks": len(ts),
                    "median_prompt_chars": statistics.median(len(t.prompt) for t in ts),
                    "median_lines_changed": statistics.median(lines) if lines else None,
                    "median_files_changed": statistics.median(files) if files else None}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m coder.env.suite")
    p.add_argument("--tasks", required=True, help="comma-separated task JSONL paths or URLs")
    p.add_argument("--out", required=True, help="the suite's task JSONL (a path or URL)")
    p.add_argument("--noisy", type=int, default=0, help="noisy-context variants of bug tasks")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    tasks = [t for path in args.tasks.split(",") if path for t in read_tasks(path)]
    suite, left_out = build_suite(tasks, args.noisy, args.seed)
    if not suite:
        print(f"no held-out task among {len(tasks)}: nothing to write", file=sys.stderr)
        return 1
    write_tasks(args.out, suite)
    print(json.dumps({"tasks": len(suite), "left_out": len(left_out),
                      "categories": suite_statistics(suite)}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
