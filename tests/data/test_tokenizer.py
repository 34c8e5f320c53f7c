"""Tokenizer, chat template, bundled corpus (coder/data/tokenizer.py, pretrained_tokenizer.py,
corpus.py), and which tokenizer a stage uses (coder.train.checkpoint.stage_tokenizer: the
checkpoint's)."""
import json
import os
import pickle

import numpy as np
import pytest

from coder.data import chat_template, corpus
from coder.data import pretrained_tokenizer as pt
from coder.data import tokenizer as tk
from coder.train import checkpoint as ckpt_lib
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
    for i, token in enumerate(chat_template.SPECIAL_TOKENS):
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
    assert not set(plain) & {tok.special_id(t) for t in chat_template.SPECIAL_TOKENS}
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


def _corpus_file(path, limit_chars: int) -> str:
    """A JSONL corpus of `_small_corpus_texts(limit_chars)` at `path` (its path as a string)."""
    with open(path, "w") as f:
        for text in _small_corpus_texts(limit_chars):
            f.write(json.dumps({"text": text}) + "\n")
    return str(path)


def _corpus_config(tmp_path, limit_chars: int = 60_000):
    """The base config with data.sources = one such corpus and a 400-piece vocabulary."""
    cfg = base.get_config()
    cfg.data.sources = ({"path": _corpus_file(tmp_path / "d.jsonl", limit_chars)},)
    cfg.data.tokenizer_vocab_size = 400
    return cfg


def test_load_or_train_caches_by_corpus_and_vocab(tmp_path):
    cfg = _corpus_config(tmp_path)
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


def test_agent_text_makes_each_calls_fixed_text_one_token(tmp_path):
    """data.tokenizer_agent_text: the offered tools' call scaffolding (protocol.call_fragments)
    is one piece each, the text round-trips, and the option is part of the cache key."""
    from coder.env.protocol import render_tool_call
    from coder.env.transcripts import tokenizer_agent_text

    cfg = _corpus_config(tmp_path)
    cfg.rl.tools, cfg.sft.toy_tasks, cfg.sft.toy_edit_tool = ("write_file", "submit"), 4, "write_file"
    cache = tmp_path / "cache"
    plain = tk.load_or_train(cfg, str(cache), agent_text=tokenizer_agent_text)  # off: not called
    cfg.data.tokenizer_agent_text = True
    with pytest.raises(ValueError, match="needs its text"):  # data sits below env: the stage passes it
        tk.load_or_train(cfg, str(cache))
    agent = tk.load_or_train(cfg, str(cache), agent_text=tokenizer_agent_text)
    assert len(os.listdir(cache)) == 2 and "agent's format" in agent.source
    call = render_tool_call("write_file", {"path": "answer.py", "content": "def f():\n    return 3\n"})
    ids = agent.encode(call)
    assert agent.decode(ids) == call and len(ids) < len(plain.encode(call)) // 2
    pieces = [agent.id_to_piece(i).replace("\u2581", " ") for i in ids]
    assert pieces[:2] == ["<tool_call>", '{"name": "write_file", "arguments": {"path": "']
    assert '", "content": "' in pieces and pieces[-2:] == ['"}}', "</tool_call>"]
    submit = render_tool_call("submit", {})
    assert len(agent.encode(submit)) == 3


def test_concurrent_load_or_train_processes_agree(tmp_path):
    """Two processes racing to train the same cached tokenizer both succeed, with one file."""
    import subprocess
    import sys

    data = _corpus_file(tmp_path / "d.jsonl", 40_000)
    script = (
        "import sys, hashlib\n"
        "from configs import base\n"
        "from coder.data import tokenizer as tk\n"
        "cfg = base.get_config()\n"
        f"cfg.data.sources = ({{'path': {data!r}}},)\n"
        "cfg.data.tokenizer_vocab_size = 400\n"
        "print(hashlib.sha256(tk.load_or_train(cfg, sys.argv[1]).model_proto).hexdigest())\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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
    tasks = {os.path.join(corpus.stdlib_root(), p) for p in corpus.heldout_task_files()}
    assert tasks <= set(held) and 0 < len(tasks) < 0.06 * len(every)
    assert 0.02 < len(set(held) - tasks) / len(every) < 0.08
    assert corpus.stdlib_files("heldout", 0.05) == held
    assert all(p.endswith(".py") and "site-packages" not in p for p in every)
    doc = next(corpus.documents("heldout"))
    assert set(doc) == {"text", "path"} and not os.path.isabs(doc["path"])
    assert corpus.is_heldout(doc["path"], 0.05)


def test_heldout_tasks_are_not_in_the_pretraining_corpus():
    """No held-out stdlib bug-fix task (coder.env.sources.mutate) has its module or its hidden tests in
    the corpus's train split (what pretraining and the tokenizer read), whatever the fraction."""
    from coder.env.sources import mutate

    held = [m for m in mutate.candidate_modules() if mutate.split_of(m) == "heldout"]
    assert len(held) >= 10
    train_texts = {d["text"] for d in corpus.documents("train", 0.05)}
    for module in held:
        module_src, test_src = mutate.module_files(module)
        assert module_src not in train_texts, module
        assert test_src not in train_texts, module
    untouched = set(corpus.stdlib_files("train", 0.0))
    for module in held:
        for rel in (f"{module}.py", os.path.join("test", f"test_{module}.py")):
            assert os.path.join(corpus.stdlib_root(), rel) not in untouched
    # the training tasks' modules stay in the corpus (only held-out ones are removed)
    train_mods = [m for m in mutate.candidate_modules() if mutate.split_of(m) == "train"]
    assert all(os.path.join(corpus.stdlib_root(), f"{m}.py") in untouched for m in train_mods)


# --- the tokenizer of a stage ----------------------------------------------------------------
WORDS = ["def", "return", "self", "import", "class", "for", "in", "if", "else", "x", "y", "0", "1"]


def _word_texts(seed: int, n: int = 300) -> list[str]:
    rng = np.random.default_rng(seed)
    return ["\n".join(" ".join(rng.choice(WORDS, 8)) for _ in range(6)) for _ in range(n)]


def _checkpoint_with(directory, tokenizer) -> str:
    """A coder checkpoint directory (one tiny step) whose tokenizer item is `tokenizer`."""
    import jax.numpy as jnp

    ck = ckpt_lib.Checkpointer(str(directory), keep=1, async_save=False)
    ck.save(1, arrays={"model": {"w": jnp.zeros(2)}, "opt_state": {"count": jnp.zeros(())}},
            meta={"step": 1}, data_state=None, config={}, tokenizer=tk.to_record(tokenizer))
    ck.close()
    return str(directory)


@pytest.fixture(scope="module")
def three():
    """Three different tokenizers, quick to train."""
    return [tk.train_tokenizer(_word_texts(seed), 300 + 4 * seed) for seed in range(3)]


def test_record_round_trip_and_corruption(three):
    a = three[0]
    record = tk.to_record(a)
    assert record["kind"] == "sentencepiece" and set(record["files"]) == {"tokenizer.model"}
    assert json.loads(json.dumps(record)) == record
    back = tk.from_record(record)
    assert back.model_proto == a.model_proto and tk.fingerprint(back) == record["sha256"]
    assert tk.fingerprint(three[1]) != record["sha256"]
    with pytest.raises(ValueError, match="corrupt"):
        tk.from_record({**record, "sha256": tk.fingerprint(three[1])})
    with pytest.raises(ValueError, match="unknown tokenizer kind"):
        tk.from_record({**record, "kind": "nope"})


def test_stage_tokenizer_comes_from_the_checkpoint(three, tmp_path):
    a, b, c = three
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in _word_texts(7)))
    cfg = base.get_config()
    cfg.data.sources = ({"path": str(data)},)
    cfg.data.tokenizer_vocab_size = 300
    cache = str(tmp_path / "cache")
    scratch = ckpt_lib.stage_tokenizer(cfg, "", str(tmp_path / "pretrain"), cache_dir=cache)  # trains
    assert tk.load_or_train(cfg, cache).model_proto == scratch.model_proto  # what the cache gives
    assert len({tk.fingerprint(t) for t in (a, b, c, scratch)}) == 4

    init = _checkpoint_with(tmp_path / "pretrain" / "checkpoints", a)
    # a later stage: init_from's tokenizer, not the cache's
    assert ckpt_lib.stage_tokenizer(cfg, init, str(tmp_path / "mtp"), cache_dir=cache).model_proto == a.model_proto
    # a step directory works too
    assert ckpt_lib.stage_tokenizer(cfg, init + "/1", "", cache_dir=cache).model_proto == a.model_proto
    # a resume: the stage's own checkpoint wins over init_from
    _checkpoint_with(tmp_path / "mtp" / "checkpoints", c)
    assert ckpt_lib.stage_tokenizer(cfg, init, str(tmp_path / "mtp"), cache_dir=cache).model_proto == c.model_proto
    # data.tokenizer equal to the checkpoint's is fine
    a.save(str(tmp_path / "a.model"))
    cfg.data.tokenizer = str(tmp_path / "a.model")
    assert ckpt_lib.stage_tokenizer(cfg, init, str(tmp_path / "sft")).model_proto == a.model_proto
    # the model must hold the ids
    cfg.model.vocab_size = 128
    with pytest.raises(ValueError, match="model.vocab_size"):
        ckpt_lib.stage_tokenizer(cfg, init, str(tmp_path / "sft"))


def test_explicit_tokenizer_differing_from_the_checkpoints_is_an_error(three, tmp_path):
    a, b, _ = three
    init = _checkpoint_with(tmp_path / "pretrain" / "checkpoints", a)
    b_path = str(tmp_path / "b.model")
    b.save(b_path)
    cfg = base.get_config()
    cfg.data.tokenizer = b_path
    with pytest.raises(ValueError) as e:
        ckpt_lib.stage_tokenizer(cfg, init, str(tmp_path / "sft"))
    msg = str(e.value)
    for part in (b_path, tk.fingerprint(b)[:16], tk.fingerprint(a)[:16], init + "/1"):
        assert part in msg, (part, msg)


# --- pretrained tokenizers: Hugging Face `tokenizers`, tiktoken ------------------------------------
def _hf_tokenizer_dir(directory, specials=("<s>", "</s>", "<|user|>", "<|im_end|>")):
    """A small byte-level BPE (tokenizer.json) with some special tokens, + tokenizer_config.json."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=350, special_tokens=list(specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_word_texts(0) + [CODE] * 20, trainer)
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": {"content": "</s>"}}, f)
    return str(directory), tok.get_vocab_size(with_added_tokens=True)


def test_hf_tokenizers_kind_uses_the_base_tokens_and_adds_the_others(tmp_path):
    path, size = _hf_tokenizer_dir(tmp_path / "base")
    # `end` named as the base's <|im_end|>; `user` is in the base under coder's own string
    tok = pt.load_pretrained(path, {"end": "<|im_end|>"}, first_new_id=size + 5)
    assert tok.kind == "hf_tokenizers" and (tok.bos_id, tok.eos_id) == (0, 1)
    assert tok.special_id("user") == 2 and tok.end_id == 3
    added = tok.added_tokens
    assert "<|user|>" not in added and "<|end|>" not in added and len(added) == len(chat_template.SPECIAL_TOKENS) - 2
    assert sorted(added.values()) == list(range(size + 5, size + 5 + len(added)))  # after the rows
    assert tok.vocab_size == tok.padded_vocab_size == size + 5 + len(added)
    assert tok.decode(tok.encode(CODE)) == CODE
    # coder's strings and the configured one are single ids; decoding writes coder's
    ids = tok.encode('x<tool_call>{"a": 1}</tool_call><|im_end|><|end|>')
    assert ids.count(tok.special_id("<tool_call>")) == 1 and ids[-2:] == [3, 3]
    assert tok.decode(ids) == 'x<tool_call>{"a": 1}</tool_call><|end|><|end|>'
    plain = tok.encode("<|end|><|im_end|><tool_call>", allow_special=False)
    assert not set(plain) & set(tok._special.values()) and tok.decode(plain) == "<|end|><|im_end|><tool_call>"
    ids, mask = tok.render_conversation([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}])
    assert ids[0] == 2 and ids[-1] == 3 and mask.tolist() == [0.0] * (len(ids) - len(tok.encode("ok")) - 1) + [1.0] * (len(tok.encode("ok")) + 1)
    # the record and pickling rebuild exactly this tokenizer
    record = tk.to_record(tok)
    assert record["kind"] == "hf_tokenizers" and set(record["files"]) == {"tokenizer.json", pt.CHAT_FILE}
    back = tk.from_record(json.loads(json.dumps(record)))
    assert tk.fingerprint(back) == record["sha256"] and back.encode(CODE) == tok.encode(CODE)
    assert pickle.loads(pickle.dumps(tok)).encode(CODE) == tok.encode(CODE)
    # data.tokenizer may name the directory or its tokenizer.json
    assert tk.load(path).encode(CODE) == tk.load(os.path.join(path, "tokenizer.json")).encode(CODE)


def test_chat_tokens_errors(tmp_path):
    path, _ = _hf_tokenizer_dir(tmp_path / "base")
    with pytest.raises(ValueError, match="unknown names"):
        pt.load_pretrained(path, {"nope": "<x>"})
    with pytest.raises(ValueError, match="two template tokens to one id"):
        pt.load_pretrained(path, {"end": "</s>", "tool": "</s>"})
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        pt.load_pretrained(str(tmp_path))


def test_tiktoken_kind(tmp_path):
    pytest.importorskip("tiktoken")
    from tiktoken._educational import bpe_train

    pattern = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    ranks = bpe_train("\n".join(_word_texts(1, 40)) + CODE, 300, pattern, visualise=None)
    d = tmp_path / "kimi"
    d.mkdir()
    (d / "tiktoken.model").write_text("".join(f"{__import__('base64').b64encode(t).decode()} {r}\n"
                                              for t, r in sorted(ranks.items(), key=lambda kv: kv[1])))
    n = len(ranks)
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "[BOS]", "eos_token": "[EOS]",
        "added_tokens_decoder": {str(n): {"content": "[BOS]"}, str(n + 1): {"content": "[EOS]"},
                                 str(n + 3): {"content": "<|im_end|>"}}}))
    tok = pt.load_pretrained(str(d), {"end": "<|im_end|>"}, first_new_id=n + 8, pattern=pattern)
    assert tok.kind == "tiktoken" and (tok.bos_id, tok.eos_id, tok.end_id) == (n, n + 1, n + 3)
    assert tok.meta["special_tokens"][f"<|reserved_token_{n + 2}|>"] == n + 2  # gaps are named
    assert min(tok.added_tokens.values()) == n + 8 and tok.vocab_size == n + 8 + len(tok.added_tokens)
    assert tok.decode(tok.encode(CODE)) == CODE
    assert tok.encode("[EOS]") == [n + 1] and n + 1 not in tok.encode("[EOS]", allow_special=False)
    record = tk.to_record(tok)
    assert set(record["files"]) == {"tiktoken.model", pt.CHAT_FILE}
    assert tk.from_record(record).encode(CODE + "<tool_call>") == tok.encode(CODE + "<tool_call>")
    assert pickle.loads(pickle.dumps(tok)).encode(CODE) == tok.encode(CODE)
    # Kimi K2's pattern (the default) compiles in tiktoken
    assert pt.load_pretrained(str(d)).meta["pattern"] == pt.KIMI_K2_PATTERN


def test_stage_tokenizer_of_a_checkpoint_with_a_pretrained_tokenizer(tmp_path):
    path, size = _hf_tokenizer_dir(tmp_path / "base")
    tok = pt.load_pretrained(path, first_new_id=size)
    init = _checkpoint_with(tmp_path / "sft" / "checkpoints", tok)
    cfg = base.get_config()
    got = ckpt_lib.stage_tokenizer(cfg, init, str(tmp_path / "grpo"))
    assert got.kind == "hf_tokenizers" and tk.fingerprint(got) == tk.fingerprint(tok)
    cfg.model.vocab_size = tok.vocab_size - 1
    with pytest.raises(ValueError, match="model.vocab_size"):
        ckpt_lib.stage_tokenizer(cfg, init, str(tmp_path / "grpo"))
