"""Tasks: JSONL format, toy tasks, and the stdlib bug-fix generator."""

import ast
import hashlib
import json
import os
import random
import uuid

import fsspec
import pytest

from coder.env.sources import mutate
from coder.env.scoring.score import score_solution
from coder.env.tasks import (
    Task,
    glob_files,
    read_solutions,
    read_tasks,
    toy_tasks,
    write_solutions,
    write_tasks,
)


def test_task_jsonl_roundtrip_and_validation(tmp_path):
    tasks = [
        Task("a", "p", {"x.py": "1"}, {"test_x.py": "2"}),
        Task("b", "q", {}, {}, source="toy"),
    ]
    write_tasks(tmp_path / "t.jsonl", tasks)
    assert read_tasks(tmp_path / "t.jsonl") == tasks
    write_solutions(tmp_path / "s.jsonl", {"a": {"x.py": "3"}})
    assert read_solutions(tmp_path / "s.jsonl") == {"a": {"x.py": "3"}}
    t = Task.from_json({"id": "c", "prompt": "p", "files": {}, "tests": {}})
    assert t.test_command == "python -m pytest -q" and t.language == "python"
    with pytest.raises(ValueError, match="lacks"):
        Task.from_json({"id": "c", "prompt": "p", "files": {}})
    with pytest.raises(ValueError, match="unknown keys"):
        Task.from_json({"id": "c", "prompt": "p", "files": {}, "tests": {}, "extra": 1})
    with pytest.raises(ValueError, match="map paths"):
        Task.from_json({"id": "c", "prompt": "p", "files": {"a": 1}, "tests": {}})


def test_task_v2_roundtrip_validation_and_patch_solutions(tmp_path):
    v1 = Task("a", "p", {"x.py": "1"}, {"test_x.py": "2"})
    assert set(v1.to_json()) == {"id", "prompt", "files", "tests", "test_command", "language",
                                 "source"}  # a v1 line is what it was
    line = {"id": "r", "prompt": "p", "repo": "/m/acme__calc", "commit": "abc", "setup": "true",
            "fail_to_pass": ["t.py::a"], "pass_to_pass": [], "test_patch": "diff",
            "metadata": {"source": "swebench", "lines_added": 2}}
    v2 = Task.from_json(line)
    assert v2.files == {} == v2.tests and v2.test_ids == ("t.py::a",)
    js = v2.to_json()
    assert js["fail_to_pass"] == ["t.py::a"] and "pass_to_pass" not in js  # empty: left out
    assert Task.from_json(js) == v2
    write_tasks(tmp_path / "t.jsonl", [v1, v2])
    assert read_tasks(tmp_path / "t.jsonl") == [v1, v2]
    for bad, match in [
        ({"repo": "x"}, "'r'.*needs a commit"),
        ({"repo": "x", "commit": "c", "fail_to_pass": "t.py::a"}, "'r'.*fail_to_pass"),
        ({"repo": "x", "commit": "c", "metadata": []}, "'r'.*metadata"),
        ({"repo": "x", "commit": 3}, "'r'.*commit must be a string"),
        ({"files": {}, "tests": {}, "test_patch": "d"}, "'r'.*need a repo"),
        ({"files": {}}, "'r'.*lacks"),
    ]:
        with pytest.raises(ValueError, match=match):
            Task.from_json({"id": "r", "prompt": "p", **bad})
    sols = {"a": {"x.py": "3"}, "r": "diff --git a/x.py b/x.py\n"}
    write_solutions(tmp_path / "s.jsonl", sols)
    assert read_solutions(tmp_path / "s.jsonl") == sols
    (tmp_path / "bad.jsonl").write_text('{"id": "r", "patch": 1}\n')
    with pytest.raises(ValueError, match="'r'.*patch"):
        read_solutions(tmp_path / "bad.jsonl")


def test_tasks_and_solutions_through_fsspec_urls(tmp_path, monkeypatch):
    """Task and solution files at fsspec URLs (memory:// here, as gs:// / s3:// in a run): written,
    globbed (the protocol kept in the paths) and read back with the bytes a local file gets, and
    no local directory named after the protocol."""
    monkeypatch.chdir(tmp_path)  # a stray local `memory:` directory would appear here
    bucket = f"bucket-{uuid.uuid4().hex[:8]}"
    root = f"memory://{bucket}"
    a = [Task("a1", "fix é", {"x.py": "1"}, {"test_x.py": "2"}), Task("a2", "p", {}, {})]
    b = [Task("b1", "q", {"y.py": "3"}, {}, source="toy")]
    sols = {"a": {"a1": {"x.py": "3"}}, "b": {"b1": "diff --git a/y.py b/y.py\n"}}
    try:
        for name, tasks in (("a", a), ("b", b)):
            write_tasks(f"{root}/tasks/{name}.jsonl", tasks)
            write_solutions(f"{root}/solutions/{name}.jsonl", sols[name])
        paths = glob_files(f"{root}/tasks/*.jsonl")
        assert [p.rsplit("/", 1)[-1] for p in paths] == ["a.jsonl", "b.jsonl"]
        assert all(p.startswith("memory://") and f"/{bucket}/tasks/" in p for p in paths)
        assert [t for p in paths for t in read_tasks(p)] == a + b
        assert read_tasks(f"{root}/tasks/b.jsonl") == b
        got = [read_solutions(p) for p in glob_files(f"{root}/solutions/*.jsonl")]
        assert got == [sols["a"], sols["b"]]
        assert glob_files(f"{root}/tasks/*.json") == [] == glob_files(f"{root}/none/a.jsonl")
        # the same bytes as a local file (the old writer's: one json.dumps line per task, UTF-8)
        write_tasks(tmp_path / "a.jsonl", a)
        local = (tmp_path / "a.jsonl").read_bytes()
        old = "".join(json.dumps(t.to_json(), ensure_ascii=False) + "\n" for t in a).encode()
        assert local == old == fsspec.filesystem("memory").cat_file(f"/{bucket}/tasks/a.jsonl")
        assert glob_files(str(tmp_path / "*.jsonl")) == [str(tmp_path / "a.jsonl")]  # no file://
        assert glob_files("*.jsonl") == [os.path.abspath("a.jsonl")]
        with pytest.raises(FileNotFoundError):  # a local file's directory is not made (as open)
            write_tasks(tmp_path / "missing" / "t.jsonl", a)
    finally:
        fsspec.filesystem("memory").rm(f"/{bucket}", recursive=True)
    assert sorted(os.listdir(tmp_path)) == ["a.jsonl"]  # no `memory:` (or `gs:`) directory


def test_toy_tasks_are_reproducible_distinct_and_solvable():
    a, b = toy_tasks(12, seed=3), toy_tasks(12, seed=3)
    assert a == b and len({t.id for t, _ in a}) == 12
    assert [t.id for t, _ in toy_tasks(12, seed=4)] != [t.id for t, _ in a]
    for task, sol in random.Random(0).sample(a, 3):
        assert score_solution(task, sol).reward == 1.0
        assert score_solution(task, {}).reward == 0.0


def test_underspecified_toy_tasks_hide_the_number_in_the_specification():
    plain, mixed = toy_tasks(20, seed=3), toy_tasks(20, seed=3, underspecified=0.5)
    assert all(t.metadata == {} for t, _ in plain)  # the default is unchanged
    vague = [(t, s) for t, s in mixed if t.metadata["underspecified"]]
    assert 4 <= len(vague) <= 16 and all(t.id.endswith("/vague") for t, _ in vague)
    by_id = {t.id: t for t, _ in plain}
    for t, sol in vague:
        full = by_id[t.id.removesuffix("/vague")]
        assert t.metadata["specification"] == full.prompt and t.prompt != full.prompt
        k = full.id.split("/")[2]
        assert k in full.prompt and k not in t.prompt  # only the answer says the number
        assert t.files == full.files and sol == dict(next(s for x, s in plain if x.id == full.id))
    assert all("specification" not in t.metadata for t, _ in mixed if not t.metadata["underspecified"])


def _passes(files: dict) -> bool:
    """The toy task's test functions run on `files` in this process (the tests are plain asserts)."""
    scope = {}
    exec(compile(files["answer.py"], "answer.py", "exec"), scope)
    test_src = files["test_answer.py"].split("\n", 1)[1]  # without `from answer import ...`
    exec(compile(test_src, "test_answer.py", "exec"), scope)
    try:
        for name in [n for n in scope if n.startswith("test_")]:
            scope[name]()
    except AssertionError:
        return False
    return True


def test_every_toy_task_fails_as_given_and_passes_fixed():
    """All 45 toy tasks: the given answer.py fails its test (none is solved by doing nothing, as
    scale with k = 1 once was), the reference passes."""
    for task, sol in toy_tasks(45, seed=0):
        assert not _passes(task.files), task.id
        assert _passes({**task.files, **sol}), task.id


SRC = """
def f(xs, n):
    total = 0
    for i in range(n):
        if xs[i] < 10:
            total += xs[i]
    return max(total, n)
"""


def test_every_mutation_operator_applies_and_parses():
    muts = mutate.mutations(SRC, random.Random(0))
    assert {m.op for m in muts} == set(mutate.OPERATORS)
    for m in muts:
        ast.parse(m.source)
        assert m.source != SRC and m.function == "f"
    # one site each: the mutant differs from the original in a single contiguous region
    flips = [m.source for m in muts if m.op == "flip_comparison"]
    assert "xs[i] <= 10" in flips[0]
    assert any("max(n, total)" in m.source for m in muts if m.op == "swap_arguments")
    assert mutate.mutations(SRC, random.Random(7)) == mutate.mutations(SRC, random.Random(7))


def test_splits_are_disjoint_by_module():
    mods = mutate.candidate_modules()
    train = {m for m in mods if mutate.split_of(m) == "train"}
    held = {m for m in mods if mutate.split_of(m) == "heldout"}
    assert train and held and not train & held and train | held == set(mods)


def test_stdlib_task_does_not_leak_its_solution():
    """The copy hack of a held-out stdlib task: copy what `import colorsys` resolves to over the
    workspace and submit. The installed module is the reference solution; inside the task's
    sandbox every installed copy shows the mutant instead, so the hack scores 0 (the reference
    itself still scores 1 in the same kind of sandbox)."""
    from coder.env.scoring.score import score
    from coder.env.runtime.sandbox import Sandbox

    ((task, solution),) = mutate.stdlib_tasks(
        1, seed=0, split="heldout", modules=["colorsys"], max_per_module=1
    )
    reference, given = solution["colorsys.py"], task.files["colorsys.py"]
    assert reference != given
    with Sandbox(task) as sb:
        r = sb.run(
            "python -I -c 'import colorsys, shutil; shutil.copy(colorsys.__file__, \"got.py\")';"
            "cp got.py colorsys.py; "
            # every file of that name anywhere the agent can read: each interpreter's copy
            "find / -path /proc -prune -o -path /workspace -prune -o -name colorsys.py "
            "-exec md5sum {} + -o -name 'colorsys*.pyc' -size +0 -printf 'pyc %p\\n' 2>/dev/null"
        )
        assert sb.read("got.py") == given, r.stderr
        copies = dict(reversed(line.split(maxsplit=1)) for line in r.stdout.splitlines())
        assert "/usr/lib/python3.11/colorsys.py" in copies or len(copies) > 1, r.stdout
        assert set(copies.values()) == {hashlib.md5(given.encode()).hexdigest()}, r.stdout
        hacked = score(sb, task, mode="all")
    assert hacked.infra_error is None and hacked.total > 0 and hacked.reward == 0.0
    assert score_solution(task, solution, mode="all").reward == 1.0


def test_frozen_stdlib_modules_make_no_tasks():
    """posixpath and friends are compiled into the interpreter: no sandbox can hide them."""
    assert not mutate.usable("posixpath", frozenset()) and not mutate.usable("os", frozenset())
    assert mutate.usable("colorsys", frozenset())


def test_stdlib_generator_sample_fails_mutated_passes_original():
    log = []
    pairs = mutate.stdlib_tasks(
        1, seed=0, split="heldout", modules=["colorsys"], max_per_module=1, log=log.append
    )
    assert len(pairs) == 1, log
    task, solution = pairs[0]
    assert task.source == "stdlib" and task.id.startswith("stdlib/colorsys/")
    assert set(task.files) == {"colorsys.py", "test_colorsys.py"} and set(task.tests) == {
        "test_colorsys.py"
    }
    assert task.files["colorsys.py"] != solution["colorsys.py"]
    assert "colorsys" in task.prompt and "@@" not in task.prompt and "line" not in task.prompt
    broken = score_solution(task, {}, mode="all")
    fixed = score_solution(task, solution, mode="all")
    assert broken.infra_error is None and broken.reward == 0.0 and broken.total > 0
    assert fixed.reward == 1.0 and fixed.passed == fixed.total == broken.total
    again = mutate.stdlib_tasks(1, seed=0, split="heldout", modules=["colorsys"], max_per_module=1)
    assert again == pairs  # reproducible from the seed
    assert mutate.stdlib_tasks(1, seed=0, split="train", modules=["colorsys"]) == []  # wrong split
