"""Per-task Python environments: a venv built from a task's `environment` spec, once per spec.

Why: the sandbox otherwise sees only the host interpreter's packages, so a real project's
dependencies (pinned versions of its libraries, its own pytest) cannot be present. A task names
what it needs (docs/contracts.md, "Task"):

    "environment": {"python": {"requirements": ["attrs==23.2.0", "pytest==8.3.2"],
                               "find_links": ["/data/wheels"], "no_index": true}}

and every sandbox of the task (the agent's commands, its tools, scoring) runs with that venv's
`bin/` first on PATH and without the host interpreter's scripts, so `python`, `pytest` and
`python -m pytest` are the venv's and import only what the spec installed: a missing package is
an ImportError, never a silent fall-back to the host's copy.

Builds: `ensure` makes `<environments dir>/<key>/`, key = a hash of the normalised spec and of
the host interpreter it is built from (`python -m venv --without-pip` of that interpreter, then
the host's own pip installs the requirements into it with `pip --python`, pip >= 22.3: no pip
inside the venv, nothing the agent could use to change it). The directory is read-only inside sandboxes.
A venv cannot be built elsewhere and renamed into place (its scripts' `#!` lines name its own
directory), so builders serialise on `<key>.lock` (flock: several env worker processes, or
threads, building one spec wait for the first, then reuse it) and a build counts as done only
once its marker file `coder-environment.json` is written, last; a directory without the marker
(a builder killed mid-way) is deleted and built again. The key is the spec's text, not the
contents of `find_links` directories or of an index: pin versions, and change the spec (or
delete the directory) to rebuild.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import time

from coder.env import build_once, images

_PYTHON_KEYS = {"requirements", "find_links", "index_url", "no_index"}
_MARKER = "coder-environment.json"
# A build that has not finished in this long is hung (a stalled index or find_links mount); the
# wait is also what a concurrent builder of the same spec may spend behind the lock.
BUILD_TIMEOUT_S = 1800.0


class BuildError(RuntimeError):
    """An environment could not be built (coder.env.sandbox reports it as an infra error)."""


@dataclasses.dataclass(frozen=True)
class Environment:
    """A built venv: `path` (bound read-only at the same path in a sandbox) and its scripts."""

    path: str

    @property
    def bin(self) -> str:
        return os.path.join(self.path, "bin")


def default_dir() -> str:
    """`$XDG_CACHE_HOME/coder/environments` (default `~/.cache/...`): `env.environments_dir=""`."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "coder", "environments")


def check_dir(path: str) -> str:
    """The environments directory for config value `path` ("" = `default_dir()`), symlinks
    resolved: a venv is bound into sandboxes at this path and its installed copies are hidden at
    their real paths (coder.env.installed), which must be the same. ValueError for a URL."""
    path = os.fspath(path or "")
    if "://" in path:
        raise ValueError(f"env.environments_dir={path!r}: must be a local directory, not a URL "
                         "(a venv is bound into the sandbox by path)")
    return os.path.realpath(os.path.expanduser(path) if path else default_dir())


def _strings(value, where: str) -> list[str]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"{where} must be a list of non-empty strings")
    return list(value)


def normalize(environment, where: str = "environment") -> dict:
    """The validated spec with defaults filled in ({} for no environment); ValueError naming the
    offending key. Requirements are pip requirement specifiers (`name==1.0`, `name>=2`, a URL of
    a wheel), never pip options: `-e .` or `--index-url` inside the list would change what is
    installed behind the spec's back."""
    if environment in (None, {}):
        return {}
    if not isinstance(environment, dict):
        raise ValueError(f"{where} must be an object such as {{\"python\": {{\"requirements\": "
                         "[...]}}}")
    unknown = set(environment) - {"python", "image"}
    if unknown:
        raise ValueError(f"{where} has unknown keys {sorted(unknown)} (supported: python, image)")
    if len(environment) != 1:
        raise ValueError(f"{where}: python (a venv) and image (an OCI image) exclude each other")
    if "image" in environment:
        return {"image": images.normalize(environment["image"], f"{where}.image")}
    py = environment.get("python")
    if not isinstance(py, dict):
        raise ValueError(f"{where}.python must be an object with requirements")
    unknown = set(py) - _PYTHON_KEYS
    if unknown:
        raise ValueError(f"{where}.python has unknown keys {sorted(unknown)} "
                         f"(supported: {sorted(_PYTHON_KEYS)})")
    if "requirements" not in py:
        raise ValueError(f"{where}.python lacks requirements (a list of pip requirements)")
    reqs = _strings(py["requirements"], f"{where}.python.requirements")
    for r in reqs:
        if r.lstrip().startswith("-") or "\n" in r:
            raise ValueError(f"{where}.python.requirements: {r!r} is not a requirement "
                             "(pip options are separate keys: find_links, index_url, no_index)")
    links = _strings(py.get("find_links", []), f"{where}.python.find_links")
    for link in links:
        if "://" not in link and not os.path.isabs(link):
            raise ValueError(f"{where}.python.find_links: {link!r} must be an absolute path or "
                             "a URL (builds do not run in the task file's directory)")
    index_url = py.get("index_url", "")
    if not isinstance(index_url, str):
        raise ValueError(f"{where}.python.index_url must be a string")
    no_index = py.get("no_index", False)
    if not isinstance(no_index, bool):
        raise ValueError(f"{where}.python.no_index must be true or false")
    if no_index and index_url:
        raise ValueError(f"{where}.python: index_url and no_index exclude each other")
    return {"python": {"requirements": reqs, "find_links": links, "index_url": index_url,
                       "no_index": no_index}}


def spec_key(spec: dict) -> str:
    """Directory name of a normalised spec's venv: the spec and the interpreter it is built
    from (a venv runs only with that interpreter)."""
    base = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    text = json.dumps([spec, base, sys.version], sort_keys=True)
    return "py-" + hashlib.sha256(text.encode()).hexdigest()[:20]


def ensure(spec: dict, directory: str) -> Environment:
    """The built environment of normalised `spec` under `directory`, building it first if no
    finished one is there (see the module docstring). BuildError says why a build failed."""
    path = os.path.join(directory, spec_key(spec))
    build_once.ensure_built(path, _MARKER, lambda p: _build(spec, p), BuildError)
    return Environment(path)


def _run(argv: list[str], what: str, deadline: float) -> None:
    try:
        r = subprocess.run(argv, capture_output=True, text=True, check=False,
                           timeout=max(deadline - time.monotonic(), 1.0))
    except subprocess.TimeoutExpired as e:
        raise BuildError(f"{what} did not finish in {BUILD_TIMEOUT_S:g} s") from e
    if r.returncode != 0:
        raise BuildError(f"{what} failed (exit {r.returncode}): {(r.stdout + r.stderr)[-2000:]}")


def _build(spec: dict, path: str) -> None:
    """`python -m venv --without-pip`, the host's pip installing the requirements into it, the
    tree opened to every uid read-only (sandboxes run as their own uid), the marker last."""
    t0 = time.monotonic()
    deadline = t0 + BUILD_TIMEOUT_S
    py = spec["python"]
    _run([sys.executable, "-m", "venv", "--without-pip", path], "python -m venv", deadline)
    python = os.path.join(path, "bin", "python")
    if py["requirements"]:
        argv = [sys.executable, "-m", "pip", "--python", python, "install", "--quiet",
                "--disable-pip-version-check", "--no-input", "--no-cache-dir"]
        argv += ["--no-index"] if py["no_index"] else []
        argv += ["--index-url", py["index_url"]] if py["index_url"] else []
        for link in py["find_links"]:
            argv += ["--find-links", link]
        _run(argv + ["--", *py["requirements"]], "pip install", deadline)
    for dirpath, dirnames, filenames in os.walk(path):
        os.chmod(dirpath, 0o755)
        for name in filenames:
            full = os.path.join(dirpath, name)
            mode = os.lstat(full).st_mode
            if not os.path.islink(full):
                os.chmod(full, (mode & 0o777) | 0o444 | (0o111 if mode & 0o111 else 0))
    seconds = time.monotonic() - t0
    with open(os.path.join(path, _MARKER + ".tmp"), "w") as f:
        json.dump({"spec": spec, "python": sys.version, "build_s": round(seconds, 3)}, f)
    os.chmod(f.name, 0o644)
    os.rename(f.name, os.path.join(path, _MARKER))


def build_seconds(env: Environment) -> float:
    """How long `env`'s build took (its marker's record)."""
    with open(os.path.join(env.path, _MARKER)) as f:
        return float(json.load(f)["build_s"])
