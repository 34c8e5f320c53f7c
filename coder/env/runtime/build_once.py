"""A directory built once per machine, whichever process (env worker, thread) asks first.

Task venvs (coder.env.runtime.environments) and unpacked images (coder.env.runtime.images) are built on the
host and shared by every sandbox of a machine. A build counts as done only once its marker file
is in the directory, written last; builders serialise on `<path>.lock` (flock), so those that
ask meanwhile wait for the first and then reuse its result; a directory without the marker (a
builder killed mid-way) is deleted and built again, and a build that fails leaves nothing.
"""

from __future__ import annotations

import fcntl
import os
import shutil


def ensure_built(path: str, marker: str, build, error=RuntimeError) -> None:
    """`path` built: nothing to do when `path/marker` exists, else `build(path)` under the lock
    (it writes the marker last). `error(message)` is raised for an OSError; build's own
    exceptions pass through, its partial output removed."""
    if os.path.isfile(os.path.join(path, marker)):
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        lock = open(path + ".lock", "a")
    except OSError as e:
        raise error(f"directory {os.path.dirname(path)}: {e}") from e
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.isfile(os.path.join(path, marker)):  # another builder finished meanwhile
            return
        shutil.rmtree(path, ignore_errors=True)  # a killed builder's leftovers
        try:
            build(path)
        except BaseException as e:
            shutil.rmtree(path, ignore_errors=True)
            if isinstance(e, OSError):
                raise error(f"building {path}: {e}") from e
            raise
