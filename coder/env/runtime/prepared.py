"""Prepared workspaces: a task's starting tree is built once per process and every rollout of
the task starts from it (`Sandbox(task, base=...)`: an overlayfs copy-on-write view, or a copy
where overlayfs is not available).

A GRPO group runs G rollouts of one task and the agent eval K samples of each task: before,
every one of them rebuilt the workspace from the task (writing each file, and for a repository
task checking it out); now the G rollouts fork one prepared tree, and starting a rollout costs a
mount, whatever the repository's size (bench/env.py measures both).

The cache lives in `<sandbox root>/prepared-<id>/`, a directory with an `owner` file like a
sandbox's, so `reap_stale` deletes it when its process dies without cleaning up. Entries are
keyed by the task's id and content (a changed task is prepared again) and evicted least recently
used first. An evicted tree that a live overlay still uses as its lower layer is deleted only
once no mount names it (overlayfs forbids changing a lower layer under a mount).
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import stat
import tempfile
import threading
import weakref

from coder.env.runtime.sandbox import Limits, Sandbox, _process_identity
from coder.env.tasks import content_id


def task_key(task) -> str:
    """Id and content of the task (files, repository, commit, setup: what the tree is made of)."""
    return content_id(task.id, json.dumps(task.to_json(), sort_keys=True, default=str))


def _open_to_every_uid(tree: str) -> None:
    """a+rw on files (a+x where some x bit is set), a+rwx on directories: each rollout's sandbox
    has its own uid, and giving it the tree by permission costs nothing under the overlay where
    chown copies every inode (coder.env.runtime.sandbox.Sandbox._start_from_base). Only the overlay's
    view is writable: the tree itself sits in a root-only directory."""
    for dirpath, dirnames, filenames in os.walk(tree):
        os.chmod(dirpath, 0o777)
        for name in filenames:
            full = os.path.join(dirpath, name)
            mode = os.lstat(full).st_mode
            if stat.S_ISREG(mode):
                os.chmod(full, 0o777 if mode & 0o111 else 0o666)


class PreparedWorkspaces:
    """An LRU cache of prepared task trees under one sandbox root (thread-safe)."""

    def __init__(self, root: str | None = None, limits: Limits | None = None, max_entries=64):
        self.root = root or os.path.join(tempfile.gettempdir(), "coder-sandboxes")
        self.limits = limits
        self.max_entries = max_entries
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        self.dir = os.path.realpath(tempfile.mkdtemp(prefix="prepared-", dir=self.root))
        with open(os.path.join(self.dir, "owner"), "w") as f:
            f.write(_process_identity(os.getpid()) or "")
        self._entries: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._retired: list[str] = []  # evicted, deleted once no overlay uses them
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, shutil.rmtree, self.dir, True)
        self.built = 0  # trees prepared (misses), for tests and stats

    def get(self, task) -> str:
        """Path of the task's prepared starting tree (read-only by convention: never write)."""
        key = task_key(task)
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return self._entries[key]
            path = os.path.join(self.dir, key)
            # Through a sandbox, so the tree is exactly what `Sandbox(task)` would start from.
            with Sandbox(task, limits=self.limits, root=self.root) as sb:
                shutil.copytree(sb.workspace, path + ".tmp", symlinks=True)
            _open_to_every_uid(path + ".tmp")
            os.rename(path + ".tmp", path)
            self.built += 1
            self._entries[key] = path
            while len(self._entries) > self.max_entries:
                self._retired.append(self._entries.popitem(last=False)[1])
            self._purge_retired()
            return path

    def _purge_retired(self) -> None:
        if not self._retired:
            return
        with open("/proc/self/mountinfo") as f:
            mounts = f.read()
        keep = []
        for path in self._retired:
            if f"lowerdir={path}" in mounts:
                keep.append(path)
            else:
                shutil.rmtree(path, ignore_errors=True)
        self._retired = keep

    def close(self) -> None:
        self._finalizer()


_CACHES: dict[tuple, PreparedWorkspaces] = {}
_CACHES_LOCK = threading.Lock()


def prepared(root: str | None, limits: Limits | None) -> PreparedWorkspaces:
    """This process's cache for a sandbox root (episodes of one pool worker share it)."""
    key = (root, limits, os.getpid())
    with _CACHES_LOCK:
        if key not in _CACHES:
            _CACHES[key] = PreparedWorkspaces(root, limits)
        return _CACHES[key]
