"""SWE-bench's resolution rule, as a pure function of a status map and the two id lists.

`resolve(statuses, fail_to_pass, pass_to_pass)`: `statuses` is {test id: "passed" | "failed" |
"skipped" | "xfailed"} as the task's test format names its tests (coder.env.scoring.runners: a JUnit
report keyed the way the dataset's log parser keys its ids, or a runner's parsed output). The
rule is the `swebench` package's (5.0.2, swebench/harness/grading.py: `get_eval_tests_report`
over `test_passed` / `test_maintained` / `test_failed` and `_resolve_case`):
- an id names the test whose key equals it; failing that, an id with more `[` than `]` (a
  parametrised id cut inside its parameters, as SWE-bench's released lists hold some) names the
  tests whose keys start with it, when they all agree on passing or not (else it names none);
- a FAIL_TO_PASS id passes when its test passed or xfailed; skipped, failed or absent, it did not;
- a PASS_TO_PASS id is maintained when its test passed, xfailed or skipped (a skip is no
  regression); failed or absent, it broke.
The task is resolved when every FAIL_TO_PASS id passes and every PASS_TO_PASS id is maintained
(SWE-bench's ResolvedStatus.FULL); coder.env.scoring.score's modes count the same outcomes.

The package itself is not imported: `import swebench.harness.grading` runs swebench.harness's
`__init__`, which imports docker, modal and datasets (its install pulls 35 packages, pre-commit,
virtualenv and pandas among them). tests/env/scoring/test_grading.py checks this module and the JUnit
keys of coder.env.scoring.runners against the package's parser and grading on the same pytest run when
the package is installed (`pip install -e .[swe]`).
"""

from __future__ import annotations

import dataclasses

PASSING = frozenset({"passed", "xfailed"})
ABSENT = "absent"  # the outcome of an id that names no test of the run


def find(case: str, statuses: dict) -> str | None:
    """The key of `statuses` that id `case` names, or None (SWE-bench's `_resolve_case`)."""
    if case in statuses:
        return case
    if case.count("[") > case.count("]"):
        matches = [k for k in statuses if k.startswith(case)]
        if matches and len({statuses[k] in PASSING for k in matches}) == 1:
            return matches[0]
    return None


def outcome(case: str, statuses: dict) -> str:
    """The status of the test id `case` names, or ABSENT."""
    key = find(case, statuses)
    return ABSENT if key is None else statuses[key]


@dataclasses.dataclass(frozen=True)
class Resolution:
    f2p_passed: int
    f2p_total: int
    p2p_passed: int  # maintained
    p2p_total: int
    failures: dict  # {id that did not pass or broke: its outcome}, in list order

    @property
    def resolved(self) -> bool:
        return self.f2p_passed == self.f2p_total and self.p2p_passed == self.p2p_total

    @property
    def not_passed(self) -> tuple:
        return tuple(self.failures)

    def describe(self, limit: int = 5) -> str:
        """What did not pass, grouped by outcome: 'failed: a, b; absent from the report: c'."""
        groups: dict[str, list[str]] = {}
        for case, out in self.failures.items():
            groups.setdefault(out, []).append(case)
        parts = []
        for out, cases in groups.items():
            shown = ", ".join(cases[:limit]) + (f" (+{len(cases) - limit} more)" if len(cases) > limit else "")
            parts.append(f"{'absent from the report' if out == ABSENT else out}: {shown}")
        return "; ".join(parts)


def resolve(statuses: dict, fail_to_pass, pass_to_pass) -> Resolution:
    """The outcome of each id under SWE-bench's rule (module docstring)."""
    failures = {}
    f2p = p2p = 0
    for case in fail_to_pass:
        out = outcome(case, statuses)
        if out in PASSING:
            f2p += 1
        else:
            failures.setdefault(case, out)
    for case in pass_to_pass:
        out = outcome(case, statuses)
        if out in PASSING or out == "skipped":
            p2p += 1
        else:
            failures.setdefault(case, out)
    return Resolution(f2p, len(fail_to_pass), p2p, len(pass_to_pass), failures)
