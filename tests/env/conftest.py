"""Fixtures shared by the environment tests."""

import base64
import hashlib
import os
import zipfile

import pytest


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _write_wheel(directory, name: str, version: str, files: dict) -> None:
    dist = f"{name}-{version}.dist-info"
    entries = dict(files)
    entries[f"{dist}/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode()
    entries[f"{dist}/WHEEL"] = (
        b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    record = "".join(f"{p},{_record_hash(d)},{len(d)}\n" for p, d in entries.items())
    entries[f"{dist}/RECORD"] = (record + f"{dist}/RECORD,,\n").encode()
    with zipfile.ZipFile(os.path.join(directory, f"{name}-{version}-py3-none-any.whl"), "w") as z:
        for path, data in entries.items():
            z.writestr(path, data)


@pytest.fixture(scope="session")
def write_wheel():
    """`write_wheel(directory, name, version, {path: bytes})`: a pure-Python wheel
    `name-version-py3-none-any.whl` holding those files, for environments built offline."""
    return _write_wheel


_SWEBENCH_STATUS = {"PASSED": "passed", "FAILED": "failed", "ERROR": "failed", "XFAIL": "xfailed",
                    "SKIPPED": "skipped"}


@pytest.fixture(scope="session")
def as_coder_statuses():
    """`as_coder_statuses({id: status})`: a status map of the `swebench` package's log parsers in
    coder's words (coder.env.scoring.runners: an ERROR is "failed", an XFAIL "xfailed")."""
    return lambda statuses: {k: _SWEBENCH_STATUS[v] for k, v in statuses.items()}
