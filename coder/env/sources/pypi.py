"""A package index's releases as source trees: list a package's versions, download their sdists
once (checked against the index's sha256), unpack them.

The index is read through its JSON API (PEP 691's sibling, the `pypi/<name>/json` document
PyPI and its mirrors serve): each release's files with their kind (`sdist`), URL (absolute, or
relative to the document), sha256 and upload time. Only final releases that are not yanked and
have an sdist count: pre-releases and wheel-only releases have no source tree to make a task of.

Cache: `<cache>/<name>/<file name>`, written under a temporary name, checked, then renamed, so
a download cut off never leaves a file that looks whole. Default `$XDG_CACHE_HOME/coder/sdists`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import tarfile
import tempfile
import urllib.parse
import urllib.request
import zipfile

from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

DEFAULT_INDEX = "https://pypi.org/pypi"
TIMEOUT_S = 60.0
# Files an sdist build writes into the archive; not part of the project's source.
GENERATED = re.compile(r"(^|/)(PKG-INFO|[^/]+\.egg-info(/.*)?)$")


class PackageIndexError(RuntimeError):
    """The index could not be read, or a release has no usable sdist."""


@dataclasses.dataclass(frozen=True)
class Release:
    """One final release of `name` and its sdist."""

    name: str  # canonical project name
    version: str
    url: str  # the sdist's absolute URL
    filename: str
    sha256: str
    upload_time: str  # ISO 8601, UTC ("2026-11-18T10:01:02")


def default_cache() -> str:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "coder", "sdists")


def _get(url: str) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as r:
            return r.read()
    except OSError as e:  # URLError, HTTPError, timeouts
        raise PackageIndexError(f"GET {url}: {e}") from e


def releases(name: str, index: str = DEFAULT_INDEX) -> list[Release]:
    """Every final, unyanked release of `name` with an sdist, oldest first."""
    url = f"{index.rstrip('/')}/{canonicalize_name(name)}/json"
    try:
        doc = json.loads(_get(url))
    except json.JSONDecodeError as e:
        raise PackageIndexError(f"{url}: not JSON: {e}") from e
    out = []
    for version, files in (doc.get("releases") or {}).items():
        try:
            v = Version(version)
        except InvalidVersion:
            continue
        sdists = [f for f in files if f.get("packagetype") == "sdist" and not f.get("yanked")]
        if v.is_prerelease or v.is_devrelease or not sdists:
            continue
        f = sdists[0]
        out.append(Release(
            name=canonicalize_name(name),
            version=version,
            url=urllib.parse.urljoin(url, f["url"]),
            filename=f["filename"],
            sha256=f.get("digests", {}).get("sha256", ""),
            upload_time=(f.get("upload_time_iso_8601") or f.get("upload_time") or "")[:19],
        ))
    if not out:
        raise PackageIndexError(f"{name}: no final release with an sdist at {url}")
    return sorted(out, key=lambda r: Version(r.version))


def fetch(release: Release, cache: str = "") -> str:
    """The local path of `release`'s sdist, downloaded into the cache once and checked against
    the index's sha256 (a mismatch is an error, and nothing is kept)."""
    d = os.path.join(cache or default_cache(), release.name)
    path = os.path.join(d, release.filename)
    if os.path.exists(path):
        return path
    os.makedirs(d, exist_ok=True)
    data = _get(release.url)
    digest = hashlib.sha256(data).hexdigest()
    if release.sha256 and digest != release.sha256:
        raise PackageIndexError(f"{release.url}: sha256 {digest} != the index's {release.sha256}")
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".part-")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    return path


def unpack(sdist: str, dest: str) -> str:
    """Unpack `sdist` (.tar.gz / .tar.bz2 / .zip) into the empty or new directory `dest`, its
    single top-level directory (`name-version/`) stripped and the files an sdist build
    generates (`PKG-INFO`, `*.egg-info/`) left out. Returns `dest`."""
    with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(dest))) as tmp:
        if zipfile.is_zipfile(sdist):
            with zipfile.ZipFile(sdist) as z:
                for member in z.namelist():
                    if member.startswith("/") or ".." in member.split("/"):
                        raise PackageIndexError(f"{sdist}: unsafe path {member!r}")
                z.extractall(tmp)
        else:
            with tarfile.open(sdist) as t:
                t.extractall(tmp, filter="data")  # refuses absolute paths, .., device files
        tops = os.listdir(tmp)
        root = os.path.join(tmp, tops[0]) if len(tops) == 1 and os.path.isdir(
            os.path.join(tmp, tops[0])) else tmp
        os.makedirs(dest, exist_ok=True)
        for dirpath, dirnames, filenames in os.walk(root):
            rel_dir = os.path.relpath(dirpath, root)
            for fn in filenames:
                rel = os.path.normpath(os.path.join(rel_dir, fn))
                if GENERATED.search(rel):
                    continue
                os.makedirs(os.path.join(dest, os.path.dirname(rel)), exist_ok=True)
                shutil.move(os.path.join(dirpath, fn), os.path.join(dest, rel))
    return dest


def runtime_requirements(tree: str) -> list[str]:
    """The requirements a source tree declares for running (PEP 621 `[project] dependencies`
    of its pyproject.toml), markers kept; [] when it declares none there."""
    import tomllib  # Python >= 3.11 (python_requires is 3.10)

    path = os.path.join(tree, "pyproject.toml")
    if not os.path.exists(path):
        return []
    with open(path, "rb") as f:
        try:
            project = tomllib.load(f).get("project", {})
        except tomllib.TOMLDecodeError:
            return []
    deps = project.get("dependencies", [])
    return [d for d in deps if isinstance(d, str)]
