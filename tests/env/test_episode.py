"""Episode: text and per-call interfaces, ending conditions, counters, infra errors."""

import os

import pytest

from coder.env.runtime import sandbox as sandbox_lib
from coder.env.episode import Episode
from coder.env.protocol import ToolCall, render_tool_call as rc
from coder.env.runtime.sandbox import InfraError
from coder.env.tasks import toy_tasks

((TASK, SOLUTION),) = toy_tasks(1, seed=5)


def test_token_count_is_required():
    with pytest.raises(TypeError):
        Episode(None)


def test_solve_toy_task_by_text():
    ep = Episode(len)
    assert ep.reset(TASK) == TASK.prompt
    obs, done, info = ep.step(
        "Look. " + rc("read_file", {"path": "answer.py"}) + rc("shell", {"command": "ls"})
    )
    assert not done and obs.count("<tool_result>") == 2 and "test_answer.py" in obs
    assert info["turns"] == 1 and info["tool_calls"] == 2 and info["broken_calls"] == 0
    assert info["tool_output_chars"] == len(obs) == info["tool_output_tokens"]
    obs, done, info = ep.step(
        rc("write_file", {"path": "answer.py", "content": SOLUTION["answer.py"]})
        + rc("submit", {})
        + rc("shell", {"command": "touch late"})
    )
    assert done and info["done_reason"] == "submit"
    assert "1 call(s) after submit were not run" in obs
    assert (info["reward"], info["passed"], info["total"], info["infra_error"]) == (1.0, 1, 1, None)
    roles = [m["role"] for m in ep.messages]
    assert roles == ["system", "user", "assistant", "tool", "assistant"]
    assert ep.sandbox is None  # closed once scored
    with pytest.raises(RuntimeError):
        ep.step(rc("submit", {}))


def test_broken_call_is_reported_and_fails_the_rollout():
    ep = Episode(lambda s: len(s.split()))
    ep.reset(TASK)
    obs, done, info = ep.step('<tool_call>{"name": "write_file"}</tool_call>')
    assert not done and "broken tool call" in obs and info["broken_calls"] == 1
    _, done, info = ep.step(
        rc("write_file", {"path": "answer.py", "content": SOLUTION["answer.py"]}) + rc("submit", {})
    )
    assert done and info["passed"] == info["total"] == 1  # the tests pass ...
    assert info["reward"] == 0.0 and "broken" in info["score_error"]  # ... but the rollout fails


def test_ends_without_tool_call_and_on_turn_limit_and_budget():
    ep = Episode(len, max_turns=2)
    ep.reset(TASK)
    _, done, info = ep.step("I give up.")
    assert done and info["done_reason"] == "no_tool_call" and info["reward"] == 0.0
    ep.reset(TASK)
    ep.step(rc("shell", {"command": "true"}))
    _, done, info = ep.step(rc("shell", {"command": "true"}))
    assert done and info["done_reason"] == "max_turns" and info["turns"] == 2
    ep = Episode(len, max_tool_output_tokens=50)
    ep.reset(TASK)
    _, done, info = ep.step(rc("shell", {"command": "seq 1 100"}))
    assert done and info["done_reason"] == "budget" and info["tool_output_tokens"] >= 50


def test_per_call_interface_and_snapshot():
    ep = Episode(len)
    ep.reset(TASK)
    snap = ep.sandbox.snapshot()
    out = ep.step(
        ToolCall("write_file", {"path": "answer.py", "content": SOLUTION["answer.py"]}, "")
    )
    assert out.startswith("wrote")
    assert ep.call(ToolCall("submit", {}, "")) == "submitted" and ep.done
    reward, info = ep.score()
    assert reward == 1.0 and ep.score()[0] == 1.0  # scored once
    ep.reset(TASK, snapshot=snap)  # G rollouts start from one snapshot
    assert ep.sandbox.read("answer.py") == TASK.files["answer.py"]
    ep.close()


def test_sandbox_start_failure_is_an_infra_error(monkeypatch):
    def broken():
        raise sandbox_lib.SandboxError("bwrap exploded")

    monkeypatch.setattr(sandbox_lib, "find_bwrap", broken)
    ep = Episode(len)
    ep.reset(TASK)
    obs, done, info = ep.step(rc("submit", {}))
    assert done and "bwrap exploded" in info["infra_error"] and info["reward"] is None
    with pytest.raises(InfraError):
        ep.call(ToolCall("shell", {"command": "true"}, ""))


def test_tool_crash_is_an_infra_error(monkeypatch):
    from coder.env.tools import registry as tools

    def crash(ctx, args):
        raise KeyError("harness bug")

    monkeypatch.setitem(tools.FUNCTIONS, "grep", crash)
    ep = Episode(len)
    ep.reset(TASK)
    obs, done, info = ep.step(rc("grep", {"pattern": "x"}))
    assert done and "harness bug" in info["infra_error"] and info["reward"] is None
    assert ep.sandbox is None


def test_from_config_reads_the_env_section():
    from configs.base import get_config

    cfg = get_config().env
    ep = Episode.from_config(cfg, len, max_turns=3)
    assert ep.limits.memory_bytes == cfg.memory_mb << 20 and ep.limits.nproc == cfg.nproc
    assert ep.max_tool_output_tokens == cfg.max_tool_output_tokens and ep.max_turns == 3
    cfg.history_depth = 5  # repo history copied into a repository task's workspace (test_tools)
    assert Episode.from_config(cfg, len).limits.history_depth == 5
    cfg.history_depth = 0
    with pytest.raises(ValueError, match="env.history_depth=0"):
        Episode.from_config(cfg, len)


def test_tools_selection_timeout_and_lint_count():
    ep = Episode(len, tools=("read_file", "submit"), tool_timeout_s=7.0)
    assert [t.name for t in ep.tools] == ["read_file", "submit"] and ep.tool_timeout_s == 7.0
    assert "shell" not in ep.system_prompt and "read_file" in ep.system_prompt
    with pytest.raises(ValueError, match="unknown tools"):
        Episode(len, tools=("read_file", "teleport"))
    ep.reset(TASK)
    with pytest.raises(ValueError, match="not offered"):
        ep.call(ToolCall("shell", {"command": "true"}, ""))
    ep.sandbox.write("bad.py", "import os\nx = undefined_name\n")
    assert ep.lint_count() >= 2  # F401 unused import, F821 undefined name
    ep.sandbox.write("bad.py", "x = 1\n")
    assert ep.lint_count() == 0
    ep.close()


def test_independent_calls_of_a_turn_run_concurrently_in_order():
    import dataclasses
    import time

    # run_tests runs the task's test command in a fresh sandbox process: here a 0.5 s sleep.
    task = dataclasses.replace(TASK, test_command="sleep 0.5; echo tests of")
    ep = Episode(len)
    ep.reset(task)
    calls = [ToolCall("run_tests", {"path": p}, "") for p in ("a", "b", "c")]
    t0 = time.monotonic()
    serial = [ep.call(c) for c in calls]
    serial_s = time.monotonic() - t0
    t0 = time.monotonic()
    outs = ep.call_many(calls)
    parallel_s = time.monotonic() - t0
    assert outs == serial == [f"exit code: 0\ntests of {p}" for p in ("a", "b", "c")]
    assert parallel_s < 0.6 * serial_s, (parallel_s, serial_s)  # ~1/3 unloaded
    assert ep.info["tool_calls"] == 6
    ep.close()


def test_calls_that_change_the_workspace_keep_their_order():
    ep = Episode(len)
    ep.reset(TASK)
    w = ToolCall("write_file", {"path": "n.txt", "content": "1"}, "")
    r = ToolCall("read_file", {"path": "n.txt"}, "")
    sh = ToolCall("shell", {"command": "echo 2 >> n.txt; cat n.txt"}, "")
    outs = ep.call_many([r, w, r, r, sh, r, ToolCall("submit", {}, ""), w])
    assert outs[0].startswith("error") and outs[1].startswith("wrote")
    assert outs[2] == outs[3] == "1\t1" and outs[4] == "exit code: 0\n12" and outs[5] == "1\t12"
    assert outs[6] == "submitted" and len(outs) == 7 and ep.done  # nothing after submit runs
    assert ep.sandbox.read("n.txt") == "12\n"
    ep.close()


def test_scoring_closes_the_shell_first(monkeypatch):
    from coder.env.scoring import score as reward

    seen = {}

    def score(sb, *a, **k):  # the sandbox's processes alive when scoring starts (host view)
        seen["jobs"] = [n for n, uid in _host_procs() if uid == sb.uid and n != "bwrap"]
        return real(sb, *a, **k)

    real = reward.score
    monkeypatch.setattr(reward, "score", score)
    ep = Episode(len)
    ep.reset(TASK)
    ep.call(ToolCall("write_file", {"path": "answer.py", "content": SOLUTION["answer.py"]}, ""))
    ep.call(ToolCall("shell", {"command": "sleep 100 &"}, ""))  # would live on into scoring
    ep.call(ToolCall("submit", {}, ""))
    sb = ep.sandbox
    assert ep.score()[0] == 1.0 and ep.terminal is None
    assert seen["jobs"] == []
    assert sb.closed


def _host_procs() -> list[tuple[str, int]]:
    """(command name, uid) of the live processes of the host."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        if not fields["State"].strip().startswith("Z"):
            out.append((fields["Name"].strip(), int(fields["Uid"].split()[0])))
    return out


def test_phases_keep_writers_alone_and_file_tools_apart_from_tests():
    from coder.env.episode import _phases

    turn = "read_file grep lint write_file run_tests run_tests grep read_file shell think search"
    phases = _phases([ToolCall(n, {}, "") for n in turn.split()])
    assert [[c.name for c in p] for p in phases] == [
        ["read_file", "grep", "lint"],
        ["write_file"],
        ["run_tests", "run_tests", "grep"],
        ["read_file"],  # not beside the tests: the agent's code could race its path check
        ["shell"],
        ["think", "search"],
    ]
