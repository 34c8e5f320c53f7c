"""SWE-bench's resolution rule (coder/env/scoring/grading.py) and the JUnit keys that name pytest cases
as its released ids do (coder/env/scoring/runners.py's swebench-* formats); then both against the
`swebench` package's own parsers and grading on one pytest run in the sandbox."""

import pytest

from coder.env.scoring import grading, runners
from coder.env.scoring.score import junit_nodes, junit_results
from coder.env.runtime.sandbox import Sandbox
from coder.env.tasks import Task


def test_ids_name_tests_as_swebench_grading_resolves_them():
    statuses = {"t.py::test_a": "passed", "t.py::test_p[x y]": "passed", "t.py::test_p[x z]": "xfailed",
                "t.py::test_q[1 2]": "passed", "t.py::test_q[1 3]": "failed", "t.py::test_s": "skipped"}
    assert grading.find("t.py::test_a", statuses) == "t.py::test_a"
    assert grading.find("t.py::test_p[x", statuses) == "t.py::test_p[x y]"  # cut ids: by prefix
    assert grading.find("t.py::test_q[1", statuses) is None  # the candidates disagree
    assert grading.find("t.py::test", statuses) is None  # a whole id never matches by prefix
    assert grading.outcome("t.py::test_gone", statuses) == grading.ABSENT
    res = grading.resolve(statuses, ["t.py::test_p[x", "t.py::test_s", "t.py::test_gone"],
                          ["t.py::test_a", "t.py::test_s", "t.py::test_q[1 3]"])
    assert (res.f2p_passed, res.f2p_total, res.p2p_passed, res.p2p_total) == (1, 3, 2, 3)
    assert res.failures == {"t.py::test_s": "skipped", "t.py::test_gone": grading.ABSENT,
                            "t.py::test_q[1 3]": "failed"}  # a skip maintains a PASS_TO_PASS id
    assert not res.resolved
    assert res.describe() == ("skipped: t.py::test_s; absent from the report: t.py::test_gone; "
                              "failed: t.py::test_q[1 3]")
    assert grading.resolve(statuses, ["t.py::test_p[x"], ["t.py::test_s"]).resolved
    many = grading.resolve({}, [f"t.py::test_{i}" for i in range(7)], [])
    assert many.describe(limit=2) == "absent from the report: t.py::test_0, t.py::test_1 (+5 more)"


APP = 'tests/test_cli.py::test_locate_app[cliapp.factory-create_app2("foo", "bar")]'


def test_swebench_formats_key_pytest_cases_as_its_parsers_read_the_summary():
    key = {name: f.key for name, f in runners.FORMATS.items() if f.junit}
    cut = 'tests/test_cli.py::test_locate_app[cliapp.factory-create_app2("foo",'
    assert key["swebench-pytest"](APP, "passed", "") == cut
    assert key["swebench-pytest"](APP, "failed", "AssertionError: a - b") == cut
    assert key["swebench-pytest"](APP, "xfailed", "known") == cut
    assert key["swebench-pytest"](APP, "skipped", "why") is None  # skips are summarised by line
    assert key["pytest"](APP, "passed", "") == APP
    # the workspace's path as the images' /testbed; nothing else that merely contains it
    assert key["swebench-pytest"]("t.py::test_p[/workspace/d/f.txt]", "passed", "") == "t.py::test_p[/testbed/d/f.txt]"
    assert key["swebench-pytest"]("t.py::test_p[/workspaces/f]", "passed", "") == "t.py::test_p[/workspaces/f]"
    assert key["swebench-pytest"]("t.py::test_p[a/workspace/f]", "passed", "") == "t.py::test_p[a/workspace/f]"
    opts = key["swebench-pytest-options"]
    assert opts("t.py::test_p[/workspace/d/f.txt]", "passed", "") == "t.py::test_p[/f.txt]"
    assert opts("t.py::test_p[n-/workspace/f.txt]", "passed", "") == "t.py::test_p[n-/testbed/f.txt]"
    assert opts("t.py::test_p[//host/f.txt]", "passed", "") == "t.py::test_p[//host/f.txt]"
    v2 = key["swebench-pytest-v2"]
    assert v2("t.py::test_e[a  b - c]", "passed", "") == "t.py::test_e[a b - c]"
    assert v2("t.py::test_e[a  b - c]", "failed", "msg") == "t.py::test_e[a b"
    assert v2("t.py::test_x", "xfailed", "known bug") == "t.py::test_x - known bug"
    assert v2("t.py::test_x[[5m]", "passed", "") == "t.py::test_x[]"  # its escape-code filter
    mpl = key["swebench-matplotlib"]
    assert mpl("t.py::test_click[MouseButton.LEFT-x y]", "passed", "") == "t.py::test_click[1-x"
    assert key["swebench-seaborn"]("t.py::test_x", "xfailed", "known") is None
    cases = [("t.py::t[x z]", "failed", "m"), ("t.py::t[x y]", "passed", ""), ("t.py::u", "skipped", "")]
    assert runners.keyed("swebench-pytest", cases) == {"t.py::t[x": "failed"}  # failures print last
    assert runners.keyed("pytest", cases) == {"t.py::t[x z]": "failed", "t.py::t[x y]": "passed",
                                              "t.py::u": "skipped"}


TEST_FILE = '''import os

import pytest


@pytest.mark.parametrize("a", ['create_app2("foo", "bar")', "plain", "a - b", "x y", "x z"])
def test_space(a):
    assert a not in ("a - b", "x z")


@pytest.mark.parametrize("p", [os.path.join(os.getcwd(), "data", "f.txt"), "n-" + os.getcwd()])
def test_path(p):
    assert p


@pytest.mark.parametrize("button", ["MouseButton.LEFT", "MouseButton.RIGHT"])
def test_click(button):
    pass


@pytest.mark.xfail(reason="known bug")
def test_xf():
    assert 0


@pytest.mark.xfail(reason="two  spaces")
def test_xf_spaces():
    assert 0


def test_skip():
    pytest.skip("nope")


@pytest.fixture
def broken():
    raise RuntimeError("setup")


def test_err(broken):
    pass


class TestC:
    def test_m(self):
        pass

    def test_fail(self):
        assert 1 == 2
'''
PARSERS = {"parse_log_pytest": "swebench-pytest", "parse_log_pytest_options": "swebench-pytest-options",
           "parse_log_pytest_v2": "swebench-pytest-v2", "parse_log_matplotlib": "swebench-matplotlib",
           "parse_log_seaborn": "swebench-seaborn"}


@pytest.fixture(scope="module")
def pytest_run():
    """(the -rA log as the images would print it, the JUnit results) of one pytest run of
    TEST_FILE in the sandbox, with SWE-bench's test command."""
    task = Task("g", "", {"tests/test_x.py": TEST_FILE}, {})
    with Sandbox(task) as sb:
        r = sb.run("python -m pytest --no-header -rA --tb=no -p no:cacheprovider "
                   "--junitxml=report.xml tests/test_x.py")
        assert r.exit_code == 1, r.stdout + r.stderr
        xml = sb.read("report.xml").encode()
    return runners.in_image(r.stdout), junit_results(xml)


def test_statuses_and_resolution_agree_with_the_swebench_package(pytest_run, as_coder_statuses):
    sg = pytest.importorskip("swebench.harness.grading",
                             reason="the swebench package is not installed (pip install -e .[swe])")
    from swebench.harness.log_parsers import PARSER_REGISTRY

    log, results = pytest_run
    nodes = junit_nodes(results, ["tests/test_x.py"])
    errored = {n for n, _, m in nodes if m.startswith("failed on setup")}
    for parser, fmt in PARSERS.items():
        theirs, ours = PARSER_REGISTRY[parser](log, None), runners.keyed(fmt, nodes)
        same_theirs, same_ours = theirs, ours
        if parser in ("parse_log_pytest_v2", "parse_log_seaborn"):
            # an error's summary line, `ERROR <id> - <message>`: v2 keeps the message in its key and
            # seaborn's parser does not read it, so the id is absent there; failed in JUnit
            same_theirs = {k: v for k, v in theirs.items() if v != "ERROR"}
            same_ours = {k: v for k, v in ours.items() if k not in {runners.in_image(e) for e in errored}}
        assert same_ours == as_coder_statuses(same_theirs), parser
        ids = set(theirs) | set(ours) | {
            'tests/test_x.py::test_space[create_app2("foo",', "tests/test_x.py::test_space[create",
            "tests/test_x.py::test_space[x", "tests/test_x.py::test_space[a", "tests/test_x.py::test_gone",
            "tests/test_x.py::test_skip", "tests/test_x.py::test_err", "tests/test_x.py::test_xf"}
        for case in sorted(ids):
            out = grading.outcome(case, ours)
            assert (out in grading.PASSING) == sg.test_passed(case, theirs), (parser, case)
            assert (out in grading.PASSING or out == "skipped") == sg.test_maintained(case, theirs), (parser, case)
            f2p = [case, next(iter(theirs))]
            report = sg.get_eval_tests_report(theirs, {"FAIL_TO_PASS": f2p, "PASS_TO_PASS": [case]})
            assert (sg.get_resolution_status(report) == "RESOLVED_FULL") == \
                grading.resolve(ours, f2p, [case]).resolved, (parser, case)
