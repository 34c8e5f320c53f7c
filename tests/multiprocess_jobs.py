"""Jobs of several processes in the tests: a test file run as a script once per process of a
`jax.distributed` job on localhost (tests/test_multiprocess.py, tests/infer/test_engine_multiprocess.py,
tests/rl/test_weight_sync.py), each process reporting one tagged JSON line on stdout."""
import json
import os
import socket
import subprocess
import sys

from tests import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    """A localhost port free now (the job's coordinator, a server)."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def spawn(script: str, args, devices: int) -> subprocess.Popen:
    """`python script *args` from the repository root with `devices` CPU devices, XLA:CPU
    compiling as the suite does (tests/xla_flags.py: these jobs are compile-bound), pipes for stdout / stderr."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
               XLA_FLAGS=xla_flags.merged(os.environ.get("XLA_FLAGS", ""), devices))
    return subprocess.Popen([sys.executable, script, *map(str, args)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def tagged_json(proc: subprocess.Popen, tag: str, timeout: float = 900):
    """The JSON after `tag ` on the line of `proc`'s stdout that starts with it, once `proc`
    exited 0 (else its stderr's end in the assertion)."""
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-4000:]
    return json.loads(next(x for x in out.splitlines() if x.startswith(tag + " "))[len(tag) + 1:])
