"""Write generated tasks: `python -m coder.env.make_tasks --source stdlib|toy --n N --seed S
--out F.jsonl [--split train|heldout] [--solutions S.jsonl]`.

stdlib: verified bug-fix tasks from the installed standard library (coder.env.mutate; each
mutant is checked in the sandbox, so this takes a few seconds per task). toy: one-line fixes
(coder.env.tasks.toy_tasks). `--solutions` also writes the reference solutions, the input of
`python -m coder.env.check` and of `coder.env.transcripts`.
"""

from __future__ import annotations

import argparse
import sys

from coder.env import mutate
from coder.env.tasks import toy_tasks, write_solutions, write_tasks


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m coder.env.make_tasks")
    p.add_argument("--source", choices=("stdlib", "toy"), required=True)
    p.add_argument("--n", type=int, required=True, help="number of tasks")
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
    args = p.parse_args(argv)
    if args.source == "toy":
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
