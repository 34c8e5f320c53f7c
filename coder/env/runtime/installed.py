"""Where the Python installations a sandbox can see keep their modules, and which modules a
workspace defines: what `coder.env.runtime.sandbox` needs to hide a task's reference solution.

A stdlib bug-fix task's reference solution is the installed module, and a repository task's may
be an installed release of the package: the sandbox shows the task's starting text over every
installed copy (`installed_copies`) of each module the workspace defines (`workspace_modules`),
in every interpreter's standard library and site-packages under /usr and the bound prefixes
(`library_dirs`), and in the task's own environment if it has one (`library_dirs_under`).
"""

from __future__ import annotations

import functools
import glob
import os
import site
import sys


def python_prefixes() -> list[str]:
    """Host directories the sandboxed Python needs, read-only: interpreter and site-packages."""
    paths = {
        sys.prefix,
        sys.base_prefix,
        os.path.dirname(os.path.dirname(os.path.realpath(sys.executable))),
    }
    paths.update(p for p in site.getsitepackages() if os.path.isdir(p))
    if site.ENABLE_USER_SITE and site.USER_SITE and os.path.isdir(site.USER_SITE):
        paths.add(site.USER_SITE)
    out = []
    for p in sorted(os.path.realpath(p) for p in paths):
        if p.startswith("/usr/") or p == "/usr":
            continue  # /usr is mounted whole
        if any(p == q or p.startswith(q + "/") for q in out):
            continue
        out.append(p)
    return out


def workspace_modules(files) -> dict[str, tuple[str, ...]]:
    """Top-level Python modules a workspace defines: {name: (its paths in the workspace)}.

    `M.py` at the root (or under `src/`) is module M; a directory with an `__init__.py` there is
    package M with every file under it. These are the names whose installed copies a sandbox
    hides (`installed_copies`)."""
    out: dict[str, list[str]] = {}
    for path in sorted(files):
        parts = path.split("/")
        if parts[0] == "src" and len(parts) > 1:
            parts = parts[1:]
        if len(parts) == 1 and parts[0].endswith(".py") and parts[0][:-3].isidentifier():
            out.setdefault(parts[0][:-3], []).append(path)
        elif len(parts) > 1 and parts[0].isidentifier():
            top = path[: len(path) - len("/".join(parts[1:]))]  # "pkg/" or "src/pkg/"
            if top + "__init__.py" in files:
                out.setdefault(parts[0], []).append(path)
    return {name: tuple(paths) for name, paths in out.items()}


@functools.lru_cache(maxsize=1)
def library_dirs() -> tuple[str, ...]:
    """Every directory visible inside a sandbox from which some Python imports modules: each
    standard library (a directory holding `os.py`, wherever an interpreter is installed under
    /usr or the bound prefixes: Debian's, pyenv's, one bundled with a cloud SDK) and every
    site- / dist-packages. One walk per process (~0.3 s over a /usr of 260k entries)."""
    out = set()
    for base in ["/usr", *python_prefixes()]:
        out.update(library_dirs_under(base))
    return tuple(sorted(out))


@functools.lru_cache(maxsize=256)
def library_dirs_under(base: str) -> tuple[str, ...]:
    """`library_dirs` of one tree: also a task's environment (coder.env.runtime.environments), whose
    venv is bound into its sandboxes beside the host's prefixes. Cached: a built tree does not
    change."""
    out = set()
    for dirpath, dirnames, filenames in os.walk(base):
        if "os.py" in filenames:
            out.add(dirpath)
        for name in ("site-packages", "dist-packages"):
            if name in dirnames:  # listed, not descended: packages hold no `os.py`
                out.add(os.path.join(dirpath, name))
                dirnames.remove(name)
    return tuple(sorted(os.path.realpath(p) for p in out))


@functools.lru_cache(maxsize=4096)
def installed_copies(name: str, extra_bases: tuple = ()) -> tuple[str, ...]:
    """Host paths of module `name`'s installed source and bytecode in every `library_dirs`
    directory and those under `extra_bases` (a task environment's venv): `name.py`, the package
    directory `name/`, `__pycache__/name.*.pyc`, and Python 2's `name.pyc`. The sandbox shows
    the task's own starting text over each of them."""
    roots = set(library_dirs())
    for base in extra_bases:
        roots.update(library_dirs_under(base))
    return _copies_in(name, roots)


def _copies_in(name: str, roots) -> tuple[str, ...]:
    out = []
    for root in sorted(roots):
        source, package = os.path.join(root, f"{name}.py"), os.path.join(root, name)
        out += [source] if os.path.isfile(source) else []
        out += [package] if os.path.isdir(package) else []
        out += glob.glob(os.path.join(root, "__pycache__", glob.escape(name) + ".*.pyc"))
        out += [p for p in (os.path.join(root, f"{name}.pyc"),) if os.path.isfile(p)]
    return tuple(sorted(set(out)))


def installed_copies_in(name: str, base: str) -> tuple[str, ...]:
    """`installed_copies` of module `name` in the library directories of one tree only: an
    image's root filesystem (coder.env.runtime.images), whose paths inside are these less `base`."""
    inside = os.path.realpath(base) + "/"  # an absolute link in the image is not followed out
    return tuple(p for p in _copies_in(name, library_dirs_under(base))
                 if os.path.realpath(p).startswith(inside))
