"""Trajectories: what a rollout produced, token by token, and the GRPO batch built from it.

A `Rollout` is one attempt of the agent at one task: a chain of `ContextWindow`s (a
self-summary starts the next one), plus the counts the reward and the metrics need. A context
window records, per token: the id, whether the policy sampled it (loss) or not (prompt,
tool output, template), the behaviour logprob and policy version of sampled tokens, and the
chosen experts (`[moe_layers, top_k]`, in the engine's compact uint8 / uint16, None where the
engine never routed the token). `to_batch` turns rollouts into the batch of docs/contracts.md,
one generation per row.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass
class ContextWindow:
    """One context window of a chain. Lists are per token, same length."""

    tokens: list = dataclasses.field(default_factory=list)
    policy: list = dataclasses.field(default_factory=list)  # True: sampled by the policy
    behaviour_logp: list = dataclasses.field(default_factory=list)  # 0.0 on non-policy tokens
    policy_version: list = dataclasses.field(default_factory=list)  # -1 on non-policy tokens
    expert_ids: list = dataclasses.field(default_factory=list)  # [moe_layers, top_k] or None

    def add_context(self, ids: Sequence[int]) -> None:
        """Appends prompt / observation / template ids (no loss)."""
        n = len(ids)
        self.tokens += [int(i) for i in ids]
        self.policy += [False] * n
        self.behaviour_logp += [0.0] * n
        self.policy_version += [-1] * n
        self.expert_ids += [None] * n

    def add_sampled(self, gen) -> None:
        """Appends an engine `Generation` (tokens, logprobs, expert_ids `[n, moe_layers, top_k]`,
        policy_version). Expert ids keep the engine's dtype (rows of one array, no copies)."""
        n = len(gen.tokens)
        self.tokens += [int(i) for i in gen.tokens]
        self.policy += [True] * n
        self.behaviour_logp += [float(x) for x in np.asarray(gen.logprobs).reshape(-1)[:n]]
        versions = np.broadcast_to(np.asarray(gen.policy_version), (n,))
        self.policy_version += [int(v) for v in versions]
        experts = getattr(gen, "expert_ids", None)
        self.expert_ids += [None] * n if experts is None else list(np.asarray(experts)[:n])

    def set_routing(self, ids) -> None:
        """Fills the routing of tokens that have none (prompt, observations) from the engine's
        record of the row, `[tokens fed, moe_layers, top_k]`; sampled tokens keep theirs."""
        ids = np.asarray(ids)
        for j in range(min(len(ids), len(self.tokens))):
            if self.expert_ids[j] is None:
                self.expert_ids[j] = ids[j]

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_policy(self) -> int:
        return int(sum(self.policy))


@dataclasses.dataclass
class Rollout:
    """A chain of generations for one task and everything the reward and metrics need."""

    task_id: str
    generations: list = dataclasses.field(default_factory=list)
    test_reward: float = 0.0  # env's test score in [0, 1]
    outcome: float = 0.0  # after the broken-call rule (coder.rl.reward.outcome)
    correct: bool = False
    infra_error: str = ""  # non-empty: infrastructure failure, masked out of the group
    finish: str = ""  # submit | answer | turns | tokens | context | infra
    turns: int = 0
    tool_calls: int = 0
    broken_calls: int = 0
    edits: int = 0
    summaries: int = 0
    thinking_tokens: int = 0  # sampled text outside calls in turns that act (call tools)
    tool_io_tokens: int = 0  # sampled call tokens + tool output tokens
    output_tokens: int = 0  # sampled tokens of the final answer turn and of summaries
    # the prose of the last turn (calls cut out): a final answer, or the turn that submits
    final_text: str = ""
    edited_paths: list = dataclasses.field(default_factory=list)  # paths edits wrote, in order
    lint_before: int | None = None
    lint_after: int | None = None
    reward: float = 0.0
    advantage: float = 0.0
    tool_time_s: float = 0.0  # wall time the rollout waited on tool calls and lint
    score_time_s: float = 0.0  # wall time of scoring (the hidden tests)

    def usage(self) -> np.ndarray:
        """`[5]` in coder.rl.reward.USAGE_KEYS order."""
        return np.array([self.thinking_tokens, self.tool_io_tokens, self.output_tokens,
                         self.tool_calls, self.turns], np.float64)

    @property
    def policy_tokens(self) -> int:
        return sum(g.num_policy for g in self.generations)


def to_batch(rollouts: Sequence[Rollout], seq_len: int, rows: int | None = None) -> dict:
    """GRPO batch of docs/contracts.md, one generation per row.

    Infra-failed rollouts are skipped (masked out of their group already). Every generation of a
    chain carries its rollout's advantage. Returns numpy arrays:
      tokens, positions, segment_ids int32 `[R, seq_len]`; loss_mask, behaviour_logp float32
      `[R, seq_len]`; policy_version int32 `[R, seq_len]` (-1 off policy tokens); advantages
      float32 `[R]`; expert_ids int32 `[moe_layers, R, seq_len, top_k]` (-1 where the engine
      did not route the token, i.e. a last appended `<|end|>`) when the engine reported them
      (any integer dtype in, int32 out).
    `rows` pads R up to a fixed count (padding rows are all zero: no loss).
    """
    gens = [(g, r.advantage) for r in rollouts if not r.infra_error for g in r.generations]
    n = len(gens) if rows is None else rows
    if len(gens) > n:
        raise ValueError(f"{len(gens)} generations do not fit in {n} rows")
    b = dict(
        tokens=np.zeros((n, seq_len), np.int32), positions=np.zeros((n, seq_len), np.int32),
        segment_ids=np.zeros((n, seq_len), np.int32), loss_mask=np.zeros((n, seq_len), np.float32),
        behaviour_logp=np.zeros((n, seq_len), np.float32),
        policy_version=np.full((n, seq_len), -1, np.int32), advantages=np.zeros((n,), np.float32),
    )
    experts = None
    for i, (g, adv) in enumerate(gens):
        t = len(g)
        if t > seq_len:
            raise ValueError(f"a generation of {t} tokens exceeds seq_len {seq_len}: keep "
                             "rl.context_budget <= data.seq_len")
        b["tokens"][i, :t] = g.tokens
        b["positions"][i, :t] = np.arange(t)
        b["segment_ids"][i, :t] = 1
        b["loss_mask"][i, :t] = g.policy
        b["behaviour_logp"][i, :t] = g.behaviour_logp
        b["policy_version"][i, :t] = g.policy_version
        b["advantages"][i] = adv
        routed = [j for j, e in enumerate(g.expert_ids) if e is not None]
        if not routed:
            continue
        block = np.stack([g.expert_ids[j] for j in routed])  # [t', moe_layers, top_k]
        if experts is None:
            experts = np.full((block.shape[1], n, seq_len, block.shape[2]), -1, np.int32)
        experts[:, i, routed] = block.transpose(1, 0, 2)
    if experts is not None:
        b["expert_ids"] = experts
    return b
