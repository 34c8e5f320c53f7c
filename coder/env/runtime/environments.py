"""Per-task Python environments: a venv built from a task's `environment` spec, once per spec.

Why: the sandbox otherwise sees only the host interpreter's packages, so a real project's
dependencies (pinned versions of its libraries, its own pytest) cannot be present. A task names
what it needs (docs/contracts.md, "Task"):

    "environment": {"python": {"requirements": ["attrs==23.2.0", "pytest==8.3.2"],
                               "find_links": ["/data/wheels"], "no_index": true,
                               "version": "3.9"}}

and every sandbox of the task (the agent's commands, its tools, scoring) runs with that venv's
`bin/` first on PATH and without the host interpreter's scripts, so `python`, `pytest` and
`python -m pytest` are the venv's and import only what the spec installed: a missing package is
an ImportError, never a silent fall-back to the host's copy.

The interpreter (`interpreter()`): without `version` or `interpreter`, the host's (the one this
process runs; `interpreter` alone: that one, whatever its version); `version` "3.9" (or
"3.9.18") is found as the spec's `interpreter` (an absolute path) when it names one, else as `python3.9` on PATH, else under pyenv
(`$(pyenv root)/versions/3.9.*/bin/python`, newest first), each candidate run to read its real
version (a pyenv shim of a version that is not active fails and is passed over). None found: a
ValueError naming the version and each place looked (from `ensure`, a BuildError: in a sandbox,
an infrastructure error). The interpreter's installation is bound read-only into the sandbox
beside the venv (`Environment.base`).

Builds: `ensure` makes `<environments dir>/<key>/`, key = a hash of the normalised spec and of
the interpreter it is built from, its path and version, so two versions never share a venv
(`<interpreter> -m venv --without-pip`, then the host's own pip installs the requirements into
it with `pip --python`, pip >= 22.3: no pip inside the venv, nothing the agent could use to
change it; the host's pip must support the venv's Python: pip 23 drives 3.7 and later, so a 3.6
venv takes no requirements). The directory is read-only inside sandboxes.
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
import functools
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time

from coder.env.runtime import build_once, images

_PYTHON_KEYS = {"requirements", "find_links", "index_url", "no_index", "version", "interpreter"}
_VERSION = re.compile(r"^3\.\d+(\.\d+)?$")
_MARKER = "coder-environment.json"
# A build that has not finished in this long is hung (a stalled index or find_links mount); the
# wait is also what a concurrent builder of the same spec may spend behind the lock.
BUILD_TIMEOUT_S = 1800.0


class BuildError(RuntimeError):
    """An environment could not be built (coder.env.runtime.sandbox reports it as an infra error)."""


@dataclasses.dataclass(frozen=True)
class Environment:
    """A built venv: `path` (bound read-only at the same path in a sandbox) and its scripts;
    `base`, the installation of the interpreter it was built from (bound read-only beside it)."""

    path: str
    base: str = ""

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
    their real paths (coder.env.runtime.installed), which must be the same. ValueError for a URL."""
    path = os.fspath(path or "")
    if "://" in path:
        raise ValueError(f"env.environments_dir={path!r}: must be a local directory, not a URL "
                         "(a venv is bound into the sandbox by path)")
    return os.path.realpath(os.path.expanduser(path) if path else default_dir())


def _strings(value, where: str) -> list[str]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"{where} must be a list of non-empty strings")
    return list(value)


def check_version(version, where: str) -> str:
    """`version` if it names a Python 3 release ("3.9", "3.9.18") or is "" (the host's);
    ValueError naming `where` otherwise."""
    if not isinstance(version, str) or (version and not _VERSION.match(version)):
        raise ValueError(f"{where}: {version!r} must be a string such as \"3.9\" or \"3.9.18\" "
                         "(\"\" or absent: the host's interpreter)")
    return version


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
    out = {"requirements": reqs, "find_links": links, "index_url": index_url,
           "no_index": no_index}
    version = check_version(py.get("version", ""), f"{where}.python.version")
    interp = py.get("interpreter", "")
    if not isinstance(interp, str) or (interp and not os.path.isabs(interp)):
        raise ValueError(f"{where}.python.interpreter: {interp!r} must be an absolute path of a "
                         "Python executable")
    # Only when set: the specs (and venv keys) of environments without them stay as they were.
    out.update({k: v for k, v in (("version", version), ("interpreter", interp)) if v})
    return {"python": out}


@dataclasses.dataclass(frozen=True)
class Interpreter:
    """A Python to build venvs from: `path` (run as `path -m venv`), `version` (3, 9, 18),
    `text` (its sys.version) and `base` (its installation, sys.base_prefix)."""

    path: str
    version: tuple
    text: str
    base: str


_PROBE = ("import json, os, sys; print(json.dumps([list(sys.version_info[:3]), sys.version, "
          "os.path.realpath(sys.executable), os.path.realpath(sys.base_prefix)]))")


@functools.lru_cache(maxsize=None)
def _probe(path: str) -> Interpreter | str:
    """The interpreter at `path`, run to read its version; or why it could not be run."""
    try:
        r = subprocess.run([path, "-c", _PROBE], capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            return f"exit {r.returncode}: {(r.stderr or r.stdout).strip().splitlines()[:1]}"
        version, text, exe, base = json.loads(r.stdout.strip().splitlines()[-1])
    except (OSError, ValueError, subprocess.TimeoutExpired) as e:
        return f"{type(e).__name__}: {e}"
    return Interpreter(exe, tuple(version), text, base)


@functools.lru_cache(maxsize=None)
def _pyenv_root() -> str:
    root = os.environ.get("PYENV_ROOT", "")
    if not root and shutil.which("pyenv"):
        r = subprocess.run(["pyenv", "root"], capture_output=True, text=True, timeout=60)
        root = r.stdout.strip() if r.returncode == 0 else ""
    return root


def _numeric(path: str) -> tuple:
    name = os.path.basename(os.path.dirname(os.path.dirname(path)))
    return tuple(int(x) if x.isdigit() else -1 for x in name.split("."))


def host_interpreter() -> Interpreter:
    """The interpreter this process runs (what a spec without `version` is built from)."""
    return Interpreter(sys.executable, tuple(sys.version_info[:3]), sys.version,
                       os.path.realpath(sys.base_prefix))


def interpreter(spec: dict) -> Interpreter:
    """The interpreter normalised `spec`'s venv is built from (the module docstring's search);
    ValueError naming the version and each place looked when none matches."""
    py = spec["python"]
    version, explicit = py.get("version", ""), py.get("interpreter", "")
    if not version and not explicit:
        return host_interpreter()
    want = tuple(int(x) for x in version.split(".")) if version else ()
    name = "python" + ".".join(version.split(".")[:2])
    looked = []
    if explicit:
        candidates = [(f"interpreter {explicit}", explicit)]
    else:
        on_path = shutil.which(name)
        candidates = [(f"{name} on PATH ({on_path})", on_path)] if on_path else []
        if not on_path:
            looked.append(f"{name} on PATH: not there")
        root = _pyenv_root()
        if root:
            pattern = os.path.join(root, "versions", f"{version}.*", "bin", "python")
            found = sorted(glob.glob(pattern) + glob.glob(os.path.join(
                root, "versions", version, "bin", "python")), key=_numeric, reverse=True)
            candidates += [(f"pyenv's {p}", p) for p in found]
            if not found:
                looked.append(f"pyenv's {pattern}: none")
        else:
            looked.append("pyenv: not installed (no PYENV_ROOT, no pyenv on PATH)")
    for where, path in candidates:
        got = _probe(path)
        if isinstance(got, str):
            looked.append(f"{where}: did not run ({got})")
        elif got.version[:len(want)] != want:
            looked.append(f"{where}: is Python {'.'.join(map(str, got.version))}")
        else:
            return got
    raise ValueError(f"no Python {version or explicit} to build the environment with; looked at: "
                     + "; ".join(looked))


def spec_key(spec: dict) -> str:
    """Directory name of a normalised spec's venv: the spec and the interpreter it is built
    from, its path and version (a venv runs only with that interpreter; two versions never
    share one). ValueError when the spec's interpreter is not found."""
    py = spec["python"]
    if not py.get("version") and not py.get("interpreter"):  # the host's, keyed as before
        base = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
        text = json.dumps([spec, base, sys.version], sort_keys=True)
    else:
        interp = interpreter(spec)
        text = json.dumps([spec, interp.path, interp.text], sort_keys=True)
    return "py-" + hashlib.sha256(text.encode()).hexdigest()[:20]


def ensure(spec: dict, directory: str) -> Environment:
    """The built environment of normalised `spec` under `directory`, building it first if no
    finished one is there (see the module docstring). BuildError says why a build failed, or
    that the spec's interpreter is not on this machine."""
    try:
        interp = interpreter(spec)
        path = os.path.join(directory, spec_key(spec))
    except ValueError as e:
        raise BuildError(str(e)) from e
    build_once.ensure_built(path, _MARKER, lambda p: _build(spec, p, interp), BuildError)
    return Environment(path, interp.base)


def _run(argv: list[str], what: str, deadline: float) -> None:
    try:
        r = subprocess.run(argv, capture_output=True, text=True, check=False,
                           timeout=max(deadline - time.monotonic(), 1.0))
    except subprocess.TimeoutExpired as e:
        raise BuildError(f"{what} did not finish in {BUILD_TIMEOUT_S:g} s") from e
    if r.returncode != 0:
        raise BuildError(f"{what} failed (exit {r.returncode}): {(r.stdout + r.stderr)[-2000:]}")


def _build(spec: dict, path: str, interp: Interpreter) -> None:
    """`<interp> -m venv --without-pip`, the host's pip installing the requirements into it, the
    tree opened to every uid read-only (sandboxes run as their own uid), the marker last."""
    t0 = time.monotonic()
    deadline = t0 + BUILD_TIMEOUT_S
    py = spec["python"]
    _run([interp.path, "-m", "venv", "--without-pip", path], f"{interp.path} -m venv", deadline)
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
        json.dump({"spec": spec, "python": interp.text, "interpreter": interp.path,
                   "build_s": round(seconds, 3)}, f)
    os.chmod(f.name, 0o644)
    os.rename(f.name, os.path.join(path, _MARKER))


def build_seconds(env: Environment) -> float:
    """How long `env`'s build took (its marker's record)."""
    with open(os.path.join(env.path, _MARKER)) as f:
        return float(json.load(f)["build_s"])
