"""Go-to-definition and find-references for the `diagnostics` tool, run by the sandbox's own
Python over /workspace (coder.env.diagnostics passes this file's text to `python -c`).

Self-contained on purpose: inside the sandbox the host's source tree is not mounted, so this
script may import nothing of coder, only the standard library and jedi. It reads one JSON query
from argv[1] and prints one JSON object: `{"names": [...]}` (each a location), or `{"error":
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
        "code": name.get_line_code().strip() if name.line else "",
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


def _positions(jedi, project, q) -> tuple:
    """The (script, line, column0) triples the query points at, or an error string."""
    path, line, column, symbol = q.get("path"), q.get("line"), q.get("column"), q.get("symbol")
    env = jedi.InterpreterEnvironment()  # this process's interpreter: no helper subprocess
    if path is None or line is None:
        # a bare symbol: its definitions anywhere in the workspace, by name
        last = symbol.rsplit(".", 1)[-1]
        found = [
            n
            for n in project.search(symbol, all_scopes=True)
            if n.name == last and n.module_path and str(n.module_path).startswith(ROOT + "/")
        ]
        out = []
        for n in _unique(found):
            script = jedi.Script(path=str(n.module_path), project=project, environment=env)
            out.append((script, n.line, n.column))
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
    return [(script, line, column - 1)]


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
    names = []
    for script, line, col in where:
        if q["action"] == "definition":
            names += script.goto(line, col, follow_imports=True)
        else:
            names += script.get_references(line, col, include_builtins=False, scope="project")
    return {"names": [_location(n) for n in _unique(names)]}


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
