"""launch/: dry runs print the commands every host would run; a missing variable is named."""
import os
import shlex
import subprocess

import pytest

pytestmark = pytest.mark.subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TPU_POD = os.path.join(ROOT, "launch", "tpu_pod.sh")
SLURM = os.path.join(ROOT, "launch", "slurm_gpu.sbatch")

TPU_ENV = dict(TPU_NAME="my-v5p", ZONE="us-east5-a", PROJECT="proj", CONFIG="configs/kimi_k2_1t.py",
               WORKDIR="gs://bucket/runs/k2")
GKE_ENV = dict(CONFIG="configs/kimi_k2_1t.py", WORKDIR="gs://bucket/runs/k2", JOB_NAME="k2",
               IMAGE="gcr.io/p/coder:1", NUM_SLICES="2", GKE_ACCELERATOR="tpu-v5p-slice",
               TPU_TOPOLOGY="4x8x8", VMS_PER_SLICE="64", CHIPS_PER_VM="4")


def sh(script, *args, env):
    base = {k: v for k, v in os.environ.items()
            if k not in set(TPU_ENV) | set(GKE_ENV) | {"DRY_RUN", "REPO_DIR", "VENV"}}
    return subprocess.run(["bash", script, *args], env={**base, **env}, capture_output=True,
                          text=True, timeout=60)


def commands(stdout):
    """The printed '+ cmd args' lines, each split back into its arguments."""
    return [shlex.split(line[2:]) for line in stdout.splitlines() if line.startswith("+ ")]


def test_tpu_pod_run_dry_run_prints_one_ssh_to_every_worker():
    r = sh(TPU_POD, "--dry-run", "run", "--", "--config.train.steps=7", "--config.mesh.fsdp=64",
           env=TPU_ENV)
    assert r.returncode == 0, r.stderr
    (cmd,) = commands(r.stdout)
    assert cmd[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh"]
    assert "my-v5p" in cmd and "--worker=all" in cmd
    assert "--zone=us-east5-a" in cmd and "--project=proj" in cmd
    remote = next(a for a in cmd if a.startswith("--command="))[len("--command="):]
    main = shlex.split(remote.split("&&")[-1])
    assert main == ["python", "main.py", "--config=configs/kimi_k2_1t.py",
                    "--config.workdir=gs://bucket/runs/k2", "--config.train.steps=7",
                    "--config.mesh.fsdp=64"]
    assert "source .venv/bin/activate" in remote  # the project's own install on each host


def test_tpu_pod_setup_dry_run_copies_and_installs_the_tpu_extra():
    r = sh(TPU_POD, "--dry-run", "setup", env=TPU_ENV)
    assert r.returncode == 0, r.stderr
    cmds = commands(r.stdout)
    assert [c[0] for c in cmds] == ["tar", "gcloud", "gcloud"]
    assert cmds[1][4] == "scp" and "--worker=all" in cmds[1]
    install = next(a for a in cmds[2] if a.startswith("--command="))
    assert "scripts/setup.sh tpu" in install  # system packages (the sandbox) and the tpu extra


@pytest.mark.parametrize("missing", ["TPU_NAME", "ZONE", "PROJECT", "CONFIG", "WORKDIR"])
def test_tpu_pod_names_a_missing_variable(missing):
    env = {k: v for k, v in TPU_ENV.items() if k != missing}
    r = sh(TPU_POD, "--dry-run", "run", env=env)
    assert r.returncode != 0
    assert f"{missing} is not set" in r.stderr
    assert "gcloud" not in r.stdout


def test_tpu_pod_rejects_an_unknown_command():
    r = sh(TPU_POD, "--dry-run", "train", env=TPU_ENV)
    assert r.returncode != 0 and "unknown command" in r.stderr


def test_gke_dry_run_renders_a_complete_jobset():
    r = sh(TPU_POD, "--dry-run", "gke", "--", "--config.train.steps=3", env=GKE_ENV)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("+ kubectl apply -f -")
    yaml = r.stdout
    assert "${" not in yaml  # every variable substituted
    assert "kind: JobSet" in yaml and "replicas: 2" in yaml
    assert "parallelism: 64" in yaml and "google.com/tpu: 4" in yaml
    assert "cloud.google.com/gke-tpu-topology: 4x8x8" in yaml
    assert ("python main.py --config=configs/kimi_k2_1t.py --config.workdir=gs://bucket/runs/k2 "
            "--config.train.steps=3") in yaml


@pytest.mark.parametrize("missing", ["IMAGE", "NUM_SLICES", "TPU_TOPOLOGY"])
def test_gke_names_a_missing_variable(missing):
    env = {k: v for k, v in GKE_ENV.items() if k != missing}
    r = sh(TPU_POD, "--dry-run", "gke", env=env)
    assert r.returncode != 0
    assert f"{missing} is not set" in r.stderr
    assert "kubectl" not in r.stdout


def test_slurm_dry_run_prints_one_srun_per_node():
    r = sh(SLURM, "--dry-run", "--", "--config.train.steps=5",
           env=dict(CONFIG="configs/deepseek_v3_671b.py", WORKDIR="/shared/runs/ds"))
    assert r.returncode == 0, r.stderr
    (cmd,) = commands(r.stdout)
    assert cmd[0] == "srun" and "--ntasks-per-node=1" in cmd
    i = cmd.index("main.py")
    assert cmd[i - 1].endswith("/.venv/bin/python")
    assert cmd[i + 1:] == ["--config=configs/deepseek_v3_671b.py",
                           "--config.workdir=/shared/runs/ds", "--config.train.steps=5"]


@pytest.mark.parametrize("missing", ["CONFIG", "WORKDIR"])
def test_slurm_names_a_missing_variable(missing):
    env = {k: v for k, v in dict(CONFIG="c.py", WORKDIR="/w").items() if k != missing}
    r = sh(SLURM, "--dry-run", env=env)
    assert r.returncode != 0
    assert f"{missing} is not set" in r.stderr
    assert "srun" not in r.stdout
