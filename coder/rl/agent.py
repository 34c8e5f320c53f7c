"""The agent loop as a state machine: one `AgentRun` per rollout, token in / token out.

A rollout is a chain of generations (coder.rl.trajectory). A generation starts as

    system turn (tool schemas, coder.env.protocol) + user turn (task prompt) + `<|assistant|>`

and grows turn by turn: the engine samples an assistant turn until `<|end|>` (or eos); its
calls are parsed by `coder.env.protocol` and run in the rollout's env episode; the tool message
`<|tool|><tool_result>..</tool_result>..<|end|>` and the next `<|assistant|>` are appended (no
re-prefill). Every token is marked policy (sampled: loss, behaviour logprob, policy version,
expert ids) or not (prompt, tool output, template). The ids the engine sampled are the ids
trained on: generated text is decoded only to *parse* calls, never re-encoded.

**The machine.** An `AgentRun` is always in one state and exposes the action that state needs
(`next_action()`); the driver performs it and feeds the result back:

    state   action                                     driver answers with
    SAMPLE  Sample(new_context, append, max_new_tokens, on_sample(engine Generation, routing)
                   stop_ids, generation)
    TOOLS   RunTools(calls)                            on_tools(outputs, done, error)
    LINT    Lint(when="before" | "after")              on_lint(count, error)
    SCORE   ScoreWorkspace()                           on_score(test_reward, info, error)
    DONE    Done()                                     - (`run.rollout` is final)

The machine never touches an engine or a sandbox, so a test drives it with fake generations
and tool outputs. Two drivers live here: `Agent.run_group` (the G rows of one task decode
together, each row's tool calls run on the calling thread) and `drive` (one thread per
rollout, for coder.rl.actor's concurrent mode); `serve_env` answers the env actions of both.

**Self-summarization.** Before a turn, if the generation has fewer than `rl.summary_reserve`
tokens left of `rl.context_budget`, the run appends a user turn asking for
`<summary>...</summary>` and samples it (policy tokens of this generation). The next generation
starts from system + task + a user turn "Summary of your progress so far:" + the summary's
*sampled ids*, nothing else of the old context (`Sample.new_context`: the driver starts a new
engine row with it). The rollout's reward applies to the policy tokens of every generation.

The rollout ends on `submit`, a turn with no tool call (the agent's final answer),
`rl.max_turns`, `rl.max_rollout_tokens` policy tokens, or a context still full after
`rl.max_summaries` summaries; the episode then scores the workspace. Any failure of the episode
(a tool, lint or the scorer raising, or a score whose info has `infra_error`) is the
infrastructure's, not the agent's: the rollout gets `infra_error`, ends at once with finish
`infra`, and is masked out of its group. The rollout's final message (`final_text`, what the
`communication` and `unanswered_question` rewards read) is the final answer's text or the words
of the turn that calls `submit` (its calls cut out); `edited_paths` lists the paths that
`write_file` / `edit_file` calls wrote without error.

Episode interface the drivers use (coder.env.episode.Episode, or coder.env.pool.PooledEpisode in
an env worker): `tools` (protocol.ToolSpec list), `call(tool_call) -> str`, optionally
`call_many(tool_calls) -> [str]` (one turn's calls at once: the env episodes run the independent
ones concurrently; without it the calls run one after another), `done`,
`score() -> (test_reward in [0, 1], info)`, `lint_count()` (only with the `lint_introduced`
reward on), `close()`.
"""
from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections.abc import Callable, Sequence

import jax

from coder.env import protocol
from coder.env.scoring import score as score_lib
from coder.rl.trajectory import ContextWindow, Rollout

SUMMARY_REQUEST = (
    "Your context is nearly full. Write a summary of your progress that lets you continue from "
    "it alone: what the task is, what you found, what you changed, what remains. Reply with "
    "only <summary>...</summary>."
)
SUMMARY_PREFIX = "Summary of your progress so far:\n"
EDIT_TOOLS = ("write_file", "edit_file")
ASK_USER = "ask_user"  # coder.env.tools.registry.ASK_USER: the simulated user
THINK_TOOL = "think"  # a scratchpad call: its tokens count as thinking, not tool I/O
SUBMIT_TOOL = "submit"

SAMPLE, TOOLS, LINT, SCORE, DONE = "sample", "tools", "lint", "score", "done"


# --- actions -----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Sample:
    """Sample one call's worth of the current turn from the engine.

    new_context: None, or the prompt of a new generation: start a new engine row (a group of
      one) holding these ids and sample there from now on;
    append: context ids (observation, summary request) to append to the row first;
    generation: index of the generation in the chain (0: the task group's shared prompt).
    """

    new_context: tuple | None
    append: tuple
    max_new_tokens: int
    stop_ids: tuple
    generation: int


@dataclasses.dataclass(frozen=True)
class RunTools:
    """Run these well-formed `protocol.ToolCall`s in order in the episode; stop after a call
    that ends the episode (`submit`) or raises."""

    calls: tuple


@dataclasses.dataclass(frozen=True)
class Lint:
    when: str  # "before" (the first action) | "after" (the last one)


@dataclasses.dataclass(frozen=True)
class ScoreWorkspace:
    pass


@dataclasses.dataclass(frozen=True)
class Done:
    pass


def prose(text: str, calls) -> str:
    """`text` without the source text of its parsed `calls` (broken ones too), stripped: what
    the turn says in words (the final message the `communication` reward reads)."""
    for c in calls:
        text = text.replace(c.text, "", 1)
    return text.strip()


def infra_message(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


# --- the machine -------------------------------------------------------------------------------
class AgentRun:
    """One rollout's loop state. Built by `Agent.start`; see the module docstring."""

    def __init__(self, agent: "Agent", task_id: str, head: Sequence[int], tools, index: int = 0):
        self.agent, self.cfg = agent, agent.cfg
        self.head, self.tools, self.index = list(head), list(tools), index
        self.prompt = self.head + agent.tok.generation_prefix()
        self.rollout = Rollout(task_id=task_id, generations=[ContextWindow()])
        self.gen.add_context(self.prompt)
        self.turn_start = len(self.prompt)  # where the current turn's sampled ids start
        self.summarizing = False
        self.unsent: list[int] = []  # context ids of this generation the engine has not been given
        self._new_context = None  # the next Sample starts a new engine row with these ids
        self._routing = None  # the engine's routing of this generation's row: array or callable
        self._calls = ()  # the turn's parsed calls (broken ones included) awaiting their outputs
        self.state, self.action = None, None
        if self._lints:
            self._set(LINT, Lint("before"))
        else:
            self._next_turn()

    @property
    def gen(self) -> ContextWindow:
        return self.rollout.generations[-1]

    @property
    def done(self) -> bool:
        return self.state == DONE

    def next_action(self):
        """The action of the current state (the same object until an `on_*` call moves on)."""
        return self.action

    def take_unsent(self) -> list[int]:
        ids, self.unsent = self.unsent, []
        return ids

    @property
    def _lints(self) -> bool:
        return bool(float(self.cfg.aux_rewards.get("lint_introduced", 0.0)))

    def _set(self, state: str, action) -> None:
        self.state, self.action = state, action

    def _expect(self, state: str) -> None:
        if self.state != state:
            raise RuntimeError(f"AgentRun is in state {self.state}, not {state}")

    # --- events ---------------------------------------------------------------------------
    def on_sample(self, out, routing=None) -> None:
        """An engine Generation (tokens, logprobs, expert_ids, finish_reason, policy_version) for
        the current Sample. `routing`: the engine's expert ids of the row `[tokens fed,
        moe_layers, top_k]` or a function returning them (read when the generation closes)."""
        self._expect(SAMPLE)
        r, c, a = self.rollout, self.cfg, self.agent
        self.gen.add_sampled(out)
        if routing is not None:
            self._routing = routing
        sampled = self.gen.tokens[self.turn_start:]
        ended = out.finish_reason == "stop" or bool(sampled and sampled[-1] in a.stop_ids)
        turn_full = len(sampled) >= c.max_turn_tokens and not self.summarizing
        if not out.tokens and not ended:  # the engine has no room left for this row
            return self._end("context")
        if not ended and not turn_full:
            return self._next_turn()  # more of this turn (or a summary if the context is full)
        body = sampled[:-1] if ended else sampled
        if self.summarizing:
            r.summaries += 1
            r.output_tokens += len(sampled)
            r.turns += 1
            return self._start_next_generation(a.summary_ids(body))
        r.turns += 1
        text = a.decode(body)
        calls = protocol.parse_tool_calls(text, self.tools)
        if not ended:  # cut at max_turn_tokens: close the turn for the template
            self._add_context([a.tok.end_id], new_turn=False)
        if not calls:
            r.output_tokens += len(sampled)
            r.final_text = text
            return self._end("answer")
        in_calls = a.tokens_in_calls(body, self.tools)
        r.tool_io_tokens += in_calls
        r.thinking_tokens += len(sampled) - in_calls
        if any(getattr(x, "name", None) == SUBMIT_TOOL for x in calls):  # the final message
            r.final_text = prose(text, calls)
        self._calls = tuple(calls)
        good = tuple(x for x in calls if not isinstance(x, protocol.BrokenToolCall))
        if not good:
            self.state = TOOLS
            return self.on_tools([])
        self._set(TOOLS, RunTools(good))

    def on_tools(self, outputs: Sequence[str], done: bool = False, error: str = "") -> None:
        """Outputs of the RunTools calls, in order: all of them, or up to the one that ended the
        episode (`done`), or up to the one that raised (`error`: the harness failed)."""
        self._expect(TOOLS)
        r, c = self.rollout, self.cfg
        n_good = sum(not isinstance(x, protocol.BrokenToolCall) for x in self._calls)
        if not error and (len(outputs) > n_good or (len(outputs) < n_good and not done)):
            error = f"InfraError: {len(outputs)} tool outputs for {n_good} calls"
        outs, k = [], 0
        for call in self._calls:
            if isinstance(call, protocol.BrokenToolCall):
                r.broken_calls += 1
                outs.append(f"error: broken tool call: {call.reason}")
                continue
            r.tool_calls += 1
            r.edits += call.name in EDIT_TOOLS
            r.questions += call.name == ASK_USER
            if k == len(outputs):  # this call raised (or the driver gave up before it)
                break
            outs.append(str(outputs[k]))
            path = call.arguments.get("path") if call.name in EDIT_TOOLS else None
            if path and not outs[-1].startswith("error:") and path not in r.edited_paths:
                r.edited_paths.append(path)
            k += 1
            if done and k == len(outputs):
                break
        self._calls = ()
        if error:
            r.infra_error = error
            return self._end("infra")
        if done:
            return self._end("submit")
        if r.turns >= c.max_turns:
            return self._end("turns")
        obs = self._fit_observation(self.agent.tool_message_ids(outs))
        r.tool_io_tokens += len(obs)
        ids = obs + self.agent.tok.generation_prefix()
        if len(self.gen) + len(ids) >= c.context_budget:  # even the cut message does not fit
            return self._end("context")
        self._add_context(ids)
        self._next_turn()

    def on_lint(self, count: int | None, error: str = "") -> None:
        """ruff diagnostics of the workspace (Lint action), or the harness error."""
        self._expect(LINT)
        r, when = self.rollout, self.action.when
        if error:
            r.infra_error = error
        else:
            setattr(r, f"lint_{when}", count)
        if when == "before":
            return self._end("infra") if error else self._next_turn()
        self._score_or_finish()

    def on_score(self, test_reward: float, info: dict | None = None, error: str = "") -> None:
        """The episode's score of the workspace (ScoreWorkspace action), or the harness error."""
        self._expect(SCORE)
        r = self.rollout
        if error:
            r.infra_error = error
        else:
            r.test_reward = float(test_reward)
            r.clarification_needed = bool((info or {}).get("clarification_needed"))
            r.verdict_shared = bool((info or {}).get("verdict_shared"))
            if (info or {}).get("infra_error"):
                r.infra_error = str(info["infra_error"])
        self._finish()

    # --- transitions ----------------------------------------------------------------------
    def _room(self) -> int:
        """Tokens the run may sample in this call (>= 1)."""
        c, r = self.cfg, self.rollout
        turn_len = len(self.gen) - self.turn_start
        room = [c.context_budget - len(self.gen), c.max_rollout_tokens - r.policy_tokens]
        if not self.summarizing:
            room += [c.max_turn_tokens - turn_len, c.context_budget - c.summary_reserve - len(self.gen)]
        return max(1, min(room))

    def _next_turn(self) -> None:
        """Ends the rollout on a budget, or switches to a summary when the context is full; then
        asks for the next sample."""
        c, r, a = self.cfg, self.rollout, self.agent
        if r.policy_tokens >= c.max_rollout_tokens:
            return self._end("tokens")
        if self.summarizing:
            if len(self.gen) >= c.context_budget:  # no room left even for the summary
                return self._end("context")
        elif c.context_budget - c.summary_reserve - len(self.gen) <= 0:
            if r.summaries >= c.max_summaries:
                return self._end("context")
            request = a.tok.turn_ids("user", SUMMARY_REQUEST) + a.tok.generation_prefix()
            if len(self.gen) > self.turn_start:  # close the cut-off turn before the request
                request = [a.tok.end_id] + request
            if len(self.gen) + len(request) >= c.context_budget:  # rl.summary_reserve is too small
                return self._end("context")
            self._add_context(request)
            self.summarizing = True
        new, self._new_context = self._new_context, None
        self._set(SAMPLE, Sample(new_context=None if new is None else tuple(new),
                                 append=tuple(self.take_unsent()), max_new_tokens=self._room(),
                                 stop_ids=a.stop_ids, generation=len(self.rollout.generations) - 1))

    def _add_context(self, ids: list[int], new_turn: bool = True) -> None:
        self.gen.add_context(ids)
        self.unsent += ids
        if new_turn:
            self.turn_start = len(self.gen)

    def _fit_observation(self, ids: list[int]) -> list[int]:
        """The tool message's ids, cut so the generation keeps its summary reserve.

        A cut message keeps its head and says so; whatever does not fit is for the summary to
        recover (the agent can re-run the tool in the next generation).
        """
        c, tok = self.cfg, self.agent.tok
        room = c.context_budget - c.summary_reserve - len(self.gen) - len(tok.generation_prefix())
        if len(ids) <= room:
            return ids
        note = tok.encode(f"\n[... tool output cut: {len(ids) - 2} tokens did not fit the context ...]")
        keep = max(0, room - len(note) - 2)
        return ids[:1 + keep] + note + [tok.end_id]

    def _capture_routing(self) -> None:
        """Routing of the generation's prompt and observation tokens from the engine's record
        of its row. Sampled tokens already carry theirs; tokens appended but never fed (the
        last `<|end|>` of a generation) have none: they predict nothing, so router replay does
        not need them."""
        src, self._routing = self._routing, None
        ids = src() if callable(src) else src
        if ids is not None:
            self.gen.set_routing(ids)

    def _start_next_generation(self, summary_ids) -> None:
        self._capture_routing()
        ctx = self.agent.chain_context(self.head, summary_ids)
        gen = ContextWindow()
        gen.add_context(ctx)
        self.rollout.generations.append(gen)
        self._new_context, self.unsent = ctx, []
        self.turn_start = len(ctx)
        self.summarizing = False
        if self.rollout.turns >= self.cfg.max_turns:
            return self._end("turns")
        self._next_turn()

    def _end(self, finish: str) -> None:
        r = self.rollout
        r.finish = r.finish or finish
        self._capture_routing()
        if not r.infra_error and self._lints:
            return self._set(LINT, Lint("after"))
        self._score_or_finish()

    def _score_or_finish(self) -> None:
        if self.rollout.infra_error:
            return self._finish()
        self._set(SCORE, ScoreWorkspace())

    def _finish(self) -> None:
        """Applies the infrastructure mask and the broken-call rule (coder.env.scoring.score.outcome)."""
        r = self.rollout
        if r.infra_error:
            r.finish = "infra"
            r.test_reward = 0.0
        r.outcome, r.correct = score_lib.outcome(r.test_reward, r.broken_calls)
        self._set(DONE, Done())


# --- the agent: tokenizer-level helpers and the drivers -----------------------------------------
class Agent:
    """Starts `AgentRun`s and drives groups of them with an engine and env episodes.

    Args:
      engine: coder.infer.engine.Engine (`start_group`, `generate`, `append`); None when only
        `start` is used (tests of the machine).
      tokenizer: coder.data.tokenizer.Tokenizer.
      cfg: `config.rl`.
      sampling_params: builds the engine's SamplingParams: `fn(max_new_tokens, stop_ids)`.
    """

    def __init__(self, engine, tokenizer, cfg, sampling_params: Callable | None = None):
        self.engine, self.tok, self.cfg = engine, tokenizer, cfg
        self.sampling_params = sampling_params
        self.stop_ids = (tokenizer.end_id, tokenizer.eos_id)
        self.call_open = tokenizer.special_id(protocol.CALL_OPEN)
        self.call_close = tokenizer.special_id(protocol.CALL_CLOSE)
        self.summary_open = tokenizer.special_id("<summary>")
        self.summary_close = tokenizer.special_id("</summary>")
        self.result_open = tokenizer.special_id(protocol.RESULT_OPEN)
        self.result_close = tokenizer.special_id(protocol.RESULT_CLOSE)

    # --- prompts and token helpers --------------------------------------------------------
    def head_ids(self, tools, task_prompt: str) -> list[int]:
        """System turn (tool schemas) + user turn (task): the start of every generation."""
        preamble = self.cfg.get("system_prompt") or None
        system = self.tok.turn_ids("system", protocol.render_system_prompt(list(tools), preamble))
        return system + self.tok.turn_ids("user", task_prompt)

    def chain_context(self, head: Sequence[int], summary_ids: Sequence[int]) -> list[int]:
        """The next generation's prompt: system + task + summary (sampled ids) + `<|assistant|>`."""
        user = [self.tok.special_id("user")] + self.tok.encode(SUMMARY_PREFIX)
        return list(head) + user + list(summary_ids) + [self.tok.end_id] + self.tok.generation_prefix()

    def tool_message_ids(self, outputs: Sequence[str]) -> list[int]:
        """The tool message's ids: the tokenizer's `tool_message_ids`, as SFT renders it."""
        return self.tok.tool_message_ids(outputs)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of sampled ids, for parsing only. Ids past the tokenizer's vocabulary (the
        model's embedding is padded to a multiple of 128) have no text and are skipped."""
        return self.tok.decode([i for i in ids if i < self.tok.vocab_size])

    def tokens_in_calls(self, ids: Sequence[int], tools=()) -> int:
        """Sampled tokens inside `<tool_call>...</tool_call>` spans, tags included, except the
        spans of well-formed `think` calls among `tools`: those are thinking written as a
        call, and the length penalty counts them as thinking."""
        spans, inside = [], False
        for t in ids:
            if t == self.call_open:
                inside = True
                spans.append([])
            if inside:
                spans[-1].append(t)
            if t == self.call_close:
                inside = False
        think = [t for t in tools if t.name == THINK_TOOL]
        return sum(len(s) for s in spans if not (think and self._is_call_of(s, think)))

    def _is_call_of(self, span: Sequence[int], tools) -> bool:
        """The span is one well-formed call of one of `tools`."""
        calls = protocol.parse_tool_calls(self.decode(span), tools)
        return len(calls) == 1 and isinstance(calls[0], protocol.ToolCall)

    def summary_ids(self, body: Sequence[int]) -> list[int]:
        """The sampled `<summary>...</summary>` span (the whole reply if the tags are missing)."""
        body = list(body)
        start = body.index(self.summary_open) if self.summary_open in body else 0
        end = body.index(self.summary_close, start) + 1 if self.summary_close in body[start:] else len(body)
        return body[start:end]

    def start(self, task_id: str, task_prompt: str, tools, index: int = 0) -> AgentRun:
        """A new rollout of the task (`index`: its row in the task's group). Raises ValueError
        when the system prompt and task leave no room beyond the summary reserve."""
        head = self.head_ids(tools, task_prompt)
        n = len(head) + len(self.tok.generation_prefix())
        if n + self.cfg.summary_reserve >= self.cfg.context_budget:
            raise ValueError(
                f"task {task_id}: system prompt + task take {n} tokens, leaving no room "
                f"in rl.context_budget={self.cfg.context_budget} beyond rl.summary_reserve="
                f"{self.cfg.summary_reserve}: raise the budget or offer fewer rl.tools")
        return AgentRun(self, task_id, head, tools, index)

    # --- driver: one group on the calling thread -----------------------------------------
    def run_group(self, task_id: str, task_prompt: str, episodes: list, rng) -> list[Rollout]:
        """G rollouts of one task (G = len(episodes)), sharing one prefilled prompt.

        Each round, every unfinished row samples (the rows of one engine group in one
        `generate` call), then the rows' tool calls run on this thread, row after row (a
        row's independent calls concurrently, when its episode has `call_many`).
        `episodes` are fresh env episodes of the task, one per rollout; they are closed here.
        """
        try:
            runs = [self.start(task_id, task_prompt, episodes[0].tools, i) for i in range(len(episodes))]
            lease = Lease(self.engine.start_group(runs[0].prompt, len(runs)), len(runs))
            seats = [Seat(self.engine, lease, i) for i in range(len(runs))]
            while True:
                batches: dict[int, list] = {}
                for run, ep, seat in zip(runs, episodes, seats):
                    action = run.next_action()
                    while not isinstance(action, (Sample, Done)):
                        serve_env(run, ep, action)
                        action = run.next_action()
                    if isinstance(action, Done):
                        seat.leave(run.take_unsent())
                        continue
                    seat.prepare(action)
                    batches.setdefault(id(seat.lease), []).append((run, seat, action))
                if not batches:
                    break
                for items in batches.values():
                    run, seat, action = items[0]
                    params = self.sampling_params(min(a.max_new_tokens for _, _, a in items), self.stop_ids)
                    outs = self.engine.generate(seat.lease.group, params, sample_key(rng, run.index, action),
                                                rows=[s.row for _, s, _ in items])
                    for (run, seat, _), out in zip(items, outs):
                        run.on_sample(out, routing=seat.routing())
            for run, seat in zip(runs, seats):
                seat.record(run.rollout)
        finally:
            for ep in episodes:
                ep.close()
        return [run.rollout for run in runs]


def sample_key(rng, index: int, action: Sample):
    """The key of a Sample: the task group's key for its first generation (the engine folds in
    the row and the position), one of the rollout's own for each later generation; never a
    function of which other rows share the decode batch."""
    if action.generation == 0:
        return rng
    return jax.random.fold_in(jax.random.fold_in(rng, 1_000_003 + index), action.generation)


def serve_env(run: AgentRun, episode, action) -> None:
    """Performs an env action (RunTools, Lint, ScoreWorkspace) of `run` with its episode and feeds the
    result back. Any exception is a harness failure (the agent's mistakes are tool outputs),
    given to the run as an infrastructure error, never raised."""
    r = run.rollout
    t0 = time.perf_counter()
    if isinstance(action, RunTools):
        outputs, error = [], ""
        try:
            outputs = run_calls(episode, action.calls)
        except Exception as e:  # noqa: BLE001 - the harness failed, not the agent
            error = infra_message(e)
        r.tool_time_s += time.perf_counter() - t0
        run.on_tools(outputs, done=bool(getattr(episode, "done", False)), error=error)
    elif isinstance(action, Lint):
        try:
            count, error = int(episode.lint_count()), ""
        except Exception as e:  # noqa: BLE001
            count, error = None, infra_message(e)
        r.tool_time_s += time.perf_counter() - t0
        run.on_lint(count, error)
    elif isinstance(action, ScoreWorkspace):
        try:
            (reward, info), error = episode.score(), ""
        except Exception as e:  # noqa: BLE001
            reward, info, error = 0.0, {}, infra_message(e)
        r.score_time_s += time.perf_counter() - t0
        run.on_score(reward, info, error)
    else:
        raise TypeError(f"serve_env: {action!r} is not an env action")


def run_calls(episode, calls) -> list[str]:
    """Outputs of one turn's calls, in order, up to the one that ends the episode (`submit`):
    through the episode's `call_many` when it has one (env episodes: independent calls at
    once), else one `call` after another."""
    many = getattr(episode, "call_many", None)
    if many is not None:
        return list(many(calls))
    outputs = []
    for call in calls:
        outputs.append(episode.call(call))
        if episode.done:
            break
    return outputs


class Lease:
    """An engine group shared by the runs still using one of its rows; closed with the last."""

    def __init__(self, group, users: int):
        self.group, self.users = group, users
        self._lock = threading.Lock()

    def leave(self, row: int | None = None) -> None:
        """One user is done with the group (with `row`: that row, whose slot goes back to the
        engine now, where its cache may serve as a cached prefix, e.g. of the user's next window)."""
        with self._lock:
            self.users -= 1
            last = self.users == 0
        if last and hasattr(self.group, "close"):
            self.group.close()
        elif not last and row is not None and hasattr(self.group, "release"):
            self.group.release(row)


class Seat:
    """A run's current engine row: (lease of its group, row index)."""

    def __init__(self, engine, lease: Lease | None, row: int = 0):
        self.engine, self.lease, self.row = engine, lease, row
        self.prefilled = self.reused = 0  # the engine's prefill counts of the rows it left

    def record(self, rollout) -> None:
        """The rows' prefill counts on the rollout (after its last `leave`)."""
        rollout.prefill_tokens, rollout.prefix_tokens_saved = self.prefilled, self.reused

    def prepare(self, action: Sample) -> None:
        """Moves to a new row for a new generation, appends the Sample's context ids."""
        if action.new_context is not None:
            self.leave()
            self.lease, self.row = Lease(self.engine.start_group(list(action.new_context), 1), 1), 0
        if action.append:
            self.engine.append(self.lease.group, self.row, list(action.append))

    def routing(self):
        fn = getattr(self.lease.group, "expert_ids", None)
        return None if fn is None else functools.partial(fn, self.row)

    def leave(self, unsent: Sequence[int] = ()) -> None:
        """Gives the row the run's last context ids (the engine's row then equals the training
        row) and leaves the group; idempotent."""
        if self.lease is None:
            return
        if unsent:
            self.engine.append(self.lease.group, self.row, list(unsent))
        counts = getattr(self.lease.group, "prefill_counts", None)
        if counts is not None:
            prefilled, reused = counts(self.row)
            self.prefilled, self.reused = self.prefilled + prefilled, self.reused + reused
        lease, self.lease = self.lease, None
        lease.leave(self.row)


def drive(run: AgentRun, episode, engine, seat: Seat, rng, sampling_params: Callable) -> Rollout:
    """Runs one rollout to the end on the calling thread (one thread per rollout): samples its
    row with `engine.generate(group, params, key, rows=[row])` while other threads decode theirs
    or wait on tools. `seat` holds the task group's row; `rng` is the task group's key."""
    try:
        while not run.done:
            action = run.next_action()
            if not isinstance(action, Sample):
                serve_env(run, episode, action)
                continue
            seat.prepare(action)
            params = sampling_params(action.max_new_tokens, action.stop_ids)
            (out,) = engine.generate(seat.lease.group, params, sample_key(rng, run.index, action), rows=[seat.row])
            run.on_sample(out, routing=seat.routing())
        seat.leave(run.take_unsent())
        seat.record(run.rollout)
    finally:
        seat.leave()
    return run.rollout
