"""OCI image environments (coder/env/runtime/images.py): an image layout built in the test with umoci
(bash, its libraries and a tool only the image has), unpacked once per digest, run by the
sandbox as the task's root filesystem: its task passes inside the image and fails without it."""

import os
import shutil
import subprocess

import pytest

from coder.env.runtime import environments, images
from coder.env.scoring.score import score
from coder.env.runtime.sandbox import Limits, Sandbox, SandboxError
from coder.env.tasks import Task
from coder.env.runtime.terminal import Terminal



def _libraries(binary: str) -> list[str]:
    out = subprocess.run(["ldd", binary], capture_output=True, text=True, check=True).stdout
    libs = [p for ln in out.splitlines() for p in ln.split() if p.startswith("/")]
    return sorted(set(libs))


@pytest.fixture(scope="module")
def layout(tmp_path_factory):
    """An OCI layout `<dir>:t` whose root filesystem holds bash with its libraries,
    /usr/local/bin/frob, a tool no host has, and an installed module `mymod`: nothing else (no
    python, no coreutils)."""
    d = tmp_path_factory.mktemp("oci")
    lay, bundle = str(d / "layout"), str(d / "bundle")
    umoci = lambda *a: subprocess.run(["umoci", *a], check=True, capture_output=True)
    umoci("init", "--layout", lay)
    umoci("new", "--image", f"{lay}:t")
    umoci("unpack", "--rootless", "--image", f"{lay}:t", bundle)
    rootfs = os.path.join(bundle, "rootfs")
    for path in ["/bin/bash", *_libraries("/bin/bash")]:
        dest = os.path.join(rootfs, path.lstrip("/"))
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        shutil.copy(os.path.realpath(path), dest)
    frob = os.path.join(rootfs, "usr/local/bin/frob")
    os.makedirs(os.path.dirname(frob))
    with open(frob, "w") as f:
        f.write("#!/bin/bash\necho frobbed\n")
    os.chmod(frob, 0o755)
    site = os.path.join(rootfs, "usr/lib/python3.11/site-packages")
    os.makedirs(site)
    with open(os.path.join(site, "mymod.py"), "w") as f:  # an installed copy of a task's module
        f.write("SECRET = 'the reference'\n")
    umoci("repack", "--image", f"{lay}:t", bundle)
    return lay


@pytest.fixture(scope="module")
def repo_task(tmp_path_factory):
    """A v2 task over a one-commit repository whose check passes only where `frob` exists."""
    src = str(tmp_path_factory.mktemp("repo"))
    with open(os.path.join(src, "check.sh"), "w") as f:
        f.write('test "$(frob)" = frobbed\n')
    env = {"PATH": os.environ["PATH"], "HOME": src, "GIT_CONFIG_NOSYSTEM": "1",
           "GIT_AUTHOR_NAME": "a", "GIT_AUTHOR_EMAIL": "a@x", "GIT_COMMITTER_NAME": "a",
           "GIT_COMMITTER_EMAIL": "a@x"}
    git = lambda *a: subprocess.run(["git", *a], cwd=src, env=env, check=True,
                                    capture_output=True, text=True).stdout.strip()
    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "check")
    return Task("frob", "make the check pass", {}, {}, test_command="bash check.sh",
                repo=src, commit=git("rev-parse", "HEAD"))


def test_image_task_passes_inside_its_image_only(layout, repo_task, tmp_path):
    limits = Limits(timeout_s=30, environments_dir=str(tmp_path / "envs"))
    task = Task(**{**repo_task.__dict__, "environment": {"image": {"layout": layout, "ref": "t"}}})
    with Sandbox(task, limits) as sb:
        assert sb.image is not None and sb.environment is None
        r = sb.run("frob; echo $UID; read l < check.sh && echo ok; echo x > /etc/y || echo ro;"
                   " echo x > new && echo ws; for p in /work /root /usr/bin/python3 "
                   "/usr/local/bin/frob; do [ -e $p ] && echo has $p; done; type git python3")
        assert r.stdout.splitlines() == [
            "frobbed", str(sb._inner_uid), "ok", "ro", "ws", "has /usr/local/bin/frob"], r
        assert "git: not found" in r.stderr and "python3: not found" in r.stderr
        term = Terminal(sb)  # the agent's persistent shell: the image's bash
        term.run("cd /tmp && export A=1")
        assert term.run("echo $PWD $A; frob").stdout == "/tmp 1\nfrobbed\n"
        term.close()
        assert score(sb, task).reward == 1.0
    with Sandbox(repo_task, limits) as sb:  # the host's root filesystem has no frob
        s = score(sb, repo_task)
        assert s.reward == 0.0 and "exit status" in s.error, s


def test_image_is_unpacked_once_per_manifest_digest(layout, tmp_path):
    spec = environments.normalize({"image": {"layout": layout, "ref": "t"}})["image"]
    first = images.ensure(spec, str(tmp_path))
    marker = os.path.join(first.path, "coder-image.json")
    stamp = os.stat(marker).st_mtime_ns
    copy = str(tmp_path / "copy")
    shutil.copytree(layout, copy)  # the same image elsewhere: the same digest, the same tree
    again = images.ensure({"layout": copy, "ref": "t"}, str(tmp_path))
    assert again == first and os.stat(marker).st_mtime_ns == stamp
    assert os.path.basename(first.path) == images.manifest_digest(layout, "t").replace(":", "-")
    assert first.shell == "/bin/bash" and any(e.startswith("PATH=") for e in first.env)


def test_image_specs_and_errors_name_the_problem(layout, repo_task, tmp_path):
    bad = [
        ({"image": {"layout": "rel/dir"}}, "layout must be an absolute path"),
        ({"image": {"layout": layout, "tag": "t"}}, r"unknown keys \['tag'\]"),
        ({"image": {"layout": layout}, "python": {"requirements": []}}, "exclude each other"),
    ]
    for spec, message in bad:
        with pytest.raises(ValueError, match=message):
            environments.normalize(spec)
    task = Task(**{**repo_task.__dict__, "environment": {"image": {"layout": layout, "ref": "x"}}})
    with pytest.raises(SandboxError, match=r"has no image tagged 'x' \(tags: \['t'\]\)"):
        Sandbox(task, Limits(environments_dir=str(tmp_path)))


def test_installed_copy_in_the_image_shows_the_starting_text(layout, tmp_path):
    """A module the workspace defines is shadowed in the image's site-packages too."""
    task = Task("shadow", "", {"mymod.py": "SECRET = 'start'\n"}, {},
                environment={"image": {"layout": layout, "ref": "t"}})
    with Sandbox(task, Limits(timeout_s=30, environments_dir=str(tmp_path))) as sb:
        r = sb.run("read l < /usr/lib/python3.11/site-packages/mymod.py; echo $l")
    assert r.stdout == "SECRET = 'start'\n", r
