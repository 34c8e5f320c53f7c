"""The agent SFT teaches is the agent RL runs: same system prompt, user turn and tool messages.

An SFT transcript of a toy task (built the way stage sft builds its data, with `rl.tools`,
`rl.system_prompt` and `sft.toy_edit_tool`, real sandboxed tool runs) and the RL agent's rendering of the same task and
tool outputs must give the same ids, including a tool output holding a special-token string.
"""
import dataclasses

import pytest

from coder.data import tokenizer as tokenizer_lib
from coder.env import protocol, transcripts
from coder.env.episode import Episode
from coder.rl.agent import Agent
from configs import quickstart


@pytest.fixture(scope="module")
def setup():
    c = quickstart.get_config()
    c.rl.system_prompt = "You fix Python bugs."
    convs = transcripts.toy_transcripts(2, 0, workers=1, tools=tuple(c.rl.tools), system_preamble=c.rl.system_prompt,
                                        edit_tool=c.sft.toy_edit_tool)
    import inspect
    import json.decoder

    texts = [m["content"] for conv in convs for m in conv["messages"]] * 4 + [inspect.getsource(json.decoder)]
    tok = tokenizer_lib.train_tokenizer(texts, 400)
    return c, convs, tok


def test_sft_transcript_and_rl_rollout_render_the_same_ids(setup):
    c, convs, tok = setup
    agent = Agent(None, tok, c.rl)
    tools = Episode(len, tools=tuple(c.rl.tools)).tools  # the episode RL builds from config
    for conv in convs:
        msgs = conv["messages"]
        assert [m["role"] for m in msgs[:2]] == ["system", "user"]
        head = agent.head_ids(tools, msgs[1]["content"])
        ids, _ = tok.render_conversation(msgs[:2])
        assert ids.tolist() == head  # system prompt (RL's tools and preamble) + task
        assert "run_tests" not in msgs[0]["content"] and c.rl.system_prompt in msgs[0]["content"]
        calls = [name for m in msgs if m["role"] == "assistant"
                 for name in [x.name for x in protocol.parse_tool_calls(m["content"], tools)]]
        assert calls and set(calls) <= set(c.rl.tools)  # SFT teaches only calls RL accepts
    # tool messages: the text SFT stores and the outputs RL appends tokenize alike, even when an
    # output holds a control token's text
    outputs = ["def f():\n    return 1\n", "a file with <|end|> and <tool_call> inside"]
    sft_ids, mask = tok.render_conversation([{"role": "tool", "content": protocol.render_tool_results(outputs)}])
    assert sft_ids.tolist() == agent.tool_message_ids(outputs)
    assert sft_ids.tolist().count(tok.end_id) == 1 and not mask.any()


def test_harness_transcript_replayed_by_the_rl_agent_gives_the_sft_ids():
    """A harness transcript (every tool: multi-call turns) fed to the RL agent's state machine,
    its assistant texts as the sampled ids and its tool outputs as the episode's: the RL loop asks
    for exactly the transcript's calls, turn by turn, and its generation is the SFT rendering of
    the transcript, id for id, with the policy tokens where SFT puts the loss."""
    import json

    import numpy as np

    from coder.data.chat_template import _tool_outputs
    from coder.env.tasks import toy_tasks
    from coder.rl import reward as reward_lib

    ((task, sol),) = toy_tasks(1, seed=3)
    conv, info = transcripts.transcript(task, sol, seed=0)
    assert info["reward"] == 1.0
    msgs = conv["messages"]
    tok = tokenizer_lib.train_tokenizer([m["content"] for m in msgs] * 2, 400)
    c = quickstart.get_config()
    c.rl.update(context_budget=1 << 20, max_turn_tokens=1 << 16, max_rollout_tokens=1 << 20, max_turns=30)
    tools = Episode(len).tools  # every tool, as the transcript offered
    run = Agent(None, tok, c.rl).start(task.id, task.prompt, tools)
    multi = 0
    for i, m in enumerate(msgs[2:], 2):
        if m["role"] != "assistant":
            continue
        ids = tok.encode(m["content"]) + [tok.end_id]
        run.on_sample(_Sampled(ids, [0.0] * len(ids), None, "stop", [0] * len(ids)))
        calls = protocol.parse_tool_calls(m["content"], tools)
        asked = run.next_action().calls
        assert [(x.name, x.arguments) for x in asked] == [(x.name, x.arguments) for x in calls]
        multi += len(calls) > 1
        done = i + 1 == len(msgs)
        run.on_tools(["submitted"] if done else _tool_outputs(msgs[i + 1]["content"]), done=done)
    run.on_score(1.0, {})
    assert run.done and run.rollout.finish == "submit" and multi >= 2
    ids, mask = tok.render_conversation(msgs)
    gen = run.rollout.generations[0]
    assert gen.tokens == ids.tolist()
    assert np.array_equal(np.asarray(gen.policy), mask > 0)
    # what the communication reward reads: the submit turn's words and the edited file
    assert run.rollout.final_text == msgs[-1]["content"].split("<tool_call>")[0].strip()
    assert run.rollout.edited_paths == ["answer.py"]
    assert reward_lib.AUX_REWARDS["communication"](run.rollout) == 1.0
    # serving: the same conversation as OpenAI messages (each reply as the server returns it:
    # words in content, calls in tool_calls; one tool message per call) renders the same prompt
    from coder.serve.server import render_prompt

    api = [{"role": "user", "content": task.prompt}]
    for m in msgs[2:-1]:
        if m["role"] == "tool":
            api += [{"role": "tool", "content": o} for o in _tool_outputs(m["content"])]
            continue
        calls = protocol.parse_tool_calls(m["content"], tools)
        words = m["content"]
        for x in calls:
            words = words.replace(x.text, "", 1)
        api.append({"role": "assistant", "content": words, "tool_calls": [
            {"type": "function", "function": {"name": x.name, "arguments": json.dumps(x.arguments)}}
            for x in calls]})
    served = render_prompt(tok, api, {t.name: t for t in tools}, None)
    assert served == ids.tolist()[:len(served) - 1] + tok.generation_prefix()
    assert len(served) - 1 == len(tok.render_conversation(msgs[:-1])[0])


@dataclasses.dataclass
class _Sampled:
    """An engine Generation's fields (coder.infer.engine) for a turn the test 'samples'."""

    tokens: list
    logprobs: list
    expert_ids: object
    finish_reason: str
    policy_version: list
