"""Files of one definition each, whose docstrings a semantic search tells apart (the
semantic-search tool's tests and the embedding model's: tests/env/tools/test_semantic_search.py,
tests/infer/test_embedding.py), and a bag-of-words encoder to embed them with (no model to load;
by import path, `tests.env.tools.search_inputs:make_word_encoder`, for the pool and harness tests)."""
import hashlib
import threading

import numpy as np

FILES = {
    "net/retry.py": 'def backoff_delay(attempt):\n    """Seconds to wait before retrying a failed request."""\n'
                    "    return 2 ** attempt\n",
    "text/slug.py": 'def slugify(title):\n    """Lowercase a title and join its words with hyphens."""\n'
                    '    return "-".join(title.lower().split())\n',
    "db/pool.py": 'class ConnectionPool:\n    """Keeps open database connections for reuse."""\n',
    "img/resize.py": 'def thumbnail(image, size):\n    """Shrink an image to fit a square box."""\n',
}


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
