"""The GRPO driver's bookkeeping (coder/rl/dispatch.py), each part alone."""
import types

import pytest

from coder.rl.dispatch import ActorCounters, ActorHealth, ActorState, GroupQueue, StalenessGate


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_actor_health_transitions():
    """UP -> lost -> DOWN -> due -> PROBING -> still restarting -> DOWN (retry later) -> due ->
    PROBING -> back -> UP; another actor lost for good is GONE; losing again while DOWN keeps
    its probe time; a probe answer in the wrong state is an error."""
    clock = Clock()
    h = ActorHealth(3, retry_s=2.0, clock=clock)
    assert h.up() == [0, 1, 2] and not h.recovering
    h.lost(1)
    assert h.up() == [0, 2] and h.state[1] is ActorState.DOWN and h.recovering
    clock.t += 5
    h.lost(1)  # a second group lost while it is down: nothing changes
    assert h.due() == [1] and h.state[1] is ActorState.PROBING
    assert h.due() == []  # one probe at a time
    assert h.answered(1, back=False) is ActorState.DOWN
    assert h.due() == []  # not before retry_s
    clock.t += 2.0
    assert h.due() == [1]
    assert h.answered(1, back=True) is ActorState.UP and h.up() == [0, 1, 2] and not h.recovering
    h.lost(2)
    assert h.due() == [2]
    assert h.answered(2, back=False, for_good=True) is ActorState.GONE
    assert h.up() == [0, 1] and not h.recovering and not h.all_gone
    with pytest.raises(ValueError, match="state up"):
        h.answered(0, back=True)
    for a in (0, 1):
        h.lost(a)
    for a in h.due():
        h.answered(a, back=False, for_good=True)
    assert h.all_gone


@pytest.mark.parametrize("bound", [0, 2])
def test_staleness_gate(bound):
    """local = 4 groups per step, the learner at version 3 having taken 3 steps (12 groups):
    with q outstanding the next group trains at step (12 + q) // 4; it goes out only while
    that step is within `bound` of the learner's version."""
    gate = StalenessGate(bound=bound, local=4, taken=12)
    assert [gate.step_of(q) for q in (0, 3, 4, 9)] == [3, 3, 4, 5]
    assert gate.admits(3, version=3)  # this step's groups: always
    assert gate.admits(4, version=3) == (bound >= 1)  # one step ahead: async only
    assert gate.admits(5, version=3) == (bound >= 2)
    assert gate.min_version(5) == 5 - bound
    gate.took()
    assert gate.step_of(0) == 4
    with pytest.raises(ValueError):
        StalenessGate(bound=-1, local=4, taken=0)


def test_group_queue_counts_received_and_dropped_per_take():
    q = GroupQueue()
    result = lambda i: types.SimpleNamespace(index=i, rollouts=[0] * 8)
    q.put(result(0))
    q.drop(8)
    q.put(result(1))
    assert len(q) == 2
    out, received, dropped = q.take(1)
    assert [r.index for r in out] == [0] and (received, dropped) == (16, 8)
    q.drop(8)
    out, received, dropped = q.take(1)
    assert [r.index for r in out] == [1] and (received, dropped) == (0, 8) and q.dropped_total == 16
    with pytest.raises(ValueError, match="take"):
        q.take(1)


def test_actor_counters_are_deltas_and_a_restart_counts_from_zero():
    c = ActorCounters()
    stats = lambda pid, versions, read, engine, version: dict(pid=pid, idle_s=1.0 * versions, versions=versions,
                                                               read_bytes=read, apply_s=0.5 * versions,
                                                               engine={"emitted": engine}, version=version)
    c.update(0, stats(10, 2, 200, 50, 4))
    c.update(1, stats(11, 1, 100, 30, 3))
    d = c.deltas()
    assert d["sync_versions"] == 3 and d["sync_read_bytes"] == 100 and d["engine_after"] == {"emitted": 80}
    assert d["engine_before"] == {"emitted": 0} and c.oldest_version(default=9) == 3
    c.update(0, stats(10, 3, 260, 70, 5))  # one more version: 60 bytes
    c.update(1, stats(12, 1, 40, 5, 5))  # restarted (new pid): its counters from 0
    d = c.deltas()
    assert d["sync_versions"] == 2 and d["sync_read_bytes"] == 50
    assert d["engine_before"] == {"emitted": 50} and d["engine_after"] == {"emitted": 75}
    assert ActorCounters().oldest_version(default=9) == 9
