"""The agent loop: engine <-> env, token in / token out, self-summarization chains.

One *rollout* is a chain of *generations* (context windows). A generation starts as

    system turn (tool schemas, coder.env.protocol) + user turn (task prompt) + `<|assistant|>`

and grows turn by turn: the engine samples an assistant turn until `<|end|>` (or eos); its
calls are parsed by `coder.env.protocol` and run in the env; the tool message
`<|tool|><tool_result>..</tool_result>..<|end|>` and the next `<|assistant|>` are appended
(`engine.append`, no re-prefill). Every token is marked policy (sampled: loss, behaviour logprob,
policy version, expert ids) or not (prompt, tool output, template). The ids the engine sampled
are the ids trained on: generated text is decoded only to *parse* calls, never re-encoded.

**Self-summarization.** Before a turn, if the generation has fewer than `rl.summary_reserve`
tokens left of `rl.context_budget`, the loop appends a user turn asking for
`<summary>...</summary>` and samples it (policy tokens of this generation). The next generation
starts from system + task + a user turn "Summary of your progress so far:" + the summary's
*sampled ids* — nothing else of the old context. The rollout's reward later applies to the
policy tokens of every generation of the chain.

The rollout ends on `submit` (or any turn the env says is final), a turn with no tool call (the
agent's final answer), `rl.max_turns`, `rl.max_rollout_tokens` policy tokens, or a context still
full after `rl.max_summaries` summaries. The env then scores the workspace.

Episode interface the loop drives (one episode per rollout; `SandboxEpisode` below implements
it on coder.env's sandbox, tools and test reward):
    `tools`            the `protocol.ToolSpec` list (rendered into the system prompt),
    `step(call) -> str` run one parsed `protocol.ToolCall`, return its output text; a `submit`
                       call sets `done`,
    `score() -> (test_reward in [0, 1], info)`, `close()`,
and `InfraError` (or coder.env.sandbox.SandboxError) raised by any of them when the sandbox or the
harness failed, not the agent: the rollout is marked `infra_error` and masked out of its group.

Outputs convert to GRPO batches (`to_batch`): one generation per row.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence

import jax
import numpy as np

from coder.env import protocol
from coder.env.sandbox import SandboxError


class InfraError(RuntimeError):
    """The environment failed (sandbox crash, harness timeout), not the agent."""


_INFRA = (InfraError, SandboxError)

SUMMARY_REQUEST = (
    "Your context is nearly full. Write a summary of your progress that lets you continue from "
    "it alone: what the task is, what you found, what you changed, what remains. Reply with "
    "only <summary>...</summary>."
)
SUMMARY_PREFIX = "Summary of your progress so far:\n"
EDIT_TOOLS = ("write_file", "edit_file")


@dataclasses.dataclass
class Generation:
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
        """Appends an engine `Generation` (tokens, logprobs, expert_ids, policy_version)."""
        n = len(gen.tokens)
        self.tokens += [int(i) for i in gen.tokens]
        self.policy += [True] * n
        self.behaviour_logp += [float(x) for x in np.asarray(gen.logprobs).reshape(-1)[:n]]
        versions = np.broadcast_to(np.asarray(gen.policy_version), (n,))
        self.policy_version += [int(v) for v in versions]
        experts = getattr(gen, "expert_ids", None)
        self.expert_ids += [None] * n if experts is None else [np.asarray(e) for e in experts]

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
    final_text: str = ""
    lint_before: int | None = None
    lint_after: int | None = None
    reward: float = 0.0
    advantage: float = 0.0

    def usage(self) -> np.ndarray:
        """`[5]` in coder.rl.reward.USAGE_KEYS order."""
        return np.array([self.thinking_tokens, self.tool_io_tokens, self.output_tokens,
                         self.tool_calls, self.turns], np.float64)

    @property
    def policy_tokens(self) -> int:
        return sum(g.num_policy for g in self.generations)


@dataclasses.dataclass
class _Row:
    """Loop state of one rollout."""

    rollout: Rollout
    episode: object
    group: object  # engine group holding this row's KV cache
    index: int  # row inside that group
    turn_start: int = 0  # index in the current generation where the turn's sampled ids start
    summarizing: bool = False
    done: bool = False

    @property
    def gen(self) -> Generation:
        return self.rollout.generations[-1]


class Agent:
    """Runs groups of rollouts with an engine, a tokenizer and env episodes.

    Args:
      engine: coder.infer.engine.Engine (`start_group`, `generate`, `append`).
      tokenizer: coder.data.tokenizer.Tokenizer.
      cfg: `config.rl`.
      sampling_params: builds the engine's SamplingParams: `fn(max_new_tokens, stop_ids)`.
    """

    def __init__(self, engine, tokenizer, cfg, sampling_params: Callable):
        self.engine, self.tok, self.cfg = engine, tokenizer, cfg
        self.sampling_params = sampling_params
        self.stop_ids = (tokenizer.end_id, tokenizer.eos_id)
        self.call_open = tokenizer.special_id("<tool_call>")
        self.call_close = tokenizer.special_id("</tool_call>")
        self.summary_open = tokenizer.special_id("<summary>")
        self.summary_close = tokenizer.special_id("</summary>")
        self.result_open = tokenizer.special_id(protocol.RESULT_OPEN)
        self.result_close = tokenizer.special_id(protocol.RESULT_CLOSE)

    # --- prompts ---------------------------------------------------------------------------
    def head_ids(self, tools, task_prompt: str) -> list[int]:
        """System turn (tool schemas) + user turn (task): the start of every generation."""
        preamble = self.cfg.get("system_prompt") or None
        system = self.tok.turn_ids("system", protocol.render_system_prompt(list(tools), preamble))
        return system + self.tok.turn_ids("user", task_prompt)

    def chain_context(self, head: Sequence[int], summary_ids: Sequence[int]) -> list[int]:
        """The next generation's prompt: system + task + summary (sampled ids) + `<|assistant|>`."""
        user = [self.tok.special_id("user")] + self.tok.encode(SUMMARY_PREFIX)
        return list(head) + user + list(summary_ids) + [self.tok.end_id] + self.tok.generation_prefix()

    # --- the loop --------------------------------------------------------------------------
    def run_group(self, task_id: str, task_prompt: str, episodes: list, rng) -> list[Rollout]:
        """G rollouts of one task (G = len(episodes)), sharing one prefilled prompt.

        `episodes` are fresh env episodes of the task, one per rollout; they are closed here.
        """
        tools = episodes[0].tools
        head = self.head_ids(tools, task_prompt)
        prompt = head + self.tok.generation_prefix()
        if len(prompt) + self.cfg.summary_reserve >= self.cfg.context_budget:
            raise ValueError(
                f"task {task_id}: system prompt + task take {len(prompt)} tokens, leaving no room "
                f"in rl.context_budget={self.cfg.context_budget} beyond rl.summary_reserve="
                f"{self.cfg.summary_reserve}: raise the budget or offer fewer rl.tools")
        group = self.engine.start_group(prompt, len(episodes))
        rows = []
        for i, ep in enumerate(episodes):
            r = Rollout(task_id=task_id, generations=[Generation()])
            r.generations[0].add_context(prompt)
            rows.append(_Row(r, ep, group, i, turn_start=len(prompt)))
        calls = 0
        try:
            self._lint(rows, "lint_before")
            while True:
                for row in rows:
                    if not row.done:
                        self._before_turn(row, head)
                active = [row for row in rows if not row.done]
                if not active:
                    break
                by_group: dict[int, list[_Row]] = {}
                for row in active:
                    by_group.setdefault(id(row.group), []).append(row)
                for grp_rows in by_group.values():
                    max_new = min(self._room(row) for row in grp_rows)
                    params = self.sampling_params(max_new, self.stop_ids)
                    outs = self.engine.generate(grp_rows[0].group, params, jax.random.fold_in(rng, calls),
                                                rows=[row.index for row in grp_rows])
                    calls += 1
                    for row, out in zip(grp_rows, outs):
                        row.gen.add_sampled(out)
                        self._after_sample(row, out, head, tools)
            self._lint(rows, "lint_after")
            for row in rows:
                self._capture_routing(row)
                self._score(row)
        finally:
            for row in rows:
                row.episode.close()
        return [row.rollout for row in rows]

    def _lint(self, rows, attr: str) -> None:
        """Lint diagnostics of each workspace, when the lint_introduced reward is on."""
        if not float(self.cfg.aux_rewards.get("lint_introduced", 0.0)):
            return
        for row in rows:
            if not row.rollout.infra_error and hasattr(row.episode, "lint_count"):
                try:
                    setattr(row.rollout, attr, row.episode.lint_count())
                except _INFRA as e:
                    row.rollout.infra_error = f"{type(e).__name__}: {e}"

    def _room(self, row: _Row) -> int:
        """Tokens the row may sample in this call (>= 1 after `_before_turn`)."""
        c, r = self.cfg, row.rollout
        turn_len = len(row.gen) - row.turn_start
        room = [c.context_budget - len(row.gen), c.max_rollout_tokens - r.policy_tokens]
        if not row.summarizing:
            room += [c.max_turn_tokens - turn_len, c.context_budget - c.summary_reserve - len(row.gen)]
        return max(1, min(room))

    def _before_turn(self, row: _Row, head) -> None:
        """Ends the rollout on a budget, or switches to a summary when the context is full."""
        c, r = self.cfg, row.rollout
        if r.policy_tokens >= c.max_rollout_tokens:
            return self._end(row, "tokens")
        if row.summarizing:
            if len(row.gen) >= c.context_budget:  # no room left even for the summary
                return self._end(row, "context")
            return
        if c.context_budget - c.summary_reserve - len(row.gen) > 0:
            return  # room for a new turn, or for more of a turn in progress
        if r.summaries >= c.max_summaries:
            return self._end(row, "context")
        request = self.tok.turn_ids("user", SUMMARY_REQUEST) + self.tok.generation_prefix()
        if len(row.gen) > row.turn_start:  # close the cut-off turn before the request
            request = [self.tok.end_id] + request
        if len(row.gen) + len(request) >= c.context_budget:  # rl.summary_reserve is too small
            return self._end(row, "context")
        self._append(row, request)
        row.summarizing = True

    def _append(self, row: _Row, ids: list[int]) -> None:
        self.engine.append(row.group, row.index, ids)
        row.gen.add_context(ids)
        row.turn_start = len(row.gen)

    def _after_sample(self, row: _Row, out, head, tools) -> None:
        r, c = row.rollout, self.cfg
        sampled = row.gen.tokens[row.turn_start:]
        ended = out.finish_reason == "stop" or (sampled and sampled[-1] in self.stop_ids)
        turn_full = len(sampled) >= c.max_turn_tokens and not row.summarizing
        if not out.tokens and not ended:  # the engine has no room left for this row
            return self._end(row, "context")
        if not ended and not turn_full:
            return  # keep sampling this turn next round (or summarize if the context is full)
        body = sampled[:-1] if ended else sampled
        if row.summarizing:
            r.summaries += 1
            r.output_tokens += len(sampled)
            r.turns += 1
            self._start_next_generation(row, head, self._summary_ids(body))
            return
        r.turns += 1
        text = self._decode(body)
        calls = protocol.parse_tool_calls(text, tools)
        if not ended:  # cut at max_turn_tokens: close the turn for the template
            self._append_context_only(row, [self.tok.end_id])
        if not calls:
            r.output_tokens += len(sampled)
            r.final_text = text
            return self._end(row, "answer")
        in_calls = self._tokens_in_calls(body)
        r.tool_io_tokens += in_calls
        r.thinking_tokens += len(sampled) - in_calls
        outputs = []
        for call in calls:
            if isinstance(call, protocol.BrokenToolCall):
                r.broken_calls += 1
                outputs.append(f"error: broken tool call: {call.reason}")
                continue
            r.tool_calls += 1
            r.edits += call.name in EDIT_TOOLS
            try:
                outputs.append(row.episode.step(call))
            except _INFRA as e:
                r.infra_error = f"{type(e).__name__}: {e}"
                return self._end(row, "infra")
            if getattr(row.episode, "done", False):
                break
        if getattr(row.episode, "done", False):
            return self._end(row, "submit")
        if r.turns >= c.max_turns:
            return self._end(row, "turns")
        obs = self._fit_observation(row, self.tool_message_ids(outputs))
        r.tool_io_tokens += len(obs)
        self._observe(row, obs)

    def tool_message_ids(self, outputs: Sequence[str]) -> list[int]:
        """`<|tool|>` + one `<tool_result>...</tool_result>` per output + `<|end|>`: the ids of
        `protocol.render_tool_results`, with the outputs encoded as plain text so a file holding
        "<|end|>" cannot forge a control token."""
        ids = [self.tok.special_id("tool")]
        for o in outputs:
            ids += [self.result_open] + self.tok.encode(o, allow_special=False) + [self.result_close]
        return ids + [self.tok.end_id]

    def _fit_observation(self, row: _Row, ids: list[int]) -> list[int]:
        """The tool message's ids, cut so the generation keeps its summary reserve.

        A cut message keeps its head and says so; whatever does not fit is for the summary to
        recover (the agent can re-run the tool in the next generation).
        """
        c = self.cfg
        room = c.context_budget - c.summary_reserve - len(row.gen) - len(self.tok.generation_prefix())
        if len(ids) <= room:
            return ids
        note = self.tok.encode(f"\n[... tool output cut: {len(ids) - 2} tokens did not fit the context ...]")
        keep = max(0, room - len(note) - 2)
        return ids[:1 + keep] + note + [self.tok.end_id]

    def _observe(self, row: _Row, obs: list[int]) -> None:
        """Appends the tool message and the next `<|assistant|>`, or ends the rollout when even
        the cut message does not fit the context (rl.summary_reserve smaller than the note)."""
        ids = obs + self.tok.generation_prefix()
        if len(row.gen) + len(ids) >= self.cfg.context_budget:
            return self._end(row, "context")
        self._append(row, ids)

    def _append_context_only(self, row: _Row, ids: list[int]) -> None:
        row.gen.add_context(ids)  # the engine sees it with the next append (or never, at the end)
        self.engine.append(row.group, row.index, ids)

    def _decode(self, ids: Sequence[int]) -> str:
        """Text of sampled ids, for parsing only. Ids past the tokenizer's vocabulary (the
        model's embedding is padded to a multiple of 128) have no text and are skipped."""
        return self.tok.decode([i for i in ids if i < self.tok.vocab_size])

    def _tokens_in_calls(self, ids: Sequence[int]) -> int:
        """Sampled tokens inside `<tool_call>...</tool_call>` spans, tags included."""
        n, inside = 0, False
        for t in ids:
            if t == self.call_open:
                inside = True
            n += inside
            if t == self.call_close:
                inside = False
        return n

    def _summary_ids(self, body: Sequence[int]) -> list[int]:
        """The sampled `<summary>...</summary>` span (the whole reply if the tags are missing)."""
        body = list(body)
        start = body.index(self.summary_open) if self.summary_open in body else 0
        end = body.index(self.summary_close, start) + 1 if self.summary_close in body[start:] else len(body)
        return body[start:end]

    def _capture_routing(self, row: _Row) -> None:
        """Routing of the generation's prompt and observation tokens from the engine's cache.

        Sampled tokens already carry theirs; tokens appended but never fed (the last `<|end|>`
        of a generation) have none: they predict nothing, so router replay does not need them.
        """
        fn = getattr(row.group, "expert_ids", None)
        if fn is None:
            return
        ids = np.asarray(fn(row.index))
        gen = row.gen
        for j in range(min(len(ids), len(gen))):
            if gen.expert_ids[j] is None:
                gen.expert_ids[j] = ids[j]

    def _start_next_generation(self, row: _Row, head, summary_ids) -> None:
        self._capture_routing(row)
        ctx = self.chain_context(head, summary_ids)
        gen = Generation()
        gen.add_context(ctx)
        row.rollout.generations.append(gen)
        row.group, row.index = self.engine.start_group(ctx, 1), 0
        row.turn_start = len(ctx)
        row.summarizing = False
        if row.rollout.turns >= self.cfg.max_turns:
            self._end(row, "turns")

    def _end(self, row: _Row, finish: str) -> None:
        row.done = True
        row.rollout.finish = row.rollout.finish or finish

    def _score(self, row: _Row) -> None:
        """Scores the workspace (unless the infrastructure failed); applies the broken-call rule."""
        from coder.rl import reward as reward_lib

        r = row.rollout
        if not r.infra_error:
            try:
                r.test_reward, info = row.episode.score()
                if info.get("infra_error"):
                    r.infra_error = str(info["infra_error"])
            except _INFRA as e:
                r.infra_error = f"{type(e).__name__}: {e}"
        if r.infra_error:
            r.finish = "infra"
            r.test_reward = 0.0
        r.outcome, r.correct = reward_lib.outcome(r.test_reward, r.broken_calls)


class SandboxEpisode:
    """The episode interface on coder.env: a bwrap `Sandbox` of the task, its tools, its reward.

    A sandbox that fails to start does not raise here: the episode records it and every later
    call raises `InfraError`, so the rollout is masked, never scored as the agent's failure.
    """

    def __init__(self, task, *, tools: Sequence[str] = (), tool_timeout_s: float = 20.0,
                 reward_mode: str = "fraction", score_timeout_s: float = 120.0, limits=None):
        from coder.env import tools as env_tools
        from coder.env.sandbox import Sandbox

        self.task, self.done = task, False
        unknown = set(tools) - {t.name for t in env_tools.SPECS}
        if unknown:
            raise ValueError(f"rl.tools: unknown {sorted(unknown)}; env tools are "
                             f"{[t.name for t in env_tools.SPECS]}")
        self.tools = [t for t in env_tools.SPECS if not tools or t.name in tools]
        self.reward_mode, self.score_timeout_s = reward_mode, score_timeout_s
        self._tools = env_tools
        self.sandbox, self.error = None, ""
        try:
            self.sandbox = Sandbox(task, limits=limits)
        except (SandboxError, OSError) as e:
            self.error = f"sandbox failed to start: {e}"
            return
        self.ctx = env_tools.ToolContext(self.sandbox, task, command_timeout_s=tool_timeout_s)

    def _check(self) -> None:
        if self.sandbox is None:
            raise InfraError(self.error)

    def step(self, call) -> str:
        self._check()
        out = self._tools.call(self.ctx, call.name, call.arguments)
        if call.name == self._tools.SUBMIT:
            self.done = True
        return out

    def lint_count(self) -> int:
        """ruff diagnostics in the workspace (lines `path:line:col: CODE message`)."""
        self._check()
        out = self._tools.lint(self.ctx, {})
        return sum(1 for line in out.splitlines() if _DIAGNOSTIC.match(line))

    def score(self) -> tuple[float, dict]:
        from coder.env import reward as env_reward

        self._check()
        s = env_reward.score(self.sandbox, self.task, mode=self.reward_mode, timeout_s=self.score_timeout_s)
        return s.reward, {"infra_error": s.infra_error, "passed": s.passed, "total": s.total, "error": s.error}

    def close(self) -> None:
        if self.sandbox is not None:
            self.sandbox.close()


_DIAGNOSTIC = re.compile(r"^\S+:\d+:\d+: ")


def to_batch(rollouts: Sequence[Rollout], seq_len: int, rows: int | None = None) -> dict:
    """GRPO batch of docs/contracts.md, one generation per row.

    Infra-failed rollouts are skipped (masked out of their group already). Every generation of a
    chain carries its rollout's advantage. Returns numpy arrays:
      tokens, positions, segment_ids int32 `[R, seq_len]`; loss_mask, behaviour_logp float32
      `[R, seq_len]`; policy_version int32 `[R, seq_len]` (-1 off policy tokens); advantages
      float32 `[R]`; expert_ids int32 `[moe_layers, R, seq_len, top_k]` (-1 where the engine
      did not route the token, i.e. prompt and observations) when the engine reported them.
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
        for j, e in enumerate(g.expert_ids):
            if e is None:
                continue
            if experts is None:
                experts = np.full((e.shape[0], n, seq_len, e.shape[1]), -1, np.int32)
            experts[:, i, j] = e
    if experts is not None:
        b["expert_ids"] = experts
    return b
