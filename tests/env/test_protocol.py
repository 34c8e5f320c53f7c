"""Tool-call protocol: rendering, parsing, broken calls, the system prompt."""

import json

from coder.env import protocol
from coder.env.tools import registry as tools
from coder.env.protocol import BrokenToolCall, ToolCall, parse_tool_calls, render_tool_call

TOOLS = tools.SPECS


def test_render_parse_roundtrip_and_exact_text():
    args = {"path": "pkg/ü.py", "content": "x = '</tool'  # \"quoted\"\n"}
    text = render_tool_call("write_file", args)
    assert text.startswith('<tool_call>{"name": "write_file", "arguments": {"path"')
    assert text.endswith("</tool_call>") and "ü" in text  # UTF-8 kept, not \\u-escaped
    (call,) = parse_tool_calls("Some thought.\n" + text + "\n", TOOLS)
    assert call == ToolCall("write_file", args, text)


def test_literal_tags_in_arguments_round_trip():
    args = {"path": "doc.md", "content": "write <tool_call>{...}</tool_call> then </tool_result>"}
    text = render_tool_call("write_file", args)
    assert text.count("<tool_call>") == 1 and text.count("</tool_call>") == 1
    (call,) = parse_tool_calls(text, TOOLS)
    assert call.arguments == args


def test_several_calls_in_order_and_no_calls():
    text = (
        "a "
        + render_tool_call("read_file", {"path": "a"})
        + " b "
        + render_tool_call("grep", {"pattern": "x"})
        + render_tool_call("submit", {})
    )
    calls = parse_tool_calls(text, TOOLS)
    assert [c.name for c in calls] == ["read_file", "grep", "submit"]
    assert parse_tool_calls("just thinking, no calls", TOOLS) == []


def _reason(text):
    (c,) = parse_tool_calls(text, TOOLS)
    assert isinstance(c, BrokenToolCall)
    return c.reason


def test_broken_calls_say_why():
    assert "invalid JSON" in _reason('<tool_call>{"name": "shell", </tool_call>')
    assert "JSON object" in _reason("<tool_call>[1, 2]</tool_call>")
    assert "unknown tool 'rm_rf'" in _reason(render_tool_call("rm_rf", {}))
    assert "missing required argument 'command'" in _reason(render_tool_call("shell", {}))
    assert "must be of type string" in _reason(render_tool_call("shell", {"command": 3}))
    assert "unknown argument" in _reason(render_tool_call("read_file", {"path": "a", "mode": "r"}))
    assert "must be of type integer" in _reason(
        render_tool_call("read_file", {"path": "a", "start_line": True})
    )
    assert ">= 1" in _reason(render_tool_call("read_file", {"path": "a", "start_line": 0}))
    assert "must be of type object" in _reason(
        '<tool_call>{"name": "submit", "arguments": []}</tool_call>'
    )
    assert "unexpected keys" in _reason(
        '<tool_call>{"name": "submit", "arguments": {}, "x": 1}</tool_call>'
    )
    assert "unclosed" in _reason('<tool_call>{"name": "submit", "arguments": {}}')
    assert "without a matching" in _reason("oops</tool_call>")


def test_unclosed_then_valid_call():
    text = '<tool_call>{"name": ' + render_tool_call("submit", {})
    calls = parse_tool_calls(text, TOOLS)
    assert isinstance(calls[0], BrokenToolCall) and "unclosed" in calls[0].reason
    assert isinstance(calls[1], ToolCall) and calls[1].name == "submit"


def test_validate_subset():
    schema = {
        "type": "object",
        "properties": {
            "k": {"type": "integer", "maximum": 3},
            "e": {"enum": ["a", "b"]},
            "l": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["k"],
    }
    assert protocol.validate({"k": 2, "e": "a", "l": ["x"]}, schema) is None
    assert "<= 3" in protocol.validate({"k": 4}, schema)
    assert "one of" in protocol.validate({"k": 1, "e": "c"}, schema)
    assert "l[1]" in protocol.validate({"k": 1, "l": ["x", 2]}, schema)


def test_system_prompt_lists_every_tool_schema():
    prompt = protocol.render_system_prompt(TOOLS)
    for t in TOOLS:
        line = json.dumps(
            {"name": t.name, "description": t.description, "parameters": t.parameters},
            ensure_ascii=False,
        )
        assert line in prompt
    assert render_tool_call("tool_name", {"arg": "value"}) in prompt
    assert {t.name for t in TOOLS} == {
        "shell",
        "read_file",
        "write_file",
        "edit_file",
        "grep",
        "search",
        "semantic_search",
        "lint",
        "diagnostics",
        "run_tests",
        "repo_history",
        "memory_write",
        "memory_read",
        "think",
        "ask_user",
        "submit",
    }


def test_tool_results_rendering():
    assert (
        protocol.render_tool_results(["a", "b"])
        == "<tool_result>a</tool_result><tool_result>b</tool_result>"
    )
