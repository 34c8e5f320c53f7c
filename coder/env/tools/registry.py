"""The agent's tools, one registry (`TOOLS`). Each is a `Tool`, defined once: its `ToolSpec`
(name, description, JSON schema, rendered into the system prompt by `coder.env.protocol`), its
function `(ToolContext, arguments) -> str`, and how its calls share a turn (whether it changes
state, opens workspace paths from the host, runs the agent's code: `may_overlap`). SPECS,
FUNCTIONS, EXCLUSIVE, HOST_SIDE and RUNS_AGENT_CODE are read off it.

Commands the model chooses run inside the sandbox: `shell` in the episode's persistent terminal
(coder.env.runtime.terminal: cwd, variables and background jobs carry over between calls), grep, lint
and tests each in a fresh process (`Sandbox.run`), so the agent's shell state cannot change
what they report. File reads and writes run on the host but are confined to the workspace by
`Sandbox.resolve`; so are grep's paths. `search` (BM25) and `semantic_search` (embeddings,
coder.env.tools.semantic_search; `ToolContext.semantic`, off when the episode has none) read the
workspace's files from the host. `repo_history` runs git in a fresh process over the
workspace's own history (HEAD's ancestry: coder/env/sources/repo.py copies no later commit).
`diagnostics` runs mypy (type errors, unresolved names) or jedi (definitions, references) in a
fresh sandbox process over the workspace (coder.env.tools.diagnostics says why these two).
`memory_write` / `memory_read` append to and read the notes of the task's repository
(coder.env.tools.memory, `ToolContext.memory`; off when the episode has no store). `think`
runs nothing: a scratchpad whose tokens count as thinking in the length penalty
(coder/rl/agent.py). `ask_user` is the simulated user: it answers from the task's hidden
specification when the prompt was underspecified.
Every output is cut to `ToolContext.max_output_chars` (head and tail kept) with a note saying
how much was cut. Tool errors the agent caused (missing file, non-unique edit) are ordinary
outputs starting with "error:"; only harness failures raise.
"""

from __future__ import annotations

import dataclasses
import shlex
from typing import Callable

from coder.env.tools import diagnostics as diagnostics_lib
from coder.env.tools import search as search_lib
from coder.env.tools import semantic_search as semantic_lib
from coder.env.tools.memory import Scope
from coder.env.protocol import ToolSpec
from coder.env.runtime.sandbox import Result, Sandbox
from coder.env.runtime.terminal import Terminal

SUBMIT = "submit"
THINK = "think"
ASK_USER = "ask_user"


@dataclasses.dataclass(frozen=True)
class Tool:
    """One tool, defined once: its spec (name, description, JSON schema), how it runs, and how its
    calls may share a turn with others (`may_overlap`)."""

    spec: ToolSpec
    run: Callable[["ToolContext", dict], str]
    # changes state (the workspace, which shell may change; memory_write the notes): runs alone
    # among the calls of a turn, after the calls before it (coder.env.episode.Episode.call_many);
    # the shell's session is one terminal
    changes_state: bool = False
    # opens workspace paths from the host: runs with the terminal's processes stopped
    # (`Terminal.frozen`), so a background job cannot race its path checks, and never beside a
    # tool that runs the agent's code (its tests), which could race them the same way
    host_paths: bool = False
    # runs the agent's code (diagnostics: mypy loads the plugins a repository's configuration names)
    runs_agent_code: bool = False


def may_overlap(a: str, b: str) -> bool:
    """Whether calls of tools `a` and `b` in one turn may run at the same time."""
    if a in EXCLUSIVE or b in EXCLUSIVE:
        return False
    return not ({a, b} & HOST_SIDE and {a, b} & RUNS_AGENT_CODE)


@dataclasses.dataclass
class ToolContext:
    sandbox: Sandbox
    task: object  # coder.env.tasks.Task
    max_output_chars: int = 8000  # each tool output is cut to this many characters
    command_timeout_s: float = 60.0  # default and cap for shell/grep/lint/run_tests
    # the shell's session; None: a new one, closed with the sandbox (an episode passes its own)
    terminal: Terminal | None = None
    # the notes of this task's (run, split, repository): coder.env.tools.memory; None: memory is off
    memory: Scope | None = None
    # the encoder, cache and chunking of semantic_search (coder.env.tools.semantic_search); None: off
    semantic: semantic_lib.SemanticSpec | None = None

    def __post_init__(self):
        if self.terminal is None:
            self.terminal = Terminal(self.sandbox, self.command_timeout_s)


def cap(text: str, limit: int) -> str:
    """Keep the first and last limit/2 characters, with a note saying how many were cut."""
    if len(text) <= limit:
        return text
    half = limit // 2
    cut = len(text) - 2 * half
    return f"{text[:half]}\n[... {cut} characters cut from this output ...]\n{text[len(text) - half :]}"


def _format_result(r: Result) -> str:
    parts = [f"exit code: {r.exit_code}"]
    if r.timed_out:
        parts[0] += " (timed out)"
    if r.stdout:
        parts.append(r.stdout.rstrip("\n"))
    if r.stderr:
        parts.append("[stderr]\n" + r.stderr.rstrip("\n"))
    return "\n".join(parts)


def _timeout(ctx: ToolContext, args: dict) -> float:
    return min(float(args.get("timeout_s", ctx.command_timeout_s)), ctx.command_timeout_s)


def shell(ctx: ToolContext, args: dict) -> str:
    return _format_result(ctx.terminal.run(args["command"], timeout_s=_timeout(ctx, args)))


def read_file(ctx: ToolContext, args: dict) -> str:
    try:
        text = ctx.sandbox.read(args["path"])
    except (ValueError, OSError) as e:
        return f"error: {e}"
    lines = text.splitlines()
    if not lines:
        return f"({args['path']} is empty)"
    start = args.get("start_line", 1)
    end = args.get("end_line", len(lines))
    if start > len(lines):
        return f"error: {args['path']} has {len(lines)} lines; start_line {start} is past the end"
    if end < start:
        return f"error: end_line {end} < start_line {start}"
    width = len(str(min(end, len(lines)) or 1))
    return "\n".join(
        f"{i:>{width}}\t{lines[i - 1]}" for i in range(start, min(end, len(lines)) + 1)
    )


def write_file(ctx: ToolContext, args: dict) -> str:
    try:
        ctx.sandbox.write(args["path"], args["content"])
    except (ValueError, OSError) as e:
        return f"error: {e}"
    return f"wrote {len(args['content'].encode())} bytes to {args['path']}"


def edit_file(ctx: ToolContext, args: dict) -> str:
    path, old, new = args["path"], args["old"], args["new"]
    if not old:
        return "error: old is empty; give the exact text to replace"
    if old == new:
        return "error: old and new are identical; nothing to change"
    try:
        text = ctx.sandbox.read(path)
    except (ValueError, OSError) as e:
        return f"error: {e}"
    n = text.count(old)
    if n == 0:
        hint = ""
        if old.strip() and old.strip() in text:
            hint = " (it matches if leading/trailing whitespace is ignored: copy it exactly)"
        return f"error: old text not found in {path}{hint}"
    if n > 1:
        lines, at = [], 0
        for _ in range(n):
            at = text.index(old, at)
            lines.append(text.count("\n", 0, at) + 1)
            at += 1
        return (
            f"error: old text occurs {n} times in {path} (lines {lines}); include more "
            "surrounding text so it matches exactly once"
        )
    ctx.sandbox.write(path, text.replace(old, new, 1))
    line = text.count("\n", 0, text.index(old)) + 1
    return f"edited {path} at line {line}"


def grep(ctx: ToolContext, args: dict) -> str:
    path = args.get("path", ".")
    try:  # the sandbox shows more than the workspace (/usr, the Python prefixes): not grep's
        ctx.sandbox.resolve(path)
    except ValueError as e:
        return f"error: {e}"
    flags = "-rnI" + ("i" if args.get("ignore_case") else "")
    cmd = f"grep {flags} -E -e {shlex.quote(args['pattern'])} -- {shlex.quote(path)}"
    r = ctx.sandbox.run(cmd, timeout_s=min(30.0, ctx.command_timeout_s))
    if r.exit_code == 1 and not r.stderr:
        return "no matches"
    if r.exit_code not in (0, 1) or r.timed_out:
        return "error: " + _format_result(r)
    return r.stdout.rstrip("\n")


def workspace_files(ctx: ToolContext) -> dict[str, str]:
    """{path: text} of the workspace's text files (the search tools' corpus)."""
    files = {}
    for rel in ctx.sandbox.list_files():
        if rel == ".git" or rel.startswith(".git/"):
            continue  # the repository's object store and hook samples are not its code
        try:
            text = ctx.sandbox.read(rel)
        except (ValueError, OSError):
            continue
        if "\0" not in text[:4096] and len(text) < 2_000_000:
            files[rel] = text
    return files


def _format_hits(hits) -> str:
    if not hits:
        return "no results"
    return "\n\n".join(f"{c.path}:{c.start}-{c.end} (score {s:.2f})\n{c.text}" for s, c in hits)


def search(ctx: ToolContext, args: dict) -> str:
    return _format_hits(search_lib.search(workspace_files(ctx), args["query"], k=args.get("k", 5)))


def semantic_search(ctx: ToolContext, args: dict) -> str:
    if ctx.semantic is None:
        return "semantic search is off in this episode (env.semantic_encoder is empty); use search"
    hits = semantic_lib.search(ctx.semantic, ctx.task, workspace_files(ctx), args["query"],
                               k=args.get("k", 5))
    return _format_hits(hits)


def lint(ctx: ToolContext, args: dict) -> str:
    path = args.get("path", ".")
    cmd = f"ruff check --no-cache --output-format concise --quiet -- {shlex.quote(path)}"
    r = ctx.sandbox.run(cmd, timeout_s=min(60.0, ctx.command_timeout_s))
    if r.exit_code == 0:
        return "no lint errors"
    return _format_result(r)


def run_tests(ctx: ToolContext, args: dict) -> str:
    cmd = ctx.task.test_command
    if args.get("path"):
        cmd += " " + shlex.quote(args["path"])
    return _format_result(ctx.sandbox.run(cmd, timeout_s=ctx.command_timeout_s))


HISTORY_MAX_COUNT = 200  # most commits one `repo_history` log lists
_SHALLOW_NOTE = (
    "[shallow history: only the commits listed were copied into this workspace (env.history_depth);"
    " earlier ones are not available]"
)


def _git(*args: str) -> str:
    return "git --no-pager -c color.ui=never -c core.quotepath=off " + " ".join(map(shlex.quote, args))


def repo_history(ctx: ToolContext, args: dict) -> str:
    """The workspace's git history, read by git inside the sandbox: `log` (one line per commit,
    newest first, at most `max_count`), `show` (one commit's message and diff), `blame` (lines
    `start`..`end` of `path`). Every action reads HEAD's ancestry only (`show` refuses a commit
    that is not an ancestor of HEAD): the task's commit and what the workspace holds before it
    (coder/env/sources/repo.py copies no later commit, nor a ref to one). A workspace that is not a git
    repository, or whose history is shallow, is said so in plain words: the agent asked a fair
    question about the task, not a broken one."""
    t = min(30.0, ctx.command_timeout_s)
    run = lambda *a: ctx.sandbox.run(_git(*a), timeout_s=t)
    probe = run("rev-parse", "--is-shallow-repository")
    if probe.exit_code != 0:
        return "no git history: this task's workspace is not a git repository"
    if run("rev-parse", "--verify", "-q", "HEAD").exit_code != 0:
        return "no git history: the workspace's repository has no commits"
    shallow = probe.stdout.strip() == "true"
    action, path = args["action"], args.get("path")
    if path is not None:
        try:  # what git may read is the workspace's; the path check is grep's
            ctx.sandbox.resolve(path)
        except ValueError as e:
            return f"error: {e}"
    if action == "log":
        n = min(int(args.get("max_count", 20)), HISTORY_MAX_COUNT)
        r = run("log", "--oneline", "--no-decorate", f"-n{n}", "HEAD", "--", *([path] if path else []))
        out = r.stdout.rstrip("\n") or "no commits touch " + str(path)
    elif action == "show":
        commit = args.get("commit", "HEAD")
        sha = run("rev-parse", "--verify", "-q", "--end-of-options", f"{commit}^{{commit}}")
        if sha.exit_code != 0:
            why = " (the history is shallow: earlier commits were not copied in)" if shallow else ""
            return f"error: no commit {commit!r} in the workspace's history{why}"
        sha = sha.stdout.strip()
        if run("merge-base", "--is-ancestor", sha, "HEAD").exit_code != 0:
            return f"error: {commit!r} is not in the history of HEAD"
        r = run("show", "--no-decorate", "--stat", "--patch", sha, "--", *([path] if path else []))
        out, shallow = r.stdout.rstrip("\n"), False  # one commit: nothing to say about the rest
    elif action == "blame":
        if not path:
            return "error: blame needs a path"
        start, end = int(args.get("start", 1)), args.get("end")
        if end is not None and int(end) < start:
            return f"error: end {end} < start {start}"
        r = run("blame", "-L", f"{start},{'' if end is None else int(end)}", "HEAD", "--", path)
        out = r.stdout.rstrip("\n")
        if shallow:  # git marks the lines it could not follow further back with ^
            out += "\n[lines marked ^ come from the oldest commit copied in: they may be older]"
            shallow = False
    else:  # the schema's enum stops this before a call runs; kept for a direct call
        return f"error: unknown action {action!r}; one of log, show, blame"
    if r.exit_code != 0 or r.timed_out:
        return "error: " + _format_result(r)
    return out + ("\n" + _SHALLOW_NOTE if shallow else "")


_MEMORY_OFF = "memory is off in this episode: no notes are kept or read"


def memory_write(ctx: ToolContext, args: dict) -> str:
    """Appends a note to the task's memory scope (coder.env.tools.memory: same run, split and
    repository); off (said plainly) where the episode has no store."""
    return _MEMORY_OFF if ctx.memory is None else ctx.memory.write(args["note"])


def memory_read(ctx: ToolContext, args: dict) -> str:
    if ctx.memory is None:
        return _MEMORY_OFF
    query = args.get("query", "")
    notes = ctx.memory.notes(query)
    if not notes:
        return f"no notes{' containing ' + repr(query) if query else ''} for this repository yet"
    return "\n\n".join(f"[note {i}] {text}" for i, text in enumerate(notes, 1))


def think(ctx: ToolContext, args: dict) -> str:
    return "noted"


def ask_user(ctx: ToolContext, args: dict) -> str:
    """The simulated user: answers from the task's hidden specification
    (`metadata["specification"]`) when the prompt was underspecified, else says the task holds
    everything needed. Asking then pays only where it was needed: the answer is what makes an
    underspecified task solvable, and the `clarification` reward (coder.rl.reward) charges every
    question a task did not need."""
    spec = (getattr(ctx.task, "metadata", None) or {}).get("specification")
    if spec:
        return f"The user answers: {spec}"
    return "The user answers: the task says everything you need; please go ahead without asking."


def submit(ctx: ToolContext, args: dict) -> str:
    return "submitted"


_STR = {"type": "string"}


def _obj(props: dict, required: list) -> dict:
    return {
        "type": "object",
        "properties": props,
        "required": required,
        "additionalProperties": False,
    }


TOOLS = (
    Tool(
        ToolSpec(
            "shell",
            "Run a bash command in your terminal (starts in /workspace, no network). One shell "
            "session per task: cd, exported variables and background jobs (cmd &) persist between "
            "calls; stdin is empty. Returns the exit code, stdout and stderr.",
            _obj({"command": _STR, "timeout_s": {"type": "number", "minimum": 1}}, ["command"]),
        ),
        run=shell, changes_state=True, runs_agent_code=True,
    ),
    Tool(
        ToolSpec(
            "read_file",
            "Read a file, with line numbers; optionally only lines start_line.."
            "end_line (1-based, inclusive).",
            _obj(
                {
                    "path": _STR,
                    "start_line": {"type": "integer", "minimum": 1},
                    "end_line": {"type": "integer", "minimum": 1},
                },
                ["path"],
            ),
        ),
        run=read_file, host_paths=True,
    ),
    Tool(
        ToolSpec(
            "write_file",
            "Create or overwrite a file with the given content.",
            _obj({"path": _STR, "content": _STR}, ["path", "content"]),
        ),
        run=write_file, changes_state=True, host_paths=True,
    ),
    Tool(
        ToolSpec(
            "edit_file",
            "Replace the exact text old with new in a file; old must occur exactly once.",
            _obj({"path": _STR, "old": _STR, "new": _STR}, ["path", "old", "new"]),
        ),
        run=edit_file, changes_state=True, host_paths=True,
    ),
    Tool(
        ToolSpec(
            "grep",
            "Search files in the workspace for an extended regular expression; prints file:line:text.",
            _obj({"pattern": _STR, "path": _STR, "ignore_case": {"type": "boolean"}}, ["pattern"]),
        ),
        run=grep,
    ),
    Tool(
        ToolSpec(
            "search",
            "Search the code of the workspace for chunks relevant to a natural-"
            "language or identifier query (ranked by BM25).",
            _obj({"query": _STR, "k": {"type": "integer", "minimum": 1, "maximum": 20}}, ["query"]),
        ),
        run=search, host_paths=True,
    ),
    Tool(
        ToolSpec(
            "semantic_search",
            "Search the code of the workspace by meaning: the functions, classes and methods "
            "whose embedding is closest to a natural-language description (finds code that "
            "does what you describe even when it uses other words).",
            _obj({"query": _STR, "k": {"type": "integer", "minimum": 1, "maximum": 20}}, ["query"]),
        ),
        run=semantic_search, host_paths=True,
    ),
    Tool(
        ToolSpec(
            "lint",
            "Run the ruff linter on a path (default: the whole workspace).",
            _obj({"path": _STR}, []),
        ),
        run=lint,
    ),
    Tool(
        ToolSpec(
            "diagnostics",
            "Type checker and code navigation. action=check: type errors and unresolved names "
            "from mypy in path (default: the whole workspace). action=definition: where the name "
            "at path:line:column is defined; action=references: every use of it in the workspace "
            "(line and column 1-based; or give symbol with path and line instead of column, or "
            "symbol alone to find workspace definitions with that name).",
            _obj(
                {
                    "action": {"type": "string", "enum": list(diagnostics_lib.ACTIONS)},
                    "path": _STR,
                    "line": {"type": "integer", "minimum": 1},
                    "column": {"type": "integer", "minimum": 1},
                    "symbol": _STR,
                },
                ["action"],
            ),
        ),
        run=diagnostics_lib.diagnostics, runs_agent_code=True,
    ),
    Tool(
        ToolSpec(
            "run_tests",
            "Run the task's test command (optionally on one test path).",
            _obj({"path": _STR}, []),
        ),
        run=run_tests, runs_agent_code=True,
    ),
    Tool(
        ToolSpec(
            "repo_history",
            "The repository's git history up to the task's commit (never later commits): "
            "action=log lists commits, newest first (max_count, optionally only those touching "
            "path); action=show prints one commit's message and diff (commit, default HEAD; "
            "optionally only path); action=blame shows the commit that last changed each of lines "
            "start..end of path.",
            _obj(
                {
                    "action": {"type": "string", "enum": ["log", "show", "blame"]},
                    "commit": _STR,
                    "path": _STR,
                    "start": {"type": "integer", "minimum": 1},
                    "end": {"type": "integer", "minimum": 1},
                    "max_count": {"type": "integer", "minimum": 1, "maximum": HISTORY_MAX_COUNT},
                },
                ["action"],
            ),
        ),
        run=repo_history,
    ),
    Tool(
        ToolSpec(
            "memory_write",
            "Save a short note for your later tasks on this same repository (what you learned: "
            "layout, how to run things, pitfalls). Notes persist across tasks of this repository; "
            "they cannot be edited or deleted.",
            _obj({"note": _STR}, ["note"]),
        ),
        run=memory_write, changes_state=True,
    ),
    Tool(
        ToolSpec(
            "memory_read",
            "Read the notes saved by your earlier tasks on this repository (optionally only those "
            "containing query).",
            _obj({"query": _STR}, []),
        ),
        run=memory_read,
    ),
    Tool(
        ToolSpec(
            THINK,
            "Think: a scratchpad for planning or reasoning about what you found. Runs nothing, "
            "changes nothing.",
            _obj({"thought": _STR}, ["thought"]),
        ),
        run=think,
    ),
    Tool(
        ToolSpec(
            ASK_USER,
            "Ask the user a clarifying question when the task leaves out something you need to "
            "know; the user's answer comes back. Do not ask what the task or the code already says.",
            _obj({"question": _STR}, ["question"]),
        ),
        run=ask_user,
    ),
    Tool(
        ToolSpec(SUBMIT, "Finish: your changes in /workspace are the solution.", _obj({}, [])),
        run=submit,
    ),
)
SPECS = [t.spec for t in TOOLS]  # the order the system prompt lists them
FUNCTIONS = {t.spec.name: t.run for t in TOOLS}
EXCLUSIVE = frozenset(t.spec.name for t in TOOLS if t.changes_state)
HOST_SIDE = frozenset(t.spec.name for t in TOOLS if t.host_paths)
RUNS_AGENT_CODE = frozenset(t.spec.name for t in TOOLS if t.runs_agent_code)
if len(FUNCTIONS) != len(TOOLS):
    raise ValueError(f"two tools share a name: {sorted(t.spec.name for t in TOOLS)}")


def call(ctx: ToolContext, name: str, args: dict) -> str:
    """Run one validated tool call; the output is capped."""
    if name in HOST_SIDE:
        with ctx.terminal.frozen():
            return cap(FUNCTIONS[name](ctx, args), ctx.max_output_chars)
    return cap(FUNCTIONS[name](ctx, args), ctx.max_output_chars)
