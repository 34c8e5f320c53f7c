"""The reward of a rollout: outcome from the tests, a nonlinear length penalty, auxiliary terms.

    reward = outcome - length_penalty + sum_k weight_k * aux_k(rollout)

**Outcome.** The env's test result in [0, 1] (fraction of scoring tests passed); `correct` is
"every test passed". A rollout with a *broken tool call* (malformed call text) is a negative
example: outcome 0, not correct, whatever the tests say (the rule is
`coder.env.scoring.score.outcome`, which the env's text interface applies too), and `rl.broken_call_penalty` below a
plain failure (without that margin GRPO pushes down the well-formed tokens that follow a wrong
choice as readily as the choice itself, and the call format decays). It is never dropped:
dropping it would teach the policy to emit a broken call on a hard task to escape a negative
reward (the instrumentation bug Composer 2 reports). Only infrastructure failures leave the
group (`coder.rl.grpo.valid_mask`).

**Length penalty** (config `rl.length_penalty`). The cost of a rollout is a weighted mix

    cost = w.thinking * thinking_tokens + w.tool_io * tool_io_tokens + w.output * output_tokens
         + w.tool_call * tool_calls + w.turn * turns

(token classes are defined in `coder.rl.trajectory.Rollout.usage`). The penalty is a concave,
saturating curve of the cost whose scale grows with the task's difficulty:

    p     = pass rate of the task's group (valid rollouts)          difficulty = 1 - p
    scale = scale_easy + (scale_hard - scale_easy) * (1 - p)
    penalty(cost) = max_penalty * (1 - exp(-cost / scale))          for a correct rollout
    penalty       = max_penalty                                     for an incorrect one

- Easy task (p near 1, small scale): the curve is steep from the first token, so every extra
  turn, call or paragraph costs a visible share of `max_penalty`: the direct answer wins.
- Hard task (p near 0, large scale): the curve is nearly flat over the lengths a rollout uses
  (~ max_penalty * cost / scale), so exploring, running tests and summarizing stay cheap.
- Saturation bounds the penalty by `max_penalty` < 1, so a correct rollout always out-scores an
  incorrect one, and the group's correctness, not its length, decides the sign of advantages.
- Incorrect rollouts take the full `max_penalty`: otherwise a short failure (give up at once,
  or break a tool call) would beat a long honest attempt, a reward hack.
Within a group whose rollouts are all correct, the advantage is the length-penalty difference,
left un-normalized by `coder.rl.grpo.advantages` (no noise amplification).

**Auxiliary rewards** (config `rl.aux_rewards`: name -> weight, 0 = off). One decorated
function per reward, `@aux_reward("name")`, taking the `Rollout` and returning a float; a new
behavioural reward or penalty is one function, not a new branch. A scorer of the final message
(`fn(final_text, edited_paths) -> [0, 1]`: the `communication` rules of coder.rl.communication,
or a reward model) registers with `@communication_scorer("name")` and becomes the auxiliary
reward `name`, `2 * score - 1`.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from coder.rl import communication

USAGE_KEYS = ("thinking_tokens", "tool_io_tokens", "output_tokens", "tool_calls", "turns")
_WEIGHT_KEYS = ("thinking", "tool_io", "output", "tool_call", "turn")

AUX_REWARDS: dict[str, Callable] = {}


def aux_reward(name: str):
    """Registers `fn(rollout) -> float` as the auxiliary reward `name`."""

    def register(fn):
        if name in AUX_REWARDS:
            raise ValueError(f"auxiliary reward {name!r} is registered twice")
        AUX_REWARDS[name] = fn
        return fn

    return register


def communication_scorer(name: str):
    """Registers `fn(final_text: str, edited_paths: list[str]) -> float in [0, 1]` (how well
    the final message says what changed and why) as the auxiliary reward `name`, valued
    `2 * fn(rollout.final_text, rollout.edited_paths) - 1` in [-1, 1]: an empty or generic final
    message costs what a clear one earns.

    The hook for a reward model: a module that loads one and decorates its scoring function,
    imported before the stage starts (a config module may import it), makes `name` a key for
    `rl.aux_rewards`; the rule-based `communication` below is registered the same way. A score
    outside [0, 1] is an error, not clipped: it means the model's output is not a probability."""

    def register(fn):
        def reward(rollout) -> float:
            score = float(fn(rollout.final_text, list(rollout.edited_paths)))
            if not 0.0 <= score <= 1.0:
                raise ValueError(f"communication scorer {name!r} returned {score}, outside [0, 1]")
            return 2.0 * score - 1.0

        reward.__doc__ = f"2 * {getattr(fn, '__name__', fn)!s}(final_text, edited_paths) - 1"
        aux_reward(name)(reward)
        return fn

    return register


def length_cost(usage, weights) -> np.ndarray:
    """usage `[..., 5]` in USAGE_KEYS order (or a dict of them) -> weighted cost `[...]`."""
    if isinstance(usage, dict):
        usage = np.stack([np.asarray(usage[k], np.float64) for k in USAGE_KEYS], axis=-1)
    w = np.asarray([float(weights[k]) for k in _WEIGHT_KEYS])
    return np.asarray(usage, np.float64) @ w


def length_penalty(cost, correct, valid, *, max_penalty, scale_easy, scale_hard) -> np.ndarray:
    """The curve of the module docstring.

    Args:
      cost: `[N, G]` weighted cost of each rollout.
      correct: `[N, G]` bool.
      valid: `[N, G]` bool (infrastructure failures excluded from the pass rate).
    Returns:
      `[N, G]` penalty in [0, max_penalty].
    """
    cost = np.asarray(cost, np.float64)
    correct = np.asarray(correct, bool)
    valid = np.asarray(valid, bool)
    n_valid = np.maximum(valid.sum(axis=1, keepdims=True), 1)
    pass_rate = (correct & valid).sum(axis=1, keepdims=True) / n_valid
    scale = scale_easy + (scale_hard - scale_easy) * (1.0 - pass_rate)
    curve = max_penalty * (1.0 - np.exp(-np.maximum(cost, 0.0) / scale))
    return np.where(correct, curve, max_penalty)


def aux_total(rollout, weights) -> float:
    """sum_k weight_k * aux_k(rollout) over the configured auxiliary rewards."""
    total = 0.0
    for name, w in dict(weights).items():
        if name not in AUX_REWARDS:
            raise KeyError(f"unknown auxiliary reward {name!r}; registered: {sorted(AUX_REWARDS)}")
        if w:
            total += float(w) * float(AUX_REWARDS[name](rollout))
    return total


def group_rewards(outcomes, correct, valid, usage, aux, cfg, broken=None, broken_penalty=0.0) -> np.ndarray:
    """Final rewards of N groups of G rollouts.

    Args:
      outcomes: `[N, G]` outcome (after the broken-call rule of `outcome`).
      correct: `[N, G]` bool.
      valid: `[N, G]` bool.
      usage: `[N, G, 5]` usage in USAGE_KEYS order.
      aux: `[N, G]` summed auxiliary rewards.
      cfg: `config.rl.length_penalty` (weights, max_penalty, scale_easy, scale_hard).
      broken: optional `[N, G]` bool, rollouts with a broken tool call; they lose
        `broken_penalty` more than a plain failure.
    Returns:
      `[N, G]` float32 rewards (0 where not valid).
    """
    cost = length_cost(usage, cfg.weights)
    pen = length_penalty(cost, correct, valid, max_penalty=cfg.max_penalty,
                         scale_easy=cfg.scale_easy, scale_hard=cfg.scale_hard)
    r = np.asarray(outcomes, np.float64) - pen + np.asarray(aux, np.float64)
    if broken is not None:
        r = r - broken_penalty * np.asarray(broken, bool)
    return np.where(np.asarray(valid, bool), r, 0.0).astype(np.float32)


# --- auxiliary rewards -------------------------------------------------------------------------
@aux_reward("lint_introduced")
def lint_introduced(rollout) -> float:
    """Minus the lint diagnostics the agent's change added (fewer after the change is >= 0).

    Reads `lint_before` / `lint_after` (diagnostic counts of the edited files, measured by the
    rollout loop with the env's lint tool before the first and after the last action).
    """
    before, after = rollout.lint_before, rollout.lint_after
    if before is None or after is None:
        return 0.0
    return -float(max(after - before, 0))


@aux_reward("unanswered_question")
def unanswered_question(rollout) -> float:
    """-1 when the rollout ends on a question to the user without having edited anything.

    Composer 2 saw policies defer risky edits by asking clarifying questions; this balances
    cautious clarification against decisive action (weight it small: sometimes asking is right).
    """
    final = rollout.final_text.strip()
    return -1.0 if final.endswith("?") and rollout.edits == 0 else 0.0


@aux_reward("clarification")
def clarification(rollout) -> float:
    """Minus each question (`ask_user`) the task did not need.

    Composer 2 saw policies ask clarifying questions to dodge risky edits. With a simulated user
    that answers from the task's hidden specification, asking is worth exactly what the answer
    is worth: on an underspecified task the first question is free, and its answer is what
    lets the outcome pay; every further question, and any question on a task whose prompt says
    everything, costs 1 (times the weight). A question never pays by itself, so it cannot stand
    in for the work."""
    needed = 1 if rollout.clarification_needed else 0
    return -float(max(rollout.questions - needed, 0))


@communication_scorer("communication")
def communication_rules(final_text: str, edited_paths) -> float:
    """The final message names an edited file (what) and gives a reason (why): 1 for both, 0.5
    for one, 0 for neither or boilerplate (coder.rl.communication); reward -1 / 0 / +1."""
    return communication.rule_score(final_text, edited_paths)
