"""The persistent terminal: state survives calls, timeouts and exits are survivable, and
nothing of the session outlives close()."""

import os
import time

import pytest

from coder.env.runtime.sandbox import Limits, Sandbox, SandboxError
from coder.env.runtime.terminal import State, Terminal

LIMITS = Limits(timeout_s=30, output_bytes=16 << 10)


def _live_procs_of(uid: int) -> list[int]:
    """Processes of `uid` that are not dead (a zombie waits for the host's init to reap it)."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        if int(fields["Uid"].split()[0]) == uid and not fields["State"].strip().startswith("Z"):
            out.append(int(pid))
    return out


@pytest.fixture
def term():
    with Sandbox(limits=LIMITS) as sb:
        t = Terminal(sb)
        yield t
        t.close()


def test_cd_and_export_persist(term):
    r = term.run("mkdir -p sub && cd sub && export GREETING='hé ✓'; X=1")
    assert (r.exit_code, r.stdout, r.stderr) == (0, "", "")
    r = term.run('pwd; echo "$GREETING $X"')
    assert r.stdout == "/workspace/sub\nhé ✓ 1\n"
    assert term.run("false").exit_code == 1 and term.run("echo $?").stdout == "1\n"


def test_background_job_survives_between_calls(term):
    assert term.run("sleep 100 & echo started").stdout == "started\n"
    r = term.run("jobs")
    assert "Running" in r.stdout and "sleep 100" in r.stdout
    assert term.run("kill %1; wait %1; echo $?").stdout == "143\n"  # 128 + SIGTERM


def test_output_edge_cases(term):
    assert term.run("printf no-newline").stdout == "no-newline"
    assert term.run("cat; echo $?").stdout == "0\n"  # stdin is /dev/null, not the control pipe
    r = term.run("exec >&- 2>&-; echo lost")  # closes only this command's streams
    assert r.exit_code != 0 and term.run("echo back").stdout == "back\n"
    r = term.run("head -c 1000000 /dev/zero | tr '\\0' a")
    assert r.truncated and "output truncated" in r.stdout and len(r.stdout) < 20_000
    r = term.run("if then")  # a syntax error fails the command, not the session
    assert r.exit_code == 2 and "syntax error" in r.stderr
    assert term.run("return 1; break; echo alive").stdout == "alive\n"
    assert term.run("printf '\\xff\\xfe'").stdout == "\ufffd\ufffd"  # not UTF-8: replaced
    assert "NUL" in term.run("echo a\0b").stderr
    assert term.run("echo \ud800").stdout == "?\n"  # a lone surrogate (valid in JSON)


def test_timeout_kills_the_command_and_keeps_the_session(term):
    term.run("cd /tmp; export KEEP=yes; sleep 100 &")
    t0 = time.monotonic()
    r = term.run("sleep 30 | cat", timeout_s=1)
    assert r.timed_out and r.exit_code == -9 and "timed out after 1 s" in r.stderr
    assert time.monotonic() - t0 < 10  # about 1 s; generous on a loaded machine
    r = term.run('pwd; echo "$KEEP"; jobs')
    assert r.stdout.startswith("/tmp\nyes\n") and "sleep 100" in r.stdout  # job kept
    assert term.state is State.READY


def test_uninterruptible_shell_is_replaced(term):
    term.run("cd /tmp")
    r = term.run("while :; do :; done", timeout_s=1)  # a loop of builtins: the shell itself
    assert r.timed_out and "session was killed" in r.stderr and term.state is State.DEAD
    r = term.run("pwd")
    assert r.stdout == "/workspace\n" and "new shell session" in r.stderr


def test_exit_starts_a_fresh_session(term):
    term.run("cd /tmp; export A=1")
    r = term.run("exit 4")
    assert r.exit_code == 4 and "shell exited" in r.stderr and not r.timed_out
    r = term.run('pwd; echo "[$A]"')
    assert r.exit_code == 0 and r.stdout == "/workspace\n[]\n"
    assert "new shell session" in r.stderr and "exit code 4" in r.stderr
    assert term.run("kill -9 $$").exit_code != 0  # killed by the agent: the same
    assert term.run("echo ok").stdout == "ok\n"


def test_shell_killed_between_calls_is_restarted(term):
    term.run("(sleep 0.2; kill -9 $$) &")
    time.sleep(1.0)
    r = term.run("echo ok")
    assert r.stdout == "ok\n" and "new shell session" in r.stderr


def test_close_leaves_no_process():
    with Sandbox(limits=LIMITS) as sb:
        t = Terminal(sb)
        t.run("sleep 100 & (sleep 200 &) ; sleep 300 </dev/null >/dev/null 2>&1 &")
        assert len(_live_procs_of(sb.uid)) >= 4  # bash, three sleeps
        t.close()
        assert _live_procs_of(sb.uid) == []
        with pytest.raises(SandboxError):
            t.run("true")


def test_sandbox_close_ends_the_session():
    sb = Sandbox(limits=LIMITS)
    t = Terminal(sb)
    t.run("sleep 100 &")
    uid = sb.uid
    sb.close()
    deadline = time.monotonic() + 10
    while _live_procs_of(uid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _live_procs_of(uid) == []
    with pytest.raises(SandboxError):
        t.run("true")


def test_frozen_pauses_background_jobs_and_resumes_them(term):
    ticks = os.path.join(term.sandbox.workspace, "ticks")
    term.run("(while :; do echo x >> ticks; sleep 0.01; done) & sleep 100 &")
    time.sleep(0.2)
    with term.frozen():
        n = os.path.getsize(ticks)
        time.sleep(0.3)
        assert os.path.getsize(ticks) == n  # nothing of the session runs
    time.sleep(0.3)
    assert os.path.getsize(ticks) > n  # and it runs again
    r = term.run("jobs")
    assert r.stdout.count("Running") == 2 and "Stopped" not in r.stdout + r.stderr
    term.run("kill %1 %2")
    with term.frozen():  # the shell alone: nothing to stop
        pass
    assert term.run("echo ok").stdout == "ok\n"


def test_timeout_spares_disowned_and_orphaned_background_processes(term):
    term.run("sleep 100 & disown; (sleep 200 &); nohup sleep 300 >/dev/null 2>&1 &")
    r = term.run("x=$(sleep 30)", timeout_s=1)  # a command substitution: the shell's own group
    assert r.timed_out
    procs = term.run("ps -e -o args=").stdout.splitlines()
    assert {"sleep 100", "sleep 200", "sleep 300"} <= set(procs) and "sleep 30" not in procs
