"""Sandbox security: each attack fails and the host is untouched."""

import os
import socket
import threading
import time

import pytest

from coder.env.runtime import sandbox as sandbox_lib
from coder.env.runtime.sandbox import Limits, Sandbox, SandboxError
from coder.env.tasks import Task

TIGHT = Limits(
    timeout_s=10,
    cpu_s=5,
    memory_bytes=256 << 20,
    nproc=16,
    fsize_bytes=1 << 20,
    tmp_bytes=8 << 20,
    output_bytes=16 << 10,
)


def _procs_of(uid: int) -> list[int]:
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("Uid:") and int(line.split()[1]) == uid:
                        out.append(int(pid))
        except OSError:
            continue
    return out


def _wait_no_procs(uid: int, timeout: float = 5.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = _procs_of(uid)
        if not left:
            return []
        time.sleep(0.05)
    return _procs_of(uid)


@pytest.fixture
def sb():
    s = Sandbox(limits=TIGHT)
    yield s
    s.close()


def test_runs_as_unprivileged_uid_with_scrubbed_env(sb, monkeypatch):
    monkeypatch.setenv("CODER_TEST_SECRET", "hunter2")
    r = sb.run(
        "id -u; env; pwd; python -c 'import pytest, sys; print(sys.version_info[:2])';"
        "python -c 'import multiprocessing as m; m.Lock()'"
    )
    assert r.exit_code == 0, r.stderr
    lines = r.stdout.splitlines()
    assert int(lines[0]) == sb.uid and sb.uid != 0
    assert "hunter2" not in r.stdout and "CODER_TEST_SECRET" not in r.stdout
    assert "/workspace" in lines


def test_no_network_loopback_or_outside(sb):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    accepted = []

    def accept():
        try:
            accepted.append(server.accept())
        except OSError:
            pass

    t = threading.Thread(target=accept)
    t.start()
    code = (
        "import socket\n"
        "for addr in [('127.0.0.1', %d), ('8.8.8.8', 53), ('1.1.1.1', 443)]:\n"
        "    s = socket.socket(); s.settimeout(2)\n"
        "    try:\n"
        "        s.connect(addr); print('CONNECTED', addr)\n"
        "    except OSError as e:\n"
        "        print('refused', addr, e)\n" % port
    )
    r = sb.run(f'python -c "{code}"')
    t.join()
    server.close()
    assert "CONNECTED" not in r.stdout, r.stdout
    assert sum(line.startswith("refused") for line in r.stdout.splitlines()) == 3
    assert not accepted  # nothing reached the host's listener
    assert "lo" in sb.run("cat /proc/net/dev").stdout  # only a loopback device inside


def test_setup_gets_the_network_only_when_configured_and_the_agent_never(dates_repo_task):
    """env.setup_network: a task's setup reaches a server on the host (as `pip install` reaches
    an index); the agent's commands in the same sandbox still have no network. Off (the
    default), the same setup cannot connect and the sandbox fails naming the task."""
    import http.server

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"wheel-bytes")

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    fetch = ("python -c \"import urllib.request; open('fetched.txt', 'w').write(urllib.request.urlopen("
             f"'http://127.0.0.1:{server.server_address[1]}/pkg', timeout=5).read().decode())\"")
    task = Task("net/1", "p", {}, {}, repo=dates_repo_task.task.repo, commit=dates_repo_task.task.commit, setup=fetch)
    try:
        with Sandbox(task, Limits(setup_network=True)) as sb:
            assert sb.read("fetched.txt") == "wheel-bytes"
            r = sb.run(fetch.replace("fetched.txt", "again.txt"))
            assert r.exit_code != 0 and "urlopen error" in r.stderr, r.stderr
            assert "wheel-bytes" not in sb.read("again.txt")
        with pytest.raises(SandboxError, match=r"task 'net/1': setup failed"):
            Sandbox(task)
    finally:
        server.shutdown()
        server.server_close()


def test_host_secret_not_readable(sb, tmp_path):
    secret = tmp_path / "home" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text("TOP-SECRET")
    os.chmod(tmp_path, 0o755)
    r = sb.run(
        f"cat {secret}; ls /work /root/.ssh /home; cat /proc/1/environ; grep -r TOP-SECRET /tmp /etc 2>/dev/null"
    )
    assert "TOP-SECRET" not in r.stdout
    assert r.exit_code != 0
    with pytest.raises(ValueError):
        sb.read(str(secret))


def test_cannot_write_outside_workspace(sb, tmp_path):
    target = tmp_path / "pwned"
    os.chmod(tmp_path, 0o777)
    cmds = [
        f"echo x > {target}",
        "echo x > /usr/pwned",
        "echo x > /etc/pwned",
        f"echo x > {os.path.dirname(os.__file__)}/pwned.py",
        "mkdir /pwned",
    ]
    for c in cmds:
        assert sb.run(c).exit_code != 0, c
    assert not target.exists()
    assert not os.path.exists("/usr/pwned") and not os.path.exists("/etc/pwned")
    assert not os.path.exists(os.path.join(os.path.dirname(os.__file__), "pwned.py"))
    # /tmp inside is private: a file written there never appears on the host
    name = f"coder-sandbox-probe-{os.getpid()}"
    assert sb.run(f"echo x > /tmp/{name} && cat /tmp/{name}").stdout.strip() == "x"
    assert not os.path.exists(f"/tmp/{name}")


def test_symlink_and_dotdot_escapes_refused(sb, tmp_path):
    (tmp_path / "secret").write_text("TOP-SECRET")
    os.chmod(tmp_path, 0o755)
    assert (
        sb.run(
            f"ln -s {tmp_path}/secret leak && ln -s {tmp_path} dirlink && ln -s / rootlink"
        ).exit_code
        == 0
    )
    assert "TOP-SECRET" not in sb.run("cat leak; cat dirlink/secret").stdout
    for path in (
        "leak",
        "dirlink/secret",
        "../" * 8 + str(tmp_path / "secret"),
        "rootlink/etc/passwd",
        "/workspace/../etc/passwd",
    ):
        with pytest.raises((ValueError, FileNotFoundError)):
            sb.read(path)
    for path in ("dirlink/new", "../escape", "rootlink/tmp/escape", "leak"):
        with pytest.raises(ValueError):
            sb.write(path, "x")
    assert (tmp_path / "secret").read_text() == "TOP-SECRET"
    assert sorted(os.listdir(tmp_path)) == ["secret"]


def test_fifo_in_workspace_does_not_block_host(sb):
    assert sb.run("mkfifo pipe").exit_code == 0
    with pytest.raises(FileNotFoundError):
        sb.read("pipe")
    sb.write("pipe", "now a file")  # replaced, not opened (opening a FIFO would block)
    assert sb.read("pipe") == "now a file"


def test_fork_bomb_is_bounded(sb):
    t0 = time.monotonic()
    r = sb.run(":(){ :|:& };:", timeout_s=5)
    assert time.monotonic() - t0 < 20  # killed at the 5 s limit (slack for a loaded CI machine)
    # The shell may return before its children hit the limit (the bomb runs in the background);
    # what matters is that nothing of it survives, and the counter below shows the limit binds.
    assert _wait_no_procs(sb.uid) == []
    counter = (
        "import os, time\n"
        "n = 0\n"
        "try:\n"
        "    while True:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(30); os._exit(0)\n"
        "        n += 1\n"
        "except OSError as e:\n"
        "    print('forks', n, e.errno)\n"
    )
    sb.write("bomb.py", counter)
    r = sb.run("python bomb.py", timeout_s=30)
    assert r.stdout.startswith("forks"), (r.stdout, r.stderr, r.timed_out)
    forks = int(r.stdout.split()[1])
    assert 0 < forks < TIGHT.nproc  # RLIMIT_NPROC binds: the sandbox uid is not root
    assert _wait_no_procs(sb.uid) == []
    assert sb.run("echo alive").stdout.strip() == "alive"  # the sandbox still works afterwards


def test_memory_bomb_fails(sb):
    r = sb.run("python -c 'x = bytearray(1 << 30); print(\"allocated\")'")
    assert "allocated" not in r.stdout
    assert r.exit_code != 0 and "MemoryError" in r.stderr


def test_infinite_loop_times_out(sb):
    t0 = time.monotonic()
    r = sb.run("while true; do :; done", timeout_s=1)
    assert r.timed_out and time.monotonic() - t0 < 4
    assert "timed out" in r.stderr
    assert _wait_no_procs(sb.uid) == []


def test_closing_output_does_not_escape_the_timeout(sb):
    t0 = time.monotonic()
    r = sb.run("exec >&- 2>&-; sleep 100", timeout_s=1)
    assert r.timed_out and time.monotonic() - t0 < 4
    assert _wait_no_procs(sb.uid) == []


def test_cpu_limit_kills_busy_process():
    with Sandbox(limits=Limits(timeout_s=20, cpu_s=1)) as s:
        t0 = time.monotonic()
        r = s.run("python -c 'while True: pass'")
        assert not r.timed_out and r.exit_code != 0
        assert time.monotonic() - t0 < 10


def test_file_size_limit(sb):
    r = sb.run("head -c 2000000 /dev/zero > big")
    assert r.exit_code != 0
    assert os.path.getsize(os.path.join(sb.workspace, "big")) <= TIGHT.fsize_bytes


def test_background_process_does_not_survive(sb):
    r = sb.run("sleep 1000 & nohup sleep 1000 >/dev/null 2>&1 & setsid sleep 1000 & echo started")
    assert r.stdout.strip() == "started" and r.duration_s < 5
    assert _wait_no_procs(sb.uid) == []


def test_output_flood_is_truncated(sb):
    t0 = time.monotonic()
    r = sb.run("head -c 100000000 /dev/zero | tr '\\0' x; echo END")
    assert r.truncated
    assert len(r.stdout) < TIGHT.output_bytes + 200
    assert "output truncated" in r.stdout and r.stdout.rstrip().endswith("END")
    assert time.monotonic() - t0 < 20


def test_sigterm_ignoring_child_is_killed(sb):
    r = sb.run("trap '' TERM; bash -c \"trap '' TERM; sleep 1000\" & wait", timeout_s=1)
    assert r.timed_out
    assert _wait_no_procs(sb.uid) == []


def test_close_leaves_nothing(tmp_path):
    s = Sandbox(limits=TIGHT, root=str(tmp_path))
    s.write("a.txt", "x")
    s.run("sleep 1000 &")
    uid, path = s.uid, s.dir
    s.close()
    assert not os.path.exists(path) and os.listdir(tmp_path) == []
    assert _wait_no_procs(uid) == []
    with pytest.raises(SandboxError):
        s.run("true")


def test_sandboxes_of_dead_processes_are_reaped(tmp_path):
    import subprocess
    import sys

    code = (
        "import os, sys; from coder.env.runtime.sandbox import Sandbox; "
        f"s = Sandbox(root={str(tmp_path)!r}); print(s.dir, flush=True); os._exit(0)"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": root},
    )
    stale = out.stdout.strip()
    assert os.path.isdir(stale)  # its owner died without close()
    with Sandbox(root=str(tmp_path)) as live:
        assert sandbox_lib.reap_stale(str(tmp_path)) == 0  # already reaped at start-up
        assert not os.path.exists(stale) and os.path.isdir(live.dir)


def test_snapshot_restore_roundtrip(sb):
    sb.write("pkg/a.py", "A = 1\n")
    sb.run("mkdir -p empty && ln -s pkg/a.py link && chmod 755 pkg/a.py")
    sb.write("keep.txt", "same")
    snap = sb.snapshot()
    sb.run("rm -rf pkg empty link && echo junk > junk.txt")
    sb.restore(snap)
    assert sb.snapshot() == snap
    sb.run(
        "chmod 600 keep.txt; rm -rf empty; touch empty; ln -sfn keep.txt link; mkdir -p pkg/new;"
        "chmod 000 pkg; chmod 000 ."
    )
    sb.restore(snap)
    assert sb.snapshot() == snap
    assert sb.run("cat pkg/a.py").exit_code == 0  # the agent can use the workspace again
    assert sb.read("pkg/a.py") == "A = 1\n"
    assert os.path.isdir(os.path.join(sb.workspace, "empty"))
    assert os.readlink(os.path.join(sb.workspace, "link")) == "pkg/a.py"
    assert not os.path.exists(os.path.join(sb.workspace, "junk.txt"))
    r = sb.run("echo more >> pkg/a.py && ls -l pkg/a.py")  # still writable by the agent
    assert r.exit_code == 0 and r.stdout.startswith("-rwxr-xr-x")
    with Sandbox(limits=TIGHT) as other:  # a snapshot moves to another sandbox (G rollouts)
        other.restore(snap)
        assert other.run("cat pkg/a.py").stdout == "A = 1\n"


def test_missing_bwrap_names_the_package(monkeypatch):
    monkeypatch.setattr(sandbox_lib.shutil, "which", lambda name: None)
    with pytest.raises(SandboxError, match="bubblewrap"):
        Sandbox()


def test_one_sandboxs_fork_bomb_does_not_starve_another():
    with Sandbox(limits=TIGHT) as a, Sandbox(limits=TIGHT) as b:
        assert a.uid != b.uid  # the process limit counts per uid: each sandbox has its own
        bomb = threading.Thread(
            target=a.run, args=(":(){ :|:& };: ; sleep 3",), kwargs={"timeout_s": 3}
        )
        bomb.start()
        time.sleep(0.5)
        r = b.run("for i in 1 2 3 4 5 6 7 8; do (sleep 0.2 &); done; echo ok")
        bomb.join()
        assert r.exit_code == 0 and r.stdout.strip() == "ok", r.stderr
        assert _wait_no_procs(a.uid) == [] and _wait_no_procs(b.uid) == []
