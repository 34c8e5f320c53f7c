"""Prepared workspaces: G rollouts fork one prepared tree, each isolated from the others."""

import os

import pytest

from coder.env.runtime import sandbox as sandbox_lib
from coder.env.runtime.prepared import PreparedWorkspaces
from coder.env.runtime.sandbox import Sandbox
from coder.env.tasks import Task

BIG = "x = 1\n" * 350_000  # 2.1 MB: copying it would show in the upper layer


def _task(tid="t"):
    return Task(tid, "", {"answer.py": "def f():\n    return 0\n", "pkg/big.py": BIG}, {})


def _mounted(path: str) -> bool:
    with open("/proc/self/mountinfo") as f:
        return f" {os.path.realpath(path)} " in f.read()


def _upper_bytes(sb: Sandbox) -> int:
    total = 0
    for dirpath, _, files in os.walk(os.path.join(sb.dir, "upper")):
        total += sum(os.lstat(os.path.join(dirpath, f)).st_blocks * 512 for f in files)
    return total


@pytest.fixture(params=["overlay", "copy"])
def cache(request, tmp_path, monkeypatch):
    root = str(tmp_path / "boxes")
    if request.param == "copy":
        monkeypatch.setattr(sandbox_lib, "overlay_available", lambda root: False)
    elif not sandbox_lib.overlay_available(root if os.path.isdir(root) else str(tmp_path)):
        pytest.skip("overlayfs needs root on the host and a kernel that mounts it here")
    c = PreparedWorkspaces(root)
    yield c
    c.close()


def test_rollouts_fork_one_prepared_tree_and_stay_isolated(cache):
    task = _task()
    base = cache.get(task)
    assert cache.get(task) == base and cache.built == 1  # prepared once
    boxes = [Sandbox(task, root=cache.root, base=base) for _ in range(3)]
    try:
        for i, sb in enumerate(boxes):
            assert sb.copy_on_write == (sandbox_lib.overlay_available(cache.root))
            r = sb.run(f"echo 'def f():\n    return {i}' > answer.py && touch mine{i} && id -u")
            assert r.exit_code == 0 and r.stdout.strip() == str(sb._inner_uid), r.stderr
        for i, sb in enumerate(boxes):
            assert sb.read("answer.py") == f"def f():\n    return {i}\n"
            assert sorted(f for f in sb.list_files() if f.startswith("mine")) == [f"mine{i}"]
            assert sb.read("pkg/big.py") == BIG
            if sb.copy_on_write:  # metadata copied up for the sandbox's uid, not the 2 MB
                assert _upper_bytes(sb) < 200_000
        with open(os.path.join(base, "answer.py")) as f:
            assert f.read() == task.files["answer.py"]  # the prepared tree is untouched
        assert not os.path.exists(os.path.join(base, "mine0"))
        sb = boxes[0]
        sb.run("sleep 100 & rm -rf pkg; echo new > extra")
        sb.reset()  # back to the prepared state
        assert sorted(sb.list_files()) == ["answer.py", "pkg/big.py"]
        assert sb.read("answer.py") == task.files["answer.py"]
        assert sb.run("cat answer.py").stdout == task.files["answer.py"]
    finally:
        for sb in boxes:
            ws = sb.workspace
            sb.close()
            assert not _mounted(ws) and not os.path.exists(ws)


def test_a_changed_task_is_prepared_again_and_old_trees_are_evicted(tmp_path):
    cache = PreparedWorkspaces(str(tmp_path / "boxes"), max_entries=2)
    try:
        a = cache.get(_task("a"))
        changed = Task("a", "", {"answer.py": "other\n"}, {})
        assert cache.get(changed) != a and cache.built == 2
        cache.get(_task("b"))
        assert cache.built == 3 and not os.path.exists(a)  # least recently used, unused: gone
    finally:
        cache.close()
    assert not os.path.exists(cache.dir)


def test_a_dead_process_overlay_is_unmounted_and_reaped(tmp_path):
    root = str(tmp_path / "boxes")
    os.makedirs(root)
    if not sandbox_lib.overlay_available(root):
        pytest.skip("overlayfs needs root on the host and a kernel that mounts it here")
    cache = PreparedWorkspaces(root)
    sb = Sandbox(_task(), root=root, base=cache.get(_task()))
    assert _mounted(sb.workspace)
    with open(os.path.join(sb.dir, "owner"), "w") as f:
        f.write("999999999 1")  # as if its process had been killed before close()
    assert sandbox_lib.reap_stale(root) == 1
    assert not _mounted(sb.workspace) and not os.path.exists(sb.dir)
    sb.close()
    cache.close()
