"""The GRPO driver (coder/rl/driver.py): the staleness histogram of a step's tokens, and a step
whose groups do not come saying where they are."""
import logging
import threading
import time

from configs import base
from coder.rl import driver as driver_lib
from coder.rl.trajectory import ContextWindow


def test_staleness_histogram_counts_policy_tokens_by_age():
    """Learner at version 5, grpo.max_staleness 2: policy tokens of versions 5, 4, 4, 1 fall in
    bins 0, 1, 1 and over; prompt / tool tokens (policy False, version -1) are not counted."""
    g = ContextWindow(tokens=list(range(6)), policy=[False, True, True, True, False, True],
                   policy_version=[-1, 5, 4, 4, -1, 1])
    rollout = type("R", (), {"generations": [g]})()
    h = driver_lib.staleness_histogram([[rollout]], version=5, bins=2)
    assert h == {"staleness_hist_0": 0.25, "staleness_hist_1": 0.5, "staleness_hist_2": 0.0,
                 "staleness_hist_over": 0.25}


class SilentActors:
    """An ActorHost (coder.rl.actor_hosts) over an actor that never finishes a group."""

    def __len__(self):
        return 1

    def submit(self, i, work):
        return object()

    def wait(self, tokens, timeout):
        time.sleep(timeout)
        return []

    def notify(self, version):
        pass

    def close(self):
        pass


def test_a_step_that_waits_for_its_groups_says_where_they_are(monkeypatch, caplog):
    """A learner step whose groups do not come (an actor stuck, a group that never starts) logs,
    every WAIT_NOTE_S, what it waits for, instead of waiting without a word."""
    cfg = base.get_config()
    cfg.rl.update(dict(group_size=2, engine_slots=2))
    monkeypatch.setattr(driver_lib, "WAIT_NOTE_S", 0.2)
    order = [(i, f"task{i}") for i in range(4)]
    driver = driver_lib.Driver(cfg, SilentActors(), order, driver_lib.Epoch(), needed=2, local=2, version=0)
    caplog.set_level(logging.WARNING)
    errors = []

    def take():
        try:
            driver.take()
        except RuntimeError as e:
            errors.append(str(e))

    learner = threading.Thread(target=take, daemon=True)  # waits until closed: the groups never come
    learner.start()
    time.sleep(2.0)
    notes = [r.getMessage() for r in caplog.records if "waited" in r.getMessage()]
    driver.close()
    learner.join(timeout=5)
    assert errors == ["[grpo] the driver closed while the learner waited for groups"]
    assert notes and notes[0].startswith("[grpo] step 1 has waited"), notes
    assert "0 of 2 finished, 1 on actors (states ['up']), 3 tasks not handed out" in notes[0], notes
