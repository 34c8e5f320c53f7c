"""Tool-call text protocol: the one place that renders and parses tool calls.

An assistant turn is free text with zero or more calls, each
    <tool_call>{"name": "read_file", "arguments": {"path": "a.py"}}</tool_call>
run in order. The environment answers with one tool message holding one result per call, in
order, each wrapped as `<tool_result>...</tool_result>` (`render_tool_results`).
`<tool_call>`, `</tool_call>`, `<tool_result>`, `</tool_result>` are single special tokens of
the tokenizer (docs/contracts.md); the tokenizer's chat template, the SFT transcripts and the RL
rollout loop all go through these functions so their text is byte-identical.

A call that cannot be run is a `BrokenToolCall(reason)`: bad JSON, not an object, unknown tool,
arguments that violate the tool's JSON schema, an unclosed `<tool_call>` or a stray
`</tool_call>`. Broken calls are reported back to the model and count as failures (docs/contracts.md, "Tool calls"; docs/rl.md, "Reward").
"""

from __future__ import annotations

import dataclasses
import json
import re

from coder.data.chat_template import CALL_CLOSE, CALL_OPEN, RESULT_CLOSE, RESULT_OPEN

_TAG = re.compile(re.escape(CALL_OPEN) + "|" + re.escape(CALL_CLOSE))


@dataclasses.dataclass(frozen=True)
class ToolSpec:
    """What the model is told about a tool: name, description, JSON schema of its arguments."""

    name: str
    description: str
    parameters: dict  # JSON schema, type "object"


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict
    text: str  # the exact source text, tags included


@dataclasses.dataclass(frozen=True)
class BrokenToolCall:
    reason: str
    text: str


def render_tool_call(name: str, arguments: dict) -> str:
    """The canonical text of one call (JSON, keys in the given order, UTF-8 kept).

    A literal tag inside an argument (a file that mentions `</tool_call>`) is written with its
    `<` as the JSON escape \\u003c, so the call still parses back to the same arguments.
    """
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    for tag in (CALL_OPEN, CALL_CLOSE, RESULT_OPEN, RESULT_CLOSE):
        body = body.replace(tag, "\\u003c" + tag[1:])
    return f"{CALL_OPEN}{body}{CALL_CLOSE}"


def call_fragments(tools: list[ToolSpec]) -> list[str]:
    """The fixed text of each tool's calls, between its string arguments: for write_file
    `{"name": "write_file", "arguments": {"path": "`, `", "content": "` and `"}}` (the tags are
    special tokens already). As tokenizer symbols they make a call a few tokens plus its
    arguments, so a tiny model cannot break its syntax midway (coder.data.tokenizer)."""
    mark = "\0"
    out = []
    for t in tools:
        strings = [k for k, v in t.parameters.get("properties", {}).items() if v.get("type") == "string"]
        text = render_tool_call(t.name, {k: mark for k in strings})[len(CALL_OPEN):-len(CALL_CLOSE)]
        out += [f for f in text.split(json.dumps(mark)[1:-1]) if f and f not in out]
    return out


def render_tool_results(outputs: list[str]) -> str:
    """The tool message for one assistant turn: one wrapped result per call, in call order."""
    return "".join(f"{RESULT_OPEN}{o}{RESULT_CLOSE}" for o in outputs)


def render_system_prompt(tools: list[ToolSpec], preamble: str | None = None) -> str:
    """System prompt listing every tool with its JSON schema and the call format."""
    lines = [
        preamble
        or "You are a coding agent working in a repository at /workspace. Use the tools to "
        "inspect the code, make changes and run tests. When the task is done, call submit.",
        "",
        "To call tools, write one or more calls in your reply, each exactly as:",
        render_tool_call("tool_name", {"arg": "value"}),
        "The arguments must satisfy the tool's JSON schema. Calls run in order; their results "
        f"come back in {RESULT_OPEN}...{RESULT_CLOSE} blocks, one per call.",
        "",
        "Tools:",
    ]
    for t in tools:
        lines.append(
            json.dumps(
                {"name": t.name, "description": t.description, "parameters": t.parameters},
                ensure_ascii=False,
            )
        )
    return "\n".join(lines)


def parse_tool_calls(text: str, tools: dict[str, ToolSpec] | list[ToolSpec]) -> list:
    """Calls in model text, in order: ToolCall or BrokenToolCall items (empty list: no call)."""
    if not isinstance(tools, dict):
        tools = {t.name: t for t in tools}
    out, pos, open_at = [], 0, None
    for m in _TAG.finditer(text):
        if m.group() == CALL_OPEN:
            if open_at is not None:  # a second open before a close: the first is unclosed
                out.append(
                    BrokenToolCall(
                        "unclosed <tool_call> (a new <tool_call> began before </tool_call>)",
                        text[open_at : m.start()],
                    )
                )
            open_at = m.start()
        elif open_at is None:
            out.append(
                BrokenToolCall("</tool_call> without a matching <tool_call>", text[pos : m.end()])
            )
        else:
            body = text[open_at + len(CALL_OPEN) : m.start()]
            out.append(_parse_one(body, text[open_at : m.end()], tools))
            open_at = None
        pos = m.end()
    if open_at is not None:
        out.append(
            BrokenToolCall(
                "unclosed <tool_call> (no </tool_call> before the end of the reply)", text[open_at:]
            )
        )
    return out


def _parse_one(body: str, source: str, tools: dict[str, ToolSpec]):
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return BrokenToolCall(f"invalid JSON: {e.msg} at char {e.pos}", source)
    if not isinstance(obj, dict):
        return BrokenToolCall('the call must be a JSON object with "name" and "arguments"', source)
    extra = set(obj) - {"name", "arguments"}
    if extra:
        return BrokenToolCall(f"unexpected keys in the call: {sorted(extra)}", source)
    name = obj.get("name")
    if not isinstance(name, str):
        return BrokenToolCall('"name" must be a string', source)
    if name not in tools:
        return BrokenToolCall(f"unknown tool {name!r}; tools are {sorted(tools)}", source)
    args = obj.get("arguments", {})
    err = validate(args, tools[name].parameters, "arguments")
    if err:
        return BrokenToolCall(f"{name}: {err}", source)
    return ToolCall(name, args, source)


_TYPES = {
    "string": str,
    "integer": int,
    "number": (int, float),
    "boolean": bool,
    "object": dict,
    "array": list,
}


def validate(value, schema: dict, where: str = "value") -> str | None:
    """Check `value` against the JSON-schema subset the tools use; return an error or None.

    Supported: type, properties, required, additionalProperties (false), items, enum,
    minimum, maximum.
    """
    typ = schema.get("type")
    if typ is not None:
        py = _TYPES[typ]
        bad_bool = isinstance(value, bool) and typ in ("integer", "number")
        if not isinstance(value, py) or bad_bool:
            return f"{where} must be of type {typ}, got {type(value).__name__}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{where} must be one of {schema['enum']}"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            return f"{where} must be >= {schema['minimum']}"
        if "maximum" in schema and value > schema["maximum"]:
            return f"{where} must be <= {schema['maximum']}"
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            if key not in value:
                return f"missing required argument {key!r}"
        if schema.get("additionalProperties") is False:
            unknown = sorted(set(value) - set(props))
            if unknown:
                return f"unknown argument(s) {unknown}; allowed: {sorted(props)}"
        for key, sub in props.items():
            if key in value:
                err = validate(value[key], sub, key)
                if err:
                    return err
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            err = validate(item, schema["items"], f"{where}[{i}]")
            if err:
                return err
    return None
