"""GRPO and the CursorBench-like suite end to end on generated repository tasks: a package with
two releases served by a local package index (a `file://` JSON API, no network) makes a release
(feature) task and a mutant (bug) task; the suite adds a noisy-context variant; a scripted policy
(tests/rl/test_agent.py's engine: the question is mechanics, not what a tiny model would choose)
rolls them out in real sandboxes; the group trains and the agent eval reports per category."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from coder.data import tokenizer as tokenizer_lib
from coder.env import protocol, suite
from coder.env.tools import registry as env_tools
from coder.model import Transformer
from coder.rl import actor as actor_lib
from coder.rl import eval as eval_lib
from coder.rl import grpo, trajectory
from configs import base
from tests.rl.scripted_engine import ScriptedEngine

NAME = "tinypkg7"  # its tasks are held out (coder.env.sources.releases.split_of), so the suite keeps them


def _turn(tok, *calls, words=""):
    return tok.encode(words + "".join(protocol.render_tool_call(n, a) for n, a in calls)) + [tok.end_id]


@pytest.mark.slow
def test_grpo_and_the_suite_on_generated_repository_tasks(generated_package_tasks, tmp_path):
    (feature, after), (bug, reference) = generated_package_tasks
    assert feature.fail_to_pass == ("tests/test_core.py::test_mean",)
    assert feature.prompt == f"Bring {NAME} from 1.0.0 up to 1.1.0. The release notes say:\n" \
                             "- Added `mean`"
    assert bug.fail_to_pass and bug.metadata["mutations"][0]["file"].startswith(f"{NAME}/")
    tasks, left_out = suite.build_suite([feature, bug], noisy=1, seed=0)
    assert not left_out and [suite.category_of(t) for t in tasks] == ["feature", "bug", "noisy-context"]
    noisy = tasks[2]
    assert noisy.fail_to_pass == bug.fail_to_pass and "FAILED tests/test_core.py::" in noisy.prompt
    assert noisy.prompt.count("\n") > 100 and bug.prompt.splitlines()[0] not in noisy.prompt
    fixes = {feature.id: after, bug.id: reference, noisy.id: reference}

    texts = [protocol.render_system_prompt(env_tools.SPECS), *[t.prompt for t in tasks],
             *after.values(), *reference.values(), "Fixed it. Done."]
    tok = tokenizer_lib.train_tokenizer(texts, 500)
    config = base.get_config()
    config.rl.concurrent = False  # the scripted engine drives the rows on this thread
    config.rl.update(dict(group_size=2, eval_samples=2, eval_k=(1, 2), context_budget=65536,
                          max_turn_tokens=4000, max_turns=4, max_rollout_tokens=60000,
                          max_summaries=0))
    marks = {t.id: t.prompt[:60] for t in tasks}

    def respond(ctx, row):
        text = tok.decode(ctx)
        tid = next(i for i, m in marks.items() if tok.decode(tok.encode(m)) in text)
        if row == 1 or tok.special_id("tool") in ctx:
            return _turn(tok, ("submit", {}), words="Done. ")
        writes = [("write_file", {"path": p, "content": c}) for p, c in sorted(fixes[tid].items())]
        return _turn(tok, *writes, words="Fixed it. ")

    actor = actor_lib.Actor(ScriptedEngine(respond), tok, config,
                            actor_lib.episode_factory(config, memory_dir=str(tmp_path / "memory")))
    groups = actor.collect([feature, bug], jax.random.key(0))
    for (fixer, quitter), task in zip(groups, (feature, bug)):
        assert fixer.correct and not fixer.infra_error, (task.id, fixer.test_reward, fixer.infra_error)
        assert not quitter.correct and not quitter.infra_error, task.id
    actor_lib.score_groups(groups, config.rl)
    assert all(f.advantage > 0 > q.advantage for f, q in groups)
    cfg = base.get_config()
    cfg.model.update(dict(vocab_size=tok.padded_vocab_size, hidden_size=32, intermediate_size=64,
                          moe_intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                          kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                          n_routed_experts=2, n_group=1, topk_group=1, num_experts_per_tok=1,
                          first_k_dense_replace=1, num_mtp_layers=0,
                          max_position_embeddings=1 << 15, dtype="float32"))
    model = Transformer(cfg.model, rngs=nnx.Rngs(0))
    rollouts = [r for g in groups for r in g]
    seq = max(len(r.generations[0]) for r in rollouts)
    batch = {k: jnp.asarray(v) for k, v in trajectory.to_batch(rollouts, seq_len=seq).items()
             if k != "expert_ids"}
    loss_fn = grpo.grpo_loss_fn(clip_low=0.2, clip_high=0.28, kl_coef=0.0, normalizer=float(seq),
                                temperature=1.0)
    grads = nnx.jit(nnx.grad(lambda m: loss_fn(m, batch, None)[0]))(model)
    norm = float(jnp.sqrt(sum(jnp.sum(g ** 2) for g in jax.tree.leaves(grads))))
    assert np.isfinite(norm) and norm > 0

    result = eval_lib.run_agent_eval(config, model, tok, str(tmp_path / "eval"), tasks=tasks,
                                     actor=actor)
    assert (result["num_tasks"], result["pass@1"], result["pass@2"]) == (3, 0.5, 1.0), result
    with open(result["report"]) as f:
        report = json.load(f)
    cats = report["categories"]
    assert set(cats) == {"feature", "bug", "noisy-context"}
    for c in cats.values():
        assert (c["num_tasks"], c["pass@1"], c["pass@2"], c["best_of_2"]) == (1, 0.5, 1.0, 1.0), c
    # each attempt's test reward is in the report (the fixer's first); best-of-K takes the best
    assert {t["id"]: t["rewards"] for t in report["tasks"]} == {t.id: [1.0, 0.0] for t in tasks}
    assert report["summary"]["best_of_1"] == report["summary"]["best_of_2"] == 1.0
