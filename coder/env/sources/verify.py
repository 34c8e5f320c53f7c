"""Verify generated or imported tasks in this machine's sandbox (`make_tasks --verify`): keep a
task whose gold patch scores 1 and whose unchanged workspace scores 0, drop any other with its
cause, and tabulate what came of each repository.

A task whose tests cannot pass here (a missing dependency, a different interpreter) would only
ever teach reward 0, and one that passes unchanged teaches nothing. Every drop names one reason
(`REASONS`) and what shows it: the ids the gold patch left failing or absent from the report
(coder.env.scoring.grading); the tail of the test run's own output when it gave no report or results
(a `ModuleNotFoundError`, a collection error); the sandbox's or environment's error.

`table(...)`, the summary `make_tasks --verify` ends with, one row per repository (the task's
`metadata["repo"]`, the row's `repo` / `repo_name` for rows that did not import):

    repository          rows  imported  verified  gold fails  no results  no apply  no-op passes  env/sandbox
    pvlib/pvlib-python    12        12         9           2           1         0             0            0
    total                 12        12         9           2           1         0             0            0

(`rows` only where rows were read: `--source swebench`; a row that did not import is counted in
`rows` and not in `imported`, its reason printed as `skipped row N (id): why`.)
"""

from __future__ import annotations

import collections
import dataclasses

from coder.env.pool import EpisodePool
from coder.env.scoring.score import score_solution
from coder.env.runtime.sandbox import Limits

REASONS = {
    "gold fails": "the gold patch leaves FAIL_TO_PASS / PASS_TO_PASS ids failed or absent from the report",
    "no results": "the gold patch's test run gave no report or no results (its output's tail is shown)",
    "no apply": "the gold patch does not apply",
    "no-op passes": "the unchanged workspace already scores above 0",
    "env/sandbox": "the environment could not be built or the sandbox failed",
}
_TAIL_LINES = 15


@dataclasses.dataclass(frozen=True)
class Drop:
    reason: str  # a key of REASONS
    detail: str

    def __str__(self) -> str:
        return f"{self.reason}: {self.detail}"


def _tail(output: str) -> str:
    lines = output.rstrip().splitlines()[-_TAIL_LINES:]
    return "\n".join("    | " + line for line in lines) if lines else "    | (no output)"


def why_dropped(gold, noop) -> Drop | None:
    """The Drop of a task whose gold patch scored `gold` (mode all) and whose unchanged workspace
    scored `noop` (mode fraction, None when not run), or None when it is kept."""
    if gold.infra_error:
        return Drop("env/sandbox", f"the gold patch's run: {gold.infra_error}")
    if gold.reward != 1.0:
        if (gold.error or "").startswith("patch does not apply"):
            return Drop("no apply", gold.error)
        if gold.not_passed:
            return Drop("gold fails", f"the gold patch scores {gold.reward:g}: {gold.error}")
        return Drop("no results", f"the gold patch scores {gold.reward:g}: {gold.error}; the test "
                    f"run's output ends:\n{_tail(gold.output)}")
    if noop is None:
        return None
    if noop.infra_error:
        return Drop("env/sandbox", f"the unchanged workspace's run: {noop.infra_error}")
    if noop.reward != 0.0:
        return Drop("no-op passes", f"the unchanged workspace scores {noop.reward:g}"
                    + (f": {noop.error}" if noop.error else ""))
    return None


def _verify_one(item) -> tuple[str, Drop | None]:
    task, gold, timeout_s, setup_network = item
    limits = Limits(timeout_s=timeout_s, cpu_s=int(timeout_s), setup_network=setup_network)
    g = score_solution(task, gold, limits=limits, mode="all", timeout_s=timeout_s)
    drop = why_dropped(g, None)
    if drop is None:  # the gold patch resolves: does the unchanged workspace not?
        drop = why_dropped(g, score_solution(task, {}, limits=limits, mode="fraction", timeout_s=timeout_s))
    return task.id, drop


def verify(pairs: list, workers: int = 4, timeout_s: float = 300.0, setup_network: bool = False
           ) -> tuple[list, dict[str, Drop]]:
    """(the (task, gold) pairs kept, {dropped task id: Drop}); module docstring. `setup_network`:
    the tasks' setup commands run with the host's network (env.setup_network in training)."""
    if not pairs:
        return [], {}
    with EpisodePool(max(1, min(workers, len(pairs))), token_count=len) as pool:
        why = dict(pool.map(_verify_one, [(t, g, timeout_s, setup_network) for t, g in pairs]))
    return [(t, g) for t, g in pairs if why[t.id] is None], {k: v for k, v in why.items() if v}


def repository_of(task) -> str:
    return task.metadata.get("repo") or task.repo or "?"


def table(imported: list, dropped: dict[str, Drop], rows: collections.Counter | None = None) -> str:
    """The per-repository summary (module docstring): `imported` tasks, `dropped` {id: Drop}
    (the others verified), `rows` {repository: rows read} when rows were read (a repository's
    rows that did not import are rows - imported)."""
    per = collections.defaultdict(collections.Counter)
    for task in imported:
        per[repository_of(task)]["imported"] += 1
        per[repository_of(task)][dropped[task.id].reason if task.id in dropped else "verified"] += 1
    for repo, n in (rows or {}).items():
        per[repo]["rows"] = n
    columns = (["rows"] if rows is not None else []) + ["imported", "verified", *REASONS]
    width = max([len("repository"), len("total"), *map(len, per)])
    lines = [f"{'repository':<{width}}  " + "  ".join(columns)]
    total = collections.Counter()
    for repo in sorted(per):
        total.update(per[repo])
        lines.append(f"{repo:<{width}}  " + "  ".join(f"{per[repo][c]:>{len(c)}}" for c in columns))
    lines.append(f"{'total':<{width}}  " + "  ".join(f"{total[c]:>{len(c)}}" for c in columns))
    return "\n".join(lines)
