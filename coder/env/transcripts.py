"""SFT conversations that solve tasks with known solutions, recorded from real tool runs.

Two scripts; the offered tools decide which (`script`). **Direct** (no `search` or `grep`
offered, e.g. the quickstart's two tools or configs/base.py's five): the scripted agent runs
the tests, reads the code around the change, applies it with `edit_file` (the smallest unique
replacement; `write_file` for new files), runs the tests again and submits. **Harness** (`search`
or `grep` offered, e.g. `rl.tools = ()`: every tool): the workflow an engineer follows with the
whole harness, several independent calls in one turn where they do not depend on each other:

    run_tests + search (or grep)      -> the failure and where the code is, in one turn
      + semantic_search                  (offered and the episode has an encoder)
      + memory_read + repo_history log   (a repository task: notes of earlier tasks on it, and
                                          the recent history of the files the fix touches)
    read_file per file + grep uses    -> the code around the change and who uses it, one turn
    diagnostics references            -> (offered) every use of the changed definition
    think + edit_file / write_file    -> the plan in a scratchpad, then one file a turn
    run_tests + diagnostics check     -> tests and type errors of the edited files, one turn
    a final message saying what changed and why, + submit
      + memory_write                     (a repository task: where the fix was and how its tests
                                          run, for the next task on that repository)

Each step appears only where its tool is offered, so SFT teaches only calls RL accepts. The
final message names the edited files and the reason (the `communication` reward of
coder.rl.reward scores exactly that). On a task whose prompt is underspecified
(`metadata["underspecified"]`, e.g. `toy_tasks(..., underspecified=0.5)`) with `ask_user`
offered, either script first asks the user, whose answer is the task's specification. A
multi-call turn is one assistant message holding the
calls in order and one tool message holding their outputs in order (`Episode.step`, the same
`Episode.call_many` the RL loop runs them through), so it renders as RL and serving render it.

With `edit_tool="write_file"` either script writes each changed file whole instead: the fixed
file is all the agent produces, with no exact copy of the read output to get right (a tiny
model's edit_file calls break on that copy), and the transcript is shorter. The script's
replies are fed through the same `Episode` the RL loop uses, so every tool message holds the
real output of the call in a sandbox, and the text follows the agent-loop format exactly
(`coder.env.protocol`). Only conversations whose episode scored reward 1 are kept.

    python -m coder.env.transcripts --tasks T.jsonl --solutions S.jsonl --out sft.jsonl \
        [--tools read_file,edit_file,run_tests,submit] [--edit-tool write_file]

writes `{"messages": [{"role", "content"}, ...]}` per line (docs/contracts.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import random
import re
import sys

from coder.env.episode import Episode, select_tools
from coder.env.pool import EpisodePool
from coder.env.protocol import call_fragments, render_system_prompt, render_tool_call
from coder.env.tasks import read_solutions, read_tasks, toy_tasks, write_jsonl

_OPEN = (
    "Let me run the tests first to see what fails.",
    "I'll start by running the test suite.",
    "First, the failing tests.",
)
_ASK = (
    "The task does not say what exactly is expected; I'll ask before changing anything.",
    "One detail is missing from the request, so I'll ask the user first.",
)
_QUESTION = (
    "What exact value or behaviour should the result have? The request leaves it out.",
    "Could you give the exact expected result? The task does not state it.",
)
_READ = (
    "Now the code around the problem in {path}.",
    "Let me read the relevant part of {path}.",
    "Looking at {path}.",
)
_EDIT = (
    "The bug is here; fixing it.",
    "This line is wrong. Editing it.",
    "Found it. Applying the fix.",
)
_NEW = ("Creating {path}.", "Writing {path}.")
_TEST = ("Running the tests again.", "Checking that the tests pass now.")
_DONE = ("The tests pass. Submitting.", "All tests pass, done.")


def minimal_edit(old_text: str, new_text: str) -> tuple[str, str, int, int]:
    """(old, new, first_line, last_line) replacing the changed span of `old_text`, grown by
    whole lines of context until `old` occurs exactly once (lines 1-based, of old_text)."""
    a, b = old_text.splitlines(keepends=True), new_text.splitlines(keepends=True)
    ops = [
        op
        for op in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes()
        if op[0] != "equal"
    ]
    if not ops:
        raise ValueError("texts are equal")
    i1, i2, j1, j2 = ops[0][1], ops[-1][2], ops[0][3], ops[-1][4]
    while True:
        old, new = "".join(a[i1:i2]), "".join(b[j1:j2])
        if old and old_text.count(old) == 1:
            return old, new, i1 + 1, max(i2, i1 + 1)
        if i1 == 0 and i2 == len(a):
            return old, new, 1, max(len(a), 1)
        if i1 > 0:
            i1, j1 = i1 - 1, j1 - 1
        if i2 < len(a):
            i2, j2 = i2 + 1, j2 + 1


EDIT_TOOLS = ("edit_file", "write_file")


def check_edit_tool(edit_tool: str, tools=None) -> None:
    """Stops on an edit tool the script has no form for, or one the agent is not offered."""
    if edit_tool not in EDIT_TOOLS:
        raise ValueError(f"edit tool {edit_tool!r}: the transcripts apply a fix with one of {EDIT_TOOLS}")
    if tools and edit_tool not in tools:
        raise ValueError(f"edit tool {edit_tool!r} is not among the offered tools {tuple(tools)}")


LOCATE_TOOLS = ("search", "grep")  # offered: the harness script (module docstring)


def script(task, solution: dict, rng: random.Random, tools=None, edit_tool: str = "edit_file"):
    """Yield the scripted agent's replies (a generator: it may look at nothing but the task).

    tools: the tool names the agent is offered (None: all); calls of tools not offered are
    left out, so the transcript teaches only calls the RL agent can make (issue #17). With a
    locating tool (`LOCATE_TOOLS`) among them the replies follow the harness workflow, else the
    direct one (module docstring).
    edit_tool: how a changed file is fixed: "edit_file" (the smallest unique replacement) or
    "write_file" (the whole new file)."""
    check_edit_tool(edit_tool, tools)
    offered = (lambda name: True) if tools is None else set(tools).__contains__
    if (task.metadata or {}).get("underspecified") and offered("ask_user"):
        # the prompt leaves out what the tests check: ask first (the simulated user answers
        # from the task's specification), and only then (the `clarification` reward charges
        # questions a task did not need, so no transcript asks on a complete prompt)
        yield rng.choice(_ASK) + "\n" + render_tool_call("ask_user", {"question": rng.choice(_QUESTION)})
    if any(offered(t) for t in LOCATE_TOOLS):
        yield from _harness(task, solution, rng, offered, edit_tool)
        return
    if offered("run_tests"):
        yield rng.choice(_OPEN) + "\n" + render_tool_call("run_tests", {})
    for path in sorted(solution):
        old_text, new_text = task.files.get(path), solution[path]
        if old_text == new_text:
            continue
        if old_text is not None and offered("read_file"):
            _, _, lo, hi = minimal_edit(old_text, new_text)
            yield (
                rng.choice(_READ).format(path=path)
                + "\n"
                + render_tool_call(
                    "read_file", {"path": path, "start_line": max(1, lo - 8), "end_line": hi + 8}
                )
            )
        yield _edit_reply(path, old_text, new_text, rng, edit_tool)
    if offered("run_tests"):
        yield rng.choice(_TEST) + "\n" + render_tool_call("run_tests", {})
    yield rng.choice(_DONE) + "\n" + render_tool_call("submit", {})


def _edit_reply(path: str, old_text: str | None, new_text: str, rng, edit_tool: str) -> str:
    """The reply that applies one file's change (`old_text` None: a new file), in both scripts."""
    if old_text is None:
        return rng.choice(_NEW).format(path=path) + "\n" + render_tool_call(
            "write_file", {"path": path, "content": new_text})
    if edit_tool == "write_file":
        return rng.choice(_EDIT) + "\n" + render_tool_call("write_file", {"path": path, "content": new_text})
    old, new, _, _ = minimal_edit(old_text, new_text)
    return rng.choice(_EDIT) + "\n" + render_tool_call("edit_file", {"path": path, "old": old, "new": new})


_DEF = re.compile(r"\s*(?:async\s+)?(?:def|class)\s+(\w+)")


def enclosing_definition(text: str, line: int) -> tuple[str, int] | None:
    """(name, line) of the nearest `def` / `class` at or above `line` (1-based) of `text`: what
    the harness script greps for and asks diagnostics about; None when there is none."""
    lines = text.splitlines()
    for i in range(min(line, len(lines)) - 1, -1, -1):
        m = _DEF.match(lines[i])
        if m:
            return m.group(1), i + 1
    return None


def _changed_lines(old_text: str, new_text: str) -> tuple[list[str], list[str]]:
    """The stripped non-blank lines the change removes and adds."""
    a, b = old_text.splitlines(), new_text.splitlines()
    removed, added = [], []
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if op != "equal":
            removed += [x.strip() for x in a[i1:i2] if x.strip()]
            added += [x.strip() for x in b[j1:j2] if x.strip()]
    return removed, added


def change_summary(task, solution: dict, tested: bool) -> str:
    """The final message: which files changed, how, and why (the task's first sentence).

    A reviewer reading only this message should know what to look at and why it changed; the
    `communication` reward (coder.rl.reward) scores a final message for the same two things."""
    parts = []
    for path in sorted(solution):
        new_text = solution[path]
        if path not in task.files:
            parts.append(f"added {path}")
            continue
        old_text = task.files[path]
        if old_text == new_text:
            continue
        removed, added = _changed_lines(old_text, new_text)
        where = enclosing_definition(old_text, minimal_edit(old_text, new_text)[2])
        where = f"`{where[0]}` in {path}" if where else path
        if len(removed) == 1 and len(added) == 1 and max(len(removed[0]), len(added[0])) <= 80:
            parts.append(f"changed {where}: `{removed[0]}` is now `{added[0]}`")
        else:
            parts.append(f"changed {where} (-{len(removed)} +{len(added)} lines)")
    prompt = " ".join(task.prompt.split())
    reason = re.split(r"(?<=[.!?])\s", prompt, maxsplit=1)[0]
    reason = reason if len(reason) <= 160 else reason[:157] + "..."
    text = "I " + "; ".join(parts) + f", because the task asks for it: {reason}"
    return text + (" The tests pass now." if tested else "")


_H_LEAD = ("Let me", "First I'll", "To begin, I'll")
_H_REFS = ("Before editing, where else is {names} used?", "Checking every use of {names} before I change it.")
_H_NEXT = ("Now I'll", "Next, I'll", "Let me")


def _turn(lead: str, what: list[str], calls: list[str]) -> str:
    """One reply: what the calls are for, in words, then the calls back to back. The server
    returns a reply as `content` (the words) and `tool_calls`, and renders a conversation's
    assistant message as content + each call's text (coder/serve/server.py); words first and
    calls with nothing between them is the form that renders back to the same text."""
    at_once = ", at once" if len(calls) > 1 else ""
    return f"{lead} " + " and ".join(what) + at_once + ".\n" + "".join(calls)


def _harness(task, solution: dict, rng: random.Random, offered, edit_tool: str):
    """The harness script's replies (module docstring); `offered(name)`: the tool is offered."""
    changed = [p for p in sorted(solution) if p in task.files and task.files[p] != solution[p]]
    repository = bool(getattr(task, "repo", "") or (task.metadata or {}).get("repo"))
    spans = {p: minimal_edit(task.files[p], solution[p])[2:] for p in changed}
    defs = {p: enclosing_definition(task.files[p], spans[p][0]) for p in changed}
    names = sorted({d[0] for d in defs.values() if d})
    grep_uses = [render_tool_call("grep", {"pattern": rf"\b{n}\b"}) for n in names] if offered("grep") else []
    # 1. the failure and where the code is
    what, calls = [], []
    if offered("run_tests"):
        what.append("run the tests")
        calls.append(render_tool_call("run_tests", {}))
    query = " ".join(task.prompt.split())[:200]
    if offered("search"):
        what.append("search the code for what the task describes")
        calls.append(render_tool_call("search", {"query": query}))
    if offered("semantic_search"):
        what.append("search it by meaning")
        calls.append(render_tool_call("semantic_search", {"query": query}))
    if not (offered("search") or offered("semantic_search")) and grep_uses:
        what.append("grep for " + ", ".join(f"`{n}`" for n in names))
        calls += grep_uses
        grep_uses = []  # done: the read turn does not repeat it
    if repository and offered("memory_read"):
        what.append("read my notes on this repository")
        calls.append(render_tool_call("memory_read", {}))
    if repository and offered("repo_history"):
        what.append("look at the recent history of " + " and ".join(changed))
        calls += [render_tool_call("repo_history", {"action": "log", "path": p, "max_count": 5}) for p in changed]
    if calls:
        yield _turn(rng.choice(_H_LEAD), what, calls)
    # 2. the code around each change (one call per file) and, if not done yet, who uses it
    reads = [render_tool_call("read_file", {"path": p, "start_line": max(1, spans[p][0] - 8),
                                            "end_line": spans[p][1] + 8})
             for p in (changed if offered("read_file") else [])]
    what = (["read the code around the change in " + " and ".join(changed)] if reads else []) + (
        ["find every use of " + ", ".join(f"`{n}`" for n in names)] if grep_uses else [])
    if what:
        yield _turn(rng.choice(_H_NEXT), what, reads + grep_uses)
    # 3. every use of the definitions the change touches, from the language tools
    if offered("diagnostics") and names:
        refs = [render_tool_call("diagnostics", {"action": "references", "symbol": d[0], "path": p,
                                                 "line": d[1]}) for p, d in defs.items() if d]
        yield rng.choice(_H_REFS).format(names=", ".join(f"`{n}`" for n in names)) + "\n" + "".join(refs)
    # 4. the plan in the scratchpad, then the edits, one file a turn (edits change the
    # workspace: they run alone anyway)
    plan = change_summary(task, solution, tested=False).split(", because", 1)[0]
    first = True
    for path in sorted(solution):
        old_text = task.files.get(path)
        if old_text != solution[path]:
            reply = _edit_reply(path, old_text, solution[path], rng, edit_tool)
            if first and offered("think"):
                words, call = reply.split("\n", 1)
                reply = words + "\n" + render_tool_call("think", {"thought": "Plan: " + plan[2:]}) + call
            first = False
            yield reply
    # 5. tests and type errors of the edited files, in one turn
    what, calls = [], []
    if offered("run_tests"):
        what.append("run the tests again")
        calls.append(render_tool_call("run_tests", {}))
    checked = [p for p in sorted(solution) if p.endswith(".py") and task.files.get(p) != solution[p]]
    if offered("diagnostics") and checked:
        what.append("type-check " + " and ".join(checked))
        calls += [render_tool_call("diagnostics", {"action": "check", "path": p}) for p in checked]
    if calls:
        yield _turn(rng.choice(_H_NEXT), what, calls)
    # 6. what changed and why, then submit (a repository task: a note for its next task first)
    note = []
    if repository and offered("memory_write"):
        where = ", ".join(f"{p} ({d[0]})" if d else p for p, d in defs.items())
        note = [render_tool_call("memory_write", {"note": f"Tests run with `{task.test_command}`. "
                                                          f"Fixed a bug in {where}."})]
    yield (change_summary(task, solution, tested=offered("run_tests")) + "\n" + "".join(note)
           + render_tool_call("submit", {}))


def transcript(task, solution: dict, seed: int = 0, edit_tool: str = "edit_file",
               **episode_kwargs) -> tuple[dict | None, dict]:
    """({"messages": [...]} or None if the episode did not score 1, final info)."""
    episode_kwargs.setdefault("token_count", len)
    ep = Episode(**episode_kwargs)
    ep.reset(task)
    info = dict(ep.info)
    try:
        # only what works in this episode: semantic_search needs an encoder
        offered = [t.name for t in ep.tools if t.name != "semantic_search" or ep.semantic is not None]
        rng = random.Random(f"{seed}/{task.id}")
        for text in script(_with_workspace_files(task, solution, ep), solution, rng, tools=offered,
                           edit_tool=edit_tool):
            _, done, info = ep.step(text)
            if done:
                break
    finally:
        ep.close()
    ok = info.get("done_reason") == "submit" and info.get("reward") == 1.0
    return ({"messages": ep.messages} if ok else None), info


def _with_workspace_files(task, solution: dict, ep):
    """`task` whose `files` also hold the workspace's text of the paths `solution` changes: a
    repository task ships its files in the checkout, not in `files`, and the script needs the
    text before the change (what it reads, greps and edits)."""
    base = {}
    for path in solution:
        if path not in task.files:
            try:
                base[path] = ep.sandbox.read(path)
            except (FileNotFoundError, ValueError, OSError):
                pass  # a new file
    return dataclasses.replace(task, files={**task.files, **base}) if base else task


def _one(item):
    task, solution, seed, kw = item
    conv, info = transcript(task, solution, seed, **kw)
    return task.id, conv, info


def _transcribe(item):
    """(task, solution, seed[, transcript kwargs]) -> conversation or None (an EpisodePool worker)."""
    task, solution, seed, *kw = item
    conv, _ = transcript(task, solution, seed, **(kw[0] if kw else {}))
    return conv


def toy_transcripts(n: int, seed: int, workers: int = 2, tools=(), system_preamble=None,
                    edit_tool: str = "edit_file") -> list[dict]:
    """Conversations solving `n` of the env's toy tasks, with real tool outputs.

    Only transcripts whose episode scored reward 1 come back from the env; fewer than half of
    them is an environment problem worth stopping for. tools/system_preamble: the agent RL
    runs (rl.tools, rl.system_prompt); () / None keep all tools and the default preamble.
    edit_tool: see `script`.
    """
    check_edit_tool(edit_tool, tools)  # here, not in each worker
    kw = {"tools": tuple(tools), "system_preamble": system_preamble, "edit_tool": edit_tool}
    items = [(task, solution, seed, kw) for task, solution in toy_tasks(n, seed)]
    with EpisodePool(max(1, min(workers, n)), token_count=len) as pool:
        convs = [c for c in pool.map(_transcribe, items) if c is not None]
    if len(convs) < max(1, n // 2):
        raise RuntimeError(f"only {len(convs)} of {n} toy-task transcripts succeeded: check the sandbox (bwrap)")
    return convs


def toy_agent_texts(n: int, seed: int, tools=(), system_preamble=None, edit_tool: str = "edit_file") -> list[str]:
    """The text of `toy_transcripts(n, seed, ...)` that does not need a sandbox to produce: the
    system prompt, each task's prompt and the scripted agent's replies (no tool outputs), for
    training a tokenizer on the agent's format (coder.data.tokenizer: data.tokenizer_agent_text)."""
    check_edit_tool(edit_tool, tools)
    texts = [render_system_prompt(select_tools(tuple(tools)), system_preamble)]
    for task, solution in toy_tasks(n, seed):
        replies = script(task, solution, random.Random(f"{seed}/{task.id}"), tools=tuple(tools) or None,
                         edit_tool=edit_tool)
        texts.append("\n".join([task.prompt, *replies]))
    return texts


def tokenizer_agent_text(config) -> tuple[list[str], list[str]]:
    """(texts, symbols) of the agent's format for a tokenizer trained with data.tokenizer_agent_text
    (coder.data.tokenizer.load_or_train's `agent_text`): the system prompt and scripted replies of
    the SFT toy transcripts (rl.tools, sft.toy_tasks, sft.toy_edit_tool), and the fixed text of the
    offered tools' calls as one piece each (protocol.call_fragments): the call syntax of a tiny
    model's replies is then a few tokens it cannot break midway."""
    tools = tuple(config.rl.tools)
    texts = toy_agent_texts(int(config.sft.toy_tasks), int(config.seed), tools=tools,
                            system_preamble=config.rl.system_prompt or None, edit_tool=config.sft.toy_edit_tool)
    return texts, call_fragments(select_tools(tools))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m coder.env.transcripts")
    p.add_argument("--tasks", required=True)
    p.add_argument("--solutions", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--tools", default="", help="comma-separated tools the agent is offered, as the "
                   "RL run's rl.tools (default: all); they choose the script (module docstring)")
    p.add_argument("--edit-tool", default="edit_file", choices=EDIT_TOOLS)
    args = p.parse_args(argv)
    tools = tuple(t for t in args.tools.split(",") if t)
    try:
        select_tools(tools)
        check_edit_tool(args.edit_tool, tools)
    except ValueError as e:
        p.error(str(e))
    kw = {"tools": tools, "edit_tool": args.edit_tool}
    tasks = read_tasks(args.tasks)
    sols = read_solutions(args.solutions)
    patches = sorted(k for k, v in sols.items() if isinstance(v, str))
    if patches:  # the scripted agent writes files; a diff would need the repository's text
        p.error(f"patch solutions {patches[:3]}: transcripts need {{'id', 'files'}} solutions")
    todo = [(t, sols[t.id], args.seed, kw) for t in tasks if t.id in sols]
    with EpisodePool(max(1, min(args.workers, len(todo) or 1)), token_count=len) as pool:
        results = pool.map(_one, todo)
    convs = [c for _, c, _ in results if c is not None]
    for tid, c, info in results:
        if c is None:
            print(
                f"dropped {tid}: {info.get('score_error') or info.get('infra_error')}",
                file=sys.stderr,
            )
    write_jsonl(args.out, convs)
    print(f"wrote {len(convs)} of {len(todo)} conversations to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
