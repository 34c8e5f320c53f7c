"""Signals derived from a conversation's next request (coder.serve.derived_signals), without a
server: which completion and choice they name, and the evidence each rule needs."""
import hashlib
import json

from coder.serve.derived_signals import DerivedSignals, edit_verdicts

OLD = "def parse(s):\n    return s.split(',')\n"
NEW = "def parse(s):\n    return [x.strip() for x in s.split(',')]\n"


def _call(name, **args):
    return {"id": "call_1", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def _served(choices):
    d = DerivedSignals()
    d.remember("conv", "cmpl-1", choices)
    return d


HEAD = [{"role": "system", "content": "tools"}, {"role": "user", "content": "Make parse strip spaces."}]


def test_followup_names_the_choice_the_user_continued():
    d = _served([("I will edit it.", [_call("edit_file", path="p.py", old=OLD, new=NEW)]), ("Done.", [])])
    # the user continued choice 1 ("Done."), then complained
    msgs = HEAD + [{"role": "assistant", "content": "Done."}, {"role": "user", "content": "It still fails."}]
    assert d.observe("conv", msgs, {}) == [
        dict(completion_id="cmpl-1", choice=1, signal="dissatisfied_followup", value=1.0)]
    ok = HEAD + [{"role": "assistant", "content": "Done."}, {"role": "user", "content": "Thanks! Now add a test."}]
    assert d.observe("conv", ok, {})[0]["value"] == 0.0  # a calm follow-up is a signal too
    # the agent loop going on (tool results only) says nothing yet; an unknown reply or
    # conversation says nothing at all
    call = {"role": "assistant", "content": "I will edit it.", "tool_calls": [_call("edit_file", path="p.py", old=OLD, new=NEW)]}
    assert d.observe("conv", HEAD + [call, {"role": "tool", "content": "edited p.py at line 1"}], {}) == []
    assert d.observe("conv", HEAD + [{"role": "assistant", "content": "Something else."},
                                     {"role": "user", "content": "wrong"}], {}) == []
    assert d.observe("other", msgs, {}) == []
    assert d.observe("conv", HEAD, {}) == []


def test_asked_again_uses_the_user_message_before_the_reply():
    d = _served([("Done.", [])])
    msgs = HEAD + [{"role": "assistant", "content": "Done."}, {"role": "user", "content": "Make parse strip the spaces!"}]
    assert d.observe("conv", msgs, {})[0]["value"] == 1.0


def test_edit_kept_from_file_hashes_and_from_the_context():
    write = _call("write_file", path="p.py", content=NEW)
    d = _served([(None, [write])])
    reply = {"role": "assistant", "content": None, "tool_calls": [write]}
    result = {"role": "tool", "content": "wrote p.py"}
    sha = hashlib.sha256(NEW.encode()).hexdigest()
    # the client's hash of p.py now: the file as written (kept) or anything else (not kept)
    for workspace, value in (({"p.py": sha}, 1.0), ({"p.py": "0" * 64}, 0.0), (json.dumps({"p.py": sha}), 1.0)):
        assert d.observe("conv", HEAD + [reply, result], {"workspace": workspace}) == [
            dict(completion_id="cmpl-1", choice=0, signal="edit_kept", value=value)]
    assert d.observe("conv", HEAD + [reply, result], {}) == []  # no evidence, no signal
    # an edit's new lines in what the client sent next (an attached file): kept; its old lines
    # back without the new ones: reverted
    edit = [("edit_file", {"path": "p.py", "old": OLD, "new": NEW})]
    assert edit_verdicts(edit, "p.py now:\n" + NEW, {}) == [True]
    assert edit_verdicts(edit, "p.py now:\n" + OLD, {}) == [False]
    assert edit_verdicts(edit, "unrelated", {}) == []
    assert edit_verdicts([("submit", {"answer": "3"})], NEW, {}) == []  # not an edit
    # two edits, one kept: the fraction
    two = [("write_file", {"path": "a.py", "content": "A"}), ("write_file", {"path": "b.py", "content": "B"})]
    kept = edit_verdicts(two, "", {"a.py": hashlib.sha256(b"A").hexdigest(), "b.py": "x"})
    assert kept == [True, False]


def test_memory_is_bounded():
    d = DerivedSignals(max_conversations=2)
    for c in ("a", "b", "c"):
        d.remember(c, f"cmpl-{c}", [("Done.", [])])
    msgs = HEAD + [{"role": "assistant", "content": "Done."}, {"role": "user", "content": "wrong file"}]
    assert d.observe("a", msgs, {}) == [] and d.observe("c", msgs, {})[0]["completion_id"] == "cmpl-c"
