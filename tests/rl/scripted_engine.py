"""A scripted stand-in for the engine in the RL agent tests (tests/rl/test_agent.py and the env /
RL tests built on it): `ScriptedEngine` answers each row from a `respond(context ids, row)`
policy through the engine's group API, and `call_ids` is one tool call's token ids."""
import dataclasses

import numpy as np

from coder.env import protocol


@dataclasses.dataclass
class ScriptedGeneration:
    tokens: list
    logprobs: list
    expert_ids: np.ndarray
    finish_reason: str
    policy_version: list


class ScriptedGroup:
    def __init__(self, prompt, n):
        self.rows = [list(prompt) for _ in range(n)]
        self.queued = [[] for _ in range(n)]
        self.prompt = list(prompt)

    def tokens(self, row):
        return list(self.rows[row])

    def expert_ids(self, row):
        pos = np.arange(len(self.rows[row]))
        return np.stack([pos[:, None] % 5, pos[:, None] % 7], -1).astype(np.int32)  # [L, 1, 2]


class ScriptedEngine:
    """Engine API over a `respond(context ids, row) -> turn ids` policy.

    A turn is emitted up to `max_new_tokens` per call (the rest continues on the next call)
    and through the first stop token. Logprobs encode the absolute position (-(pos+1)/1000),
    so a test can check each recorded logprob sits at its token.
    """

    def __init__(self, respond, chunk=10**9):
        self.respond, self.chunk = respond, chunk  # chunk: at most this many tokens per call
        self.groups = []
        self.calls = []

    def start_group(self, prompt, n):
        g = ScriptedGroup(prompt, n)
        self.groups.append(g)
        return g

    def append(self, group, row, ids):
        group.rows[row].extend(int(i) for i in ids)
        group.queued[row] = []  # the policy now answers the new context

    def generate(self, group, params, rng, rows=None):
        rows = range(len(group.rows)) if rows is None else rows
        out = []
        for r in rows:
            self.calls.append(params.max_new_tokens)
            if not group.queued[r]:
                group.queued[r] = list(self.respond(group.rows[r], r))
            toks, finish = [], "length"
            while group.queued[r] and len(toks) < min(params.max_new_tokens, self.chunk):
                t = group.queued[r].pop(0)
                toks.append(t)
                if t in params.stop_token_ids:
                    finish = "stop"
                    group.queued[r] = []
                    break
            start = len(group.rows[r])
            group.rows[r].extend(toks)
            lp = [-(start + i + 1) / 1000 for i in range(len(toks))]
            ex = np.stack([np.arange(start, start + len(toks))[:, None] % 5,
                           np.arange(start, start + len(toks))[:, None] % 7], -1).astype(np.int32)
            out.append(ScriptedGeneration(toks, lp, ex, finish, [7] * len(toks)))
        return out


def call_ids(tok, name, args, pre=""):
    return tok.encode(pre + protocol.render_tool_call(name, args)) + [tok.end_id]
