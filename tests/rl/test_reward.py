"""Reward shaping: outcome, broken calls, the nonlinear length penalty, auxiliary rewards."""
import math
import types

import numpy as np
import pytest

from coder.rl import grpo
from coder.rl import reward as R
from configs import base

CFG = base.get_config().rl.length_penalty  # max_penalty 0.2, scales 64 / 2048


def test_length_cost_is_the_weighted_mix():
    usage = {"thinking_tokens": 10, "tool_io_tokens": 40, "output_tokens": 5, "tool_calls": 2, "turns": 3}
    # 1*10 + 0.25*40 + 1*5 + 8*2 + 16*3
    assert float(R.length_cost(usage, CFG.weights)) == 89.0


def test_penalty_curve_by_hand():
    cost = np.array([[64.0, 128.0], [64.0, 2048.0]])
    correct = np.array([[True, True], [True, False]])
    valid = np.ones((2, 2), bool)
    pen = R.length_penalty(cost, correct, valid, max_penalty=0.2, scale_easy=64.0, scale_hard=2048.0)
    # Group 0 all correct -> scale 64: 0.2(1 - e^-1), 0.2(1 - e^-2).
    assert pen[0, 0] == pytest.approx(0.2 * (1 - math.exp(-1)))
    assert pen[0, 1] == pytest.approx(0.2 * (1 - math.exp(-2)))
    # Group 1 half correct -> scale 64 + 1984 / 2 = 1056; the failure takes the full 0.2.
    assert pen[1, 0] == pytest.approx(0.2 * (1 - math.exp(-64 / 1056)))
    assert pen[1, 1] == pytest.approx(0.2)


def test_easy_tasks_pay_more_for_length_than_hard_ones():
    cost = np.array([[300.0, 0.0], [300.0, 0.0]])
    easy = R.length_penalty(cost, [[True, True], [True, True]], np.ones((2, 2), bool),
                            max_penalty=0.2, scale_easy=64.0, scale_hard=2048.0)
    hard = R.length_penalty(cost, [[True, False], [True, False]], np.ones((2, 2), bool),
                            max_penalty=0.2, scale_easy=64.0, scale_hard=2048.0)
    assert easy[0, 0] > 0.19 and hard[0, 0] < 0.05  # steep vs nearly flat
    assert easy[0, 1] == 0.0


def test_penalty_is_concave_and_bounded():
    c = np.linspace(0, 10_000, 200)[None]
    p = R.length_penalty(c, np.ones_like(c, bool), np.ones_like(c, bool), max_penalty=0.2,
                         scale_easy=64.0, scale_hard=2048.0)[0]
    assert np.all(np.diff(p) >= 0) and np.all(np.diff(p, 2) <= 1e-12) and p.max() <= 0.2


def test_correct_always_beats_incorrect_and_short_failure_does_not_pay():
    outcomes = np.array([[1.0, 0.0, 0.0]])
    correct = np.array([[True, False, False]])
    valid = np.ones((1, 3), bool)
    usage = np.array([[[5000, 5000, 500, 40, 40], [0, 0, 5, 0, 1], [3000, 3000, 300, 20, 20]]], float)
    r = R.group_rewards(outcomes, correct, valid, usage, np.zeros((1, 3)), CFG)
    assert r[0, 0] > r[0, 1] == r[0, 2] == pytest.approx(-0.2)


def test_all_correct_group_keeps_small_length_differences_unamplified():
    outcomes = np.ones((1, 2))
    correct = np.ones((1, 2), bool)
    usage = np.array([[[10, 0, 10, 0, 1], [100, 0, 10, 0, 1]]], float)
    r = R.group_rewards(outcomes, correct, np.ones((1, 2), bool), usage, np.zeros((1, 2)), CFG)
    adv = np.asarray(grpo.advantages(r, correct))
    assert adv[0, 0] > 0 > adv[0, 1] and abs(adv[0, 0]) < 0.2  # not normalised to +-1


def test_invalid_rollouts_get_zero_and_do_not_set_difficulty():
    outcomes = np.array([[1.0, 1.0, 0.0]])
    correct = np.array([[True, True, False]])
    valid = np.array([[True, True, False]])
    usage = np.zeros((1, 3, 5))
    usage[0, :, 0] = 64
    r = R.group_rewards(outcomes, correct, valid, usage, np.zeros((1, 3)), CFG)
    # Pass rate over valid = 1 -> easy scale 64: penalty 0.2(1 - e^-1).
    assert r[0, 0] == pytest.approx(1 - 0.2 * (1 - math.exp(-1)), rel=1e-5)
    assert r[0, 2] == 0.0


def test_aux_registry():
    with pytest.raises(ValueError):
        R.aux_reward("lint_introduced")(lambda r: 0.0)
    ro = types.SimpleNamespace(lint_before=3, lint_after=5, final_text="Should I change it?", edits=0)
    assert R.AUX_REWARDS["lint_introduced"](ro) == -2.0
    assert R.AUX_REWARDS["unanswered_question"](ro) == -1.0
    assert R.aux_total(ro, {"lint_introduced": 0.1, "unanswered_question": 0.0}) == pytest.approx(-0.2)
    ro.edits, ro.lint_after = 1, 2
    assert R.aux_total(ro, {"lint_introduced": 1.0, "unanswered_question": 1.0}) == 0.0
    with pytest.raises(KeyError):
        R.aux_total(ro, {"nope": 1.0})
    # clarification: the one question an underspecified task needs is free, every other costs 1
    q = lambda n, needed: R.AUX_REWARDS["clarification"](types.SimpleNamespace(questions=n, clarification_needed=needed))
    assert [q(0, True), q(1, True), q(3, True), q(0, False), q(1, False), q(2, False)] == [0, 0, -2, 0, -1, -2]


# --- agent eval scoring (coder/rl/eval.py) ------------------------------------------------------
def test_pass_at_k_unbiased_estimator_by_hand():
    from coder.rl.eval import pass_at_k, summarize

    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)  # 1 - C(3,3)/C(5,3)
    assert pass_at_k(5, 3, 3) == 1.0 and pass_at_k(5, 0, 3) == 0.0
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)
    s = summarize([(4, 1), (4, 4), (1, 1)], ks=(1, 2))
    assert s["pass@1"] == pytest.approx((0.25 + 1 + 1) / 3)
    assert s["pass@2"] == pytest.approx((0.5 + 1) / 2)  # the 1-sample task is left out of pass@2


def test_best_of_k_and_the_per_category_breakdown_by_hand():
    from coder.rl.eval import best_of_k, by_category

    assert best_of_k([[0.2, 0.9, 0.5], [0.0, 0.0, 1.0], [0.4]], 2) == pytest.approx((0.9 + 0.0) / 2)
    assert best_of_k([[0.4]], 2) != best_of_k([[0.4]], 2)  # nan: no task has 2 attempts
    tasks = [{"category": "bug", "n": 2, "correct": 1, "rewards": [1.0, 0.5]},
             {"category": "bug", "n": 2, "correct": 0, "rewards": [0.0, 0.25]},
             {"category": "feature", "n": 2, "correct": 0, "rewards": [0.5, 0.0]}]
    cats = by_category(tasks, ks=(1, 2))
    assert cats["bug"] == pytest.approx({"num_tasks": 2, "pass@1": 0.25, "pass@2": 0.5,
                                         "best_of_1": 0.5, "best_of_2": 0.625})
    assert cats["feature"] == pytest.approx({"num_tasks": 1, "pass@1": 0.0, "pass@2": 0.0,
                                             "best_of_1": 0.5, "best_of_2": 0.5})


def test_regression_flag():
    from coder.rl.eval import is_regression

    assert is_regression({"pass@1": 0.6}, {"pass@1": 0.5}, 0.05)
    assert not is_regression({"pass@1": 0.6}, {"pass@1": 0.56}, 0.05)
    assert not is_regression({"pass@1": float("nan")}, {"pass@1": 0.1}, 0.05)


def test_broken_call_scores_below_a_plain_failure():
    outcomes = np.zeros((1, 3))
    correct = np.zeros((1, 3), bool)
    usage = np.zeros((1, 3, 5))
    r = R.group_rewards(outcomes, correct, np.ones((1, 3), bool), usage, np.zeros((1, 3)), CFG,
                        broken=[[False, True, False]], broken_penalty=0.1)
    np.testing.assert_allclose(r, [[-0.2, -0.3, -0.2]], atol=1e-6)
