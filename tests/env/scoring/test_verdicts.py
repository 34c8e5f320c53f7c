"""One test run per distinct workspace: coder/env/scoring/verdicts.py, reward.scoring_digest and
EpisodePool.score's sharing."""

import os
import threading

import pytest

from coder.env.scoring import score as reward
from coder.env.episode import Episode
from coder.env.pool import EpisodePool, PooledEpisode
from coder.env.protocol import ToolCall
from coder.env.tasks import toy_tasks
from coder.env.scoring.verdicts import Claim, SharedVerdicts

PASS = reward.Score(1.0, 1, 1)


def _run(fn):
    t = threading.Thread(target=fn)
    t.start()
    return t


def test_a_digest_being_scored_is_waited_for_and_its_verdict_shared():
    verdicts = SharedVerdicts()
    claimed, release = threading.Event(), threading.Event()
    seen = []

    def first():
        with verdicts.slot("d") as s:
            seen.append((s.claim, s.verdict))
            claimed.set()
            release.wait(10)
            s.offer(PASS)

    def second():
        claimed.wait(10)
        with verdicts.slot("d") as s:  # blocks until the first slot is done
            seen.append((s.claim, s.verdict))

    threads = [_run(first), _run(second)]
    claimed.wait(10)
    release.set()
    for t in threads:
        t.join(10)
    assert seen == [(Claim.RUN, None), (Claim.REUSE, PASS)]
    assert (verdicts.runs, verdicts.reused) == (1, 1)


def test_infra_errors_and_failed_holders_are_not_shared():
    verdicts = SharedVerdicts()
    with verdicts.slot("d") as s:
        s.offer(reward.Score(0.0, 0, 0, infra_error="sandbox died"))
    with pytest.raises(RuntimeError), verdicts.slot("d") as s:
        assert s.claim is Claim.RUN  # the infra error was not kept
        raise RuntimeError("the worker was lost")
    with verdicts.slot("d") as s:
        assert s.claim is Claim.RUN  # nor was anything from the holder that raised
        s.offer(PASS)
    with verdicts.slot("d") as s:
        assert (s.claim, s.verdict) == (Claim.REUSE, PASS)
        s.offer(reward.Score(0.0, 0, 1))  # a reusing slot offers nothing
    with verdicts.slot(None) as s:
        assert s.claim is Claim.UNSHARED and s.verdict is None
    assert (verdicts.runs, verdicts.reused) == (3, 1)


def test_the_least_recently_used_verdict_is_dropped_past_capacity():
    verdicts = SharedVerdicts(capacity=2)
    for d in ("a", "b"):
        with verdicts.slot(d) as s:
            s.offer(PASS)
    with verdicts.slot("a"):
        pass  # "a" used again: "b" is now the oldest
    with verdicts.slot("c") as s:
        s.offer(PASS)
    assert [verdicts.slot(d).__enter__().claim for d in ("a", "c")] == [Claim.REUSE] * 2
    with verdicts.slot("b") as s:
        assert s.claim is Claim.RUN


def _episode(task, files: dict) -> Episode:
    ep = Episode(token_count=len)
    ep.reset(task)
    for path, text in files.items():
        assert ep.call(ToolCall("write_file", {"path": path, "content": text}, "")).startswith("wrote")
    return ep


def test_the_digest_is_the_task_and_the_prepared_workspace():
    (task, sol), (other, _) = toy_tasks(2, seed=5)
    eps = [_episode(task, sol), _episode(task, sol), _episode(task, {}), _episode(other, sol)]
    try:
        same, twin, unfixed, other_task = (ep.scoring_digest() for ep in eps)
        assert same == twin and len(same) == 64  # two sandboxes, one tree
        assert unfixed != same and other_task != same
        # what scoring deletes first (byte code, a conftest.py) is not part of the digest
        ws = eps[1].sandbox.workspace
        for junk in ("conftest.py", "stale.pyc"):
            with open(os.path.join(ws, junk), "w") as f:
                f.write("raise SystemExit\n")
        assert eps[1].scoring_digest() == same
        # an executable bit, a new file and another reward mode are
        os.chmod(os.path.join(ws, "answer.py"), 0o755)
        assert eps[1].scoring_digest() != same
        os.chmod(os.path.join(ws, "answer.py"), 0o644)
        with open(os.path.join(ws, "notes.txt"), "w") as f:
            f.write("x")
        assert eps[1].scoring_digest() != same
        assert reward.scoring_digest(eps[0].sandbox, task, "all", 300.0) != same
        # a given verdict is used as it is (no test run: the unfixed workspace would fail)
        assert eps[2].score(PASS)[0] == 1.0 and eps[2].verdict is PASS
        assert eps[2].scoring_digest() is None  # scored: nothing left to share
    finally:
        for ep in eps:
            ep.close()


@pytest.mark.parametrize("share", [True, False])
def test_pooled_rollouts_with_one_workspace_run_the_tests_once(share):
    """Four rollouts of one task, three of which write the reference fix, scored at once from
    four threads over two workers: two test runs (fixed, unfixed) when shared, each rollout its
    own verdict's reward either way."""
    ((task, sol),) = toy_tasks(1, seed=6)
    with EpisodePool(2, token_count=len, share_verdicts=share) as pool:
        eps = [PooledEpisode(pool, task) for _ in range(4)]
        for ep in eps[:3]:
            ep.call(ToolCall("write_file", {"path": "answer.py", "content": sol["answer.py"]}, ""))
        results = [None] * 4

        def score(i):
            results[i] = eps[i].score()

        for t in [_run(lambda i=i: score(i)) for i in range(4)]:
            t.join(60)
        assert [r for r, _ in results] == [1.0, 1.0, 1.0, 0.0]
        shared = [info["verdict_shared"] for _, info in results]
        if share:
            assert (pool.verdicts.runs, pool.verdicts.reused) == (2, 2)
            assert sum(shared) == 2 and not shared[3]
        else:
            assert pool.verdicts is None and not any(shared)
        for ep in eps:
            ep.close()
