"""One agent rollout in one sandbox.

Text interface (scripted agents, SFT transcripts, tests):
    obs = ep.reset(task)                       # the user prompt
    obs, done, info = ep.step(model_text)      # one assistant reply: all its calls, in order
Per-call interface (coder/rl/agent.py, which parses calls from sampled token ids itself):
    ep.reset(task); out = ep.call(tool_call)   # one parsed protocol.ToolCall -> output text
    outs = ep.call_many(tool_calls)            # one turn's calls: independent ones concurrently
    ep.done; n = ep.lint_count(); reward, info = ep.score(); ep.close()
Scoring with a verdict shared between identical workspaces (coder/env/scoring/verdicts.py, the pool):
    d = ep.scoring_digest(); reward, info = ep.score(verdict); ep.verdict  # the test run's Score
(`step` also accepts a `protocol.ToolCall` and then behaves as `call`.)

`tools` names the tools offered (`()`: all of coder.env.tools.registry; an unknown name is a ValueError);
`tool_timeout_s` caps one tool command (default: the limits' `timeout_s`). `memory` (a
coder.env.tools.memory.Memory, or None: the memory tools say memory is off) is the run's notes store;
each `reset` scopes it to the task's (split, repository). `semantic` (a
coder.env.tools.semantic_search.SemanticSpec, or None: semantic_search says it is off) names the
encoder and the embedding cache of `semantic_search`. RL builds every
episode with `Episode.from_config(config.env, ...)` (coder/rl/actor.py), so `config.env` sets
the sandbox limits of training and eval rollouts alike.

The conversation is system prompt (tools and call format), user (the task's prompt), then
alternating assistant turns (model text with protocol tool calls) and tool messages (the
calls' results, `protocol.render_tool_results`). `messages` holds it in the SFT format of
docs/contracts.md; `coder.env.transcripts` builds SFT data by driving this same class.

In the text interface an episode ends on `submit`, on a reply with no tool call, after
`max_turns` replies, or when the tool outputs reach `max_tool_output_tokens`; it is then scored
(`coder.env.scoring.score`) and its sandbox closed. Any broken tool call makes the rollout a failure
(reward 0) even if the tests pass: broken calls are negative examples (docs/contracts.md, "Tool calls"; docs/rl.md).

The calls of one reply run concurrently where they are independent (`call_many`): calls that
change the workspace (`tools.EXCLUSIVE`: write_file, edit_file, shell) each run alone, after
every call before them and before every call after them; the calls between two of them
(reads, grep, lint, diagnostics, tests, think) run at once, except that a host-side file tool
never runs beside the agent's tests or diagnostics (`tools.may_overlap`: agent code, such as a
mypy plugin the repository configures, could race its path checks).
Outputs come back in call order, so a turn means what it would mean run one call after
another. `shell` runs in the episode's `Terminal` (coder.env.runtime.terminal), one session from reset
to close; scoring closes it first, so nothing the agent left running can touch the workspace
while it is scored.

`info`: turns, tool_calls, broken_calls, tool_output_chars, tool_output_tokens, done_reason,
and once scored: reward, passed, total, score_error, infra_error. `infra_error` is set when the
harness failed (sandbox would not start, a tool or the scorer crashed): the RL loop masks such a
rollout instead of scoring it. In the per-call interface these failures raise `InfraError`.

Token counts: `token_count` is required, because a character-based guess would silently skew
the length penalty; pass the tokenizer's `lambda s: len(tok.encode(s))` (tests pass `len`).
"""

from __future__ import annotations

import re
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

from coder.env import protocol
from coder.env.scoring import score as reward
from coder.env.tools import registry as tools
from coder.env.tools.memory import Memory, Scope
from coder.env.runtime.prepared import prepared
from coder.env.runtime.sandbox import InfraError, Limits, Sandbox, SandboxError, Snapshot
from coder.env.tools.semantic_search import SemanticSpec
from coder.env.runtime.terminal import Terminal

_DIAGNOSTIC = re.compile(r"^\S+:\d+:\d+: ")  # ruff concise output: path:line:col: CODE message
_MAX_CONCURRENT_CALLS = 8  # each may be a bwrap process tree of the sandbox's uid (its nproc)


def select_tools(names: Sequence[str] = ()) -> list[protocol.ToolSpec]:
    """The env tools named (`()`: all), in prompt order; an unknown name is a ValueError."""
    known = [t.name for t in tools.SPECS]
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise ValueError(f"unknown tools {unknown}; env tools are {known}")
    return [t for t in tools.SPECS if not names or t.name in names]


class Episode:
    def __init__(
        self,
        token_count: Callable[[str], int],
        *,
        limits: Limits | None = None,
        max_turns: int = 30,
        max_tool_output_tokens: int = 32768,
        max_output_chars: int = 8000,
        reward_mode: str = "fraction",
        test_timeout_s: float = 300.0,
        sandbox_root: str | None = None,
        system_preamble: str | None = None,
        tools: Sequence[str] = (),
        tool_timeout_s: float | None = None,
        memory: Memory | None = None,
        semantic: SemanticSpec | None = None,
    ):
        if not callable(token_count):
            raise TypeError("token_count must be a function str -> int (the tokenizer's count)")
        self.token_count = token_count
        self.limits = limits or Limits()
        self.max_turns = max_turns
        self.max_tool_output_tokens = max_tool_output_tokens
        self.max_output_chars = max_output_chars
        self.reward_mode = reward_mode
        self.test_timeout_s = test_timeout_s
        self.sandbox_root = sandbox_root
        self.tool_timeout_s = float(tool_timeout_s or self.limits.timeout_s)
        self.memory = memory  # the run's notes; each reset scopes them to the task (memory.py)
        self.memory_scope: Scope | None = None
        self.semantic = semantic  # semantic_search's encoder and cache (None: the tool is off)
        self.tools = select_tools(tools)  # protocol.ToolSpec list, in prompt order
        self._tool_map = {t.name: t for t in self.tools}
        self.system_prompt = protocol.render_system_prompt(self.tools, system_preamble)
        self.sandbox: Sandbox | None = None
        self.terminal: Terminal | None = None  # the shell tool's session, from reset to close
        self.task = None
        self.done = True
        self.scored = False
        self.verdict: reward.Score | None = None  # the hidden tests' verdict, once scored
        self.messages: list[dict] = []
        self.info: dict = {}

    @classmethod
    def from_config(
        cls, env_cfg, token_count: Callable[[str], int], max_turns: int = 30, **kw
    ) -> "Episode":
        """An episode with the limits and reward settings of `config.env`."""
        return cls(**cls.config_kwargs(env_cfg, token_count, max_turns, **kw))

    @staticmethod
    def config_kwargs(
        env_cfg, token_count: Callable[[str], int], max_turns: int = 30, **kw
    ) -> dict:
        """`from_config`'s constructor arguments (picklable: env workers build the same episode)."""
        select_tools(kw.get("tools", ()))  # an unknown name fails here, not in a worker
        return dict(
            token_count=token_count,
            limits=Limits.from_config(env_cfg),
            max_turns=max_turns,
            max_tool_output_tokens=int(env_cfg.max_tool_output_tokens),
            max_output_chars=int(env_cfg.max_output_chars),
            reward_mode=str(env_cfg.reward_mode),
            test_timeout_s=float(env_cfg.test_timeout_s),
            **kw,
        )

    # ---- lifecycle -------------------------------------------------------------------------
    def reset(self, task, snapshot: Snapshot | None = None) -> str:
        """Start `task` (from `snapshot` of its workspace if given); returns the user prompt."""
        self.close()
        self.task = task
        self.memory_scope = self.memory.scope(task) if self.memory is not None else None
        self.done, self.scored, self.verdict = False, False, None
        self.messages = [
            {"role": "system", "content": self.system_prompt},
            {"role": "user", "content": task.prompt},
        ]
        self.info = dict(
            turns=0,
            tool_calls=0,
            broken_calls=0,
            tool_output_chars=0,
            tool_output_tokens=0,
            done_reason=None,
            reward=None,
            passed=None,
            total=None,
            score_error=None,
            infra_error=None,
            # the prompt leaves out what the tests check (the `ask_user` tool answers it)
            clarification_needed=bool((getattr(task, "metadata", None) or {}).get("underspecified")),
        )
        try:
            # Every rollout of a task forks one prepared tree (coder.env.runtime.prepared).
            base = None if snapshot else prepared(self.sandbox_root, self.limits).get(task)
            self.sandbox = Sandbox(
                task, limits=self.limits, root=self.sandbox_root, snapshot=snapshot, base=base
            )
            self.terminal = Terminal(self.sandbox, self.tool_timeout_s)  # its shell starts lazily
        except (InfraError, OSError) as e:
            self._fail_infra(f"sandbox could not start: {e}")
        return task.prompt

    def close(self) -> None:
        self._close_terminal()
        if self.sandbox is not None:
            self.sandbox.close()
            self.sandbox = None

    def _close_terminal(self) -> None:
        if self.terminal is not None:
            self.terminal.close()
            self.terminal = None

    def _fail_infra(self, msg: str) -> None:
        self.info.update(infra_error=msg, done_reason="infra_error", reward=None)
        self.done = self.scored = True
        self.close()

    # ---- one call --------------------------------------------------------------------------
    def call(self, c: protocol.ToolCall) -> str:
        """Run one parsed, validated call; `submit` ends the episode. Raises InfraError when
        the harness fails (the episode is then over and `info["infra_error"]` says why)."""
        return self.call_many([c])[0]

    def call_many(self, calls: Sequence[protocol.ToolCall]) -> list[str]:
        """Run the parsed calls of one turn, independent ones concurrently (module docstring);
        their outputs in call order. The calls after a `submit` are not run: the outputs end
        with submit's. Raises InfraError as `call` does."""
        if self.info.get("infra_error"):
            raise InfraError(self.info["infra_error"])
        if self.done:
            raise RuntimeError("call() after the episode ended; call reset()")
        calls = list(calls)
        for i, c in enumerate(calls):
            if c.name not in self._tool_map:
                raise ValueError(f"tool {c.name!r} is not offered in this episode")
            if c.name == tools.SUBMIT:
                del calls[i + 1 :]
                break
        self.info["tool_calls"] += len(calls)
        work = [c for c in calls if c.name != tools.SUBMIT]
        outputs = []
        for phase in _phases(work):
            results = self._run_concurrently(phase)
            for ok, value in results:
                if not ok:
                    self._fail_infra(value)
                    raise InfraError(self.info["infra_error"])
                outputs.append(value)
        if len(work) < len(calls):
            self.done = True
            self.info["done_reason"] = "submit"
            outputs.append("submitted")
        return outputs

    def _run_concurrently(self, calls: list) -> list[tuple[bool, str]]:
        """(True, output) or (False, why the harness failed) per call, in order."""
        ctx = self._context()
        if len(calls) == 1:
            return [_run_tool(ctx, calls[0])]
        with ThreadPoolExecutor(min(len(calls), _MAX_CONCURRENT_CALLS)) as pool:
            return list(pool.map(lambda c: _run_tool(ctx, c), calls))

    def _context(self) -> tools.ToolContext:
        return tools.ToolContext(
            self.sandbox, self.task, self.max_output_chars, self.tool_timeout_s, self.terminal,
            self.memory_scope, self.semantic,
        )

    def lint_count(self) -> int:
        """ruff diagnostics in the workspace (the lint tool's `path:line:col: CODE message`
        lines). Raises InfraError when the harness fails."""
        if self.info.get("infra_error"):
            raise InfraError(self.info["infra_error"])
        if self.sandbox is None:
            raise RuntimeError("lint_count() without a workspace; call reset()")
        try:
            out = tools.lint(self._context(), {})
        except SandboxError as e:
            self._fail_infra(f"sandbox failed during lint: {e}")
            raise InfraError(self.info["infra_error"]) from e
        return sum(1 for line in out.splitlines() if _DIAGNOSTIC.match(line))

    # ---- one assistant reply ---------------------------------------------------------------
    def step(self, model_text) -> tuple[str, bool, dict]:
        """Run the tool calls of one assistant reply; see the module docstring."""
        if isinstance(model_text, protocol.ToolCall):
            return self.call(model_text)
        if self.info.get("infra_error"):
            return "", True, dict(self.info)
        if self.done:
            raise RuntimeError("step() after the episode ended; call reset()")
        info = self.info
        info["turns"] += 1
        self.messages.append({"role": "assistant", "content": model_text})
        calls = protocol.parse_tool_calls(model_text, self.tools)
        ends = [i for i, c in enumerate(calls) if getattr(c, "name", None) == tools.SUBMIT]
        turn = calls[: ends[0] + 1] if ends else calls  # calls after submit are not run
        good = [c for c in turn if not isinstance(c, protocol.BrokenToolCall)]
        info["broken_calls"] += len(turn) - len(good)
        try:
            done_outputs = iter(self.call_many(good) if good else [])
        except InfraError:
            return "", True, dict(self.info)
        outputs = [
            f"error: broken tool call: {c.reason}"
            if isinstance(c, protocol.BrokenToolCall)
            else next(done_outputs)
            for c in turn
        ]
        left = len(calls) - len(turn)
        if left:  # the agent is told
            outputs[-1] += f"; the {left} call(s) after submit were not run"
        observation = protocol.render_tool_results(outputs) if outputs else ""
        info["tool_output_chars"] += len(observation)
        info["tool_output_tokens"] += self.token_count(observation) if observation else 0
        if not self.done:
            if not calls:
                info["done_reason"] = "no_tool_call"
            elif info["turns"] >= self.max_turns:
                info["done_reason"] = "max_turns"
            elif info["tool_output_tokens"] >= self.max_tool_output_tokens:
                info["done_reason"] = "budget"
            else:
                self.messages.append({"role": "tool", "content": observation})
                return observation, False, dict(info)
            self.done = True
        self.score()
        return observation, True, dict(self.info)

    # ---- scoring ---------------------------------------------------------------------------
    def scoring_digest(self) -> str | None:
        """Ends the agent's part (its terminal closed), readies the workspace for scoring
        (`reward.prepare`) and returns `reward.scoring_digest` of it; None when the episode is
        already scored or the workspace cannot be read (scoring then reports what is wrong)."""
        if self.scored or self.sandbox is None:
            return None
        self._close_terminal()  # nothing the agent left running may touch the workspace
        try:
            reward.prepare(self.sandbox, self.task)
            return reward.scoring_digest(self.sandbox, self.task, self.reward_mode, self.test_timeout_s)
        except Exception:  # noqa: BLE001 - scored alone, where the error is reported
            return None

    def score(self, verdict: reward.Score | None = None) -> tuple[float, dict]:
        """Score the workspace once (later calls return the same); closes the sandbox.

        `verdict`: the tests' verdict on an identical workspace of the same task (equal
        `scoring_digest`), used instead of running them. Returns (reward, info); reward is 0.0
        with `info["infra_error"]` set when the harness failed. A text-interface episode with
        broken calls scores 0.
        """
        if not self.scored:
            self.scored = True
            self._close_terminal()  # nothing the agent left running may touch the workspace
            if verdict is not None:
                s = verdict
            else:
                try:
                    s = reward.score(
                        self.sandbox, self.task, mode=self.reward_mode, timeout_s=self.test_timeout_s
                    )
                except Exception:
                    s = reward.Score(
                        0.0, 0, 0, infra_error=f"scoring crashed:\n{traceback.format_exc(limit=5)}"
                    )
            self.verdict = s
            if s.infra_error:
                self._fail_infra(s.infra_error)
            else:
                broken = self.info["broken_calls"]
                r, _ = reward.outcome(s.reward, broken)  # the broken-call rule
                err = f"{broken} broken tool call(s)" if broken else s.error
                self.info.update(reward=r, passed=s.passed, total=s.total, score_error=err)
                self.close()
        return float(self.info["reward"] or 0.0), dict(self.info)


def _phases(calls: list) -> list[list]:
    """Consecutive calls grouped so that each group may run at once (`tools.may_overlap`): a
    call that changes the workspace is a group of its own."""
    phases: list[list] = []
    for c in calls:
        if phases and all(tools.may_overlap(c.name, x.name) for x in phases[-1]):
            phases[-1].append(c)
        else:
            phases.append([c])
    return phases


def _run_tool(ctx: tools.ToolContext, c: protocol.ToolCall) -> tuple[bool, str]:
    """(True, output), or (False, why) when the harness failed: a sandbox error, or a crash
    of the tool (a harness bug, not the agent's doing: masked, not scored)."""
    try:
        return True, tools.call(ctx, c.name, c.arguments)
    except SandboxError as e:
        return False, f"sandbox failed during {c.name}: {e}"
    except Exception:
        return False, f"tool {c.name} crashed:\n{traceback.format_exc(limit=5)}"
