"""The agent's terminal: one long-lived bash per episode, inside the episode's sandbox.

`Sandbox.run` starts a new bwrap for every command, so nothing an agent does in a shell
survives the call. A `Terminal` keeps one bash running under the very same isolation
(`Sandbox.start`, built on `Sandbox._argv`: the sandbox uid, its rlimits, its namespaces), so
`cd`, `export` and background jobs (`server &`) carry over between calls, as in a real
terminal, and a call costs a pipe round trip instead of a bwrap start.

Protocol. The bash reads its script from a pipe (`bash -s`: unbuffered, one byte at a time,
so the script and the data it reads share the pipe). For each call the host writes

    IFS= read -r -d '' __coder_cmd      <- a script line: read the command ...
    <command text>\\0                    <- ... which is data up to a NUL, never parsed as script
    eval "$__coder_cmd" </dev/null ...  <- run it; then print an end marker on both streams

The command runs with `eval` at the top level of the shell (so `cd`, variables and `declare`
stay; `return`, `break` or a syntax error only fail that command), its stdin is /dev/null (the
pipe is the shell's script, never the command's input), and its stdout and stderr are
temporary redirections, so `exec >&-` cannot close the shell's own pipes. The end marker is
`\\x1e<call id> <exit code>\\x1e\\n` with a random id per call; output
before it is the call's (capped head + tail, as `Sandbox.run` does), bytes after it (a
background job's later output) are kept for the next call.

Timeouts. The shell runs with job control (`set -m`), so every pipeline is a process group of
its own. Before each call the host notes the process groups alive in the session (from the
namespace's own /proc: a few entries); on a timeout it kills, through the host's /proc, every
process of the namespace but init and the shell whose group is new or the shell's own (a
command substitution): the command dies, the shell prints its marker, and cwd, variables and
background jobs (disowned or `nohup`ed ones too) are kept. A shell that still does not answer (a loop of builtins, `exec
sleep 99`) is killed with its whole namespace.

Host-side file access. The file tools read and write the workspace from the host after checking
the path (`Sandbox.resolve`); `frozen()` stops every process of the session meanwhile, so no
background job can swap a directory for a symlink between the check and the open.

Limits are the sandbox's, per process: the shell lives for the whole episode, so its CPU-time
limit (`Limits.cpu_s`) counts every builtin it ran, and background jobs count in the sandbox
uid's process limit beside the other tools' commands. A shell killed by a limit is a shell
that ended (below).

States (`State`): NEW (no shell yet: the first call starts one), READY (a shell waits for a
command), DEAD (the shell ended: `exit`, killed, not interruptible; the next call starts a new
one and its output says that state was lost), CLOSED (calls raise `SandboxError`).
"""

from __future__ import annotations

import contextlib
import enum
import os
import secrets
import selectors
import signal
import subprocess
import threading
import time

from coder.env.runtime.sandbox import Result, Sandbox, SandboxError, _process_identity, _stream_cap

_SHELL = "exec /bin/bash --noprofile --norc -s"
_PREAMBLE = b'set -m\n__coder_rc=0\n__coder_status() { return "$1"; }\n'
_END = b"\x1e\n"  # terminates an end marker
_GRACE_S = 2.0  # after killing a timed-out command, how long the shell has to print its marker
_START_TIMEOUT_S = 30.0


class State(enum.Enum):
    NEW = "new"
    READY = "ready"
    DEAD = "dead"
    CLOSED = "closed"


def _call_script(call_id: str, command: str) -> bytes:
    """The bytes one call writes to the shell (module docstring)."""
    run = (
        'exec 61>&1 62>&2; __coder_status "$__coder_rc"; '  # `$?` is the previous command's
        'eval "$__coder_cmd" </dev/null >&61 2>&62; __coder_rc=$?; '
        f"builtin printf '\\036%s %s\\036\\n' {call_id} \"$__coder_rc\" >&2; "
        f"builtin printf '\\036%s %s\\036\\n' {call_id} \"$__coder_rc\"\n"
    )
    return (
        b"IFS= builtin read -r -d '' __coder_cmd\n"
        + command.encode(errors="replace")
        + b"\0"
        + run.encode()
    )


class _Stream:
    """One output pipe of the shell, split at the current call's end marker."""

    def __init__(self, f):
        self.fd = f.fileno()
        os.set_blocking(self.fd, False)
        self.buf = bytearray()  # read but not yet given to a call
        self.eof = False
        self.begin(b"", 1)

    def begin(self, tag: bytes, limit: int) -> None:
        self.tag, self.marker = tag, None
        self.feed, self.finish = _stream_cap(limit)

    def read(self) -> None:
        try:
            chunk = os.read(self.fd, 1 << 16)
        except BlockingIOError:
            return
        if chunk:
            self.buf += chunk
        else:
            self.eof = True

    def absorb(self) -> None:
        """Gives the call its output up to the marker; sets `marker` (its fields) once seen."""
        if self.marker is not None:
            return
        at = self.buf.find(self.tag)
        if at < 0:
            keep = len(self.tag) - 1  # a marker may straddle two reads
            cut = len(self.buf) if self.eof else max(len(self.buf) - keep, 0)
            self.feed(bytes(self.buf[:cut]))
            del self.buf[:cut]
            return
        self.feed(bytes(self.buf[:at]))
        del self.buf[:at]
        end = self.buf.find(_END, len(self.tag))
        if end >= 0:
            self.marker = self.buf[len(self.tag) : end].decode().split()
            del self.buf[: end + len(_END)]


def _proc_tree(root: int) -> list[int]:
    """Host pids of the descendants of `root` (from /proc: no per-process children lists)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(name))
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), ()):
            out.append(c)
            todo.append(c)
    return out


def _ns_ids(pid: int) -> tuple[int, int] | None:
    """(pid, process group) of a host pid as seen inside its innermost pid namespace."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return int(fields["NSpid"].split()[-1]), int(fields["NSpgid"].split()[-1])
    except (OSError, KeyError, ValueError):
        return None


def _state(pid: int) -> str | None:
    """The process's state letter (R, S, D, T, Z, ...); None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _alive(pid: int) -> bool:
    """Not yet dead. A zombie is dead: its orphaned kind waits for the host's init to reap it,
    which may take seconds, and holds nothing but its pid."""
    return _state(pid) not in (None, "Z", "X")


def _wait_stopped(pids, timeout_s: float = 2.0) -> bool:
    """Whether every one of `pids` is stopped (or dead) within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while any(_state(p) not in (None, "T", "t", "Z", "X") for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def _signal(pids, sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _kill(pids) -> None:
    _signal(pids, signal.SIGKILL)


class Terminal:
    """One persistent bash session in `sandbox` (module docstring). Thread-safe: calls are
    serialized. `run` never raises for what the command or the agent did; it raises
    `SandboxError` when the terminal is closed or a new shell cannot start."""

    def __init__(self, sandbox: Sandbox, timeout_s: float | None = None):
        self.sandbox = sandbox
        self.timeout_s = sandbox.limits.timeout_s if timeout_s is None else timeout_s
        self.state = State.NEW
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._out = self._err = None
        self._shell_pid = 0  # the shell's pid inside its namespace
        self._shell_host = self._init_host = 0  # host pids of the shell and its namespace's init
        self._shell_id = None  # the shell's `_process_identity`
        self._shell_group = 0  # the shell's process group inside its namespace
        self._kept: set[int] = set()  # process groups a timeout spares (namespace ids)
        self._lost = ""  # why the previous session ended: told at the start of the next one

    # ---- lifecycle -------------------------------------------------------------------------
    def _start(self) -> None:
        self._shell_pid = self._shell_host = self._init_host = self._shell_group = 0
        self._proc = self.sandbox.start(_SHELL)
        self._out, self._err = _Stream(self._proc.stdout), _Stream(self._proc.stderr)
        os.set_blocking(self._proc.stdin.fileno(), False)
        self.state = State.READY
        r = self._call("builtin echo $$", _START_TIMEOUT_S, _PREAMBLE)
        if r.exit_code != 0 or not r.stdout.strip().isdigit():
            self._end_session()
            self.state = State.NEW
            raise SandboxError(f"terminal: the shell failed to start: {r.stderr.strip()[:500]}")
        self._shell_pid = int(r.stdout)
        for pid in _proc_tree(self._proc.pid):
            ns = _ns_ids(pid)
            if ns and ns[0] == 1:
                self._init_host = pid
            elif ns and ns[0] == self._shell_pid:
                self._shell_host, self._shell_group = pid, ns[1]
        self._shell_id = _process_identity(self._shell_host)  # its pid may be reused once it ends

    def _end_session(self) -> None:
        """Kills the shell and every process of its namespace; waits until they are gone."""
        proc, self._proc = self._proc, None
        self.state = State.DEAD
        if proc is None:
            return
        tree = _proc_tree(proc.pid)
        _kill(tree)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
        for f in (proc.stdin, proc.stdout, proc.stderr):
            try:
                f.close()
            except OSError:
                pass
        self.sandbox.release(proc)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and any(_alive(p) for p in tree):
            time.sleep(0.01)

    def close(self) -> None:
        """Ends the session (no process of it is left); later calls raise SandboxError."""
        with self._lock:
            self._end_session()
            self.state = State.CLOSED

    @contextlib.contextmanager
    def frozen(self):
        """Every process of the session stopped (SIGSTOP) while the block runs; no call runs.

        The host-side file tools check a path (`Sandbox.resolve`), then open it: with no agent
        process running in between, no background job can swap a directory of the workspace
        for a symlink out of it. A shell alone (no other process) cannot act while it waits for
        its next command and is left alone; a session that cannot be stopped is killed (the
        next call says so)."""
        with self._lock:
            live = self.state is State.READY and self._proc.poll() is None
            live = live and _process_identity(self._shell_host) == self._shell_id
            stopped = self._stop_all() if live else []  # no shell: its namespace is gone
            try:
                yield
            finally:
                _signal(reversed(stopped), signal.SIGCONT)  # the shell last: its jobs run again

    def _others_alive(self) -> bool:
        """Whether a process besides init and the shell is in the session's pid namespace, read
        from the namespace's own /proc (reached through the shell's root): a few entries, where
        the host's /proc holds every process of the machine."""
        try:
            names = os.listdir(f"/proc/{self._shell_host}/root/proc")
        except OSError:
            return True  # cannot tell: assume so
        return sum(n.isdigit() for n in names) > 2

    def _ns_groups(self) -> set[int]:
        """Process groups alive in the session's namespace, as it numbers them."""
        root, groups = f"/proc/{self._shell_host}/root/proc", set()
        try:
            names = [n for n in os.listdir(root) if n.isdigit()] if self._shell_host else []
        except OSError:
            names = []
        for name in names:
            try:
                with open(f"{root}/{name}/stat") as f:
                    groups.add(int(f.read().rsplit(")", 1)[1].split()[2]))
            except (OSError, IndexError, ValueError):
                pass
        return groups

    def _stop_all(self) -> list[int]:
        """Stops the shell, then every other process of its namespace but init; the pids it
        stopped, shell first (processes the agent had stopped itself are not among them)."""
        if not self._others_alive():
            return []
        stopped, todo = [], [self._shell_host]  # first alone: it must not see its jobs stop
        for _ in range(20):
            todo = [p for p in todo if _state(p) not in (None, "T", "t", "Z", "X")]
            _signal(todo, signal.SIGSTOP)
            stopped += todo
            if not _wait_stopped(todo):
                break
            todo = [
                p for p in _proc_tree(self._proc.pid) if p not in stopped and p != self._init_host
            ]
            if not [p for p in todo if _state(p) not in (None, "T", "t", "Z", "X")]:
                return stopped
        self._lost = "the previous one could not be paused for a file tool and was killed"
        self._end_session()
        return []

    # ---- calls -----------------------------------------------------------------------------
    def run(self, command: str, timeout_s: float | None = None) -> Result:
        """Runs `command` in the session; see the module docstring."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        with self._lock:
            if self.state is State.CLOSED or self.sandbox.closed:
                raise SandboxError("terminal is closed")
            if "\0" in command:
                return Result(2, "", "error: the command contains a NUL character\n", False, False)
            note = ""
            if self.state is State.READY and self._proc.poll() is not None:
                self._lost = f"the shell exited (exit code {self._proc.returncode})"
                self._end_session()
            if self.state in (State.NEW, State.DEAD):
                if self._lost:
                    note = (
                        f"[new shell session: {self._lost}; cwd is /workspace again, variables "
                        "and background jobs are gone]\n"
                    )
                self._lost = ""
                self._start()
            r = self._call(command, timeout_s)
            return Result(
                r.exit_code, r.stdout, note + r.stderr, r.timed_out, r.truncated, r.duration_s
            )

    def _call(self, command: str, timeout_s: float, preamble: bytes = b"") -> Result:
        t0 = time.monotonic()
        call_id = secrets.token_hex(8)
        tag = b"\x1e" + call_id.encode() + b" "
        for s in (self._out, self._err):
            s.begin(tag, self.sandbox.limits.output_bytes)
        self._kept = self._ns_groups() - {self._shell_group}
        outcome = self._exchange(preamble + _call_script(call_id, command), t0 + timeout_s)
        stdout, trunc_o = self._out.finish()
        stderr, trunc_e = self._err.finish()
        code = int(self._out.marker[0]) if self._out.marker else -signal.SIGKILL
        timed_out = outcome != "done" and outcome != "exited"
        if outcome == "timeout":
            code = -signal.SIGKILL
            stderr += (
                f"\n[command timed out after {timeout_s:g} s; its processes were killed; the "
                "shell session goes on (cwd, variables and background jobs kept)]\n"
            )
        elif outcome == "stuck":
            stderr += (
                f"\n[command timed out after {timeout_s:g} s and the shell could not be "
                "interrupted: the session was killed; the next call starts a new one]\n"
            )
            self._lost = "the previous one was killed after a timeout"
        elif outcome == "exited":
            code = self._proc.wait() if self._proc else code
            stderr += f"\n[the shell exited (exit code {code}); the next call starts a new one]\n"
            self._lost = f"the shell exited (exit code {code})"
            self._end_session()
        return Result(code, stdout, stderr, timed_out, trunc_o or trunc_e, time.monotonic() - t0)

    def _exchange(self, script: bytes, deadline: float) -> str:
        """Writes the call's script and reads both streams up to its markers. Returns "done",
        "timeout" (the command was killed, the shell lives), "stuck" (the shell was killed)
        or "exited" (the shell ended)."""
        proc, streams = self._proc, (self._out, self._err)
        pending = memoryview(script)
        timed_out = False
        next_kill = 0.0
        with selectors.DefaultSelector() as sel:
            for s in streams:
                sel.register(s.fd, selectors.EVENT_READ, s)
            sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE, None)
            for s in streams:
                s.absorb()  # output left over from background jobs, and maybe nothing else
            while not all(s.marker is not None for s in streams):
                if any(s.eof for s in streams):
                    return "exited"
                now = time.monotonic()
                if now >= deadline:
                    if timed_out:
                        self._lost = "the previous one was killed after a timeout"
                        self._end_session()
                        return "stuck"
                    timed_out, deadline = True, now + _GRACE_S
                if timed_out and now >= next_kill:  # again and again: a fork may race the scan
                    self._kill_foreground()
                    next_kill = now + 0.2
                for key, _ in sel.select(timeout=max(min(deadline - now, 0.2), 0.0)):
                    if key.data is None:
                        try:
                            n = os.write(key.fd, pending)
                        except BlockingIOError:
                            n = 0
                        except BrokenPipeError:  # the shell is gone: end of file follows
                            n = len(pending)
                        pending = pending[n:]
                        if not pending:
                            sel.unregister(key.fd)
                    else:
                        key.data.read()
                        key.data.absorb()
        return "timeout" if timed_out else "done"

    def _kill_foreground(self) -> None:
        """Kills the running command: every process of the namespace except its init, the
        shell, and the process groups alive before this call (but the shell's)."""
        if self._proc is None:
            return
        victims = []
        for pid in _proc_tree(self._proc.pid):
            ids = _ns_ids(pid)
            if ids and ids[0] not in (1, self._shell_pid) and ids[1] not in self._kept:
                victims.append(pid)
        _kill(victims)
