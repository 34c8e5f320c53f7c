"""Repository-length documents: one document per repository, its files in dependency order.

DeepSeek-Coder (arXiv:2401.14196, section 2.2) builds its repository-level pretraining data this
way: parse each file's imports, order the files topologically so a file comes after the files it
imports, and put a comment naming each file's path at the start of its text. A model trained on
such documents sees a definition thousands of tokens before its use, which single files rarely
give: the long-context stage needs them (issue #31: with files alone, positions past a file's
length were never trained).

    dirs = repository_dirs(["gs://bucket/repos/*"])   # each matched directory is a repository
    files = read_repository(dirs[0])                   # {relative path: text} of its .py files
    order = dependency_order(files)                    # [relative path], dependencies first
    text = repository_text(files, order)               # "# file: a.py\n<a.py>\n# file: b.py\n..."

Only Python imports are parsed (`ast`), and only `.py` files are read. An import names a file of
the repository when the imported dotted name, or one of its suffixes, is a file's module name:
`from coder.data import corpus` in `coder/data/` (the repository) names `corpus.py`. The order
is Kahn's algorithm with ties taken by path; a cycle is broken by emitting the remaining file with
the fewest unplaced dependencies (ties by path), as DeepSeek-Coder does, so the order is a pure
function of the files.

`RepoSource` is a random-access source in grain's sense (len + getitem -> the document's UTF-8
bytes), so the pretraining pipeline mixes, shuffles and resumes it like any other source
(coder.data.pretrain.repo_spec). Repository directories are local paths or any fsspec URL.
"""
from __future__ import annotations

import ast
import hashlib
import heapq
import posixpath

import fsspec

FILE_HEADER = "# file: {path}\n"
_EXTENSION = ".py"


def module_name(path: str) -> str:
    """"a/b/c.py" -> "a.b.c"; "a/b/__init__.py" -> "a.b" (the module a file defines)."""
    parts = path[: -len(_EXTENSION)].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def python_imports(text: str, path: str) -> set[str]:
    """Dotted module names `text` (the file at repository path `path`) imports, relative imports
    resolved against its package; `from m import a` gives m and m.a (a may be a submodule).
    A file that does not parse imports nothing (it is still placed, by path)."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):  # ValueError: null bytes in the source
        return set()
    package = module_name(path).split(".")
    if not path.endswith("/__init__.py") and path != "__init__.py":
        package = package[:-1]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                base = base + (node.module.split(".") if node.module else [])
            else:
                base = node.module.split(".") if node.module else []
            if not base:
                continue
            out.add(".".join(base))
            out.update(".".join(base + [alias.name]) for alias in node.names if alias.name != "*")
    return out


def dependencies(files: dict[str, str]) -> dict[str, set[str]]:
    """{path: paths of the repository's files it imports} (itself excluded)."""
    by_module = {module_name(p): p for p in sorted(files)}
    deps = {}
    for path, text in files.items():
        found = set()
        for name in python_imports(text, path):
            parts = name.split(".")
            # the name itself or a suffix of it: a repository rooted inside its own package
            for i in range(len(parts)):
                hit = by_module.get(".".join(parts[i:]))
                if hit is not None:
                    found.add(hit)
                    break
        found.discard(path)
        deps[path] = found
    return deps


def dependency_order(files: dict[str, str]) -> list[str]:
    """The paths of `files` ({path: text}), each after the files it imports where a cycle allows.

    Kahn's algorithm over the import graph, the smallest path first among the files ready; when
    only files in cycles remain, the one with the fewest unplaced dependencies goes next (ties by
    path) and the rest continue from it. Deterministic: a function of the paths and texts only.
    """
    deps = dependencies(files)
    users: dict[str, set[str]] = {p: set() for p in files}
    for path, ds in deps.items():
        for d in ds:
            users[d].add(path)
    waiting = {p: len(ds) for p, ds in deps.items()}  # unplaced dependencies per file
    ready = [p for p, n in waiting.items() if n == 0]
    heapq.heapify(ready)
    order: list[str] = []
    placed: set[str] = set()
    while len(order) < len(files):
        if ready:
            path = heapq.heappop(ready)
        else:  # every remaining file sits on a cycle or after one
            path = min((n, p) for p, n in waiting.items() if p not in placed)[1]
        if path in placed:
            continue
        placed.add(path)
        order.append(path)
        waiting.pop(path)
        for user in sorted(users[path]):
            if user in waiting:
                waiting[user] -= 1
                if waiting[user] == 0:
                    heapq.heappush(ready, user)
    return order


def repository_text(files: dict[str, str], order: list[str]) -> str:
    """The repository document: each file in `order`, preceded by its path header (FILE_HEADER)."""
    return "".join(FILE_HEADER.format(path=p) + files[p] + ("" if files[p].endswith("\n") else "\n")
                   for p in order)


def repository_dirs(patterns) -> list[str]:
    """Directories matched by `patterns` (globs of local paths or fsspec URLs), sorted per pattern,
    each holding at least one .py file: each is one repository. FileNotFoundError naming the
    pattern (config.data.repos) when one matches no such directory."""
    out = []
    for pattern in patterns:
        pattern = str(pattern).rstrip("/")
        fs, path = fsspec.core.url_to_fs(pattern)
        found = []
        for m in sorted(fs.glob(path) if any(c in path for c in "*?[") else [path]):
            if fs.isdir(m) and any(f.endswith(_EXTENSION) for f in fs.find(m)):
                found.append(fs.unstrip_protocol(m) if "://" in pattern else m)
        if not found:
            raise FileNotFoundError(f"config.data.repos: {pattern!r} matches no directory holding .py files")
        out += found
    return out


def read_repository(url: str) -> dict[str, str]:
    """{path relative to `url` ("/"-separated): text} of the repository's .py files; files that
    are not UTF-8 are left out (a document is text)."""
    fs, root = fsspec.core.url_to_fs(url)
    root = root.rstrip("/")
    files = {}
    for full in sorted(fs.find(root)):
        rel = posixpath.relpath(full, root)
        if not rel.endswith(_EXTENSION) or "__pycache__" in rel.split("/"):
            continue
        try:
            files[rel] = fs.cat_file(full).decode("utf-8")
        except UnicodeDecodeError:
            continue
    return files


def repository_document(url: str) -> str:
    """The document of the repository at `url` (read_repository, dependency_order, repository_text)."""
    files = read_repository(url)
    return repository_text(files, dependency_order(files))


def split_repositories(urls: list[str], split: str, heldout_fraction: float) -> list[str]:
    """The repositories of `split` ("train" | "heldout" | "all"), in the order given.

    Repositories are few (a whole repository is one record), so a per-record hash with a small
    fraction would often hold none out: the held-out ones are the round(fraction x n) (at least
    one when fraction > 0 and n >= 2) with the smallest sha256 of their directory name; a name's
    hash needs no seed and is the same on every machine.
    """
    if split not in ("train", "heldout", "all"):
        raise ValueError(f"split must be 'train', 'heldout' or 'all', got {split!r}")
    if split == "all":
        return list(urls)
    if heldout_fraction <= 0 or len(urls) < 2:  # nothing held out
        return [] if split == "heldout" else list(urls)
    n_held = min(len(urls) - 1, max(1, round(heldout_fraction * len(urls))))
    key = lambda u: hashlib.sha256(posixpath.basename(u.rstrip("/")).encode()).hexdigest()
    held = set(sorted(urls, key=lambda u: (key(u), u))[:n_held])
    return [u for u in urls if (u in held) == (split == "heldout")]


def plan_parts(url: str, part_chars: int) -> list[tuple[str, ...]]:
    """The repository's files in dependency order, cut at file boundaries into runs of at most
    `part_chars` characters (a longer file is a run of its own)."""
    files = read_repository(url)
    parts, run, size = [], [], 0
    for path in dependency_order(files):
        n = len(FILE_HEADER.format(path=path)) + len(files[path])
        if run and size + n > part_chars:
            parts.append(tuple(run))
            run, size = [], 0
        run.append(path)
        size += n
    return parts + ([tuple(run)] if run else [])


class RepoSource:
    """Random-access source of repository documents: record i is the UTF-8 bytes of one
    repository's document (repository_document), built when read; picklable (URLs and paths).

    part_chars > 0: a record is one run of plan_parts instead, so a repository far longer than
    the rows trained on becomes several documents that shuffle apart (a row never sees more than
    seq_len tokens of one document, so runs longer than that keep all it could see, and a stage
    of few steps sees many repositories instead of one or two). Planning reads every repository
    once, at construction.
    """

    def __init__(self, urls: list[str], part_chars: int = 0):
        self.records = ([(u, ()) for u in urls] if part_chars <= 0
                        else [(u, run) for u in urls for run in plan_parts(u, part_chars)])

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> bytes:
        url, run = self.records[index]
        if not run:
            return repository_document(url).encode("utf-8")
        fs, root = fsspec.core.url_to_fs(url)
        files = {p: fs.cat_file(f"{root.rstrip('/')}/{p}").decode("utf-8") for p in run}
        return repository_text(files, list(run)).encode("utf-8")
