"""Rules for the `dissatisfied_followup` signal: does a user's next message say the last reply
failed them?

Composer 2's real-time RL rewards what users did next; one of its signals is a dissatisfied
follow-up: the user complains, reports that it still fails, pastes the error, asks to undo, or
asks the same thing again. The server (coder/serve/derived_signals.py) runs `judge` on the user
message that follows a served reply in the same conversation, so the signal needs no client.

A message is **dissatisfied** when it has
- a complaint: "that's wrong", "doesn't work", "not what I asked", "why did you ...", "you
  broke / deleted / ignored ...", "I said ...", a leading "no," / "nope";
- a report of failure: "still fails / broken / the same error", "now it fails", a pasted
  traceback or `SomethingError:` line, "it crashes";
- a request to undo: "revert", "undo", "roll back", "put it back";
- or it asks again: its words overlap the previous user message's (Jaccard >= 0.6 over words of
  3+ letters), the sign of an answer that did not land.
A message that only thanks, approves or asks for something new is not. A complaint wins over
thanks ("thanks, but it still fails"); praise wins over nothing else.

Measured on tests/rl/test_followup.py's 48 hand-labelled follow-ups (22 dissatisfied), labelled
before the rules were run on them: precision 0.955 (21 of the 22 flagged), recall 0.955 (21 of
22). The miss is sarcasm without a keyword ("great, another red build"); the false alarm is a
leading "No" that starts a noun phrase ("No errors now, thanks."). Rules are cheap, deterministic and transparent; a learned classifier can
replace `judge` (any `fn(message, previous) -> Verdict`) once served conversations are labelled.
"""
from __future__ import annotations

import dataclasses
import re

_COMPLAINT = re.compile(
    r"^\s*(no|nope|nah)\b[\s,.!]|"
    r"\b(that'?s|this is|it'?s|that is|is)\s+(not right|wrong|incorrect|not what)|"
    r"\b(doesn'?t|does not|didn'?t|did not|won'?t|isn'?t|is not|don'?t|do not)\s+(work|compile|run|pass|fix|help|build)|"
    r"\bnot (working|what i (asked|wanted|meant|said))|"
    r"\bwhy (did|would) you\b|"
    r"\byou (broke|deleted|removed|ignored|forgot|missed|skipped|overwrote|changed the wrong)\b|"
    r"\b(i (said|asked|told you)|as i said)\b|"
    r"\bwrong (file|function|place|fix|answer)\b",
    re.IGNORECASE)
_FAILURE = re.compile(
    r"\bstill\s+(fails?|failing|broken|(the same|getting|get|see|seeing|throws|raises|crash\w*)|not|wrong|errors?)\b|"
    r"\b(now|it) (fails|crashes|breaks|errors|hangs)\b|"
    r"\bsame (error|problem|issue|failure|exception)\b|"
    r"\b(made it worse|broke (it|the|everything)|tests? (are |is )?(still )?(failing|red))\b|"
    r"Traceback \(most recent call last\)|^\s*\w*(Error|Exception):|\bcrash(es|ed)?\b",
    re.IGNORECASE | re.MULTILINE)
_UNDO = re.compile(r"\b(revert|undo|roll ?back|put it back|restore the (old|original))\b", re.IGNORECASE)
_WORD = re.compile(r"[a-z]{3,}")
REPEAT_JACCARD = 0.6


@dataclasses.dataclass(frozen=True)
class Verdict:
    dissatisfied: bool
    reason: str  # "complaint" | "failure" | "undo" | "asked again" | ""


def _words(text: str) -> set:
    return set(_WORD.findall(text.lower()))


def judge(message: str, previous: str | None = None) -> Verdict:
    """The verdict on a user's follow-up `message`; `previous`: the user message before the reply
    it follows (None when there was none), for "asked again"."""
    for reason, pattern in (("complaint", _COMPLAINT), ("failure", _FAILURE), ("undo", _UNDO)):
        if pattern.search(message or ""):
            return Verdict(True, reason)
    if previous:
        a, b = _words(message), _words(previous)
        if len(a) >= 3 and len(a & b) / len(a | b) >= REPEAT_JACCARD:
            return Verdict(True, "asked again")
    return Verdict(False, "")
