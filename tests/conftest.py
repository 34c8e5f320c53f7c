"""Test setup: CPU backend with 8 fake devices, so sharding tests run anywhere.

This must run before jax is imported by any test module.
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# 8 fake CPU devices, and XLA:CPU flags that halve compile time, which is most of the suite's
# time (tests/xla_flags.py). Inherited by the processes the tests start. A user's own flags are
# kept.
from tests import xla_flags  # noqa: E402  (no jax import)

_flags = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = xla_flags.merged(_flags, None if xla_flags.DEVICE_COUNT_FLAG in _flags else 8)

# One persistent XLA compilation cache per test session, shared by the xdist workers and the
# processes tests start (main.py, the two-process jobs, Ray actors, which all compile the same
# small programs again). The first process to load this file (pytest's controller) creates it;
# the others inherit the variable. A user's JAX_COMPILATION_CACHE_DIR is left alone.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _cache_dir = tempfile.mkdtemp(prefix="coder-test-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

# Artifacts every test process of the session shares (the toy policies' format checks, or their
# fits when the committed ones do not apply: tests/rl_toy.py fitted_policy): made by whichever
# process needs one first, under a file lock, in a directory the controller creates and removes.
if "CODER_TEST_SHARED_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _shared_dir = tempfile.mkdtemp(prefix="coder-test-shared-")
    os.environ["CODER_TEST_SHARED_DIR"] = _shared_dir
    atexit.register(shutil.rmtree, _shared_dir, ignore_errors=True)

import json  # noqa: E402

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """The longest modules first (tests/durations.json, which scripts/test_durations.py writes
    from a run's JUnit XML or a CODER_TEST_TIMELINE file), each module's tests together and in
    their order. With -n, xdist hands out whole modules in this order (pytest.ini: `--dist
    loadfile --no-loadscope-reorder`), the next to whichever worker has at most two tests left:
    longest first, so the short modules at the end fill the workers' last gaps. (xdist's default
    `load` sends each worker a contiguous quarter of its share first: one worker got every
    multi-process module and finished 70 s after the other, and a module split over two
    workers builds its module fixtures twice.) A module the file does not list counts as short;
    a stale file only orders less well."""
    path = os.path.join(os.path.dirname(__file__), "durations.json")
    if not os.path.exists(path):
        return
    with open(path) as f:
        seconds = json.load(f)
    module = lambda item: item.nodeid.split("::")[0]
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        first.setdefault(module(item), i)
    items.sort(key=lambda item: (-seconds.get(module(item), 0.0), first[module(item)]))
    # The toy policy (fixture toy_policy) is loaded and its format checked once per session under
    # a file lock (fitted there when the committed fit does not apply, ~80 s): when the first two
    # tests both need it, xdist hands them to the two workers and one waits idle for the other.
    # The longest module that does not need it goes second instead.
    needs = {module(it) for it in items if "toy_policy" in it.fixturenames}
    if items and module(items[0]) in needs:
        free = next((it for it in items if module(it) not in needs), None)
        if free is not None:
            moved = [it for it in items if module(it) == module(free)]
            rest = [it for it in items if module(it) != module(free)]
            items[:] = rest[:1] + moved + rest[1:]


@pytest.fixture(scope="session")
def dates_repo_task(tmp_path_factory):
    """A repository task (task format v2) over a two-commit git repository whose second commit
    ("speed up parse_iso") brought a bug: `.task`, and `.solution` ({path: fixed text})."""
    import subprocess
    import types

    from coder.env.tasks import Task

    def git(*args):
        env = {"PATH": os.environ["PATH"], "HOME": str(src), "GIT_CONFIG_NOSYSTEM": "1", "GIT_AUTHOR_NAME": "a",
               "GIT_AUTHOR_EMAIL": "a@x", "GIT_COMMITTER_NAME": "a", "GIT_COMMITTER_EMAIL": "a@x"}
        return subprocess.run(["git", "-c", "init.defaultBranch=main", *args], cwd=src, env=env, check=True,
                              capture_output=True, text=True).stdout.strip()

    buggy = ('def parse_iso(text):\n    """The (year, month, day) of an ISO date string."""\n'
             '    return tuple(int(p) for p in text[:-1].split("-"))\n')
    fixed = buggy.replace("text[:-1]", "text")
    test = "from pkg.dates import parse_iso\n\n\ndef test_parse_iso():\n    assert parse_iso('2024-01-31') == (2024, 1, 31)\n"
    src = tmp_path_factory.mktemp("dates")
    git("init", "-q")
    (src / "pkg").mkdir()
    (src / "tests").mkdir()
    (src / "pkg" / "__init__.py").write_text("")
    (src / "pkg" / "dates.py").write_text(fixed)
    (src / "pkg" / "util.py").write_text("def clamp(x, lo, hi):\n    return max(lo, min(x, hi))\n")
    (src / "tests" / "test_dates.py").write_text(test)
    git("add", ".")
    git("commit", "-qm", "dates: parse_iso")
    (src / "pkg" / "dates.py").write_text(buggy)
    git("commit", "-qam", "speed up parse_iso")
    task = Task("repo/dates/1", "parse_iso returns the wrong day for '2024-01-31'. Fix it.", {},
                {"tests/test_dates.py": test}, repo=str(src), commit=git("rev-parse", "HEAD"),
                test_command="python -m pytest -q tests", metadata={"repo": "example/dates"})
    return types.SimpleNamespace(task=task, solution={"pkg/dates.py": fixed})


@pytest.fixture(scope="session")
def toy_policy():
    """tests/rl_toy.py's tiny model SFT-ed on the submit-call format (the committed fit, or one
    made once per session; every xdist worker loads the same file), its call format checked once
    per session: `rl_toy.ToyPolicy(tokenizer, stage_len, state, format)`."""
    from tests import rl_toy

    return rl_toy.fitted_policy(os.environ["CODER_TEST_SHARED_DIR"])


@pytest.fixture
def quickstart_grpo():
    """configs/quickstart.py's config as stage grpo runs it (its derive, and the context longctx
    extended the model to): the 2-layer MoE with one MTP module, rl.context_budget 1024, 32
    engine slots (rl.tasks_per_step 4 x rl.group_size 8). The start-up checks' tests."""
    from coder.stages import stage_config
    from configs import quickstart

    c = quickstart.get_config()
    c.model.max_position_embeddings = c.longctx.seq_len
    return stage_config("grpo", c)


_TINY_CORE = '''def add(a, b):
    return a + b


def clamp(x, lo, hi):
    if x < lo:
        return lo
    if x > hi:
        return hi
    return x
'''
_TINY_TEXT = '''def shout(text, times=1):
    words = [w.upper() for w in text.split()]
    return " ".join(words) + "!" * times


def initials(text):
    return "".join(w[0] for w in text.split() if w)
'''
_TINY_TESTS = '''from tinypkg7 import add, clamp
from tinypkg7.text import initials, shout


def test_add():
    assert add(2, 3) == 5


def test_clamp_low():
    assert clamp(-4, 0, 10) == 0


def test_clamp_high():
    assert clamp(14, 0, 10) == 10


def test_clamp_inside():
    assert clamp(4, 0, 10) == 4


def test_shout():
    assert shout("a b", 2) == "A B!!"


def test_initials():
    assert initials("portable network graphics") == "png"
'''
_TINY_MEAN = '''

def mean(xs):
    xs = list(xs)
    return sum(xs) / len(xs)
'''
# tinypkg7's two releases; 1.1.0 adds `mean` (and its test), its changelog says so
TINY_RELEASES = {
    "1.0.0": {"tinypkg7/__init__.py": _TINY_CORE, "tinypkg7/text.py": _TINY_TEXT,
              "tests/test_core.py": _TINY_TESTS,
              "CHANGELOG.md": "# Changelog\n\n## 1.0.0\n\n- First release\n"},
    "1.1.0": {"tinypkg7/__init__.py": _TINY_CORE + _TINY_MEAN, "tinypkg7/text.py": _TINY_TEXT,
              "tests/test_core.py": _TINY_TESTS + "\n\ndef test_mean():\n    from tinypkg7 import mean\n"
                                                 "    assert mean([1, 2, 6]) == 3\n",
              "CHANGELOG.md": "# Changelog\n\n## 1.1.0\n\n- Added `mean` ([#4](https://x/4))\n\n"
                              "## 1.0.0\n\n- First release\n"},
}


@pytest.fixture(scope="session")
def tiny_package_index(tmp_path_factory):
    """A package index's JSON API on disk, `file://<dir>` (coder.env.sources.pypi reads it as it reads
    PyPI's): the sdists of package tinypkg7's two releases (TINY_RELEASES), whose tasks are held
    out (coder.env.sources.releases.split_of)."""
    import hashlib
    import io
    import tarfile

    root = tmp_path_factory.mktemp("index")
    files = {}
    for i, (version, tree) in enumerate(TINY_RELEASES.items()):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            for path, text in tree.items():
                data = text.encode()
                info = tarfile.TarInfo(f"tinypkg7-{version}/{path}")
                info.size, info.mtime = len(data), 1_700_000_000
                tar.addfile(info, io.BytesIO(data))
        sdist = root / f"tinypkg7-{version}.tar.gz"
        sdist.write_bytes(buf.getvalue())
        files[version] = [{"packagetype": "sdist", "url": sdist.as_uri(), "filename": sdist.name,
                           "digests": {"sha256": hashlib.sha256(buf.getvalue()).hexdigest()},
                           "upload_time_iso_8601": f"2026-0{i + 1}-01T00:00:00Z"}]
    (root / "tinypkg7").mkdir()
    (root / "tinypkg7" / "json").write_text(json.dumps({"releases": files}))
    return root.as_uri()


@pytest.fixture(scope="session")
def generated_package_tasks(tiny_package_index, tmp_path_factory):
    """Repository tasks generated from tinypkg7's releases on `tiny_package_index`, verified in
    their sandboxes: ((feature task, its changed files after the fix), (bug task, its reference
    files)); the feature task's `repo` is the release mirror (both releases' commits)."""
    from coder.env.sources import package_mutants, releases
    from coder.env.sources import repo as repo_lib

    work = tmp_path_factory.mktemp("generated")
    options = releases.Options(history=0, environment={}, timeout_s=60)
    [(feature, _)], dropped = releases.package_tasks(
        "tinypkg7==1.1.0", str(work / "repos"), cache=str(work / "sdists"), options=options,
        index=tiny_package_index)
    assert not dropped
    after = {p: repo_lib.git(f"--git-dir={feature.repo}", "show", f"{feature.metadata['to_commit']}:{p}")
             for p in feature.metadata["files_changed"]}
    [(bug, reference)], _ = package_mutants.mutant_tasks(
        "tinypkg7==1.1.0", str(work / "repos"), n=1, seed=1, cache=str(work / "sdists"),
        options=options, index=tiny_package_index, tries=12)
    return (feature, after), (bug, reference)


if os.environ.get("CODER_TEST_TIMELINE"):
    import time as _time

    import resource as _resource

    def _cpu_seconds() -> float:
        """User + system CPU of this process and of its children that have exited (the
        subprocesses a test starts, Ray's processes included once reaped)."""
        return sum(u.ru_utime + u.ru_stime for u in (_resource.getrusage(_resource.RUSAGE_SELF),
                                                      _resource.getrusage(_resource.RUSAGE_CHILDREN)))

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        t0, cpu0 = _time.time(), _cpu_seconds()
        yield
        with open(os.environ["CODER_TEST_TIMELINE"], "a") as f:
            f.write(json.dumps({"worker": os.environ.get("PYTEST_XDIST_WORKER", "-"), "test": item.nodeid,
                                "start": t0, "end": _time.time(), "cpu": _cpu_seconds() - cpu0}) + "\n")
