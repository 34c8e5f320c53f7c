"""The communication reward: rules over a hand-labelled set of final messages, the reward's
values, and the reward-model hook (`communication_scorer`).

LABELLED: final messages written by hand with the files the agent edited and whether a reviewer
learns from the message both what changed and why (True) or not (False), labelled by reading,
before the rules ran on them. Two are there because the rules get them wrong: a change named by
what it does rather than by its file, and a temporal "since" read as a reason.
"""
import types

import pytest

from coder.rl import communication
from coder.rl import reward as reward_lib

LABELLED = [
    ("I changed `parse_date` in utils/dates.py: it now accepts ISO week dates, because the importer "
     "fed it '2024-W05' strings and crashed.", ["utils/dates.py"], True),
    ("Done.", ["a.py"], False),
    ("All tests pass. Submitting.", ["app.py"], False),
    ("Fixed the off-by-one in the pagination helper so the last page is no longer dropped.",
     ["web/paging.py"], True),
    ("Updated config.py.", ["config.py"], False),
    ("The parser was wrong.", ["parser.py"], False),
    ("Edited src/cache.py to evict the oldest entry instead of the newest: the LRU test expects the "
     "least recently used key to go first.", ["src/cache.py"], True),
    ("I didn't change any code: the function is already correct, and the failing test was flaky "
     "because it depends on the wall clock.", [], True),
    ("", ["a.py"], False),
    ("Fixed it, everything works now!", ["x.py"], False),
    ("Changed answer.py.", ["answer.py"], False),
    ("In models.user, `full_name` returned 'None None' for users without names; it now returns an "
     "empty string so the profile page renders.", ["models/user.py"], True),
    ("I refactored things because it was messy.", ["core/engine.py"], False),
    ("Should I also update the README?", ["lib.py"], False),
    ("Added tests/test_io.py and changed io_utils.py: read_lines now strips the trailing newline, "
     "which the caller in cli.py did not expect.", ["io_utils.py", "tests/test_io.py"], True),
    ("Changes in db/session.py: retry on connection reset. Tests pass.", ["db/session.py"], False),
    ("Fixed the bug in math_utils.py.", ["math_utils.py"], False),
    ("I changed `scale` in answer.py: `return x + 1` is now `return x * 4`, because the task asks for "
     "it: `scale(x)` in answer.py should multiply x by 4. The tests pass now.", ["answer.py"], True),
    ("Since the upstream API now returns ints, I cast the ids in client.py to str before the lookup; "
     "otherwise the cache missed every time.", ["client.py"], True),
    ("Ran the tests since the last edit to parser.py; nothing else to do.", ["parser.py"], False),
]


def test_rules_precision_and_recall_on_the_labelled_set():
    pred = [communication.judge(text, paths).good for text, paths, _ in LABELLED]
    gold = [label for _, _, label in LABELLED]
    tp = sum(p and g for p, g in zip(pred, gold))
    precision, recall = tp / sum(pred), tp / sum(gold)
    print(f"communication rules on {len(LABELLED)} labelled finals: precision {precision:.3f}, "
          f"recall {recall:.3f}")
    assert 10 <= len(LABELLED) <= 20 and 0 < sum(gold) < len(gold)
    # the two known misses (module docstring) and nothing else
    wrong = [text[:30] for (text, _, label), p in zip(LABELLED, pred) if p != label]
    assert wrong == ["Fixed the off-by-one in the pa", "Ran the tests since the last e"]
    assert (round(precision, 3), round(recall, 3)) == (0.875, 0.875)


def test_reward_values_and_generic_finals():
    rew = reward_lib.AUX_REWARDS["communication"]
    ro = lambda text, paths: types.SimpleNamespace(final_text=text, edited_paths=paths)
    assert rew(ro("Changed a.py because f returned None.", ["a.py"])) == 1.0
    assert rew(ro("Changed a.py.", ["a.py"])) == 0.0  # what, not why
    assert rew(ro("", ["a.py"])) == -1.0
    # boilerplate is judged generic even though it names no file and has no reason word
    j = communication.judge("All tests pass, done. Submitting.", ["a.py"])
    assert j.generic and j.score == 0.0
    # a message naming the file by its module name; tool calls inside are ignored
    j = communication.judge('pkg.util now rounds half up, because the spec says so.<tool_call>{"name": '
                            '"submit", "arguments": {}}</tool_call>', ["pkg/util.py"])
    assert j.what and j.why and j.good
    assert reward_lib.aux_total(ro("Changed a.py.", ["a.py"]), {"communication": 0.05}) == 0.0


def test_a_reward_model_registers_by_name_and_is_checked():
    seen = []

    def model(final_text, edited_paths):
        seen.append((final_text, edited_paths))
        return 0.75 if "because" in final_text else 1.5

    name = "test_communication_model"
    try:
        assert reward_lib.communication_scorer(name)(model) is model
        ro = types.SimpleNamespace(final_text="Edited a.py because x.", edited_paths=["a.py"])
        assert reward_lib.aux_total(ro, {name: 0.1}) == pytest.approx(0.1 * 0.5)
        assert seen == [("Edited a.py because x.", ["a.py"])]
        with pytest.raises(ValueError, match="outside"):
            reward_lib.AUX_REWARDS[name](types.SimpleNamespace(final_text="no", edited_paths=[]))
        with pytest.raises(ValueError, match="registered twice"):
            reward_lib.communication_scorer(name)(model)
    finally:
        reward_lib.AUX_REWARDS.pop(name, None)
