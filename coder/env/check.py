"""Score given solutions: `python -m coder.env.check --tasks T.jsonl --solutions S.jsonl`.

Each solution (`{"id", "files"}` written over its task's workspace, or `{"id", "patch"}` applied
to it with `git apply`) goes into a fresh sandbox of its task and
the hidden tests are run (coder.env.scoring.score); tasks are scored in parallel worker processes.
Prints one JSON line per task, in task order: {"id", "reward", "passed", "total", "error"}.
`error` is null for a clean run; infrastructure failures are prefixed "infra: ". A task without
a solution is reported with reward 0 and error "no solution".
"""

from __future__ import annotations

import argparse
import json
import sys

from coder.env.pool import EpisodePool
from coder.env.scoring.score import REWARD_MODES, score_solution
from coder.env.runtime.sandbox import Limits
from coder.env.tasks import read_solutions, read_tasks


def _score(item) -> dict:
    task, files, mode, timeout_s, limits = item
    s = score_solution(task, files, limits=limits, mode=mode, timeout_s=timeout_s)
    error = f"infra: {s.infra_error}" if s.infra_error else s.error
    return {"id": task.id, "reward": s.reward, "passed": s.passed, "total": s.total, "error": error}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m coder.env.check", description=__doc__.split("\n")[0]
    )
    p.add_argument("--tasks", required=True, help="Task JSONL")
    p.add_argument(
        "--solutions", required=True, help='solutions JSONL: {"id", "files" | "patch"} per line'
    )
    p.add_argument("--workers", type=int, default=4, help="parallel sandbox worker processes")
    p.add_argument("--mode", choices=sorted(REWARD_MODES), default="fraction", help="reward mode")
    p.add_argument("--timeout", type=float, default=300.0, help="test run wall time per task (s)")
    args = p.parse_args(argv)
    tasks = read_tasks(args.tasks)
    solutions = read_solutions(args.solutions)
    unknown = sorted(set(solutions) - {t.id for t in tasks})
    if unknown:
        print(f"warning: solutions for unknown task ids {unknown[:5]}", file=sys.stderr)
    limits = Limits(timeout_s=args.timeout, cpu_s=int(args.timeout))
    todo = [
        (t, solutions[t.id], args.mode, args.timeout, limits) for t in tasks if t.id in solutions
    ]
    with EpisodePool(max(1, min(args.workers, len(todo) or 1)), token_count=len) as pool:
        scored = {r["id"]: r for r in pool.map(_score, todo)}
    for t in tasks:
        row = scored.get(t.id) or {
            "id": t.id,
            "reward": 0.0,
            "passed": 0,
            "total": 0,
            "error": "no solution",
        }
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
