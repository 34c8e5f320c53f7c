#!/usr/bin/env bash
# Asynchronous GRPO on GKE: the actors on a KubeRay RayCluster (launch/gke/raycluster.yaml, one
# actor per TPU slice: its Engine over the slice's hosts, one Ray actor process per host, its env
# workers and sandboxes; optionally CPU env nodes, launch/gke/raycluster_env.yaml, that run the env
# workers instead), the learner on the training slices (the JobSet of launch/tpu_pod.sh gke),
# connected to the actors as a Ray client.
# The learner publishes every version to the weight store ({WORKDIR}/grpo/weights, so WORKDIR
# must be gs://... that every pod can reach) and the actors poll it.
#
# Usage:
#   launch/ray_cluster.sh [--dry-run] gke [-- FLAGS...]   apply the RayCluster, then the learner's
#                                                         JobSet with --config.rl.topology.asynchronous=True,
#                                                         --config.rl.topology.actors=NUM_ACTORS,
#                                                         --config.rl.topology.actor_processes=ACTOR_PROCESSES,
#                                                         --config.rl.topology.ray_address=ray://RAY_CLUSTER-head-svc:10001
#                                                         (and, with ENV_NODES > 0,
#                                                         --config.env.workers_backend=ray
#                                                         --config.env.ray_resource=env_node)
#                                                         (FLAGS come after them: they win)
#   launch/ray_cluster.sh [--dry-run] down                delete the RayCluster
# --dry-run (or DRY_RUN=1) prints the commands and the rendered manifests instead of running them.
#
# Variables (environment):
#   RAY_CLUSTER   name of the RayCluster (default: ${JOB_NAME}-actors)
#   NUM_ACTORS    rl.topology.actors: actors each learner process starts (default: 1); the cluster needs
#                 ACTOR_HOSTS = NUM_ACTORS x learner processes (NUM_SLICES x VMS_PER_SLICE) x
#                 ACTOR_PROCESSES hosts
#   ACTOR_PROCESSES  hosts per actor slice (rl.topology.actor_processes, default 1); ACTOR_HOSTS must split
#                 into slices of that many
#   ENV_NODES     CPU pods for the env workers (default 0: the env workers run on the actor hosts);
#                 > 0 needs ENV_CPUS and ENV_MEMORY (launch/gke/raycluster_env.yaml)
#   the RayCluster's (see launch/gke/raycluster.yaml): IMAGE, ACTOR_HOSTS, ACTOR_ACCELERATOR,
#                 ACTOR_TOPOLOGY, ACTOR_CHIPS, ACTOR_CPUS, ACTOR_MEMORY
#   the learner's (see launch/tpu_pod.sh): CONFIG, WORKDIR, JOB_NAME, IMAGE, NUM_SLICES,
#                 GKE_ACCELERATOR, TPU_TOPOLOGY, VMS_PER_SLICE, CHIPS_PER_VM
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DRY_RUN="${DRY_RUN:-0}"
PYTHON="${PYTHON:-python3}"
NUM_ACTORS="${NUM_ACTORS:-1}"
ACTOR_PROCESSES="${ACTOR_PROCESSES:-1}"
ENV_NODES="${ENV_NODES:-0}"

die() { echo "ray_cluster.sh: $*" >&2; exit 2; }
require() {
  local name="$1" what="$2"
  [[ -n "${!name:-}" ]] || die "$name is not set: $what (see the top of launch/ray_cluster.sh)"
}

while [[ $# -gt 0 && "$1" == --* ]]; do
  case "$1" in
    --dry-run) DRY_RUN=1; shift ;;
    *) die "unknown option $1" ;;
  esac
done
[[ $# -gt 0 ]] || die "missing command: gke | down (see the top of launch/ray_cluster.sh)"
CMD="$1"; shift
[[ $# -eq 0 || "$1" == "--" ]] || die "unexpected argument '$1' (main.py flags go after --)"
[[ $# -gt 0 ]] && shift
FLAGS=("$@")

if [[ -z "${RAY_CLUSTER:-}" ]]; then
  require JOB_NAME "the learner's JobSet name (RAY_CLUSTER defaults to \${JOB_NAME}-actors)"
  RAY_CLUSTER="${JOB_NAME}-actors"
fi
export RAY_CLUSTER

render() {  # render TEMPLATE: every ${VAR} must be set
  local template="$1"
  for name in $(grep -o '\${[A-Z_]*}' "$template" | tr -d '${}' | sort -u); do
    require "$name" "used by ${template#"$HERE/"} (documented at its top)"
    export "${name?}"
  done
  "$PYTHON" -c 'import os, string, sys
print(string.Template(open(sys.argv[1]).read()).substitute(os.environ), end="")' "$template"
}

case "$CMD" in
  gke)
    require CONFIG "the config file, e.g. configs/kimi_k2_1t.py"
    require WORKDIR "a run directory every pod can reach, e.g. gs://bucket/runs/NAME (the weight store lives there)"
    require ACTOR_HOSTS "the actor hosts (see the top of launch/ray_cluster.sh)"
    (( ACTOR_PROCESSES >= 1 && ACTOR_HOSTS % ACTOR_PROCESSES == 0 )) ||
      die "ACTOR_HOSTS=$ACTOR_HOSTS does not split into actor slices of ACTOR_PROCESSES=$ACTOR_PROCESSES hosts"
    export ACTOR_SLICES=$(( ACTOR_HOSTS / ACTOR_PROCESSES )) ACTOR_PROCESSES
    rendered="$(render "$HERE/gke/raycluster.yaml")"
    env_flags=()
    if (( ENV_NODES > 0 )); then  # the env workers' group, and the learner's keys that send them there
      rendered="$rendered"$'\n'"$(render "$HERE/gke/raycluster_env.yaml" | grep -v '^#')"
      env_flags=("--config.env.workers_backend=ray" "--config.env.ray_resource=env_node")
    fi
    if [[ "$DRY_RUN" == 1 ]]; then
      echo "+ kubectl apply -f - <<'YAML'"
      echo "$rendered"
      echo "YAML"
    else
      echo "$rendered" | kubectl apply -f -
    fi
    learner=("--config.rl.topology.asynchronous=True" "--config.rl.topology.actors=$NUM_ACTORS"
             "--config.rl.topology.actor_processes=$ACTOR_PROCESSES"
             "--config.rl.topology.ray_address=ray://${RAY_CLUSTER}-head-svc:10001" "${env_flags[@]}" "${FLAGS[@]}")
    dry=(); [[ "$DRY_RUN" == 1 ]] && dry=(--dry-run)
    DRY_RUN="$DRY_RUN" bash "$HERE/tpu_pod.sh" "${dry[@]}" gke -- "${learner[@]}"
    ;;
  down)
    if [[ "$DRY_RUN" == 1 ]]; then
      printf '+'; printf ' %q' kubectl delete raycluster "$RAY_CLUSTER"; printf '\n'
    else
      kubectl delete raycluster "$RAY_CLUSTER"
    fi
    ;;
  *) die "unknown command '$CMD': gke | down" ;;
esac
