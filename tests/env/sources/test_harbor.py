"""Harbor task directories (coder/env/sources/harbor.py): a dataset the test writes, one task over a
prebuilt image (an OCI layout built here with umoci: bash, mkdir and their libraries, working
directory /app) and one with a Dockerfile only, imported by `make_tasks --source harbor
--verify`: the image task's solve.sh scores 1 and its unchanged workspace 0, the Dockerfile task
is skipped with its reason; a malformed task.toml is refused naming the file."""

import json
import os
import shutil
import subprocess

import pytest

from coder.env import make_tasks
from coder.env.sources import harbor
from coder.env.scoring.score import score_solution
from coder.env.runtime.sandbox import Limits
from coder.env.tasks import read_tasks

IMAGE = "example.org/harbor/tiny:1.0"


def _libraries(binary: str) -> list[str]:
    out = subprocess.run(["ldd", binary], capture_output=True, text=True, check=True).stdout
    return sorted({p for ln in out.splitlines() for p in ln.split() if p.startswith("/")})


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """A directory of OCI layouts holding IMAGE where `harbor.layout_of` looks for it."""
    d = tmp_path_factory.mktemp("layouts")
    spec = harbor.layout_of(IMAGE, str(d))
    lay, ref, bundle = spec["layout"], spec["ref"], str(tmp_path_factory.mktemp("b") / "bundle")
    umoci = lambda *a: subprocess.run(["umoci", *a], check=True, capture_output=True)
    umoci("init", "--layout", lay)
    umoci("new", "--image", f"{lay}:{ref}")
    umoci("unpack", "--rootless", "--image", f"{lay}:{ref}", bundle)
    rootfs = os.path.join(bundle, "rootfs")
    for tool in ("/bin/bash", shutil.which("mkdir")):
        for path in [tool, *_libraries(tool)]:
            dest = os.path.join(rootfs, path.lstrip("/"))
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            shutil.copy(os.path.realpath(path), dest)
    os.makedirs(os.path.join(rootfs, "app"))
    with open(os.path.join(rootfs, "app", "greeting.txt"), "w") as f:
        f.write("hello\n")
    umoci("repack", "--image", f"{lay}:{ref}", bundle)
    umoci("config", "--image", f"{lay}:{ref}", "--config.workingdir", "/app")
    return str(d)


def _write(root, files: dict) -> str:
    for path, text in files.items():
        full = os.path.join(root, path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w") as f:
            f.write(text)
    return str(root)


TEST_SH = """#!/bin/bash
# Harbor's convention: the verifier writes its reward to /logs/verifier/reward.txt
if [[ -f /app/out.txt && "$(</app/out.txt)" == "$(</tests/expected.txt)" ]]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""


@pytest.fixture
def dataset(tmp_path):
    root = tmp_path / "tb"
    _write(root / "greet", {
        "instruction.md": "<!-- harbor-canary GUID 0000 -->\n\nRead /app/greeting.txt and write it, "
                          "upper-cased, to /app/out.txt.\n",
        "task.toml": f'version = "1.0"\n[metadata]\ndifficulty = "easy"\ncategory = "files"\n'
                     f'tags = ["bash"]\n[verifier]\ntimeout_sec = 60.0\n[agent]\ntimeout_sec = 60.0\n'
                     f'[environment]\ndocker_image = "{IMAGE}"\ncpus = 1\nmemory_mb = 2048\n',
        "environment/Dockerfile": "FROM scratch\n",
        "tests/test.sh": TEST_SH,
        "tests/expected.txt": "HELLO\n",
        "solution/solve.sh": '#!/bin/bash\nread -r line < /app/greeting.txt\necho "${line^^}" > /app/out.txt\n',
    })
    _write(root / "built", {
        "instruction.md": "Do something.\n",
        "task.toml": "[verifier]\ntimeout_sec = 60.0\n",
        "environment/Dockerfile": "FROM python:3.12\n",
        "tests/test.sh": TEST_SH,
        "solution/solve.sh": "true\n",
    })
    return str(root)


def test_image_task_imports_and_verifies_and_a_dockerfile_task_is_skipped(
        layouts, dataset, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # unpacked images go there
    out, sols = str(tmp_path / "t.jsonl"), str(tmp_path / "s.jsonl")
    rc = make_tasks.main(["--source", "harbor", dataset, "--images", layouts, "--repos",
                          str(tmp_path / "repos"), "--out", out, "--solutions", sols, "--verify",
                          "--workers", "1"])
    err = capsys.readouterr().err
    assert rc == 1, err  # one of the two directories was skipped
    assert f"skipped {os.path.join(dataset, 'built')}: environment/Dockerfile only: coder does " \
           "not build Dockerfiles" in err
    assert "dropped" not in err and "wrote 1 harbor tasks" in err, err
    (task,) = read_tasks(out)
    assert task.id == "greet" and task.source == "harbor" and task.repo and task.commit
    assert task.prompt == ("Read /workspace/greeting.txt and write it, upper-cased, to "
                           "/workspace/out.txt.")  # canary line gone, /app made the workspace
    assert task.environment["image"]["ref"] == "1.0"
    assert task.metadata["workdir"] == "/app" and task.metadata["difficulty"] == "easy"
    assert task.metadata["verifier_timeout_sec"] == 60.0 and task.metadata["tags"] == ["bash"]
    test_sh = task.tests[".harbor/tests/test.sh"]
    assert "/workspace/out.txt" in test_sh and "/workspace/.harbor/tests/expected.txt" in test_sh
    assert "/tmp/.harbor-logs/verifier/reward.txt" in test_sh
    with open(sols) as f:
        assert [json.loads(ln) for ln in f] == [{"id": "greet", "files": {"out.txt": "HELLO\n"}}]
    limits = Limits(timeout_s=60, environments_dir=str(tmp_path / "cache/coder/environments"))
    gold, noop = (score_solution(task, s, limits=limits, mode="all") for s in
                  ({"out.txt": "HELLO\n"}, {}))
    assert gold.reward == 1.0 and "reward.txt reward 1 (test.sh exit 0)" in gold.output, gold
    assert noop.reward == 0.0 and "reward.txt reward 0" in noop.output, noop
    wrong = score_solution(task, {"out.txt": "hello\n"}, limits=limits, mode="all")
    assert wrong.reward == 0.0


def test_reward_json_first_and_a_missing_reward_scores_0(layouts, dataset, tmp_path):
    """Harbor reads reward.json's "reward" before reward.txt; no reward file is no pass."""
    limits = Limits(timeout_s=60, environments_dir=str(tmp_path / "envs"))
    td = harbor.read_task_dir(os.path.join(dataset, "greet"))
    task = harbor.to_task(td, layouts, str(tmp_path / "repos"), limits)
    cases = [
        ('echo \'{"reward": 1.0, "tests": 3}\' > /logs/verifier/reward.json\n'
         'echo 0 > /logs/verifier/reward.txt\n', 1.0, "reward.json reward 1.0"),
        ('echo \'{"reward": 0.5}\' > /logs/verifier/reward.json\n', 0.0, "reward.json reward 0.5"),
        ("exit 0\n", 0.0, "wrote no reward file"),
    ]
    for script, reward, said in cases:
        tests = {**task.tests, ".harbor/tests/test.sh": harbor.rewrite(script, "/app")}
        t = type(task)(**{**task.__dict__, "tests": tests})
        s = score_solution(t, {}, limits=limits, mode="all")
        assert s.reward == reward and said in s.output, (script, s)


def test_rewrite_names_whole_paths_only():
    text = 'cd /app && cat /app/x /apps/y x/app "/tests/t.sh" /logs/verifier/reward.txt /solution'
    assert harbor.rewrite(text, "/app") == (
        'cd /workspace && cat /workspace/x /apps/y x/app "/workspace/.harbor/tests/t.sh" '
        "/tmp/.harbor-logs/verifier/reward.txt /workspace/.harbor/solution")
    assert harbor.layout_of("ghcr.io/o/n:2.0", "/l") == {"layout": "/l/ghcr.io_o_n", "ref": "2.0"}
    assert harbor.layout_of("o/n", "/l") == {"layout": "/l/o_n", "ref": "latest"}


def test_malformed_task_toml_is_refused_naming_the_file(dataset, tmp_path):
    toml = os.path.join(dataset, "greet", "task.toml")
    with open(toml, "w") as f:
        f.write("[verifier\ntimeout_sec = 60\n")
    with pytest.raises(ValueError, match=rf"{toml}: not valid TOML"):
        harbor.read_task_dir(os.path.dirname(toml))
    with open(toml, "w") as f:
        f.write('[verifier]\ntimeout_sec = "soon"\n')
    skipped = {}
    assert harbor.import_dirs([dataset], "", str(tmp_path), skipped, solutions=False) == []
    assert skipped[os.path.dirname(toml)] == (f"{toml}: [verifier].timeout_sec must be int or "
                                              "float, got 'soon'")
    assert "Dockerfile only" in skipped[os.path.join(dataset, "built")]
