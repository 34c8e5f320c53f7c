"""Held-out code kept out of training data (coder/data/decontaminate.py): the n-gram index, and
the pretraining and SFT pipelines dropping what overlaps it, counted."""
import os
import subprocess
import sys

import numpy as np
import pytest

from coder.data import decontaminate, pretrain, sft
from tests.data.repo_inputs import repo_config, write_repo
from tests.data.sft_inputs import config as sft_config
from tests.data.sft_inputs import conversation, segments, write
from tests.fakes import CharTokenizer

HELD_OUT = '''def harmonic_mean(values, weights=None):
    """The weighted harmonic mean of positive values; weights default to one each."""
    if weights is None:
        weights = [1.0] * len(values)
    if len(weights) != len(values):
        raise ValueError("values and weights differ in length")
    total = sum(weights)
    return total / sum(w / v for v, w in zip(values, weights))


def geometric_mean(values):
    """The geometric mean of positive values, computed in log space to avoid overflow."""
    import math
    return math.exp(sum(math.log(v) for v in values) / len(values))
'''
UNRELATED = '''def parse_header(line):
    """Split an HTTP header line into its name and value, both stripped."""
    name, _, value = line.partition(":")
    return name.strip().lower(), value.strip()


if __name__ == "__main__":
    print(parse_header("Content-Type: text/plain"))
'''


def _tokenizer():
    import random

    from coder.data import tokenizer as tk
    from tests.data.sft_inputs import WORDS

    rng = random.Random(0)
    return tk.train_tokenizer([" ".join(rng.choice(WORDS) for _ in range(200)) for _ in range(200)]
                              + [HELD_OUT, UNRELATED] * 5, vocab_size=400)


@pytest.fixture(scope="module")
def index():
    return decontaminate.NgramIndex.from_texts([HELD_OUT])


def test_a_copied_function_matches_and_unrelated_code_does_not(index):
    copied = UNRELATED + "\n\n" + HELD_OUT.split("\n\n\n")[0] + "\n"  # one held-out function among other code
    assert index.matches(copied) >= index.min_matches and index.contaminated(copied)
    assert index.matches(UNRELATED) == 0 and not index.contaminated(UNRELATED)
    # a shared idiom or a line of it is far below the threshold
    assert not index.contaminated(UNRELATED + "\n    total = sum(weights)\n")
    two_lines = " ".join(HELD_OUT.split()[:20])  # 20 words: 8 of the index's 13-word runs
    assert index.matches(two_lines) == 8 and not index.contaminated(two_lines)
    # fewer words than one n-gram: nothing to match
    assert decontaminate.ngram_hashes("a b c").size == 0 and index.matches("return total") == 0
    # whitespace does not hide a copy (words are compared), reformatting the indentation included
    assert index.contaminated(" ".join(HELD_OUT.split()))


def test_hashes_are_the_same_in_every_process():
    """grain's worker processes check documents against an index built in the parent: the hash
    must not depend on the interpreter's per-process string hash seed."""
    code = ("from coder.data import decontaminate; import sys; "
            "print(int(decontaminate.ngram_hashes(sys.stdin.read())[-1]))")
    runs = {subprocess.run([sys.executable, "-c", code], input=HELD_OUT, capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}
    assert runs == {f"{int(decontaminate.ngram_hashes(HELD_OUT)[-1])}\n"}


def test_bad_settings_are_errors():
    with pytest.raises(ValueError, match="min_matches=0 must be >= 1"):
        decontaminate.NgramIndex(np.zeros(0, np.uint64), min_matches=0)


def test_pretraining_leaves_out_the_repository_holding_held_out_code(tmp_path, index):
    write_repo(tmp_path / "repos" / "vendoring", {"stats.py": HELD_OUT, "app.py": UNRELATED})
    write_repo(tmp_path / "repos" / "clean", {"app.py": UNRELATED, "more.py": UNRELATED.replace("parse", "split")})
    cfg = repo_config(tmp_path, seq_len=64, max_position=64, repos=(str(tmp_path / "repos" / "*"),), repo_weight=1.0,
                      sources=({"path": str(tmp_path / "repos" / "clean" / "app.py"), "name": "short"},))
    marker = np.asarray(CharTokenizer().encode("harmonic_mean"))

    def texts(exclude):
        it = pretrain.make_pretrain_iterator(cfg, CharTokenizer(), "train", exclude=exclude)
        rows = [row for _ in range(30) for row in next(it)["tokens"]]
        stream = np.concatenate(rows)
        windows = np.lib.stride_tricks.sliding_window_view(stream, len(marker))
        return int((windows == marker).all(1).sum()), it.metrics()

    seen, metrics = texts(None)
    assert seen > 0 and metrics["data/heldout_dropped"] == 0  # without the index the copy is trained on
    seen, metrics = texts(index)
    assert seen == 0 and metrics["data/heldout_dropped"] > 0
    assert metrics["data/records_bad"] == 0  # dropped as held out, not as bad data
    # the counters are in the iterator's state: a resumed run continues them
    it = pretrain.make_pretrain_iterator(cfg, CharTokenizer(), "train", exclude=index)
    for _ in range(10):
        next(it)
    again = pretrain.make_pretrain_iterator(cfg, CharTokenizer(), "train", exclude=index)
    again.set_state(it.get_state())
    assert again.metrics()["data/heldout_dropped"] == it.metrics()["data/heldout_dropped"] > 0


def test_an_old_state_without_the_heldout_column_restores(tmp_path):
    write(tmp_path / "c.jsonl", [{"text": f"document {i}"} for i in range(20)])
    cfg = repo_config(tmp_path, seq_len=32, max_position=32, sources=({"path": str(tmp_path / "c.jsonl")},))
    it = pretrain.make_pretrain_iterator(cfg, CharTokenizer(), "train")
    next(it)
    state = it.get_state()
    state["counts"] = [row[:-1] for row in state["counts"]]  # saved before the column existed
    again = pretrain.make_pretrain_iterator(cfg, CharTokenizer(), "train")
    again.set_state(state)
    assert again.metrics()["data/records_seen"] == it.metrics()["data/records_seen"]
    assert again.metrics()["data/heldout_dropped"] == 0


def test_sft_leaves_out_a_transcript_that_read_held_out_code(tmp_path, index):
    tok = _tokenizer()
    leaky = conversation(99)
    leaky["messages"][3]["content"] = "<tool_result>" + HELD_OUT + "</tool_result>"  # the agent cat'ed a file
    write(tmp_path / "c.jsonl", [conversation(i) for i in range(6)] + [leaky])
    cfg = sft_config(seq_len=1024, batch_size=2)
    it = sft.make_sft_iterator(cfg, tok, str(tmp_path / "c.jsonl"), "all", exclude=index)
    kept = segments(list(it))
    assert len(kept) == 6 and it.metrics()["data/heldout_dropped"] == 1
    assert all("harmonic_mean" not in tok.decode(t.tolist()) for t, _, _ in kept)


def test_sft_with_only_held_out_transcripts_is_an_error_naming_the_key(tmp_path, index):
    tok = _tokenizer()
    leaky = [conversation(i) for i in range(3)]
    for c in leaky:
        c["messages"][3]["content"] = HELD_OUT
    write(tmp_path / "c.jsonl", leaky)
    with pytest.raises(sft.SftDataError, match=r"3 conversations overlap the held-out tasks' code \(data.exclude_tasks"):
        next(sft.make_sft_iterator(sft_config(seq_len=1024, batch_size=2), tok, str(tmp_path / "c.jsonl"), "train",
                                   exclude=index))
