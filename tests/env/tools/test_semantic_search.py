"""semantic_search: chunks by definition, the per-snapshot embedding cache, an installed encoder
by import path (the policy encoder: tests/infer/test_embedding.py)."""

import pytest

from coder.env.tools import semantic_search as sem
from coder.env.tasks import Task
from tests.env.tools.search_inputs import FILES, WordEncoder

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
    assert all(c.context == "class Cache:" and "class Cache:" in sem.embed_text(c) for c in methods)
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


def test_cache_embeds_each_file_content_once_and_reloads_from_disk(tmp_path):
    spec = sem.SemanticSpec("tests.env.tools.search_inputs:make_word_encoder", cache_dir=str(tmp_path))
    assert isinstance(sem.encoder_of(spec), WordEncoder)  # an installed encoder, by import path
    with pytest.raises(ValueError, match="package.module:factory"):
        sem.SemanticSpec("wordllama")
    task = Task(id="t", prompt="", files=FILES, tests={})
    enc = WordEncoder()
    hits = sem.search(spec, task, FILES, "wait before retrying a failed request", k=2, encoder=enc)
    assert hits[0][1].path == "net/retry.py" and hits[0][0] > hits[1][0]
    assert len(enc.texts) == 4 + 1  # four one-definition files, then the query
    (table,) = list((tmp_path).rglob("*.npz"))
    # the agent edits one file: only it is embedded again
    edited = dict(FILES, **{"text/slug.py": FILES["text/slug.py"] + "\ndef unslug(s):\n    return s\n"})
    sem.search(spec, task, edited, "slug", encoder=enc)
    assert enc.texts[5:] == [sem.embed_text(c) for c in sem.chunk_definitions("text/slug.py", edited["text/slug.py"])] + ["slug"]
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
