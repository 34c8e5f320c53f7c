"""Every env tool through the RL agent loop on a repository task in a real sandbox: one group of
two rollouts (a scripted policy that uses the whole harness and fixes the bug, and one that
submits at once), scored as GRPO scores a group, a GRPO loss gradient on them, and the agent
eval over the same actor. The policy is tests/rl/test_agent.py's scripted engine: the question
here is the harness's mechanics (every call parses, runs in the sandbox, returns its output into
the context the model reads, and the rollout trains), not what a tiny model would choose.
"""
import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from coder.data import tokenizer as tokenizer_lib
from coder.env import protocol
from coder.env.tools import registry as env_tools
from coder.model import Transformer
from coder.rl import actor as actor_lib
from coder.rl import eval as eval_lib
from coder.rl import grpo, trajectory
from configs import base
from tests.rl.scripted_engine import ScriptedEngine

def _config():
    c = base.get_config()
    c.rl.tools = ()  # every env tool
    c.rl.concurrent = False  # the scripted engine drives both rows on this thread
    c.rl.update(dict(group_size=2, eval_samples=2, eval_k=(1, 2), context_budget=65536, summary_reserve=64,
                     max_turn_tokens=2000, max_turns=16, max_rollout_tokens=60000, max_summaries=0))
    c.rl.aux_rewards.update(dict(communication=0.05, clarification=0.05))
    c.env.history_depth = 2
    c.env.max_output_chars = 1500
    c.env.semantic_encoder = "tests.env.tools.search_inputs:make_word_encoder"  # no model to load
    return c


def _turn(tok, *calls, words=""):
    return tok.encode(words + "".join(protocol.render_tool_call(n, a) for n, a in calls)) + [tok.end_id]


def _script(tok):
    return [
        _turn(tok, ("think", {"thought": "find the parser, then read it"}), ("memory_read", {}),
              ("repo_history", {"action": "log"}), ("semantic_search", {"query": "ISO date string year month day"}),
              ("search", {"query": "parse_iso"}), ("grep", {"pattern": "def parse_iso"}), words="Looking around. "),
        _turn(tok, ("read_file", {"path": "pkg/dates.py"}), ("diagnostics", {"action": "check", "path": "pkg"}),
              ("lint", {"path": "pkg"}), ("run_tests", {})),
        _turn(tok, ("shell", {"command": "cd pkg && export MARK=kept"})),
        _turn(tok, ("shell", {"command": 'echo "$MARK in $(basename "$PWD")"'})),
        _turn(tok, ("repo_history", {"action": "show"}), ("diagnostics", {"action": "references", "symbol": "parse_iso"})),
        _turn(tok, ("ask_user", {"question": "Should parse_iso accept a trailing Z?"})),
        _turn(tok, ("edit_file", {"path": "pkg/dates.py", "old": "text[:-1]", "new": "text"})),
        _turn(tok, ("write_file", {"path": "NOTES.md", "content": "parse_iso: no slicing\n"})),
        _turn(tok, ("run_tests", {}), ("memory_write", {"note": "tests run with: python -m pytest -q tests"})),
        _turn(tok, ("submit", {}), words="I changed pkg/dates.py because parse_iso cut the day's last digit. "),
    ]


@pytest.fixture(scope="module")
def tok(dates_repo_task):
    texts = [protocol.render_system_prompt(env_tools.SPECS), "\n".join(dates_repo_task.solution.values()),
             "Looking around. I changed it."]
    return tokenizer_lib.train_tokenizer(texts, 400)


@pytest.mark.slow
def test_every_tool_runs_in_the_rl_loop_and_the_group_trains(dates_repo_task, tok, tmp_path):
    repo_task = dates_repo_task.task
    config = _config()
    script = _script(tok)
    quick = _turn(tok, ("submit", {}), words="Done. ")

    def respond(ctx, row):
        turn = sum(1 for t in ctx if t == tok.special_id("tool"))
        return script[turn] if row == 0 else quick

    make = actor_lib.episode_factory(config, memory_dir=str(tmp_path / "memory"))
    actor = actor_lib.Actor(ScriptedEngine(respond), tok, config, make)
    ((fixer, quitter),) = actor.collect([repo_task], jax.random.key(0))
    called = {c.name for turn in script for c in protocol.parse_tool_calls(tok.decode(turn[:-1]), env_tools.SPECS)}
    assert called == {t.name for t in env_tools.SPECS}  # every tool of the registry
    seen = tok.decode(fixer.generations[0].tokens)  # the context the policy read, tool outputs included
    assert fixer.finish == "submit" and fixer.correct and fixer.broken_calls == 0 and not fixer.infra_error, (
        fixer.test_reward, fixer.tool_calls, seen)
    assert (fixer.tool_calls, fixer.questions, fixer.edited_paths) == (20, 1, ["pkg/dates.py", "NOTES.md"])
    assert quitter.finish == "submit" and not quitter.correct
    seen = tok.decode(fixer.generations[0].tokens)  # the context the policy read, tool outputs included
    for expected in ("speed up parse_iso", "dates: parse_iso",  # repo_history log: both commits
                     "pkg/dates.py:1-3 (score",  # semantic_search and search found the parser
                     "pkg/dates.py:1:def parse_iso",  # grep
                     "no notes for this repository yet",  # memory_read before any write
                     "kept in pkg",  # the shell kept cd and export across calls
                     "text[:-1]",  # read_file / show: the bug
                     "the task says everything you need",  # ask_user: this prompt was complete
                     "1 passed", "noted"):
        assert expected in seen, expected
    # the note persists for the next task of this repository (another task: a rollout never reads its own task's)
    nxt = dataclasses.replace(repo_task, id="repo/dates/2")
    assert "python -m pytest -q tests" in make(nxt).memory_scope.notes("")[0]
    assert make(repo_task).memory_scope.notes("") == []
    # scored as GRPO scores a group: the fixer above the quitter; its unneeded question costs
    scores = actor_lib.score_groups([[fixer, quitter]], config.rl)
    assert fixer.advantage > 0 > quitter.advantage
    assert scores["correct"].tolist() == [[True, False]]
    # a GRPO loss gradient on the group's batch (a tiny model over the tokenizer's vocabulary)
    cfg = base.get_config()
    cfg.model.update(dict(vocab_size=tok.padded_vocab_size, hidden_size=32, intermediate_size=64,
                          moe_intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, kv_lora_rank=16,
                          qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=2, n_group=1,
                          topk_group=1, num_experts_per_tok=1, first_k_dense_replace=1, num_mtp_layers=0,
                          max_position_embeddings=1 << 15, dtype="float32"))
    model = Transformer(cfg.model, rngs=nnx.Rngs(0))
    seq = max(len(r.generations[0]) for r in (fixer, quitter))
    batch = {k: jnp.asarray(v) for k, v in trajectory.to_batch([fixer, quitter], seq_len=seq).items()
             if k != "expert_ids"}
    loss_fn = grpo.grpo_loss_fn(clip_low=0.2, clip_high=0.28, kl_coef=0.0, normalizer=float(seq), temperature=1.0)
    grads = nnx.jit(nnx.grad(lambda m: loss_fn(m, batch, None)[0]))(model)
    norm = float(jnp.sqrt(sum(jnp.sum(g ** 2) for g in jax.tree.leaves(grads))))
    assert np.isfinite(norm) and norm > 0
    # the agent eval over the same actor and tools: a report with pass@k
    result = eval_lib.run_agent_eval(config, model, tok, str(tmp_path / "eval"), tasks=[repo_task], actor=actor)
    assert result["num_tasks"] == 1 and result["pass@1"] == 0.5 and result["infra_failures"] == 0
    assert os.path.exists(result["report"])
