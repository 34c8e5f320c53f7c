"""The agent SFT teaches is the agent RL runs: same system prompt, user turn and tool messages.

An SFT transcript of a toy task (built the way stage sft builds its data, with `rl.tools`,
`rl.system_prompt` and `sft.toy_edit_tool`, real sandboxed tool runs) and the RL agent's rendering of the same task and
tool outputs must give the same ids, including a tool output holding a special-token string.
"""
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
