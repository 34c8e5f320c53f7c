"""The bundled corpus: the Python standard library source of the running interpreter.

Nothing is copied into the repository: the files are found at run time through `sysconfig`, so
the corpus is whatever stdlib the interpreter ships (CPython 3.11: ~1,800 files, ~31 MB).
Each `.py` file is one document `{"text", "path"}`; `path` is relative to the stdlib root so a
document's identity (and its split) is the same on every machine with the same Python version.

The train / held-out split is a hash of the relative path, not a random draw: it needs no seed,
no stored list, and adding or removing files never moves another file across the split.
"""
import hashlib
import os
import sysconfig

# Third-party packages installed into the interpreter are not the standard library.
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_root() -> str:
    """Directory holding the running interpreter's standard library sources."""
    return sysconfig.get_paths()["stdlib"]


def is_heldout(rel_path: str, heldout_fraction: float) -> bool:
    """Deterministic split: the first 8 bytes of sha256(path) as a uniform number in [0, 1)."""
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
