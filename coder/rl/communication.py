"""Rules for the `communication` reward: does the final message say what changed and why?

A person reads an agent's final message before its diff; a message that names the files it
changed and says why lets them review the change, one that says "Done." does not (issue #29's
communication reward). The rules judge two things of the final message (`Rollout.final_text`,
coder/rl/agent.py: the final answer, or the words of the turn that submits):

- **what**: it names a file the agent edited (`Rollout.edited_paths`: the path, its base name,
  or its dotted module name, e.g. `pkg/util.py`, `util.py`, `pkg.util`); when the agent edited
  nothing, it says so ("no change was needed", "I did not edit ...");
- **why**: it has a reason clause: a causal connective ("because", "so that", "in order to",
  "to fix / handle / avoid ...", "otherwise", "due to", "instead of") or a statement of the
  defect ("was wrong", "returned ... instead", "raised", "off by one", "the test expects");
- **generic**: empty, or nothing but boilerplate ("Done.", "All tests pass, submitting.",
  "Fixed the bug."): judged as neither, whatever it matches.

`judge(final_text, edited_paths).score` is 0, 0.5 or 1 (the share of the two it meets), and
coder.rl.reward turns it into the reward `2 * score - 1` in {-1, 0, 1}, so an empty or generic
final costs as much as a complete one earns. The rules are cheap and deterministic, and also
easy to satisfy without meaning it (name the file, write "because"); that is why its weight is
small in the configs, and why coder.rl.reward has `communication_scorer`: register a reward
model's `fn(final_text, edited_paths) -> score in [0, 1]` under a name and weight that name in
`rl.aux_rewards` instead. Measured on tests/rl/test_communication.py's 20 hand-labelled messages
(good = states both what and why; 8 are): precision 0.875 and recall 0.875 (7 of 8 each). The
miss names the change by what it does ("the pagination helper"), not by its file; the false
alarm reads a temporal "since" as a reason.
"""
from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Sequence

_CALL = re.compile(r"<tool_call>.*?(?:</tool_call>|$)", re.S)
_REASON = re.compile(
    r"\b(?:because|since|so that|so (?:it|the|that|a|an|they|we|callers?)\b|in order to|otherwise|due to|"
    r"instead(?: of)?|as (?:the|a) (?:test|tests|task|spec|issue|caller|docs?)\b|"
    r"to (?:fix|handle|avoid|prevent|match|support|satisfy|keep|stop|allow|accept|reject|restore|"
    r"make|return|respect|cover)|"
    r"(?:was|were|is|are) (?:wrong|broken|missing|incorrect|inverted|reversed|never|always|not|off by)|"
    r"wasn't|weren't|isn't|didn't|did not|never|off[- ]by[- ]one|"
    r"(?:returned|raised|crashed|ignored|dropped|skipped|overflowed|leaked|failed)|"
    r"(?:the |a )?tests? (?:expects?|requires?|asks? for)|the task (?:asks|says|wants|requires))",
    re.I,
)
_NO_CHANGE = re.compile(
    r"\b(?:no (?:code )?changes? (?:was |is |were )?(?:needed|necessary|required|made)|"
    r"nothing (?:to change|needed (?:to be )?chang|was changed)|"
    r"(?:did not|didn't|do not|don't) (?:change|edit|modify|touch)|without (?:changing|editing)|"
    r"(?:left|leave) .{0,60}?unchanged|(?:is|was) already (?:correct|right|fixed))",
    re.I,
)
# words a final message may hold and still say nothing about this change
_BOILERPLATE = frozenset(
    "a all am and applied are as been bug change changes code complete completed did done "
    "everything finished fix fixed good great have here i i'm is issue it it's looks made my now "
    "ok okay pass passed passes passing problem resolved should solution solved submit submitting "
    "task test tests that the this to work works".split()
)


@dataclasses.dataclass(frozen=True)
class Judgement:
    what: bool  # names an edited file (or says nothing was edited)
    why: bool  # has a reason clause
    generic: bool  # empty or boilerplate only

    @property
    def score(self) -> float:
        """0, 0.5 or 1: the share of what / why the message states (0 when generic)."""
        return 0.0 if self.generic else (self.what + self.why) / 2

    @property
    def good(self) -> bool:
        """States both what changed and why (the label of the tests' labelled set)."""
        return self.score == 1.0


def names(path: str) -> set[str]:
    """How a message may name an edited file: its path, base name and dotted module name."""
    path = path.removeprefix("./").removeprefix("/workspace/")
    out = {path, os.path.basename(path)}
    stem, ext = os.path.splitext(path)
    if ext == ".py" and "/" in stem:
        out.add(stem.replace("/", "."))
    return {n for n in out if n}


def judge(final_text: str, edited_paths: Sequence[str] = ()) -> Judgement:
    """The rules of the module docstring over one final message (tool calls in it are ignored)."""
    text = _CALL.sub(" ", final_text or "").strip()
    words = re.findall(r"[a-z']+", text.lower())
    generic = not any(w not in _BOILERPLATE for w in words)
    if edited_paths:
        what = any(n in text for p in edited_paths for n in names(p))
    else:
        what = bool(_NO_CHANGE.search(text))
    return Judgement(what=what, why=bool(_REASON.search(text)), generic=generic)


def rule_score(final_text: str, edited_paths: Sequence[str] = ()) -> float:
    """`judge(...).score`: the rules as a scorer (coder.rl.reward.communication_scorer)."""
    return judge(final_text, edited_paths).score
