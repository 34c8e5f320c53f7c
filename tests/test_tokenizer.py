"""Tokenizer, chat template and bundled corpus (coder/data/tokenizer.py, corpus.py)."""
import json
import os
import pickle

import numpy as np
import pytest

from coder.data import corpus
from coder.data import tokenizer as tk
from configs import base

CODE = (
    "def f(x):\n"
    "    if x:\n"
    "\t\treturn 12345  # caf\u00e9 \U0001F600\n"
    "\n\n"
    "    return None   \r\n"
)


def _small_corpus_texts(limit_chars=150_000):
    docs = [d["text"] for d in corpus.documents("train")]
    return tk.sample_texts(docs[::7], limit_chars)


@pytest.fixture(scope="module")
def tok():
    return tk.train_tokenizer(_small_corpus_texts(), vocab_size=600)


def test_special_tokens_are_single_fixed_ids(tok):
    assert (tok.pad_id, tok.unk_id, tok.bos_id, tok.eos_id) == (0, 1, 2, 3)
    for i, token in enumerate(tk.SPECIAL_TOKENS):
        assert tok.encode(token) == [4 + i]
        assert tok.special_id(token) == 4 + i
        assert tok.decode([4 + i]) == token
    assert tok.special_id("assistant") == tok.special_id("<|assistant|>")
    # Atomic inside text, as coder.env.protocol writes tool calls.
    ids = tok.encode('x<tool_call>{"name": "shell"}</tool_call>y')
    assert ids.count(tok.special_id("<tool_call>")) == 1
    assert ids.count(tok.special_id("</tool_call>")) == 1
    with pytest.raises(KeyError):
        tok.special_id("<|nope|>")


def test_special_strings_can_be_encoded_as_plain_text(tok):
    text = 'print("<|end|>")  # </tool_call> <tool_call'
    plain = tok.encode(text, allow_special=False)
    assert not set(plain) & {tok.special_id(t) for t in tk.SPECIAL_TOKENS}
    assert tok.decode(plain) == text
    assert tok.end_id in tok.encode(text)
    assert tok.encode("no specials", allow_special=False) == tok.encode("no specials")


def test_code_round_trips_exactly(tok):
    # identity normalisation, no dummy prefix, whitespace kept, byte fallback for rare chars.
    for text in (CODE, "  leading", "trailing  \n", "\n", "a\u00a0b", "x" * 3000, "\x00\x01"):
        assert tok.decode(tok.encode(text)) == text
    assert tok.unk_id not in tok.encode(CODE + "\u4e2d\u6587")
    assert tok.vocab_size == 600 and tok.padded_vocab_size == 640


def test_digits_are_split(tok):
    pieces = [tok.id_to_piece(i) for i in tok.encode("x = 2048")]
    assert [p for p in pieces if any(c.isdigit() for c in p)] == ["2", "0", "4", "8"]


def test_render_is_concatenation_of_turns_and_equals_encoding_the_text(tok):
    messages = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Fix   the bug\n"},
        {"role": "assistant", "content": 'Look.<tool_call>{"name": "shell"}</tool_call>'},
        {"role": "tool", "content": "<tool_result>ok\n</tool_result>"},
        {"role": "assistant", "content": "Done.\n  "},
    ]
    ids, mask = tok.render_conversation(messages)
    turns = [tok.turn_ids(m["role"], m["content"]) for m in messages]
    assert ids.tolist() == sum(turns, [])
    assert ids.dtype == np.int32 and mask.dtype == np.float32 and ids.shape == mask.shape
    # Token-in / token-out: the ids equal a fresh encoding of the rendered text.
    text = "".join(f"<|{m['role']}|>{m['content']}<|end|>" for m in messages)
    assert ids.tolist() == tok.encode(text)
    assert tok.decode(ids) == text
    # An agent building the context turn by turn gets the same ids.
    agent = sum(turns[:4], []) + tok.generation_prefix()
    agent += tok.encode(messages[4]["content"]) + [tok.end_id]
    assert agent == ids.tolist()


def test_loss_mask_covers_assistant_text_and_end_only(tok):
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello there"},
        {"role": "tool", "content": "out"},
        {"role": "assistant", "content": "bye"},
    ]
    ids, mask = tok.render_conversation(messages)
    expected = []
    for m in messages:
        n_text = len(tok.encode(m["content"]))
        w = 1.0 if m["role"] == "assistant" else 0.0
        expected += [0.0] + [w] * n_text + [w]
    assert mask.tolist() == expected
    assistant = tok.special_id("assistant")
    assert all(mask[i] == 0 for i in np.flatnonzero(ids == assistant))
    assert all(mask[i] == 1 for i in np.flatnonzero(ids == tok.end_id)[[1, 3]])


def test_render_rejects_bad_messages(tok):
    with pytest.raises(ValueError):
        tok.render_conversation([{"role": "robot", "content": "x"}])
    with pytest.raises(ValueError):
        tok.render_conversation([{"role": "user"}])


def test_pickle_and_save_load(tok, tmp_path):
    again = pickle.loads(pickle.dumps(tok))
    assert again.encode(CODE) == tok.encode(CODE)
    path = str(tmp_path / "t.model")
    tok.save(path)
    assert tk.Tokenizer.load(path).encode(CODE) == tok.encode(CODE)
    assert os.listdir(tmp_path) == ["t.model"]


def test_load_rejects_a_model_without_the_special_layout(tmp_path):
    import io

    import sentencepiece as spm

    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=tk._chunks(_small_corpus_texts(30_000)), model_writer=proto, vocab_size=300,
        minloglevel=2,
    )
    with pytest.raises(ValueError, match="special-token layout"):
        tk.Tokenizer(proto.getvalue())


def test_load_or_train_caches_by_corpus_and_vocab(tmp_path):
    data = tmp_path / "d.jsonl"
    with open(data, "w") as f:
        for text in _small_corpus_texts(60_000):
            f.write(json.dumps({"text": text}) + "\n")
    cfg = base.get_config()
    cfg.data.sources = ({"path": str(data)},)
    cfg.data.tokenizer_vocab_size = 400
    cache = tmp_path / "cache"
    first = tk.load_or_train(cfg, str(cache))
    (cached,) = os.listdir(cache)
    second = tk.load_or_train(cfg, str(cache))
    assert second.model_proto == first.model_proto and os.listdir(cache) == [cached]
    cfg.data.tokenizer_vocab_size = 420
    assert tk.load_or_train(cfg, str(cache)).vocab_size == 420
    assert len(os.listdir(cache)) == 2
    cfg.data.tokenizer = str(cache / cached)
    assert tk.load_or_train(cfg, str(cache)).model_proto == first.model_proto


def test_concurrent_load_or_train_processes_agree(tmp_path):
    """Two processes racing to train the same cached tokenizer both succeed, with one file."""
    import subprocess
    import sys

    data = tmp_path / "d.jsonl"
    with open(data, "w") as f:
        for text in _small_corpus_texts(40_000):
            f.write(json.dumps({"text": text}) + "\n")
    script = (
        "import sys, hashlib\n"
        "from configs import base\n"
        "from coder.data import tokenizer as tk\n"
        "cfg = base.get_config()\n"
        f"cfg.data.sources = ({{'path': {str(data)!r}}},)\n"
        "cfg.data.tokenizer_vocab_size = 400\n"
        "print(hashlib.sha256(tk.load_or_train(cfg, sys.argv[1]).model_proto).hexdigest())\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root)
    procs = [
        subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "cache")], cwd=root, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-500:] for o in outs]
    assert outs[0][0] == outs[1][0]
    (name,) = os.listdir(tmp_path / "cache")
    assert name.endswith(".model")


def test_corpus_split_is_deterministic_disjoint_and_complete():
    train = corpus.stdlib_files("train", 0.05)
    held = corpus.stdlib_files("heldout", 0.05)
    every = corpus.stdlib_files("all")
    assert not set(train) & set(held)
    assert sorted(train + held) == sorted(every)
    assert 0.02 < len(held) / len(every) < 0.09
    assert corpus.stdlib_files("heldout", 0.05) == held
    assert all(p.endswith(".py") and "site-packages" not in p for p in every)
    doc = next(corpus.documents("heldout"))
    assert set(doc) == {"text", "path"} and not os.path.isabs(doc["path"])
    assert corpus.is_heldout(doc["path"], 0.05)
