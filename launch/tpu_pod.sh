#!/usr/bin/env bash
# Launch coder's main.py on Cloud TPU: every worker of a TPU VM slice (gcloud ssh --worker=all),
# or a multi-slice GKE JobSet (launch/gke/jobset.yaml). Each host runs the same command;
# main.py calls jax.distributed.initialize() when the run spans several processes, every host
# logs its process index, and only process 0 writes metrics.
#
# Usage:
#   launch/tpu_pod.sh [--dry-run] setup              copy this checkout to every worker and
#                                                    install it there (scripts/setup.sh tpu: bubblewrap, pip install -e '.[tpu]')
#   launch/tpu_pod.sh [--dry-run] run [-- FLAGS...]  run main.py on every worker
#   launch/tpu_pod.sh [--dry-run] gke [-- FLAGS...]  render launch/gke/jobset.yaml, kubectl apply
# FLAGS are extra main.py flags, e.g. -- --config.train.steps=1000 --config.mesh.fsdp=64
# --dry-run (or DRY_RUN=1) prints the commands instead of running them.
#
# Variables (environment):
#   TPU_NAME      setup, run   name of the TPU VM slice (gcloud compute tpus tpu-vm list)
#   ZONE          setup, run   its zone, e.g. us-east5-a
#   PROJECT       setup, run   Google Cloud project id
#   CONFIG        run, gke     config file, e.g. configs/kimi_k2_1t.py
#   WORKDIR       run, gke     run directory every host can reach, e.g. gs://bucket/runs/k2
#   REMOTE_DIR    setup, run   checkout directory on each worker (default: coder)
#   PYTHON        setup        python on the workers used to create the venv (default: python3)
#   gke only (see launch/gke/jobset.yaml): JOB_NAME, IMAGE, NUM_SLICES, GKE_ACCELERATOR,
#                 TPU_TOPOLOGY, VMS_PER_SLICE, CHIPS_PER_VM; MAX_RESTARTS (default: 0)
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HERE")"
DRY_RUN="${DRY_RUN:-0}"
REMOTE_DIR="${REMOTE_DIR:-coder}"
PYTHON="${PYTHON:-python3}"
MAX_RESTARTS="${MAX_RESTARTS:-0}"

die() { echo "tpu_pod.sh: $*" >&2; exit 2; }

require() {  # require VAR "what it is": fail naming the variable when it is unset or empty
  local name="$1" what="$2"
  [[ -n "${!name:-}" ]] || die "$name is not set: $what (see the top of launch/tpu_pod.sh)"
}

run() {  # print (dry run) or execute one command
  if [[ "$DRY_RUN" == 1 ]]; then
    printf '+'; printf ' %q' "$@"; printf '\n'
  else
    "$@"
  fi
}

main_cmd() {  # the main.py command line every host runs, as one shell-quoted string
  local cmd
  cmd="$(printf '%q ' python main.py "--config=$CONFIG" "--config.workdir=$WORKDIR" "$@")"
  echo "${cmd% }"
}

while [[ $# -gt 0 && "$1" == --* ]]; do
  case "$1" in
    --dry-run) DRY_RUN=1; shift ;;
    *) die "unknown option $1" ;;
  esac
done
[[ $# -gt 0 ]] || die "missing command: setup | run | gke (see the top of launch/tpu_pod.sh)"
CMD="$1"; shift
[[ $# -eq 0 || "$1" == "--" ]] || die "unexpected argument '$1' (main.py flags go after --)"
[[ $# -gt 0 ]] && shift
FLAGS=("$@")

tpu_vm() {  # gcloud compute tpus tpu-vm SUBCOMMAND ... on every worker of the slice
  local sub="$1"; shift
  run gcloud compute tpus tpu-vm "$sub" "$@" --zone="$ZONE" --project="$PROJECT" --worker=all
}

case "$CMD" in
  setup)
    require TPU_NAME "the TPU VM slice name"
    require ZONE "the slice's zone"
    require PROJECT "the Google Cloud project id"
    tarball="$(mktemp -u /tmp/coder.XXXXXX).tar.gz"
    run tar -C "$ROOT" --exclude=.git --exclude=runs --exclude='*.egg-info' -czf "$tarball" .
    tpu_vm scp "$tarball" "$TPU_NAME:coder.tar.gz"
    remote="mkdir -p $(printf %q "$REMOTE_DIR") && tar -xzf coder.tar.gz -C $(printf %q "$REMOTE_DIR")"
    remote+=" && cd $(printf %q "$REMOTE_DIR") && $(printf %q "$PYTHON") -m venv .venv"
    remote+=" && PYTHON=.venv/bin/python bash scripts/setup.sh tpu"  # bubblewrap + the tpu extra
    tpu_vm ssh "$TPU_NAME" --command="$remote"
    ;;
  run)
    require TPU_NAME "the TPU VM slice name"
    require ZONE "the slice's zone"
    require PROJECT "the Google Cloud project id"
    require CONFIG "the config file, e.g. configs/kimi_k2_1t.py"
    require WORKDIR "a run directory every host can reach, e.g. gs://bucket/runs/NAME"
    remote="cd $(printf %q "$REMOTE_DIR") && source .venv/bin/activate && $(main_cmd "${FLAGS[@]}")"
    tpu_vm ssh "$TPU_NAME" --command="$remote"
    ;;
  gke)
    require CONFIG "the config file, e.g. configs/kimi_k2_1t.py"
    require WORKDIR "a run directory every host can reach, e.g. gs://bucket/runs/NAME"
    template="$HERE/gke/jobset.yaml"
    export MAIN_COMMAND MAX_RESTARTS
    MAIN_COMMAND="$(main_cmd "${FLAGS[@]}")"
    # every ${VAR} of the template must be set: fail naming the first one that is not
    for name in $(grep -o '\${[A-Z_]*}' "$template" | tr -d '${}' | sort -u); do
      require "$name" "used by launch/gke/jobset.yaml (documented at its top)"
      export "${name?}"
    done
    rendered="$("$PYTHON" -c 'import os, string, sys
print(string.Template(open(sys.argv[1]).read()).substitute(os.environ), end="")' "$template")"
    if [[ "$DRY_RUN" == 1 ]]; then
      echo "+ kubectl apply -f - <<'YAML'"
      echo "$rendered"
      echo "YAML"
    else
      echo "$rendered" | kubectl apply -f -
    fi
    ;;
  *) die "unknown command '$CMD': setup | run | gke" ;;
esac
