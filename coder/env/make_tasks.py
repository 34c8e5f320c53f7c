"""Write generated tasks: `python -m coder.env.make_tasks --source stdlib|toy --n N --seed S
--out F.jsonl [--split train|heldout] [--solutions S.jsonl]`, or import SWE-bench-style
instances: `python -m coder.env.make_tasks --source swebench --input I.jsonl --repos DIR
--out T.jsonl [--solutions S.jsonl] [--test-command CMD] [--setup CMD] [--environments E.json]
[--verify]`.

stdlib: verified bug-fix tasks from the installed standard library (coder.env.mutate; each
mutant is checked in the sandbox, so this takes a few seconds per task). toy: one-line fixes
(coder.env.tasks.toy_tasks). swebench: repository tasks (task format v2) from SWE-bench,
SWE-Gym, SWE-rebench or SWE-smith instances over local mirrors `DIR/owner__name`
(coder.env.swebench; `--verify` drops the tasks whose gold patch does not score 1, or whose
unchanged workspace does not score 0, in this machine's sandbox). `--solutions` also writes
the reference solutions (files, or the gold patches as {"id", "patch"}), the input of
`python -m coder.env.check` and of `coder.env.transcripts`.
"""

from __future__ import annotations

import argparse
import json
import sys

import fsspec

from coder.env import mutate, swebench
from coder.env.tasks import DEFAULT_TEST_COMMAND, read_jsonl, toy_tasks, write_solutions
from coder.env.tasks import write_tasks


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m coder.env.make_tasks")
    p.add_argument("--source", choices=("stdlib", "toy", "swebench"), required=True)
    p.add_argument("--n", type=int, help="number of tasks (stdlib, toy)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="Task JSONL to write")
    p.add_argument(
        "--split",
        choices=("train", "heldout"),
        default="train",
        help="stdlib: modules of this split only (no module is in both)",
    )
    p.add_argument("--modules", default="", help="stdlib: comma-separated modules to draw from")
    p.add_argument("--max-per-module", type=int, default=3, help="stdlib: tasks per module")
    p.add_argument("--solutions", default="", help="also write reference solutions here")
    p.add_argument("--input", default="", help="swebench: instances JSONL")
    p.add_argument("--repos", default="", help="swebench: directory of mirrors owner__name")
    p.add_argument(
        "--test-command", default=DEFAULT_TEST_COMMAND, help="swebench: every task's pytest command"
    )
    p.add_argument("--setup", default="", help="swebench: setup command of every task")
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
    p.add_argument("--workers", type=int, default=4, help="swebench --verify: sandbox workers")
    args = p.parse_args(argv)
    if args.source == "swebench":
        if not args.input or not args.repos:
            p.error("--source swebench needs --input and --repos")
        specs = {}
        if args.environments:
            with fsspec.open(args.environments, "r", encoding="utf-8") as f:
                specs = json.load(f)
        pairs = swebench.import_instances(
            read_jsonl(args.input), args.repos, args.test_command, args.setup, specs
        )
        args.n = len(pairs)
        if args.verify:
            pairs, dropped = swebench.verify(pairs, workers=args.workers)
            for tid, why in dropped.items():
                print(f"dropped {tid}: {why}", file=sys.stderr)
    elif args.n is None:
        p.error(f"--source {args.source} needs --n")
    elif args.source == "toy":
        pairs = toy_tasks(args.n, args.seed)
    else:
        mods = [m for m in args.modules.split(",") if m] or None
        pairs = mutate.stdlib_tasks(
            args.n,
            args.seed,
            split=args.split,
            modules=mods,
            max_per_module=args.max_per_module,
            log=lambda s: print(s, file=sys.stderr, flush=True),
        )
    write_tasks(args.out, [t for t, _ in pairs])
    if args.solutions:
        write_solutions(args.solutions, {t.id: files for t, files in pairs})
    print(f"wrote {len(pairs)} {args.source} tasks to {args.out}", file=sys.stderr)
    return 0 if len(pairs) == args.n else 1


if __name__ == "__main__":
    sys.exit(main())
