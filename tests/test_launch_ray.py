"""launch/ Ray launchers of asynchronous GRPO: dry runs print the commands and manifests; a missing
variable is named (as tests/test_launch.py checks the other launchers)."""
import os
import shlex
import subprocess

import pytest

pytestmark = pytest.mark.subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RAY_GKE = os.path.join(ROOT, "launch", "ray_cluster.sh")
SLURM_RAY = os.path.join(ROOT, "launch", "slurm_ray.sbatch")

GKE_ENV = dict(CONFIG="configs/kimi_k2_1t.py", WORKDIR="gs://bucket/runs/k2", JOB_NAME="k2", IMAGE="gcr.io/p/coder:1",
               NUM_SLICES="1", GKE_ACCELERATOR="tpu-v5p-slice", TPU_TOPOLOGY="4x4x4", VMS_PER_SLICE="16",
               CHIPS_PER_VM="4", ACTOR_HOSTS="32", ACTOR_ACCELERATOR="tpu-v6e-slice", ACTOR_TOPOLOGY="2x4",
               ACTOR_CHIPS="8", ACTOR_CPUS="180", ACTOR_MEMORY="700Gi", NUM_ACTORS="2")
SLURM_ENV = dict(CONFIG="configs/deepseek_v3_671b.py", WORKDIR="/shared/runs/ds", NODES="gpu1 gpu2 gpu3 gpu4")
ALL = set(GKE_ENV) | set(SLURM_ENV) | {"ACTOR_PROCESSES", "ENV_NODES", "ENV_CPUS", "ENV_MEMORY", "DRY_RUN", "REPO_DIR", "VENV", "RAY_CLUSTER", "LEARNER_NODES", "SLURM_JOB_NODELIST"}


def sh(script, *args, env):
    base = {k: v for k, v in os.environ.items() if k not in ALL}
    return subprocess.run(["bash", script, *args], env={**base, **env}, capture_output=True, text=True, timeout=60)


def commands(stdout):
    return [shlex.split(line[2:].removesuffix(" &")) for line in stdout.splitlines() if line.startswith("+ ")]


def test_gke_dry_run_renders_the_actors_raycluster_and_a_learner_connected_to_it():
    r = sh(RAY_GKE, "--dry-run", "gke", "--", "--config.train.steps=3", env=GKE_ENV)
    assert r.returncode == 0, r.stderr
    assert "${" not in r.stdout  # every variable substituted
    ray, jobset = r.stdout.split("+ kubectl apply -f - <<'YAML'")[1:]
    assert "kind: RayCluster" in ray and "name: k2-actors" in ray and "replicas: 32" in ray
    assert "google.com/tpu: 8" in ray and "cloud.google.com/gke-tpu-topology: 2x4" in ray
    assert "privileged: true" in ray  # the sandbox
    assert "kind: JobSet" in jobset and "parallelism: 16" in jobset
    main = next(line for line in jobset.splitlines() if "python main.py" in line)
    assert shlex.split(main) == [
        "python", "main.py", "--config=configs/kimi_k2_1t.py", "--config.workdir=gs://bucket/runs/k2",
        "--config.rl.topology.asynchronous=True", "--config.rl.topology.actors=2", "--config.rl.topology.actor_processes=1",
        "--config.rl.topology.ray_address=ray://k2-actors-head-svc:10001", "--config.train.steps=3"]


def test_gke_actor_slices_of_several_hosts_and_env_nodes():
    """Actors of 16 hosts each (v5p-128 slices: rl.topology.actor_processes) and CPU env nodes that take the
    env workers (env.workers_backend=ray on the `env_node` resource): the manifest parses, its
    groups say so, and the learner gets the keys."""
    import yaml

    env = {**GKE_ENV, "CONFIG": "configs/composer_k2.py", "ACTOR_HOSTS": "64", "ACTOR_PROCESSES": "16",
           "ACTOR_ACCELERATOR": "tpu-v5p-slice", "ACTOR_TOPOLOGY": "4x4x8", "ACTOR_CHIPS": "4", "NUM_ACTORS": "4",
           "ENV_NODES": "8", "ENV_CPUS": "220", "ENV_MEMORY": "800Gi"}
    r = sh(RAY_GKE, "--dry-run", "gke", env=env)
    assert r.returncode == 0, r.stderr
    ray, jobset = r.stdout.split("+ kubectl apply -f - <<'YAML'")[1:]
    cluster = yaml.safe_load(ray.split("\nYAML")[0])
    actors, env_group = cluster["spec"]["workerGroupSpecs"]
    assert (actors["groupName"], actors["replicas"], actors["numOfHosts"]) == ("actors", 4, 16)
    assert env_group["groupName"] == "env" and env_group["replicas"] == 8
    assert env_group["rayStartParams"]["resources"] == '"{\\"env_node\\": 1000}"'
    assert "google.com/tpu" not in str(env_group)
    main = shlex.split(next(line for line in jobset.splitlines() if "python main.py" in line))
    assert main[4:] == ["--config.rl.topology.asynchronous=True", "--config.rl.topology.actors=4", "--config.rl.topology.actor_processes=16",
                        "--config.rl.topology.ray_address=ray://k2-actors-head-svc:10001",
                        "--config.env.workers_backend=ray", "--config.env.ray_resource=env_node"]


def test_gke_refuses_hosts_that_do_not_split_into_actor_slices():
    r = sh(RAY_GKE, "--dry-run", "gke", env={**GKE_ENV, "ACTOR_HOSTS": "30", "ACTOR_PROCESSES": "16"})
    assert r.returncode != 0 and "does not split into actor slices" in r.stderr
    assert "kubectl" not in r.stdout


@pytest.mark.parametrize("missing", ["ACTOR_ACCELERATOR", "IMAGE", "WORKDIR"])
def test_gke_names_a_missing_variable(missing):
    r = sh(RAY_GKE, "--dry-run", "gke", env={k: v for k, v in GKE_ENV.items() if k != missing})
    assert r.returncode != 0 and f"{missing} is not set" in r.stderr
    assert "kubectl" not in r.stdout


def test_gke_down_deletes_the_raycluster():
    r = sh(RAY_GKE, "--dry-run", "down", env=dict(JOB_NAME="k2"))
    assert r.returncode == 0, r.stderr
    assert commands(r.stdout) == [["kubectl", "delete", "raycluster", "k2-actors"]]


def test_slurm_dry_run_starts_ray_on_the_actor_nodes_and_the_learner_on_the_first():
    r = sh(SLURM_RAY, "--dry-run", "--", "--config.train.steps=5", env=SLURM_ENV)
    assert r.returncode == 0, r.stderr
    head, workers, learner = commands(r.stdout)
    assert head[:6] == ["srun", "--nodes=1", "--ntasks=1", "-w", "gpu2", head[5]]
    assert head[5].endswith("/.venv/bin/ray") and head[6:] == ["start", "--head", "--port=6379", "--block"]
    assert workers[:5] == ["srun", "--nodes=2", "--ntasks-per-node=1", "-w", "gpu3,gpu4"]
    assert workers[6:] == ["start", "--address=gpu2:6379", "--block"]
    assert learner[0] == "srun" and learner[learner.index("-w") + 1] == "gpu1"
    i = learner.index("main.py")
    assert learner[i + 1:] == ["--config=configs/deepseek_v3_671b.py", "--config.workdir=/shared/runs/ds",
                               "--config.rl.topology.asynchronous=True", "--config.rl.topology.actors=3",
                               "--config.rl.topology.ray_address=gpu2:6379", "--config.train.steps=5"]


def test_slurm_two_learner_nodes_share_the_actor_nodes():
    r = sh(SLURM_RAY, "--dry-run", env={**SLURM_ENV, "LEARNER_NODES": "2"})
    assert r.returncode == 0, r.stderr
    head, workers, learner = commands(r.stdout)
    assert head[4] == "gpu3" and workers[4] == "gpu4" and learner[learner.index("-w") + 1] == "gpu1,gpu2"
    assert "--nodes=2" in learner and "--config.rl.topology.actors=1" in learner  # 2 actor nodes / 2 learners


def test_slurm_refuses_an_allocation_without_actor_nodes():
    r = sh(SLURM_RAY, "--dry-run", env={**SLURM_ENV, "LEARNER_NODES": "4"})
    assert r.returncode != 0 and "no actor node" in r.stderr


@pytest.mark.parametrize("missing", ["CONFIG", "WORKDIR", "NODES"])
def test_slurm_names_a_missing_variable(missing):
    r = sh(SLURM_RAY, "--dry-run", env={k: v for k, v in SLURM_ENV.items() if k != missing})
    assert r.returncode != 0 and f"{missing} is not set" in r.stderr
    assert "srun" not in r.stdout
