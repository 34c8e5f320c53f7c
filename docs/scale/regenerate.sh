#!/usr/bin/env bash
# Regenerate every report in docs/scale/ (and docs/scale/README.md's table) from the code:
#
#   bash docs/scale/regenerate.sh            # all pairs, one at a time
#   bash docs/scale/regenerate.sh quickstart,v5e-4 kimi_k2_1t,v6e-256x2   # only these
#
# Each pair MODEL,SETTING (SETTING: a topology, "xN" for N slices; docs/scale/configs.py; a third
# part ACTOR_TOPOLOGY compiles the RL engine on an actor slice of its own, "colocated" on the
# learner's chips, "longNk" the long-context step at N x 1024 tokens a row) runs
#   python main.py --config=docs/scale/configs.py:MODEL,SETTING
# (stage=compile: libtpu compiles the training step for the TPU slice on this machine's CPU) and
# writes docs/scale/MODEL_SETTING/report.{json,md}; docs/scale/summarize.py then rebuilds the
# README table. Needs the tpu extra (pip install -e '.[tpu]'). A full-size pair takes 10-30 minutes
# of CPU (the training step, the engine's programs and the GRPO step) and up to ~20 GB of host
# memory; runs are sequential for that reason.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

PAIRS=("$@")
if [[ ${#PAIRS[@]} -eq 0 ]]; then
  PAIRS=(quickstart,v5e-4 deepseek_v3_671b,v5p-512 kimi_k2_1t,v5p-512x2 deepseek_v3_671b,v6e-256x2
         deepseek_v3_671b,v6e-256x4 deepseek_v3_671b,v5p-512,v5p-128 kimi_k2_1t,v5p-512x2,v5p-256
         deepseek_v3_671b,v5p-512,colocated deepseek_v3_671b,v5p-512,long128k
         deepseek_v3_671b,v5p-512,long256k deepseek_v3_671b,v5p-512x2,long256k
         kimi_k2_1t,v5p-512x2,long128k kimi_k2_1t,v5p-512x2,long256k
         deepseek_v3_671b,v5p-512,long128k-nsa kimi_k2_1t,v5p-512x2,long128k-nsa
         deepseek_v3_671b,v5p-512,long256k-offload deepseek_v3_671b,v5p-512,long128k-ring
         deepseek_v3_671b,v5p-512,long256k-ring kimi_k2_1t,v5p-512x2,long128k-ring)
fi
export JAX_PLATFORMS=cpu  # the local backend; the TPU devices are libtpu's compile-only ones
for pair in "${PAIRS[@]}"; do
  echo "=== $pair"
  python main.py "--config=docs/scale/configs.py:$pair" "--config.workdir=/tmp/coder_scale"
done
python docs/scale/summarize.py docs/scale
# The recipes' plans (coder/stages/plan.py: every program of every stage of the chain, compiled):
# both when no pairs are named, else those in PLANS (e.g. PLANS=composer_k2 bash ... quickstart,v5e-4)
DEFAULT_PLANS="composer_k2 composer_dsv3"
[[ $# -gt 0 ]] && DEFAULT_PLANS=""
for recipe in ${PLANS-$DEFAULT_PLANS}; do
  echo "=== plan $recipe"
  python main.py "--config=configs/$recipe.py" --config.plan=True "--config.workdir=/tmp/coder_plan_$recipe"
  mkdir -p "docs/scale/$recipe"
  cp "/tmp/coder_plan_$recipe/plan/plan.json" "/tmp/coder_plan_$recipe/plan/plan.md" "docs/scale/$recipe/"
done
