"""The chat / tool template every tokenizer kind (coder.data.tokenizer) serves, with its roles
and special tokens.

A turn is `<|role|>` + encode(text) + `<|end|>`; a conversation is the
concatenation of its turns (no bos). Loss falls on an assistant turn's text tokens and its
`<|end|>` (the model must learn to stop), never on the role token (the template supplies it:
`generation_prefix()`), nor on any other role's turn.
"""
from collections.abc import Sequence

import numpy as np

ROLES = ("system", "user", "assistant", "tool")
# The tool-call and tool-result tags of coder.env.protocol's format, one special token each
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESULT_OPEN, RESULT_CLOSE = "<tool_result>", "</tool_result>"
SPECIAL_TOKENS = (
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|tool|>",
    "<|end|>",
    CALL_OPEN,
    CALL_CLOSE,
    RESULT_OPEN,
    RESULT_CLOSE,
    "<summary>",
    "</summary>",
)
# The keys of `data.chat_tokens`, one per SPECIAL_TOKENS entry (same order).
CHAT_TOKEN_NAMES = ("system", "user", "assistant", "tool", "end", "tool_call", "tool_call_end",
                    "tool_result", "tool_result_end", "summary", "summary_end")
DEFAULT_CHAT_TOKENS = dict(zip(CHAT_TOKEN_NAMES, SPECIAL_TOKENS))


def _tool_outputs(content: str) -> list[str] | None:
    """The outputs of a tool message's text (`<tool_result>o</tool_result>` per call), or None
    for text without the tags."""
    if not content.startswith(RESULT_OPEN) or not content.endswith(RESULT_CLOSE):
        return None
    return content[len(RESULT_OPEN):-len(RESULT_CLOSE)].split(RESULT_CLOSE + RESULT_OPEN)


class ChatTemplate:
    """The chat / tool template over a tokenizer's `encode` and its special-token ids
    (`self._special`: SPECIAL_TOKENS string -> id), shared by every kind."""

    _special: dict

    def special_id(self, token: str) -> int:
        """Id of a special token, by its text (`"<|end|>"`) or role name (`"assistant"`)."""
        if token in ROLES:
            token = f"<|{token}|>"
        if token not in self._special:
            raise KeyError(f"{token!r} is not a special token; known: {SPECIAL_TOKENS}")
        return self._special[token]

    @property
    def end_id(self) -> int:
        return self._special["<|end|>"]

    def turn_ids(self, role: str, text: str) -> list[int]:
        """`<|role|>` + encode(text) + `<|end|>`."""
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; roles are {ROLES}")
        return [self.special_id(role)] + self.encode(text) + [self.end_id]

    def turn_loss_mask(self, role: str, num_ids: int) -> list[float]:
        """Loss mask of a rendered turn of `num_ids` ids (role token, text, end)."""
        weight = 1.0 if role == "assistant" else 0.0
        return [0.0] + [weight] * (num_ids - 1)

    def generation_prefix(self) -> list[int]:
        """What the agent loop appends before sampling an assistant turn."""
        return [self.special_id("assistant")]

    def tool_message_ids(self, outputs: Sequence[str]) -> list[int]:
        """The tool message of one assistant turn, as SFT, RL and serving all tokenize it:
        `<|tool|>` + one `<tool_result>` output `</tool_result>` per call + `<|end|>`, each output
        encoded as plain text (a file holding "<|end|>" cannot forge a control token)."""
        ids = [self.special_id("tool")]
        for o in outputs:
            ids += [self._special[RESULT_OPEN]] + self.encode(o, allow_special=False) + [self._special[RESULT_CLOSE]]
        return ids + [self.end_id]

    def render_conversation(self, messages: Sequence[dict]) -> tuple[np.ndarray, np.ndarray]:
        """messages [{"role", "content"}] -> (ids int32 [n], loss_mask float32 [n]).

        A tool message's content is `<tool_result>...</tool_result>` per call (the text of
        coder.env.protocol.render_tool_results): it is tokenized by `tool_message_ids`, like the
        RL agent's observations; other tool content is encoded as plain text."""
        ids: list[int] = []
        mask: list[float] = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or "role" not in message or "content" not in message:
                raise ValueError(f"message {i} must be a dict with 'role' and 'content': {message!r}")
            if not isinstance(message["content"], str):
                raise TypeError(f"message {i} content must be a string")
            outputs = _tool_outputs(message["content"]) if message["role"] == "tool" else None
            if outputs is not None:
                turn = self.tool_message_ids(outputs)
            elif message["role"] == "tool":
                turn = [self.special_id("tool")] + self.encode(message["content"], allow_special=False) + [self.end_id]
            else:
                turn = self.turn_ids(message["role"], message["content"])
            ids += turn
            mask += self.turn_loss_mask(message["role"], len(turn))
        return np.asarray(ids, np.int32), np.asarray(mask, np.float32)
