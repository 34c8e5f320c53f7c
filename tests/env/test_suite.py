"""The CursorBench-like held-out suite (coder/env/suite.py): held-out repositories only, a
category per task, noisy-context variants, files through fsspec."""

import json
import random

import pytest

from coder.env import suite
from coder.env.tasks import Task, read_tasks, write_tasks


def _task(tid, source, split, f2p=("tests/test_a.py::test_x",), **meta):
    return Task(tid, f"prompt of {tid}", {}, {}, source=source, repo="/r", commit="c" * 40,
                fail_to_pass=f2p, metadata={"source": source, "split": split,
                                            "lines_added": 10, "lines_removed": 2,
                                            "files_changed": ["a.py"], **meta})


def test_suite_keeps_held_out_repositories_and_sets_categories(capsys):
    tasks = [_task("f", "releases", "heldout"), _task("b", "mutants", "heldout"),
             _task("t", "mutants", "train"), _task("s", "swebench", None),
             _task("c", "mutants", "heldout", category="my-own")]
    made, left_out = suite.build_suite(tasks, noisy=1, seed=3)
    assert sorted(left_out) == ["s", "t"] and "held-out repositories only" in left_out["t"]
    assert [(t.id, suite.category_of(t)) for t in made] == [
        ("f", "feature"), ("b", "bug"), ("c", "my-own"), ("b-noisy", "noisy-context")]
    noisy = made[-1]
    assert noisy.fail_to_pass == tasks[1].fail_to_pass and noisy.metadata["noisy_of"] == "b"
    log = noisy.prompt.split("```\n")[1].removesuffix("\n```")
    lines = log.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith("FAILED "))
    assert lines[at] == "FAILED tests/test_a.py::test_x - AssertionError" and 40 <= at < len(lines) - 3
    assert len(lines) == 122 and "prompt of b" not in noisy.prompt
    with pytest.raises(ValueError, match="only 1 held-out bug tasks"):
        suite.build_suite(tasks, noisy=2)
    assert suite.noisy_log(random.Random(0), "x::y") == suite.noisy_log(random.Random(0), "x::y")


def test_suite_command_reads_and_writes_through_fsspec(capsys):
    write_tasks("memory://suite-in/a.jsonl", [_task("f", "releases", "heldout"),
                                              _task("t", "mutants", "train")])
    write_tasks("memory://suite-in/b.jsonl", [_task("b", "mutants", "heldout")])
    rc = suite.main(["--tasks", "memory://suite-in/a.jsonl,memory://suite-in/b.jsonl",
                     "--out", "memory://suite-out/s.jsonl", "--noisy", "1"])
    assert rc == 0
    stats = json.loads(capsys.readouterr().err)
    assert stats["tasks"] == 3 and stats["left_out"] == 1
    assert stats["categories"]["feature"] == {"tasks": 1, "median_prompt_chars": 11,
                                              "median_lines_changed": 12,
                                              "median_files_changed": 1}
    assert [t.id for t in read_tasks("memory://suite-out/s.jsonl")] == ["f", "b", "b-noisy"]
    assert suite.main(["--tasks", "memory://suite-in/a.jsonl", "--out", "memory://x.jsonl"]) == 0
    write_tasks("memory://suite-in/c.jsonl", [_task("t", "mutants", "train")])
    assert suite.main(["--tasks", "memory://suite-in/c.jsonl", "--out", "memory://y.jsonl"]) == 1
