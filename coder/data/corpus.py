"""The bundled corpus: the Python standard library source of the running interpreter.

Nothing is copied into the repository: the files are found at run time through `sysconfig`, so
the corpus is whatever stdlib the interpreter ships (CPython 3.11: ~1,800 files, ~31 MB).
Each `.py` file is one document `{"text", "path"}`; `path` is relative to the stdlib root so a
document's identity (and its split) is the same on every machine with the same Python version.

The train / held-out split is a hash of the relative path, not a random draw: it needs no seed,
no stored list, and adding or removing files never moves another file across the split.

No contamination of the agent's held-out tasks: the stdlib bug-fix task generator
(coder.env.sources.mutate) builds a task from a top-level module `M.py` and its CPython tests
`test/test_M.py`, and splits modules by `task_module_split(M)` (a hash of the module name, 20%
held out). Both files of every held-out task module (`heldout_task_files`, ~60 files of ~1,800
on CPython 3.11) are in this corpus's held-out split too, whatever `heldout_fraction`, so
pretraining (and the tokenizer) never sees a held-out task's code or its hidden tests.
"""
import functools
import hashlib
import os
import sysconfig

# Third-party packages installed into the interpreter are not the standard library.
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_root() -> str:
    """Directory holding the running interpreter's standard library sources."""
    return sysconfig.get_paths()["stdlib"]


# Percent of the stdlib modules whose bug-fix tasks are held out (coder.env.sources.mutate.split_of).
TASK_HELDOUT_PERCENT = 20


def task_module_split(module: str, heldout_percent: int = TASK_HELDOUT_PERCENT) -> str:
    """'train' or 'heldout': the split of the bug-fix tasks of stdlib module `module`, fixed per
    module (a hash of its name, independent of any seed)."""
    h = int(hashlib.sha256(module.encode()).hexdigest()[:8], 16)
    return "heldout" if h % 100 < heldout_percent else "train"


@functools.lru_cache(maxsize=4)
def heldout_task_files(root: str | None = None) -> frozenset:
    """Paths (relative to the stdlib root, "/"-separated) of the files the held-out bug-fix tasks
    may use: `M.py` and `test/test_M.py` of every module M that has both and whose tasks are
    held out (`task_module_split`)."""
    root = root or stdlib_root()
    out = set()
    for name in os.listdir(root):
        test = f"test/test_{name[:-3]}.py"
        if (name.endswith(".py") and os.path.isfile(os.path.join(root, name))
                and os.path.isfile(os.path.join(root, test))
                and task_module_split(name[:-3]) == "heldout"):
            out |= {name, test}
    return frozenset(out)


def is_heldout(rel_path: str, heldout_fraction: float) -> bool:
    """Deterministic split: a file of a held-out task module (module docstring), or the first 8
    bytes of sha256(path) as a uniform number in [0, 1) below `heldout_fraction`."""
    if rel_path.replace(os.sep, "/") in heldout_task_files():
        return True
    digest = hashlib.sha256(rel_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64 < heldout_fraction


def stdlib_files(split: str = "all", heldout_fraction: float = 0.05) -> list[str]:
    """Absolute paths of the stdlib `.py` files of `split` ("train" | "heldout" | "all"), sorted."""
    if split not in ("train", "heldout", "all"):
        raise ValueError(f"split must be 'train', 'heldout' or 'all', got {split!r}")
    root = stdlib_root()
    paths = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in _EXCLUDED_DIRS)
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(directory, name)
            if split != "all":
                held = is_heldout(os.path.relpath(path, root), heldout_fraction)
                if held != (split == "heldout"):
                    continue
            paths.append(path)
    if not paths:
        raise FileNotFoundError(f"no .py files for split {split!r} under {root}")
    return paths


def read_document(path: str) -> dict:
    """One corpus document. Raises UnicodeDecodeError for the few non-UTF-8 stdlib files."""
    with open(path, "rb") as f:
        text = f.read().decode("utf-8")
    return {"text": text, "path": os.path.relpath(path, stdlib_root())}


def documents(split: str = "all", heldout_fraction: float = 0.05):
    """Yields the documents of `split` in path order, skipping files that are not UTF-8."""
    for path in stdlib_files(split, heldout_fraction):
        try:
            yield read_document(path)
        except UnicodeDecodeError:
            continue
