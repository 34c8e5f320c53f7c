"""Task environments from OCI images, without a daemon: an image layout unpacked once per
manifest digest into a root filesystem the sandbox runs the task in.

A task names an image layout (a directory in the OCI image-layout format) and a reference
(its tag) in its environment:

    "environment": {"image": {"layout": "/data/images/django", "ref": "4.2"}}

Images from a registry are copied into a layout first, where a registry is reachable:
`skopeo copy docker://python:3.12-slim oci:/data/images/python:3.12-slim` (Debian's skopeo).

Why umoci (Debian's `umoci`, installed by scripts/setup.sh): it unpacks a layout's layers in
order with OCI whiteouts applied, as an unprivileged user (`--rootless`), and writes the image's
runtime configuration (environment variables) beside the root filesystem, with no daemon and
no registry; a Python OCI library would leave layer ordering and whiteouts to us.

Cache: `<environments dir>/images/<manifest digest>/` (`rootfs/` and umoci's `config.json`),
keyed by the manifest's digest, so a layout copied elsewhere or re-tagged reuses the unpacked
tree, and a changed image (new digest) unpacks anew: once per machine (coder.env.runtime.build_once,
marker `coder-image.json`), as task venvs are built. The unpacked tree gets the mount points the sandbox binds over it
(/workspace, /tmp, /proc, /dev, /etc/passwd, /etc/group, and /.coder-host/usr: the host's /usr,
from which the sandbox's own helpers, setpriv and prlimit, run through the host's dynamic
loader, so an image needs neither).

What runs inside: the image's `/bin/bash` (or `/bin/sh`) with the image's environment
variables; a task scored by pytest needs python and pytest in the image, a patch solution
needs git there, the agent's terminal needs bash.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import subprocess
import tempfile
import time

from coder.env.runtime import build_once

HOST = "/.coder-host"  # where the host's /usr is bound inside an image's sandbox
_MARKER = "coder-image.json"
_KEYS = {"layout", "ref"}
UNPACK_TIMEOUT_S = 1800.0


class ImageError(RuntimeError):
    """An image could not be read or unpacked (the sandbox reports an infrastructure error)."""


@dataclasses.dataclass(frozen=True)
class Image:
    """An unpacked image: its root filesystem, environment ("KEY=value", ...) and shell."""

    path: str  # the cache entry; rootfs/ inside
    env: tuple
    shell: str

    @property
    def rootfs(self) -> str:
        return os.path.join(self.path, "rootfs")

    @property
    def path_var(self) -> str:
        found = [e.split("=", 1)[1] for e in self.env if e.startswith("PATH=")]
        return found[0] if found else "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

    def root_args(self) -> list[str]:
        """bwrap arguments of the root filesystem: the image (its mount points made at unpack),
        and the host's /usr only where the sandbox's helpers run from (`host_tool`)."""
        return ["--ro-bind", self.rootfs, "/", "--ro-bind", "/usr", HOST + "/usr"]

    def setenv_args(self) -> list[str]:
        """bwrap `--setenv` arguments of the image's own variables (LANG, PYTHON_VERSION, ...);
        PATH, HOME, USER and TERM are the sandbox's."""
        out = []
        for item in self.env:
            key, _, value = item.partition("=")
            if key and key not in ("PATH", "HOME", "USER", "TERM"):
                out += ["--setenv", key, value]
        return out

    def host_path(self, inner: str) -> str:
        """Where path `inner` of the image is on the host."""
        return os.path.join(self.rootfs, inner.lstrip("/"))


def normalize(spec, where: str) -> dict:
    """{"layout": absolute path, "ref": tag}; ValueError naming the key."""
    if not isinstance(spec, dict):
        raise ValueError(f"{where} must be an object {{\"layout\": DIR, \"ref\": TAG}}")
    unknown = set(spec) - _KEYS
    if unknown:
        raise ValueError(f"{where} has unknown keys {sorted(unknown)} (supported: {sorted(_KEYS)})")
    layout, ref = spec.get("layout"), spec.get("ref", "latest")
    if not isinstance(layout, str) or not os.path.isabs(layout):
        raise ValueError(f"{where}.layout must be an absolute path of an OCI image layout "
                         f"(got {layout!r}; copy a registry image with `skopeo copy docker://IMAGE "
                         "oci:DIR:TAG`)")
    if not isinstance(ref, str) or not ref:
        raise ValueError(f"{where}.ref must be a non-empty tag")
    return {"layout": os.path.normpath(layout), "ref": ref}


def manifest_digest(layout: str, ref: str) -> str:
    """The digest of the manifest tagged `ref` in the layout's index.json."""
    path = os.path.join(layout, "index.json")
    try:
        with open(path) as f:
            index = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ImageError(f"{layout} is not an OCI image layout: {e}") from e
    tags = {}
    for m in index.get("manifests", []):
        tag = (m.get("annotations") or {}).get("org.opencontainers.image.ref.name")
        if tag:
            tags[tag] = m
    if ref not in tags:
        raise ImageError(f"{layout} has no image tagged {ref!r} (tags: {sorted(tags)})")
    m = tags[ref]
    if m.get("mediaType", "").endswith("image.index.v1+json"):
        raise ImageError(f"{layout}:{ref} is a multi-platform index: copy one platform "
                         "(`skopeo copy --override-arch amd64 ...`)")
    return m["digest"]


def host_loader() -> tuple[str, str]:
    """(the host's dynamic loader, its library directory), both as seen inside an image's
    sandbox (under HOST): the sandbox's helpers run through them. ImageError where the loader
    is not under /usr (a host without a merged /usr)."""
    for name in ("/lib64/ld-linux-x86-64.so.2", "/lib/ld-linux-aarch64.so.1"):
        if os.path.exists(name):
            real = os.path.realpath(name)
            if not real.startswith("/usr/"):
                raise ImageError(f"the host's loader {real} is not under /usr: image sandboxes "
                                 "need a merged-/usr host")
            return HOST + real, HOST + os.path.dirname(real)
    raise ImageError("no dynamic loader found on the host")


@functools.lru_cache(maxsize=8)  # every command of an image's sandbox asks
def host_tool(name: str) -> list[str]:
    """argv prefix that runs the host's `name` (setpriv, prlimit) inside an image's sandbox."""
    real = os.path.realpath(shutil.which(name) or f"/usr/bin/{name}")
    if not real.startswith("/usr/"):
        raise ImageError(f"{name} ({real}) is not under /usr")
    loader, libdir = host_loader()
    return [loader, "--library-path", libdir, HOST + real]


def ensure(spec: dict, directory: str) -> Image:
    """The unpacked image of normalised `spec` under `directory/images/`, unpacking it first if
    no finished one is there. ImageError says why it could not be."""
    digest = manifest_digest(spec["layout"], spec["ref"])
    root = os.path.join(directory, "images")
    path = os.path.join(root, digest.replace(":", "-"))
    build_once.ensure_built(path, _MARKER, lambda p: _unpack(spec, digest, p), ImageError)
    return _load(path)


def _load(path: str) -> Image:
    with open(os.path.join(path, _MARKER)) as f:
        rec = json.load(f)
    return Image(path, tuple(rec["env"]), rec["shell"])


def _unpack(spec: dict, digest: str, path: str) -> None:
    umoci = shutil.which("umoci")
    if umoci is None:
        raise ImageError("umoci is not installed: image environments need it "
                         "(apt-get install umoci; scripts/setup.sh installs it)")
    t0 = time.monotonic()
    tmp = tempfile.mkdtemp(dir=os.path.dirname(path), prefix=".unpack-")
    bundle = os.path.join(tmp, "bundle")
    try:
        try:
            r = subprocess.run([umoci, "unpack", "--rootless", "--image",
                                f"{spec['layout']}:{spec['ref']}", bundle],
                               capture_output=True, text=True, timeout=UNPACK_TIMEOUT_S)
        except subprocess.TimeoutExpired as e:
            raise ImageError(f"umoci unpack did not finish in {UNPACK_TIMEOUT_S:g} s") from e
        if r.returncode != 0:
            raise ImageError(f"umoci unpack {spec['layout']}:{spec['ref']} failed "
                             f"(exit {r.returncode}): {(r.stdout + r.stderr)[-1500:]}")
        rootfs = os.path.join(bundle, "rootfs")
        for d in ("workspace", "tmp", "proc", "dev", "etc", HOST.lstrip("/") + "/usr"):
            _inside(rootfs, d, make=True)
        for f in ("etc/passwd", "etc/group"):
            if not os.path.lexists(os.path.join(rootfs, f)):
                open(os.path.join(rootfs, f), "w").close()
        os.chmod(rootfs, 0o755)
        with open(os.path.join(bundle, "config.json")) as f:
            env = json.load(f).get("process", {}).get("env", [])
        shell = next((s for s in ("/bin/bash", "/usr/bin/bash", "/bin/sh")
                      if _exists_inside(rootfs, s)), None)
        if shell is None:
            raise ImageError(f"{spec['layout']}:{spec['ref']} has no /bin/bash or /bin/sh")
        with open(os.path.join(bundle, _MARKER + ".tmp"), "w") as f:
            json.dump({"spec": spec, "digest": digest, "env": env, "shell": shell,
                       "unpack_s": round(time.monotonic() - t0, 3)}, f)
        os.rename(bundle, path)
        os.rename(os.path.join(path, _MARKER + ".tmp"), os.path.join(path, _MARKER))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _inside(rootfs: str, rel: str, make: bool = False) -> str:
    """`rel` under `rootfs` with its symlinks resolved inside the image (an absolute link such
    as /bin -> /usr/bin must not lead to the host's directory); made as directories if asked."""
    cur = rootfs
    for part in rel.strip("/").split("/"):
        nxt = os.path.join(cur, part)
        for _ in range(40):
            if not os.path.islink(nxt):
                break
            target = os.readlink(nxt)
            nxt = os.path.join(rootfs, target.lstrip("/")) if target.startswith("/") else \
                os.path.normpath(os.path.join(cur, target))
        if not os.path.realpath(nxt).startswith(os.path.realpath(rootfs)):
            raise ImageError(f"{rel} leaves the image's root filesystem")
        if make and not os.path.exists(nxt):
            os.mkdir(nxt, 0o755)
        cur = nxt
    return cur


def _exists_inside(rootfs: str, rel: str) -> bool:
    try:
        return os.path.isfile(_inside(rootfs, rel))
    except ImageError:
        return False
