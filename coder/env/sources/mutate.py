"""Repository bug-fix tasks from the installed Python standard library (SWE-smith style).

A task is a pure-Python stdlib module `M.py` with one injected bug, next to CPython's own
regression tests `test_M.py` (from `Lib/test`), both at the workspace root so the workspace copy
shadows the installed module (pytest puts the test file's directory first on sys.path, and
CPython's tests import a fresh copy of the module under test). The hidden tests are that same
test file; the reference solution is the original module.

Mutation operators (on `ast`, spliced back into the source text so the rest of the file keeps
its formatting and comments): flipped comparison (< <=, > >=, == !=, is / is not, in / not in),
off-by-one (integer constants in comparisons, arithmetic, subscripts and range()), wrong
variable (a local name replaced by another local of the same function), dropped statement,
swapped arguments (first two positional arguments of a call). Only code inside functions is
mutated, so the bug report can name the function.

A mutant is kept only if the module still imports and its own tests fail, checked in the
sandbox at generation time; the module's tests must first pass on the original (and run in
`max_test_s`). Tasks are reproducible from the seed, deduplicated by mutated source, and each
module belongs to exactly one split (train / heldout) by a hash of its name
(coder.data.corpus.task_module_split). The pretraining corpus holds the files of the held-out
modules (`M.py`, `test/test_M.py`) out of its train split, so held-out tasks are not pretrained on.

The reference solution is the installed module, so the task's sandbox shows the mutant over
every installed copy of M (coder.env.runtime.sandbox); modules frozen into the interpreter (os,
posixpath, ...) make no tasks, since their original code cannot be hidden.
"""

from __future__ import annotations

import _imp
import ast
import dataclasses
import functools
import os
import random
import shlex
import sys
import sysconfig
import time

from coder.data import corpus
from coder.env.scoring.score import score
from coder.env.runtime.sandbox import Limits, Sandbox
from coder.env.tasks import DEFAULT_TEST_COMMAND, Task, content_id

STDLIB = sysconfig.get_paths()["stdlib"]
# Network, terminals, GUIs, whole-interpreter tools and very slow suites: not bug-fix material.
EXCLUDE = frozenset(
    "_osx_support aifc asynchat asyncore cgi cgitb compileall crypt doctest ftplib getpass "
    "imaplib imp mailbox nntplib pickle poplib pdb profile pstats pty pydoc smtpd smtplib "
    "socketserver ssl telnetlib trace tracemalloc tty turtle webbrowser zipapp sysconfig "
    "modulefinder pkgutil symtable idlelib tarfile hashlib rlcompleter".split()
)
OPERATORS = ("flip_comparison", "off_by_one", "wrong_variable", "drop_statement", "swap_arguments")
_FLIP = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
}


@dataclasses.dataclass(frozen=True)
class Mutation:
    op: str
    function: str  # qualified name of the enclosing function
    source: str  # the whole mutated module


def candidate_modules() -> list[str]:
    """Top-level pure-Python stdlib modules that have a CPython test file `test_M.py`."""
    out = []
    for name in sorted(os.listdir(STDLIB)):
        mod = name[:-3]
        if (
            name.endswith(".py")
            and not mod.startswith("_")
            and mod not in EXCLUDE
            and os.path.isfile(os.path.join(STDLIB, "test", f"test_{mod}.py"))
        ):
            out.append(mod)
    return out


@functools.lru_cache(maxsize=4)
def pytest_preloaded(limits: Limits | None = None) -> frozenset:
    """Modules already imported when pytest runs a test in the sandbox: a test's `import M`
    then gets the installed M, not the workspace copy, so M is useless unless its tests import
    a fresh copy (`import_fresh_module`)."""
    probe = Task(
        id="probe",
        prompt="",
        files={
            "test_probe.py": (
                "import sys\n\ndef test_probe():\n    print('MODS', ' '.join(sorted(sys.modules)))\n"
            )
        },
        tests={},
    )
    with Sandbox(probe, limits=limits) as sb:
        r = sb.run("python -I -m pytest -q -s test_probe.py", timeout_s=60)
    line = next((ln for ln in r.stdout.splitlines() if "MODS " in ln), None)
    if line is None:
        raise RuntimeError(f"could not list pytest's modules: {r.stdout[-500:]}{r.stderr[-500:]}")
    return frozenset(line.split("MODS ", 1)[1].split())


def usable(module: str, preloaded: frozenset) -> bool:
    if _imp.is_frozen(module) or module in sys.builtin_module_names:
        # Its original code is compiled into the interpreter (`_imp.get_frozen_object`): a
        # sandbox cannot hide it, so the task would hand out its own solution.
        return False
    if module not in preloaded:
        return True
    test_src = module_files(module)[1]
    return (
        f"import_fresh_module('{module}'" in test_src
        or f'import_fresh_module("{module}"' in test_src
    )


def split_of(module: str, heldout_percent: int = corpus.TASK_HELDOUT_PERCENT) -> str:
    """'train' or 'heldout', fixed per module (independent of any seed); the pretraining corpus
    holds the held-out modules' files out of its train split (coder.data.corpus)."""
    return corpus.task_module_split(module, heldout_percent)


# ---- mutation ---------------------------------------------------------------------------------
class _Source:
    """Byte-offset splicing of an ast node's span (ast col offsets are UTF-8 byte offsets)."""

    def __init__(self, text: str):
        self.text, self.data = text, text.encode()
        self.starts = [0]
        for line in self.data.splitlines(keepends=True):
            self.starts.append(self.starts[-1] + len(line))

    def span(self, node) -> tuple[int, int]:
        return (
            self.starts[node.lineno - 1] + node.col_offset,
            self.starts[node.end_lineno - 1] + node.end_col_offset,
        )

    def segment(self, node) -> str:
        a, b = self.span(node)
        return self.data[a:b].decode()

    def splice(self, edits: list[tuple[int, int, str]]) -> str:
        data = self.data
        for a, b, new in sorted(edits, reverse=True):
            data = data[:a] + new.encode() + data[b:]
        return data.decode()


def _functions(tree):
    """(qualified name, FunctionDef) for every function, methods as Class.method."""

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield prefix + child.name, child
                yield from walk(child, prefix + child.name + ".")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, prefix + child.name + ".")

    yield from walk(tree, "")


def _own_nodes(fn):
    """Nodes of `fn`'s body, not descending into nested functions or classes."""
    stack = list(fn.body)
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if not isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)
            ):
                stack.append(child)


def mutations(source: str, rng: random.Random, limit: int | None = None) -> list[Mutation]:
    """Single-site mutants of `source` that still parse: all candidate sites in a shuffled
    order (`rng`), materialised lazily, at most `limit` of them."""
    src = _Source(source)
    sites = _sites(src, ast.parse(source), rng)
    rng.shuffle(sites)
    out = []
    for op, fname, edits in sites:
        if limit is not None and len(out) >= limit:
            break
        new = src.splice(edits)
        if new == source:
            continue
        try:
            ast.parse(new)
        except SyntaxError:
            continue
        out.append(Mutation(op, fname, new))
    return out


def _sites(src: "_Source", tree, rng: random.Random) -> list[tuple]:
    """(operator, function, edits) for every mutation site; edits are byte-range splices."""
    out = []

    def add(op, fname, edits):
        out.append((op, fname, edits))

    for fname, fn in _functions(tree):
        nodes = list(_own_nodes(fn))
        parents = {}
        for node in nodes:
            for child in ast.iter_child_nodes(node):
                parents[id(child)] = node
        local = sorted(
            {a.arg for a in fn.args.args + fn.args.kwonlyargs if a.arg not in ("self", "cls")}
            | {n.id for n in nodes if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        )
        for node in nodes:
            if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _FLIP:
                new = ast.Compare(node.left, [_FLIP[type(node.ops[0])]()], node.comparators)
                a, b = src.span(node)
                add("flip_comparison", fname, [(a, b, ast.unparse(new))])
            elif (
                isinstance(node, ast.Constant)
                and type(node.value) is int
                and isinstance(
                    parents.get(id(node)), (ast.Compare, ast.BinOp, ast.Subscript, ast.Slice)
                )
                or isinstance(node, ast.Constant)
                and type(node.value) is int
                and isinstance(parents.get(id(node)), ast.Call)
                and isinstance(parents[id(node)].func, ast.Name)
                and parents[id(node)].func.id == "range"
            ):
                delta = 1 if node.value == 0 or rng.random() < 0.5 else -1
                a, b = src.span(node)
                add("off_by_one", fname, [(a, b, str(node.value + delta))])
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in local:
                others = [v for v in local if v != node.id]
                if others:
                    a, b = src.span(node)
                    add("wrong_variable", fname, [(a, b, rng.choice(others))])
            elif (
                isinstance(node, ast.Call)
                and len(node.args) >= 2
                and not any(isinstance(x, ast.Starred) for x in node.args[:2])
            ):
                x, y = node.args[0], node.args[1]
                if src.segment(x) != src.segment(y):
                    (a1, b1), (a2, b2) = src.span(x), src.span(y)
                    add(
                        "swap_arguments",
                        fname,
                        [(a1, b1, src.segment(y)), (a2, b2, src.segment(x))],
                    )
        for block in [fn.body] + [
            getattr(n, f)
            for n in nodes
            for f in ("body", "orelse", "finalbody")
            if isinstance(getattr(n, f, None), list)
        ]:
            for stmt in block:
                if not isinstance(
                    stmt, (ast.Expr, ast.Assign, ast.AugAssign, ast.Return, ast.Raise)
                ):
                    continue
                if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
                    continue  # docstrings and bare constants change nothing
                a, b = src.span(stmt)
                line_a = src.starts[stmt.lineno - 1]
                line_b = src.starts[stmt.end_lineno]
                if src.data[line_a:a].strip() or src.data[b:line_b].strip():
                    continue  # shares its line with other code
                indent = src.data[line_a:a].decode()
                repl = "" if len(block) > 1 else f"{indent}pass\n"
                add("drop_statement", fname, [(line_a, line_b, repl)])
    return out


# ---- tasks ------------------------------------------------------------------------------------
def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def module_files(module: str) -> tuple[str, str]:
    return _read(os.path.join(STDLIB, f"{module}.py")), _read(
        os.path.join(STDLIB, "test", f"test_{module}.py")
    )


def _task(
    module: str,
    module_src: str,
    test_src: str,
    prompt: str,
    tid: str,
    test_command: str = DEFAULT_TEST_COMMAND,
) -> Task:
    test_path = f"test_{module}.py"
    return Task(
        id=tid,
        prompt=prompt,
        files={f"{module}.py": module_src, test_path: test_src},
        tests={test_path: test_src},
        test_command=test_command,
        source="stdlib",
    )


_REPORTS = (
    "`{func}` in {module}.py misbehaves after a recent change; {test} now fails ({n} failing "
    "test(s) in test_{module}.py). Find and fix the bug in {module}.py without changing the tests.",
    "Bug: {module}.{func} returns wrong results. The regression test {test} fails, and {n} "
    "test(s) of test_{module}.py fail in total. Fix {module}.py; do not edit the tests.",
    "test_{module}.py is failing ({n} test(s), e.g. {test}). The culprit is in {module}.py, "
    "somewhere around `{func}`. Make the tests pass again by fixing the module.",
)


def _check(task: Task, module: str, limits: Limits, timeout_s: float):
    """(importable, Score) of the task's workspace as shipped."""
    with Sandbox(task, limits=limits) as sb:
        imp = sb.run(
            f"python -I -c 'import sys; sys.path.insert(0, \"\"); import {module}'", timeout_s=30
        )
        return imp.exit_code == 0, score(sb, task, mode="all", timeout_s=timeout_s)


def stdlib_tasks(
    n: int,
    seed: int,
    split: str = "train",
    modules: list[str] | None = None,
    max_per_module: int = 3,
    tries_per_module: int = 12,
    max_test_s: float = 10.0,
    max_deselect: int = 40,
    limits: Limits | None = None,
    log=None,
) -> list[tuple[Task, dict]]:
    """Up to `n` verified bug-fix tasks with reference solutions ({path: original text})."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split {split!r}: use 'train' or 'heldout'")
    rng = random.Random(seed)
    limits = limits or Limits(timeout_s=max_test_s * 3, cpu_s=int(max_test_s * 3))
    preloaded = pytest_preloaded(limits)
    mods = [
        m for m in (modules or candidate_modules()) if split_of(m) == split and usable(m, preloaded)
    ]
    rng.shuffle(mods)
    out, seen = [], set()
    for module in mods:
        if len(out) >= n:
            break
        original, test_src = module_files(module)
        t0 = time.monotonic()
        ok, base = _check(
            _task(module, original, test_src, "", "baseline"), module, limits, max_test_s * 3
        )
        took = time.monotonic() - t0
        # Tests the original does not pass (platform skips, resources) are deselected in the
        # task's own test command, so the reference solution scores 1.
        command = DEFAULT_TEST_COMMAND + "".join(
            f" --deselect {shlex.quote(t)}" for t in base.not_passed
        )
        why = (
            "not importable"
            if not ok
            else base.infra_error
            or ("fewer than 3 passing tests" if base.total - len(base.not_passed) < 3 else "")
            or (
                f"{len(base.not_passed)} tests to deselect"
                if len(base.not_passed) > max_deselect
                else ""
            )
            or (f"tests take {took:.1f} s" if took > max_test_s else "")
        )
        if why:
            if log:
                log(f"skip {module}: {why} (original passes {base.passed}/{base.total})")
            continue
        if base.not_passed:  # confirm the deselection makes the original pass cleanly
            ok, base = _check(
                _task(module, original, test_src, "", "baseline", command),
                module,
                limits,
                max_test_s * 3,
            )
            if not ok or base.reward < 1.0:
                if log:
                    log(f"skip {module}: deselecting {len(base.not_passed)} tests did not help")
                continue
        muts = mutations(original, random.Random(f"{seed}/{module}"), limit=tries_per_module)
        kept = 0
        for m in muts:
            if kept >= max_per_module or len(out) >= n:
                break
            key = content_id(module, m.source)
            if key in seen:
                continue
            seen.add(key)
            probe = _task(module, m.source, test_src, "", f"stdlib/{module}/{key}", command)
            importable, s = _check(probe, module, limits, max_test_s * 3)
            if not importable or s.infra_error or s.reward >= 1.0 or s.total == 0:
                if log:  # equivalent mutant, crash of the whole suite, or harness trouble
                    log(
                        f"reject {m.op} in {module}.{m.function}: importable={importable}, "
                        f"{s.passed}/{s.total} pass {s.infra_error or ''}"
                    )
                continue
            test = s.not_passed[0].split("::", 1)[1].replace("::", ".")
            prompt = rng.choice(_REPORTS).format(
                func=m.function, module=module, test=test, n=s.total - s.passed
            )
            out.append((dataclasses.replace(probe, prompt=prompt), {f"{module}.py": original}))
            kept += 1
            if log:
                log(f"task {probe.id}: {m.op} in {m.function}, {s.total - s.passed}/{s.total} fail")
    return out
