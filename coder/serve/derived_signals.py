"""Signals the server derives from what the user did next, so real-time RL learns from users who
never press a feedback button.

When a chat request continues a conversation this server answered (same conversation id, and
its last assistant message is one of the choices of the conversation's last completion here),
the request itself says how that completion went:

- **dissatisfied_followup**: the first user message after that assistant message, judged by
  coder.rl.followup against the user message before it: value 1 (dissatisfied) or 0 (the user
  went on without complaint, also evidence: the completion then has a signal and is trained on,
  at reward 0, instead of being dropped). Tool results alone (an agent loop going on) say
  nothing yet.
- **edit_kept**: the completion's edits are its tool calls with a string `path` and a string
  `content` (a whole file: write_file) or `new` (a replacement: edit_file). Each is judged from
  the request when the request has evidence:
  - `metadata.workspace` = {path: sha256 hex of the file's content now} (the client's file
    hashes): a whole-file write is kept when the hash equals its content's, else not;
  - the request's context after the assistant message (tool results, the user's next message,
    the files an IDE attaches): an edit whose written text (its non-blank lines, stripped)
    appears there is kept; one whose replaced `old` text appears there while its new text does
    not was reverted.
  The value is the fraction kept of the edits judged; no edit judged, no signal.

Both name the completion and the choice the conversation continued. Their `feedback_id` starts
with `derived-`; a client's own feedback on the same completion and signal, logged later,
replaces them (coder.rl.realtime.join: the latest wins).

State: the last completion of each conversation (`max_conversations` most recent), in this
process. A conversation whose requests reach several server processes gets signals only where
two consecutive turns reached the same one (sticky routing by conversation id keeps them
together).
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import threading

from coder.rl import followup


@dataclasses.dataclass(frozen=True)
class ServedTurn:
    """One completion's choices as the client received them."""

    completion_id: str
    choices: tuple  # per choice: (content or "", ((name, arguments dict), ...))


def _calls_of(message: dict) -> tuple:
    out = []
    for tc in message.get("tool_calls") or []:
        fn = (tc.get("function") or {}) if isinstance(tc, dict) else {}
        args = fn.get("arguments")
        try:
            args = json.loads(args) if isinstance(args, str) else (args or {})
        except json.JSONDecodeError:
            args = {"_raw": args}
        out.append((fn.get("name"), args))
    return tuple(out)


def _text(content) -> str:
    if isinstance(content, list):  # OpenAI content parts
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def _present(text: str, context: str) -> bool:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return bool(lines) and all(ln in context for ln in lines)


def edit_verdicts(calls, context: str, workspace: dict) -> list[bool]:
    """Kept (True) / not kept (False) per edit call that the evidence judges (module docstring)."""
    out = []
    for name, args in calls:
        if not isinstance(args, dict) or not isinstance(args.get("path"), str):
            continue
        written = args.get("content") if isinstance(args.get("content"), str) else args.get("new")
        if not isinstance(written, str):
            continue
        now = workspace.get(args["path"])
        if isinstance(args.get("content"), str) and isinstance(now, str):
            out.append(now.lower() == hashlib.sha256(written.encode()).hexdigest())
        elif _present(written, context):
            out.append(True)
        elif isinstance(args.get("old"), str) and _present(args["old"], context):
            out.append(False)
    return out


class DerivedSignals:
    """The conversations' last served turns, and the signals a new request derives from them."""

    def __init__(self, max_conversations: int = 10000):
        self.max_conversations = int(max_conversations)
        self._last: collections.OrderedDict[str, ServedTurn] = collections.OrderedDict()
        self._lock = threading.Lock()

    def remember(self, conversation_id: str, completion_id: str, choices) -> None:
        """Record a completion's choices: (content, OpenAI tool_call dicts) each."""
        turn = ServedTurn(completion_id, tuple(
            ((content or "").strip(), _calls_of({"tool_calls": calls})) for content, calls in choices))
        with self._lock:
            self._last.pop(conversation_id, None)
            self._last[conversation_id] = turn
            while len(self._last) > self.max_conversations:
                self._last.popitem(last=False)

    def observe(self, conversation_id: str, messages: list, metadata: dict) -> list[dict]:
        """The signals `messages` (a new request of the conversation) give about the
        conversation's last completion here: [{"completion_id", "choice", "signal", "value"}]."""
        with self._lock:
            turn = self._last.get(conversation_id)
        if turn is None or not isinstance(messages, list):
            return []
        roles = [m.get("role") if isinstance(m, dict) else None for m in messages]
        if "assistant" not in roles:
            return []
        at = len(roles) - 1 - roles[::-1].index("assistant")
        reply = messages[at]
        key = (_text(reply.get("content")).strip(), _calls_of(reply))
        if key not in turn.choices:
            return []  # not our reply (edited, or another server's): nothing to say about it
        choice = turn.choices.index(key)
        after = [m for m in messages[at + 1:] if isinstance(m, dict)]
        out = []
        user = next((m for m in after if m.get("role") == "user"), None)
        if user is not None:
            before = next((_text(m.get("content")) for m in reversed(messages[:at])
                           if isinstance(m, dict) and m.get("role") == "user"), None)
            verdict = followup.judge(_text(user.get("content")), before)
            out.append(dict(completion_id=turn.completion_id, choice=choice, signal="dissatisfied_followup",
                            value=float(verdict.dissatisfied)))
        workspace = metadata.get("workspace") if isinstance(metadata, dict) else None
        if isinstance(workspace, str):  # OpenAI's metadata values are strings: a JSON object in one
            try:
                workspace = json.loads(workspace)
            except json.JSONDecodeError:
                workspace = None
        context = "\n".join(_text(m.get("content")) for m in after)
        kept = edit_verdicts(key[1], context, workspace if isinstance(workspace, dict) else {})
        if kept:
            out.append(dict(completion_id=turn.completion_id, choice=choice, signal="edit_kept",
                            value=sum(kept) / len(kept)))
        return out
