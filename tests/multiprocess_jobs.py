"""Jobs of several processes in the tests: a test file run as a script once per process of a
`jax.distributed` job on localhost (tests/test_multiprocess.py, tests/infer/test_engine_multiprocess.py,
tests/rl/test_weight_sync.py), each process reporting one tagged JSON line on stdout.

A job's stdout and stderr go to files, never to pipes: a pipe holds 64 KiB, and a test that
waits on one process (or on a file the job writes) reads nobody's pipe meanwhile, so a chatty
process (Ray forwards its workers' logs to the driver's stdout) blocks in write() and the whole
job hangs with it (CI saw the 4-process GRPO run stall before its first step)."""
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile

from tests import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    """A localhost port free now (the job's coordinator, a server)."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


class Job(subprocess.Popen):
    """A subprocess whose stdout and stderr (or both in one, `merged`) are temporary files:
    `output()` reads what it wrote so far, `communicate()` waits and returns it all."""

    def __init__(self, args, merged: bool = False, **kwargs):
        self._out = tempfile.TemporaryFile("w+")
        self._err = self._out if merged else tempfile.TemporaryFile("w+")
        super().__init__(args, stdout=self._out, stderr=self._err, text=True, **kwargs)

    @staticmethod
    def _read(f) -> str:
        f.flush()
        with open(f.fileno(), closefd=False) as g:  # its own offset: the child appends meanwhile
            g.seek(0)
            return g.read()

    def output(self) -> tuple[str, str]:
        """(stdout, stderr) so far (the same text twice when merged)."""
        return self._read(self._out), self._read(self._err)

    def communicate(self, input=None, timeout=None) -> tuple[str, str]:
        """Waits for the exit, then `output()`. A job still running after `timeout` s is killed
        with every process below it (Ray's, a pool's: a hung job must not outlive its test) and
        AssertionError gives the end of its output."""
        assert input is None, "a job has no stdin"
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill_tree()
            out, err = self.output()
            raise AssertionError(f"{' '.join(map(str, self.args[1:]))}: still running after {timeout} s, "
                                 f"killed; its output's end:\n{out[-3000:]}\n{err[-3000:]}") from None
        return self.output()

    def kill_tree(self) -> None:
        """SIGKILL to this process and every process below it."""
        from coder.env.runtime.terminal import _proc_tree

        for pid in _proc_tree(self.pid) + [self.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.wait()


def spawn(script: str, args, devices: int) -> Job:
    """`python script *args` from the repository root with `devices` CPU devices, XLA:CPU
    compiling as the suite does (tests/xla_flags.py: these jobs are compile-bound)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
               XLA_FLAGS=xla_flags.merged(os.environ.get("XLA_FLAGS", ""), devices))
    return Job([sys.executable, script, *map(str, args)], cwd=ROOT, env=env)


def tagged_json(proc: Job, tag: str, timeout: float = 900):
    """The JSON after `tag ` on the line of `proc`'s stdout that starts with it, once `proc`
    exited 0 (else its stderr's end in the assertion)."""
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-4000:]
    return json.loads(next(x for x in out.splitlines() if x.startswith(tag + " "))[len(tag) + 1:])
