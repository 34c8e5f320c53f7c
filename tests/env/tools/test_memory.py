"""Agent memory (coder/env/tools/memory.py): notes persist across the trajectories of one repository
and split of a run, and are invisible across repositories, splits and runs."""

import pickle

import pytest

from coder.env import protocol
from coder.env.episode import Episode
from coder.env.tools.memory import Memory, repository_key
from coder.env.tasks import Task


def repo_task(tid, repo="octo/widgets"):
    return Task(tid, "p", {}, {}, source="swebench", metadata={"repo": repo})


def test_notes_persist_within_a_repository_and_split_only(tmp_path):
    mem = Memory(str(tmp_path / "memory"), eval_ids={"held1", "held2"})
    a, b, other = repo_task("a"), repo_task("b"), repo_task("c", repo="octo/gadgets")
    assert mem.scope(a).write("tests run with `pytest -q tests/`").startswith("noted (1 of")
    # another task of the repository, read through a fresh store object (another env worker)
    again = Memory(str(tmp_path / "memory"), eval_ids={"held1", "held2"})
    assert again.scope(b).notes() == ["tests run with `pytest -q tests/`"]
    assert mem.scope(other).notes() == []  # never across repositories
    # held-out tasks of the same repository: their own split, both ways
    held1, held2 = repo_task("held1"), repo_task("held2")
    assert mem.split(held1) == "eval" and mem.split(a) == "train"
    assert mem.scope(held1).notes() == []
    mem.scope(held1).write("the bug is in widgets/core.py")
    assert mem.scope(held2).notes() == ["the bug is in widgets/core.py"]
    assert mem.scope(repo_task("e")).notes() == ["tests run with `pytest -q tests/`"]  # nothing from eval
    assert Memory(str(tmp_path / "other-run")).scope(b).notes() == []  # another run's root
    # query: a case-insensitive substring; notes come back in write order
    mem.scope(b).write("widgets/core.py imports lazily")
    assert mem.scope(a).notes("CORE") == ["widgets/core.py imports lazily"]
    d = repo_task("d")
    assert len(mem.scope(d).notes()) == 2 and mem.scope(d).notes()[0].startswith("tests run")


def test_keys_caps_and_config(tmp_path):
    toy1, toy2 = Task("t1", "p", {}, {}, source="toy"), Task("t2", "p", {}, {}, source="toy")
    v1 = Task("j", "p", {}, {})  # a v1 JSONL task: source "jsonl"
    assert repository_key(toy1) == repository_key(toy2) == "source:toy" != repository_key(v1)
    assert repository_key(Task("r", "p", {}, {}, repo="/m/o__n", commit="c")) == "repo:/m/o__n"
    assert repository_key(repo_task("x")) == "repo:octo/widgets"  # metadata first: same everywhere
    mem = Memory(str(tmp_path), max_notes=2, max_chars=10)
    s = mem.scope(toy1)
    assert s.write("x" * 11).startswith("error: the note has 11 characters")
    assert s.write("  ").startswith("error: the note is empty")
    assert s.write("one").startswith("noted") and mem.scope(toy2).write("two").startswith("noted")
    assert s.write("three").startswith("error: memory is full (2 notes")
    assert mem.scope(Task("t3", "p", {}, {}, source="toy")).notes() == ["one", "two"]
    from configs.base import get_config

    c = get_config()
    c.env.memory_max_notes = 0
    with pytest.raises(ValueError, match="env.memory_max_notes=0"):
        Memory.from_config(c.env, str(tmp_path))
    c.env.memory_max_notes, c.env.memory_max_chars = 1, 5
    from coder.rl.actor import episode_factory

    mem = episode_factory(c, memory_dir=str(tmp_path / "run"), eval_ids=["h"]).kwargs["memory"]
    assert mem == Memory(str(tmp_path / "run"), frozenset({"h"}), 1, 5)
    assert pickle.loads(pickle.dumps(mem)) == mem  # env workers receive it pickled
    assert episode_factory(c).kwargs["memory"] is None


def test_memory_tools_in_episodes(tmp_path):
    """One episode writes, the next episode of the same repository reads it; an episode without
    a store says memory is off."""
    names = ("memory_write", "memory_read", "submit")
    call = lambda name, **a: protocol.ToolCall(name, a, "")
    mem = Memory(str(tmp_path / "memory"), eval_ids={"held"})
    ep = Episode(len, tools=names, memory=mem)
    try:
        ep.reset(repo_task("a"))
        assert ep.call(call("memory_write", note="run tests with tox")).startswith("noted")
        ep.reset(repo_task("b"))
        assert ep.call(call("memory_read")) == "[note 1] run tests with tox"
        assert ep.call(call("memory_read", query="nothing")).startswith("no notes containing")
        ep.reset(repo_task("held"))  # held out: the eval split is empty
        assert ep.call(call("memory_read")) == "no notes for this repository yet"
    finally:
        ep.close()
    off = Episode(len, tools=names)
    try:
        off.reset(repo_task("a"))
        assert off.call(call("memory_read")).startswith("memory is off")
    finally:
        off.close()


def test_memory_crosses_the_env_workers_of_one_run(tmp_path):
    """GRPO's path: the factory's episodes in two worker processes share the run's notes of a
    repository; a held-out task in either worker does not see them."""
    from configs.base import get_config
    from coder.env.pool import PooledEpisode
    from coder.rl.actor import episode_factory

    c = get_config()
    c.rl.tools = ("memory_write", "memory_read", "submit")
    call = lambda name, **a: protocol.ToolCall(name, a, "")
    with episode_factory(c, memory_dir=str(tmp_path / "memory"), eval_ids=["held"]).pool(2) as pool:
        a = PooledEpisode(pool, repo_task("a"), key="a")
        assert a.call(call("memory_write", note="setup.cfg pins pytest 7")).startswith("noted")
        b = PooledEpisode(pool, repo_task("b"), key="b")  # started after the note
        assert pool._owner["a"] != pool._owner["b"]  # two processes
        assert b.call(call("memory_read")) == "[note 1] setup.cfg pins pytest 7"
        held = PooledEpisode(pool, repo_task("held"), key="held")
        assert held.call(call("memory_read")) == "no notes for this repository yet"
        for ep in (a, b, held):
            ep.close()


def test_a_rollout_reads_the_notes_other_tasks_wrote_before_it_started_and_its_own(tmp_path):
    """What a rollout reads: the notes of other tasks written before its scope was opened (its
    episode's reset), and its own. The rollouts of one GRPO group (one task, opened together)
    read the same notes and never each other's, so their rewards compare like with like; a later
    group of the same task does not read that task's earlier notes either (it used to read every
    note of the scope, a sibling's written a second ago included)."""
    mem = Memory(str(tmp_path / "memory"))
    first, second = mem.scope(repo_task("a")), mem.scope(repo_task("a"))  # two rollouts of a group
    early = mem.scope(repo_task("b"))  # another task's rollout, already running
    assert first.write("tests live in tests/unit").startswith("noted (1 of")
    assert first.notes() == ["tests live in tests/unit"]  # its own
    assert second.notes() == [] and early.notes() == []  # a sibling's, and a note from after its start
    assert mem.scope(repo_task("a")).notes() == []  # the task's next group: not its own task's notes
    later = mem.scope(repo_task("b"))
    assert later.notes() == ["tests live in tests/unit"]  # another task, started after the note
    assert second.write("run with -x").startswith("noted (2 of")  # the cap counts every note
    assert later.notes() == ["tests live in tests/unit"] and mem.scope(repo_task("c")).notes() == [
        "tests live in tests/unit", "run with -x"]


def test_a_memory_session_starts_empty_and_keeps_its_notes_to_itself(tmp_path):
    """`in_session(tasks, s)`: the tasks' rollouts keep their notes in session `s`, empty at its
    start, read by no other session and by no rollout outside it (training's), and they read
    nothing from outside it: every agent eval runs in a session of its own (coder/rl/eval.py)."""
    from coder.env.tools.memory import in_session

    mem = Memory(str(tmp_path / "memory"), eval_ids={"held1", "held2"})
    mem.scope(repo_task("a")).write("train note")
    mem.scope(repo_task("held1")).write("eval-split note")
    first = in_session([repo_task("held1"), repo_task("held2"), repo_task("a")], "agent_eval-step_0-x1")
    assert [t.id for t in first] == ["held1", "held2", "a"] and first[0].metadata["repo"] == "octo/widgets"
    assert all(mem.scope(t).notes() == [] for t in first)  # nothing from training or the eval split
    mem.scope(first[0]).write("session note")
    assert mem.scope(first[1]).notes() == ["session note"]  # within the session, as anywhere
    second = in_session([repo_task("held2"), repo_task("a")], "agent_eval-step_10-x2")
    assert all(mem.scope(t).notes() == [] for t in second)  # the next eval starts empty again
    assert mem.scope(repo_task("b")).notes() == ["train note"]  # training never sees a session's
    assert mem.scope(repo_task("held2")).notes() == ["eval-split note"]
