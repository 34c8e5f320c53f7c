"""Installed Python modules a sandbox hides: the workspace's modules, every installed copy."""

from coder.env.runtime import installed as installed_lib
from coder.env.runtime.sandbox import Sandbox
from coder.env.tasks import Task


def test_workspace_modules_names_top_level_modules_and_packages():
    files = {
        "colorsys.py": "",
        "test_colorsys.py": "",
        "pkg/__init__.py": "",
        "pkg/sub/mod.py": "",
        "notpkg/x.py": "",  # no __init__.py: not importable as a package of that name
        "src/lib2/__init__.py": "",
        "my-script.py": "",  # not an identifier: nothing can `import` it
    }
    assert installed_lib.workspace_modules(files) == {
        "colorsys": ("colorsys.py",),
        "lib2": ("src/lib2/__init__.py",),
        "pkg": ("pkg/__init__.py", "pkg/sub/mod.py"),
        "test_colorsys": ("test_colorsys.py",),
    }


def test_installed_copies_of_a_workspace_module_show_its_starting_text():
    """A workspace `json/` package and `colorsys.py` hide the installed ones: every library
    directory shows the task's text (or nothing), and no bytecode of the original remains."""
    copies = installed_lib.installed_copies("colorsys")
    assert any(c.endswith("/colorsys.py") for c in copies), copies
    mine = "GIVEN = 'the starting text'\n"
    task = Task("t", "", {"colorsys.py": mine, "json/__init__.py": "X = 1\n"}, {})
    with Sandbox(task) as sb:
        r = sb.run(
            "python -I -c 'import colorsys, json; print(colorsys.GIVEN, json.X)'; "
            "for d in $(python -I -c 'import sys; print(*[p for p in sys.path if p])') "
            "/usr/lib/python3*; do cat $d/colorsys.py 2>/dev/null; done | sort -u; "
            "find / -path /proc -prune -o -path /workspace -prune -o -size +0 "
            "\\( -name 'colorsys*.pyc' -o -path '*/json/decoder.py' \\) -print 2>/dev/null; true"
        )
        assert r.exit_code == 0, r.stderr
        assert r.stdout.splitlines() == ["the starting text 1", mine.strip()], r.stdout
    with Sandbox(Task("u", "", {"answer.py": "x = 1\n"}, {})) as sb:  # nothing to hide
        r = sb.run("python -I -c 'import colorsys; print(colorsys.rgb_to_hsv(1, 0, 0))'")
        assert r.stdout.strip() == "(0.0, 1.0, 1)", r.stderr
