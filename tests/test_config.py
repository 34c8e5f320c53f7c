"""Config errors stop at start-up with the key named: unknown key, wrong type, unknown stage,
a batch that does not split over the mesh / grad_accum; and the stage table's plumbing."""
import os
import sys

import pytest
from absl import flags
from ml_collections import config_flags

from coder import stages
from configs import base, quickstart

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _parse_file(path, *overrides):
    """Parse `--config=path` + overrides exactly as main.py's flag does.

    config_flags reads the overrides from sys.argv, so the test sets it too.
    """
    argv = ["main.py", f"--config={path}", *overrides]
    fv = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "config", flag_values=fv)
    saved = sys.argv
    sys.argv = argv
    try:
        fv(argv)
    finally:
        sys.argv = saved
    return fv.config


def _parse(*overrides):
    """`_parse_file` of configs/quickstart.py."""
    return _parse_file(os.path.join(ROOT, "configs", "quickstart.py"), *overrides)


def test_overrides_apply_with_their_types():
    c = _parse("--config.train.lr=1e-4", "--config.stage=sft", "--config.stages=()")
    assert c.train.lr == 1e-4 and c.stage == "sft"
    assert stages.stage_names(c) == ["sft"]


def test_unknown_key_names_the_key():
    with pytest.raises(Exception, match="no_such_key"):
        _parse("--config.train.no_such_key=1")


def test_wrong_type_names_the_key():
    with pytest.raises(Exception, match="steps"):
        _parse("--config.train.steps=many")


def test_unknown_stage_names_the_key_and_the_choices():
    c = base.get_config()
    c.stage = "pretrian"
    with pytest.raises(ValueError, match=r"config\.stage: unknown stage 'pretrian'.*pretrain"):
        stages.validate(c, n_devices=8)
    c.stage, c.stages = "", ("pretrain", "grpo", "fly")
    with pytest.raises(ValueError, match=r"config\.stages: unknown stage 'fly'"):
        stages.validate(c, n_devices=8)


def test_batch_must_split_over_accum_and_mesh():
    c = base.get_config()
    c.stage = "pretrain"
    c.data.batch_size, c.train.grad_accum = 8, 3
    with pytest.raises(ValueError, match="train.grad_accum"):
        stages.validate(c, n_devices=8)
    c.data.batch_size, c.train.grad_accum = 8, 2  # 4 rows per micro-batch, 8 data shards
    with pytest.raises(ValueError, match="mesh.data"):
        stages.validate(c, n_devices=8)
    c.train.grad_accum = 1
    assert stages.validate(c, n_devices=8) == ["pretrain"]


def test_model_that_does_not_fit_the_mesh_is_refused():
    c = base.get_config()
    c.stage = "pretrain"
    c.mesh.data, c.mesh.tensor = 2, 4
    c.model.num_attention_heads = 6
    with pytest.raises(ValueError, match="num_attention_heads"):
        stages.validate(c, n_devices=8)


def test_missing_stage_module_fails_with_its_name(monkeypatch):
    monkeypatch.setitem(stages.STAGES, "ghost", stages.Stage("coder.no_such_module:run"))
    with pytest.raises(ImportError, match="stage 'ghost' needs coder.no_such_module"):
        stages.resolve("ghost")


def test_every_stage_resolves_to_a_function():
    for name in stages.STAGES:
        try:
            assert callable(stages.resolve(name))
        except ImportError as e:  # another engineer's stage not built yet: named clearly
            assert name in str(e)


def test_longctx_config_derives_yarn():
    from coder.stages.lm import longctx_config

    c = quickstart.get_config()
    lc = longctx_config(c)
    assert lc.data.seq_len == c.longctx.seq_len
    rs = lc.model.rope_scaling
    assert rs.type == "yarn" and rs.original_max_position_embeddings == 256
    assert rs.factor == c.longctx.seq_len / 256
    # same tokens per step when they make at least one row
    assert lc.data.batch_size == max(1, c.data.batch_size * c.data.seq_len // c.longctx.seq_len)
    assert c.model.rope_scaling.type == "none"  # the input config is not modified


def test_stage_and_stages_both_set_is_an_error():
    c = _parse("--config.stage=eval")  # quickstart sets stages
    with pytest.raises(ValueError, match=r"config\.stage='eval' and config\.stages=.*both set"):
        stages.validate(c, n_devices=8)
    c = base.get_config()
    with pytest.raises(ValueError, match=r"set config\.stage"):
        stages.validate(c, n_devices=8)


def test_every_chosen_stage_is_validated_at_start_up():
    """A bad key of the last stage of a chain stops the run before the first one starts."""
    c = quickstart.get_config()
    c.stages = ("pretrain", "sft")
    c.sft.batch_size = 3  # sft's own batch does not split over 2 devices; pretrain's does
    with pytest.raises(ValueError, match=r"stage sft: data.batch_size=3"):
        stages.validate(c, n_devices=2, check_tools=False)
    c = quickstart.get_config()
    c.stages = ("pretrain", "longctx", "grpo")  # longctx grows the context grpo needs
    c.rl.group_size = 1
    with pytest.raises(ValueError, match=r"rl.group_size=1"):
        stages.validate(c, n_devices=1, check_tools=False)
    c = quickstart.get_config()
    c.stages = ("mtp", "sft")
    with pytest.raises(ValueError, match=r"stage mtp starts from a trained model: set init_from"):
        stages.validate(c, n_devices=2, check_tools=False)
    c = quickstart.get_config()
    c.stages = ("pretrain", "sft")
    c.rl.tools = ("read_file", "edit_file", "submit")  # the quickstart's toy transcripts write_file
    with pytest.raises(ValueError, match=r"sft.toy_edit_tool='write_file'.*not among the offered tools"):
        stages.validate(c, n_devices=1, check_tools=False)


def test_stage_overrides_are_data():
    c = quickstart.get_config()
    c.sft.lr, c.sft.seq_len, c.sft.batch_size = 5e-4, 0, 4
    s = stages.stage_config("sft", c)
    assert (s.train.lr, s.train.steps) == (5e-4, c.sft.steps)
    assert s.data.seq_len == c.data.seq_len  # 0 keeps the shared value
    assert s.data.batch_size == 4
    g = stages.stage_config("grpo", c)
    assert (g.train.steps, g.train.ckpt_every) == (c.grpo.steps, c.grpo.ckpt_every)
    assert stages.stage_config("pretrain", c).train.lr == c.train.lr


# ---------------------------------------------------------------------------- locked configs


TYPO_CONFIG = """
from configs.quickstart import get_config as quickstart


def get_config():
    c = quickstart()
    c.train.lrr = 1e-4  # typo of lr
    return c
"""


def test_config_file_cannot_add_a_key(tmp_path):
    """configs/base.py returns a locked config: a typo in a named config fails naming the key."""
    path = tmp_path / "typo.py"
    path.write_text(TYPO_CONFIG)
    with pytest.raises(Exception, match=r"lrr.*(locked|Did you mean)") as e:
        _parse_file(str(path))
    assert 'Did you mean "lr"' in str(e.value)
    for name in ("base", "quickstart", "deepseek_v3_671b", "kimi_k2_1t", "composer_k2", "composer_dsv3"):
        c = __import__(f"configs.{name}", fromlist=["get_config"]).get_config()
        assert c.is_locked and c.model.is_locked and c.rl.length_penalty.weights.is_locked, name
        with pytest.raises(AttributeError, match="nsa_windw"):
            c.model.nsa_windw = 3


def test_named_configs_and_overrides_still_set_existing_keys(tmp_path):
    """Every named config (and docs/scale's) loads; nested and dict-valued keys are overridable."""
    for spec in ("deepseek_v3_671b,v5p-512", "kimi_k2_1t,v6e-256x2", "quickstart,v5e-4"):
        c = _parse_file(os.path.join(ROOT, "docs", "scale", "configs.py") + ":" + spec)
        assert c.stage == "compile" and c.is_locked
    # a long-context report: the longctx stage's config (YaRN over the original 4096), one 256k
    # row per micro-batch and slice
    c = _parse_file(os.path.join(ROOT, "docs", "scale", "configs.py") + ":deepseek_v3_671b,v5p-512x2,long256k")
    assert (c.data.seq_len, c.data.batch_size, c.train.grad_accum) == (262144, 16, 8)
    assert c.model.rope_scaling.factor == 64.0 and c.model.max_position_embeddings == 262144
    assert c.compile.report_dir.endswith("deepseek_v3_671b_v5p-512x2_long256k") and not c.compile.engine
    assert not c.train.offload_optimizer
    # NSA at 128k: one row per micro-batch, the Adam moments in host memory between steps
    c = _parse_file(os.path.join(ROOT, "docs", "scale", "configs.py") + ":deepseek_v3_671b,v5p-512,long128k-nsa")
    assert c.model.attention_backend == "nsa" and c.train.offload_optimizer
    assert c.data.batch_size // c.train.grad_accum == 1
    # the ring: the dense attention's keys passed around `sequence`, the moments on the chips
    c = _parse_file(os.path.join(ROOT, "docs", "scale", "configs.py") + ":deepseek_v3_671b,v5p-512,long256k-ring")
    assert c.model.context_parallel == "ring" and c.model.attention_backend == "dense"
    assert not c.train.offload_optimizer and c.compile.report_dir.endswith("_long256k_ring")
    c = _parse_file(os.path.join(ROOT, "docs", "scale", "configs.py") + ":deepseek_v3_671b,v5p-512,long256k-offload")
    assert c.model.attention_backend == "dense" and c.train.offload_optimizer
    assert c.compile.report_dir.endswith("deepseek_v3_671b_v5p-512_long256k_offload")
    c = _parse(
        "--config.model.rope_scaling.factor=4.0", "--config.model.nsa.window=128",
        "--config.rl.length_penalty.weights.turn=2.0", "--config.rl.aux_rewards.lint_introduced=0.5",
        "--config.data.sources=({'path': '/data/*.jsonl', 'weight': 1.0},)",
        "--config.mesh.rules=(('batch', 'data'),)",
    )
    assert c.model.rope_scaling.factor == 4.0 and c.model.nsa.window == 128
    assert c.rl.length_penalty.weights.turn == 2.0 and c.rl.aux_rewards.lint_introduced == 0.5
    assert c.data.sources[0]["path"] == "/data/*.jsonl" and c.mesh.rules == (("batch", "data"),)
    with pytest.raises(Exception, match="turns"):
        _parse("--config.rl.length_penalty.weights.turns=2.0")
    # a registered auxiliary reward may be added (grpo's validate checks names against the registry)
    c = base.get_config()
    c.rl.aux_rewards.some_new_reward = 0.1
    with pytest.raises(ValueError, match="some_new_reward"):
        __import__("coder.stages.grpo", fromlist=["validate"]).validate(c)


def test_composer_k2_recipe_passes_the_grpo_stages_checks():
    """The recipe's RL keys are consistent (context within the model's window, summaries within
    the context, async with Ray actor groups and Ray env workers) before anything is built."""
    from coder import stages
    from coder.stages import grpo
    from configs import composer_k2

    c = stages.stage_config("grpo", composer_k2.get_config())
    grpo.validate(c)
    assert c.rl.context_budget == c.model.max_position_embeddings == 262144
    assert c.rl.topology.actor_processes > 1 and c.env.workers_backend == "ray" and c.rl.topology.asynchronous
    # the learner's step keeps its Adam moments in host memory (the plan's grpo_step did not fit on
    # the chips), only in the grpo stage
    assert c.train.offload_optimizer and not stages.stage_config("sft", composer_k2.get_config()).train.offload_optimizer


def test_composer_recipes_chain_the_seeds_stages_each_with_its_own_shape_and_layout():
    """configs/composer_k2.py and composer_dsv3.py: the seed's chain (CPT at 32k, 256k, MTP, SFT,
    GRPO) with MTP modules for the drafts the actors and serve decode with, and every stage's
    checks passing on the config that stage runs with against the learner pod's chips (plan mode:
    the batch over the 512 chips of 2 x v5p-512)."""
    from coder import stages
    from configs import composer_dsv3, composer_k2

    for module, experts in ((composer_k2, 384), (composer_dsv3, 256)):
        c = module.get_config()
        assert c.model.n_routed_experts == experts
        assert tuple(c.stages) == ("pretrain", "longctx", "mtp", "sft", "grpo") and not c.stage
        k = c.rl.speculative_k
        assert k >= 1 and c.model.num_mtp_layers == k == c.serve.speculative_k
        c.plan = True
        assert stages.validate(c) == list(c.stages)
        shape = {n: (s.data.seq_len, s.data.batch_size, s.train.grad_accum, s.model.remat, s.train.lr)
                 for n in c.stages for s in [stages.stage_config(n, c)]}
        assert shape["pretrain"][:2] == (32768, 128) and shape["longctx"][:2] == (262144, 16)
        assert shape["longctx"][3] == "full" and shape["sft"][0] == 131072
        assert len({v[4] for v in shape.values()}) == len(shape)  # a learning rate per stage
        g = stages.stage_config("grpo", c)
        assert (g.train.grad_accum, g.model.remat) == (64, "full")
        assert g.compile.engine_topology == "v5p-256" and g.rl.topology.actor_processes == 32
