"""Reward: correct solutions score, and every cheat scores 0."""

import pytest

from coder.env.scoring.score import outcome, parse_junit, pytest_args, score, score_solution
from coder.env.runtime.sandbox import Sandbox
from coder.env.tasks import Task

TEST = "from answer import f\n\n\ndef test_f():\n    assert f() == 7\n\n\ndef test_g():\n    assert f() + 1 == 8\n"
TASK = Task(
    id="t/seven",
    prompt="Make f() in answer.py return 7.",
    files={"answer.py": "def f():\n    return 0\n", "test_answer.py": TEST},
    tests={"test_answer.py": TEST},
    source="toy",
)
GOOD = {"answer.py": "def f():\n    return 7\n"}


def _run_then_score(shell: str, files: dict | None = None, task=TASK, mode="fraction"):
    """The agent runs `shell` in its sandbox (and writes `files`), then the task is scored."""
    with Sandbox(task) as sb:
        for path, text in (files or {}).items():
            sb.write(path, text)
        if shell:
            assert not sb.run(shell).timed_out
        return score(sb, task, mode=mode, timeout_s=20)


def test_correct_solution_scores_one_and_original_zero():
    s = score_solution(TASK, GOOD)
    assert (s.reward, s.passed, s.total, s.error) == (1.0, 2, 2, None)
    s = score_solution(TASK, {})
    assert (s.reward, s.passed, s.total) == (0.0, 0, 2)
    assert set(s.not_passed) == {"test_answer.py::test_f", "test_answer.py::test_g"}


def test_fraction_and_all_or_nothing():
    partial = {"answer.py": "def f():\n    return 7.0000001\n"}
    s = score_solution(TASK, partial)
    assert s.total == 2 and s.passed == 0
    one_of_two = {
        "test_answer.py": TEST,
        "answer.py": "import inspect\n\ndef f():\n"
        "    return 7 if inspect.stack()[1].function == 'test_f' else 0\n",
    }
    assert score_solution(TASK, one_of_two, mode="fraction").reward == 0.5
    assert score_solution(TASK, one_of_two, mode="all").reward == 0.0


CHEATS = {
    "delete_tests": ("rm -f test_answer.py", {}),
    "empty_tests": ("", {"test_answer.py": "def test_ok():\n    pass\n"}),
    "symlink_tests": ("rm test_answer.py && ln -s /dev/null test_answer.py", {}),
    "conftest_exit": ("", {"conftest.py": "import sys\nsys.exit(0)\n"}),
    "conftest_os_exit": ("", {"conftest.py": "import os\nos._exit(0)\n"}),
    "conftest_skip_all": (
        "",
        {
            "conftest.py": (
                "import pytest\n\ndef pytest_collection_modifyitems(items):\n"
                "    for it in items:\n        it.add_marker(pytest.mark.skip)\n"
            )
        },
    ),
    "conftest_force_pass": (
        "",
        {
            "conftest.py": (
                "import pytest\n\n@pytest.hookimpl(hookwrapper=True)\n"
                "def pytest_runtest_makereport(item, call):\n    out = yield\n"
                "    rep = out.get_result()\n    rep.outcome = 'passed'\n"
            )
        },
    ),
    "nested_conftest": (
        "mkdir -p sub",
        {"sub/conftest.py": "import os\nos._exit(0)\n", "sub/__init__.py": ""},
    ),
    "module_sys_exit": ("", {"answer.py": "import sys\nsys.exit(0)\n"}),
    "module_os_exit": ("", {"answer.py": "import os\nos._exit(0)\n"}),
    "exit_inside_call": ("", {"answer.py": "import os\n\ndef f():\n    os._exit(0)\n"}),
    "module_skip": ("", {"answer.py": "import unittest\nraise unittest.SkipTest('no')\n"}),
    "skip_in_call": ("", {"answer.py": "import pytest\n\ndef f():\n    pytest.skip('no')\n"}),
    "pytest_ini_addopts": ("", {"pytest.ini": "[pytest]\naddopts = --co\n"}),
    "pyproject_addopts": (
        "",
        {"pyproject.toml": "[tool.pytest.ini_options]\naddopts = '-k nothing'\n"},
    ),
    "setup_cfg_addopts": (
        "",
        {"setup.cfg": "[tool:pytest]\naddopts = --deselect test_answer.py\n"},
    ),
    "fake_pytest_runner": ("", {"pytest.py": "import sys\nprint('1 passed')\nsys.exit(0)\n"}),
    "fake_unittest": ("mkdir -p unittest", {"unittest/__init__.py": "raise SystemExit(0)\n"}),
    "sitecustomize": ("", {"sitecustomize.py": "import os\nos._exit(0)\n"}),
    "pth_file": ("", {"evil.pth": "import os; os._exit(0)\n"}),
    "stale_bytecode": (
        'mkdir -p __pycache__ && python -c "import py_compile; '
        "open('t.py','w').write('def test_f(): pass'); "
        "py_compile.compile('t.py', cfile='__pycache__/test_answer.cpython-311.pyc')\"",
        {},
    ),
    "forged_tmp_report": (
        'mkdir -p /tmp/r && echo \'<testsuite><testcase classname="test_answer" '
        'name="test_f"/></testsuite>\' > /tmp/r/report.xml',
        {},
    ),
    "print_success": ("", {"answer.py": "print('2 passed in 0.01s')\nimport os\nos._exit(0)\n"}),
    "fifo_tests": ("rm test_answer.py && mkfifo test_answer.py", {}),
    "infinite_loop": ("", {"answer.py": "def f():\n    while True:\n        pass\n"}),
}


@pytest.mark.parametrize("name", sorted(CHEATS))
def test_cheat_scores_zero(name):
    shell, files = CHEATS[name]
    s = _run_then_score(shell, files, mode="fraction") if name != "infinite_loop" else None
    if name == "infinite_loop":
        with Sandbox(TASK) as sb:
            sb.write("answer.py", files["answer.py"])
            s = score(sb, TASK, timeout_s=3)
        assert s.error and "timed out" in s.error
    assert s.reward == 0.0, (name, s)
    assert s.infra_error is None, (name, s)  # the agent's failure, not the harness's


def test_cheat_plus_correct_code_still_scores_only_on_real_tests():
    # A real fix alongside a (removed) conftest still scores 1: cleanup does not break solutions.
    s = _run_then_score("", {**GOOD, "conftest.py": "import sys\nsys.exit(0)\n"})
    assert s.reward == 1.0


def test_scoring_imports_the_workspace_packages_as_the_agents_own_test_run_does():
    """Tests in a subdirectory import the repository's package from the workspace root (no
    conftest.py): `python -m pytest` in /workspace (the run_tests tool) finds it, and so must
    scoring, or an agent would see its fix pass and score 0."""
    test = "from pkg.mod import f\n\n\ndef test_f():\n    assert f() == 7\n"
    task = Task(id="t/layout", prompt="p", files={"pkg/__init__.py": "", "pkg/mod.py": "def f():\n    return 0\n",
                                                   "tests/test_mod.py": test}, tests={"tests/test_mod.py": test})
    fixed = {"pkg/mod.py": "def f():\n    return 7\n"}
    with Sandbox(task) as sb:
        for path, text in fixed.items():
            sb.write(path, text)
        assert "1 passed" in sb.run("python -m pytest -q tests").stdout
        s = score(sb, task, timeout_s=20)
    assert (s.reward, s.passed, s.total, s.error) == (1.0, 1, 1, None)
    assert score_solution(task, {}).reward == 0.0


def test_helper_modules_of_the_agent_survive_cleanup():
    files = {
        "helpers.py": "SEVEN = 7\n",
        "answer.py": "from helpers import SEVEN\n\ndef f():\n    return SEVEN\n",
    }
    assert _run_then_score("", files).reward == 1.0


def test_pytest_args_and_unsupported_commands():
    assert pytest_args("python -m pytest -q tests") == ["-q", "tests"]
    assert pytest_args("pytest -x") == ["-x"]
    s = score_solution(Task("x", "p", {}, {}, test_command="make test"), {})
    assert s.infra_error and "pytest" in s.infra_error


def test_parse_junit_counts_only_hidden_files():
    xml = (
        b"<testsuites><testsuite>"
        b'<testcase classname="test_a.T" name="test_1"/>'
        b'<testcase classname="test_a.T" name="test_2"><failure/></testcase>'
        b'<testcase classname="test_a" name="test_3"><skipped/></testcase>'
        b'<testcase classname="test_other" name="test_4"/>'
        b"</testsuite></testsuites>"
    )
    passed, bad, total, not_passed = parse_junit(xml, ["test_a.py"])
    assert (passed, bad, total) == (1, 1, 3)
    assert not_passed == ["test_a.py::T::test_2", "test_a.py::test_3"]


def test_a_broken_call_fails_the_rollout_whatever_the_tests_say():
    """The broken-call rule, kept once (the env's text interface and the RL agent apply it)."""
    assert outcome(1.0, 0) == (1.0, True)
    assert outcome(0.5, 0) == (0.5, False)
    assert outcome(1.5, 0) == (1.0, True)  # clipped to [0, 1]
    assert outcome(1.0, 1) == (0.0, False)  # passes the tests, but a broken call: negative example
