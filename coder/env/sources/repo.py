"""Repository snapshots for task format v2: a task names a git repository and a commit.

`checkout(repo, commit)` prepares a pristine working tree of `commit` once per process (and,
through the cache directory, once per machine), and `copy_into` copies it into a sandbox's
workspace (`Sandbox._populate`). `repo` is a local path or `file://` URL of a git repository, a
git URL (`https://...`, fetched with git), or an archive of a repository (`.tar.gz`, `.tgz`,
`.tar`, `.zip`) at a local path or any fsspec URL (`gs://...`), downloaded and unpacked once
into the cache.

History: `commit` and at most `depth - 1` of its ancestors (`env.history_depth`, default 1).
The tree comes from `git fetch --depth=<depth> <repo> <sha>` into a fresh repository, so the
workspace's `.git` holds exactly the objects of those commits (`git log` shows them, the
oldest grafted; `git diff` / `git status` show the agent's changes). A later commit (where the
fix lives) is unreachable by construction: the fetch asks for `sha` only, so the source sends
`sha`'s ancestry and nothing else; no ref is created (FETCH_HEAD, which names the host's path,
is deleted; HEAD is detached at `sha`; no tags), so no object, ref or packfile of the
workspace holds a descendant of `sha`, and `git log --all` shows what `git log HEAD` shows
(tests/env/tools/test_registry.py checks both). More history helps the agent (`repo_history`: why a
line is the way it is) but is copied into every workspace and every in-memory snapshot of it
(`Sandbox.snapshot`, pickled to pool workers): hence a depth, not the whole history.

Cache: `<tempdir>/coder-repos/<sha>/` (`<sha>.depth<N>/` for a depth N > 1; the tree and a
manifest of its tracked files), written under a temporary name and renamed into place, so
concurrent processes (pool workers) never see a half-made tree; the first process to finish
wins. Copies use `cp --reflink=auto`: a copy-on-write clone where the file system has them, a
plain copy elsewhere. Hard links would be cheaper but the agent (and host-side writes as root)
could then change the cached files through them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import zipfile
from collections.abc import Mapping

import fsspec

CACHE = os.path.join(tempfile.gettempdir(), "coder-repos")
ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar", ".zip")
_SHA = re.compile(r"^[0-9a-f]{40}$")


class RepoError(RuntimeError):
    """A repository or commit could not be prepared (the harness's failure, not the agent's)."""


@dataclasses.dataclass(frozen=True)
class Checkout:
    """A prepared working tree of one commit."""

    dir: str  # the tree, with its one-commit .git
    commit: str  # full sha
    paths: tuple  # tracked regular files (no symlinks, no submodules), sorted
    tracked: frozenset  # every tracked path (symlinks and submodule paths too)

    def read(self, path: str) -> bytes:
        with open(os.path.join(self.dir, path), "rb") as f:
            return f.read()

    def files(self) -> "TreeFiles":
        """{path: text} of the tracked files, read lazily (for `Sandbox._shadow_installed`)."""
        return TreeFiles(self)


class TreeFiles(Mapping):
    """A read-only {path: text} view of a checkout; a file's text is read when asked for."""

    def __init__(self, co: Checkout):
        self._co, self._paths = co, frozenset(co.paths)

    def __getitem__(self, path):
        if path not in self._paths:
            raise KeyError(path)
        return self._co.read(path).decode("utf-8", "replace")

    def __iter__(self):
        return iter(self._co.paths)

    def __len__(self):
        return len(self._co.paths)

    def __contains__(self, path):
        return path in self._paths


def git(*args, cwd: str | None = None, stdin: str | None = None, index: str = "",
        env: Mapping | None = None) -> str:
    """git's stdout (CRLF line ends kept); RepoError with its stderr. The host's git
    configuration plays no part; `env` adds variables (commit dates and names)."""
    # Decoded without newline translation: a diff of a file with CRLF line ends keeps them.
    return _git_bytes(*args, cwd=cwd, stdin=None if stdin is None else stdin.encode(), index=index,
                      env=env).decode("utf-8", errors="replace")


def _git_bytes(*args, cwd: str | None = None, stdin: bytes | None = None, index: str = "",
               env: Mapping | None = None) -> bytes:
    """`git`'s stdout as bytes (cat-file's output holds binary blobs)."""
    env = {
        **(env or {}),
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": tempfile.gettempdir(),
        "LANG": "C",
        "GIT_CONFIG_NOSYSTEM": "1",  # the host's git configuration plays no part
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_TERMINAL_PROMPT": "0",
        "GIT_CEILING_DIRECTORIES": os.path.dirname(os.path.abspath(cwd or ".")),
        **({"GIT_INDEX_FILE": index} if index else {}),
    }
    r = subprocess.run(
        ["git", "-c", "safe.directory=*", "-c", "init.defaultBranch=main", *args],
        cwd=cwd,
        input=stdin,
        capture_output=True,
        env=env,
    )
    if r.returncode != 0:
        raise RepoError(f"git {' '.join(args[:3])}: {r.stderr.decode(errors='replace').strip()[-800:]}")
    return r.stdout


def is_archive(repo: str) -> bool:
    return repo.lower().endswith(ARCHIVE_SUFFIXES)


def _local_path(repo: str) -> str | None:
    if repo.startswith("file://"):
        return repo[len("file://") :]
    return None if "://" in repo else os.path.abspath(os.path.expanduser(repo))


def _find_repo(root: str) -> str:
    """The git repository at `root` or in its single top-level directory (how archives of a
    repository are usually made); a bare repository counts."""
    cands = [root]
    entries = [e for e in os.listdir(root) if not e.startswith(".")] if os.path.isdir(root) else []
    if len(entries) == 1 and os.path.isdir(os.path.join(root, entries[0])):
        cands.append(os.path.join(root, entries[0]))
    for c in cands:
        if os.path.exists(os.path.join(c, ".git")) or (
            os.path.isfile(os.path.join(c, "HEAD")) and os.path.isdir(os.path.join(c, "objects"))
        ):
            return c
    raise RepoError(f"no git repository in {root} (nor in its single top-level directory)")


def _unpack(repo: str, cache: str) -> str:
    """Download (fsspec) and unpack an archive once per version of it (its URL, size and
    modification time or etag); the directory of the repository in it."""
    local = _local_path(repo)
    try:
        if local is None:
            fs, path = fsspec.core.url_to_fs(repo)
            version = json.dumps(fs.info(path), sort_keys=True, default=str)
        else:
            st = os.stat(local)
            version = f"{st.st_size} {st.st_mtime_ns}"
    except (OSError, ValueError) as e:
        raise RepoError(f"{repo}: cannot read the archive: {e}") from e
    key = hashlib.sha256(f"{repo}\0{version}".encode()).hexdigest()[:20]
    final = os.path.join(cache, "archives", key)
    if not os.path.isdir(final):
        os.makedirs(os.path.dirname(final), 0o700, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix="unpack-", dir=os.path.dirname(final))
        try:
            if local is None:
                name = os.path.join(tmp, "archive" + _suffix(repo))
                with fsspec.open(repo, "rb") as src, open(name, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
                local = name
            out = os.path.join(tmp, "x")
            os.mkdir(out)
            if local.lower().endswith(".zip"):
                with zipfile.ZipFile(local) as z:
                    for info in z.infolist():
                        if info.filename.startswith("/") or ".." in info.filename.split("/"):
                            raise RepoError(f"{repo}: unsafe path {info.filename!r} in archive")
                    z.extractall(out)
            else:
                with tarfile.open(local) as t:
                    t.extractall(out, filter="data")
            try:
                os.rename(out, final)
            except OSError:
                if not os.path.isdir(final):
                    raise
        except (OSError, tarfile.TarError, zipfile.BadZipFile) as e:
            raise RepoError(f"{repo}: could not unpack the archive: {e}") from e
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return _find_repo(final)


def _suffix(repo: str) -> str:
    return next(s for s in ARCHIVE_SUFFIXES if repo.lower().endswith(s))


def source(repo: str, cache: str = CACHE) -> tuple[str, bool]:
    """(where git fetches `repo` from, whether that is a local directory)."""
    if is_archive(repo):
        return _unpack(repo, cache), True
    local = _local_path(repo)
    if local is None:
        return repo, False  # a git URL: git fetches it (no network inside tests)
    if not os.path.isdir(local):
        raise RepoError(f"{repo}: no such repository directory")
    return _find_repo(local), True


def resolve(repo: str, commit: str, cache: str = CACHE) -> str:
    """The full sha of `commit` (any revision name) in a local or archived repository; a remote
    repository's commit must already be a full sha. Raises RepoError."""
    os.makedirs(cache, 0o700, exist_ok=True)
    src, local = source(repo, cache)
    if local:
        rev = f"{commit}^{{commit}}"
        return git("rev-parse", "--verify", "--end-of-options", rev, cwd=src).strip()
    if not _SHA.match(commit):
        raise RepoError(f"{repo}: a remote repository's commit must be a full sha, not {commit!r}")
    return commit


def applies(repo: str, commit: str, patch: str, cache: str = CACHE) -> bool:
    """Whether `patch` applies to `commit` of a local or archived repository (checked against a
    throwaway index of that commit: no checkout)."""
    src, local = source(repo, cache)
    if not local:
        raise RepoError(f"{repo}: only a local repository can check a patch without a checkout")
    fd, index = tempfile.mkstemp(prefix="index-", dir=cache)
    os.close(fd)
    try:
        os.unlink(index)
        git("read-tree", commit, cwd=src, index=index)
        git("apply", "--cached", "--check", "-", cwd=src, stdin=patch, index=index)
        return True
    except RepoError:
        return False
    finally:
        if os.path.exists(index):
            os.unlink(index)


def is_dir(repo: str, commit: str, path: str, cache: str = CACHE) -> bool:
    """Whether `commit` of a local or archived repository has a directory at `path`."""
    src, local = source(repo, cache)
    if not local:
        raise RepoError(f"{repo}: only a local repository can list a commit's tree without a checkout")
    try:
        return git("cat-file", "-t", f"{commit}:{path}", cwd=src).strip() == "tree"
    except RepoError:
        return False


_CHECKOUTS: dict = {}


def text_blobs(repo: str, commit: str, cache: str = CACHE, max_bytes: int = 1 << 20):
    """Yields the text of every file (UTF-8, at most `max_bytes`) in every commit a local or
    archived repository holds: its refs' histories and `commit`'s (a release mirror's refs name
    every release, the next one a feature task asks for included). A remote repository gives
    `commit`'s tree only (nothing else is fetched). Each distinct blob once. Raises RepoError."""
    src, local = source(repo, cache)
    if not local:
        co = checkout(repo, commit, cache)
        for path in co.paths:
            data = co.read(path)
            if len(data) <= max_bytes:
                yield data.decode("utf-8", "replace")
        return
    sha = resolve(repo, commit, cache)
    listed = git("rev-list", "--objects", "--all", sha, cwd=src).splitlines()
    objects = "".join(line.split(" ", 1)[0] + "\n" for line in listed if line)
    checked = git("cat-file", "--batch-check=%(objectname) %(objecttype) %(objectsize)", cwd=src, stdin=objects)
    blobs = sorted({name for name, kind, size in (line.split() for line in checked.splitlines())
                    if kind == "blob" and int(size) <= max_bytes})
    out = _git_bytes("cat-file", "--batch", cwd=src, stdin="".join(b + "\n" for b in blobs).encode())
    at = 0
    for _ in blobs:  # "<sha> blob <size>\n<content>\n" each
        header_end = out.index(b"\n", at)
        size = int(out[at:header_end].split()[2])
        data = out[header_end + 1 : header_end + 1 + size]
        at = header_end + 2 + size
        try:
            yield data.decode("utf-8")
        except UnicodeDecodeError:  # binary files are not code
            continue


def checkout(repo: str, commit: str, cache: str = CACHE, depth: int = 1) -> Checkout:
    """The prepared tree of `repo` at `commit` (a sha or, for a local repository, any revision
    name) with `depth` commits of history (`commit` and its depth - 1 nearest ancestors); see
    the module docstring. Raises RepoError."""
    if int(depth) < 1:
        raise ValueError(f"history depth {depth}: at least 1 (the task's commit itself)")
    key = (repo, commit, cache, int(depth))
    if key in _CHECKOUTS and os.path.isdir(_CHECKOUTS[key].dir):  # a tmp cleaner may remove it
        return _CHECKOUTS[key]
    os.makedirs(cache, 0o700, exist_ok=True)
    src, local = source(repo, cache)
    sha = resolve(repo, commit, cache)
    final = os.path.join(cache, sha if int(depth) == 1 else f"{sha}.depth{int(depth)}")
    if not os.path.isfile(os.path.join(final, "manifest.json")):
        tmp = tempfile.mkdtemp(prefix=f"{sha[:12]}.tmp-", dir=cache)
        try:
            tree = os.path.join(tmp, "tree")
            git("init", "-q", tree)
            url = "file://" + os.path.abspath(src) if local else src
            pack = "git -c uploadpack.allowAnySHA1InWant=true -c 'safe.directory=*' upload-pack"
            git("fetch", "-q", f"--depth={int(depth)}", "--no-tags", f"--upload-pack={pack}", url, sha,
                 cwd=tree)
            git("-c", "advice.detachedHead=false", "checkout", "-q", "--detach", sha, cwd=tree)
            for name in ("FETCH_HEAD", "ORIG_HEAD"):  # FETCH_HEAD names the host's source path
                if os.path.exists(os.path.join(tree, ".git", name)):
                    os.unlink(os.path.join(tree, ".git", name))
            files, tracked = [], []
            for entry in git("ls-files", "-s", "-z", cwd=tree).split("\0"):
                if not entry:
                    continue
                meta, path = entry.split("\t", 1)
                tracked.append(path)
                if meta.split()[0] in ("100644", "100755"):
                    files.append(path)
            with open(os.path.join(tmp, "manifest.json"), "w") as f:
                json.dump({"commit": sha, "files": sorted(files), "tracked": tracked}, f)
            try:
                os.rename(tmp, final)
            except OSError:  # another process made it first
                if not os.path.isfile(os.path.join(final, "manifest.json")):
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    with open(os.path.join(final, "manifest.json")) as f:
        m = json.load(f)
    co = Checkout(os.path.join(final, "tree"), sha, tuple(m["files"]), frozenset(m["tracked"]))
    _CHECKOUTS[key] = co
    return co


def copy_into(co: Checkout, dest: str, uid: int | None = None) -> None:
    """Copy the checkout's tree (its .git included) into the existing directory `dest`, owned by
    `uid` when given (the sandbox's user: as `Sandbox.write` does)."""
    r = subprocess.run(
        ["cp", "-a", "--reflink=auto", co.dir + "/.", dest], capture_output=True, text=True
    )
    if r.returncode == 0 and uid is not None:
        r = subprocess.run(
            ["chown", "-R", "-h", f"{uid}:{uid}", dest], capture_output=True, text=True
        )
    if r.returncode != 0:
        raise RepoError(f"copying {co.commit[:12]} into the workspace: {r.stderr.strip()[-500:]}")


_PATCHED: dict = {}


def patched_files(co: Checkout, patch: str, cache: str = CACHE) -> dict:
    """{path: bytes, or None for a deleted file}: what `patch` makes of the files it touches in
    the pristine checkout. Computed once per (commit, patch) in a scratch directory beside the
    cache, never in a workspace the agent touched; scoring writes the result over the workspace
    (the way `Task.tests` is written). Raises RepoError when the patch does not apply."""
    key = (co.commit, hashlib.sha256(patch.encode()).hexdigest())
    if key in _PATCHED:
        return _PATCHED[key]
    paths = sorted({p for f in parse_patch(patch) for p in (f["old"], f["new"]) if p})
    tmp = tempfile.mkdtemp(prefix="patch-", dir=cache)
    try:
        for p in paths:
            if p in co.paths:
                dst = os.path.join(tmp, p)
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                shutil.copy2(os.path.join(co.dir, p), dst)
        git("apply", "--whitespace=nowarn", "-", cwd=tmp, stdin=patch)
        out = {}
        for p in paths:
            full = os.path.join(tmp, p)
            out[p] = open(full, "rb").read() if os.path.isfile(full) else None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _PATCHED[key] = out
    return out


_HUNK = re.compile(r"^@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@")


def _strip(path: str) -> str | None:
    path = path.split("\t", 1)[0].strip()
    if path == "/dev/null":
        return None
    return path[2:] if path[:2] in ("a/", "b/") else path


def parse_patch(patch: str) -> list[dict]:
    """The files of a unified diff (git's or plain): [{"old", "new", "added", "removed"}]
    (`old` / `new` None for a created / deleted file); line counts from the hunks."""
    files: list[dict] = []
    cur, old_left, new_left = None, 0, 0
    for line in patch.splitlines():
        if old_left > 0 or new_left > 0:
            if line.startswith("+"):
                cur["added"] += 1
                new_left -= 1
            elif line.startswith("-"):
                cur["removed"] += 1
                old_left -= 1
            elif not line.startswith("\\"):  # context (an empty line is a blank context line)
                old_left, new_left = old_left - 1, new_left - 1
            continue
        if line.startswith("diff --git "):
            m = re.match(r"^diff --git a/(.+) b/(.+)$", line)
            a, b = (m.group(1), m.group(2)) if m else (None, None)
            cur = {"old": a, "new": b, "added": 0, "removed": 0, "hunks": 0, "git": True}
            files.append(cur)
        elif line.startswith("--- "):
            if cur is None or cur["hunks"] or not cur["git"]:
                cur = {"old": None, "new": None, "added": 0, "removed": 0, "hunks": 0, "git": False}
                files.append(cur)
            cur["old"] = _strip(line[4:])
        elif line.startswith("+++ ") and cur is not None:
            cur["new"] = _strip(line[4:])
        elif line.startswith("new file mode") and cur is not None:
            cur["old"] = None
        elif line.startswith("deleted file mode") and cur is not None:
            cur["new"] = None
        elif (m := _HUNK.match(line)) and cur is not None:
            cur["hunks"] += 1
            old_left = int(m.group(1)) if m.group(1) is not None else 1
            new_left = int(m.group(2)) if m.group(2) is not None else 1
    return [{k: f[k] for k in ("old", "new", "added", "removed")} for f in files]


def patch_stats(patch: str) -> dict:
    """{"files": paths changed, "lines_added", "lines_removed"} of a unified diff."""
    fs = parse_patch(patch)
    return {
        "files": sorted({f["new"] or f["old"] for f in fs}),
        "lines_added": sum(f["added"] for f in fs),
        "lines_removed": sum(f["removed"] for f in fs),
    }
