"""semantic_search: chunks by definition, the per-snapshot embedding cache, an installed encoder
by import path, and the policy encoder (a coder checkpoint's trunk) through the tool in a real
sandbox."""
import hashlib
import os
import threading

import numpy as np
import pytest

from coder.env import semantic_search as sem
from coder.env import tools
from coder.env.episode import Episode
from coder.env.protocol import ToolCall
from coder.env.tasks import Task

LONG_CLASS = "class Cache:\n    \"\"\"A cache.\"\"\"\n    size = 3\n\n" + "".join(
    f"    def get_{i}(self, key):\n" + "".join(f"        x{j} = key\n" for j in range(6)) + "        return key\n\n"
    for i in range(4))
SOURCE = f'''"""Module docstring."""
import os

LIMIT = 10


@decorator
def first(a):
    return a + 1


{LONG_CLASS}
class Small:
    def one(self):
        return 1


if __name__ == "__main__":
    first(LIMIT)
'''


def test_chunks_follow_definitions():
    chunks = sem.chunk_definitions("pkg/mod.py", SOURCE, max_lines=20)
    heads = [c.text.splitlines()[0] for c in chunks]
    assert heads == ['"""Module docstring."""', "@decorator", "class Cache:", "    def get_0(self, key):",
                     "    def get_1(self, key):", "    def get_2(self, key):", "    def get_3(self, key):",
                     "class Small:", 'if __name__ == "__main__":']
    methods = [c for c in chunks if c.text.lstrip().startswith("def get_")]
    assert all(c.context == "class Cache:" and "class Cache:" in c.embed_text() for c in methods)
    assert chunks[1].text == "@decorator\ndef first(a):\n    return a + 1"
    lines = SOURCE.splitlines()
    for c in chunks:  # a chunk is the file's own lines, numbered 1-based and inclusive
        assert c.text == "\n".join(lines[c.start - 1:c.end])
    # a definition longer than max_lines is cut into windows; non-Python and broken Python fall
    # back to BM25's line windows
    long_fn = "def f():\n" + "    x = 1\n" * 30
    assert [(c.start, c.end) for c in sem.chunk_definitions("a.py", long_fn, max_lines=20)] == [(1, 20), (21, 31)]
    assert sem.chunk_definitions("a.py", "def (:\n") == sem.search_lib.chunk_file("a.py", "def (:\n", 60)
    assert sem.chunk_definitions("README.md", "# title\ntext\n")[0].text == "# title\ntext"


class WordEncoder:
    """Hashed bag of words (deterministic): counts the texts it embeds."""

    name = "words-v1"

    def __init__(self):
        self.texts, self.lock = [], threading.Lock()

    def encode(self, texts):
        with self.lock:
            self.texts += texts
        out = np.zeros((len(texts), 64), np.float32)
        for i, t in enumerate(texts):
            for w in t.lower().replace("_", " ").split():
                out[i, int(hashlib.md5(w.strip(".,:()\"'").encode()).hexdigest(), 16) % 64] += 1
        return out


def make_word_encoder():
    return WordEncoder()


FILES = {
    "net/retry.py": 'def backoff_delay(attempt):\n    """Seconds to wait before retrying a failed request."""\n'
                    "    return 2 ** attempt\n",
    "text/slug.py": 'def slugify(title):\n    """Lowercase a title and join its words with hyphens."""\n'
                    '    return "-".join(title.lower().split())\n',
    "db/pool.py": 'class ConnectionPool:\n    """Keeps open database connections for reuse."""\n',
    "img/resize.py": 'def thumbnail(image, size):\n    """Shrink an image to fit a square box."""\n',
}


def test_cache_embeds_each_file_content_once_and_reloads_from_disk(tmp_path):
    spec = sem.SemanticSpec("tests.env.test_semantic_search:make_word_encoder", cache_dir=str(tmp_path))
    assert isinstance(sem.encoder_of(spec), WordEncoder)  # an installed encoder, by import path
    task = Task(id="t", prompt="", files=FILES, tests={})
    enc = WordEncoder()
    hits = sem.search(spec, task, FILES, "wait before retrying a failed request", k=2, encoder=enc)
    assert hits[0][1].path == "net/retry.py" and hits[0][0] > hits[1][0]
    assert len(enc.texts) == 4 + 1  # four one-definition files, then the query
    (table,) = list((tmp_path).rglob("*.npz"))
    # the agent edits one file: only it is embedded again
    edited = dict(FILES, **{"text/slug.py": FILES["text/slug.py"] + "\ndef unslug(s):\n    return s\n"})
    sem.search(spec, task, edited, "slug", encoder=enc)
    assert enc.texts[5:] == [c.embed_text() for c in sem.chunk_definitions("text/slug.py", edited["text/slug.py"])] + ["slug"]
    # another process (the table gone from memory) reads the snapshot's table from disk: no chunk
    # is embedded again, and the edit never reached the saved table
    sem._TABLES.clear()
    fresh = WordEncoder()
    again = sem.search(spec, task, FILES, "wait before retrying a failed request", k=2, encoder=fresh)
    assert fresh.texts == ["wait before retrying a failed request"]
    assert [(round(s, 5), c) for s, c in again] == [(round(s, 5), c) for s, c in hits]
    assert list(tmp_path.rglob("*.npz")) == [table]
    # a renamed file reuses its vectors and reports its new path
    moved = {("net/backoff.py" if p == "net/retry.py" else p): t for p, t in FILES.items()}
    assert sem.search(spec, task, moved, "retrying a failed request", k=1, encoder=fresh)[0][1].path == "net/backoff.py"
    assert len(fresh.texts) == 2


def test_spec_from_config_says_what_is_missing():
    from configs import base

    env = base.get_config().env
    with pytest.raises(ValueError, match="semantic_checkpoint"):
        sem.SemanticSpec.from_config(env)
    assert sem.SemanticSpec.from_config(env, "/ckpt").checkpoint == "/ckpt"
    env.semantic_encoder = "wordllama"
    with pytest.raises(ValueError, match="package.module:factory"):
        sem.SemanticSpec.from_config(env)
    env.semantic_encoder = ""
    assert sem.SemanticSpec.from_config(env) is None


@pytest.fixture(scope="module")
def policy_checkpoint(tmp_path_factory):
    """A coder checkpoint of tests/rl_toy.py's tiny model (its own tokenizer), as stages write."""
    from flax import nnx

    from coder.data import tokenizer as tokenizer_lib
    from coder.model import Transformer
    from coder.train import checkpoint as ckpt_lib
    from tests import rl_toy

    tok = rl_toy.tokenizer()
    cfg = rl_toy.tiny_config(tok, 128)
    model = Transformer(cfg.model, rngs=nnx.Rngs(0))
    path = str(tmp_path_factory.mktemp("policy") / "checkpoints")
    ck = ckpt_lib.Checkpointer(path, keep=1, async_save=False)
    ck.save(1, arrays={"model": ckpt_lib.state_to_flat(nnx.state(model)), "opt_state": {}}, meta={"step": 1},
            data_state=None, config=cfg.to_dict(), tokenizer=tokenizer_lib.to_record(tok))
    return path


def test_policy_encoder_finds_the_file_through_the_tool(policy_checkpoint, tmp_path):
    """The default encoder: the checkpoint's trunk, mean-pooled, through the tool in a sandbox
    (episode in this process: the encoder loads once per process, as in an env worker)."""
    spec = sem.SemanticSpec("policy", policy_checkpoint, cache_dir=str(tmp_path))
    enc = sem.encoder_of(spec)
    v = enc.encode(["def f():\n    return 1", "x" * 3000, "retry"])
    assert v.shape == (3, 64) and np.allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    assert np.allclose(enc.encode(["retry"]), v[2:], atol=1e-6)  # batch and padding do not change it
    task = Task(id="s", prompt="", files=FILES, tests={})
    ep = Episode(len, tools=("semantic_search", "search"), semantic=spec)
    ep.reset(task)
    try:
        # the model is untrained (its ranking quality is bench/search_recall.py's figure): the
        # known case is a query that is the definition's own text, which must come first
        query = FILES["net/retry.py"].replace("def ", "").strip()
        out = ep.call(ToolCall("semantic_search", {"query": query, "k": 2}, ""))
        assert out.split(":", 1)[0] == "net/retry.py", out
        assert "(score " in out and "def backoff_delay" in out
        assert len(list(tmp_path.rglob("*.npz"))) == 1
    finally:
        ep.close()
    off = Episode(len, tools=("semantic_search",))
    off.reset(task)
    try:
        assert "semantic search is off" in off.call(ToolCall("semantic_search", {"query": "x"}, ""))
    finally:
        off.close()
    assert "semantic_search" in tools.HOST_SIDE  # read from the host, with the terminal frozen
    assert os.path.isdir(policy_checkpoint)
