"""Composer 2's recipe (configs/composer_k2.py, the whole chain) on DeepSeek-V3 671B.

The same stages, layouts and rollout settings as the Kimi K2.5 recipe, on DeepSeek-V3's
architecture (configs/deepseek_v3_671b.py: 256 experts, 128 heads, 3 dense layers): its one
MTP module drafts one token a decode step (rl.speculative_k = 1; the mtp stage trains it afresh
by self-distillation, as the seed's recipe does). Its window is extended from 160k (YaRN 40)
to 256k (YaRN 64 over 4096) by the longctx stage.

    python main.py --config=configs/composer_dsv3.py --config.plan=True --config.workdir=/tmp/plan_dsv3

docs/scale/README.md ("Plans") and docs/scale/composer_dsv3/plan.md have its plan (aaccc5d, the
whole chain): every program fits; 341 h and 282k chip-hours in all (GRPO 209 h at 751 s a step),
the engine's decode 84.9 GiB a chip and 0.191 s a step, its group copy 85.7 of 95.0 GiB with the
weights beside it; 256 slots fit, 384 do not.
"""
from configs.composer_k2 import recipe
from configs.deepseek_v3_671b import get_config as deepseek_v3_config


def get_config():
    return recipe(deepseek_v3_config(), draft_depth=1)
