"""SFT pipeline (coder/data/sft.py): template rendering, loss masks, whole-conversation packing."""
import json
import random

import numpy as np
import pytest

from coder.data import chat_template, sft
from coder.data import tokenizer as tk
from tests.data.sft_inputs import WORDS, config, conversation, segments, write

@pytest.fixture(scope="module")
def tok():
    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(200)) + "\n" for _ in range(200)]
    return tk.train_tokenizer(texts, vocab_size=300)




def test_conversations_packed_whole_with_template_masks(tok, tmp_path):
    convs = [conversation(i, n_turns=1 + i % 2) for i in range(30)]
    write(tmp_path / "c.jsonl", convs)
    it = sft.make_sft_iterator(config(seq_len=256), tok, str(tmp_path / "c.jsonl"), "all")
    batches = list(it)
    assert it.metrics()["data/truncated"] == 0
    segs = segments(batches)
    rendered = {tuple(tok.render_conversation(c["messages"])[0]): c for c in convs}
    assert len(segs) == 30
    for ids, mask, pos in segs:
        # Every segment is exactly one whole rendered conversation, with its template mask.
        _, want_mask = tok.render_conversation(rendered[tuple(ids)]["messages"])
        np.testing.assert_array_equal(mask, want_mask)
        np.testing.assert_array_equal(pos, np.arange(len(ids)))
        assert ids[0] == tok.special_id("system")
    assert {tuple(s[0]) for s in segs} == set(rendered)
    for b in batches:
        assert not b["loss_mask"][b["segment_ids"] == 0].any()
        assert b["tokens"].shape == (4, 256)
    # Loss on assistant text + <|end|> only: never on role tokens or other turns.
    ids, mask = np.concatenate([s[0] for s in segs]), np.concatenate([s[1] for s in segs])
    for role in chat_template.ROLES:
        assert not mask[ids == tok.special_id(role)].any()
    assert mask[ids == tok.special_id("<tool_call>")].all()
    assert not mask[ids == tok.special_id("<tool_result>")].any()
    assert it.metrics()["data/records_seen"] == 30


def test_long_conversations_truncated_or_dropped_and_counted(tok, tmp_path):
    long_conv = conversation(1, n_turns=8, words=30)
    late = {"messages": [{"role": "user", "content": "x " * 400}, {"role": "assistant", "content": "ok"}]}
    short = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}
    write(tmp_path / "c.jsonl", [short, long_conv, late])
    cfg = config(seq_len=96)
    assert len(tok.render_conversation(long_conv["messages"])[0]) > 96
    it = sft.make_sft_iterator(cfg, tok, str(tmp_path / "c.jsonl"), "all")
    segs = segments(list(it))
    assert len(segs) == 2 and max(len(s[0]) for s in segs) == 96
    full_ids, full_mask = tok.render_conversation(long_conv["messages"])
    (cut,) = [s for s in segs if len(s[0]) == 96]
    np.testing.assert_array_equal(cut[0], full_ids[:96])
    np.testing.assert_array_equal(cut[1], full_mask[:96])
    m = it.metrics()
    assert (m["data/truncated"], m["data/dropped"], m["data/records_bad"]) == (2, 1, 0)


def test_invalid_conversations_are_bad_records(tok, tmp_path):
    bad = [
        {"messages": "hello"},
        {"messages": []},
        {"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]},
        {"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "y"}]},
        {"messages": [{"role": "user", "content": "no answer"}]},
        {"text": "not a conversation"},
        b'{"messages": [',
    ]
    write(tmp_path / "c.jsonl", [conversation(i) for i in range(5)] + bad)
    cfg = config(max_bad_fraction=1.0)
    it = sft.make_sft_iterator(cfg, tok, [{"path": str(tmp_path / "c.jsonl"), "name": "t"}], "all")
    assert len(segments(list(it))) == 5
    c = it.counts()["t"]
    assert (c["invalid_conversation"], c["missing_field"], c["malformed_json"]) == (5, 1, 1)
    cfg = config(max_bad_fraction=0.1, bad_check_min_records=5)
    with pytest.raises(ValueError, match="'t'"):
        list(sft.make_sft_iterator(cfg, tok, [{"path": str(tmp_path / "c.jsonl"), "name": "t"}], "all"))


def test_sft_resume_is_exact(tok, tmp_path):
    write(tmp_path / "c.jsonl", [conversation(i, n_turns=1 + i % 3) for i in range(25)])
    cfg = config(seq_len=160, batch_size=2)
    ref_it = sft.make_sft_iterator(cfg, tok, str(tmp_path / "c.jsonl"))
    ref = [next(ref_it) for _ in range(10)]
    it = sft.make_sft_iterator(cfg, tok, str(tmp_path / "c.jsonl"))
    for _ in range(4):
        next(it)
    fresh = sft.make_sft_iterator(cfg, tok, str(tmp_path / "c.jsonl"))
    fresh.set_state(json.loads(json.dumps(it.get_state())))
    for want in ref[4:]:
        got = next(fresh)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])
    assert fresh.counts() == ref_it.counts()


# ------------------------------------------------ no batch possible: an error, never a hang


@pytest.fixture
def deadline():
    """Fail (SIGALRM) instead of hanging if the pipeline spins without a batch."""
    import signal

    def boom(*_):
        raise TimeoutError("the SFT iterator produced neither a batch nor an error in 120 s")

    old = signal.signal(signal.SIGALRM, boom)
    signal.alarm(120)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def test_every_conversation_too_long_is_an_error_naming_sft_seq_len(tok, tmp_path, deadline):
    convs = [conversation(i, n_turns=3, words=20) for i in range(12)]
    write(tmp_path / "c.jsonl", convs)
    lengths = [len(tok.render_conversation(c["messages"])[0]) for c in convs]
    cfg = config(seq_len=16, batch_size=2)
    # the endless training stream (shuffled, repeated) and a finite pass both stop with the error
    for split, epochs in (("train", -1), ("all", 1), ("all", 3)):
        it = sft.make_sft_iterator(cfg, tok, str(tmp_path / "c.jsonl"), split, num_epochs=epochs)
        with pytest.raises(sft.SftDataError) as e:
            next(it)
        msg = str(e.value)
        assert "sft.seq_len=16" in msg, msg
        assert "12 conversations were dropped as too long" in msg, msg
        assert f"the longest has {max(lengths)} tokens" in msg, msg
    # the smallest seq_len the message gives keeps at least one conversation
    need = int(msg.split("sft.seq_len >= ")[1].split()[0])
    it = sft.make_sft_iterator(config(seq_len=need, batch_size=2), tok, str(tmp_path / "c.jsonl"), "all")
    assert len(segments(list(it))) >= 1
    assert isinstance(e.value, ValueError)


def test_bad_records_alone_are_an_error_not_a_hang(tok, tmp_path, deadline):
    write(tmp_path / "c.jsonl", [{"messages": f"not a list {i}"} for i in range(3)] + [b"{oops"])
    cfg = config(max_bad_fraction=1.0)
    with pytest.raises(sft.SftDataError, match=r"cannot make a batch: 4 records were bad"):
        next(sft.make_sft_iterator(cfg, tok, str(tmp_path / "c.jsonl"), "train"))


def test_empty_split_is_an_error_naming_heldout_fraction(tok, tmp_path, deadline):
    write(tmp_path / "c.jsonl", [conversation(i) for i in range(3)])
    cfg = config(heldout_fraction=1.0)
    with pytest.raises(sft.SftDataError, match=r"no conversation in the 'train' split.*data\.heldout_fraction=1\.0"):
        sft.make_sft_iterator(cfg, tok, str(tmp_path / "c.jsonl"), "train")


def test_rare_fitting_conversations_still_make_batches(tok, tmp_path, deadline):
    """Most conversations too long, a few fit: batches come (the error needs a whole pass)."""
    long = [conversation(i, n_turns=3, words=20) for i in range(40)]
    short = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": f"ok {i}"}]}
             for i in range(2)]
    write(tmp_path / "c.jsonl", long[:20] + short[:1] + long[20:] + short[1:])
    cfg = config(seq_len=24, batch_size=2)
    it = sft.make_sft_iterator(cfg, tok, str(tmp_path / "c.jsonl"), "train")
    for _ in range(30):
        b = next(it)
        assert b["loss_mask"].any()
    assert it.metrics()["data/dropped"] > it.metrics()["data/records_seen"] // 2
