"""SFT conversations that solve tasks with known solutions, recorded from real tool runs.

For a task and its reference solution a scripted agent runs the tests, reads the code around
the change, applies it with `edit_file` (the smallest unique replacement; `write_file` for new
files), runs the tests again and submits. With `edit_tool="write_file"` it writes each changed
file whole instead: the fixed file is all the agent produces, with no exact copy of the read
output to get right (a tiny model's edit_file calls break on that copy), and the transcript is
shorter. The script's replies are fed through the same
`Episode` the RL loop uses, so every tool message holds the real output of the call in a
sandbox, and the text follows the agent-loop format exactly (`coder.env.protocol`). Only
conversations whose episode scored reward 1 are kept.

    python -m coder.env.transcripts --tasks T.jsonl --solutions S.jsonl --out sft.jsonl

writes `{"messages": [{"role", "content"}, ...]}` per line (docs/contracts.md).
"""

from __future__ import annotations

import argparse
import difflib
import random
import sys

from coder.env.episode import Episode
from coder.env.pool import EpisodePool
from coder.env.protocol import render_tool_call
from coder.env.tasks import read_solutions, read_tasks, write_jsonl

_OPEN = (
    "Let me run the tests first to see what fails.",
    "I'll start by running the test suite.",
    "First, the failing tests.",
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


def script(task, solution: dict, rng: random.Random, tools=None, edit_tool: str = "edit_file"):
    """Yield the scripted agent's replies (a generator: it may look at nothing but the task).

    tools: the tool names the agent is offered (None: all); calls of tools not offered are
    left out, so the transcript teaches only calls the RL agent can make (issue #17).
    edit_tool: how a changed file is fixed: "edit_file" (the smallest unique replacement) or
    "write_file" (the whole new file)."""
    check_edit_tool(edit_tool, tools)
    offered = (lambda name: True) if tools is None else set(tools).__contains__
    if offered("run_tests"):
        yield rng.choice(_OPEN) + "\n" + render_tool_call("run_tests", {})
    for path in sorted(solution):
        new_text = solution[path]
        if path not in task.files:
            yield (
                rng.choice(_NEW).format(path=path)
                + "\n"
                + render_tool_call("write_file", {"path": path, "content": new_text})
            )
            continue
        old_text = task.files[path]
        if old_text == new_text:
            continue
        old, new, lo, hi = minimal_edit(old_text, new_text)
        if offered("read_file"):
            yield (
                rng.choice(_READ).format(path=path)
                + "\n"
                + render_tool_call(
                    "read_file", {"path": path, "start_line": max(1, lo - 8), "end_line": hi + 8}
                )
            )
        if edit_tool == "write_file":
            yield (
                rng.choice(_EDIT)
                + "\n"
                + render_tool_call("write_file", {"path": path, "content": new_text})
            )
            continue
        yield (
            rng.choice(_EDIT)
            + "\n"
            + render_tool_call("edit_file", {"path": path, "old": old, "new": new})
        )
    if offered("run_tests"):
        yield rng.choice(_TEST) + "\n" + render_tool_call("run_tests", {})
    yield rng.choice(_DONE) + "\n" + render_tool_call("submit", {})


def transcript(task, solution: dict, seed: int = 0, edit_tool: str = "edit_file",
               **episode_kwargs) -> tuple[dict | None, dict]:
    """({"messages": [...]} or None if the episode did not score 1, final info)."""
    episode_kwargs.setdefault("token_count", len)
    ep = Episode(**episode_kwargs)
    ep.reset(task)
    info = dict(ep.info)
    try:
        offered = [t.name for t in ep.tools] if episode_kwargs.get("tools") else None
        rng = random.Random(f"{seed}/{task.id}")
        for text in script(task, solution, rng, tools=offered, edit_tool=edit_tool):
            _, done, info = ep.step(text)
            if done:
                break
    finally:
        ep.close()
    ok = info.get("done_reason") == "submit" and info.get("reward") == 1.0
    return ({"messages": ep.messages} if ok else None), info


def _one(item):
    task, solution, seed = item
    conv, info = transcript(task, solution, seed)
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
    from coder.env.tasks import toy_tasks

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
    from coder.env.episode import select_tools
    from coder.env.protocol import render_system_prompt
    from coder.env.tasks import toy_tasks

    check_edit_tool(edit_tool, tools)
    texts = [render_system_prompt(select_tools(tuple(tools)), system_preamble)]
    for task, solution in toy_tasks(n, seed):
        replies = script(task, solution, random.Random(f"{seed}/{task.id}"), tools=tuple(tools) or None,
                         edit_tool=edit_tool)
        texts.append("\n".join([task.prompt, *replies]))
    return texts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m coder.env.transcripts")
    p.add_argument("--tasks", required=True)
    p.add_argument("--solutions", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=4)
    args = p.parse_args(argv)
    tasks = read_tasks(args.tasks)
    sols = read_solutions(args.solutions)
    patches = sorted(k for k, v in sols.items() if isinstance(v, str))
    if patches:  # the scripted agent writes files; a diff would need the repository's text
        p.error(f"patch solutions {patches[:3]}: transcripts need {{'id', 'files'}} solutions")
    todo = [(t, sols[t.id], args.seed) for t in tasks if t.id in sols]
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
