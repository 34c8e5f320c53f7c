"""Go-to-definition and find-references for the `diagnostics` tool, run by the sandbox's own
Python over /workspace (coder.env.tools.diagnostics passes this file's text to `python -c`).

Self-contained on purpose: inside the sandbox the host's source tree is not mounted, so this
script may import nothing of coder, only the standard library and jedi. It reads one JSON query
from argv[1] and prints one JSON object: `{"groups": [{"at", "total", "names"}, ...]}` (the
locations found from each position asked about: one, or one per definition `at` of a bare
symbol; at most `max` locations in all, `total` counting each group's), or `{"error":
...}` for a question jedi cannot answer (a symbol not on the line, nothing found), or
`{"missing": ...}` when jedi (the module `q["module"]` names) is not installed here. Lines are
1-based, columns 1-based (as mypy and editors count them; jedi's own are 0-based).
"""

import importlib
import json
import os
import re
import sys

ROOT = "/workspace"
CODE_CHARS = 200  # of each location's source line: with `max` locations in all, the answer stays
# far below the sandbox's output cap (a cut answer would not parse)


def _location(name) -> dict:
    path = str(name.module_path) if name.module_path else None
    if path and (path == ROOT or path.startswith(ROOT + "/")):
        path = os.path.relpath(path, ROOT)
    return {
        "path": path,
        "module": name.module_name,
        "line": name.line,
        "column": None if name.column is None else name.column + 1,
        "type": name.type,
        "name": name.name,
        "code": name.get_line_code().strip()[:CODE_CHARS] if name.line else "",
        "definition": name.is_definition(),
    }


def _unique(names) -> list:
    seen, out = set(), []
    for n in names:
        key = (str(n.module_path), n.line, n.column)
        if key not in seen:
            seen.add(key)
            out.append(n)
    return out


def _order(name) -> tuple:
    return str(name.module_path or ""), name.line or 0, name.column or 0


def _in_workspace(name) -> bool:
    return bool(name.module_path) and str(name.module_path).startswith(ROOT + "/")


def _positions(jedi, project, q) -> tuple:
    """The (script, line, column0, definition) the query points at, or an error string;
    `definition` is the location of a bare symbol's definition, None for a position given."""
    path, line, column, symbol = q.get("path"), q.get("line"), q.get("column"), q.get("symbol")
    env = jedi.InterpreterEnvironment()  # this process's interpreter: no helper subprocess
    if path is None or line is None:
        # a bare symbol: the workspace's functions, classes, methods and module or class level
        # names called so (not the locals of some function), each followed through imports to
        # the definition it names
        last = symbol.rsplit(".", 1)[-1]
        found = [
            n
            for n in project.search(symbol, all_scopes=True)
            if n.name == last and _in_workspace(n)
            and (n.type in ("function", "class") or n.parent().type in ("module", "class"))
        ]
        targets = []
        for n in _unique(found):
            script = jedi.Script(path=str(n.module_path), project=project, environment=env)
            targets += [t for t in script.goto(n.line, n.column, follow_imports=True) if _in_workspace(t)]
        out = []
        for t in sorted(_unique(targets), key=_order):
            script = jedi.Script(path=str(t.module_path), project=project, environment=env)
            out.append((script, t.line, t.column, _location(t)))
        return out or f"no definition named {symbol!r} in the workspace"
    full = os.path.join(ROOT, path)
    try:
        with open(full, encoding="utf-8", errors="replace") as f:
            text = f.read().splitlines()
    except OSError as e:
        return f"cannot read {path}: {e.strerror}"
    script = jedi.Script(path=full, project=project, environment=env)
    if line > len(text):
        return f"{path} has {len(text)} lines; line {line} is past the end"
    if column is None:
        m = re.search(r"(?<!\w)" + re.escape(symbol) + r"(?!\w)", text[line - 1])
        if m is None:
            return f"{symbol!r} does not occur on line {line} of {path}"
        column = m.end() - len(symbol.rsplit(".", 1)[-1]) + 1  # a dotted name: its last part
    return [(script, line, column - 1, None)]


def main(q: dict) -> dict:
    try:
        jedi = importlib.import_module(q["module"])  # "jedi"; named by the caller
    except ImportError as e:
        return {"missing": str(e)}
    src = os.path.join(ROOT, "src")  # a src/ layout imports its packages from there (as mypy's
    # MYPYPATH=src does for the checker)
    project = jedi.Project(ROOT, added_sys_path=[src] if os.path.isdir(src) else [])
    where = _positions(jedi, project, q)
    if isinstance(where, str):
        return {"error": where}
    groups = []  # the locations found from each position asked about
    budget = q["max"]  # locations listed in all; the rest are only counted
    for script, line, col, at in where:
        if q["action"] == "definition":
            names = script.goto(line, col, follow_imports=True)
        else:
            names = script.get_references(line, col, include_builtins=False, scope="project")
        names = sorted(_unique(names), key=_order)
        kept = names[: max(budget, 0)]
        budget -= len(kept)
        groups.append({"at": at, "total": len(names), "names": [_location(n) for n in kept]})
    return {"groups": groups}


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
