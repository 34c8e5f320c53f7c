"""Sandboxed workspaces: every command of a rollout runs under bubblewrap.

A `Sandbox` owns one host directory (`<root>/<uid>/`) holding the workspace (`ws/`, mounted at
`/workspace` inside) and a few generated system files. Each `run()` starts a fresh bwrap:

  bwrap  (as root on the host; new pid, net, ipc, uts, cgroup namespaces)
    └ setpriv --reuid U --regid U   drop to the sandbox's own unprivileged uid, no capabilities,
      └ prlimit ...                 CPU, address space, processes, file size, open files, core
        └ /bin/bash -c CMD

Why a per-sandbox uid: RLIMIT_NPROC counts the processes of a *real* uid and is ignored for uid 0,
so the agent must run as an uid nobody else uses; the uid is allocated by `mkdir <root>/<uid>`
(atomic), which also makes that directory the sandbox's private home on the host.

What the agent sees: /usr (and /bin, /lib symlinks), the running Python's prefixes read-only (so
`python -m pytest` and ruff work inside), a synthetic /etc/passwd, a private size-limited /tmp,
/proc of its own pid namespace, a minimal /dev, and /workspace (the only writable host path).
No network (an empty network namespace), no host home, no /work, no host /tmp.

A task with an `environment` (coder/env/runtime/environments.py) runs in its venv: built once per spec
on the host, bound read-only at its own path, its `bin/` first on PATH instead of the host
interpreter's (so `python` and `pytest` are the venv's and see only its packages).

A v2 task's workspace is its repository's tree at `commit` (coder/env/sources/repo.py: no later
history, `Limits.history_depth` commits of earlier history; prepared once per process and
copied in), then `task.files`, then its `setup` run.

The workspace's own top-level modules are hidden everywhere else: each installed copy of a module
or package the task defines (in every interpreter's standard library and site-packages visible
inside) shows the task's starting text, and its bytecode shows empty. A stdlib bug-fix task's
reference solution is the installed module; without this, `import M; open(M.__file__)` handed
it to the agent (`installed_copies`, `Sandbox._shadow_installed`).

Every `run()` is a new process tree: shell state (cwd, variables, background jobs) does not
survive between commands. When the command's main process exits, bwrap's init exits and the
kernel kills everything left in the pid namespace; on a timeout the host kills bwrap, which
takes the namespace down the same way (`--die-with-parent`). The agent's shell is the one
exception: `start()` runs a long-lived process under the same bwrap command line, the bash of
coder.env.runtime.terminal, whose state persists between calls and which `close()` kills.

Snapshots are in-memory copies of the workspace's files (workspaces are small: a module and its
tests), so they can be pickled to pool workers; restore rewrites the tree. Host-side reads and
writes resolve paths and refuse anything that lands outside the workspace (symlinks, `..`); this
is race-free only while no agent process runs: `run()`'s are gone when it returns, and the
tools stop the terminal's around their host-side file access (`Terminal.frozen`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import os
import random
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Mapping

from coder.env.runtime import environments, images
from coder.env.sources import repo as repo_lib
from coder.env.runtime.installed import (installed_copies, installed_copies_in, python_prefixes,
                                 workspace_modules)

WORKDIR = "/workspace"  # where the workspace is mounted inside the sandbox
_UID_BASE = 200_000  # sandbox uids: [_UID_BASE, _UID_BASE + _UID_RANGE), unused on the host
_UID_RANGE = 50_000
_TRUNC_MARKER = "\n[... output truncated: {n} bytes omitted ...]\n"


class InfraError(RuntimeError):
    """The harness failed, not the agent: RL masks the rollout instead of scoring it."""


class SandboxError(InfraError):
    """The sandbox itself failed (could not start, misconfigured, closed)."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """What `config.env` bounds in a sandbox: per-command resources (sizes in bytes, times in
    seconds) and how much of a repository task's git history is copied into the workspace.
    One value carries both because it is what every builder of a sandbox already passes along
    (episodes, pool workers, the prepared-tree cache, which it keys)."""

    timeout_s: float = 60.0  # wall time; the whole process tree is killed after it
    cpu_s: int = 60  # RLIMIT_CPU of each process
    memory_bytes: int = 2 << 30  # RLIMIT_AS of each process
    nproc: int = 64  # RLIMIT_NPROC: processes+threads of the sandbox uid
    fsize_bytes: int = 64 << 20  # RLIMIT_FSIZE: largest file a process may write
    nofile: int = 256  # RLIMIT_NOFILE
    tmp_bytes: int = 64 << 20  # size of the private /tmp and /dev/shm (tmpfs: host RAM)
    output_bytes: int = 64 << 10  # kept per stream (head + tail); the rest is counted, dropped
    history_depth: int = 1  # commits of a repository task's history in its workspace (>= 1)
    # where task environments (coder.env.runtime.environments) are built and kept; "" = the default
    environments_dir: str = ""
    # a task's `setup` runs with the host's network (to fetch what it installs); the agent's
    # commands and scoring never have one
    setup_network: bool = False

    def __post_init__(self):
        if int(self.history_depth) < 1:
            raise ValueError(f"env.history_depth={self.history_depth}: at least 1 (the task's "
                             "commit itself; 1 copies no earlier history)")
        environments.check_dir(self.environments_dir)

    @classmethod
    def from_config(cls, env_cfg) -> "Limits":
        """Limits from the `env` section of configs/base.py."""
        return cls(
            timeout_s=float(env_cfg.timeout_s),
            cpu_s=int(env_cfg.cpu_s),
            memory_bytes=int(env_cfg.memory_mb) << 20,
            nproc=int(env_cfg.nproc),
            fsize_bytes=int(env_cfg.fsize_mb) << 20,
            tmp_bytes=int(env_cfg.tmp_mb) << 20,
            output_bytes=int(env_cfg.output_kb) << 10,
            history_depth=int(env_cfg.history_depth),
            environments_dir=str(env_cfg.environments_dir),
            setup_network=bool(env_cfg.setup_network),
        )


# the host's name resolution and certificates, for a command given the network (a task's setup)
_NETWORK_ETC = ("resolv.conf", "hosts", "nsswitch.conf", "host.conf", "gai.conf", "ssl", "ca-certificates",
                "pki")


@dataclasses.dataclass(frozen=True)
class Result:
    exit_code: int  # the command's exit status (128 + signal when killed; -9 on timeout)
    stdout: str
    stderr: str
    timed_out: bool
    truncated: bool  # some output was dropped (a marker says how much)
    duration_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """Workspace contents: relative path -> (mode, bytes) for files, -> target for symlinks."""

    files: tuple  # ((rel, mode, data), ...)
    symlinks: tuple  # ((rel, target), ...)
    dirs: tuple  # ((rel, mode), ...) including empty directories

    @property
    def nbytes(self) -> int:
        return sum(len(d) for _, _, d in self.files)


def find_bwrap() -> str:
    path = shutil.which("bwrap")
    if path is None:
        raise SandboxError(
            "bubblewrap (bwrap) is not installed: install the Debian/Ubuntu package `bubblewrap` "
            "(apt-get install bubblewrap; scripts/setup.sh does it)"
        )
    return path


@functools.lru_cache(maxsize=None)
def overlay_available(root: str) -> bool:
    """Whether this process can mount an overlayfs workspace under `root` (root on the host,
    a kernel with overlayfs). Probed once per root by mounting one."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    probe = tempfile.mkdtemp(prefix=".overlay-probe-", dir=root)
    try:
        dirs = [os.path.join(probe, d) for d in ("lower", "upper", "work", "merged")]
        for d in dirs:
            os.mkdir(d)
        ok = _mount_overlay(*dirs)
        _unmount(dirs[3])
        return ok
    finally:
        shutil.rmtree(probe, ignore_errors=True)


def _mount_overlay(lower: str, upper: str, work: str, merged: str) -> bool:
    # volatile: a rollout's upper layer is scratch, never synced to disk
    opts = f"lowerdir={lower},upperdir={upper},workdir={work},volatile"
    r = subprocess.run(
        ["mount", "-t", "overlay", "overlay", "-o", opts, merged], capture_output=True, check=False
    )
    return r.returncode == 0


def task_checkout(task, depth: int = 1) -> "repo_lib.Checkout":
    """The prepared tree of a v2 task's repository at its commit, with `depth` commits of
    history (SandboxError if it cannot be made)."""
    try:
        return repo_lib.checkout(task.repo, task.commit, depth=depth)
    except repo_lib.RepoError as e:
        raise SandboxError(f"task {task.id!r}: {e}") from e


def starting_files(task, depth: int = 1) -> Mapping:
    """{path: text} the agent starts from: `task.files` over, for a v2 task, every tracked file
    of its repository at `commit` (read lazily: only the modules `_shadow_installed` stages;
    `depth`: the checkout the sandbox copies, so no second one is made)."""
    if not getattr(task, "repo", ""):
        return task.files
    return collections.ChainMap(task.files, task_checkout(task, depth).files())


def _stream_cap(limit: int):
    """Return (feed, finish) keeping the first and last limit/2 bytes of a stream."""
    head, tail = bytearray(), bytearray()
    half = max(limit // 2, 1)
    dropped = [0]

    def feed(chunk: bytes):
        room = half - len(head)
        if room > 0:
            head.extend(chunk[:room])
            chunk = chunk[room:]
        if chunk:
            tail.extend(chunk)
            if len(tail) > 2 * half:  # amortised trim: keep the last `half` bytes
                extra = len(tail) - half
                dropped[0] += extra
                del tail[:extra]

    def finish() -> tuple[str, bool]:
        if len(tail) > half:
            dropped[0] += len(tail) - half
            del tail[: len(tail) - half]
        text = head.decode("utf-8", "replace")
        if dropped[0]:
            text += _TRUNC_MARKER.format(n=dropped[0])
        return text + tail.decode("utf-8", "replace"), dropped[0] > 0

    return feed, finish


def _read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _unmount(path: str) -> None:
    """Detach an overlay workspace (lazily: a process still inside cannot keep it busy)."""
    if os.path.ismount(path):
        subprocess.run(["umount", "-l", path], capture_output=True, check=False)


def _cleanup(path: str, procs: set) -> None:
    for p in list(procs):
        _kill_group(p)
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
    _unmount(os.path.join(path, "ws"))  # before deleting: rmtree must not walk into a mount
    shutil.rmtree(path, ignore_errors=True)


def _process_identity(pid: int) -> str | None:
    """'pid starttime' of a live process (pids are reused; start times tell them apart)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat_fields = f.read().rsplit(")", 1)[1].split()
        return f"{pid} {stat_fields[19]}"
    except (OSError, IndexError):
        return None


def reap_stale(root: str) -> int:
    """Delete sandbox directories whose owning process is gone (it was killed before close());
    returns how many. Their commands died with them (bwrap --die-with-parent)."""
    n = 0
    for name in os.listdir(root) if os.path.isdir(root) else []:
        path = os.path.join(root, name)
        try:
            with open(os.path.join(path, "owner")) as f:
                owner = f.read().strip()
        except OSError:
            continue  # being created right now, or not ours
        if owner and _process_identity(int(owner.split()[0])) != owner:
            _unmount(os.path.join(path, "ws"))
            shutil.rmtree(path, ignore_errors=True)
            n += 1
    return n


_REAPED: set = set()


class Sandbox:
    """One isolated workspace. `Sandbox(task)` copies the task's starting workspace in
    (`_populate`: a v2 task's repository tree, then `task.files`); see the module docstring.

    Use as a context manager or call `close()`; a finalizer cleans up if neither happens.
    """

    def __init__(
        self,
        task=None,
        limits: Limits | None = None,
        root: str | None = None,
        snapshot: Snapshot | None = None,
        base: str | None = None,
    ):
        self.limits = limits or Limits()
        self.base = base
        self.copy_on_write = False  # the workspace is an overlay over `base` (see _start_from_base)
        self._bwrap = find_bwrap()
        self._privileged = os.geteuid() == 0
        root = root or os.path.join(tempfile.gettempdir(), "coder-sandboxes")
        os.makedirs(root, mode=0o700, exist_ok=True)
        if root not in _REAPED:  # once per process and root
            _REAPED.add(root)
            reap_stale(root)
        self.uid, self.dir = self._allocate(root)
        self._procs: set = set()
        self._finalizer = weakref.finalize(self, _cleanup, self.dir, self._procs)
        try:
            self.workspace = os.path.join(self.dir, "ws")
            os.mkdir(self.workspace, 0o755)
            self._chown(self.workspace)
            self._write_etc()
            self._prefixes = python_prefixes()
            self.image: images.Image | None = None
            self.environment = self._environment(task)
            depth = self.limits.history_depth
            self._shadows = (
                self._shadow_installed(starting_files(task, depth)) if task is not None else ()
            )
            if base is not None:
                self._start_from_base(root)
            # An image may lack `id`: bash knows its uid itself.
            bash = self.image is not None and self.image.shell.endswith("bash")
            probe = self.run("echo $UID" if bash else "id -u", timeout_s=30)
            if probe.exit_code != 0 or probe.stdout.strip() != str(self._inner_uid):
                raise SandboxError(
                    f"sandbox failed to start (exit {probe.exit_code}): {probe.stderr.strip()[:500]}"
                )
            if snapshot is not None:
                self.restore(snapshot)
            elif task is not None and base is None:
                self._populate(task)
        except BaseException:
            self.close()
            raise

    # ---- lifecycle -------------------------------------------------------------------------
    @staticmethod
    def _allocate(root: str) -> tuple[int, str]:
        rng = random.Random(os.getpid() ^ time.monotonic_ns())
        start = rng.randrange(_UID_RANGE)
        for i in range(_UID_RANGE):
            uid = _UID_BASE + (start + i) % _UID_RANGE
            path = os.path.join(root, str(uid))
            try:
                os.mkdir(path, 0o700)
            except FileExistsError:
                continue
            with open(os.path.join(path, "owner"), "w") as f:
                f.write(_process_identity(os.getpid()) or "")
            return uid, path
        raise SandboxError(f"no free sandbox uid under {root}")

    @property
    def _inner_uid(self) -> int:
        return self.uid if self._privileged else os.getuid()

    @property
    def _owner_uid(self) -> int:
        return self.uid if self._privileged else os.getuid()

    def _chown(self, path: str) -> None:
        if self._privileged:
            os.lchown(path, self.uid, self.uid)

    def _write_etc(self) -> None:
        etc = os.path.join(self.dir, "etc")
        os.mkdir(etc, 0o755)
        u = self._inner_uid
        with open(os.path.join(etc, "passwd"), "w") as f:
            f.write(f"root:x:0:0:root:/root:/bin/sh\nagent:x:{u}:{u}:agent:/tmp:/bin/sh\n")
        with open(os.path.join(etc, "group"), "w") as f:
            f.write(f"root:x:0:\nagent:x:{u}:\n")
        for name in ("passwd", "group"):
            os.chmod(os.path.join(etc, name), 0o644)

    def _environment(self, task) -> environments.Environment | None:
        """The task's built environment (None without one), built now if it is not yet: a
        failed build is a SandboxError naming the task and the spec, never a silent run on the
        host's packages."""
        if task is None:
            return None
        spec = environments.normalize(
            getattr(task, "environment", None), f"task {task.id!r}: environment"
        )
        if not spec:
            return None
        directory = environments.check_dir(self.limits.environments_dir)
        if "image" in spec:
            try:
                self.image = images.ensure(spec["image"], directory)
            except images.ImageError as e:
                raise SandboxError(f"task {task.id!r}: image {spec['image']}: {e}") from e
            return None
        try:
            return environments.ensure(spec, directory)
        except environments.BuildError as e:
            raise SandboxError(
                f"task {task.id!r}: environment {json.dumps(spec, sort_keys=True)}: {e}"
            ) from e

    def _populate(self, task) -> None:
        """Write the task's starting workspace: a v2 task's repository at its commit (a copy of
        the tree `coder.env.sources.repo` prepared once per process, owned by the sandbox's user), then
        `task.files` over it, then the task's `setup` commands run inside (a failure is an
        infrastructure error naming the task)."""
        if task.repo:
            try:
                co = task_checkout(task, self.limits.history_depth)
                repo_lib.copy_into(co, self.workspace, self.uid if self._privileged else None)
            except repo_lib.RepoError as e:
                raise SandboxError(f"task {task.id!r}: {e}") from e
        for path, text in task.files.items():
            self.write(path, text)
        if task.setup:
            r = self.run(task.setup, network=self.limits.setup_network)
            if r.exit_code != 0:
                raise SandboxError(
                    f"task {task.id!r}: setup failed (exit {r.exit_code}): "
                    f"{(r.stdout + r.stderr).strip()[-1000:]}"
                )

    def _start_from_base(self, root: str) -> None:
        """Make the workspace a copy of the prepared directory `self.base`, which is never
        modified. With overlayfs (root on the host) the workspace is an overlay mount whose lower
        layer is `base`: starting costs a mount, whatever the size of the tree, and a rollout's
        writes land in this sandbox's own upper layer (the G rollouts of a group share one
        prepared tree). Elsewhere the tree is copied.

        The prepared tree is world-writable (coder.env.runtime.prepared) instead of owned by this
        sandbox's uid: chown-ing it through the overlay copies every inode up (0.7 ms a file,
        1.4 s for a 2000-file repository), while the permission bits need no copy. Files the
        agent creates are its own; `git` is told to trust the tree (safe.directory in _argv)."""
        if not os.path.isdir(self.base):
            raise SandboxError(f"prepared workspace {self.base} does not exist")
        if overlay_available(root):
            upper, work = os.path.join(self.dir, "upper"), os.path.join(self.dir, "work")
            for d in (upper, work):
                os.mkdir(d, 0o755)
            self._chown(upper)
            if not _mount_overlay(os.path.realpath(self.base), upper, work, self.workspace):
                raise SandboxError(f"could not mount an overlay over {self.base}")
            self.copy_on_write = True
        else:
            shutil.copytree(self.base, self.workspace, symlinks=True, dirs_exist_ok=True)
            if self._privileged:
                for dirpath, dirnames, filenames in os.walk(self.workspace):
                    for name in dirnames + filenames:
                        os.lchown(os.path.join(dirpath, name), self.uid, self.uid)
        self._chown(self.workspace)

    def reset(self) -> None:
        """Back to the prepared state `base` (a new rollout in the same sandbox): with overlayfs
        the upper layer is dropped and remounted, in milliseconds whatever the tree's size."""
        if self.base is None:
            raise SandboxError("reset() needs a sandbox started from a prepared base")
        if self.closed:
            raise SandboxError("sandbox is closed")
        for p in list(self._procs):
            _kill_group(p)
        if self.copy_on_write:
            _unmount(self.workspace)
            for d in ("upper", "work"):
                shutil.rmtree(os.path.join(self.dir, d))
            self.copy_on_write = False
        else:
            shutil.rmtree(self.workspace)
            os.mkdir(self.workspace, 0o755)
        self._start_from_base(os.path.dirname(self.dir))

    def _shadow_installed(self, files: Mapping) -> tuple:
        """((host path, inner path), ...) read-only mounts that hide every installed copy of the
        workspace's own modules behind the task's starting text of that module.

        Why: a stdlib bug-fix task's reference solution *is* the installed module, and a release
        task's is the next version of an installed package; any path that reads an installed
        copy (`import M; open(M.__file__)`, `cat`, the `.pyc`, another interpreter's standard
        library) would hand the agent the answer. Showing the starting text (not an empty file)
        keeps working whatever imports M before the workspace is on sys.path (pytest itself);
        bytecode is shown empty, which importlib treats as stale and recompiles."""
        mounts = []
        shadow = os.path.join(self.dir, "shadow")
        empty = os.path.join(shadow, ".empty")
        for name, paths in workspace_modules(files).items():
            if self.image is not None:  # the image's own installations, at their inner paths
                rootfs = self.image.rootfs
                copies = tuple("/" + os.path.relpath(c, rootfs)
                               for c in installed_copies_in(name, rootfs))
            else:
                copies = installed_copies(
                    name, (self.environment.path,) if self.environment else ())
            if not copies:
                continue
            os.makedirs(shadow, 0o755, exist_ok=True)
            if not os.path.exists(empty):
                open(empty, "wb").close()
                os.chmod(empty, 0o644)
            staged = os.path.join(shadow, name)  # the starting text: name.py or the package dir
            for path in paths:
                rel = path.split("/", 1)[1] if path.startswith("src/") else path
                dst = os.path.join(shadow, rel)
                os.makedirs(os.path.dirname(dst), 0o755, exist_ok=True)
                with open(dst, "w", encoding="utf-8") as f:
                    f.write(files[path])
                os.chmod(dst, 0o644)
            for copy in copies:
                host_copy = copy if self.image is None else self.image.host_path(copy)
                if copy.endswith(".pyc"):
                    mounts.append((empty, copy))
                elif os.path.isdir(host_copy):
                    if os.path.isdir(staged):
                        mounts.append((staged, copy))
                    else:  # the workspace has M.py, an installation has package M/
                        mounts.append((self._empty_dir(shadow), copy))
                else:
                    src = staged + ".py"
                    mounts.append((src if os.path.isfile(src) else empty, copy))
        for dirpath, dirnames, _ in os.walk(shadow):
            for d in dirnames:
                os.chmod(os.path.join(dirpath, d), 0o755)
        return tuple(mounts)

    @staticmethod
    def _empty_dir(shadow: str) -> str:
        path = os.path.join(shadow, ".empty-dir")
        os.makedirs(path, 0o755, exist_ok=True)
        return path

    def close(self) -> None:
        """Kill anything still running and delete every file of this sandbox."""
        self._finalizer()

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    # ---- commands --------------------------------------------------------------------------
    def _argv(self, cmd: str, binds: tuple, network: bool = False) -> list[str]:
        lim = self.limits
        a = [
            self._bwrap,
            "--unshare-ipc",
            "--unshare-pid",
            *(() if network else ("--unshare-net",)),
            "--unshare-uts",
            "--unshare-cgroup-try",
            "--die-with-parent",
            "--new-session",
        ]
        if self._privileged:
            a += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SETPCAP"]
        else:  # unprivileged host user: a user namespace maps the caller's own uid
            a += ["--unshare-user", "--cap-drop", "ALL"]
        img = self.image
        if img is not None:
            a += img.root_args()
        else:
            a += ["--ro-bind", "/usr", "/usr"]
            for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
                host = "/" + name
                if os.path.islink(host):
                    a += ["--symlink", os.readlink(host), host]
                elif os.path.isdir(host):
                    a += ["--ro-bind", host, host]
            a += ["--perms", "0755", "--dir", "/etc"]
            for name in ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "localtime",
                         *(_NETWORK_ETC if network else ())):
                if os.path.lexists("/etc/" + name):
                    a += ["--ro-bind", "/etc/" + name, "/etc/" + name]
        a += [
            "--ro-bind",
            os.path.join(self.dir, "etc/passwd"),
            "/etc/passwd",
            "--ro-bind",
            os.path.join(self.dir, "etc/group"),
            "/etc/group",
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            # multiprocessing's semaphores live in /dev/shm
            "--size",
            str(lim.tmp_bytes),
            "--perms",
            "1777",
            "--tmpfs",
            "/dev/shm",
            "--size",
            str(lim.tmp_bytes),
            "--perms",
            "1777",
            "--tmpfs",
            "/tmp",
        ]
        env = self.environment
        # A task environment's venv, and the installation of the interpreter it was built from
        # when that is not the host's (a `version` of its own: coder.env.runtime.environments).
        extra = [env.path] if env else []
        if env and env.base and not any(env.base == p or env.base.startswith(p + "/")
                                        for p in ["/usr", *self._prefixes]):
            extra.append(env.base)
        for prefix in ([] if img else self._prefixes) + extra:
            # Parents such as /root are 0700 on the host; inside they only need to be traversable.
            parents, p = [], os.path.dirname(prefix)
            while p not in ("/", "") and p != "/tmp":
                parents.append(p)
                p = os.path.dirname(p)
            for parent in reversed(parents):
                a += ["--perms", "0755", "--dir", parent]
            a += ["--ro-bind", prefix, prefix]
        for host, inner in self._shadows:
            a += ["--ro-bind", host, inner]
        a += ["--bind", self.workspace, WORKDIR]
        for host, inner, writable in binds:
            a += ["--bind" if writable else "--ro-bind", host, inner]
        # The running interpreter first, then its base installation's scripts (ruff, pytest);
        # with a task environment its venv's scripts instead, and none of the host's: `pytest`
        # or `python` must not fall back to the host's packages.
        bindirs = dict.fromkeys(
            [env.bin] if env else [
                os.path.dirname(sys.executable),
                os.path.join(sys.prefix, "bin"),
                os.path.join(sys.base_prefix, "bin"),
            ]
        )
        path = ":".join([*bindirs, "/usr/local/bin", "/usr/bin", "/bin"])
        if img is not None:
            path = img.path_var
        a += [
            "--chdir",
            WORKDIR,
            "--clearenv",
            *(img.setenv_args() if img is not None else []),
            "--setenv",
            "PATH",
            path,
            *(["--setenv", "VIRTUAL_ENV", env.path] if env else []),
            "--setenv",
            "HOME",
            "/tmp",
            "--setenv",
            "LANG",
            "C.UTF-8",
            "--setenv",
            "TERM",
            "dumb",
            "--setenv",
            "PYTHONDONTWRITEBYTECODE",
            "1",
            "--setenv",
            "PYTHONIOENCODING",
            "utf-8",
            "--setenv",
            "USER",
            "agent",
            # A prepared tree belongs to another uid (coder.env.runtime.prepared): git must still work.
            "--setenv",
            "GIT_CONFIG_COUNT",
            "1",
            "--setenv",
            "GIT_CONFIG_KEY_0",
            "safe.directory",
            "--setenv",
            "GIT_CONFIG_VALUE_0",
            "*",
            # The host's pytest plugins are not part of any task; no cache dir in the workspace.
            "--setenv",
            "PYTEST_DISABLE_PLUGIN_AUTOLOAD",
            "1",
            "--setenv",
            "PYTEST_ADDOPTS",
            "-p no:cacheprovider",
            "--",
        ]
        tool = (lambda name: [name]) if img is None else images.host_tool
        if self._privileged:
            a += [
                *tool("setpriv"),
                f"--reuid={self.uid}",
                f"--regid={self.uid}",
                "--clear-groups",
                "--no-new-privs",
                "--inh-caps=-all",
                "--bounding-set=-all",
                "--",
            ]
        a += [
            *tool("prlimit"),
            f"--cpu={lim.cpu_s}",
            f"--as={lim.memory_bytes}",
            f"--nproc={lim.nproc}",
            f"--fsize={lim.fsize_bytes}",
            f"--nofile={lim.nofile}",
            "--core=0",
            "--",
            "/bin/bash" if img is None else img.shell,
            "-c",
            cmd,
        ]
        return a

    def run(self, cmd: str, timeout_s: float | None = None, binds: tuple = (), network: bool = False) -> Result:
        """Run `cmd` with bash inside the sandbox (cwd /workspace). Never raises for the
        command's own failures; raises SandboxError when the sandbox is closed.

        binds: extra ((host_path, inner_path, writable), ...) mounts for this command only.
        network: the host's network namespace (and its name resolution) for this command only;
        only a task's setup asks for it (Limits.setup_network), every other command has none.
        """
        if self.closed:
            raise SandboxError("sandbox is closed")
        timeout_s = self.limits.timeout_s if timeout_s is None else timeout_s
        t0 = time.monotonic()
        proc = self._spawn(cmd, binds, stdin=subprocess.DEVNULL, network=network)
        caps = {
            proc.stdout: _stream_cap(self.limits.output_bytes),
            proc.stderr: _stream_cap(self.limits.output_bytes),
        }
        timed_out = False
        sel = selectors.DefaultSelector()
        for f in caps:
            os.set_blocking(f.fileno(), False)
            sel.register(f, selectors.EVENT_READ)
        try:
            deadline = t0 + timeout_s
            while sel.get_map():
                left = deadline - time.monotonic()
                if left <= 0 and not timed_out:
                    timed_out = True
                    _kill_group(proc)  # bwrap dies -> its pid namespace is torn down
                    deadline = time.monotonic() + 5.0  # drain what is already in the pipes
                    continue
                if left <= 0:
                    break
                for key, _ in sel.select(timeout=min(left, 1.0)):
                    try:
                        chunk = os.read(key.fd, 1 << 16)
                    except BlockingIOError:
                        continue
                    if chunk:
                        caps[key.fileobj][0](chunk)
                    else:
                        sel.unregister(key.fileobj)
            try:  # output closed (e.g. `exec >&-`) but the command may still be running
                code = proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(proc)
                code = proc.wait()
        finally:
            sel.close()
            proc.stdout.close()
            proc.stderr.close()
            if proc.poll() is None:
                _kill_group(proc)
                proc.wait()
            self._procs.discard(proc)
        stdout, trunc_o = caps[proc.stdout][1]()
        stderr, trunc_e = caps[proc.stderr][1]()
        if timed_out:
            code = -signal.SIGKILL
            stderr += (
                f"\n[command timed out after {timeout_s:g} s; all its processes were killed]\n"
            )
        return Result(code, stdout, stderr, timed_out, trunc_o or trunc_e, time.monotonic() - t0)

    def start(self, cmd: str) -> subprocess.Popen:
        """Start `cmd` (bash) as a long-lived process of this sandbox, with pipes on stdin,
        stdout and stderr (coder.env.runtime.terminal's shell). The caller reads and reaps it, then
        calls `release`; `close()` kills it if it is still registered."""
        if self.closed:
            raise SandboxError("sandbox is closed")
        return self._spawn(cmd, (), stdin=subprocess.PIPE)

    def _spawn(self, cmd: str, binds: tuple, stdin, network: bool = False) -> subprocess.Popen:
        """bwrap running `cmd` in its own session (so its group can be killed), registered for
        `close()`."""
        proc = subprocess.Popen(
            self._argv(cmd, binds, network),
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            env={"PATH": "/usr/bin:/bin"},
        )
        self._procs.add(proc)
        return proc

    def release(self, proc: subprocess.Popen) -> None:
        """Forget a process of `start` that its owner has killed and reaped."""
        self._procs.discard(proc)

    # ---- files (host side, confined to the workspace) --------------------------------------
    def resolve(self, path: str) -> str:
        """Host path of a workspace path; ValueError if it resolves outside the workspace."""
        if path.startswith(WORKDIR + "/") or path == WORKDIR:
            path = path[len(WORKDIR) :].lstrip("/") or "."
        if os.path.isabs(path):
            raise ValueError(f"{path}: absolute paths must be under {WORKDIR}")
        root = os.path.realpath(self.workspace)
        real = os.path.realpath(os.path.join(root, path))
        if real != root and not real.startswith(root + os.sep):
            raise ValueError(f"{path}: resolves outside the workspace")
        return real

    def read(self, path: str) -> str:
        real = self.resolve(path)
        if not os.path.isfile(real):
            raise FileNotFoundError(f"{path}: no such file")
        with open(real, "rb") as f:
            return f.read().decode("utf-8", "replace")

    def write(self, path: str, text: str | bytes) -> None:
        real = self.resolve(path)
        if os.path.isdir(real):
            raise IsADirectoryError(f"{path}: is a directory")
        root = os.path.realpath(self.workspace)
        parent = os.path.dirname(real)
        missing = []
        while not os.path.isdir(parent):
            missing.append(parent)
            parent = os.path.dirname(parent)
        for d in reversed(missing):
            os.mkdir(d, 0o755)
            self._chown(d)
        if not real.startswith(root + os.sep):
            raise ValueError(f"{path}: resolves outside the workspace")
        if os.path.lexists(real) and not os.path.isfile(real):
            os.unlink(real)  # a FIFO or socket the agent left would block or misdirect the write
        data = text.encode("utf-8") if isinstance(text, str) else text
        fd = os.open(
            real, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644
        )
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        self._chown(real)

    def remove(self, path: str) -> None:
        """Delete a workspace file or symlink (not following it) if present."""
        if path.startswith(WORKDIR + "/"):
            path = path[len(WORKDIR) + 1 :]
        parent = self.resolve(os.path.dirname(path) or ".")
        target = os.path.join(parent, os.path.basename(path))
        if os.path.islink(target) or os.path.isfile(target):
            os.unlink(target)
        elif os.path.isdir(target):
            shutil.rmtree(target)

    def list_files(self) -> list[str]:
        """Relative paths of the regular files in the workspace (symlinks not followed)."""
        out = []
        for dirpath, dirnames, filenames in os.walk(self.workspace):
            dirnames.sort()
            for name in sorted(filenames):
                full = os.path.join(dirpath, name)
                if not os.path.islink(full) and os.path.isfile(full):
                    out.append(os.path.relpath(full, self.workspace))
        return out

    # ---- snapshots -------------------------------------------------------------------------
    def snapshot(self, max_bytes: int = 256 << 20) -> Snapshot:
        files, links, dirs, total = [], [], [], 0
        for dirpath, dirnames, filenames in os.walk(self.workspace):
            dirnames.sort()
            rel_dir = os.path.relpath(dirpath, self.workspace)
            if rel_dir != ".":
                dirs.append((rel_dir, stat.S_IMODE(os.lstat(dirpath).st_mode)))
            for name in sorted(filenames) + [
                d for d in dirnames if os.path.islink(os.path.join(dirpath, d))
            ]:
                full = os.path.join(dirpath, name)
                rel = os.path.relpath(full, self.workspace)
                st = os.lstat(full)
                if stat.S_ISLNK(st.st_mode):
                    links.append((rel, os.readlink(full)))
                elif stat.S_ISREG(st.st_mode):
                    total += st.st_size
                    if total > max_bytes:
                        raise SandboxError(f"workspace larger than {max_bytes} bytes")
                    with open(full, "rb") as f:
                        files.append((rel, stat.S_IMODE(st.st_mode), f.read()))
        return Snapshot(tuple(files), tuple(links), tuple(dirs))

    def restore(self, snap: Snapshot) -> None:
        """Make the workspace equal to `snap`. Files that already match (type, mode, owner,
        bytes) are left alone, so restoring a workspace after a rollout rewrites only what the
        rollout changed (creating files dominates the cost on a journaling file system)."""
        want_files = {rel: (mode, data) for rel, mode, data in snap.files}
        want_links = dict(snap.symlinks)
        want_dirs = dict(snap.dirs)
        os.chmod(self.workspace, 0o755)  # the agent may have locked its own workspace root
        self._chown(self.workspace)
        for dirpath, dirnames, filenames in os.walk(self.workspace, topdown=True):
            for name in list(dirnames) + filenames:
                full = os.path.join(dirpath, name)
                rel = os.path.relpath(full, self.workspace)
                st = os.lstat(full)
                if stat.S_ISDIR(st.st_mode):
                    if rel in want_dirs and st.st_uid == self._owner_uid:
                        if stat.S_IMODE(st.st_mode) != want_dirs[rel]:
                            os.chmod(full, want_dirs[rel])
                        continue
                    shutil.rmtree(full)
                    dirnames.remove(name)
                elif stat.S_ISLNK(st.st_mode) and want_links.get(rel) == os.readlink(full):
                    want_links.pop(rel)
                elif (
                    stat.S_ISREG(st.st_mode)
                    and rel in want_files
                    and stat.S_IMODE(st.st_mode) == want_files[rel][0]
                    and st.st_uid == self._owner_uid
                    and st.st_size == len(want_files[rel][1])
                    and _read_bytes(full) == want_files[rel][1]
                ):
                    want_files.pop(rel)
                else:
                    os.unlink(full)
        for rel, mode in snap.dirs:
            full = os.path.join(self.workspace, rel)
            if not os.path.isdir(full):
                os.mkdir(full, mode)  # parents come first: os.walk lists them top-down
                os.chmod(full, mode)
                self._chown(full)
        for rel, (mode, data) in want_files.items():
            full = os.path.join(self.workspace, rel)
            with open(full, "wb") as f:
                f.write(data)
            os.chmod(full, mode)
            self._chown(full)
        for rel, target in want_links.items():
            full = os.path.join(self.workspace, rel)
            os.symlink(target, full)
            self._chown(full)
