"""Trajectories: what a rollout produced, token by token, and the GRPO batch built from it.

A `Rollout` is one attempt of the agent at one task: a chain of `ContextWindow`s (a
self-summary starts the next one), plus the counts the reward and the metrics need. A context
window records, per token: the id, whether the policy sampled it (loss) or not (prompt,
tool output, template), the behaviour logprob and policy version of sampled tokens, and the
chosen experts (`[moe_layers, top_k]`, in the engine's compact uint8 / uint16, None where the
engine never routed the token). `to_batch` turns rollouts into the batch of docs/contracts.md,
one generation per row; `shared_prefix_rows` + `to_shared_batch` pack a group's shared prompt
once with its rollouts' continuations after it (grpo.shared_prefix_len).
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
    outcome: float = 0.0  # after the broken-call rule (coder.env.scoring.score.outcome)
    correct: bool = False
    infra_error: str = ""  # non-empty: infrastructure failure, masked out of the group
    finish: str = ""  # submit | answer | turns | tokens | context | infra
    turns: int = 0
    tool_calls: int = 0
    broken_calls: int = 0
    edits: int = 0
    questions: int = 0  # ask_user calls (the simulated user)
    clarification_needed: bool = False  # the task's prompt was underspecified (its episode says)
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
    verdict_shared: bool = False  # its tests' verdict came from an identical workspace (no run)
    # the engine's prefill for its rows (windows): tokens computed (a group's shared prompt counts in
    # its first rollout), and prompt tokens taken from the engine's prefix cache instead
    prefill_tokens: int = 0
    prefix_tokens_saved: int = 0

    def usage(self) -> np.ndarray:
        """`[5]` in coder.rl.reward.USAGE_KEYS order."""
        return np.array([self.thinking_tokens, self.tool_io_tokens, self.output_tokens,
                         self.tool_calls, self.turns], np.float64)

    @property
    def policy_tokens(self) -> int:
        return sum(g.num_policy for g in self.generations)


def _empty_batch(n: int, seq_len: int, per_token_advantages: bool = False) -> dict:
    adv_shape = (n, seq_len) if per_token_advantages else (n,)
    return dict(
        tokens=np.zeros((n, seq_len), np.int32), positions=np.zeros((n, seq_len), np.int32),
        segment_ids=np.zeros((n, seq_len), np.int32), loss_mask=np.zeros((n, seq_len), np.float32),
        behaviour_logp=np.zeros((n, seq_len), np.float32),
        policy_version=np.full((n, seq_len), -1, np.int32), advantages=np.zeros(adv_shape, np.float32),
    )


def _write(b: dict, row: int, at: int, g: ContextWindow, lo: int, hi: int, segment: int, pos0: int):
    """Copies tokens [lo, hi) of window `g` to `row` from index `at` as `segment`, positions from
    `pos0`; the routing into b["expert_ids"] (allocated at the first routed token)."""
    dst = slice(at, at + hi - lo)
    b["tokens"][row, dst] = g.tokens[lo:hi]
    b["positions"][row, dst] = np.arange(pos0, pos0 + hi - lo)
    b["segment_ids"][row, dst] = segment
    b["loss_mask"][row, dst] = g.policy[lo:hi]
    b["behaviour_logp"][row, dst] = g.behaviour_logp[lo:hi]
    b["policy_version"][row, dst] = g.policy_version[lo:hi]
    routed = [j for j in range(lo, hi) if g.expert_ids[j] is not None]
    if not routed:
        return
    block = np.stack([g.expert_ids[j] for j in routed])  # [t', moe_layers, top_k]
    if "expert_ids" not in b:
        n, seq_len = b["tokens"].shape
        b["expert_ids"] = np.full((block.shape[1], n, seq_len, block.shape[2]), -1, np.int32)
    b["expert_ids"][:, row, [at + j - lo for j in routed]] = block.transpose(1, 0, 2)


def _check_fits(g: ContextWindow, seq_len: int):
    if len(g) > seq_len:
        raise ValueError(f"a generation of {len(g)} tokens exceeds seq_len {seq_len}: keep "
                         "rl.context_budget <= data.seq_len")


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
    b = _empty_batch(n, seq_len)
    for i, (g, adv) in enumerate(gens):
        _check_fits(g, seq_len)
        _write(b, i, 0, g, 0, len(g), 1, 0)
        b["advantages"][i] = adv
    return b


def shared_prefix_len(windows: Sequence[ContextWindow], match_routing: bool = False) -> int:
    """How many leading tokens `windows` truly share: the longest prefix of equal token ids that
    no window's policy sampled (a sampled token carries its own loss, behaviour logprob and
    version) and, with `match_routing` (router replay), equal engine expert ids (the prompt's
    routing replayed once must be every rollout's). 0 for fewer than two windows."""
    if len(windows) < 2:
        return 0
    n = min(len(w) for w in windows)
    first = windows[0]
    for j in range(n):
        if any(w.policy[j] for w in windows) or any(w.tokens[j] != first.tokens[j] for w in windows[1:]):
            return j
        if match_routing:
            ids = [w.expert_ids[j] for w in windows]
            if any(e is None for e in ids) != all(e is None for e in ids):
                return j
            if ids[0] is not None and any(not np.array_equal(e, ids[0]) for e in ids[1:]):
                return j
    return n


def shared_prefix_rows(groups: Sequence[Sequence[Rollout]], seq_len: int,
                       match_routing: bool = False) -> list[list[tuple]]:
    """The rows of a shared-prefix batch: each a list of pieces `(window, lo, hi, advantage,
    role)`, tokens [lo, hi) of the window; role "prompt" (a group's shared prompt), "cont" (a
    continuation of the prompt piece before it in the row) or "own" (a window on its own).

    Per group, the first context window of each valid rollout shares its leading
    `shared_prefix_len` = L tokens with the others: one prompt piece holds tokens [0, L-1) and
    each rollout's continuation [L-1, len): it starts with the last shared token, whose logits
    predict the rollout's first own token, so the loss's next-token rule (same segment as the
    previous token) needs no change. Later windows of a chain (a self-summary starts each with
    its own text) and groups sharing fewer than 2 tokens are pieces of their own. A group whose
    continuations do not fit one row repeats the prompt piece in as many rows as they fill.
    Chunks are placed first-fit, largest first (several groups and windows per row).
    """
    chunks = []  # (length, [pieces])
    for group in groups:
        valid = [r for r in group if not r.infra_error]
        firsts = [r for r in valid if r.generations]
        for r in valid:
            for g in r.generations:
                _check_fits(g, seq_len)
        shared = shared_prefix_len([r.generations[0] for r in firsts], match_routing) - 1
        for r in valid:
            rest = r.generations[1:] if shared >= 1 else r.generations
            chunks += [(len(g), [(g, 0, len(g), r.advantage, "own")]) for g in rest]
        if shared < 1:
            continue
        prompt = (firsts[0].generations[0], 0, shared, 0.0, "prompt")
        chunk, used = [prompt], shared
        for r in firsts:
            g = r.generations[0]
            if used + len(g) - shared > seq_len:
                chunks.append((used, chunk))
                chunk, used = [prompt], shared
            chunk.append((g, shared, len(g), r.advantage, "cont"))
            used += len(g) - shared
        chunks.append((used, chunk))
    rows, free = [], []
    for length, pieces in sorted(chunks, key=lambda c: -c[0]):
        i = next((i for i, f in enumerate(free) if f >= length), None)
        if i is None:
            rows.append([])
            free.append(seq_len)
            i = len(rows) - 1
        rows[i] += pieces
        free[i] -= length
    return rows


def to_shared_batch(plan: list[list[tuple]], seq_len: int, rows: int | None = None) -> dict:
    """The GRPO batch of `shared_prefix_rows`' plan (grpo.shared_prefix_len): `to_batch`'s keys, with
    per-token `advantages` `[R, seq_len]` (a row holds several rollouts) and `prefix_segment` int32
    `[R, seq_len]`: on a continuation's tokens the segment id of its row's prompt piece, 0
    elsewhere (coder.model.attention_kernels.attention_mask). A continuation's positions go on
    from its prompt's, so every token sees the keys and positions of its unshared row.
    `rows` pads R up to a fixed count (padding rows are all zero: no loss)."""
    n = len(plan) if rows is None else rows
    if len(plan) > n:
        raise ValueError(f"{len(plan)} shared-prefix rows do not fit in {n} rows")
    b = _empty_batch(n, seq_len, per_token_advantages=True)
    b["prefix_segment"] = np.zeros((n, seq_len), np.int32)
    for i, pieces in enumerate(plan):
        total = sum(hi - lo for _, lo, hi, _, _ in pieces)
        if total > seq_len:
            raise ValueError(f"a shared-prefix row of {total} tokens exceeds seq_len {seq_len}")
        at, prompt_segment = 0, 0
        for segment, (g, lo, hi, adv, role) in enumerate(pieces, start=1):
            _write(b, i, at, g, lo, hi, segment, lo if role == "cont" else 0)
            b["advantages"][i, at:at + hi - lo] = adv
            if role == "prompt":
                prompt_segment = segment
            elif role == "cont":
                b["prefix_segment"][i, at:at + hi - lo] = prompt_segment
            at += hi - lo
    return b
