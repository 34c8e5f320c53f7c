"""Feature tasks from release history (coder/env/sources/releases.py, coder/env/sources/pypi.py): changelog
sections and terse prompts on fixture text; two real packages fetched from the package index
into tasks that verify in the sandbox and leak nothing of the next release."""

import json
import os

import pytest

from coder.env import make_tasks
from coder.env.sources import package_mutants, releases
from coder.env.runtime.sandbox import Limits, Sandbox
from coder.env.tasks import Task, read_solutions, read_tasks


def test_changelog_sections_in_the_three_common_styles(tmp_path):
    md = tmp_path / "md"
    md.mkdir()
    (md / "CHANGELOG.md").write_text(
        "# pkg Changelog\n\nintro 1.1 words\n\n## 1.10.0\n\n- later\n\n## 1.1.0\n\n"
        "_(September 7, 2026)_\n\n- Added [`x.y`][x.y] to do things ([#453](https://h/453))\n"
        "- Fixed [`z`](https://docs/z)\n  when empty\n\n## 1.0.0\n\n- old\n"
    )
    rst = tmp_path / "rst"
    (rst / "docs").mkdir(parents=True)
    (rst / "docs" / "changes.rst").write_text(
        "Version 2.0.0\n-------------\n\nReleased 2024-04-16\n\n-   Drop ``a``. :pr:`372`\n"
        "-   Use :func:`b` instead\n    of c. :issue:`9`\n\nVersion 1.9.0\n-------------\n\n- old\n"
    )
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "CHANGELOG").write_text(
        "- 0.10.0: Add support for 3.13.\n  New format ``grid``.\n- 0.9.0: Drop 2.7.\n"
    )
    path, text = releases.changelog_section(str(md), "1.1.0")
    assert path == "CHANGELOG.md"
    assert releases.changelog_entries(text) == ["Added `x.y` to do things", "Fixed `z` when empty"]
    assert releases.changelog_section(str(md), "1.1") is None  # "1.1.0" is not "1.1"
    path, text = releases.changelog_section(str(rst), "2.0.0")
    assert path == "docs/changes.rst"
    assert releases.changelog_entries(text) == ["Drop `a`.", "Use `b` instead of c."]
    path, text = releases.changelog_section(str(plain), "0.10.0")
    assert releases.changelog_entries(text) == ["Add support for 3.13.", "New format `grid`."]
    assert releases.changelog_section(str(plain), "0.11.0") is None


def test_terse_prompt_fits_its_cap_and_counts_what_it_left_out():
    entries = [f"Fixed thing number {i} in the module that does it" for i in range(30)]
    prompt, left = releases.terse_prompt("pkg", "1.0", "1.1", entries, 300)
    assert len(prompt) <= 300 and 0 < left < 30
    assert prompt.endswith(f"(and {left} more changes in the release)")
    assert prompt.count("\n- ") == 30 - left
    prompt, left = releases.terse_prompt("pkg", "1.0", "1.1", ["word " * 200, "b"], 200)
    assert len(prompt) <= 200 and left == 1 and " ...\n" in prompt
    prompt, left = releases.terse_prompt("pkg", "1.0", "1.1", entries[:2], 600)
    assert left == 0 and "more changes" not in prompt


def test_test_paths_and_package_specs():
    for p in ("tests/test_a.py", "tests/data/x.json", "src/pkg/tests/test_b.py", "test_c.py",
              "conftest.py", "testing/helpers.py", "pkg/d_test.py"):
        assert releases.is_test_path(p), p
    for p in ("src/pkg/testing_utils.py", "pkg/attestation.py", "docs/tests.rst", "contest.py"):
        assert not releases.is_test_path(p), p
    assert releases.parse_spec("Boltons==26.1.0") == ("boltons", "26.1.0")
    assert releases.parse_spec("jaraco.functools") == ("jaraco-functools", None)
    with pytest.raises(ValueError, match="NAME or NAME==VERSION"):
        releases.parse_spec("pkg==")


def test_mutants_draw_from_the_package_sources_only(tmp_path):
    for path in ("pkg/__init__.py", "pkg/core.py", "pkg/tests/test_core.py", "setup.py",
                 "docs/conf.py", "tests/conftest.py", "top.py", "src/other/util.py"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("")
    assert package_mutants.source_files(str(tmp_path)) == [
        "pkg/__init__.py", "pkg/core.py", "src/other/util.py"]


def test_readable_copies_finds_a_vendored_copy_of_the_next_release(tmp_path, write_wheel):
    """The generator's leak check: a copy of the new code vendored inside an installed package
    (here in the task's environment) is found; the same task without it is clean."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    new_line = "return 'only the next release has this line'"
    write_wheel(wheels, "vend", "1.0", {
        "vend/__init__.py": b"",
        "vend/_vendor/mymod/__init__.py": f"def f():\n    {new_line}\n".encode(),
    })
    files = {"mymod/__init__.py": "def f():\n    return 1\n", "test_f.py": ""}
    gold = f"--- a/mymod/__init__.py\n+++ b/mymod/__init__.py\n@@ -1,2 +1,2 @@\n def f():\n" \
           f"-    return 1\n+    {new_line}\n"
    env = {"python": {"requirements": ["vend==1.0"], "find_links": [str(wheels)],
                      "no_index": True}}
    limits = Limits(timeout_s=60, environments_dir=str(tmp_path / "envs"))
    leaky = Task("leaky", "", files, {}, environment=env)
    found = releases.readable_copies(leaky, releases.added_lines(gold), limits)
    assert len(found) == 1 and found[0].startswith(os.path.realpath(tmp_path / "envs") + "/")
    assert found[0].endswith("/site-packages/vend/_vendor/mymod/__init__.py"), found
    assert releases.readable_copies(Task("clean", "", files, {}), [new_line], limits) == []


@pytest.fixture(scope="module")
def sdists(tmp_path_factory):
    """One sdist cache for the module's tests (each still downloads what it needs once)."""
    return str(tmp_path_factory.mktemp("sdists"))


@pytest.mark.slow
def test_release_tasks_from_two_packages_on_the_index(tmp_path, capsys, sdists):
    """cachetools 7.3.1 -> 7.3.2 and itsdangerous 2.1.2 -> 2.2.0, fetched from the package index
    at test time: each makes a verified task (gold patch 1, start 0: `--verify`), the figures are
    printed, the workspace's history stops at the older release, and what an agent would try
    (git, `import`, the sdist cache) finds nothing of the newer one."""
    out, sol = tmp_path / "tasks.jsonl", tmp_path / "solutions.jsonl"
    rc = make_tasks.main([
        "--source", "releases", "--packages", "cachetools==7.3.2,itsdangerous==2.2.0",
        "--repos", str(tmp_path / "repos"), "--sdist-cache", sdists, "--history", "0",
        "--host-python", "--verify", "--workers", "2", "--out", str(out), "--solutions", str(sol),
    ])
    err = capsys.readouterr().err
    print(err)
    assert rc == 0, err
    stats = json.loads(next(ln for ln in err.splitlines() if ln.startswith("{")))
    assert stats["tasks"] == 2 and stats["verification_rate"] == 1.0, stats
    assert stats["tasks_per_package"] == {"cachetools": 1, "itsdangerous": 1}
    tasks = {t.id: t for t in read_tasks(str(out))}
    assert set(tasks) == {"pypi-cachetools-7.3.2", "pypi-itsdangerous-2.2.0"}
    gold = read_solutions(str(sol))
    for task in tasks.values():
        m = task.metadata
        assert task.fail_to_pass and task.pass_to_pass, task.id
        assert 0 < len(task.prompt) <= 600 and task.prompt.startswith(f"Bring {m['package']}")
        assert m["lines_added"] > 0 and m["files_changed"], m
        assert not any(releases.is_test_path(p) for p in m["files_changed"])
        assert m["split"] in ("train", "heldout") and task.test_command.endswith("pythonpath=src")
    task = tasks["pypi-itsdangerous-2.2.0"]
    assert "(and 2 more changes in the release)" in task.prompt  # 6 entries, 4 fit in 600 chars
    with Sandbox(task) as sb:
        r = sb.run("git log --all --format=%s; python -c 'import sys; sys.path.insert(0, \"src\");"
                   " import itsdangerous; print(itsdangerous.__file__)';"
                   f" ls {sdists} 2>/dev/null || echo no-cache")
    assert r.stdout.splitlines() == [
        "itsdangerous 2.1.2: the release's sdist (itsdangerous-2.1.2.tar.gz)",
        "/workspace/src/itsdangerous/__init__.py", "no-cache"], r
    assert releases.readable_copies(task, releases.added_lines(gold[task.id])) == []


def test_mutant_tasks_across_files_of_a_package(tmp_path, capsys, tiny_package_index):
    """Two bugs in the two source files of a package release (served by a local index): the
    task verifies (reference 1, start 0), its prompt names a failing test, and the workspace's
    history is the mutant alone (no unmutated commit to diff against)."""
    out, sol = tmp_path / "tasks.jsonl", tmp_path / "solutions.jsonl"
    rc = make_tasks.main([
        "--source", "mutants", "--packages", "tinypkg7==1.1.0", "--n", "1", "--mutations", "2",
        "--seed", "0", "--repos", str(tmp_path / "repos"), "--sdist-cache", str(tmp_path / "s"),
        "--index-url", tiny_package_index, "--host-python", "--verify", "--workers", "1",
        "--out", str(out), "--solutions", str(sol),
    ])
    err = capsys.readouterr().err
    assert rc == 0, err
    [task] = read_tasks(str(out))
    reference = read_solutions(str(sol))[task.id]
    m = task.metadata
    assert m["source"] == "mutants" and len(m["mutations"]) == 2
    assert {x["file"] for x in m["mutations"]} == set(reference) == {
        "tinypkg7/__init__.py", "tinypkg7/text.py"}
    assert task.fail_to_pass and not set(task.fail_to_pass) & set(task.pass_to_pass)
    assert task.fail_to_pass[0] in task.prompt
    with Sandbox(task) as sb:
        assert all(sb.read(p) != text for p, text in reference.items())
        r = sb.run("git log --all --format='%s %P'; git status --porcelain | wc -l")
    assert r.stdout.splitlines() == ["tinypkg7 1.1.0 ", "0"], r
