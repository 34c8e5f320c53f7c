"""Tasks and solutions: the JSONL formats of docs/contracts.md ("Task"), and the toy task source.

Task line (v1): {"id", "prompt", "files": {path: text}, "tests": {path: text}, "test_command",
"language", "source"}. `files` is the repository the agent starts from (it may hold visible
tests); `tests` are the scoring tests, copied over whatever is there only at scoring.
Task line (v2, a repository snapshot): the same keys plus `repo` and `commit` (the workspace is
that commit's tree, `coder.env.sources.repo`; `files` and `tests` are then optional and written over
it), `setup` (shell run once in the sandbox after checkout), `fail_to_pass` / `pass_to_pass`
(test ids that decide the reward), `test_patch` (a hidden unified diff applied only at scoring),
`test_format` (how the command reports each test: pytest, go, tap; coder.env.scoring.runners) and
`metadata` (free-form: source, repository name, size of the reference change, ...).
Any task may name an `environment` (a Python venv spec, `coder.env.runtime.environments`): its
sandboxes then run that venv's interpreter and packages instead of the host's.
Solution line: {"id", "files": {path: text}} (files written over the task's files) or
{"id", "patch": unified diff} (applied to the workspace with `git apply`).

Files are local paths or fsspec URLs (`gs://...`, `s3://...`, `memory://...`): every read, write
and glob here goes through fsspec (`glob_files` keeps a URL's protocol in the paths it returns).

Sources: JSONL files (`read_tasks`), the stdlib bug-fix generator (`coder.env.sources.mutate`), and
`toy_tasks` below: one-line fixes a tiny model can learn, for RL smoke tests.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random

import fsspec

from coder.env.runtime import environments
from coder.env.scoring import runners

DEFAULT_TEST_COMMAND = "python -m pytest -q"


# v2 keys and their defaults; `to_json` leaves them out at these values, so a v1 task's line is
# exactly what it was.
_V2 = {
    "repo": "",
    "commit": "",
    "setup": "",
    "fail_to_pass": (),
    "pass_to_pass": (),
    "test_patch": "",
    "metadata": {},
    "environment": {},
    "test_format": "",
}


@dataclasses.dataclass(frozen=True)
class Task:
    id: str
    prompt: str
    files: dict  # path -> text: the workspace the agent starts from (over `repo`'s tree, if any)
    tests: dict  # path -> text: hidden scoring tests
    test_command: str = DEFAULT_TEST_COMMAND
    language: str = "python"
    source: str = "jsonl"
    # ---- v2: a repository snapshot (docs/contracts.md, "Task") ----
    repo: str = ""  # local path, file:// or git URL, or an archive (.tar.gz / .zip; fsspec URL)
    commit: str = ""  # the workspace is this commit's tree (required with `repo`)
    setup: str = ""  # bash run once in the sandbox after checkout, before the agent starts
    fail_to_pass: tuple = ()  # test ids (pytest node ids) that must pass
    pass_to_pass: tuple = ()  # test ids that passed before and must still pass
    test_patch: str = ""  # unified diff of hidden tests: applied at scoring only
    metadata: dict = dataclasses.field(default_factory=dict)
    # {"python": {"requirements": [...], ...}}: the venv every sandbox of the task runs in
    # (coder.env.runtime.environments); {} = the host interpreter's packages, as for a v1 task
    environment: dict = dataclasses.field(default_factory=dict)
    # how the test command reports each test: "pytest" | "go" | "tap" (coder.env.scoring.runners);
    # "" = inferred from test_command
    test_format: str = ""

    @property
    def test_ids(self) -> tuple:
        return tuple(self.fail_to_pass) + tuple(self.pass_to_pass)

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        for key, default in _V2.items():
            if out[key] == default or (isinstance(default, tuple) and not out[key]):
                del out[key]
            elif isinstance(default, tuple):
                out[key] = list(out[key])
        return out

    @classmethod
    def from_json(cls, obj: dict) -> "Task":
        tid = obj.get("id", "?")
        v2 = bool(obj.get("repo"))
        required = ("id", "prompt") if v2 else ("id", "prompt", "files", "tests")
        missing = [k for k in required if k not in obj]
        if missing:
            raise ValueError(f"task {tid!r} lacks keys {missing}")
        unknown = set(obj) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"task {tid!r} has unknown keys {sorted(unknown)}")
        obj = {"files": {}, "tests": {}, **obj}
        for key in ("files", "tests"):
            if not isinstance(obj[key], dict) or not all(
                isinstance(p, str) and isinstance(t, str) for p, t in obj[key].items()
            ):
                raise ValueError(f"task {tid!r}: {key} must map paths to text")
        if obj.get("test_format", "") not in ("", *runners.FORMATS):
            raise ValueError(f"task {tid!r}: test_format {obj['test_format']!r}: use one of "
                             f"{list(runners.FORMATS)} (or leave it out)")
        for key in ("repo", "commit", "setup", "test_patch"):
            if not isinstance(obj.get(key, ""), str):
                raise ValueError(f"task {tid!r}: {key} must be a string")
        for key in ("fail_to_pass", "pass_to_pass"):
            ids = obj.get(key, ())
            if not isinstance(ids, (list, tuple)) or not all(isinstance(i, str) for i in ids):
                raise ValueError(f"task {tid!r}: {key} must be a list of test ids")
            obj[key] = tuple(ids)
        if not isinstance(obj.get("metadata", {}), dict):
            raise ValueError(f"task {tid!r}: metadata must be an object")
        obj["environment"] = environments.normalize(
            obj.get("environment"), f"task {tid!r}: environment"
        )
        if v2 and not obj.get("commit"):
            raise ValueError(f"task {tid!r}: repo needs a commit")
        if not v2 and any(obj.get(k) for k in ("commit", "setup", "test_patch")):
            raise ValueError(f"task {tid!r}: commit, setup and test_patch need a repo")
        return cls(**{**obj, "test_command": obj.get("test_command") or DEFAULT_TEST_COMMAND})


def glob_files(pattern) -> list[str]:
    """The files `pattern` (a path or glob: local, or an fsspec URL) names, sorted; [] when none.

    A URL's matches keep its protocol (`gs://b/t/*.jsonl` -> `gs://b/t/a.jsonl`, ...: `fs.glob`
    drops it), a local pattern's are local paths. Directories are left out."""
    pattern = os.fspath(pattern)
    fs, path = fsspec.core.url_to_fs(pattern)
    found = fs.glob(path, detail=True)
    files = [p for p, info in found.items() if info.get("type") != "directory"]
    return sorted(fs.unstrip_protocol(p) if "://" in pattern else p for p in files)


def read_jsonl(path) -> list[dict]:
    """The objects of a JSONL file (a local path or fsspec URL); blank lines are skipped."""
    with fsspec.open(os.fspath(path), "r", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_jsonl(path, rows: list[dict]) -> None:
    """One JSON object a line (UTF-8) to a local path or fsspec URL. A local file's directory
    must exist (as with `open`; object stores have none to make)."""
    with fsspec.open(os.fspath(path), "w", encoding="utf-8", auto_mkdir=False) as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def read_tasks(path: str) -> list[Task]:
    tasks = [Task.from_json(o) for o in read_jsonl(path)]
    ids = [t.id for t in tasks]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: duplicate task ids")
    return tasks


def write_tasks(path: str, tasks: list[Task]) -> None:
    write_jsonl(path, [t.to_json() for t in tasks])


def read_solutions(path: str) -> dict[str, dict | str]:
    """{task id: {path: text}, or a unified diff (str) for a `patch` solution}."""
    out = {}
    for o in read_jsonl(path):
        if "patch" in o and "files" not in o:
            if not isinstance(o["patch"], str):
                raise ValueError(f"solution {o.get('id')!r}: patch must be a unified diff")
            out[o["id"]] = o["patch"]
            continue
        if not isinstance(o.get("files"), dict):
            raise ValueError(
                f"solution {o.get('id')!r}: needs files (a map of paths to text) or patch"
            )
        out[o["id"]] = o["files"]
    return out


def write_solutions(path: str, solutions: dict[str, dict | str]) -> None:
    """Files solutions as {"id", "files"}, patch solutions (str) as {"id", "patch"}."""
    write_jsonl(
        path,
        [{"id": k, "patch" if isinstance(v, str) else "files": v} for k, v in solutions.items()],
    )


def content_id(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:12]


# ---- toy tasks -------------------------------------------------------------------------------
# Each template: (prompt, buggy answer.py, fixed answer.py, test body), formatted with `k`.
_TOY = {
    "const": (
        "Make `f()` in answer.py return {k}.",
        "def f():\n    return 0\n",
        "def f():\n    return {k}\n",
        "def test_f():\n    assert f() == {k}\n",
    ),
    "add": (
        "`add(a, b)` in answer.py should return a + b plus {k}; it does not.",
        "def add(a, b):\n    return a - b\n",
        "def add(a, b):\n    return a + b + {k}\n",
        "def test_add():\n    assert add(2, 3) == 5 + {k}\n    assert add(-1, 1) == {k}\n",
    ),
    "scale": (
        "`scale(x)` in answer.py should multiply x by {k}.",
        "def scale(x):\n    return x + 1\n",  # not `x`: with k = 1 that would pass unfixed
        "def scale(x):\n    return x * {k}\n",
        "def test_scale():\n    assert scale(3) == 3 * {k}\n    assert scale(0) == 0\n",
    ),
    "last": (
        "`pick(xs)` in answer.py should return the item at index {k} from the end "
        "(pick([..., a]) is a when {k} == 1).",
        "def pick(xs):\n    return xs[0]\n",
        "def pick(xs):\n    return xs[-{k}]\n",
        "def test_pick():\n    xs = list(range(100, 120))\n    assert pick(xs) == xs[-{k}]\n",
    ),
    "greet": (
        "`greet(name)` in answer.py should return 'Hello, NAME' followed by {k} exclamation marks.",
        "def greet(name):\n    return 'Hello ' + name\n",
        "def greet(name):\n    return 'Hello, ' + name + '!' * {k}\n",
        "def test_greet():\n    assert greet('Ada') == 'Hello, Ada' + '!' * {k}\n",
    ),
}


# The same tasks with the number the tests check left out of the prompt: underspecified, as a
# user's request often is. The full prompt is the hidden specification the simulated user
# answers from (the `ask_user` tool, coder/env/tools/registry.py).
_TOY_VAGUE = {
    "const": "`f()` in answer.py returns the wrong constant; fix it.",
    "add": "`add(a, b)` in answer.py should return a + b plus a fixed offset; it does not.",
    "scale": "`scale(x)` in answer.py should multiply x by a fixed factor.",
    "last": "`pick(xs)` in answer.py should return an item counted from the end of xs.",
    "greet": "`greet(name)` in answer.py should return 'Hello, NAME' followed by some exclamation marks.",
}


def toy_tasks(n: int, seed: int, underspecified: float = 0.0) -> list[tuple[Task, dict]]:
    """`n` distinct toy tasks with their reference solutions ({path: text}), from `seed`.

    `underspecified`: the share of tasks (each drawn from the seed and the task) whose prompt
    leaves out the number the tests check (`_TOY_VAGUE`); their `metadata` holds
    `underspecified: True` and the full prompt as `specification`, what the simulated user
    answers with. The other tasks' metadata says `underspecified: False` when the share is > 0."""
    rng = random.Random(seed)
    out, seen = [], set()
    kinds = sorted(_TOY)
    if n > len(kinds) * 9:
        raise ValueError(f"at most {len(kinds) * 9} distinct toy tasks exist")
    while len(out) < n:
        kind, k = rng.choice(kinds), rng.randint(1, 9)
        if (kind, k) in seen:
            continue
        seen.add((kind, k))
        prompt, buggy, fixed, test = (s.format(k=k) for s in _TOY[kind])
        names = {"const": "f", "add": "add", "scale": "scale", "last": "pick", "greet": "greet"}
        test_file = f"from answer import {names[kind]}\n\n\n{test}"
        meta = {}
        if underspecified > 0:
            vague = random.Random(f"{seed}/vague/{kind}/{k}").random() < underspecified
            meta = {"underspecified": vague, **({"specification": prompt} if vague else {})}
            prompt = _TOY_VAGUE[kind] if vague else prompt
        task = Task(
            id=f"toy/{kind}/{k}" + ("/vague" if meta.get("underspecified") else ""),
            prompt=prompt,
            files={"answer.py": buggy, "test_answer.py": test_file},
            tests={"test_answer.py": test_file},
            source="toy",
            metadata=meta,
        )
        out.append((task, {"answer.py": fixed}))
    return out
