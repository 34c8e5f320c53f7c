"""The dissatisfied follow-up rules (coder.rl.followup) on hand-labelled follow-ups: precision and
recall as measured, and each rule's reason."""
from coder.rl import followup

# (previous user message, follow-up, dissatisfied?) labelled by hand: would a developer who sent
# this follow-up have wanted the last reply to be different?
PREV = "Fix the date parsing in utils/dates.py so ISO strings with a Z suffix work."
LABELLED = [
    (PREV, "That's wrong, the timezone is dropped now.", True),
    (PREV, "It still fails with the same error.", True),
    (PREV, "Traceback (most recent call last):\n  File \"x.py\", line 3\nValueError: bad date", True),
    (PREV, "No, I meant the parser in api/, not utils.", True),
    (PREV, "Why did you delete the tests?", True),
    (PREV, "Please revert that change.", True),
    (PREV, "You broke the import in main.py", True),
    (PREV, "this doesn't work", True),
    (PREV, "Not what I asked for.", True),
    (PREV, "Fix the date parsing in utils/dates.py so ISO strings with the Z suffix work!", True),
    (PREV, "tests are still failing", True),
    (PREV, "Undo the last edit please", True),
    (PREV, "KeyError: 'tz' when I run it", True),
    (PREV, "I said don't touch the public API.", True),
    (PREV, "now it crashes on empty input", True),
    (PREV, "nope, same problem", True),
    (PREV, "You edited the wrong file.", True),
    (PREV, "that didn't fix anything", True),
    (PREV, "It's not working on Windows paths", True),
    (PREV, "roll back to the previous version", True),
    (PREV, "great, another red build", True),
    (PREV, "you ignored my instruction about logging", True),
    (PREV, "Thanks, that works!", False),
    (PREV, "Perfect. Now add a test for it.", False),
    (PREV, "Looks good to me.", False),
    (PREV, "Can you also handle the +05:30 offset format?", False),
    (PREV, "ok", False),
    (PREV, "Great, ship it.", False),
    (PREV, "Next: rename parse_date to parse_iso.", False),
    (PREV, "Nice. How would I make it faster?", False),
    (PREV, "Could you explain why the Z suffix needed special handling?", False),
    (PREV, "Now write the changelog entry.", False),
    (PREV, "All tests pass now, thanks", False),
    (PREV, "Let's move on to the CSV export.", False),
    (PREV, "Add type hints to that function too", False),
    (PREV, "lgtm", False),
    (PREV, "Now let's fix the failing case in the exporter module", False),
    (PREV, "Does this also work for dates before 1970?", False),
    (PREV, "Cool. Can you also update the README?", False),
    (PREV, "Works now. What about leap seconds?", False),
    (PREV, "Good catch on the off-by-one.", False),
    (PREV, "Please run the full test suite.", False),
    (PREV, "Also make the error message clearer when parsing fails.", False),
    (PREV, "thank you!", False),
    (PREV, "No errors now, thanks.", False),
    (PREV, "Now do the same for the time parsing.", False),
    (PREV, "Can you add a docstring?", False),
    (PREV, "Write a commit message for this.", False),
]


def _counts():
    tp = sum(followup.judge(m, p).dissatisfied and y for p, m, y in LABELLED)
    fp = sum(followup.judge(m, p).dissatisfied and not y for p, m, y in LABELLED)
    fn = sum(not followup.judge(m, p).dissatisfied and y for p, m, y in LABELLED)
    return tp, fp, fn


def test_precision_and_recall_on_the_labelled_followups():
    tp, fp, fn = _counts()
    assert len(LABELLED) == 48 and tp + fn == 22
    precision, recall = tp / (tp + fp), tp / (tp + fn)
    # the module docstring's figures: deterministic rules, so the counts are exact
    assert (tp, fp, fn) == (21, 1, 1), (tp, fp, fn, precision, recall)  # 0.955 and 0.955
    wrong = [m for p, m, y in LABELLED if followup.judge(m, p).dissatisfied != y]
    assert wrong == ["great, another red build", "No errors now, thanks."]


def test_reasons():
    assert followup.judge("It still fails").reason == "failure"
    assert followup.judge("why did you do that").reason == "complaint"
    assert followup.judge("please undo it").reason == "undo"
    assert followup.judge(PREV + " Please.", PREV).reason == "asked again"
    assert followup.judge(PREV + " Please.") == followup.Verdict(False, "")  # nothing to repeat
    assert followup.judge("thanks, but it still fails").dissatisfied  # a complaint wins over thanks
    assert not followup.judge("").dissatisfied
