"""Pool of sandboxed episodes, the CLIs, and SFT transcripts."""

import dataclasses
import json
import os
import subprocess
import sys

from coder.env.pool import EpisodePool
from coder.env.protocol import parse_tool_calls, render_tool_call as rc
from coder.env.tasks import toy_tasks
from coder.env.tools.registry import SPECS
from coder.env.transcripts import minimal_edit, transcript

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _square(x):
    return x * x


def test_pool_runs_episodes_in_parallel_workers():
    pairs = toy_tasks(3, seed=1)
    with EpisodePool(2, token_count=len) as pool:
        assert pool.map(_square, [1, 2, 3, 4]) == [1, 4, 9, 16]
        obs = pool.reset([(i, t, None) for i, (t, _) in enumerate(pairs)])
        assert obs == [t.prompt for t, _ in pairs]
        assert sorted(pool._owner.values()) == [0, 0, 1]  # spread over both workers
        outs = pool.step(
            [
                (i, rc("write_file", {"path": "answer.py", "content": s["answer.py"]}))
                for i, (_, s) in enumerate(pairs)
            ]
        )
        assert all(not done and "wrote" in o for o, done, _ in outs)
        # two submit; the third replies without a call, which ends it and scores it as it is
        outs = pool.step([(0, rc("submit", {})), (1, rc("submit", {})), (2, "no call")])
        assert [o[2]["reward"] for o in outs] == [1.0, 1.0, 1.0]
        assert [o[2]["done_reason"] for o in outs] == ["submit", "submit", "no_tool_call"]
        assert outs[0][2]["messages"][-1]["role"] == "assistant" and not pool._owner


def test_make_tasks_and_check_cli(tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "coder.env.make_tasks",
            "--source",
            "toy",
            "--n",
            "3",
            "--seed",
            "2",
            "--out",
            str(tmp_path / "t.jsonl"),
            "--solutions",
            str(tmp_path / "s.jsonl"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    sols = [json.loads(line) for line in open(tmp_path / "s.jsonl")]
    sols[1]["files"] = {}  # no change: the bug stays
    with open(tmp_path / "s2.jsonl", "w") as f:
        for s in sols[:2]:
            f.write(json.dumps(s) + "\n")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "coder.env.check",
            "--tasks",
            str(tmp_path / "t.jsonl"),
            "--solutions",
            str(tmp_path / "s2.jsonl"),
            "--workers",
            "2",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    ids = [json.loads(line)["id"] for line in open(tmp_path / "t.jsonl")]
    assert [r["id"] for r in rows] == ids
    assert all(set(r) == {"id", "reward", "passed", "total", "error"} for r in rows)
    assert (rows[0]["reward"], rows[0]["passed"], rows[0]["error"]) == (1.0, rows[0]["total"], None)
    assert rows[1]["reward"] == 0.0 and rows[1]["error"]
    assert rows[2]["error"] == "no solution"


def test_transcript_follows_the_agent_loop_format():
    ((task, sol),) = toy_tasks(1, seed=9)
    conv, info = transcript(task, sol, seed=0)
    assert info["reward"] == 1.0 and info["done_reason"] == "submit"
    msgs = conv["messages"]
    assert [m["role"] for m in msgs[:2]] == ["system", "user"] and msgs[1]["content"] == task.prompt
    assert all(set(m) == {"role", "content"} for m in msgs)
    for a, b in zip(msgs[2::2], msgs[3::2], strict=False):  # assistant / tool alternate
        assert a["role"] == "assistant" and b["role"] == "tool"
        calls = parse_tool_calls(a["content"], SPECS)
        assert calls and all(hasattr(c, "name") for c in calls)
        assert b["content"].count("<tool_result>") == len(calls)
    assert (
        msgs[-1]["role"] == "assistant"
        and parse_tool_calls(msgs[-1]["content"], SPECS)[0].name == "submit"
    )
    assert any("1 passed" in m["content"] for m in msgs if m["role"] == "tool")  # real output


def test_transcript_of_an_underspecified_task_asks_the_user_first():
    """With ask_user offered, the script asks on a vague prompt (the simulated user's answer is
    the specification) and never on a complete one."""
    tasks = toy_tasks(12, seed=9, underspecified=0.5)
    (vague, sol), (plain, plain_sol) = (next(x for x in tasks if x[0].metadata["underspecified"] == v)
                                         for v in (True, False))
    tools = ("ask_user", "read_file", "edit_file", "run_tests", "submit")
    conv, info = transcript(vague, sol, seed=0, tools=tools)
    assert info["reward"] == 1.0 and info["clarification_needed"] is True
    first = parse_tool_calls(conv["messages"][2]["content"], SPECS)
    assert [c.name for c in first] == ["ask_user"]
    assert vague.metadata["specification"] in conv["messages"][3]["content"]
    conv, info = transcript(plain, plain_sol, seed=0, tools=tools)
    assert info["clarification_needed"] is False
    assert all("ask_user" not in m["content"] for m in conv["messages"][2:])


def test_transcript_with_write_file_rewrites_the_file_whole():
    import random

    import pytest

    from coder.env.transcripts import script, toy_agent_texts

    ((task, sol),) = toy_tasks(1, seed=9)
    tools = ("write_file", "submit")
    conv, info = transcript(task, sol, seed=9, edit_tool="write_file", tools=tools)
    assert info["reward"] == 1.0 and info["done_reason"] == "submit"
    calls = [c for m in conv["messages"] if m["role"] == "assistant" for c in parse_tool_calls(m["content"], SPECS)]
    assert [c.name for c in calls] == ["write_file", "submit"]  # only the offered tools
    assert calls[0].arguments == {"path": "answer.py", "content": sol["answer.py"]}
    # the text a tokenizer learns the agent's format from: the same replies, no sandbox
    system, text = toy_agent_texts(1, 9, tools=tools, edit_tool="write_file")
    assert system == conv["messages"][0]["content"]
    assert text == "\n".join([task.prompt] + [m["content"] for m in conv["messages"] if m["role"] == "assistant"])
    with pytest.raises(ValueError, match="edit_file', 'write_file"):
        next(script(task, sol, random.Random(0), edit_tool="patch"))
    with pytest.raises(ValueError, match="not among the offered tools"):
        next(script(task, sol, random.Random(0), tools=("edit_file", "submit"), edit_tool="write_file"))


def test_harness_transcript_turns_parse_back_and_hold_the_tools_outputs():
    """Every tool offered (the harness script): multi-call turns parse back into their calls, and
    each tool message holds exactly what those calls output when run again one by one, in order,
    in a fresh sandbox of the task (test durations aside); the final message says what and why."""
    import re

    from coder.env.episode import Episode
    from coder.env.protocol import render_tool_results
    from coder.rl import communication

    ((task, sol),) = toy_tasks(1, seed=9)
    conv, info = transcript(task, sol, seed=0)
    assert info["reward"] == 1.0 and info["done_reason"] == "submit" and info["broken_calls"] == 0
    msgs = conv["messages"]
    turns = [parse_tool_calls(m["content"], SPECS) for m in msgs if m["role"] == "assistant"]
    assert [[c.name for c in t] for t in turns] == [
        ["run_tests", "search"], ["read_file", "grep"], ["diagnostics"], ["think", "edit_file"],
        ["run_tests", "diagnostics"], ["submit"]]  # no encoder here: no semantic_search; no repository: no notes
    assert [m["role"] for m in msgs[2:]] == ["assistant", "tool"] * 5 + ["assistant"]
    no_time = lambda s: re.sub(r" in \d+\.\d+s\b", " in Ts", s)
    ep = Episode(len)
    ep.reset(task)
    try:
        for turn, tool in zip(turns, msgs[3::2]):
            assert no_time(tool["content"]) == no_time(render_tool_results([ep.call(c) for c in turn]))
    finally:
        ep.close()
    assert "1 failed" in msgs[3]["content"] and "answer.py" in msgs[3]["content"].split("</tool_result>")[1]
    assert communication.judge(msgs[-1]["content"], ["answer.py"]).good


def test_harness_transcript_of_a_repository_task_uses_history_memory_and_semantic_search(dates_repo_task, tmp_path):
    """A repository task with the whole harness: notes and the changed file's history with the
    search in the first turn, a plan in the scratchpad before the edit, a note for the next task
    before submitting; the note is there afterwards."""
    from coder.env.tools.memory import Memory
    from coder.env.tools.semantic_search import SemanticSpec
    from configs import base

    memory = Memory.from_config(base.get_config().env, str(tmp_path / "memory"))
    semantic = SemanticSpec("tests.env.tools.search_inputs:make_word_encoder", cache_dir=str(tmp_path / "sem"))
    conv, info = transcript(dates_repo_task.task, dates_repo_task.solution, seed=0, memory=memory,
                            semantic=semantic)
    assert info["reward"] == 1.0 and info["broken_calls"] == 0
    msgs = conv["messages"]
    turns = [[c.name for c in parse_tool_calls(m["content"], SPECS)] for m in msgs if m["role"] == "assistant"]
    assert turns == [["run_tests", "search", "semantic_search", "memory_read", "repo_history"],
                     ["read_file", "grep"], ["diagnostics"], ["think", "edit_file"], ["run_tests", "diagnostics"],
                     ["memory_write", "submit"]]
    assert "speed up parse_iso" in msgs[3]["content"]  # the history of pkg/dates.py
    assert "pkg/dates.py:1-3 (score" in msgs[3]["content"].split("</tool_result>")[2]  # semantic_search
    # the next task of the repository reads it (a task's own later rollouts do not: coder.env.tools.memory.Scope)
    (note,) = memory.scope(dataclasses.replace(dates_repo_task.task, id=dates_repo_task.task.id + "/next")).notes("")
    assert "python -m pytest -q tests" in note and "pkg/dates.py (parse_iso)" in note


def test_the_offered_tools_choose_the_script_and_its_steps():
    """No sandbox: the replies alone. Without search / grep the direct script is unchanged; with
    grep alone it locates by grep; two changed files are read in one turn."""
    import dataclasses
    import random

    from coder.env.transcripts import script

    ((task, sol),) = toy_tasks(1, seed=9)
    names = lambda tools, t=task, s=sol: [[c.name for c in parse_tool_calls(r, SPECS)]
                                         for r in script(t, s, random.Random(0), tools=tools)]
    direct = ("read_file", "edit_file", "run_tests", "submit")  # configs/base.py's rl.tools
    assert names(direct) == [["run_tests"], ["read_file"], ["edit_file"], ["run_tests"], ["submit"]]
    assert list(script(task, sol, random.Random(0), tools=direct))[-1].startswith(
        ("The tests pass. Submitting.", "All tests pass, done."))
    assert names(("grep", "read_file", "edit_file", "submit")) == [["grep"], ["read_file"], ["edit_file"],
                                                                  ["submit"]]
    two = dataclasses.replace(task, files={**task.files, "util.py": "def g():\n    return 1\n"})
    sol2 = {**sol, "util.py": "def g():\n    return 2\n"}
    got = names(None, two, sol2)
    assert got[1] == ["read_file", "read_file", "grep", "grep"] and got[2] == ["diagnostics"] * 2
    assert got[-2] == ["run_tests", "diagnostics", "diagnostics"]
    assert "answer.py" in list(script(two, sol2, random.Random(0)))[-1] and "util.py" in list(
        script(two, sol2, random.Random(0)))[-1]


def test_transcripts_cli_offers_the_given_tools(tmp_path, capsys):
    """`--tools` / `--edit-tool`: the CLI's transcripts teach the RL run's tools (here the
    quickstart's two: the direct script); an unknown tool stops it at start-up."""
    import pytest

    from coder.env.tasks import write_jsonl
    from coder.env.transcripts import main

    ((task, sol),) = toy_tasks(1, seed=9)
    write_jsonl(tmp_path / "t.jsonl", [task.to_json()])
    write_jsonl(tmp_path / "s.jsonl", [{"id": task.id, "files": sol}])
    common = ["--tasks", str(tmp_path / "t.jsonl"), "--solutions", str(tmp_path / "s.jsonl"),
              "--workers", "1"]
    assert main(common + ["--out", str(tmp_path / "o.jsonl"), "--tools", "write_file,submit",
                          "--edit-tool", "write_file"]) == 0
    (conv,) = [json.loads(line) for line in open(tmp_path / "o.jsonl")]
    calls = [c.name for m in conv["messages"] if m["role"] == "assistant"
             for c in parse_tool_calls(m["content"], SPECS)]
    assert calls == ["write_file", "submit"] and '"name": "grep"' not in conv["messages"][0]["content"]
    with pytest.raises(SystemExit):
        main(common + ["--out", str(tmp_path / "x.jsonl"), "--tools", "write_file,sumbit"])
    assert "unknown tools ['sumbit']" in capsys.readouterr().err


def test_minimal_edit_is_unique():
    old = "a = 1\nb = 2\na = 1\nc = 3\n"
    new = "a = 1\nb = 2\na = 5\nc = 3\n"
    o, n, lo, hi = minimal_edit(old, new)
    assert old.count(o) == 1 and old.replace(o, n) == new and lo <= 3 <= hi


def test_per_call_interface_runs_different_workers_in_parallel():
    import threading
    import time

    from coder.env.pool import PooledEpisode
    from coder.env.protocol import ToolCall

    pairs = toy_tasks(2, seed=3)
    with EpisodePool(2, token_count=len) as pool:
        eps = [PooledEpisode(pool, t) for t, _ in pairs]
        assert sorted(pool._owner.values()) == [0, 1]  # one episode per worker
        assert [s.name for s in eps[0].tools] == [s.name for s in SPECS]
        spans, errors = {}, []

        def work(i):
            try:
                t0 = time.perf_counter()
                out = eps[i].call(ToolCall("shell", {"command": "sleep 1; echo slept"}, ""))
                spans[i] = (t0, time.perf_counter())
                assert "slept" in out
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert max(s for s, _ in spans.values()) < min(e for _, e in spans.values())  # overlapped
        # The episode interface end to end: fix, submit, score.
        (_, sol), ep = pairs[0], eps[0]
        out = ep.call(ToolCall("write_file", {"path": "answer.py", "content": sol["answer.py"]}, ""))
        assert out.startswith("wrote") and not ep.done
        assert ep.call(ToolCall("submit", {}, "")) == "submitted" and ep.done
        reward, info = ep.score()
        assert reward == 1.0 and info["infra_error"] is None
        for e in eps:
            e.close()
        assert not pool._owner


def test_per_call_interface_serializes_one_worker():
    import threading
    import time

    from coder.env.protocol import ToolCall

    pairs = toy_tasks(2, seed=4)
    with EpisodePool(1, token_count=len) as pool:
        for i, (t, _) in enumerate(pairs):
            pool.open(i, t)
        spans = {}

        def work(i):
            t0 = time.perf_counter()
            pool.call(i, ToolCall("shell", {"command": "sleep 0.5"}, ""))
            spans[i] = (t0, time.perf_counter())

        threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert max(e for _, e in spans.values()) - min(s for s, _ in spans.values()) >= 1.0


def test_dead_worker_turns_calls_into_infra_errors_and_is_restarted():
    import pytest

    from coder.env.pool import PooledEpisode
    from coder.env.protocol import ToolCall
    from coder.env.runtime.sandbox import InfraError

    ((task, _),) = toy_tasks(1, seed=6)
    with EpisodePool(1, token_count=len, tools=("shell", "submit")) as pool:
        ep = PooledEpisode(pool, task)
        assert [s.name for s in ep.tools] == ["shell", "submit"]
        assert "exit code: 0" in ep.call(ToolCall("shell", {"command": "true"}, ""))
        pool._workers[0].proc.kill()
        pool._workers[0].proc.join()
        with pytest.raises(InfraError, match="died"):
            ep.call(ToolCall("shell", {"command": "true"}, ""))
        with pytest.raises(InfraError):
            ep.score()
        ep.close()
        fresh = PooledEpisode(pool, task)  # the worker is restarted for new episodes
        assert not fresh.error and "exit code: 0" in fresh.call(ToolCall("shell", {"command": "true"}, ""))
        with pytest.raises(InfraError):  # the lost episode stays lost
            ep.call(ToolCall("shell", {"command": "true"}, ""))
        fresh.close()
    with pytest.raises(ValueError, match="unknown tools"):
        EpisodePool(1, token_count=len, tools=("teleport",))


def test_hung_worker_times_out_as_infra_error():
    import pytest

    from coder.env.protocol import ToolCall
    from coder.env.runtime.sandbox import InfraError

    ((task, _),) = toy_tasks(1, seed=7)
    with EpisodePool(1, timeout_s=3.0, token_count=len) as pool:
        pool.open("a", task)
        with pytest.raises(InfraError, match="took more than"):
            pool.call("a", ToolCall("shell", {"command": "sleep 20"}, ""))
        pool.open("b", task)  # the killed worker is restarted
        assert "exit code: 0" in pool.call("b", ToolCall("shell", {"command": "true"}, ""))


def test_pooled_turn_runs_its_independent_calls_concurrently():
    import dataclasses
    import time

    from coder.env.pool import PooledEpisode
    from coder.env.protocol import ToolCall

    ((task, _),) = toy_tasks(1, seed=8)
    task = dataclasses.replace(task, test_command="sleep 1; echo ran")  # run_tests: 1 s each
    with EpisodePool(1, token_count=len) as pool:
        ep = PooledEpisode(pool, task)
        calls = [ToolCall("run_tests", {"path": p}, "") for p in "abc"]
        calls += [ToolCall("submit", {}, ""), ToolCall("run_tests", {}, "")]
        t0 = time.perf_counter()
        outs = ep.call_many(calls)
        took = time.perf_counter() - t0
        assert outs == [f"exit code: 0\nran {p}" for p in "abc"] + ["submitted"] and ep.done
        assert took < 0.6 * 3 * 1.0, took  # one after another: over 3 s
        ep.close()
